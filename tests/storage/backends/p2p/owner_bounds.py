"""Child process for ``test_p2p_exports``: one P2P tier over a bare pool, its exports pushed
past their window and left to expire; prints one JSON line of what it saw, then ends with
``os._exit`` (a NIXL agent crashes its process at interpreter exit).

``python -m tests.storage.backends.p2p.owner_bounds DIRECTORY_URL [TTL]``

The windows it checks are fractions of ``TTL`` (the refreshed export outlives the others by
0.6 TTL, the sweep runs every TTL/4): the test gives a TTL whose fractions are seconds, so
a loaded machine's scheduling delays fit in them."""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from lmc.config import CacheConfig
from lmc.memory.pool import MemoryPool
from lmc.storage.backends.p2p.backend import P2PBackend, directory_url
from lmc.storage.backends.p2p.directory_client import DirectoryConnection
from lmc.storage.backends.server.client import Address

SHAPE, CHUNK = (2, 2, 16, 64), 2 * 2 * 16 * 64 * 2  # 8 KiB of bf16
TTL = 1.0
WITHDRAWN_WITHIN = 60.0  # seconds for the directory to forget the expired (a hang guard)


def main(url: str) -> dict:
    cfg = CacheConfig(remote_timeout=5.0, pin_memory="false")
    pool = MemoryPool(1 << 20, pin_memory="false")
    tier = P2PBackend(url, config=cfg, pool=pool, export_bytes=4 * CHUNK, export_ttl=TTL)
    probe = DirectoryConnection(Address.parse(directory_url(url, cfg)), tier.namespace, None,
                                5.0, "probe")
    out: dict = {}
    keys = [i.to_bytes(16, "little") for i in range(6)]
    objs = pool.allocate_many(SHAPE, torch.bfloat16, 6, 16)
    slots_before = tier.agent.versions.clone()
    tier.put(keys, objs)
    out["refs"] = [o.ref_count for o in objs]  # ours only: the tier exports copies
    out["window_used"] = tier.window.used_bytes
    out["exported"] = tier.exported(keys)
    out["located"] = [bool(g) for g in probe.locate(keys, "probe")]
    out["live_slots"] = int((tier.agent.versions != 0).sum())
    out["slots_were_clear"] = bool((slots_before == 0).all())
    time.sleep(TTL * 0.6)
    tier.put(keys[5:], objs[5:])  # stored again: exported afresh, its clock restarts
    refreshed = time.monotonic()
    # the others expire (swept by the timer, every TTL/4: no call on the tier) well before
    # the refreshed one does
    while any(tier.exported(keys[:5])) and time.monotonic() - refreshed < TTL * 0.9:
        time.sleep(0.01)
    out["after_ttl"] = tier.exported(keys)
    while any(tier.exported(keys)) and time.monotonic() - refreshed < 10 * TTL:
        time.sleep(0.02)  # and then the refreshed one
    out["swept"] = tier.exported(keys)
    out["swept_after"] = time.monotonic() - refreshed
    out["refs_after"] = [o.ref_count for o in objs]
    out["live_slots_after"] = int((tier.agent.versions != 0).sum())
    out["window_used_after"] = tier.window.used_bytes
    end = time.monotonic() + WITHDRAWN_WITHIN
    while True:
        out["located_after"] = [bool(g) for g in probe.locate(keys, "probe")]
        if not any(out["located_after"]) or time.monotonic() > end:
            break
        time.sleep(0.02)
    out["stats"] = {k: tier.stats()[k] for k in ("exported", "withdrawn", "expired")}
    pool.release_many(objs)
    probe.close()
    tier.close()
    pool.close()
    out["leaks"] = pool.leaks
    return out


if __name__ == "__main__":
    if len(sys.argv) > 2:
        TTL = float(sys.argv[2])
    print("@lmc " + json.dumps(main(sys.argv[1])), flush=True)
    os._exit(0)
