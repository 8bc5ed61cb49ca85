"""The fastest an engine could prefill before it has computed anything: its model's
arithmetic at the device's measured matmul rate.

A fresh engine's first request has no measured compute (:class:`lmc.storage.speeds.
PrefillSpeed` learns it from steps), yet a load through a slow link must know when to stop
(:mod:`lmc.storage.load_watch`). The model's shape says how many multiply-adds a prompt
costs; a matmul on the device, timed once at registration, says how many the device does
per second at best. Their ratio under-estimates the real forward (no kernel reaches the
peak, and norms, activations and launches cost on top), which is the safe side for that
use: a load stops early only where the link is slow against compute, and the time it
spent before stopping is bounded by this estimate, not by a guess that may be long.

Counted per token: ``2 * layers * hidden * (q + 2 kv + o projections, 3 MLP
matrices)``; attention: ``4 * heads * head_dim`` per layer per earlier position, i.e.
``2 * layers * heads * head_dim * (end**2 - start**2)`` over ``[start, end)``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch

from lmc import units
from lmc.storage.speeds import PrefillRate

log = logging.getLogger(__name__)
_RATES: dict[tuple[str, torch.dtype], float] = {}
_LOCK = threading.Lock()


def _field(cfg: Any, name: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def model_flops(cfg: Any) -> tuple[float, float] | None:
    """(FLOPs per prompt token, FLOPs per unit of ``end**2 - start**2``) of a decoder-only
    transformer described by a Hugging Face-style config (mapping or object); ``None``
    when a field it needs is missing."""
    hidden = _field(cfg, "hidden_size")
    layers = _field(cfg, "num_hidden_layers")
    heads = _field(cfg, "num_attention_heads")
    inter = _field(cfg, "intermediate_size")
    if not all(isinstance(v, int) and v > 0 for v in (hidden, layers, heads, inter)):
        return None
    kv_heads = _field(cfg, "num_key_value_heads") or heads
    head_dim = _field(cfg, "head_dim") or hidden // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    per_token = 2.0 * layers * (hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter)
    return per_token, 2.0 * layers * q


def matmul_flops_per_s(device: torch.device, dtype: torch.dtype, width: int = 1024) -> float:
    """The device's matmul rate in ``dtype`` (a prefill-shaped product, best of five
    timings), measured once per process, device and dtype."""
    key = (str(device), dtype)
    with _LOCK:
        if key in _RATES:
            return _RATES[key]
        width = max(64, min(width, 4096))
        rows = 512
        a = torch.randn(rows, width, device=device).to(dtype)
        b = torch.randn(width, width, device=device).to(dtype)
        torch.matmul(a, b)  # kernels loaded, workspaces made
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        clock = _clock(device)
        sync()
        reps, best = 1, float("inf")
        for _ in range(5):  # the best: a busy machine only ever makes a timing longer
            t0 = clock()
            for _ in range(reps):
                torch.matmul(a, b)
            sync()
            dt = (clock() - t0) / reps
            best = min(best, dt)
            reps = max(1, min(64, int(0.01 / max(dt, 1e-7))))  # ~10 ms per timing
        rate = 2.0 * rows * width * width / best
        _RATES[key] = rate
        return rate


def _clock(device: torch.device) -> Any:
    """The clock a matmul is timed by: on a CPU the CPU time its threads spent (this
    thread's, when torch computes on it alone), so other processes sharing the cores do
    not make the device look slower than it is -- a floor must stay a floor; on a GPU the
    wall clock (the kernel's time)."""
    if device.type != "cpu":
        return time.perf_counter
    threads = torch.get_num_threads()
    if threads <= 1:
        return time.thread_time
    return lambda: time.process_time() / threads


def compute_floor(cfg: Any, device: torch.device, dtype: torch.dtype) -> PrefillRate | None:
    """The fastest prefill of ``cfg``'s model on ``device`` (module doc); ``None`` when the
    config does not say its shape or the measurement fails."""
    flops = model_flops(cfg)
    if flops is None:
        return None
    try:
        t0 = time.perf_counter()
        rate = matmul_flops_per_s(device, dtype, int(_field(cfg, "hidden_size")))
    except Exception as e:  # noqa: BLE001 - without it a load is simply not watched
        log.warning("lmc: timing a matmul on %s failed (%s: %s): a fresh engine's loads "
                    "are not watched until its compute is measured", device,
                    type(e).__name__, e)
        return None
    per_token, attention = flops
    floor = PrefillRate(0.0, per_token / rate, attention / rate)
    log.info("lmc: compute floor on %s (%s): matmuls at %.1f GFLOP/s (measured in %s), so a "
             "prefill of 2,048 tokens takes >= %s", device, str(dtype).removeprefix("torch."),
             rate / 1e9, units.seconds(time.perf_counter() - t0),
             units.seconds(floor.seconds(0, 2048)))
    return floor
