"""The worker half on synthetic caches: a load writes exactly positions ``[start, end)``,
saves respect the already-saved prefix, and failures become block ids, never exceptions.
Layouts other than the reference engine's are covered too (vLLM's CPU backend, FlashInfer),
since the vLLM adapter will drive this same class."""

from __future__ import annotations

import pytest
import torch
from lmc.connectors.metadata import ConnectorMetadata, LoadSpec, SaveSpec
from lmc.connectors.worker import WorkerConnector, prefix_mask, slot_mapping

from lmc import CacheConfig, CacheEngine
from tests.kvutil import assert_bits_equal, make_caches, spec_for, token_kv
from tests.late_transfer import copies  # noqa: F401 - the fixture below

pytestmark = pytest.mark.usefixtures("copies")  # every test: copies now, then late

BS, CS, LAYERS = 4, 8, 3
TOKENS = tuple(range(500, 530))  # 30 tokens: 3 chunks of 8 + 6


def blocks(first: int, n: int = 8) -> tuple[int, ...]:
    return tuple(range(first, first + n))


def slots_of(block_ids: tuple[int, ...], lo: int, hi: int) -> torch.Tensor:
    return torch.from_numpy(slot_mapping(block_ids, BS, hi, lo, hi)[lo:hi])


def setup(layout: str = "vllm_flash"):
    src = make_caches(layout, layers=LAYERS, blocks=32, block_size=BS)
    dst = make_caches(layout, layers=LAYERS, blocks=32, block_size=BS, zeros=True)
    spec = spec_for(layout, src)
    engine = CacheEngine(CacheConfig(chunk_size=CS, local_cpu_size="4MiB"), spec, "m")
    return spec, engine, WorkerConnector(engine, src, BS), WorkerConnector(engine, dst, BS), \
        src, dst


def step(w: WorkerConnector, meta: ConnectorMetadata) -> set[int]:
    w.bind(meta)
    w.start_load()
    for layer in range(LAYERS):
        w.wait_for_layer(layer)
        w.save_layer(layer)
    w.wait_for_save()
    return w.take_load_errors()


def test_slot_mapping_and_mask() -> None:
    s = slot_mapping((5, 2), 4, 8, 2, 7)
    assert s.tolist() == [-1, -1, 22, 23, 8, 9, 10, -1]
    with pytest.raises(ValueError, match="need 3 blocks"):
        slot_mapping((5, 2), 4, 12, 0, 9)
    assert prefix_mask(4, 0) is None
    assert prefix_mask(4, 2).tolist() == [False, False, True, True]


@pytest.mark.parametrize("layout", ["vllm_flash", "vllm_cpu", "vllm_flashinfer"])
def test_save_then_load_writes_exactly_the_range(layout: str) -> None:
    spec, engine, ws, wd, src, dst = setup(layout)
    with engine:
        assert not step(ws, ConnectorMetadata(1, saves=[SaveSpec("a", TOKENS, blocks(0), 0)]))
        assert engine.lookup(TOKENS) == 30
        # load [10, 29): positions before 10 are the engine's, 29 is computed by it
        load = LoadSpec("b", TOKENS, blocks(16), 10, 29, 8)
        assert not step(wd, ConnectorMetadata(2, loads=[load]))
        got = token_kv(spec, dst, slots_of(blocks(16), 0, 30))
        want = token_kv(spec, src, slots_of(blocks(0), 0, 30))
        assert_bits_equal(got[:, :, 10:29], want[:, :, 10:29], "loaded range")
        assert not got[:, :, :10].any() and not got[:, :, 29:].any(), "wrote outside the range"
        assert wd.stats.loaded_tokens == 19 and wd.stats.tokens_by_tier == {"cpu": 19}


def test_saves_skip_the_masked_prefix() -> None:
    _, engine, ws, _, _, _ = setup()
    with engine:
        step(ws, ConnectorMetadata(1, saves=[SaveSpec("a", TOKENS[:16], blocks(0), 8)]))
        assert engine.contains_chunks(TOKENS).tolist() == [False, True, False, False]
        assert ws.stats.saved_tokens == 8


def test_missing_chunk_reports_its_blocks_and_drops_the_requests_saves() -> None:
    _, engine, ws, wd, _, _ = setup()
    with engine:
        step(ws, ConnectorMetadata(1, saves=[SaveSpec("a", TOKENS, blocks(0), 0)]))
        engine.storage.delete([engine.db.keys(TOKENS)[1]])  # chunk [8, 16) is gone
        meta = ConnectorMetadata(2, loads=[LoadSpec("b", TOKENS, blocks(16), 0, 29, 0)],
                                 saves=[SaveSpec("b", TOKENS, blocks(16), 24)])
        bad = step(wd, meta)
        assert bad == set(blocks(16)[2:])  # from position 8 (block index 2) to the end
        assert wd.take_load_errors() == set()  # reported once
        assert wd.stats.load_failures == 1 and wd.stats.saves_dropped == 1


def test_failed_layer_fails_the_request_not_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    _, engine, ws, wd, _, _ = setup()
    with engine:
        other = tuple(range(900, 916))
        step(ws, ConnectorMetadata(1, saves=[SaveSpec("a", TOKENS, blocks(0), 0),
                                             SaveSpec("c", other, blocks(8, 4), 0)]))
        tr = engine.transfer_for(wd.kv_caches)
        real = tr.scatter
        calls: list[int] = []

        def scatter(plan, bufs, layers=None, arrays=None, **kw):
            layers = list(layers)
            calls.append(layers[0])
            if layers == [1] and len(bufs) == 4:  # request b's chunks (c has two)
                raise OSError("injected")
            return real(plan, bufs, layers, arrays, **kw)

        monkeypatch.setattr(tr, "scatter", scatter)
        loads = [LoadSpec("b", TOKENS, blocks(16), 0, 29, 0),
                 LoadSpec("c", other, blocks(24, 4), 0, 15, 0)]
        bad = step(wd, ConnectorMetadata(2, loads=loads))
        assert bad == set(blocks(16))
        assert wd.stats.load_failures == 1
        assert wd.stats.loaded_tokens == 15  # c loaded completely
        assert calls.count(2) == 1  # b's layer 2 was not attempted after its layer 1 failed


def test_unfinished_step_is_dropped_on_rebind() -> None:
    _, engine, ws, _, _, _ = setup()
    with engine:
        ws.bind(ConnectorMetadata(1, saves=[SaveSpec("a", TOKENS, blocks(0), 0)]))
        ws.save_layer(0)
        ws.bind(ConnectorMetadata(2))  # the engine never called wait_for_save
        ws.wait_for_save()
        assert engine.lookup(TOKENS) == 0 and ws.stats.saves_dropped == 1
        assert engine.pool.used_bytes == 0


def test_sync_mode_loads_before_the_forward() -> None:
    _, engine, ws, _, _, dst = setup()
    with engine:
        step(ws, ConnectorMetadata(1, saves=[SaveSpec("a", TOKENS, blocks(0), 0)]))
        wd = WorkerConnector(engine, dst, BS, layerwise=False)
        wd.bind(ConnectorMetadata(2, loads=[LoadSpec("b", TOKENS, blocks(16), 0, 29, 0)]))
        wd.start_load()
        assert bool(dst[0][:, 16].view(torch.int32).any())  # in place before any wait
        wd.wait_for_save()
        assert wd.stats.loaded_tokens == 29
