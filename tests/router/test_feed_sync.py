"""No source can hold up another (lmc/router/sync.py, docs/threats/router.md): a mute source
-- a publisher whose replay socket is bound and never answers, sending a batch every 50 ms --
beside an honest reference-engine instance; the honest one stays fresh and its prompts are
routed to it by prefix, the mute one is asked again only every ``RETRY`` seconds. A
publisher process restarted with another block size is indexed again at the new one."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from lmc.events import wire
from lmc.reference import make_tiny_checkpoint
from lmc.router import sync
from lmc.router.app import InstanceSpec
from lmc.router.feed import EventFeed, Source
from lmc.router.index import block_keys
from tests.deadlines import HANG_S
from tests.kvutil import random_tokens
from tests.router.helpers import ROOT, free_port, http, instances
from tests.router.test_router import complete, routed, running, wait_indexed
from tests.router.test_router_attacks import Forger

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    work = tmp_path_factory.mktemp("pair")
    ckpt = make_tiny_checkpoint(work / "tiny", hidden=64, layers=2, vocab=512,
                                max_position_embeddings=2048)
    with instances(ckpt, work, 2) as insts:
        yield insts


class Mute(Forger):
    """A publisher that sends a batch every 50 ms and never answers its replay socket."""

    def __init__(self) -> None:
        super().__init__(replay=True)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._spam, daemon=True)
        self._thread.start()

    def _spam(self) -> None:
        seq = 0
        while not self._stop.wait(0.05):
            self.send(b"t", wire.seq_bytes(seq), wire.encode_batch([]))
            seq += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        super().close()


def test_a_mute_source_leaves_the_honest_one_fresh_and_routed_by_prefix(pair):
    honest, other = pair
    mute = Mute()
    t0 = time.monotonic()
    r = running([honest.spec, InstanceSpec(other.url, mute.endpoint, mute.replay)],
                stale_after=2.0)
    try:
        a = next(i for i in r.instances if i.url == honest.url)
        m = next(i for i in r.instances if i.url == other.url)
        assert a.source is not None and m.source is not None
        end = time.monotonic() + HANG_S
        while not a.source.synced:
            assert time.monotonic() < end, r.state()
            time.sleep(0.1)
        time.sleep(8.0)  # four stale periods of the mute source's batches and requests
        now = time.monotonic()
        assert a.source.fresh(2.0, now), (now - a.source.last_heard, r.state())
        assert not m.source.synced
        # asked every RETRY seconds since the router started (a loaded machine's slow sync
        # of the honest one included), not once per batch (every 50 ms)
        asked_for = time.monotonic() - t0
        assert m.source.counts["dumps"] <= asked_for / sync.RETRY + 2, (m.source.counts,
                                                                          asked_for)
        # a prompt the honest instance cached (asked of it directly) goes back to it
        base = [t % 512 for t in random_tokens(256, seed=900)]
        status, _ = http(honest.url + "/v1/completions",
                         {"prompt": base, "max_tokens": 2, "ignore_eos": True})
        assert status == 200
        wait_indexed(r, honest.url, base)
        before = routed(r)
        complete(r, base + [5, 6, 7])
        after = routed(r)
        assert after.get((honest.url, "prefix"), 0) == before.get((honest.url, "prefix"), 0) + 1
        assert a.source.fresh(2.0)
    finally:
        r.close()
        mute.close()


PUBLISHER = """
import sys, torch
from tests.events.helpers import engine_with_events, store
from tests.deadlines import HANG_S
from tests.kvutil import random_tokens
block, pub, rep = int(sys.argv[1]), sys.argv[2], sys.argv[3]
with engine_with_events(None, endpoint=pub, replay_endpoint=rep, block_size=block,
                        heartbeat=0.2) as (eng, ev, caches):
    store(eng, caches, random_tokens(128, seed=block))
    print("stored", flush=True)
    sys.stdin.read()
"""


def publisher(block: int, pub: str, rep: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", PUBLISHER, str(block), pub, rep],
                            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"stored"
    return proc


def test_a_publisher_restarted_with_another_block_size_is_indexed_again():
    pp, rp = free_port(), free_port()
    pub, rep = f"tcp://*:{pp}", f"tcp://*:{rp}"
    src = Source("engine", f"tcp://127.0.0.1:{pp}", f"tcp://127.0.0.1:{rp}", 1 << 16)
    feed = EventFeed([src], stale_after=5.0)
    feed.start()
    proc = publisher(16, pub, rep)
    try:
        end = time.monotonic() + HANG_S
        while src.index.blocks < 8:  # 128 tokens in blocks of 16
            assert time.monotonic() < end, (src.counts, src.index.counts)
            time.sleep(0.05)
        assert src.index.block_size == 16
        proc.stdin.close()  # type: ignore[union-attr]
        proc.wait(HANG_S)
        proc = publisher(32, pub, rep)
        end = time.monotonic() + HANG_S
        # synced too: an index at the new block size is not yet a sync that ended (a second
        # sync, asked meanwhile, would leave the index as it is but unscored)
        while not src.synced or src.index.block_size != 32 or src.index.blocks < 4:
            assert time.monotonic() < end, (src.synced, src.index.block_size,
                                            src.index.blocks, src.counts, src.index.counts)
            time.sleep(0.05)
        prompt = random_tokens(128, seed=32)
        assert src.index.match(block_keys(prompt, 32)).storage == 4  # the new one's prompt
        # seen as a restart (a seq at or below the last) or, when its first batches went out
        # before the SUB was back, as a reconnection: either way synced anew
        assert src.counts["restarts"] + src.counts["reconnects"] >= 1 and src.fresh(5.0)
    finally:
        proc.kill()
        proc.wait(10)
        feed.close()
