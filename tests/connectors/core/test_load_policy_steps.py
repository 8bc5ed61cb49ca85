"""On a GPU, a step that loads is still an observation of the engine's compute: its
stream's waits for the loads are bracketed by CUDA events and taken out (without them only
cold prefills, which also save, were seen, and an H100 measured lmc's compute at half the
engine's). The CUDA case is skipped where no device is present; the CPU's host waits are
subtracted alike."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.connectors.reference.helpers import assert_same, lmc_llm, plain_llm, prompt, run


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_step_that_loads_is_timed_without_its_waits(tiny_dir: Path, device: str) -> None:
    p = prompt(31, 150)
    want = run(plain_llm(tiny_dir, device=device), [p])
    llm, conn = lmc_llm(tiny_dir, device=device)
    run(llm, [p[:64]])  # chunks 0-1 stored
    got = run(llm, [p])  # loads 64 positions, computes the other 86 in one step
    assert got[0].num_cached_tokens == 64
    assert_same(got, want)
    run(llm, [prompt(32, 40)])  # later steps: the loading step's events are read by now
    obs = conn.cache.speeds.prefill.fit.observations()
    loaded_step = [(x, y) for x, y, _ in obs if x[1] == len(p) - 64]
    assert loaded_step, [x for x, _, _ in obs]
    (x, seconds), *_ = loaded_step
    assert 0 < x[3] <= len(p) - 64  # it saved (some of) what it computed
    assert 0 < seconds < 5.0
    llm.close()
