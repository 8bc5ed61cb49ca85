"""The publisher's surface (docs/threats/events.md): its replay socket answers anything
malformed with an error, never a crash; a subscriber that never reads, or none at all, costs
neither memory past the configured bounds nor a blocked store; a replay requester that never
reads is dropped by ZMQ; bad settings are refused naming the key."""

from __future__ import annotations

import contextlib
import os
import time

import msgpack
import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st

from lmc.events import wire
from lmc.events.events_config import EventsConfig
from lmc.events.publisher import EventPublisher
from tests.events.helpers import CHUNK, LOCAL, Collector, engine_with_events, request, store
from tests.kvutil import random_tokens


def rss() -> int:
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


def publisher(**kw) -> EventPublisher:
    return EventPublisher(EventsConfig(**{**LOCAL, **kw}), None, "kv@p@m")


def big_batch(i: int) -> list[dict]:
    """About 100 KiB of BlockStored."""
    toks = list(range(i, i + 16 * 1024))
    return [wire.block_stored(list(range(1024)), None, toks, 16, wire.CPU)]


@pytest.mark.parametrize("frames", [
    [b"", b"x"], [b"", b"123456789"], [b"", b"1234567"], [b"junk", wire.seq_bytes(0)],
    [b"", b"dump", b"more"], [b""], [b"", b"", b""], [b"", b"DUMP"]])
def test_a_malformed_replay_request_gets_an_error_and_the_socket_goes_on(frames):
    pub = publisher()
    try:
        got = request(pub.replay_endpoint, frames)
        assert got and got[-1][2] == wire.END_SEQ and got[-1][3].startswith(b"error: ")
        assert pub.stats()["bad_requests"] == 1
        ok = request(pub.replay_endpoint, [b"", wire.seq_bytes(0)])
        assert ok[-1][3] == b"" and wire.decode_batch(ok[0][3])[1] == [wire.Cleared()]
    finally:
        pub.close()


def test_an_oversized_request_disconnects_its_sender_only():
    pub = publisher()
    try:
        assert request(pub.replay_endpoint, [b"", b"x" * 4096], timeout=1.0) == []
        ok = request(pub.replay_endpoint, [b"", wire.seq_bytes(0)])
        assert ok[-1][2] == wire.END_SEQ and ok[-1][3] == b""
    finally:
        pub.close()


def test_dumps_are_rate_limited():
    pub = publisher()
    now = [1000.0]  # the limit's clock, moved by hand: the same on a loaded machine
    pub.replay.clock = lambda: now[0]
    try:
        first = request(pub.replay_endpoint, [b"", b"dump"])
        now[0] += 0.9
        second = request(pub.replay_endpoint, [b"", b"dump"])
        assert first[-1][3] == b"" and second[-1][3].startswith(b"error: one dump per second")
        now[0] += 0.2
        assert request(pub.replay_endpoint, [b"", b"dump"])[-1][3] == b""
    finally:
        pub.close()


@pytest.mark.parametrize("reader", ["none", "never_reads"])
def test_no_reader_or_a_stuck_one_costs_bounded_memory(reader):
    """~500 MB of msgpack published (6 rounds of 1,500 batches of ~57 KB, offered at the pace
    the publisher keeps up with) past a subscriber that never reads (or none): the process
    stops growing after the first round (16 batches kept for replay, 8 at PUB, 8 at the SUB,
    64 items queued or draining), where buffering what was sent would take all of it;
    every item is sent or counted dropped. A flood faster than the publisher is dropped at
    the queue (test_engine_events.py, test_stores_go_on_while_a_subscriber_never_reads).
    Batches go to PUB zero-copy, and what ZMQ (and pyzmq's thread that releases
    zero-copy frames, which lags on a busy machine) still holds is bounded by
    ``pub_max_bytes``: 8 MiB here, well inside the margin."""
    pub = publisher(hwm=8, buffer_steps=16, max_queue_size=64, pub_max_bytes=8 << 20)
    ctx = zmq.Context()
    ctx.setsockopt(zmq.LINGER, 0)  # never a term() that waits
    sub = ctx.socket(zmq.SUB)
    try:
        if reader == "never_reads":
            sub.setsockopt(zmq.RCVHWM, 8)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(pub.endpoint)
            time.sleep(0.3)
        offered = 0
        before = rss()
        after = []
        for _ in range(6):
            for i in range(1500):
                while pub.stats()["queued"] >= 32:
                    time.sleep(0.001)
                pub.offer(("raw", big_batch(i)))
                offered += 1
            after.append(rss())
        end = time.monotonic() + 30  # the last items drained are being sent
        while (s := pub.stats())["events"] - 1 + s["dropped"] < offered and \
                time.monotonic() < end:
            time.sleep(0.05)
        assert s["events"] - 1 + s["dropped"] == offered  # each sent or counted dropped
        assert s["events"] > offered // 2
        mib = [(a - before) >> 20 for a in after]
        # flat after the first round (a publisher buffering what it sent: +80 MiB a round)
        assert max(after[1:]) - after[0] < 64 << 20, mib
        assert after[0] - before < 320 << 20, mib
    finally:
        sub.close(0)
        ctx.term()
        pub.close()


