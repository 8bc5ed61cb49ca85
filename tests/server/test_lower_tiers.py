"""The daemon's storage is lmc's own StorageManager: with a Redis tier behind its memory,
chunks evicted from the daemon's memory are still served (from Redis, promoted back)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest
import torch

from lmc.storage.tier import create_backend
from tests.kvutil import assert_bits_equal, random_bits
from tests.server.daemon_proc import client_pool, free_port

pytestmark = pytest.mark.integration


@pytest.fixture
def redis_port(tmp_path):
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server not installed (.ci/run installs Debian's redis-server)")
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), 1) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    break
        except OSError:
            pass
        assert time.monotonic() < deadline, "redis-server did not start"
        time.sleep(0.05)
    yield port
    proc.terminate()
    proc.wait(10)


def test_redis_tier_behind_daemon_memory(start_daemon, redis_port):
    d = start_daemon("--size", "16MiB", "--redis", f"redis://127.0.0.1:{redis_port}/0")
    cfg, pool = client_pool("48MiB")
    tier = create_backend(d.url, cfg, pool)
    gen = torch.Generator().manual_seed(4)
    objs = []
    for _ in range(4):
        o = pool.allocate((4, 2, 64, 1024), torch.bfloat16, 64)  # 1 MiB each
        o.tensor.copy_(random_bits((4, 2, 64, 1024), torch.bfloat16, gen))
        objs.append(o)
    first = [bytes([1, i]) * 8 for i in range(4)]
    assert tier.put(first, objs) == 4

    def drained() -> bool:
        return d.stats()["tiers"].get("redis.queue_chunks", 1) == 0

    deadline = time.monotonic() + 20
    while not drained():
        assert time.monotonic() < deadline, "write-behind to Redis never drained"
        time.sleep(0.05)
    for r in range(2, 10):  # 32 MiB more through a 16 MiB daemon: the first ones leave memory
        assert tier.put([bytes([r, i]) * 8 for i in range(4)], objs) == 4
    st = d.stats()
    assert st["tiers"]["cpu.evictions"] > 4
    got = tier.get(first)
    for o, g in zip(objs, got):
        assert g is not None, "an evicted chunk was not served from the Redis tier"
        assert_bits_equal(g.tensor, o.tensor, "via the daemon's Redis tier")
        g.release()
    for o in objs:
        o.release()
    tier.close()
