"""Asynchronous (prefill/decode consumer) loads, on both halves of the connector core: the
scheduler half turns a producer's promise into an async load carrying the request's
blocks; the worker half waits in the background for chunks still being published, loads
them bit-exact, reports the request through ``get_finished`` and, for what never came,
the blocks to recompute no later than that report."""

from __future__ import annotations

import threading
import time

import pytest

from lmc import CacheConfig, CacheEngine
from lmc.connectors.core.metadata import ConnectorMetadata, LoadSpec, SaveSpec, StepRequest
from lmc.connectors.core.pd_params import producer_params, remote_prefill_tokens
from lmc.connectors.core.scheduler import ConnectorConfig, SchedulerConnector
from lmc.connectors.core.worker import WorkerConnector
from tests.connectors.core.test_worker_side import BS, CS, LAYERS, TOKENS, blocks, slots_of, step
from tests.deadlines import AT_ONCE_S, HANG_S, SLACK_S
from tests.kvutil import assert_bits_equal, make_caches, spec_for, token_kv


def _setup(remote_wait: float = HANG_S):
    src = make_caches("vllm_flash", layers=LAYERS, blocks=32, block_size=BS)
    dst = make_caches("vllm_flash", layers=LAYERS, blocks=32, block_size=BS, zeros=True)
    spec = spec_for("vllm_flash", src)
    engine = CacheEngine(CacheConfig(chunk_size=CS, local_cpu_size="4MiB"), spec, "m")
    return (spec, engine, WorkerConnector(engine, src, BS),
            WorkerConnector(engine, dst, BS, remote_wait=remote_wait), src, dst)


