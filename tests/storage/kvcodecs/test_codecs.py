"""Each KV codec's round trip stays within its stated error bound, on every layout and dtype
lmc stores (fp32, fp16, bf16; two planes K/V, MLA's one latent plane; a partial chunk, a
width no group divides), and what it cannot represent is stored exact."""

import pytest
import torch

from lmc.storage.kvcodecs.base import NotEncodable
from lmc.storage.kvcodecs.lossless import Lossless
from lmc.storage.kvcodecs.stage import CODED, EXACT, HEADER, parse_stage
from lmc.storage.serde import CorruptValue

CODECS = ["fp8-e4m3", "int8", "int4-kivi", "int4-kivi+zstd", "fp8-e4m3+lz4"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# [layers, planes, tokens, width], head size: MHA with 3 heads of 64 (SmolLM2's), a partial
# chunk of a width no group of 32 divides, MLA's latent (576 = 512 + 64 rope) as one group
SHAPES = [((3, 2, 64, 192), 64), ((2, 2, 5, 40), 8), ((3, 1, 37, 576), None)]


def kv_like(shape, dtype, seed=0):
    """Keys with outlier channels and a large token, as real KV has."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x[:, 0, :, 3] *= 20  # an outlier channel
    x[:, -1, shape[2] // 2] *= 8  # an outlier token
    return x.to(dtype)


def round_trip(stage, x):
    c = stage.encode(x)
    out = torch.empty_like(x)
    stage.decode(c.method, c.lossless, c.body, c.body_len, out)
    return c, out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,head", SHAPES, ids=["mha", "partial", "mla"])
@pytest.mark.parametrize("codec", CODECS)
def test_round_trip_within_the_stated_bound(codec, shape, head, dtype):
    stage = parse_stage(codec, head_size=head)
    x = kv_like(shape, dtype)
    c, out = round_trip(stage, x)
    assert c.method == CODED
    err = (out.float() - x.float()).abs()
    bound = stage.codec.error_bound(x)
    worst = (err - bound).max()
    assert bool((err <= bound).all()), f"error past the bound by {float(worst):.3g}"
    assert torch.equal(out, stage.round_trip(x)), "round_trip() differs from the tier's path"
    # the bound is a real one, not vacuous: a small fraction of a typical value
    fraction = {"fp8-e4m3": 0.1, "int8": 0.1, "int4-kivi": 0.35}[stage.codec.name]
    assert float(bound.median()) < fraction * float(x.float().abs().median()) + 1e-3


@pytest.mark.parametrize("codec,ratio", [("fp8-e4m3", 0.51), ("int8", 0.54),
                                         ("int4-kivi", 0.32)])
def test_bytes_per_value(codec, ratio):
    """What each codec promises to save on a bf16 chunk of SmolLM2's geometry."""
    stage = parse_stage(codec, head_size=64)
    shape = (30, 2, 256, 192)
    assert stage.coded_bytes(shape, torch.bfloat16) <= ratio * 30 * 2 * 256 * 192 * 2


@pytest.mark.parametrize("codec", ["fp8-e4m3", "int8", "int4-kivi"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_chunk_holding_a_non_finite_value_is_stored_exact(codec, bad):
    stage = parse_stage(codec)
    x = kv_like((2, 2, 16, 64), torch.bfloat16)
    x[1, 1, 3, 7] = bad
    with pytest.raises(NotEncodable):
        stage.codec.encode(x, torch.empty(stage.coded_bytes(tuple(x.shape), x.dtype),
                                          dtype=torch.uint8))
    c, out = round_trip(stage, x)
    assert c.method == EXACT
    assert torch.equal(out.view(torch.int16), x.view(torch.int16))


def test_int4_values_past_fp16_are_stored_exact():
    stage = parse_stage("int4-kivi")
    x = kv_like((1, 2, 16, 64), torch.float32)
    x[0, 0, 0, 0] = 1e6
    c, out = round_trip(stage, x)
    assert c.method == EXACT and torch.equal(out, x)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e4m3fn])
def test_dtypes_a_codec_does_not_take_are_stored_exact(dtype):
    stage = parse_stage("int4-kivi+zstd")
    x = torch.randint(0, 255, (2, 2, 8, 64), dtype=torch.uint8).view(dtype)
    c, out = round_trip(stage, x)
    assert c.method == EXACT
    assert torch.equal(out.view(torch.uint8), x.view(torch.uint8))


def test_the_lossless_stage_alone_is_exact():
    stage = parse_stage("exact+zstd")
    x = torch.zeros(2, 2, 16, 64, dtype=torch.bfloat16)
    x[0, 0, :3] = 1.5
    c, out = round_trip(stage, x)
    assert c.lossless and c.stored_len < x.numel() * 2 and torch.equal(out, x)
    assert not stage.lossy


@pytest.mark.parametrize("name", ["zstd", "lz4"])
def test_a_damaged_compressed_body_is_a_corrupt_value(name):
    stage = Lossless(name)
    packed = bytearray(stage.compress(bytes(range(256)) * 64))
    with pytest.raises(CorruptValue):
        stage.decompress(bytes(packed), 100)  # shorter than it holds
    for i in range(0, len(packed), 7):
        packed[i] ^= 0x5A
    with pytest.raises(CorruptValue):
        stage.decompress(bytes(packed), 256 * 64)


def test_a_zstd_frame_declaring_more_than_the_chunk_is_refused_unread():
    """A forged frame's declared size would be allocated whole: it is checked first."""
    z = Lossless("zstd")
    big = z.compress(bytes(1 << 20))
    with pytest.raises(CorruptValue, match="declares"):
        z.decompress(big, 4096)


def test_headers_name_the_stage_and_readers_of_another_refuse_it():
    a = parse_stage("int4-kivi", head_size=64)
    b = parse_stage("int4-kivi", head_size=32)
    x = kv_like((2, 2, 16, 64), torch.float16)
    c = a.encode(x)
    head = a.header(c, tuple(x.shape), x.dtype)
    assert len(head) == HEADER
    a.read_header(head, HEADER + c.stored_len)
    with pytest.raises(CorruptValue, match="coded as"):
        b.read_header(head, HEADER + c.stored_len)
    with pytest.raises(CorruptValue, match="body"):
        a.read_header(head, HEADER + c.stored_len - 1)
    assert a.namespace(b"k" * 16) != b.namespace(b"k" * 16)
    assert a.namespace(a.namespace(b"k" * 16)) == b"k" * 16


@pytest.mark.parametrize("value,message", [
    ("int5", "unknown codec 'int5'"), ("fp8+gzip", "unknown lossless stage 'gzip'"),
    ({"name": "int4-kivi", "group": 0}, "group must be"),
    ({"name": "fp8", "group": 32}, "takes no parameter 'group'"),
    ({"name": "none"}, "needs a lossy codec, a lossless stage, or both"), (3, "expected a codec"),
    ("int4-kivi,group", "expected name=<integer>"), ("int8,group=4", "no parameter 'group'"),
])
def test_bad_settings_are_named(value, message):
    with pytest.raises(ValueError, match=message) as e:
        parse_stage(value, "tiers[1].codec")
    assert str(e.value).startswith("tiers[1].codec: ")


def test_parameters_in_the_string_form():
    assert parse_stage("int4-kivi,group=64+zstd").ident == "int4-kivi.g64.h0+zstd1"


def test_served_kv_codes_each_chunk_as_a_tier_does():
    from lmc.storage.kvcodecs.serve import served_kv

    stage = parse_stage("int4-kivi", head_size=8)
    exact = torch.randn(2, 2, 40, 3, 8)  # two chunks of 16 and a partial one
    served = served_kv(exact, stage, 16)
    assert served.shape == exact.shape and not torch.equal(served, exact)
    chunk = exact[:, :, 16:32].reshape(2, 2, 16, 24).contiguous()
    assert torch.equal(served[:, :, 16:32].reshape(2, 2, 16, 24), stage.round_trip(chunk))
