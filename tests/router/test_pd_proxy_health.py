"""``lmc pd-proxy``'s health checks, retries and metrics with real reference-engine servers
(subprocesses; decode instances wait ``--remote-prefill-wait 1`` for KV that never comes,
then prefill themselves): a prefill instance killed with SIGKILL is passed over, reported
unhealthy in ``/metrics`` and ``/lmc/pd-proxy`` (one INFO line), and healthy again after a
restart on its port; one that refuses a request's connection before the checks saw it die
is marked at once and the request goes to the other instance (prefill and decode); every
prefill instance dead is a 503 naming "prefill" at once, never a hang; the new endpoints are
under the shared HTTP bounds (docs/threats/http.md)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from lmc.http.json_api import HttpLimits
from lmc.reference import make_tiny_checkpoint
from lmc.router.pd_proxy import Proxy
from tests.deadlines import AT_ONCE_S, HANG_S, SLACK_S
from tests.http.kit import LIMITS, exchange, read_answer
from tests.router.helpers import ROOT, Instance, free_port, http, start, wait_ready

pytestmark = pytest.mark.integration
PROMPT = list(range(1, 40))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("pdhealth") / "tiny", hidden=64,
                                layers=2, vocab=512, max_position_embeddings=1024)


class Fleet:
    """Reference servers on fixed ports, so that a killed one comes back at its URL."""

    def __init__(self, ckpt: Path, work: Path) -> None:
        self.ckpt, self.work = ckpt, work
        self.ports: dict[str, int] = {}
        self.insts: dict[str, Instance] = {}

    def up(self, *names: str) -> None:
        for name in names:
            self.ports.setdefault(name, free_port())
            self.insts[name] = start(self.ckpt, self.work, name, serve_args=[
                "--port", str(self.ports[name]), "--remote-prefill-wait", "1"])
        for name in names:
            wait_ready(self.insts[name], self.work, name)

    def url(self, name: str) -> str:
        return self.insts[name].url

    def kill(self, name: str) -> None:
        proc = self.insts[name].proc
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        (self.work / f"{name}.json").unlink(missing_ok=True)

    def close(self) -> None:
        for inst in self.insts.values():
            inst.stop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, ckpt) -> Iterator[Fleet]:
    f = Fleet(ckpt, tmp_path_factory.mktemp("pdhealthfleet"))
    try:
        f.up("a", "b", "c")
        yield f
    finally:
        f.close()


def alive(fleet: Fleet, *names: str) -> None:
    """Bring back any of ``names`` an earlier test killed."""
    dead = [n for n in names if fleet.insts[n].proc.poll() is not None]
    if dead:
        fleet.up(*dead)


def running(prefill: list[str], decode: list[str], **kw: Any) -> Proxy:
    p = Proxy(prefill, decode, policy="round_robin", **kw)
    threading.Thread(target=p.serve_forever, daemon=True).start()
    return p


def complete(url: str, timeout: float = 60) -> tuple[int, Any]:
    return http(url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 2,
                                          "ignore_eos": True}, timeout=timeout)


def until(cond: Callable[[], bool], within: float, what: str) -> None:
    end = time.monotonic() + within
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.05)


def instance_state(state: dict, role: str, url: str) -> dict:
    return next(i for i in state["instances"][role] if i["url"] == url)


def metric(text: str, name: str, **labels: str) -> float | None:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))  # as exposed
    m = re.search(rf"^{name}\{{{re.escape(want)}\}} (\S+)$", text, re.M)
    return None if m is None else float(m.group(1))


def test_a_killed_prefill_instance_is_passed_over_reported_and_back_after_restart(
        fleet, tmp_path):
    """The command line, ``--health-interval 0.3``: SIGKILL prefill instance A; every
    request is answered (by B); A is reported unhealthy in both endpoints and the log says
    so once; restarted on its port, A is healthy again and gets requests again."""
    alive(fleet, "a", "b", "c")
    a, b, c = fleet.url("a"), fleet.url("b"), fleet.url("c")
    log = tmp_path / "proxy.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lmc.cli", "pd-proxy", "--port", "0", "--prefill", a,
             "--prefill", b, "--decode", c, "--health-interval", "0.3"], cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, stderr=err,
            text=True)
    try:
        line = proc.stdout.readline()
        m = re.search(r" at (http://[\d.]+:\d+)", line)
        assert m, (line, log.read_text()[-2000:])
        url = m.group(1)

        def state() -> dict:
            return http(url + "/lmc/pd-proxy")[1]

        def metrics() -> str:
            status, raw = http(url + "/metrics")
            assert status == 200
            return raw.decode() if isinstance(raw, bytes) else str(raw)

        assert complete(url)[0] == 200
        fleet.kill("a")
        for _ in range(4):  # every request answered, whether or not the checks saw it yet
            status, answer = complete(url)
            assert status == 200, answer
        until(lambda: not instance_state(state(), "prefill", a)["healthy"], HANG_S,
              "A never reported unhealthy")
        text = metrics()
        assert metric(text, "lmc_pd_proxy_instance_healthy", role="prefill", instance=a) == 0
        assert metric(text, "lmc_pd_proxy_instance_healthy", role="prefill", instance=b) == 1
        assert metric(text, "lmc_pd_proxy_instance_healthy", role="decode", instance=c) == 1
        sent_b = metric(text, "lmc_pd_proxy_requests_total", role="prefill", instance=b,
                        reason="round_robin")
        assert sent_b is not None and sent_b >= 2
        status, health = http(url + "/health")
        assert status == 200 and health == {"status": "ok"}

        fleet.up("a")  # the same port
        until(lambda: instance_state(state(), "prefill", a)["healthy"], HANG_S,
              "A never healthy again")
        before = state()["routed"]["prefill"].get(a, {}).get("round_robin", 0)
        for _ in range(2):  # in turn: one of them is A's
            assert complete(url)[0] == 200
        assert state()["routed"]["prefill"][a]["round_robin"] == before + 1
        assert metric(metrics(), "lmc_pd_proxy_instance_healthy", role="prefill",
                      instance=a) == 1
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
    text = log.read_text()
    assert "Traceback" not in text
    assert text.count(f"prefill instance {a} is unhealthy") == 1, text[-3000:]
    assert text.count(f"prefill instance {a} is healthy again") == 1, text[-3000:]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_an_instance_refusing_the_connection_is_marked_at_once_and_the_request_retried(
        fleet, role, monkeypatch):
    """The checks (every hour) saw A alive; A dies; the request chosen for A goes to B,
    answered, and A is unhealthy without waiting for a check."""
    from lmc.router import health

    probed: list[str] = []
    probe = health.probe

    def recording_probe(fleet, inst) -> None:  # the real probe, its end recorded
        probe(fleet, inst)
        probed.append(inst.url)

    monkeypatch.setattr(health, "probe", recording_probe)
    alive(fleet, "a", "b", "c")
    a, b, c = fleet.url("a"), fleet.url("b"), fleet.url("c")
    two, one = [a, b], [c]
    p = running(two, one, health_interval=3600) if role == "prefill" else \
        running(one, two, health_interval=3600)
    try:
        # the first probes found A alive (the next one is an hour away)
        until(lambda: {a, b, c} <= set(probed), HANG_S, f"the first probes: {probed}")
        assert all(i["healthy"] for r in ("prefill", "decode")
                   for i in p.state()["instances"][r])
        fleet.kill("a")
        for _ in range(2):  # in turn: the first is chosen for A
            status, answer = complete(p.url)
            assert status == 200, answer
        st = p.state()
        assert st["retries"] == 1 and st[f"{role}_failures"] == 0, st
        assert not instance_state(st, role, a)["healthy"]
        assert st["routed"][role] == {b: {"round_robin": 2}}, st
        text = p.prometheus().decode()
        assert metric(text, "lmc_pd_proxy_retries_total", role=role) == 1
        assert metric(text, "lmc_pd_proxy_upstream_failures_total", role=role,
                      instance=a) == 1
        assert metric(text, "lmc_pd_proxy_instance_healthy", role=role, instance=a) == 0
    finally:
        p.close()


def test_every_prefill_instance_dead_is_a_503_naming_prefill_at_once(fleet):
    alive(fleet, "a", "b", "c")
    a, b, c = fleet.url("a"), fleet.url("b"), fleet.url("c")
    p = running([a, b], [c], health_interval=0.3)
    try:
        assert complete(p.url)[0] == 200
        fleet.kill("a")
        fleet.kill("b")
        t0 = time.monotonic()  # before the checks see it: two refusals, then no one left
        status, answer = complete(p.url)
        assert status == 503 and "prefill" in answer["error"]["message"], answer
        assert time.monotonic() - t0 < AT_ONCE_S  # never a hang
        until(lambda: p.prefill.healthy() == 0, HANG_S, "the checks never saw them die")
        t0 = time.monotonic()
        status, answer = complete(p.url)
        assert status == 503, answer
        assert "no healthy prefill instance" in answer["error"]["message"]
        assert time.monotonic() - t0 < AT_ONCE_S
        status, health = http(p.url + "/health")
        assert status == 503 and health["status"] == "no healthy prefill instance"
        assert p.decode.healthy() == 1  # the decode side is not blamed
    finally:
        p.close()


# ------------------------------------------------------- the new endpoints, attacked

@pytest.fixture
def bounded(fleet) -> Iterator[Proxy]:
    alive(fleet, "c")
    p = running([fleet.url("c")], [fleet.url("c")], limits=LIMITS, health_interval=0.5)
    yield p
    p.close()


@pytest.mark.parametrize("request_bytes,status", [
    (b"GET /metrics" + b"x" * 70_000 + b" HTTP/1.0\r\n\r\n", 414),  # over the line limit
    (b"GET /metrics/../lmc/pd-proxy HTTP/1.0\r\n\r\n", 404),
    (b"GET /lmc/pd-proxy?all=1 HTTP/1.0\r\n\r\n", 404),
    (b"GET /metrics\x00 HTTP/1.0\r\n\r\n", 404),
    (b"GET /metrics HTTP/1.0\r\n" + b"X-A: b\r\n" * 200 + b"\r\n", 431),  # too many headers
    (b"POST /metrics HTTP/1.0\r\nContent-Length: 2\r\n\r\n{}", 404),
    (b"DELETE /lmc/pd-proxy HTTP/1.0\r\n\r\n", 501),
])
def test_odd_and_oversized_requests_to_the_new_endpoints_are_refused(bounded, request_bytes,
                                                                    status):
    got, _ = exchange(bounded.port, request_bytes)
    assert got == status
    got, raw = exchange(bounded.port, b"GET /metrics HTTP/1.0\r\n\r\n")
    assert got == 200 and b"lmc_pd_proxy_instance_healthy" in raw
    got, raw = exchange(bounded.port, b"GET /lmc/pd-proxy HTTP/1.0\r\n\r\n")
    assert got == 200 and b'"health_interval": 0.5' in raw


def test_a_slow_loris_on_metrics_is_dropped_at_the_read_timeout(bounded):
    """A request line then a header byte every 0.1 s: the whole request is due within
    ``read_timeout`` (1 s here), so the connection ends by then (plus ``SLACK_S``; the
    trickle would last 60 s); the endpoint serves on."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", bounded.port), timeout=HANG_S) as s:
        s.sendall(b"GET /metrics HTTP/1.0\r\n")
        closed = False
        for byte in b"X-Pad: " + b"a" * 600:
            try:
                s.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            time.sleep(0.1)
            if time.monotonic() - t0 > LIMITS.read_timeout + SLACK_S:
                break
        if not closed:
            try:
                got = s.recv(4096)
            except ConnectionError:
                got = b""
            assert got == b"" or got.startswith(b"HTTP/1.0 408"), got
    assert time.monotonic() - t0 < LIMITS.read_timeout + 2 * SLACK_S  # not HANG_S
    got, raw = exchange(bounded.port, b"GET /metrics HTTP/1.0\r\n\r\n")
    assert got == 200 and b"lmc_pd_proxy_requests" in raw