def test_stores_go_on_while_a_subscriber_never_reads(tmp_path):
    with engine_with_events(None, pool="16MiB", hwm=1, buffer_steps=8) as (eng, ev, caches):
        ctx = zmq.Context()
        ctx.setsockopt(zmq.LINGER, 0)  # never a term() that waits
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 1)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(ev.endpoint)
        try:
            for seed in range(40):
                assert store(eng, caches, random_tokens(4 * CHUNK, seed=seed)) == 4 * CHUNK
            live = Collector(ev.endpoint)  # a second subscriber still gets new batches
            store(eng, caches, random_tokens(4 * CHUNK, seed=999))
            assert any(isinstance(e, wire.Stored) for e in live.settle(ev.publisher))
            live.close()
        finally:
            sub.close(0)
            ctx.term()


def test_a_replay_requester_that_never_reads_is_dropped():
    pub = publisher(buffer_steps=64)
    for i in range(64):
        pub.offer(("raw", big_batch(i)))
    ctx = zmq.Context()
    ctx.setsockopt(zmq.LINGER, 0)  # never a term() that waits
    hogs = []
    try:
        time.sleep(0.5)
        base = rss()
        for _ in range(20):
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.RCVHWM, 1)
            d.connect(pub.replay_endpoint)
            d.send_multipart([b"", wire.seq_bytes(0)])
            hogs.append(d)
        time.sleep(1.0)
        ok = request(pub.replay_endpoint, [b"", wire.seq_bytes(1)])
        assert ok[-1][2] == wire.END_SEQ and len(ok) >= 2
        assert rss() - base < 256 << 20
    finally:
        for d in hogs:
            d.close(0)
        ctx.term()
        pub.close()


