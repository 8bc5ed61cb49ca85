"""What the attack tests of both HTTP servers share (``tests/reference/test_serve_attacks.py``,
``tests/router/test_pd_proxy_attacks.py``; threat model: docs/threats/http.md): the tiny model
and the answer it must keep giving, a reference server in this process, raw-socket requests,
and the socket flood at RLIMIT_NOFILE 128."""

from __future__ import annotations

import contextlib
import json
import resource
import socket
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from lmc.http.json_api import HttpLimits
from lmc.reference import LLM, make_tiny_checkpoint
from lmc.reference.serve import Server
from tests.deadlines import HANG_S

PROMPT = [5, 17, 99, 3, 250, 7, 41, 12]
NORMAL = {"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True, "return_token_ids": True}
LIMITS = HttpLimits(max_connections=16, read_timeout=1.0, max_body=256 << 10)
"""A short read timeout: the tests that a request is dropped at it wait for it."""
PATIENT = HttpLimits(max_connections=16, read_timeout=HANG_S, max_body=256 << 10)
"""A read timeout only a hang reaches: "answered at once, not at the read timeout" is then
told apart from the timeout whatever this machine's load (tests/deadlines.py)."""


def tiny_model(folder: Path) -> Path:
    return make_tiny_checkpoint(folder / "tiny", hidden=64, layers=2, max_position_embeddings=64)


def expected_tokens(ckpt: Path) -> list[int]:
    """What an untouched engine answers to :data:`NORMAL`: every attack must leave it so."""
    with LLM(ckpt, num_blocks=32) as llm:
        return llm.generate([PROMPT], max_tokens=4, ignore_eos=True)[0].token_ids


@contextlib.contextmanager
def running_server(ckpt: Path, limits: HttpLimits = LIMITS) -> Iterator[Server]:
    srv = Server(LLM(ckpt, num_blocks=32), limits=limits)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield srv
    finally:
        srv.close()


def exchange(port: int, data: bytes, timeout: float = HANG_S) -> tuple[int, bytes]:
    """Send ``data`` on a fresh socket, read the answer to EOF: ``(status, body)``."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        return read_answer(s)


def read_answer(s: socket.socket) -> tuple[int, bytes]:
    buf = b""
    while chunk := s.recv(65536):
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def post(port: int, body: bytes | dict, timeout: float = HANG_S) -> tuple[int, bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return exchange(port, b"POST /v1/completions HTTP/1.0\r\nContent-Length: %d\r\n\r\n%s"
                    % (len(data), data), timeout)


def message(raw: bytes) -> str:
    return json.loads(raw)["error"]["message"]


def low_nofile() -> None:
    """``preexec_fn``: the issue's RLIMIT_NOFILE of 128 for the server under attack."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))


def flood_then_serve(proc: subprocess.Popen, port: int, log: Path, want: list[int],
                     bad_bodies: Iterable[bytes]) -> None:
    """300 half-sent request lines held open against ``port``; then ordinary requests are
    answered with ``want``, ordinary mistakes with a 400, the process still runs and its log
    has neither EMFILE nor a traceback. Kills ``proc`` at the end."""
    socks = []
    try:
        for _ in range(300):
            with contextlib.suppress(OSError):  # refused ones are closed by the server
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                s.sendall(b"POST /v1/comp")
                socks.append(s)
        for _ in range(3):
            status, raw = post(port, NORMAL)
            assert status == 200 and json.loads(raw)["choices"][0]["token_ids"] == want, raw
        for body in bad_bodies:
            assert post(port, body)[0] == 400
        assert proc.poll() is None
        text = log.read_text()
        assert "Too many open files" not in text and "Traceback" not in text, text[-3000:]
    finally:
        for s in socks:
            s.close()
        proc.kill()
        proc.wait(30)


def wait_for(path: Path, proc: subprocess.Popen, log: Path, within: float = 60) -> None:
    end = time.monotonic() + within
    while not path.exists():
        assert proc.poll() is None and time.monotonic() < end, log.read_text()[-2000:]
        time.sleep(0.1)