def _finished(w: WorkerConnector, timeout: float = HANG_S) -> tuple[set[str], set[int]]:
    """Poll as an engine does once per step: finished ids, then that step's load errors."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        w.bind(ConnectorMetadata())
        done = w.get_finished()
        errors = w.take_load_errors()
        if done:
            return done, errors
        time.sleep(0.01)
    raise AssertionError("asynchronous load never reported")


def test_scheduler_makes_an_async_load_with_the_blocks():
    s = SchedulerConnector(ConnectorConfig(chunk_size=CS), lambda t: 0)
    assert s.match_remote("r", TOKENS, 0, 30) == 29  # the last token is computed here
    assert s.match_remote("q", TOKENS, 16, 10) == 0  # nothing past what is computed
    s.update_state_after_alloc("r", TOKENS, 0, 29, blocks(16))
    meta = s.build_metadata([])
    assert not meta.is_empty and not meta.loads
    assert meta.async_loads == [LoadSpec("r", TOKENS, blocks(16), 0, 29, 0)]
    assert s.build_metadata([]).async_loads == []  # carried once
    s.match_remote("x", TOKENS, 0, 30)
    with pytest.raises(ValueError, match="needs the request's block ids"):
        s.update_state_after_alloc("x", TOKENS, 0, 29)
    # a producer-only connector never loads
    p = SchedulerConnector(ConnectorConfig(chunk_size=CS, load=False), lambda t: 0)
    assert p.match_remote("r", TOKENS, 0, 30) == 0


def test_params_round_trip_and_bad_counts_are_prefilled_here():
    class Req:
        request_id = "r"
        kv_transfer_params = producer_params(30, "e1")
    assert remote_prefill_tokens(Req) == 30
    Req.kv_transfer_params = {**producer_params(30, "e1"), "remote_num_tokens": "many"}
    assert remote_prefill_tokens(Req) is None
    Req.kv_transfer_params = {"do_remote_prefill": True, "remote_num_tokens": 30}
    assert remote_prefill_tokens(Req) is None  # not an lmc producer's
    Req.kv_transfer_params = None
    assert remote_prefill_tokens(Req) is None


def test_load_waits_for_chunks_published_late_and_is_bit_exact():
    spec, engine, ws, wd, src, dst = _setup()
    with engine:
        load = LoadSpec("d", TOKENS, blocks(16), 0, 29, 0)
        wd.bind(ConnectorMetadata(1, async_loads=[load]))
        assert wd.num_async_loads == 1
        time.sleep(0.2)  # the consumer is told before the producer's chunks are in
        assert wd.get_finished() == set()
        threading.Timer(0.1, lambda: step(
            ws, ConnectorMetadata(2, saves=[SaveSpec("p", TOKENS, blocks(0), 0)]))).start()
        done, errors = _finished(wd)
        assert done == {"d"} and errors == set()
        got = token_kv(spec, dst, slots_of(blocks(16), 0, 30))
        want = token_kv(spec, src, slots_of(blocks(0), 0, 30))
        assert_bits_equal(got[:, :, :29], want[:, :, :29], "pulled prompt")
        assert not got[:, :, 29:].any(), "the last token is the engine's"
        assert wd.stats.async_loads == 1 and wd.stats.loaded_tokens == 29
        assert wd.stats.async_wait_seconds >= 0.2
        wd.close()
        ws.close()


def test_late_chunks_are_load_errors_reported_with_the_finish():
    spec, engine, ws, wd, src, dst = _setup(remote_wait=0.3)
    with engine:
        # only the first two chunks ever arrive: positions 16.. are recomputed
        step(ws, ConnectorMetadata(1, saves=[SaveSpec("p", TOKENS[:16], blocks(0), 0)]))
        wd.bind(ConnectorMetadata(2, async_loads=[LoadSpec("d", TOKENS, blocks(16), 0, 29, 0)]))
        done, errors = _finished(wd)
        assert done == {"d"}
        assert errors == set(blocks(16)[16 // BS: -(-29 // BS)])  # blocks from position 16
        assert wd.stats.async_load_failures == 1 and wd.stats.loaded_tokens == 16
        got = token_kv(spec, dst, slots_of(blocks(16), 0, 16))
        assert_bits_equal(got, token_kv(spec, src, slots_of(blocks(0), 0, 16)), "kept part")
        wd.close()
        ws.close()


def test_aborted_or_closed_loads_stop_waiting_and_still_report():
    _, engine, _, wd, _, _ = _setup(remote_wait=HANG_S)
    with engine:
        wd.bind(ConnectorMetadata(1, async_loads=[LoadSpec("a", TOKENS, blocks(16), 0, 29, 0)]))
        time.sleep(0.05)
        t0 = time.monotonic()
        assert wd.get_finished({"a", "never-loaded"}) == set()  # the engine aborted it
        done, errors = _finished(wd, timeout=AT_ONCE_S)  # not the HANG_S wait
        assert done == {"a"} and errors and time.monotonic() - t0 < AT_ONCE_S
        assert wd._async_cancel == set()  # ids of other requests are not kept
        wd.bind(ConnectorMetadata(2, async_loads=[LoadSpec("b", TOKENS, blocks(16), 0, 29, 0)]))
        t0 = time.monotonic()
        wd.close()  # a waiting load gives up at once
        assert time.monotonic() - t0 < AT_ONCE_S


def test_step_requests_are_not_confused_with_async_ones():
    """A consumer's normal (synchronous) hits still load inside the step."""
    s = SchedulerConnector(ConnectorConfig(chunk_size=CS), lambda t: 30)
    assert s.get_num_new_matched_tokens("r", TOKENS, 0) == 29
    s.update_state_after_alloc("r", TOKENS, 0, 29)
    meta = s.build_metadata([StepRequest("r", TOKENS, 30, blocks(0), 29, 1)])
    assert len(meta.loads) == 1 and meta.async_loads == []


def test_a_load_never_published_does_not_hold_up_the_next():
    # the stuck load gives up after 2 * SLACK_S; the ready one is reported before that,
    # alone (a load that waited for the stuck one would be reported with it)
    spec, engine, ws, wd, src, dst = _setup(remote_wait=2 * SLACK_S)
    with engine:
        other = tuple(range(900, 930))  # never stored anywhere
        wd.bind(ConnectorMetadata(1, async_loads=[
            LoadSpec("stuck", other, blocks(0), 0, 29, 0),
            LoadSpec("ready", TOKENS, blocks(16), 0, 29, 0)]))
        step(ws, ConnectorMetadata(2, saves=[SaveSpec("p", TOKENS, blocks(8), 0)]))
        done, errors = _finished(wd)
        assert done == {"ready"} and errors == set()
        done, errors = _finished(wd)
        assert done == {"stuck"} and errors == set(blocks(0)[: -(-29 // BS)])
        wd.close()
        ws.close()
