"""The router subscribes to vLLM 0.32's own publisher (``ZmqEventPublisher``, in the vLLM venv,
a subprocess) exactly as to lmc's: it has no state dump, so the router syncs from its replay
buffer (seq 0 on), then follows the PUB stream; the GPU blocks vLLM announces score a prompt
in the GPU tier, a removal truncates it, a reset clears it."""

from __future__ import annotations

import subprocess
import time

import pytest

from lmc.router.feed import EventFeed, Source
from lmc.router.index import Match, block_keys
from tests.events.helpers import vllm_python
from tests.router.helpers import free_port

pytestmark = pytest.mark.integration

PUBLISH = r'''
import sys, time
from vllm.distributed.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored,
                                        KVEventBatch, ZmqEventPublisher)
pub_port, rep_port = int(sys.argv[1]), int(sys.argv[2])
pub = ZmqEventPublisher(data_parallel_rank=0, endpoint=f"tcp://*:{pub_port}",
                        replay_endpoint=f"tcp://127.0.0.1:{rep_port}", topic="kv@pod@m")
toks = list(range(100, 164))
def stored(hashes, parent, tokens):
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                       block_size=16, lora_id=None, medium="GPU", lora_name=None)
pub.publish(KVEventBatch(ts=1.0, events=[stored([11, 12], None, toks[:32])]))
pub.publish(KVEventBatch(ts=1.1, events=[stored([13, 14], 12, toks[32:])]))
print("published", flush=True)
for line in sys.stdin:  # the test says when
    if line.startswith("remove"):
        pub.publish(KVEventBatch(ts=2.0, events=[BlockRemoved(block_hashes=[14],
                                                              medium="GPU")]))
    elif line.startswith("reset"):
        pub.publish(KVEventBatch(ts=3.0, events=[AllBlocksCleared()]))
    elif line.startswith("quit"):
        break
    print("done", flush=True)
pub.shutdown()
'''


def test_router_follows_vllms_own_publisher(tmp_path):
    py = vllm_python()
    pub_port, rep_port = free_port(), free_port()
    proc = subprocess.Popen([py, "-c", PUBLISH, str(pub_port), str(rep_port)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=open(tmp_path / "vllm.log", "w"), text=True)  # noqa: SIM115
    feed = None
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "published", (tmp_path / "vllm.log").read_text()
        src = Source("vllm", f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{rep_port}", 1024)
        feed = EventFeed([src])
        feed.start()
        prompt = list(range(100, 164))
        keys = block_keys(prompt, 16)

        def wait(want: Match, what: str) -> None:
            end = time.monotonic() + 20
            while src.index.match(keys) != want:
                assert time.monotonic() < end, (what, src.index.match(keys), src.counts)
                time.sleep(0.05)

        time.sleep(1.0)  # subscribed; the next batch triggers the sync from replay
        proc.stdin.write("remove\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "done"
        wait(Match(3, 3, 3, 16), "synced from replay, then block 4 removed")
        assert src.synced and src.counts["dumps"] == 1
        proc.stdin.write("reset\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "done"
        wait(Match(0, 0, 0, 0), "AllBlocksCleared")  # the block size goes with the blocks
        proc.stdin.write("quit\n")
        proc.stdin.flush()
    finally:
        if feed is not None:
            feed.close()
        proc.kill()
        proc.wait(30)
