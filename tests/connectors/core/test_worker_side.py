"""The worker half on synthetic caches: a load writes exactly positions ``[start, end)``,
saves respect the already-saved prefix, and failures become block ids, never exceptions.
Layouts other than the reference engine's are covered too (vLLM's CPU backend, FlashInfer),
since the vLLM adapter will drive this same class."""

from __future__ import annotations

import pytest
import torch

from lmc import CacheConfig, CacheEngine
from lmc.connectors.core.metadata import ConnectorMetadata, LoadSpec, SaveSpec
from lmc.connectors.core.worker import WorkerConnector, prefix_mask, slot_mapping
from tests.kvutil import assert_bits_equal, make_caches, spec_for, token_kv
from tests.late_transfer import copies  # noqa: F401 - the fixture below

pytestmark = pytest.mark.usefixtures("copies")  # every test: copies now, then late

BS, CS, LAYERS = 4, 8, 3
TOKENS = tuple(range(500, 530))  # 30 tokens: 3 chunks of 8 + 6


def blocks(first: int, n: int = 8) -> tuple[int, ...]:
    return tuple(range(first, first + n))


def slots_of(block_ids: tuple[int, ...], lo: int, hi: int) -> torch.Tensor:
    return torch.from_numpy(slot_mapping(block_ids, BS, hi, lo, hi)[lo:hi])


def setup(layout: str = "vllm_flash", **cfg):
    src = make_caches(layout, layers=LAYERS, blocks=32, block_size=BS)
    dst = make_caches(layout, layers=LAYERS, blocks=32, block_size=BS, zeros=True)
    spec = spec_for(layout, src)
    engine = CacheEngine(CacheConfig(chunk_size=CS, local_cpu_size="4MiB", **cfg), spec, "m")
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


def test_loaded_tokens_are_counted_by_tier_from_the_load_itself(tmp_path, monkeypatch) -> None:
    """The per-tier counts come from the fetch that serves the load: the disk tier is read
    once (layer by layer: ``get_layers``) and never asked ``contains`` (once it was: a
    second hash and tier walk)."""
    spec, engine, ws, wd, src, dst = setup(local_disk=str(tmp_path))
    with engine:
        step(ws, ConnectorMetadata(1, saves=[SaveSpec("a", TOKENS, blocks(0), 0)]))
        assert engine.flush(10)
        engine.storage.l1.delete(engine.db.keys(TOKENS)[2:])  # chunks 2-3 only on disk
        disk = engine.storage.tiers[1]
        calls: list[str] = []
        for name in ("contains", "get", "get_layers"):
            real = getattr(disk, name)
            monkeypatch.setattr(disk, name, lambda keys, _r=real, _n=name:
                                calls.append(_n) or _r(keys))
        assert not step(wd, ConnectorMetadata(2, loads=[LoadSpec("b", TOKENS, blocks(16),
                                                                 10, 29, 8)]))
        assert calls == ["get_layers"]
        # [10, 16) from chunk 1 in L1; [16, 24) and [24, 29) from chunks 2-3 on disk
        assert wd.stats.tokens_by_tier == {"cpu": 6, "disk": 13}
        got = token_kv(spec, dst, slots_of(blocks(16), 10, 29))
        assert_bits_equal(got, token_kv(spec, src, slots_of(blocks(0), 10, 29)), "mixed load")


def test_a_request_is_hashed_once_across_its_steps(monkeypatch) -> None:
    """Chunked prefill: each step saves the chunk it completed, hashing that chunk (and one
    kept chunk as a check), not the whole prefix again."""
    from lmc import token_database as tdb

    _, engine, ws, _, _, _ = setup()
    with engine:
        packed: list[int] = []
        real = tdb.tokens_to_bytes
        monkeypatch.setattr(tdb, "tokens_to_bytes", lambda t: packed.append(len(t)) or real(t))
        for i, end in enumerate((8, 16, 24)):
            step(ws, ConnectorMetadata(i, saves=[SaveSpec("a", TOKENS[:end], blocks(0),
                                                          end - 8)]))
        monkeypatch.undo()
        assert packed == [8, 8, 8, 8, 8]  # 8 + (check 8, new 8) * 2, not 8 + 16 + 24
        assert engine.lookup(TOKENS[:24]) == 24 and ws.stats.saved_tokens == 24
        assert ws.num_tracked_requests == 1
        ws.forget(["a", "never-seen"])
        assert ws.num_tracked_requests == 0


