"""The reference engine on a real trained model (SmolLM2-135M-Instruct, ``lmc model get``)
against a forward written here, straight from the GGUF file the checkpoint is converted from:
``gguf`` dequantizes the weights, this file restores the q/k row order and runs the Llama math
in plain torch. Nothing of lmc's converter or engine is used by that forward, so a fault in
either (names, row order, RoPE, GQA, tied head, norms) shows as a difference.

Measured here (one thread, fp32): the forward and the engine agree to 5e-5 on logits of
magnitude ~37; perplexity of the bundled text is 15.7, and 209 when the rows are left in
GGUF's order (the model then answers nonsense). bf16 against fp32: max logit difference 0.6,
top-1 agreement 98%.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lmc.models.texts import bundled_text
from lmc.reference import LLM
from lmc.reference.tokenizer import Tokenizer
from tests.real_model import real_model_dir, real_model_gguf
from tests.reference.test_ref_model import paged_logits

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One torch thread, as the engine runs on a shared 2-core machine (two were slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ------------------------------------------------------------------ the independent forward
def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Hyper-parameters and float32 weights, by GGUF name, from the file itself."""
    import gguf

    reader = gguf.GGUFReader(str(path))

    def field(key: str) -> Any:
        return reader.fields[key].contents()

    hp = {"layers": field("llama.block_count"), "heads": field("llama.attention.head_count"),
          "kv_heads": field("llama.attention.head_count_kv"),
          "eps": field("llama.attention.layer_norm_rms_epsilon"),
          "theta": field("llama.rope.freq_base")}
    weights = {t.name: torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type),
                                                 dtype=np.float32))
               for t in reader.tensors}
    return hp, weights