def test_the_new_endpoints_count_against_the_connection_cap(fleet):
    """Silent sockets at the cap: a newcomer asking for ``/metrics`` displaces the oldest
    (as any request does), so the endpoint stays reachable."""
    alive(fleet, "c")
    p = running([fleet.url("c")], [fleet.url("c")], health_interval=None,
                limits=HttpLimits(max_connections=4, read_timeout=HANG_S))
    silent = [socket.create_connection(("127.0.0.1", p.port), timeout=HANG_S)
              for _ in range(4)]
    try:
        until(lambda: len(p.httpd.conns) == 4, HANG_S, "the silent sockets were not admitted")
        with socket.create_connection(("127.0.0.1", p.port), timeout=HANG_S) as s:
            s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            status, raw = read_answer(s)
        assert status == 200 and b"lmc_pd_proxy_in_flight" in raw
        assert p.httpd.displaced >= 1
    finally:
        for s in silent:
            s.close()
        p.close()


def test_a_bad_health_interval_is_refused_naming_the_flag(tmp_path):
    for bad in ("0", "-1", "nan", "x"):
        proc = subprocess.run(
            [sys.executable, "-m", "lmc.cli", "pd-proxy", "--prefill", "http://h:1",
             "--decode", "http://h:2", "--health-interval", bad], cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
            timeout=60)
        assert proc.returncode == 2 and "--health-interval" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
