"""lmc on vs off in the reference engine on a real model (SmolLM2-135M-Instruct, fp32): a
document-QA chat and its follow-up turn give the same answers, token for token, with lmc off,
cold, warm from L1 (the follow-up reusing the first turn's prefix), and after a restart that
reads the KV back from the disk tier. The answers are the model's real text (measured: "The
railway line closed in 1965.", the year the bundled text gives)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lmc.models.texts import bundled_text
from lmc.reference import LLM, RequestOutput
from tests.deadlines import HANG_S
from tests.real_model import real_model_dir

ENGINE = {"max_model_len": 2048, "num_blocks": 160, "block_size": 16}
FIRST = [{"role": "system", "content": "Answer from this document:\n\n" + bundled_text()},
         {"role": "user", "content": "In which year did the railway line close?"}]
# logits of the same prompt computed cold and from cached KV sum attention in another order
LOGIT_ATOL = 2e-4  # 2.6e-5 measured (logits up to ~37)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return real_model_dir("fp32")


def follow_up(first_answer: str) -> list[dict[str, str]]:
    return FIRST + [{"role": "assistant", "content": first_answer},
                    {"role": "user", "content": "What colour is the band on the lighthouse?"}]


def answer(llm: LLM, conversation: list[dict[str, str]]) -> RequestOutput:
    return llm.chat(conversation, max_tokens=20, return_logits=True)[0]


def lmc_config(disk: Path) -> dict[str, Any]:
    return {"chunk_size": 256, "local_cpu_size": "128MiB", "local_disk": str(disk),
            "local_disk_size": "256MiB", "load_policy": "load_all",
            "lookup_min_wait": HANG_S}  # the disk always heard, however loaded the host


def assert_same(got: RequestOutput, want: RequestOutput) -> None:
    assert got.token_ids == want.token_ids, (got.text, want.text)
    assert got.text == want.text
    torch.testing.assert_close(got.logits, want.logits, atol=LOGIT_ATOL, rtol=1e-4)


@pytest.fixture(scope="module")
def lmc_off(model_dir: Path) -> tuple[RequestOutput, RequestOutput]:
    with LLM(model_dir, **ENGINE) as llm:
        first = answer(llm, FIRST)
        return first, answer(llm, follow_up(first.text))


def test_answers_are_the_models(lmc_off) -> None:
    first, second = lmc_off
    assert first.text == "The railway line closed in 1965." and first.finish_reason == "stop"
    assert len(first.prompt_token_ids) > 600 and len(second.prompt_token_ids) > 700
    assert second.text  # whatever a 135M model says of the band, lmc must not change it


def test_cold_warm_and_restarted_equal_lmc_off(model_dir: Path, lmc_off, tmp_path: Path
                                               ) -> None:
    want_first, want_second = lmc_off
    conversation = follow_up(want_first.text)
    with LLM(model_dir, lmc_config=lmc_config(tmp_path / "disk"), **ENGINE) as llm:
        cold = answer(llm, FIRST)
        assert cold.num_cached_tokens == 0
        assert_same(cold, want_first)
        warm = answer(llm, FIRST)
        first_len = len(warm.prompt_token_ids)
        assert warm.num_cached_tokens == first_len - 1  # all but the token it computes
        assert_same(warm, want_first)
        turn = answer(llm, conversation)  # the first turn's prompt is this one's prefix
        assert turn.num_cached_tokens >= first_len // 256 * 256 > 0
        assert_same(turn, want_second)
        assert llm.kv_connector is not None
        from_cpu = llm.kv_connector.stats()["worker.tokens_from_cpu"]
        assert from_cpu == warm.num_cached_tokens + turn.num_cached_tokens
    with LLM(model_dir, lmc_config=lmc_config(tmp_path / "disk"), **ENGINE) as llm:
        restarted = answer(llm, conversation)  # a new, empty L1: the KV comes from disk
        assert restarted.num_cached_tokens == len(restarted.prompt_token_ids) - 1
        assert_same(restarted, want_second)
        assert llm.kv_connector is not None
        assert llm.kv_connector.stats()["worker.tokens_from_disk"] > 0
