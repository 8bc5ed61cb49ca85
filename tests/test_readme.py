"""The README's promises that code can check: its config table lists every key."""

from __future__ import annotations

from pathlib import Path

from lmc.config import CacheConfig

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_config_reference_lists_every_key():
    missing = [k for k in CacheConfig.field_names() if f"| `{k}` |" not in README]
    assert not missing, f"README's configuration reference lacks {missing}"


def test_two_setup_commands_exist_in_makefile():
    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    assert "make demo" in README and "make test" in README
    assert "\ndemo:" in makefile and "\ntest:" in makefile


def _python_block(heading: str) -> str:
    section = README.split(heading, 1)[1]
    return section.split("```python", 1)[1].split("```", 1)[0]


def test_python_api_quick_start_runs(monkeypatch):
    """The README's Python API example is executed as written (from the repository root)."""
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    env: dict = {}
    exec(compile(_python_block("## Python API quick start"), "README.md", "exec"), env)
    assert env["stored"] == 1000 and env["hit"] == 1000 and env["loaded"] == 1000
