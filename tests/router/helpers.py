"""Reference-engine servers with lmc and KV events on, in subprocesses, for the router's
tests and benchmark: each on its own free ports, stopped by its pid."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmc.router.app import InstanceSpec

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports, all held while choosing: a server started on port 0 after
    a lone ``free_port()`` may be given that same port back (an instance's HTTP port once
    took its events port, and its events publisher could not bind)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class Instance:
    proc: subprocess.Popen
    url: str
    events: str
    replay: str
    log: Path

    @property
    def spec(self) -> InstanceSpec:
        return InstanceSpec(self.url, self.events, self.replay)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def lmc_config(path: Path, pub: int, rep: int, pool: str = "64MiB",
               extra: str = "") -> Path:
    path.write_text(
        f"chunk_size: 64\nlocal_cpu_size: {pool}\npin_memory: false\n"
        f"local_cpu_prefault: 'off'\n{extra}"
        f"kv_events: {{enable_kv_cache_events: true, endpoint: 'tcp://*:{pub}', "
        f"replay_endpoint: 'tcp://*:{rep}', heartbeat: 0.5, pod: {path.stem}, "
        f"model_name: tiny}}\n")
    return path


def start(ckpt: Path, work: Path, name: str, pool: str = "64MiB", extra: str = "",
          num_blocks: int = 256, serve_args: Sequence[str] = ()) -> Instance:
    port, pub, rep = free_ports(3)
    # "{name}" in extra is the instance's own (a disk directory each)
    cfg = lmc_config(work / f"{name}.yaml", pub, rep, pool, extra.replace("{name}", name))
    ready = work / f"{name}.json"
    log = work / f"{name}.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmc.reference.serve", "--model", str(ckpt), "--port", str(port),
         "--lmc-config", str(cfg), "--num-blocks", str(num_blocks), "--ready-file", str(ready),
         *serve_args],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "w"))  # noqa: SIM115
    return Instance(proc, "", f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{rep}", log)


def wait_ready(inst: Instance, work: Path, name: str, timeout: float = 180) -> None:
    path = work / f"{name}.json"
    end = time.monotonic() + timeout
    while not path.exists():
        if inst.proc.poll() is not None or time.monotonic() > end:
            raise RuntimeError(f"{name} not ready (rc={inst.proc.poll()}):\n"
                               f"{inst.log.read_text()[-3000:]}")
        time.sleep(0.1)
    inst.url = json.loads(path.read_text())["url"]


@contextlib.contextmanager
def instances(ckpt: Path, work: Path, n: int, **kw: Any) -> Iterator[list[Instance]]:
    out: list[Instance] = []
    try:
        for i in range(n):
            out.append(start(ckpt, work, f"inst{i}", **kw))
        for i, inst in enumerate(out):
            wait_ready(inst, work, f"inst{i}")
        yield out
    finally:
        for inst in out:
            inst.stop()


def http(url: str, body: dict | None = None, timeout: float = 120) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw
