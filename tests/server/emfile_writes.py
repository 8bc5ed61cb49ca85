"""Run as a script by test_daemon_threats: the daemon's tier stack (memory + disk, write
retries on as ``lmc server`` sets them) storing values while every file descriptor of the
process is taken, so each disk write fails with EMFILE; then memory pressure; then the
descriptors come back. Prints JSON: which values the disk tier ends up holding, bit-exact.
A subprocess because it lowers RLIMIT_NOFILE and fills the fd table.
Threat model: docs/threats/daemon.md."""

from __future__ import annotations

import json
import os
import resource
import sys
import time

import torch

from lmc.config import CacheConfig
from lmc.memory.pool import MemoryPool
from lmc.storage.chain import build_storage

MiB = 1 << 20


def _value(i: int) -> tuple[bytes, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return bytes([9, i]) * 8, torch.randint(-1000, 1000, (1, 2, 256, 1024), generator=g,
                                            dtype=torch.int16).to(torch.float16)


def _put(storage, i: int) -> None:
    key, t = _value(i)
    obj = storage.allocate(t.shape, t.dtype, 256)
    assert obj is not None, "no memory for a value"
    obj.tensor.copy_(t)
    storage.put([key], [obj])
    obj.release()


def main(disk: str, retry: float) -> None:
    cfg = CacheConfig(local_cpu_size=16 * MiB, pin_memory="false", local_disk=disk)
    pool = MemoryPool(cfg.local_cpu_size, pin_memory="false")
    storage = build_storage(cfg, pool)
    storage.retry_failed_writes(retry)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(
        resource.RLIMIT_NOFILE)[1]))
    hogs = []
    try:
        while True:
            hogs.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass
    for i in range(6):  # written while no descriptor is free: every write fails (EMFILE)
        _put(storage, i)
    time.sleep(0.3)
    for i in range(6, 30):  # memory pressure: 24 MiB more through a 16 MiB pool
        _put(storage, i)
    failed = storage.stats().get("disk.errors_put_EMFILE", 0)
    for fd in hogs:
        os.close(fd)
    disk_tier = storage.lower[0]
    deadline = time.monotonic() + 15
    keys = [_value(i)[0] for i in range(6)]
    while not all(disk_tier.contains(keys)) and time.monotonic() < deadline:
        time.sleep(0.05)
    exact = []
    for i, k in enumerate(keys):
        got = disk_tier.get([k])[0]
        exact.append(got is not None and torch.equal(got.tensor, _value(i)[1]))
        if got is not None:
            got.release()
    storage.close()
    pool.close()
    print(json.dumps({"emfile_failures": failed, "on_disk_exact": exact}))


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
