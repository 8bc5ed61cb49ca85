"""Test helpers for the lookup service's Unix sockets."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deadlines import HANG_S


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short directory for socket files (pytest's tmp_path can exceed sockaddr_un's 108
    bytes)."""
    d = Path("/tmp") / f"lmc-test-{os.getpid()}-{time.monotonic_ns()}"
    d.mkdir()
    yield d
    for f in d.iterdir():
        f.unlink()
    d.rmdir()


def send_and_expect_close(path: str, payload: bytes) -> None:
    """Send raw bytes to a server and check that it hangs up without answering."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(path)
        s.sendall(payload)
        s.settimeout(HANG_S)
        # closed by the server (a reset when our unread bytes were pending)
        with contextlib.suppress(ConnectionResetError):
            assert s.recv(16) == b""
