"""Running the SGLang scripts from pytest: find the SGLang venv, run a script in it.

``LMC_SGLANG_PYTHON`` names a python with ``sglang==0.5.23`` and this checkout's lmc
importable (``.ci/run`` creates one); default ``/work/venv-sglang/bin/python``. Without it the
tests skip, except under ``CI=true``, where they fail.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.requirements import missing

SCRIPTS = Path(__file__).resolve().parent
DEFAULT_PYTHON = "/work/venv-sglang/bin/python"
_PROBED: dict[str, str | None] = {}


def sglang_python() -> str:
    py = os.environ.get("LMC_SGLANG_PYTHON") or (
        DEFAULT_PYTHON if Path(DEFAULT_PYTHON).exists() else "")
    if py not in _PROBED:
        reason = None
        if not py:
            reason = ("no SGLang environment: set LMC_SGLANG_PYTHON to a python with "
                      "sglang==0.5.23 (.ci/run creates one)")
        elif not Path(py).exists():
            reason = f"LMC_SGLANG_PYTHON={py} does not exist"
        else:
            probe = subprocess.run(
                [py, "-c", "import importlib.metadata as m, importlib.util as u, sys; "
                           "sys.exit(0 if m.version('sglang') == '0.5.23' and "
                           "u.find_spec('lmc') else 3)"],
                capture_output=True, timeout=120)
            if probe.returncode:
                reason = f"{py} cannot import sglang 0.5.23 and lmc (rc {probe.returncode})"
        _PROBED[py] = reason
    reason = _PROBED[py]
    if reason:
        missing(reason)
    return py


def run_script(name: str, *args: str, timeout: int = 300, **env: str
               ) -> subprocess.CompletedProcess:
    """Run ``sglang_scripts/<name>`` with the SGLang python; fail with its output on a
    non-zero exit or a missing ``RESULT: PASS``."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
                    TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1",
                    LMC_DEBUG_INVARIANTS="1", **env)  # leaked references fail the run
    proc = subprocess.run([sglang_python(), str(SCRIPTS / name), *args], capture_output=True,
                          text=True, timeout=timeout, env=full_env, cwd=SCRIPTS)
    out = proc.stdout + proc.stderr
    if proc.returncode or "RESULT: PASS" not in proc.stdout:
        pytest.fail(f"{name} {' '.join(args)} exited {proc.returncode}:\n{out[-6000:]}")
    return proc
