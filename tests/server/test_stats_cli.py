"""``lmc stats`` against a real daemon: INFO-style sections with human units and hit rates,
JSON, --watch, a closed pipe, token, unreachable server, namespaces after writes."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

from lmc.storage.backends.server import protocol as P
from tests.server import wire
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


# ------------------------------------------------------------ operator view (issue 15)
def _traffic(port: int, ns: str, n: int = 4, asked: int = 6) -> None:
    """PUT ``n`` values into ``ns`` and GET ``asked`` keys (``n`` of them present)."""
    c = wire.RawClient(port)
    try:
        assert c.call(wire.hello(client="stats-test"))[0] == P.OK
        keys = [bytes([i]) * 16 for i in range(asked)]
        status, meta, _ = c.call(wire.put(ns, [wire.value_bytes(ns, k) for k in keys[:n]]))
        assert status == P.OK and meta["results"] == bytes(n)
        assert c.call(wire.frame(P.GET, {"ns": ns, "keys": keys}))[0] == P.OK
    finally:
        c.close()


def test_namespaces_show_up_after_writes(start_daemon):
    d = start_daemon("--size", "64MiB")  # no quotas: no ledgers, yet the namespace is listed
    _traffic(d.port, "team-a")
    stats = json.loads(_lmc("stats", "--url", d.url, "--json").stdout)
    ns = stats["namespaces"]["team-a"]
    assert (ns["puts"], ns["stored"], ns["gets"], ns["get_keys"], ns["hits"]) == (1, 4, 1, 6, 4)
    assert stats["requests"]["hits"] == 4


def test_info_sections_human_units_and_hit_rates(start_daemon):
    d = start_daemon("--size", "64MiB")
    _traffic(d.port, "team-a")
    out = _lmc("stats", "--url", d.url)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for section in ("# Server", "# Memory", "# Requests (since start)", "# Tiers",
                    "# Namespaces (1)"):
        assert section in text, text
    assert "of 64.0 MiB" in text and "hit rate: 66.7% (4/6) keys" in text
    assert "team-a: puts 1, gets 1, hit rate 66.7% (4/6) keys" in text
    assert re.search(r"uptime: [\d.]+ (ms|s)\b", text)
    tiers = text.split("# Tiers\n", 1)[1].split("\n\n", 1)[0].splitlines()
    # other groups: own section; the tier's declared medium, when the daemon says it
    assert len(tiers) == 1 and re.match(r"cpu( \[memory[^]]*\])?: ", tiers[0]), tiers
    assert not re.search(r"\b\d{7,}\b", text), "a raw byte count in the human view"
    assert not re.search(r"\d\.\d{5,}", text), "a raw float in the human view"


def test_watch_repeats_with_interval_rates_and_stops_on_ctrl_c(shared_daemon):
    p = subprocess.Popen([sys.executable, "-m", "lmc.cli", "stats", "--url", shared_daemon.url,
                          "--watch", "0.3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        seen, deadline = "", time.monotonic() + 60
        while "# Requests (last" not in seen and time.monotonic() < deadline:
            seen += p.stdout.readline()  # the second sample: rates over the last interval
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=30)
    finally:
        p.kill()
    assert seen.count("# Server") >= 2 and "# Requests (last" in seen, seen
    assert p.returncode == 130 and "Traceback" not in err, err


def test_closed_pipe_is_not_a_traceback(shared_daemon):
    """``lmc stats --watch | head -1``: the reader leaves, lmc exits quietly."""
    p = subprocess.Popen([sys.executable, "-m", "lmc.cli", "stats", "--url", shared_daemon.url,
                          "--watch", "0.2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout.readline()
    p.stdout.close()
    try:
        err = p.stderr.read().decode()
        p.wait(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 141 and err == "", err
