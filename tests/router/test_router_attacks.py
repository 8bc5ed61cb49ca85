"""``lmc router`` attacked from all three sides (docs/threats/router.md):

* clients: ``tests/http/test_attacks.py``, the suite every HTTP front runs (lying
  Content-Length, bad bodies and values, half-sent and trickled requests, the connection
  cap, a socket flood at RLIMIT_NOFILE 128, random bodies);
* instances: garbage status lines, hang-ups, hangs, lying ``cached_tokens`` -- the request
  goes to the next instance when nothing was answered yet, else the answer is relayed as it
  came; the liar is marked unhealthy; nothing crashes the router;
* event publishers: forged PUB streams (wrong frame counts, undecodable payloads, bytes
  where ints belong, orphan parents, another block size, a flood of blocks past the bound)
  and a replay socket that lies -- each counted, the index stays bounded, requests flow.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import time

import msgpack
import pytest
import zmq

from lmc.events import wire
from lmc.router.app import InstanceSpec, Router, cached_tokens
from lmc.router.feed import EventFeed, Source
from tests.deadlines import HANG_S, SLACK_S
from tests.http.kit import (
    LIMITS,
    NORMAL,
    expected_tokens,
    http200,
    post,
    running_server,
    tiny_model,
)
from tests.http.kit import Liar as KitLiar


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("router"))


@pytest.fixture(scope="module")
def want(ckpt) -> list[int]:
    return expected_tokens(ckpt)


@pytest.fixture(scope="module")
def honest(ckpt):
    with running_server(ckpt) as srv:
        yield srv


class Liar(KitLiar):
    """The kit's scripted upstream; a GET (the router's health check) is answered 200 even
    when requests hang: the instance looks healthy and fails the requests themselves."""

    def _one(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(10)
            buf = b""
            with contextlib.suppress(OSError):
                while b"\r\n\r\n" not in buf:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    buf += chunk
                head, _, body = buf.partition(b"\r\n\r\n")
                m = re.search(rb"Content-Length: (\d+)", head)
                while m and len(body) < int(m.group(1)):
                    body += conn.recv(65536)
                if head.startswith(b"GET"):
                    conn.sendall(http200(b"{}"))
                elif self.answer == "hang":
                    self.stop.wait(HANG_S)
                elif self.answer != "close":
                    conn.sendall(self.answer)


@pytest.fixture
def liar():
    up = Liar()
    yield up
    up.close()


def start(r: Router) -> Router:
    threading.Thread(target=r.serve_forever, daemon=True).start()
    return r


def assert_served(port: int, want: list[int]) -> None:
    status, raw = post(port, NORMAL)
    assert status == 200, raw
    assert json.loads(raw)["choices"][0]["token_ids"] == want


# -------------------------------------------------------------- lying instances

@pytest.mark.parametrize("answer", [b"HELLO THERE\r\n\r\n", "close", "hang"],
                         ids=["bad status line", "hang-up", "hang"])
def test_an_instance_failing_before_it_answers_hands_the_request_on(honest, liar, want,
                                                                    answer):
    liar.answer = answer
    r = start(Router([InstanceSpec(liar.url), InstanceSpec(honest.url)], policy="round_robin",
                     upstream_timeout=SLACK_S, health_interval=60, limits=LIMITS))
    try:
        for _ in range(2):  # whichever turn the liar has, the honest instance answers
            assert_served(r.port, want)
        assert not r.instances[0].healthy
        fails = {s.labels["instance"]: s.value for f in r.metrics.failures.collect()
                 for s in f.samples if s.name.endswith("_total")}
        assert fails.get(liar.url, 0) >= 1
    finally:
        r.close()


@pytest.mark.parametrize("usage", [
    b'{"usage": {"prompt_tokens_details": {"cached_tokens": -5}}}',
    b'{"usage": {"prompt_tokens_details": {"cached_tokens": 1e300}}}',
    b'{"usage": {"prompt_tokens_details": {"cached_tokens": "9"}}}',
    b'{"usage": {"prompt_tokens_details": {"cached_tokens": true}}}',
    b'{"usage": {"prompt_tokens_details": {"cached_tokens": 2000000000000000}}}',
    b'{"usage": [' + b"[" * 50_000 + b"]" * 50_000 + b'], "cached_tokens": 1}',
    b'data: {"usage": {"prompt_tokens_details": 7}, "cached_tokens": 3}\n\ndata: [DONE]\n',
])
def test_lying_usage_is_relayed_and_not_counted(liar, usage):
    liar.answer = http200(usage)
    r = start(Router([InstanceSpec(liar.url)], limits=LIMITS, health_interval=60))
    try:
        status, raw = post(r.port, NORMAL)
        assert status == 200 and raw == usage
        reported = [s.value for f in r.metrics.reported.collect() for s in f.samples
                    if s.name.endswith("_total")]
        assert sum(reported) == 0
    finally:
        r.close()
    assert cached_tokens(usage) is None


# -------------------------------------------------------------- lying publishers

class Forger:
    """A PUB (and optionally a ROUTER for replay) the test writes anything to."""

    def __init__(self, replay: bool = False) -> None:
        self.ctx = zmq.Context()
        self.ctx.setsockopt(zmq.LINGER, 0)  # never a term() that waits
        self.pub = self.ctx.socket(zmq.PUB)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.rep = None
        self.replay = None
        if replay:
            self.rep = self.ctx.socket(zmq.ROUTER)
            rport = self.rep.bind_to_random_port("tcp://127.0.0.1")
            self.replay = f"tcp://127.0.0.1:{rport}"

    def send(self, *frames: bytes) -> None:
        self.pub.send_multipart(list(frames))

    def answer_replay(self, frames_after_id: list[list[bytes]], timeout: float = HANG_S) -> bool:
        assert self.rep is not None
        if not self.rep.poll(int(timeout * 1000)):
            return False
        ident = self.rep.recv_multipart()[0]
        for f in frames_after_id:
            self.rep.send_multipart([ident, *f])
        return True

    def close(self) -> None:
        self.pub.close(0)
        if self.rep is not None:
            self.rep.close(0)
        self.ctx.term()


def batch(events: list[dict]) -> bytes:
    return wire.encode_batch(events)


def stored(hashes: list[int], parent: int | None, tokens: list[int], bs: int = 4) -> dict:
    return wire.block_stored(hashes, parent, tokens, bs, wire.CPU)


def test_forged_messages_are_counted_and_the_index_stays_true():
    f = Forger()
    src = Source("forged", f.endpoint, None, max_blocks=64)
    feed = EventFeed([src], stale_after=60)
    try:
        good = stored([1, 2], None, [1, 2, 3, 4, 5, 6, 7, 8])
        junk = [
            [b"t", wire.seq_bytes(0)],                          # 2 frames
            [b"t", b"\x00" * 3, batch([good])],                 # a short seq
            [b"t", wire.seq_bytes(0), b"\xc1\xc1"],             # not msgpack
            [b"t", wire.seq_bytes(0), msgpack.packb([1.0, [{"type": "BlockStored",
                                                              "block_hashes": [b"x" * 80],
                                                              "token_ids": [], "block_size": 4}
                                                             ], 0])],
            [b"t", wire.seq_bytes(0), msgpack.packb({"a": 1})],
        ]
        for frames in junk:
            feed.on_message(src, frames)
        assert src.index.blocks == 0 and src.counts["bad"] >= 3
        feed.on_message(src, [b"t", wire.seq_bytes(1), batch([good])])
        assert src.index.blocks == 2
        # an orphan (unknown parent) and another block size are refused, counted
        feed.on_message(src, [b"t", wire.seq_bytes(2), batch([
            stored([9], 12345, [1, 2, 3, 4]), stored([10], None, list(range(8)), bs=8)])])
        assert src.index.blocks == 2
        assert src.index.counts["orphans"] == 1 and src.index.counts["other_block_size"] == 1
        # a flood of blocks past max_blocks: bounded, counted
        feed.on_message(src, [b"t", wire.seq_bytes(3), batch([
            stored(list(range(100, 300)), None, list(range(800)))])])
        assert len(src.index.key_of) <= 64 and src.index.counts["overflow"] >= 1
    finally:
        feed.close()
        f.close()


def test_a_lying_replay_socket_leaves_the_source_unsynced_and_unscored(honest, want):
    f = Forger(replay=True)
    r = start(Router([InstanceSpec(honest.url, f.endpoint, f.replay)], limits=LIMITS,
                     health_interval=60))
    try:
        assert f.answer_replay([[b"", b"t", wire.seq_bytes(5), b"\xc1"],
                                [b"", b"", wire.END_SEQ, b""]])
        src = r.instances[0].source
        assert src is not None
        end = time.monotonic() + HANG_S
        while src.counts["bad"] < 1:  # the answer is read on the feed's thread
            assert time.monotonic() < end, src.counts
            time.sleep(0.05)
        assert not src.synced
        assert f.answer_replay([[b"", b"", wire.END_SEQ, b"error: go away"]], timeout=HANG_S)
        time.sleep(0.5)
        assert not src.synced
        assert_served(r.port, want)
        reasons = {s.labels["reason"] for fam in r.metrics.requests.collect()
                   for s in fam.samples if s.name.endswith("_total")}
        assert reasons == {"stale"}
    finally:
        r.close()
        f.close()
