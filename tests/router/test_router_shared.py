"""``lmc router``'s shared sources: two instances use one ``lmc server`` daemon as their
``lmc://`` tier; a prefix instance A stored there is scored as cached for instance B through
the daemon's events (and for A through its own and the daemon's), weighted by medium; an
instance that does not use the daemon gets nothing from it; a daemon restart is noticed."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from lmc import CacheConfig
from lmc.cache_engine import CacheEngine
from lmc.events.engine import attach
from lmc.events.notes import bind
from lmc.router.feed import EventFeed, SaltedKeys, SharedSource, SharedSpec, Source, match_instance
from lmc.router.policy import Candidate, Weights, choose
from tests.events.helpers import LOCAL
from tests.kvutil import make_caches, random_tokens, spec_for
from tests.server.daemon_proc import DaemonProc, free_port

pytestmark = pytest.mark.integration
CHUNK, BLOCK = 64, 16
EVENTS = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*",
          "replay_endpoint": "tcp://127.0.0.1:*", "block_size": BLOCK, "heartbeat": 0.3}
A, B, C = "http://a:8000", "http://b:8000", "http://c:8000"


@contextlib.contextmanager
def instance(url: str) -> Iterator[tuple[CacheEngine, Any, Source]]:
    """An engine with its own events on and the daemon as its lmc:// tier."""
    caches = make_caches("vllm_flash", blocks=256, block_size=BLOCK)
    cfg = CacheConfig(chunk_size=CHUNK, local_cpu_size="4MiB", local_cpu_prefault="off",
                      pin_memory="false", remote_url=url)
    eng = CacheEngine(cfg, spec_for("vllm_flash", caches), "shared-router-test")
    ev = attach(eng, {**LOCAL, "heartbeat": 0.3})
    assert ev is not None and bind(eng) is not None  # after attach: notes wrap its database
    eng.lookup(random_tokens(CHUNK, seed=999))  # connects: the daemon's HELLO turns notes on
    try:
        yield eng, caches, ev
    finally:
        ev.close()
        eng.close()


def wait(pred, timeout: float = 15.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


def tokens_cached(m) -> tuple[int, int, int]:
    return (m.gpu * m.block_size, m.cpu * m.block_size, m.storage * m.block_size) if m else None


def test_a_prefix_stored_through_a_is_cached_for_b(tmp_path):
    port, rport = free_port(), free_port()  # fixed: a restarted daemon comes back on them
    ev = {**EVENTS, "endpoint": f"tcp://*:{port}", "replay_endpoint": f"tcp://*:{rport}"}
    d = DaemonProc(tmp_path / "d", ["--size", "64MiB", "--kv-events", json.dumps(ev)]).start()
    feed = None
    try:
        info = d.info["kv_events"]
        shared = SharedSource(SharedSpec.parse(
            f"{info['endpoint']},replay={info['replay_endpoint']},instances={A}|{B}"), 1 << 16)
        with instance(d.url) as (ea, ca, eva), instance(d.url) as (eb, cb, evb):
            own = {A: Source(A, eva.endpoint, eva.replay_endpoint, 1 << 16),
                   B: Source(B, evb.endpoint, evb.replay_endpoint, 1 << 16)}
            feed = EventFeed([own[A], own[B], shared], stale_after=5.0)
            feed.start()
            assert wait(lambda: all(s.synced for s in (own[A], own[B], shared)))
            prompt = random_tokens(4 * CHUNK, seed=7)
            n = len(prompt)
            ea.store(prompt, ca, torch.arange(n))
            ea.flush()
            keys = SaltedKeys(prompt)

            def m(url: str, own_src: Source | None = None):
                return tokens_cached(match_instance(url, own_src, [shared], keys, 5.0))

            # B never saw the prompt: its own events say nothing, the daemon says CPU
            assert wait(lambda: m(B, own[B]) == (0, n, n)), m(B, own[B])
            assert m(B) == (0, n, n)  # with no events of its own: the shared source alone
            assert wait(lambda: m(A, own[A]) == (0, n, n))  # A: its memory and the daemon's
            # C does not use this daemon: nothing from it (and no fresh events at all)
            assert match_instance(C, None, [shared], keys, 5.0) is None
            # another namespace's prompt keys never match the daemon's "lmc" blocks
            other = SharedSource(SharedSpec(shared.endpoint, None, "tenant-x"), 16)
            other.index, other.synced, other.last_heard = shared.index, True, time.monotonic()
            assert tokens_cached(match_instance(B, None, [other], keys, 5.0)) == (0, 0, 0)
            # the policy: B is credited like A, so load decides between them
            w = Weights()
            ma = match_instance(A, own[A], [shared], keys, 5.0)
            mb = match_instance(B, own[B], [shared], keys, 5.0)
            assert w.credit(ma) == w.credit(mb) == 0.8 * n
            c = choose([Candidate(1, ma), Candidate(0, mb)], n, w, 0, "prefix")
            assert c.index == 1 and c.reason == "prefix"
            # without the shared source B would have been scored as uncached
            assert tokens_cached(match_instance(B, own[B], [], keys, 5.0)) == (0, 0, 0)
            # the daemon restarts (its memory is gone): the router notices and resyncs
            d.terminate()
            d.start()
            # seen by its seq (numbered from 0 again) or, first, by its reconnection: one sync
            assert wait(lambda: shared.counts["restarts"] + shared.counts["reconnects"] >= 1
                        and shared.synced)
            assert wait(lambda: m(B) == (0, 0, 0)), m(B)
    finally:
        if feed is not None:
            feed.close()
        d.kill()


@pytest.mark.parametrize("text,why", [
    ("http://d:5557", "is not a tcp:// or ipc:// endpoint"),
    ("tcp://d:5557,replay=http://x", "replay='http://x' is not"),
    ("tcp://d:5557,bogus=1", "'bogus=1'"),
    ("tcp://d:5557,namespace=a,namespace=b", "'namespace=b'"),
    ("tcp://d:5557,namespace=" + "x" * 65, "longer than 64 bytes"),
    ("tcp://d:5557,instances=", "instances= must name 1 to"),
    ("tcp://d:5557,instances=" + "|".join(f"http://h{i}" for i in range(1025)),
     "instances= must name 1 to"),
])
def test_shared_spec_mistakes_are_named(text, why):
    with pytest.raises(ValueError, match="--shared-events") as e:
        SharedSpec.parse(text)
    assert why in str(e.value)


def test_shared_spec_defaults():
    s = SharedSpec.parse("tcp://d:5557,replay=tcp://d:5558")
    assert (s.namespace, s.instances, s.replay) == ("lmc", None, "tcp://d:5558")
    src = SharedSource(SharedSpec.parse("tcp://d:5557,instances=http://a:1/|http://b:2"), 8)
    assert src.serves("http://a:1") and src.serves("http://b:2/") and not src.serves("http://c")