def test_kept_keys_are_bounded_and_a_reused_id_is_rehashed() -> None:
    spec, engine, ws, _, src, _ = setup()
    with engine:
        ws = WorkerConnector(engine, src, BS, max_tracked_requests=2)
        for rid in ("a", "b", "c"):
            step(ws, ConnectorMetadata(1, saves=[SaveSpec(rid, TOKENS[:16], blocks(0), 0)]))
        assert ws.num_tracked_requests == 2
        other = tuple(range(700, 724))  # "c" again, another sequence: must not reuse keys
        step(ws, ConnectorMetadata(2, saves=[SaveSpec("c", other, blocks(8), 0)]))
        assert engine.lookup(other) == 24 and engine.lookup(TOKENS[:16]) == 16
        with pytest.raises(ValueError, match="max_tracked_requests"):
            WorkerConnector(engine, src, BS, max_tracked_requests=0)


def test_a_finished_request_id_reused_for_another_prompt_gets_fresh_keys() -> None:
    """The worker's kept keys check only one chunk per call, which a prompt differing only
    in an earlier chunk passes; the metadata's ``forget`` (a finished request) is what makes
    reusing the id safe."""
    _, engine, ws, _, _, _ = setup()
    with engine:
        first = TOKENS[:16]
        second = tuple(range(800, 808)) + TOKENS[8:16]  # chunk 0 differs, chunk 1 the same
        step(ws, ConnectorMetadata(1, saves=[SaveSpec("r", first, blocks(0), 0)]))
        step(ws, ConnectorMetadata(2, saves=[SaveSpec("r", second, blocks(4), 0)],
                                   forget=["r"]))
        assert engine.lookup(second) == 16
        assert engine.lookup(first) == 16
        assert engine.db.keys(second)[1] != engine.db.keys(first)[1]


class _Timeline:
    """A GPU stream's clock for :class:`_StepClock`: each recorded event takes the
    timeline's current time (ms); ``advance`` is work or a stall on the stream."""

    def __init__(self) -> None:
        self.now = 0.0
        self.done = True

    def advance(self, ms: float) -> None:
        self.now += ms

    def event(self) -> object:
        line = self

        class Event:
            t: float

            def record(self, stream: object) -> None:
                self.t = line.now

            def query(self) -> bool:
                return line.done

            def elapsed_time(self, other: Event) -> float:
                return other.t - self.t

        return Event()


def test_a_gpu_step_that_loads_is_timed_without_its_stalls() -> None:
    """On a GPU the stream's waits for loads (the fetch before the forward, each layer's
    wait) are bracketed by events and taken out of the step's time; the result is read
    once the events have completed (a later step), never by waiting."""
    from lmc.connectors.core.worker import _StepClock

    line = _Timeline()
    clock = _StepClock(torch.device("cuda"), event=line.event, stream=lambda: None,
                       capturing=lambda: False)
    clock.start()
    with clock.stall():
        line.advance(5.0)  # the fetch
    for _ in range(4):
        line.advance(10.0)  # a layer's compute
        with clock.stall():
            line.advance(2.5)  # the stream waits for the next layer's copy
    line.done = False
    assert clock.stop((1024, 1024.0**2, 0)) == []  # not completed yet: nothing read
    line.done = True
    clock.start()
    line.advance(7.0)
    got = clock.stop((512, 512.0**2, 512))
    assert got == [(1024, 1024.0**2, 0, pytest.approx(0.040)),
                   (512, 512.0**2, 512, pytest.approx(0.007))]
    # a step whose stall bracket could not be closed is no observation
    clock.start()
    with clock.stall():
        line.advance(1.0)
        clock._event = lambda: (_ for _ in ()).throw(RuntimeError("no event"))
    assert clock.stop((8, 64.0, 0)) == []
