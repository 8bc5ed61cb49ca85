"""``lmc stats`` against a real daemon: plain and JSON output, token, unreachable server."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.server.daemon_proc import free_port


def _lmc(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmc.cli", *args], capture_output=True,
                          text=True, timeout=60, env=env)


def test_stats_of_a_running_daemon(shared_daemon):
    out = _lmc("stats", "--url", shared_daemon.url, "--json")
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)
    assert isinstance(stats, dict) and stats
    plain = _lmc("stats", "--url", shared_daemon.unix_url)
    assert plain.returncode == 0, plain.stderr
    assert len(plain.stdout.splitlines()) >= 3


def test_token_is_required_and_read_from_a_file(start_daemon, tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    d = start_daemon("--size", "64MiB", "--token-file", str(token))
    denied = _lmc("stats", "--url", d.url)
    assert denied.returncode == 2 and "rejected the connection" in denied.stderr
    assert "s3cret" not in denied.stderr
    ok = _lmc("stats", "--url", d.url, "--token-file", str(token), "--json")
    assert ok.returncode == 0, ok.stderr
    assert isinstance(json.loads(ok.stdout), dict)


def test_unreachable_server_is_a_clear_error():
    out = _lmc("stats", "--url", f"lmc://127.0.0.1:{free_port()}", "--timeout", "1")
    assert out.returncode == 2 and "cannot reach" in out.stderr
