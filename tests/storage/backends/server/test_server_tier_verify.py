"""The ``lmc://`` tier's verify-or-delete: a value whose payload no longer matches the
checksum the daemon recorded at PUT (damaged at rest in the daemon's memory) is a miss for
the engine, is counted, and is deleted from the daemon, so no later lookup finds it again.

The daemon runs in this process (its asyncio loop on a thread) so the test can damage the
stored bytes out of band; the tier talks to it over a real TCP socket."""

from __future__ import annotations

import asyncio
import threading
import time

import torch

from lmc.config import CacheConfig
from lmc.memory.pool import MemoryPool
from lmc.server.daemon import Daemon, build_storage
from lmc.server.server_config import ServerConfig
from lmc.storage.tier import create_backend
from tests.server.daemon_proc import free_port


def _serve(d: Daemon) -> tuple[threading.Thread, list[asyncio.AbstractEventLoop]]:
    loops: list[asyncio.AbstractEventLoop] = []

    def main() -> None:
        async def run() -> None:
            loops.append(asyncio.get_running_loop())
            await d.serve()

        asyncio.run(run())

    t = threading.Thread(target=main, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while not loops and time.monotonic() < deadline:
        time.sleep(0.01)
    return t, loops


def test_a_value_damaged_in_the_daemon_is_a_miss_and_is_deleted():
    port = free_port()
    d = Daemon(ServerConfig(port=port, size="8MiB", prefault=False, hugepages=False))
    thread, loops = _serve(d)
    assert loops, "the daemon's loop did not start"
    cfg = CacheConfig(local_cpu_size=4 << 20, remote_url=f"lmc://127.0.0.1:{port}",
                      remote_timeout=5.0)
    pool = MemoryPool(4 << 20, pin_memory=False)
    tier = create_backend(cfg.remote_url, cfg, pool)
    try:
        keys = [bytes([i]) * 16 for i in range(2)]
        objs = [pool.allocate((1, 2, 16, 64), torch.float16, 16) for _ in keys]
        for i, o in enumerate(objs):
            o.tensor.fill_(float(i + 1))
        assert tier.put(keys, objs) == 2
        for o in objs:
            o.release()
        stored = list(d.storage.l1._map.values())  # the daemon's own copies
        assert len(stored) == 2
        victim = next(o for o in stored if bool((o.tensor == 1.0).all()))
        victim.byte_view()[100] ^= 0xFF  # one flipped byte in the daemon's memory
        got = tier.get(keys)
        assert got[0] is None, "a damaged value was served"
        assert got[1] is not None and bool((got[1].tensor == 2.0).all())
        got[1].release()
        assert tier.stats()["corrupt"] == 1
        assert tier.contains(keys) == [False, True], "the damaged value was not deleted"
    finally:
        tier.close()
        loops[0].call_soon_threadsafe(d.request_stop)
        thread.join(30)
        pool.close()
    assert not thread.is_alive()
    assert pool.leaks == []


def test_the_daemon_takes_any_lower_tier_an_engine_takes(tmp_path):
    """The daemon builds its tiers with the engine's builder (``lmc.storage.chain``): another
    daemon (``lmc://``) behind it is a lower tier like Redis, with its backend options."""
    from lmc.storage.backends.server.backend import ServerBackend

    port = free_port()
    below = Daemon(ServerConfig(port=port, size="8MiB", prefault=False, hugepages=False))
    thread, loops = _serve(below)
    assert loops, "the daemon's loop did not start"
    try:
        cfg = ServerConfig(port=free_port(), size="8MiB", prefault=False, hugepages=False,
                           disk=str(tmp_path / "d"), disk_size="1MiB",
                           redis=f"lmc://127.0.0.1:{port}",
                           cache={"remote_options": {"client_name": "chained-daemon"}})
        pool, storage = build_storage(cfg)
        try:
            assert [t.name for t in storage.tiers] == ["cpu", "disk", "server"]
            remote = storage.tiers[2]
            assert isinstance(remote, ServerBackend)
            assert remote._client_name == "chained-daemon"
            key = b"c" * 16
            o = storage.allocate((1, 2, 16, 64), torch.float16, 16)
            o.tensor.fill_(3.0)
            storage.put([key], [o])
            o.release()
            assert storage.flush(10)
            assert remote.contains([key]) == [True]  # written down to the daemon below
        finally:
            storage.close()
            pool.close()
        assert pool.leaks == []
    finally:
        loops[0].call_soon_threadsafe(below.request_stop)
        thread.join(30)
    assert not thread.is_alive()