def rows_restored(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """GGUF interleaves each head's rotary pairs (rows 2i, 2i+1); HF rotates halves (rows
    i, i + d/2). Per head: the stored pair index becomes the half index."""
    out, inp = weight.shape
    d = out // heads
    return weight.view(heads, d // 2, 2, inp).permute(0, 2, 1, 3).reshape(out, inp)


def gguf_forward(hp: dict[str, Any], w: dict[str, torch.Tensor], ids: list[int],
                 restore: bool = True, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Logits ``[len(ids), vocab]`` (fp32) of a Llama with tied embeddings, full causal
    attention over one sequence; matmuls in ``dtype``, norms and softmax in fp32."""
    t, heads, kv = len(ids), hp["heads"], hp["kv_heads"]
    emb = w["token_embd.weight"].to(dtype)
    x = emb[torch.tensor(ids)]
    d = x.shape[1] // heads
    inv = 1.0 / hp["theta"] ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angle = torch.arange(t, dtype=torch.float32)[:, None] * inv[None, :]
    cos = torch.cat([angle.cos(), angle.cos()], -1).to(dtype)
    sin = torch.cat([angle.sin(), angle.sin()], -1).to(dtype)
    causal = torch.full((t, t), float("-inf")).triu(1)

    def norm(v: torch.Tensor, gain: str) -> torch.Tensor:
        f = v.float()
        return w[gain].to(dtype) * (f / torch.sqrt(f.pow(2).mean(-1, keepdim=True) + hp["eps"])
                                    ).to(dtype)

    def rope(v: torch.Tensor) -> torch.Tensor:  # [heads, t, d]
        return v * cos + torch.cat([-v[..., d // 2:], v[..., :d // 2]], -1) * sin

    def lin(v: torch.Tensor, name: str, restore_heads: int = 0) -> torch.Tensor:
        weight = w[name]
        if restore_heads:
            weight = rows_restored(weight, restore_heads)
        return v @ weight.to(dtype).T

    for i in range(hp["layers"]):
        p = f"blk.{i}."
        h = norm(x, p + "attn_norm.weight")
        q = lin(h, p + "attn_q.weight", heads if restore else 0).view(t, heads, d).transpose(0, 1)
        k = lin(h, p + "attn_k.weight", kv if restore else 0).view(t, kv, d).transpose(0, 1)
        v = lin(h, p + "attn_v.weight").view(t, kv, d).transpose(0, 1)
        q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
        scores = q.float() @ k.float().transpose(1, 2) / math.sqrt(d) + causal
        att = (torch.softmax(scores, -1) @ v.float()).to(dtype)
        x = x + lin(att.transpose(0, 1).reshape(t, heads * d), p + "attn_output.weight")
        h = norm(x, p + "ffn_norm.weight")
        x = x + lin(torch.nn.functional.silu(lin(h, p + "ffn_gate.weight"))
                    * lin(h, p + "ffn_up.weight"), p + "ffn_down.weight")
    return (norm(x, "output_norm.weight") @ emb.T).float()


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    logp = torch.log_softmax(logits[:-1].float(), -1)
    return math.exp(-logp.gather(1, torch.tensor(ids[1:])[:, None]).mean().item())


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def model_dir() -> Path:
    return real_model_dir("fp32")


@pytest.fixture(scope="module")
def gguf_model() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    return read_gguf(real_model_gguf())


@pytest.fixture(scope="module")
def text_ids(model_dir: Path) -> list[int]:
    ids = Tokenizer(model_dir / "tokenizer.json").encode(bundled_text("harbour"))
    assert len(ids) == 667
    return ids


@pytest.fixture(scope="module")
def reference_logits(gguf_model, text_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return gguf_forward(*gguf_model, text_ids)


# ------------------------------------------------------------------------------- tests
def test_fp32_logits_match_the_gguf_forward(model_dir: Path, text_ids: list[int],
                                            reference_logits: torch.Tensor) -> None:
    # two chunks: the second attends over the first's paged KV
    (got,) = paged_logits(model_dir, [text_ids], [[300], [367]])
    torch.testing.assert_close(got, reference_logits, rtol=1e-4, atol=1e-3)


def test_perplexity_tells_a_correct_port_from_a_broken_rope(
        model_dir: Path, gguf_model, text_ids: list[int], reference_logits: torch.Tensor) -> None:
    (got,) = paged_logits(model_dir, [text_ids], [[667]])
    ppl = perplexity(got, text_ids)
    assert 10.0 < ppl < 25.0, ppl  # 15.7 measured
    assert ppl == pytest.approx(perplexity(reference_logits, text_ids), rel=1e-4)
    with torch.no_grad():
        broken = perplexity(gguf_forward(*gguf_model, text_ids, restore=False), text_ids)
    assert broken > 100.0, broken  # 209 measured: rows left in GGUF's order


def test_bf16_is_close_to_fp32(model_dir: Path, text_ids: list[int],
                               reference_logits: torch.Tensor) -> None:
    """bf16 matmuls are slow on CPUs without AVX-512 (the fp32 forward's cost x8 here), so
    128 tokens; the fp32 checkpoint loaded as bf16 is the bf16 checkpoint (test_get)."""
    ids, ref = text_ids[:128], reference_logits[:128]
    (got,) = paged_logits(model_dir, [ids], [[64], [64]], dtype=torch.bfloat16)
    assert torch.isfinite(got).all()
    assert (got - ref).abs().max() < 1.5  # 0.59 measured, logits up to ~37
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9  # 0.98 measured
    assert perplexity(got, ids) == pytest.approx(perplexity(ref, ids), rel=0.05)


def test_chat_answer_matches_the_gguf_forward(model_dir: Path, gguf_model) -> None:
    """``LLM.chat`` renders the checkpoint's template and stops at the end of the turn; the
    answer is the independent forward's greedy tokens."""
    with LLM(model_dir, max_model_len=2048) as llm:
        out = llm.chat(QUESTION, max_tokens=24)[0]
        prompt = llm.encode_chat(QUESTION)
        again = llm.chat([QUESTION, QUESTION + [
            {"role": "assistant", "content": out.text},
            {"role": "user", "content": "And of Germany?"}]], max_tokens=24)
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop" and out.token_ids[-1] == 2  # <|im_end|> ends the turn
    assert out.prompt_token_ids == prompt and prompt[:2] == [1, 9690]  # <|im_start|>system
    assert again[0].token_ids == out.token_ids
    assert again[1].text == "The capital of Germany is Berlin."
    ids = list(prompt)
    with torch.no_grad():
        for _ in out.token_ids:
            ids.append(int(gguf_forward(*gguf_model, ids)[-1].argmax()))
    assert ids[len(prompt):] == out.token_ids
