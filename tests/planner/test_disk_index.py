"""The planner's byte-free disk tier holds what lmc's real disk tier holds, in the same order.

Both run the disk tier's own index (``lmc/storage/backends/disk/index.py``); the planner
(``SimDisk`` in ``lmc/planner/tiers.py``) drives it as the tier's writes and reads do, with no
files. This drives the real ``DiskBackend`` (real files, O_DIRECT where the filesystem allows)
and ``SimDisk`` with the same random puts, gets and lookups of chunks of mixed sizes, and
after every operation compares the keys and their eviction order (under each eviction
policy). A change to how the tier drives its index that the planner does not follow fails
here.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from lmc.config import CacheConfig
from lmc.memory.pool import MemoryPool
from lmc.planner.tiers import SimDisk
from lmc.storage.backends.disk.backend import DiskBackend

SEED = int(os.environ.get("LMC_TEST_SEED", random.randrange(1 << 30)))
TOKENS = (8, 12, 16, 3)  # chunk sizes in tokens: a partial tail included


def _obj(pool: MemoryPool, i: int, t: int):
    o = pool.allocate((2, 1, t, 64), torch.float32, t)  # 512 B per token
    o.tensor.fill_(float(i))
    return o


@pytest.mark.parametrize("policy", ["lru", "fifo"])
@pytest.mark.parametrize("capacity_files", [3, 7])
def test_same_keys_same_order_as_the_real_disk_tier(tmp_path, capacity_files, policy):
    print(f"seed {SEED}")
    rng = random.Random(SEED + capacity_files)
    capacity = capacity_files * (4096 + 8192)
    cfg = CacheConfig(local_disk=str(tmp_path), local_disk_size=capacity)
    pool = MemoryPool(4 << 20, pin_memory=False, prefault="off")
    disk = DiskBackend(config=cfg, pool=pool, io_threads=1, eviction_policy=policy)
    index = SimDisk(capacity, policy)
    size_of = {}
    try:
        for step in range(160):
            k = rng.randrange(20)
            key = k.to_bytes(16, "little")
            op = rng.random()
            if op < 0.55:
                t = size_of.setdefault(k, rng.choice(TOKENS))
                if disk.contains([key]) == [False]:  # write-behind puts only what is absent
                    o = _obj(pool, k, t)
                    try:
                        assert disk.put([key], [o]) == 1
                    finally:
                        o.release()
                    index.put([key], [o.nbytes])
                else:
                    assert index.contains([key]) == [True]
            elif op < 0.85:
                got = disk.get([key])
                assert index.touch_present([key]) == [got[0] is not None], f"step {step}"
                for o in got:
                    if o is not None:
                        assert o.tensor.flatten()[0].item() == float(k)
                        o.release()
            else:
                keys = [rng.randrange(20).to_bytes(16, "little") for _ in range(4)]
                assert disk.contains(keys) == index.contains(keys)
            order = disk.index.policy.keys_in_order()
            assert order == index.keys_in_order(), f"step {step} (seed {SEED})"
            assert disk.used_bytes == index.used
    finally:
        disk.close()
        pool.close()
