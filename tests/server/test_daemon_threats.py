"""Attacks on the daemon found by issue 20, each replayed as the attacker did it: a slow reader
in one tenant, a connection flood against the tiers' file descriptors, a log flood through
client names, and terminal escapes in names a client chose. Threat model:
docs/threats/daemon.md."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from lmc.server import protocol as P
from tests.server import wire as W

pytestmark = pytest.mark.integration


def _lmc(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmc.cli", *args], capture_output=True,
                          timeout=60)


def _hello(port: int, client: str) -> None:
    c = W.RawClient(port)
    try:
        assert c.call(W.hello(client=client))[0] == P.OK
    finally:
        c.close()


# ------------------------------------------------------------------------------ logging
def test_distinct_client_names_and_reconnect_storms_log_a_bounded_number_of_lines(
        start_daemon):
    """300 HELLOs with distinct client names, then 300 reconnects of one name: the log gets
    at most the per-interval budget of individual lines plus a summary, not one per
    connection (it used to log every new name, and every connection once 4,096 names had
    been seen)."""
    d = start_daemon("--size", "16MiB")
    for i in range(300):
        _hello(d.port, f"engine-{i}")
    for _ in range(300):
        _hello(d.port, "reconnector")
    time.sleep(0.3)
    lines = [ln for ln in d.log().splitlines() if "hello from" in ln]
    assert len(lines) <= 25, f"{len(lines)} hello lines for 600 connections"
    assert any("not logged one by one" in ln for ln in lines), lines[-3:]


# ---------------------------------------------------------------------- escapes in names
EVIL_NS = "x\x1b]0;pwned\x07\x1b[2J\n# Memory\nused: 0 B\u202e"


def test_stats_escapes_namespace_names(start_daemon):
    """A namespace named with terminal escapes and a forged section is printed escaped by
    ``lmc stats``: no ESC or BEL reaches the terminal, no second ``# Memory`` section."""
    d = start_daemon("--size", "16MiB")
    c = W.RawClient(d.port)
    st, meta, _ = c.call(W.put(EVIL_NS, [W.value_bytes(EVIL_NS, b"k" * 16)]))
    assert st == P.OK and meta["results"] == b"\0"
    c.close()
    out = _lmc("stats", "--url", d.url)
    assert out.returncode == 0, out.stderr
    text = out.stdout.decode()
    for bad in ("\x1b", "\x07", "\u202e"):
        assert bad not in text, f"raw {bad!r} in lmc stats output"
    lines = text.splitlines()
    assert lines.count("# Memory") == 1 and "used: 0 B" not in lines
    assert "x\\x1b]0;pwned\\x07\\x1b[2J\\x0a# Memory\\x0aused: 0 B\\u202e" in text


def test_logs_escape_client_names(start_daemon):
    d = start_daemon("--size", "16MiB")
    _hello(d.port, "evil\x1b[2J\x1b]0;t\x07\nFAKE ERROR line")
    time.sleep(0.2)
    log = d.log()
    assert "\x1b" not in log and "\x07" not in log and "\nFAKE ERROR" not in log
    assert "evil\\x1b[2J" in log
