"""lmc's vLLM connector on a real model: SmolLM2-135M-Instruct (the checkpoint ``lmc model
get`` converts) in vLLM 0.32 (CPU, float32, greedy), with the connector and without it, must
give the same answers: a question over a ~1.4k-token document (cold, warm from L1, and read
back from disk by a second, multi-process vLLM) and a three-turn chat played turn by turn.

vLLM renders the conversations with the checkpoint's chat template through transformers; the
prompt ids must equal lmc's own rendering (``lmc.models.chat`` + the converted tokenizer), so
the checkpoint reads the same in both engines. ``LMC_VLLM_PYTHON`` names the venv's python;
without vLLM these tests skip, except under ``CI=true``, where they fail.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lmc.models import ChatTemplate
from lmc.models.texts import bundled_text
from lmc.reference.tokenizer import Tokenizer
from tests.connectors.vllm.test_vllm_integration import SCRIPTS, _env, _run, _vllm_python
from tests.real_model import real_model_dir

pytestmark = pytest.mark.integration

DOCUMENT = bundled_text("harbour") + "\n\n" + bundled_text("workshop")
CONVERSATIONS = {
    "doc": [{"role": "system", "content": "Answer from these documents:\n\n" + DOCUMENT},
            {"role": "user", "content": "In which year did the railway line close?"}],
    "system": "You are a helpful assistant. Here is a story to talk about:\n\n"
              + bundled_text("workshop"),
    "chat": ["Who founded the bicycle workshop?",
             "What did she teach on Thursday evenings?",
             "What happened in 1998?"],
}


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-real")


@pytest.fixture(scope="module")
def runs(work: Path) -> dict[str, Any]:
    """Both vLLM processes, one after the other (the second reads the first's disk)."""
    py = _vllm_python()
    model = real_model_dir("fp32")
    conv = work / "conversations.json"
    conv.write_text(json.dumps(CONVERSATIONS))
    out: dict[str, Any] = {"model": model}
    for mode, env in (("mp0", _env(VLLM_ENABLE_V1_MULTIPROCESSING="0")), ("mp1", _env())):
        result, log = work / f"{mode}.json", work / f"{mode}.log"
        _run([py, str(SCRIPTS / "real_model.py"), "--mode", mode, "--model", str(model),
              "--conversations", str(conv), "--disk", str(work / "disk"), "--out",
              str(result)], log, env)
        out[mode] = json.loads(result.read_text())
    return out


def _same(got: dict[str, Any], want: dict[str, Any], name: str) -> None:
    assert got["tokens"] == want["tokens"], (name, got["text"], want["text"])
    assert got["text"] == want["text"] and got["finish"] == want["finish"]


def test_vllm_reads_the_checkpoint_as_lmc_does(runs: dict[str, Any]) -> None:
    plain = runs["mp0"]["plain"]
    template = ChatTemplate.from_model_dir(runs["model"])
    tokenizer = Tokenizer(runs["model"] / "tokenizer.json")
    assert template is not None
    ours = tokenizer.encode(template.render(CONVERSATIONS["doc"]), add_special_tokens=False)
    assert plain["doc"]["prompt_ids"] == ours and 1300 < len(ours) < 1500
    assert plain["doc"]["text"] == "The railway line closed in 1965."  # as the reference engine
    assert plain["doc"]["finish"] == "stop"  # at <|im_end|>
    assert all(got["text"].strip() for got in plain.values())  # the chat's: cut at 24 tokens


def test_lmc_gives_vllm_s_answers_single_process(runs: dict[str, Any]) -> None:
    plain, lmc = runs["mp0"]["plain"], runs["mp0"]["lmc"]
    _same(lmc["cold_doc"], plain["doc"], "cold_doc")
    _same(lmc["warm_doc"], plain["doc"], "warm_doc")
    assert lmc["cold_doc"]["cached"] == 0
    doc_len = len(plain["doc"]["prompt_ids"])
    assert lmc["warm_doc"]["cached"] >= doc_len // 256 * 256  # from lmc's L1
    for i in range(len(CONVERSATIONS["chat"])):
        _same(lmc[f"lmc_chat{i}"], plain[f"chat{i}"], f"chat{i}")
    # each turn extends the previous prompt: the second and third load its chunks
    assert lmc["lmc_chat1"]["cached"] > 0 and lmc["lmc_chat2"]["cached"] > 0


def test_lmc_gives_vllm_s_answers_multi_process_from_disk(runs: dict[str, Any]) -> None:
    plain, disk = runs["mp0"]["plain"], runs["mp1"]["lmc"]
    _same(disk["disk_doc"], plain["doc"], "doc")
    assert disk["disk_doc"]["cached"] >= len(plain["doc"]["prompt_ids"]) // 256 * 256
    for i in range(len(CONVERSATIONS["chat"])):
        _same(disk[f"disk_chat{i}"], plain[f"chat{i}"], f"chat{i}")
        assert disk[f"disk_chat{i}"]["cached"] > 0
