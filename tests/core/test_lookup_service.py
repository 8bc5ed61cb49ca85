"""The scheduler-to-worker lookup service (no vLLM needed): answers, minimum over ranks,
timeouts and broken peers count as 0 hits quickly, never a hang."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from lmc.connectors.vllm_lookup import (
    LOCAL_ENGINES,
    LookupClient,
    LookupServer,
    encode_request,
    socket_path,
)


@pytest.fixture
def sock_dir(tmp_path: Path) -> Path:
    d = Path("/tmp") / f"lmc-test-{os.getpid()}-{time.monotonic_ns()}"
    d.mkdir()
    yield d
    for f in d.iterdir():
        f.unlink()
    d.rmdir()


def prefix_answer(limit: int, l1: int):
    def fn(tokens: np.ndarray) -> tuple[int, int]:
        return min(limit, len(tokens)), min(l1, len(tokens))
    return fn


def Client(paths: list[str], timeout: float) -> LookupClient:  # noqa: N802
    """Over the socket, although the servers live in this process."""
    return LookupClient(paths, timeout, use_local=False)


def test_socket_path_is_short_and_per_rank():
    a = socket_path("/tmp", "8dcf2909-6202-40f1-8cce-9a378f64636a", 0, 0)
    b = socket_path("/tmp", "8dcf2909-6202-40f1-8cce-9a378f64636a", 0, 1)
    c = socket_path("/tmp", "8dcf2909-6202-40f1-8cce-9a378f64636a", 1, 0)
    assert len({a, b, c}) == 3 and len(a) < 100


def test_answers_over_the_socket(sock_dir):
    path = str(sock_dir / "r0.sock")
    server = LookupServer(path, prefix_answer(512, 256))
    client = Client([path], timeout=2)
    try:
        assert client.lookup(list(range(700))) == (512, 256)
        assert client.lookup(np.arange(100)) == (100, 100)
        assert server.requests == 2 and client.stats.rank_failures == 0
    finally:
        client.close()
        server.close()
    assert not os.path.exists(path)


def test_minimum_over_ranks(sock_dir):
    paths = [str(sock_dir / f"r{i}.sock") for i in range(3)]
    servers = [LookupServer(p, prefix_answer(n, n)) for p, n in zip(paths, (768, 256, 512))]
    client = Client(paths, timeout=2)
    try:
        assert client.lookup(list(range(1000))) == (256, 256)
    finally:
        client.close()
        for s in servers:
            s.close()


def test_in_process_engines_are_called_directly(sock_dir):
    path = str(sock_dir / "r0.sock")
    server = LookupServer(path, prefix_answer(300, 0))
    client = LookupClient([path], timeout=2)
    try:
        assert LOCAL_ENGINES[path] is not None
        assert client.lookup(list(range(400))) == (300, 0)
        assert client.stats.local_calls == 1 and server.requests == 0
    finally:
        server.close()
    assert path not in LOCAL_ENGINES


def test_missing_rank_is_zero_hits(sock_dir):
    client = Client([str(sock_dir / "nobody.sock")], timeout=0.5)
    t0 = time.perf_counter()
    assert client.lookup([1, 2, 3]) == (0, 0)
    assert time.perf_counter() - t0 < 0.5
    assert client.stats.rank_failures == 1


def test_slow_rank_times_out_and_recovers(sock_dir):
    path = str(sock_dir / "slow.sock")
    delay = {"s": 1.0}

    def slow(tokens: np.ndarray) -> tuple[int, int]:
        time.sleep(delay["s"])
        return len(tokens), 0

    server = LookupServer(path, slow)
    client = Client([path], timeout=0.2)
    try:
        t0 = time.perf_counter()
        assert client.lookup(list(range(10))) == (0, 0)
        assert time.perf_counter() - t0 < 0.6  # bounded by the timeout, not the server
        delay["s"] = 0.0
        time.sleep(1.1)  # the late answer goes to the dropped connection, not the next one
        assert client.lookup(list(range(20))) == (20, 0)
    finally:
        client.close()
        server.close()


def test_one_slow_rank_of_two_is_zero(sock_dir):
    fast, slow = str(sock_dir / "a.sock"), str(sock_dir / "b.sock")
    s1 = LookupServer(fast, prefix_answer(100, 100))
    s2 = LookupServer(slow, lambda t: (time.sleep(1.0), (len(t), 0))[1])
    client = Client([fast, slow], timeout=0.2)
    try:
        assert client.lookup(list(range(50))) == (0, 0)
        assert client.lookup(list(range(50))) == (0, 0)  # both reconnect cleanly
    finally:
        client.close()
        s1.close()
        s2.close()


def test_failing_engine_answers_zero(sock_dir):
    path = str(sock_dir / "err.sock")

    def broken(tokens: np.ndarray) -> tuple[int, int]:
        raise OSError("tier down")

    server = LookupServer(path, broken)
    client = Client([path], timeout=2)
    try:
        assert client.lookup([5, 6]) == (0, 0)
        assert server.errors == 1 and client.stats.rank_failures == 0
    finally:
        client.close()
        server.close()


def test_garbage_request_closes_only_that_connection(sock_dir):
    path = str(sock_dir / "g.sock")
    server = LookupServer(path, prefix_answer(7, 7))
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(path)
            s.sendall(b"HTTP/1.1 GET /\r\n\r\n")
            s.settimeout(2)
            # closed by the server (a reset when our unread bytes were pending)
            with contextlib.suppress(ConnectionResetError):
                assert s.recv(16) == b""
        client = Client([path], timeout=2)
        assert client.lookup([1] * 10) == (7, 7)
        client.close()
    finally:
        server.close()


def test_oversized_request_is_refused_by_the_client():
    with pytest.raises(ValueError, match="exceed"):
        encode_request(np.zeros((1 << 24) + 1, dtype=np.int64))


def test_stale_socket_file_is_replaced_live_one_is_not(sock_dir):
    path = str(sock_dir / "stale.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.close()  # file left behind, nobody listening
    server = LookupServer(path, prefix_answer(1, 1))
    try:
        with pytest.raises(RuntimeError, match="engine_id"):
            LookupServer(path, prefix_answer(2, 2))
    finally:
        server.close()


def test_concurrent_clients(sock_dir):
    path = str(sock_dir / "c.sock")
    server = LookupServer(path, prefix_answer(10**6, 0))
    errors: list[BaseException] = []

    def hammer(n: int) -> None:
        client = Client([path], timeout=2)
        try:
            for i in range(50):
                assert client.lookup(list(range(n + i))) == (n + i, 0)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            client.close()

    threads = [threading.Thread(target=hammer, args=(k * 100,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    server.close()
    assert not errors
