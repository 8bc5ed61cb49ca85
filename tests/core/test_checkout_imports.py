"""A checkout imports without an install: every package lives under ``lmc/`` (issue 21; the
old layout mapped two top-level folders into ``lmc`` at install time, so a second checkout
silently ran the first one's connectors and tiers)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_checkout_imports_its_own_packages_with_no_install(tmp_path):
    # -S: no site-packages at all, so no editable install (of this or another checkout) helps
    code = ("import lmc, lmc.connectors.vllm, lmc.connectors.sglang, lmc.storage.backends, "
            "lmc.storage.backends.redis, lmc.connectors.core; "
            "import sys; print(lmc.__file__); print(lmc.connectors.vllm.__file__); "
            "print(lmc.storage.backends.__file__)")
    out = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, text=True,
                         capture_output=True, timeout=60, env={"PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    files = [Path(line) for line in out.stdout.split()]
    assert len(files) == 3 and all(f.is_relative_to(ROOT / "lmc") for f in files), files


def test_the_engine_module_paths_export_their_classes_lazily(tmp_path):
    """``lmc.connectors.vllm`` and ``lmc.connectors.sglang`` are what engine configs name; their
    parts that need no engine must import without it."""
    code = ("import lmc.connectors.vllm as v, lmc.connectors.sglang as s; "
            "import lmc.connectors.vllm.extra_config, lmc.connectors.sglang.pages; import sys; "
            "print(sorted(v.__all__), sorted(s.__all__), 'vllm' in sys.modules, "
            "'sglang' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, text=True,
                         capture_output=True, timeout=120, env={"PYTHONPATH": str(ROOT),
                                                                "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("]")[0] == "['LMCConnector'", out.stdout
    assert out.stdout.strip().endswith("False False"), out.stdout