@pytest.mark.parametrize("bad, words", [
    ({"endpiont": "tcp://*:1"}, "did you mean 'endpoint'"),
    ({"endpoint": "udp://x:1"}, "kv_events.endpoint"),
    ({"buffer_steps": 0}, "kv_events.buffer_steps"),
    ({"heartbeat": float("nan")}, "kv_events.heartbeat"),
    ({"enable_kv_cache_events": "yes"}, "expected true or false"),
    ({"pod": "a@b"}, "without @"),
    ({"max_queue_size": 1 << 40}, "kv_events.max_queue_size"),
    ({"replay_max_bytes": "lots"}, "kv_events.replay_max_bytes"),
    ({"pub_max_bytes": 10}, "kv_events.pub_max_bytes"),
])
def test_bad_settings_are_refused_naming_the_key(bad, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        EventsConfig.from_mapping(bad)


def test_a_port_in_use_is_a_clear_error():
    first = publisher()
    try:
        taken = first.endpoint.replace("127.0.0.1", "*")
        with pytest.raises(ValueError, match="cannot open"):
            publisher(endpoint=taken, replay_endpoint=None)
    finally:
        first.close()


def test_an_ipc_path_in_use_is_a_clear_error_and_a_dead_ones_is_reused(tmp_path):
    """ZMQ re-binds an ipc:// socket file, so a second engine used to take the first's
    endpoints over silently; now it is refused as a tcp:// port in use is. A file left by a
    process that died is reused."""
    import socket
    import subprocess
    import sys

    pub_ep, rep_ep = f"ipc://{tmp_path}/pub.sock", f"ipc://{tmp_path}/rep.sock"
    with engine_with_events(None, endpoint=pub_ep, replay_endpoint=rep_ep) as (_, ev, __):
        for ep, rep in ((pub_ep, rep_ep), (f"ipc://{tmp_path}/other.sock", rep_ep)):
            with pytest.raises(ValueError, match="in use"):
                publisher(endpoint=ep, replay_endpoint=rep)
        # the first engine still publishes and answers on its endpoints
        live = Collector(ev.endpoint)
        ev.publisher.offer(("raw", [wire.block_removed([7], wire.CPU)]))
        assert any(isinstance(e, wire.Removed) for e in live.settle(ev.publisher))
        live.close()
        assert request(ev.replay_endpoint, [b"", wire.seq_bytes(0)])[-1][3] == b""
    # another program listening at the path (not lmc: no lock file) is refused too
    other = tmp_path / "vllm.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(other))
    srv.listen(1)
    try:
        with pytest.raises(ValueError, match="another process listens"):
            publisher(endpoint=f"ipc://{other}", replay_endpoint=None)
    finally:
        srv.close()
    # a process that held both paths and was killed: its socket files and lock files stay
    code = ("import sys, zmq; from lmc.events.endpoints import IpcClaim; c = zmq.Context(); "
            "s = c.socket(zmq.PUB); claim = IpcClaim(sys.argv[1]); s.bind(sys.argv[1]); "
            "print('up', flush=True); sys.stdin.read()")
    dead = f"ipc://{tmp_path}/dead.sock"
    proc = subprocess.Popen([sys.executable, "-c", code, dead], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"up"
        with pytest.raises(ValueError, match="in use"):
            publisher(endpoint=dead, replay_endpoint=None)
    finally:
        proc.kill()
        proc.wait(10)
    assert os.path.exists(f"{tmp_path}/dead.sock") and os.path.exists(f"{tmp_path}/dead.sock.lock")
    pub = publisher(endpoint=dead, replay_endpoint=None)
    try:
        live = Collector(pub.endpoint)
        pub.offer(("raw", [wire.block_removed([9], wire.CPU)]))
        assert any(isinstance(e, wire.Removed) for e in live.settle(pub))
        live.close()
    finally:
        pub.close()
    assert not os.path.exists(f"{tmp_path}/dead.sock.lock")  # released, not left behind


def test_unset_endpoints_bind_loopback_and_a_wildcard_is_named():
    """vLLM binds tcp://*:5557 by default; lmc binds loopback unless an address is named."""
    cfg = EventsConfig.from_mapping({"enable_kv_cache_events": True})
    assert (cfg.pub_address, cfg.pub_binds, cfg.replay_address) == (
        "tcp://127.0.0.1:5557", True, "tcp://127.0.0.1:5558")
    assert "loopback only" in cfg.loopback_note()
    named = EventsConfig.from_mapping({"enable_kv_cache_events": True,
                                       "endpoint": "tcp://*:5557", "replay_endpoint": None})
    assert (named.pub_address, named.pub_binds, named.replay_address) == (
        "tcp://*:5557", True, None)
    assert named.loopback_note() == ""
    assert not EventsConfig(endpoint="tcp://10.0.0.1:5557").pub_binds  # vLLM's connect rule
    rank = next(r for r in range(3000, 3200) if free(5557 + r) and free(5558 + r))
    pub = EventPublisher(EventsConfig(enable_kv_cache_events=True, dp_rank=rank), None,
                         "kv@p@m")  # dp_rank shifts the default ports (vLLM's rule)
    try:
        assert pub.endpoint == f"tcp://127.0.0.1:{5557 + rank}"
        assert pub.replay_endpoint == f"tcp://127.0.0.1:{5558 + rank}"
    finally:
        pub.close()


def free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


@given(st.binary(max_size=512))
def test_the_reader_refuses_garbage_with_a_wire_error(data):
    with contextlib.suppress(wire.WireError):  # anything else fails the test
        wire.decode_batch(data)


@given(st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats()
                    | st.text(max_size=8) | st.binary(max_size=12),
                    lambda c: st.lists(c, max_size=6)
                    | st.dictionaries(st.sampled_from(
                        ["type", "block_hashes", "token_ids", "block_size", "medium",
                         "parent_block_hash", "lora_name", "cache_salt"]), c, max_size=6),
                    max_leaves=40))
def test_the_reader_refuses_any_wrong_shape_with_a_wire_error(obj):
    for payload in (msgpack.packb([1.0, [obj], 0]), msgpack.packb(obj)):
        with contextlib.suppress(wire.WireError):
            wire.decode_batch(payload)
