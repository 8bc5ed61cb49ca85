"""The reference server as an operator starts it: the port is bound before the model loads,
``/health`` is 503 saying what it waits for (the model, then the lmc pool's pre-fault) and
200 only at full speed, "serving" is printed then; ``/metrics`` carries lmc's engine series;
every request answered is one INFO access-log line (both HTTP servers), but for health
probes and scrapes (DEBUG: the fronts probe every 2 s)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from lmc.reference import make_tiny_checkpoint
from lmc.router.pd_proxy import Proxy

ROOT = Path(__file__).resolve().parents[2]


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _post(url: str, body: dict) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A server with lmc (a 512 MiB pool), /health polled from the moment it listens."""
    work = tmp_path_factory.mktemp("ready")
    ckpt = make_tiny_checkpoint(work / "llama")
    cfg = work / "lmc.yaml"
    cfg.write_text("chunk_size: 16\nlocal_cpu_size: 512MiB\npin_memory: 'false'\n")
    ready = work / "ready.json"
    log = open(work / "server.log", "w")  # noqa: SIM115 - the child writes it
    proc = subprocess.Popen([sys.executable, "-m", "lmc.reference.serve", "--model", str(ckpt),
                             "--port", "0", "--lmc-config", str(cfg), "--ready-file",
                             str(ready), "--num-blocks", "64"], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    health: list[tuple[int, dict]] = []
    deadline = time.monotonic() + 180
    url = None
    while not ready.exists():
        assert proc.poll() is None, (work / "server.log").read_text()[-3000:]
        assert time.monotonic() < deadline, (work / "server.log").read_text()[-3000:]
        text = (work / "server.log").read_text()
        if url is None and "listening at " in text:
            url = text.split("listening at ", 1)[1].split()[0]
        if url is not None:
            status, body = _get(url + "/health")
            health.append((status, json.loads(body)))
        time.sleep(0.02)
    info = json.loads(ready.read_text())
    yield info["url"], health, proc, work / "server.log"
    proc.terminate()
    proc.wait(30)
    log.close()


def test_health_is_503_naming_what_it_waits_for_then_200(served):
    url, health, _, _ = served
    assert health, "the server never listened before it was ready"
    waits = [b for s, b in health if s == 503]
    assert waits and all(b["status"] == "starting" for b in waits)
    assert any("loading the model" in b["detail"] for b in waits), waits[:3]
    statuses = [s for s, _ in health]
    assert 503 not in statuses[statuses.index(200):] if 200 in statuses else True, statuses
    status, body = _get(url + "/health")
    assert status == 200 and json.loads(body) == {"status": "ok"}


def test_ready_means_the_pool_is_prefaulted(served):
    url, _, _, logfile = served
    stats = json.loads(_get(url + "/lmc/stats")[1])
    assert stats["cache.cpu.prefault_front"] == stats["cache.cpu.capacity"], stats
    text = logfile.read_text()
    assert text.index("stores run at full speed") < text.index("ready: serving")


def test_metrics_carry_the_engines_series_and_requests_are_logged(served):
    url, _, _, logfile = served
    body = {"prompt": list(range(1, 40)), "max_tokens": 2}
    for _ in range(2):  # the second is a hit
        assert _post(url + "/v1/completions", body)[0] == 200
    status, scrape = _get(url + "/metrics")
    text = scrape.decode()
    assert status == 200
    lookups = [ln for ln in text.splitlines() if ln.startswith("lmc_lookups_total ")]
    hits = [ln for ln in text.splitlines() if ln.startswith("lmc_hit_tokens_total ")]
    assert lookups and float(lookups[0].split()[1]) >= 2, text[:2000]
    assert hits and float(hits[0].split()[1]) > 0
    for _ in range(3):  # as lmc router and lmc pd-proxy probe it, every 2 s
        assert _get(url + "/health")[0] == 200
    assert _post(url + "/v1/completions", {**body, "max_tokens": 1})[0] == 200

    def posts() -> list[str]:  # an access line is written once its answer has gone
        return [ln for ln in logfile.read_text().splitlines()
                if '"POST /v1/completions HTTP/1.1" 200' in ln]

    deadline = time.monotonic() + 60
    while len(posts()) < 3:
        assert time.monotonic() < deadline, logfile.read_text()[-3000:]
        time.sleep(0.05)
    lines = posts()
    assert len(lines) == 3, lines
    assert "lmc.http.access" in lines[0] and "127.0.0.1:" in lines[0]
    log = logfile.read_text()
    assert '"GET /health HTTP/1.1"' not in log and '"GET /metrics HTTP/1.1"' not in log, \
        "probes and scrapes are logged at INFO"


def test_pd_proxy_logs_each_request_once(caplog):
    caplog.set_level(logging.INFO, logger="lmc.http.access")
    proxy = Proxy(["http://127.0.0.1:1"], ["http://127.0.0.1:2"], port=0)
    import threading
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        # nothing listens on either port: no healthy prefill instance is left (a refused
        # connection marks one down at once): 503
        status, _ = _post(proxy.url + "/v1/completions", {"prompt": "hi", "max_tokens": 1})
        assert status == 503
        _get(proxy.url + "/no/such\x01path".replace("\x01", "%01"))
    finally:
        proxy.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "lmc.http.access"]
    assert len(lines) == 2, lines
    assert '"POST /v1/completions HTTP/1.1" 503' in lines[0]


def test_access_log_lines_are_escaped_and_bounded(caplog):
    """A client's request line is data: control characters (terminal escapes, a forged
    newline) are escaped and a long line is cut, so one request is one short log line."""
    import socket
    import threading
    caplog.set_level(logging.INFO, logger="lmc.http.access")
    proxy = Proxy(["http://127.0.0.1:1"], ["http://127.0.0.1:2"], port=0)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        for line in (b"GET /\x1b[31mred\rINFO forged HTTP/1.0\r\n\r\n",
                     b"GET /" + b"a" * 60000 + b" HTTP/1.0\r\n\r\n"):
            with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s:
                s.sendall(line)
                s.shutdown(socket.SHUT_WR)
                while s.recv(65536):
                    pass
    finally:
        proxy.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "lmc.http.access"]
    assert len(lines) == 2, lines
    assert all(ch.isprintable() for ln in lines for ch in ln), lines
    assert "\\x1b" in lines[0] and "\\r" in lines[0]
    assert all(len(ln) < 400 for ln in lines)
