"""Long steps tell the operator where they are (issue 15): the disk tier's index rebuild at
start-up, making a checkpoint (the demo's, once), the pool's pre-fault. Each test makes the
step "long" by shrinking its reporting interval or by a clock that runs fast, and fails if the
progress lines or the final summary with its duration went away. ``lmc bench``'s streamed
progress is checked by tests/cli/test_bench_runner.py."""

from __future__ import annotations

import io
import logging
import re

import pytest
import torch

from lmc import demo
from lmc.config import CacheConfig
from lmc.demo import model as demo_model
from lmc.memory import prefault as pf
from lmc.memory.pool import MemoryPool
from lmc.reference.tiny import cached_checkpoint, make_tiny_checkpoint
from lmc.storage.backends.disk import backend as disk_mod
from lmc.storage.backends.disk.backend import MARKER, DiskBackend

MiB = 1 << 20


def test_disk_index_rebuild_reports_progress_and_a_summary(tmp_path, monkeypatch, caplog):
    """Files named like chunks (sparse: the rebuild reads names and sizes only) are counted
    in progress lines while the directory is scanned; the summary gives the duration."""
    (tmp_path / MARKER).write_text("lmc\n")
    n, size = 300, 3 * 4096
    for i in range(n):
        with open(tmp_path / f"{i:032x}.{size}.kv", "wb") as f:
            f.truncate(size)
    monkeypatch.setattr(disk_mod, "SCAN_PROGRESS_SECONDS", 0.0)  # every file is "a while"
    caplog.set_level(logging.INFO, logger=disk_mod.__name__)
    pool = MemoryPool(MiB, pin_memory=False)
    tier = DiskBackend(config=CacheConfig(local_disk=str(tmp_path), local_disk_size="64MiB"),
                       pool=pool)
    try:
        assert len(tier) == n
    finally:
        tier.close()
        pool.close()
    lines = [r.getMessage() for r in caplog.records]
    progress = [ln for ln in lines if "index rebuild:" in ln]
    assert len(progress) >= n // 2, lines[:5]
    last = progress[-1]
    assert re.search(r"\d+ files seen, \d+ chunks \([\d.]+ (KiB|MiB)\) so far, ", last), last
    summary = [ln for ln in lines if "index rebuilt in" in ln]
    assert len(summary) == 1, lines[-5:]
    assert re.search(rf"index rebuilt in [\d.]+ (us|ms|s): {n} chunks, 3\.52 MiB of 64\.0 MiB",
                     summary[0]), summary


def test_disk_index_rebuild_is_quiet_when_quick(tmp_path, caplog):
    """At the default interval a small directory gives the one summary line only."""
    caplog.set_level(logging.INFO, logger=disk_mod.__name__)
    pool = MemoryPool(MiB, pin_memory=False)
    DiskBackend(config=CacheConfig(local_disk=str(tmp_path)), pool=pool).close()
    pool.close()
    lines = [r.getMessage() for r in caplog.records]
    assert not [ln for ln in lines if "index rebuild:" in ln]
    assert len([ln for ln in lines if "index rebuilt in" in ln]) == 1


def test_making_a_checkpoint_reports_each_step(tmp_path, monkeypatch):
    steps: list[str] = []
    make_tiny_checkpoint(tmp_path / "m", hidden=64, layers=2, vocab=300, progress=steps.append)
    text = "\n".join(steps)
    assert steps[0].startswith("training a 300-id byte-level BPE tokenizer")
    assert re.search(r"tokenizer ready in [\d.]+ s", text)
    assert re.search(r"\d+ weight tensors, [\d.]+ MiB, in [\d.]+ s; writing 1 file", text)
    assert re.search(r"checkpoint written to .* in [\d.]+ s$", steps[-1])
    # a cached checkpoint reports while it is made, and says nothing when reused
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    made: list[str] = []
    cached_checkpoint("t", progress=made.append, hidden=64, layers=2, vocab=300)
    assert len(made) == 4
    again: list[str] = []
    cached_checkpoint("t", progress=again.append, hidden=64, layers=2, vocab=300)
    assert again == []


def test_demo_prints_checkpoint_progress(monkeypatch):
    """``lmc demo`` hands the steps to its output (first run: the checkpoint is made)."""
    class Stop(Exception):
        pass

    def fake_model_dir(progress=None, **_kw):
        progress("training a 2048-id byte-level BPE tokenizer ...")
        raise Stop

    monkeypatch.setattr(demo_model, "demo_model_dir", fake_model_dir)
    out = io.StringIO()
    with pytest.raises(Stop):
        demo.run_demo(None, None, demo.Workload.quick(), out=out, quick=True)
    assert "making the checkpoint: training a 2048-id byte-level BPE tokenizer" in out.getvalue()


class _FastClock:
    """``time`` for lmc.memory.prefault whose perf_counter advances 1.5 s per call: every step of
    a small pre-fault then looks slow enough to be reported."""

    def __init__(self) -> None:
        self.t = 0.0

    def perf_counter(self) -> float:
        self.t += 1.5
        return self.t


def test_prefault_reports_progress_between_start_and_end(monkeypatch, caplog):
    monkeypatch.setattr(pf, "time", _FastClock())
    caplog.set_level(logging.INFO, logger=pf.__name__)
    buf = torch.empty(40 * MiB, dtype=torch.uint8)
    p = pf.Prefaulter(buf, step=4 * MiB, name="test pool")
    p.run(fallback_touch=True)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("test pool: pre-faulting 40.0 MiB"), lines
    middle = [ln for ln in lines if re.search(r"pre-faulted [\d.]+ MiB of 40\.0 MiB \(\d+%\)", ln)]
    assert len(middle) >= 5, lines
    assert re.search(r"pre-faulted 40\.0 MiB in .* \(.*/s\)", lines[-1]), lines
