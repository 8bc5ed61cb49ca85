"""The replay socket holds what every peer together can make it hold (docs/threats/events.md,
lmc/events/replay.py): sixteen peers asking for a replay from seq 0 every 10 ms and never
reading, against a real engine's publisher, stay within ``replay_max_bytes`` (the bytes the
bound counts) and the process's RSS barely moves (before the bound: +3 GiB in 10 s on the
issue's machine); requests past a peer's rate, peers past the cap, are refused and counted;
an honest replay afterwards is whole. The daemon's publisher: tests/server/
test_daemon_events_attacks.py."""

from __future__ import annotations

import time

import zmq

from lmc.events import replay, wire
from tests.events.helpers import Collector, engine_with_events, replay_flood, request
from tests.events.test_publisher_attacks import rss

BATCHES = 600
BUDGET = 8 << 20


def fill(pub, n: int = BATCHES) -> None:
    """``n`` batches of ~40 KiB each (1,024 one-hash removals: one batch per item)."""
    for i in range(n):
        pub.offer(("raw", [wire.block_removed([(i << 20) + j], wire.CPU)
                           for j in range(1024)]))
        while pub.stats()["queued"] > 16:
            time.sleep(0.001)
    end = time.monotonic() + 30
    while pub.stats()["seq"] < n and time.monotonic() < end:
        time.sleep(0.01)


def test_sixteen_peers_flooding_replays_stay_within_the_byte_budget(tmp_path):
    with engine_with_events(None, buffer_steps=BATCHES + 8,
                            replay_max_bytes=BUDGET) as (eng, ev, caches):
        pub = ev.publisher
        fill(pub)
        assert pub.stats()["buffer_bytes"] > 20 << 20  # what one replay would queue
        largest = max(len(p) for _, p in pub.buffer)
        before = rss()
        peak_rss = replay_flood(ev.replay_endpoint, peers=16, seconds=6.0, interval=0.01,
                                sample=rss)
        st = pub.stats()
        grew = (peak_rss - before) >> 20
        print(f"replay flood: RSS +{grew} MiB, replies held at most "
              f"{st['replay_bytes_peak'] >> 20} MiB (bound {BUDGET >> 20} MiB), "
              f"refused {st['replay_refused']}, limited {st['replay_limited']}")
        assert st["replay_bytes_peak"] <= BUDGET + largest + replay.OVERHEAD
        assert st["replay_limited"] > 0  # 100 requests a second each: past their rate
        assert grew < 160, f"RSS grew {grew} MiB under the flood"  # 16 x 25 MB before
        # the flood gone, an honest requester gets the whole buffer and the end marker
        got = request(ev.replay_endpoint, [b"", wire.seq_bytes(0)], timeout=30.0)
        assert got[-1][2] == wire.END_SEQ and got[-1][3] == b""
        seqs = [int.from_bytes(f[2], "big") for f in got[:-1]]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # in order, no gap
        assert len(seqs) >= BATCHES


def test_a_peer_past_its_rate_or_one_past_the_cap_is_refused_and_counted(monkeypatch):
    monkeypatch.setattr(replay, "MAX_PEERS", 8)  # the cap, lowered so 12 peers pass it
    with engine_with_events(None, buffer_steps=208) as (eng, ev, caches):
        pub = ev.publisher
        fill(pub, 200)  # ~8 MB a replay: more than a socket's kernel buffers take
        ctx = zmq.Context()
        ctx.setsockopt(zmq.LINGER, 0)
        socks = []
        try:
            d = ctx.socket(zmq.DEALER)
            d.connect(ev.replay_endpoint)
            socks.append(d)
            for _ in range(replay.BURST + 4):  # faster than one per REFILL
                d.send_multipart([b"", b"dump"])
            answers = []
            while len(answers) < replay.BURST + 4 and d.poll(5000):
                f = d.recv_multipart()
                if f[2] == wire.END_SEQ:
                    answers.append(f[3])
            assert sum(a.startswith(b"error: too many requests") for a in answers) >= 4
            assert pub.stats()["replay_limited"] >= 4
            d.close(0)
            time.sleep(0.5)
            # peers that ask and never read keep their state (bytes held): past the cap,
            # a peer is refused
            for _ in range(12):
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.RCVHWM, 1)
                s.setsockopt(zmq.RCVBUF, 4096)
                s.connect(ev.replay_endpoint)
                s.send_multipart([b"", wire.seq_bytes(0)])
                socks.append(s)
            end = time.monotonic() + 20
            while pub.stats()["replay_refused"] < 4 and time.monotonic() < end:
                time.sleep(0.05)
            st = pub.stats()
            assert st["replay_refused"] >= 4 and st["replay_peers"] <= 8, st
        finally:
            for s in socks:
                s.close(0)
            ctx.term()
        # they left (once ZMQ has seen them go, which frees their state): served again
        end = time.monotonic() + 20
        while True:
            got = request(ev.replay_endpoint, [b"", wire.seq_bytes(0)], timeout=20.0)
            if got[-1][3] != b"error: too many replay peers; retry" or time.monotonic() > end:
                break
            time.sleep(0.2)
        assert got[-1][2] == wire.END_SEQ and got[-1][3] == b"" and len(got) > 200


def test_a_subscriber_that_never_reads_holds_at_most_pub_max_bytes():
    """Batches go on PUB zero-copy and tracked: a subscriber that stopped reading makes ZMQ
    hold at most ``pub_max_bytes`` (then batches skip PUB, counted; ZMTP heartbeats drop
    the stuck subscriber, and a live one catches up through replay)."""
    budget = 4 << 20
    with engine_with_events(None, buffer_steps=BATCHES + 8,
                            pub_max_bytes=budget) as (eng, ev, caches):
        pub = ev.publisher
        ctx = zmq.Context()
        ctx.setsockopt(zmq.LINGER, 0)
        stuck = ctx.socket(zmq.SUB)
        stuck.setsockopt(zmq.RCVHWM, 1)
        stuck.setsockopt(zmq.RCVBUF, 4096)
        stuck.setsockopt(zmq.SUBSCRIBE, b"")
        stuck.connect(ev.endpoint)
        try:
            time.sleep(0.5)
            fill(pub)
            st = pub.stats()
            assert st["pub_bytes_peak"] <= budget + max(len(p) for _, p in pub.buffer) + 256
            assert st["pub_dropped"] > 0
        finally:
            stuck.close(0)
            ctx.term()
        live = Collector(ev.endpoint)  # a subscriber that reads still gets what follows
        pub.offer(("raw", [wire.block_removed([1], wire.CPU)]))
        assert any(isinstance(e, wire.Removed) for e in live.settle(pub))
        live.close()
