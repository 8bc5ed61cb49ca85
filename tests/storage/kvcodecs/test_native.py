"""The C kernels (``lmc._kvcodecs``) store exactly the torch formulation's bytes and decode to
exactly its values, on every codec, dtype and layout: a value written by one reads the same
through the other (a machine built without a compiler shares a store with one built with)."""

import pytest
import torch

from lmc.storage.kvcodecs import native
from lmc.storage.kvcodecs.base import NotEncodable
from lmc.storage.kvcodecs.stage import parse_stage

from .test_codecs import DTYPES, SHAPES, kv_like

pytestmark = pytest.mark.skipif(native._kernels is None,
                                reason="lmc._kvcodecs is not built (no C compiler)")


def both(monkeypatch, fn):
    monkeypatch.setattr(native, "ENABLED", True)
    fast = fn()
    monkeypatch.setattr(native, "ENABLED", False)
    slow = fn()
    return fast, slow


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,head", SHAPES, ids=["mha", "partial", "mla"])
@pytest.mark.parametrize("codec", ["fp8-e4m3", "int8", "int4-kivi", "int4-kivi.g7"])
def test_kernels_code_as_torch_does(monkeypatch, codec, shape, head, dtype):
    spec = {"name": "int4-kivi", "group": 7} if codec == "int4-kivi.g7" else codec
    c = parse_stage(spec, head_size=head).codec
    x = kv_like(shape, dtype, seed=3)
    x.view(-1)[::97] = 0  # exact zeros, and tiny values near the e4m3 subnormals
    x.view(-1)[5::101] *= 1e-4
    n = c.encoded_bytes(tuple(shape))

    def enc():
        out = torch.zeros(n, dtype=torch.uint8)
        c.encode(x, out)
        return out

    fast, slow = both(monkeypatch, enc)
    assert torch.equal(fast, slow), f"{int((fast != slow).sum())} of {n} bytes differ"

    def dec():
        out = torch.empty_like(x)
        c.decode(fast, out)
        return out

    fast_v, slow_v = both(monkeypatch, dec)
    assert torch.equal(fast_v.view(torch.uint8), slow_v.view(torch.uint8))


@pytest.mark.parametrize("codec", ["fp8-e4m3", "int8", "int4-kivi"])
def test_kernels_refuse_what_torch_refuses(monkeypatch, codec):
    c = parse_stage(codec).codec
    x = kv_like((2, 2, 8, 64), torch.bfloat16)
    x[1, 0, 2, 5] = float("nan")
    monkeypatch.setattr(native, "ENABLED", True)
    with pytest.raises(NotEncodable):
        c.encode(x, torch.empty(c.encoded_bytes(tuple(x.shape)), dtype=torch.uint8))


@pytest.mark.parametrize("codec", ["int8", "int4-kivi"])
def test_every_finite_fp16_value_codes_as_torch_does(monkeypatch, codec):
    """Every finite fp16 bit pattern up to 60,000 (subnormals and both zeros included) through the
    kernels' own fp16 widening and narrowing."""
    bits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    finite = bits[torch.isfinite(bits) & (bits.float().abs() <= 60000)]  # int4: fp16 scales
    x = finite[: (finite.numel() // 64) * 64].reshape(1, 1, -1, 64).contiguous()
    x = torch.cat([x, x.flip(2)], 1)  # two planes: keys and values
    c = parse_stage(codec, head_size=8).codec
    n = c.encoded_bytes(tuple(x.shape))

    def enc():
        out = torch.zeros(n, dtype=torch.uint8)
        c.encode(x, out)
        out_v = torch.empty_like(x)
        c.decode(out, out_v)
        return torch.cat([out, out_v.view(torch.uint8).reshape(-1)])

    fast, slow = both(monkeypatch, enc)
    assert torch.equal(fast, slow)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("codec", ["fp8-e4m3", "int8", "int4-kivi"])
def test_a_thread_flushing_denormals_codes_the_same_bytes(codec, dtype):
    """``torch.set_flush_denormal(True)`` (a user's choice for speed) makes this thread read
    denormal floats as zero: the kernels' fp16 widening must not pass through one (it did:
    subnormal fp16 values and scales came out as zero)."""
    c = parse_stage(codec, head_size=64).codec
    x = kv_like((2, 2, 16, 128), dtype, seed=5)
    x.view(-1)[::7] = torch.tensor(2.0 ** -20).to(dtype)  # fp16 subnormals
    x[1] = (x[1].float() * 2.0 ** -18).to(dtype)  # a layer of tiny values: subnormal scales
    n = c.encoded_bytes(tuple(x.shape))
    want, got = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    c.encode(x, want)
    back_want, back_got = torch.empty_like(x), torch.empty_like(x)
    c.decode(want, back_want)
    if not torch.set_flush_denormal(True):
        pytest.skip("this processor cannot flush denormals")
    try:
        c.encode(x, got)
        c.decode(want, back_got)
    finally:
        torch.set_flush_denormal(False)
    assert torch.equal(got, want), f"{int((got != want).sum())} of {n} bytes differ"
    assert torch.equal(back_got.view(torch.uint8), back_want.view(torch.uint8))
