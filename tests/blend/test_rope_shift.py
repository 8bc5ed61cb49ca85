"""A cached K rotated by the position difference equals K computed at the new position."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmc.blend.rope_shift import BlendUnsupported, KeyShifter, check_placeable, check_rope
from lmc.reference.loader import load_model
from lmc.reference.model_config import ModelConfig, RopeConfig


def _layer0_keys(model: torch.nn.Module, tokens: torch.Tensor, positions: torch.Tensor
                 ) -> torch.Tensor:
    """Layer 0's K for ``tokens`` at ``positions``, as the engine computes it."""
    layer = model.model.layers[0]
    x = model.model.embed_tokens(tokens)
    attn = layer.self_attn
    k = attn.k_proj(layer.input_layernorm(x)).view(len(tokens), attn.num_kv_heads, attn.head_dim)
    cos, sin = model.rotary.cos_sin(positions, x.dtype)
    return model.rotary.rotate(k, cos, sin)


@pytest.mark.parametrize("offset", [1, 37, 1000])
@torch.no_grad()
def test_shifted_k_equals_k_at_the_new_position(model_dir: Path, offset: int) -> None:
    model = load_model(model_dir, "float32", torch.device("cpu"))
    tokens = torch.randint(0, model.config.vocab_size, (40,), generator=torch.Generator()
                           .manual_seed(offset))
    canonical = _layer0_keys(model, tokens, torch.arange(40))
    placed = KeyShifter(model.config).shift(canonical, offset)
    direct = _layer0_keys(model, tokens, torch.arange(offset, offset + 40))
    # fp32 angles at position p carry ~p * 2**-24 rad of rounding, in the direct K too
    torch.testing.assert_close(placed, direct, rtol=1e-5, atol=2e-5 + (offset + 40) * 2.4e-7)
    # and the unshifted keys are wrong at the new position (the test can fail)
    assert not torch.allclose(canonical, direct, atol=1e-3)


@torch.no_grad()
def test_per_token_shifts_and_bfloat16(llama3_dir: Path) -> None:
    model = load_model(llama3_dir, "bfloat16", torch.device("cpu"))
    tokens = torch.arange(3, 27)
    canonical = _layer0_keys(model, tokens, torch.arange(24))
    delta = torch.tensor([5] * 12 + [300] * 12)
    placed = KeyShifter(model.config).shift(canonical, delta)
    direct = _layer0_keys(model, tokens, torch.arange(24) + delta)
    assert placed.dtype == torch.bfloat16
    torch.testing.assert_close(placed, direct, rtol=2e-2, atol=2e-2)  # bf16: a few ulps


def test_other_rope_variants_are_refused_by_name(llama_dir: Path) -> None:
    for kind in ("yarn", "dynamic", "longrope", "mrope"):
        with pytest.raises(BlendUnsupported, match=repr(kind)):
            check_rope(RopeConfig(kind=kind, factor=2.0))
    config = ModelConfig.from_file(llama_dir / "config.json")
    check_placeable(config)  # the checkpoint itself is fine
    with pytest.raises(BlendUnsupported, match="'mistral'"):
        check_placeable(ModelConfig(**{**config.__dict__, "model_type": "mistral"}))
    with pytest.raises(ValueError, match=r"\[tokens, heads"):
        KeyShifter(config).shift(torch.zeros(4, 32), 1)
