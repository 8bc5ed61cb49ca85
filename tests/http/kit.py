"""What the HTTP fronts' attack tests share (threat model: docs/threats/http.md): the tiny
model and the answer it must keep giving, a reference server in this process, raw-socket
requests, the bodies every front must refuse by name (:data:`FIELD_ERRORS`, the fuzz's
:data:`BODIES`), a scripted lying upstream (:class:`Liar`) and the socket flood at
RLIMIT_NOFILE 128. The suite every front runs is ``tests/http/test_attacks.py``; the fronts
it runs against are :data:`tests.http.fronts.FRONTS`."""

from __future__ import annotations

import contextlib
import json
import re
import resource
import socket
import subprocess
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

from hypothesis import strategies as st

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


# ------------------------------------------------------------ what every front refuses

NESTED = b'{"prompt": [1, 2], "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
FIELD_ERRORS = [  # (raw body, the field the 400 must name)
    (b'{"prompt": [1, 2, 3], "temperature": NaN}', "temperature"),
    (b'{"prompt": [1, 2, 3], "temperature": Infinity}', "temperature"),
    (b'{"prompt": [1, 2, 3], "temperature": -1e-300}', "temperature"),
    (b'{"prompt": [1, 2, 3], "top_p": NaN}', "top_p"),
    (b'{"prompt": [1, 2, 3], "top_p": -Infinity}', "top_p"),
    (b'{"prompt": "\\ud800 hi"}', "prompt"),
    (b'{"prompt": ["\\udfff"]}', "prompt"),
    (b'{"prompt": [1, 2, 3], "max_tokens": Infinity}', "max_tokens"),
    (b'{"prompt": [1, 2, 3], "max_tokens": 1e999}', "max_tokens"),
    (b'{"prompt": [1, 2, 3], "max_tokens": NaN}', "max_tokens"),
    (b'{"prompt": [1, 2, 3], "max_tokens": 18446744073709551616}', "max_tokens"),
    (b'{"prompt": [1, 2, 3], "seed": 18446744073709551616}', "seed"),
    (b'{"prompt": [1, 2, 3], "seed": -18446744073709551616}', "seed"),
    (b'{"prompt": [1, 2, 3], "seed": 1.5}', "seed"),
    (b'{"prompt": [1, 2, 3], "stream": true, "stream_options": 5}', "stream_options"),
    (b'{"prompt": [1, 2, 3], "stream": true, "stream_options": {"include_usage": 5}}',
     "include_usage"),
    (b'{"prompt": [1, 2, 3], "stream": "yes"}', "stream"),
    (b'{"prompt": [1, 2, 3], "model": {"a": 1}}', "model"),
    (b'{"prompt": [1, 99999999999999999999999]}', "out of range"),
    (NESTED, "nested"),
    (b"[" * 100_000 + b"]" * 100_000, "nested"),
]

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8)
    | st.sampled_from(["\ud800", 2**64, -(2**64), 1e-300, 5e-324]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                 max_size=4),
    max_leaves=12)
FIELDS = ["prompt", "max_tokens", "temperature", "top_p", "seed", "ignore_eos", "stream",
          "stream_options", "return_token_ids", "kv_transfer_params", "model"]
SURROGATES = st.sampled_from(["\ud800", "a\udfff b", "\udbff\udc00"])  # lone and a pair
PROMPTS = (st.lists(st.integers(0, 2047), min_size=1, max_size=8) | st.text(max_size=8)
           | SURROGATES | JSON)
BODIES = st.fixed_dictionaries({"prompt": PROMPTS}, optional={
    f: st.integers(-3, 70) | JSON if f in ("max_tokens", "seed") else JSON
    for f in FIELDS[1:]}) | JSON
"""Random completion bodies: the fuzz tests' (any JSON value, mostly near a real request)."""


# ------------------------------------------------------------- a lying upstream

class Liar:
    """An upstream that reads each request and answers ``self.answer``: raw bytes, or
    ``"close"`` (hang up unanswered) or ``"hang"`` (never answer). A health probe (GET) is
    answered 200 unless it hangs."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.answer: bytes | str = b""
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(10)
            buf = b""
            with contextlib.suppress(OSError):
                while b"\r\n\r\n" not in buf:
                    buf += conn.recv(65536)
                head, _, body = buf.partition(b"\r\n\r\n")
                if head.startswith(b"GET "):  # the front's health probe
                    if self.answer == "hang":
                        self.stop.wait(HANG_S)
                    else:
                        conn.sendall(http200(b"{}"))
                    return
                m = re.search(rb"Content-Length: (\d+)", head)
                assert m is not None, head
                while len(body) < int(m.group(1)):
                    body += conn.recv(65536)
                if self.answer == "hang":
                    self.stop.wait(HANG_S)
                elif self.answer != "close":
                    conn.sendall(self.answer)

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


def http200(body: bytes, extra: bytes = b"") -> bytes:
    return (b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s"
            b"\r\n%s" % (len(body), extra, body))
