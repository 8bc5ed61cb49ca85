"""``lmc server`` as an operator meets it: ports bound before the pool's pre-fault (a taken
address fails at once, named), start-up progress in the log, one INFO line per event (not per
connection), a warning when it runs without a token, and no dead series on ``/metrics``."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from lmc.storage.backends.server import protocol as P
from tests.server import wire
from tests.server.daemon_proc import DaemonProc

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


@pytest.fixture
def daemons(tmp_path):
    procs: list[DaemonProc] = []

    def start(*flags: str) -> DaemonProc:
        d = DaemonProc(tmp_path / f"d{len(procs)}", list(flags))
        procs.append(d)
        return d.start()

    yield start
    for d in procs:
        d.kill()


def test_taken_port_fails_before_the_prefault_and_names_the_address(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        # 8 GiB pre-faulted would take minutes here: the bind must fail long before
        out = subprocess.run([sys.executable, "-m", "lmc.server", "--port", str(port),
                              "--size", "8GiB", "--prefault", "true"], cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT)},
                             capture_output=True, text=True, timeout=120)
        took = time.monotonic() - t0
    assert out.returncode == 2, out.stderr
    assert f"port: 127.0.0.1:{port} is already in use" in out.stderr, out.stderr
    assert "pre-faulting" not in out.stderr and "Traceback" not in out.stderr
    assert took < 60, took


def test_metrics_port_taken_is_named_too(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "lmc.server", "--port", "0",
                              "--metrics-port", str(port), "--size", "64MiB"], cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT)},
                             capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert f"metrics_port: 127.0.0.1:{port} is already in use" in out.stderr, out.stderr


def _info_lines(log: str) -> list[str]:
    return [ln for ln in log.splitlines() if " INFO " in ln]


def test_start_up_progress_and_one_info_line_per_event(daemons):
    d = daemons("--size", "64MiB", "--prefault", "true")
    log = d.log()
    bound = log.index("bound tcp 127.0.0.1:")
    assert bound < log.index("pre-faulting 64.0 MiB") < log.index("storage ready in")
    assert re.search(r"lmc server serving on tcp 127\.0\.0\.1:\d+, metrics http://", log)
    assert "WARNING" in log and "no token configured" in log
    before = len(_info_lines(d.log()))
    for _ in range(5):  # one engine reconnecting: one line, not one (or two) per connection
        c = wire.RawClient(d.port)
        assert c.call(wire.hello(client="engine-7"))[0] == P.OK
        assert c.call(wire.frame(P.PING, {}))[0] == P.OK
        c.close()
    time.sleep(0.5)
    new = _info_lines(d.log())[before:]
    assert len(new) == 1 and "hello from client engine-7" in new[0], new


def test_a_token_silences_the_warning(daemons, tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    d = daemons("--size", "64MiB", "--token-file", str(token))
    log = d.log()
    assert "token required" in log and "no token configured" not in log
    assert "s3cret-token" not in log


def _families(text: str) -> set[str]:
    """Metric family names in a scrape (a counter's TYPE line may carry its _total)."""
    return {re.sub(r"_(total|created)$", "", f)
            for f in re.findall(r"^# TYPE (\S+) ", text, re.M)}


ENGINE_ONLY = ("lmc_lookups", "lmc_lookup_tokens", "lmc_hit_tokens", "lmc_bytes", "lmc_tokens",
               "lmc_op_seconds", "lmc_skipped_chunks", "lmc_pool_used_bytes",
               "lmc_pool_capacity_bytes")


def test_metrics_have_no_dead_engine_series(daemons):
    d = daemons("--size", "64MiB")
    c = wire.RawClient(d.port)
    c.call(wire.hello(client="m"))
    c.call(wire.put("ns", [wire.value_bytes("ns", b"k" * 16)]))
    c.close()
    body = urllib.request.urlopen(f"http://127.0.0.1:{d.info['metrics_port']}/metrics",
                                  timeout=10).read().decode()
    families = _families(body)
    dead = [f for f in families if f in ENGINE_ONLY]
    assert not dead, f"the daemon exports engine-only series: {dead}"
    assert re.search(r"^lmc_server_pool_capacity_bytes 6\.7108864e\+07$", body, re.M)
    assert re.search(r'^lmc_server_values_total\{outcome="stored"\} 1\.0$', body, re.M)


@pytest.mark.parametrize("entry", [["-m", "lmc.server"], ["-m", "lmc.cli", "server"]])
def test_ctrl_c_while_the_pool_is_built_is_not_a_traceback(tmp_path, entry):
    proc = subprocess.Popen([sys.executable, *entry, "--port", "0", "--size", "8GiB",
                             "--prefault", "true"], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:  # an 8 GiB daemon left behind would starve every later test of memory
        seen, deadline = "", time.monotonic() + 90
        while "building the storage" not in seen:
            assert proc.poll() is None and time.monotonic() < deadline, seen
            seen += proc.stdout.readline()
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        out = seen + proc.communicate(timeout=60)[0]
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130 and "lmc server: interrupted" in out, out
    assert "Traceback" not in out


def test_an_engine_process_exports_no_daemon_or_unborn_engine_series():
    """The other side of the same rule: importing the engine and the lmc:// client adds no
    lmc_server_* series, and engine series appear only with an engine."""
    code = ("import re, lmc.cache_engine, lmc.storage.backends.server.backend\n"
            "from prometheus_client import REGISTRY, generate_latest\n"
            "fams = lambda: {re.sub(r'_(total|created)$', '', f) for f in re.findall("
            "r'^# TYPE (lmc\\S+)', generate_latest(REGISTRY).decode(), re.M)}\n"
            "before = fams()\n"
            "from lmc.metrics import EngineMetrics\n"
            "EngineMetrics()\n"
            "print(sorted(before)); print(sorted(fams() - before))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    before, added = (eval(line) for line in out.stdout.splitlines()[-2:])
    assert not [f for f in before if f.startswith("lmc_server_")], before
    assert not set(before) & set(ENGINE_ONLY), before
    assert set(added) == set(ENGINE_ONLY), added
