"""vLLM 0.32's GPU KV-cache layouts against lmc, with vLLM's own layout resolution and
allocation code run on CPU tensors (``vllm_scripts/vllm_gpu_layouts.py``, in the vLLM venv):
every element lmc writes is where vLLM's attention reads it, in every layout vLLM can resolve
for FLASH_ATTN, TRITON_ATTN, FLASHINFER and FLASHMLA, and KV saved from those caches loads
bit-exact into vllm_flash and sglang_mha caches of the same model (and back)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.connectors.vllm.test_vllm_integration import _env, _vllm_python

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[1] / "vllm_scripts" / "vllm_gpu_layouts.py"
LAYOUTS = ("LBNHC", "LBHNC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")


def test_vllm_builds_what_lmc_addresses(tmp_path):
    py = _vllm_python()
    res = subprocess.run([py, str(SCRIPT)], capture_output=True, text=True, timeout=420,
                         env=_env(), cwd=tmp_path)
    assert res.returncode == 0, f"{SCRIPT.name} failed:\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}"
    cases = json.loads(res.stdout.strip().splitlines()[-1])["cases"]
    for backend in ("FLASH_ATTN", "TRITON_ATTN", "FLASHINFER", "FLASHMLA"):
        resolved = {c.split(":")[1].split("->")[1] for c in cases if c.startswith(backend + ":")}
        assert resolved == set(LAYOUTS), f"{backend}: layouts checked {sorted(resolved)}"
        assert f"{backend}:default->LBNHC:float32" in cases, "vLLM's default is NHD (LBNHC)"
        assert f"{backend}:HND->LBHNC:float16" in cases, "VLLM_KV_CACHE_LAYOUT=HND honoured"
