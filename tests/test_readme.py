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
