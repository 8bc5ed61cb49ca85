"""The daemon as a real process, through the ``lmc://`` tier: round trips over TCP and the
Unix socket, authentication, eviction under a flood, 16 concurrent namespaced clients,
answers cut to the frame bound, metrics, graceful SIGTERM."""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from lmc.memory.pool import MemoryPool
from lmc.storage.backends.server import protocol as P
from lmc.storage.backends.server.client import ServerError
from lmc.storage.serde import encode_header, tensor_bytes
from lmc.storage.tier import create_backend
from tests.kvutil import DTYPES, assert_bits_equal, random_bits
from tests.server.daemon_proc import client_pool

pytestmark = pytest.mark.integration


def _chunks(pool: MemoryPool, n: int, shape=(2, 2, 16, 64), dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    objs = []
    for _ in range(n):
        o = pool.allocate(shape, dtype, shape[2])
        o.tensor.copy_(random_bits(shape, dtype, gen))
        objs.append(o)
    return objs


def _keys(n: int, tag: int = 0) -> list[bytes]:
    return [bytes([tag, i % 256, i // 256]) * 5 + b"k" for i in range(n)]


def _release(objs) -> None:
    for o in objs:
        if o is not None:
            o.release()


@pytest.mark.parametrize("via", ["tcp", "unix"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_bit_exact(shared_daemon, via, dtype):
    cfg, pool = client_pool()
    url = shared_daemon.url if via == "tcp" else shared_daemon.unix_url
    tier = create_backend(f"{url}?ns=rt-{via}-{dtype}", cfg, pool)
    keys = _keys(6)
    objs = _chunks(pool, 6, dtype=dtype, seed=hash(via) & 0xFFFF)
    assert tier.put(keys, objs) == 6
    probe = [*keys[:3], b"m" * 16, *keys[3:]]
    assert tier.contains(probe) == [True, True, True, False, True, True, True]
    assert tier.prefix_hits(probe) == 3
    got = tier.get(probe)
    assert got[3] is None
    for o, g in zip(objs, got[:3] + got[4:]):
        assert_bits_equal(g.tensor, o.tensor, f"{via} {dtype}")
        assert (g.shape, g.dtype, g.num_tokens) == (o.shape, o.dtype, o.num_tokens)
    _release(got)
    assert tier.delete(keys[:2]) == 2
    assert tier.contains(keys[:3]) == [False, False, True]
    _release(objs)
    tier.close()
    assert pool.used_bytes == 0


def test_answers_cut_to_the_frame_bound_and_resumed(shared_daemon):
    """Six 1.5 MiB values with 4 MiB frames: the PUT is split, the GET answer comes back in
    parts (``more``), the client asks again and gets everything, in order."""
    cfg, pool = client_pool("64MiB")
    tier = create_backend(shared_daemon.url + "?ns=big", cfg, pool)
    objs = _chunks(pool, 6, shape=(4, 2, 96, 1024), seed=3)
    keys = _keys(6, tag=9)
    assert tier.put(keys, objs) == 6
    got = tier.get(keys)
    for o, g in zip(objs, got):
        assert_bits_equal(g.tensor, o.tensor, "resumed GET")
    _release(got)
    _release(objs)
    tier.close()


def test_sixteen_concurrent_clients_no_cross_talk(shared_daemon):
    """16 clients in 16 namespaces write the *same* keys with different values at once;
    each reads back only its own, and a namespace nobody wrote sees nothing."""
    keys = _keys(8, tag=42)
    errors: list[str] = []
    barrier = threading.Barrier(16)

    def client(i: int) -> None:
        cfg, pool = client_pool("8MiB")
        url = (shared_daemon.url if i % 2 else shared_daemon.unix_url) + f"?ns=tenant-{i}"
        tier = create_backend(url, cfg, pool)
        try:
            objs = _chunks(pool, 8, shape=(2, 2, 16, 64), dtype=torch.float32, seed=1000 + i)
            barrier.wait()
            for _ in range(3):
                if tier.put(keys, objs) != 8:
                    errors.append(f"{i}: put incomplete")
                got = tier.get(keys)
                for o, g in zip(objs, got):
                    if g is None or not torch.equal(g.tensor.view(torch.int32),
                                                    o.tensor.view(torch.int32)):
                        errors.append(f"client {i} read another namespace's value")
                _release(got)
            _release(objs)
        except Exception as e:  # reported below, with the client's number
            errors.append(f"{i}: {type(e).__name__}: {e}")
        finally:
            tier.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[:5]
    cfg, pool = client_pool("8MiB")
    other = create_backend(shared_daemon.url + "?ns=nobody", cfg, pool)
    assert other.contains(keys) == [False] * 8
    other.close()


def test_metrics_and_healthz(shared_daemon):
    base = f"http://127.0.0.1:{shared_daemon.info['metrics_port']}"
    assert urllib.request.urlopen(base + "/healthz", timeout=5).read() == b"ok\n"
    text = urllib.request.urlopen(base + "/metrics", timeout=5).read().decode()
    for name in ("lmc_server_requests_total", "lmc_server_pool_used_bytes",
                 "lmc_server_connections", "lmc_server_bytes_total"):
        assert name in text
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(base + "/nope", timeout=5)


# --------------------------------------------------------------------- auth
def _raw_put_frame(key: str = "a" * 16, seed: int = 0, ns: str = "lmc"):
    """A PUT frame of one 1 MiB value in namespace ``ns``, and the value (in its own pool)."""
    _, pool = client_pool("2MiB")
    [o] = _chunks(pool, 1, shape=(4, 2, 64, 1024), seed=seed)
    payload = bytes(tensor_bytes(o.tensor))
    item = encode_header(key.encode(), o.shape, o.dtype, o.num_tokens, payload)
    meta = P.pack_meta({"ns": ns, "items": [item]})
    return P.pack_header(P.PUT, 1, len(meta), len(payload)) + meta + payload, o


def _answer_then_eof(sock: socket.socket) -> int:
    head = b""
    while len(head) < P.FRAME_SIZE:
        chunk = sock.recv(P.FRAME_SIZE - len(head))
        assert chunk, "closed without an answer"
        head += chunk
    h = P.unpack_header(head)
    rest = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        rest += chunk
    assert len(rest) == h.meta_len, "nothing but the error answer may follow"
    return h.status


def test_token_required_before_anything(start_daemon, tmp_path):
    tok = tmp_path / "token"
    tok.write_text("correct horse\n")
    d = start_daemon("--size", "16MiB", "--token-file", str(tok))
    before = d.stats(token="correct horse")
    # 1. no HELLO at all: a PUT with its payload is refused after the 24-byte header
    s = socket.create_connection(("127.0.0.1", d.port), timeout=5)
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        s.sendall(_raw_put_frame()[0])
    assert _answer_then_eof(s) == P.AUTH_FAILED
    s.close()
    # 2. a wrong token, and a missing one
    for meta in ({"token": "hunter2-bogus"}, {}):
        s = socket.create_connection(("127.0.0.1", d.port), timeout=5)
        m = P.pack_meta(meta)
        s.sendall(P.pack_header(P.HELLO, 1, len(m)) + m)
        assert _answer_then_eof(s) == P.AUTH_FAILED
        s.close()
    with pytest.raises(ServerError, match="auth_failed"):
        d.connect(token="hunter2-bogus")
    # 3. through the tier: a wrong token is a miss, never an exception
    cfg, pool = client_pool("8MiB")
    bad = create_backend(d.url, cfg.replace(remote_token="hunter2-bogus"), pool)
    objs = _chunks(pool, 2)
    assert bad.put(_keys(2), objs) == 0 and bad.contains(_keys(2)) == [False, False]
    bad.close()
    after = d.stats(token="correct horse")
    assert after["pool"]["used"] == before["pool"]["used"] == 0  # no data moved in
    good = create_backend(d.url, cfg.replace(remote_token="correct horse"), pool)
    assert good.put(_keys(2), objs) == 2 and good.contains(_keys(2)) == [True, True]
    good.close()
    _release(objs)
    log = d.log()
    assert "authentication" in log and "correct horse" not in log and "hunter2-bogus" not in log


# ------------------------------------------------------------------- flood
def test_write_flood_evicts_and_stays_within_size(start_daemon):
    d = start_daemon("--size", "32MiB")
    rss0 = d.rss()
    cfg, pool = client_pool("16MiB")
    tier = create_backend(d.url, cfg, pool)
    objs = _chunks(pool, 8, shape=(4, 2, 64, 1024), seed=5)  # 8 x 1 MiB, reused
    total = 0
    for r in range(20):  # 160 MiB of distinct keys into a 32 MiB daemon
        keys = _keys(8, tag=r + 1)
        assert tier.put(keys, objs) == 8
        total += 8 << 20
        st = d.stats()
        assert st["pool"]["used"] <= st["pool"]["capacity"] == 32 << 20
    st = d.stats()
    assert st["tiers"]["cpu.evictions"] >= (total - (32 << 20)) // (1 << 20) - 1
    last = tier.get(_keys(8, tag=20))
    for o, g in zip(objs, last):
        assert_bits_equal(g.tensor, o.tensor, "most recent chunks survive")
    _release(last)
    assert tier.contains(_keys(8, tag=1)) == [False] * 8
    assert d.rss() - rss0 < (32 + 24) << 20  # the pool's pages plus slack, not the flood
    _release(objs)
    tier.close()


# --------------------------------------------------------------- shutdown
def test_sigterm_finishes_in_flight_and_flushes_disk(start_daemon, tmp_path):
    """SIGTERM while a PUT is half-received: that request is still answered (stored), the
    daemon exits 0, and everything answered before the exit is served by the next daemon
    from the same disk directory."""
    disk = tmp_path / "disk"
    d = start_daemon("--size", "64MiB", "--disk", str(disk))
    cfg, pool = client_pool("64MiB")
    tier = create_backend(d.url, cfg, pool)
    objs = _chunks(pool, 8, shape=(4, 2, 64, 1024), seed=8)
    keys = _keys(8, tag=77)
    assert tier.put(keys, objs) == 8
    tier.close()
    frame, late = _raw_put_frame("late-key-0123456", seed=9)
    s = socket.create_connection(("127.0.0.1", d.port), timeout=10)
    cut = len(frame) - 1000
    s.sendall(frame[:cut])
    time.sleep(0.2)
    d.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    s.sendall(frame[cut:])  # the rest of the in-flight request arrives after the signal
    head = s.recv(P.FRAME_SIZE, socket.MSG_WAITALL)
    h = P.unpack_header(head)
    meta = P.unpack_meta(s.recv(h.meta_len, socket.MSG_WAITALL), P.Limits())
    assert h.status == P.OK and meta["results"] == bytes([P.STORED])
    assert s.recv(1) == b"", "a draining daemon closes the connection after the answer"
    s.close()
    assert d.proc.wait(60) == 0
    log = d.log()
    assert "draining" in log and "lmc server stopped" in log
    d2 = start_daemon("--size", "64MiB", "--disk", str(disk), name="after")
    tier = create_backend(d2.url, cfg, pool)
    got = tier.get([*keys, b"late-key-0123456"])
    for o, g in zip([*objs, late], got):
        assert g is not None, "a value answered before SIGTERM was not flushed to disk"
        assert_bits_equal(g.tensor, o.tensor, "served after restart")
    _release(got)
    _release([*objs, late])
    tier.close()


def _bytes_in(d) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{d.info['metrics_port']}/metrics",
                                  timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith('lmc_server_bytes_total{direction="in"}'):
            return float(line.split()[-1])
    return 0.0


def test_values_the_server_holds_are_not_sent_again(shared_daemon):
    cfg, pool = client_pool()
    tier = create_backend(shared_daemon.url + "?ns=dedup", cfg, pool)
    objs = _chunks(pool, 4, seed=21)
    keys = _keys(4, tag=21)
    assert tier.put(keys, objs) == 4
    before = _bytes_in(shared_daemon)
    assert tier.put(keys, objs) == 4  # probed: all present, nothing transferred
    assert _bytes_in(shared_daemon) == before
    _release(objs)
    tier.close()


def test_full_pool_is_a_counted_miss(shared_daemon):
    """A value the daemon holds but the client's pool has no room for is a miss, and a counted
    one: the model-based engine tests found such misses with no counter saying why."""
    cfg, pool = client_pool()
    tier = create_backend(shared_daemon.url + "?ns=fullpool", cfg, pool)
    keys = _keys(3, tag=7)
    objs = _chunks(pool, 3)
    assert tier.put(keys, objs) == 3
    hogs = []
    while (h := pool.allocate((1, 1, 4, 1024), torch.uint8, 4)) is not None:
        hogs.append(h)  # fill the pool
    assert tier.get(keys) == [None] * 3
    assert tier.stats()["alloc_failures"] == 3 and tier.stats()["failures"] == 0
    _release(hogs)
    got = tier.get(keys)  # room again: the same values come back
    for o, g in zip(objs, got):
        assert_bits_equal(g.tensor, o.tensor, "after the pool emptied")
    _release(got)
    _release(objs)
    tier.close()
    assert pool.used_bytes == 0
