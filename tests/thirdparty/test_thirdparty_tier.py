"""A third-party tier runs lmc's contract by import: ``toy_tier_pkg/`` (a package of its own,
with its own pytest project) runs ``lmc.testing``'s classes in a child pytest that can import
lmc and the toy only (no lmc ``tests/``, no repository root on the path). The toy passes;
each deliberate bug put into a copy of it fails the contract test written for it.
docs/extending.md ("A storage tier") walks through it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOY = Path(__file__).resolve().parent / "toy_tier_pkg"
BACKEND = "lmc_toy_tier/backend.py"

# (the bug, text of backend.py it replaces, replacement, the contract test that must catch it)
BUGS = [
    ("serves a damaged value", "verify_payload(header, memoryview(value)[HEADER_SIZE:])",
     "pass", "test_corrupted_value_is_a_miss_and_deleted"),
    ("keeps a reference of every hit", "obj.byte_view()[:] = memoryview(value)[HEADER_SIZE:]",
     "obj.byte_view()[:] = memoryview(value)[HEADER_SIZE:]; obj.acquire()",
     "test_each_hit_is_one_reference_for_the_caller"),
    ("raises when its directory is gone", "except OSError:  # the directory is gone",
     "except ValueError:  # the directory is gone",
     "test_dead_backend_answers_misses_within_a_deadline"),
    ("counts a delete it did not do", "os.unlink(self._file(k))\n", "\n",
     "test_call_sequences_match_the_model"),
    ("declares memory", "medium = Medium.LOCAL_STORAGE", "medium = Medium.MEMORY",
     "test_declarations_match_the_tier"),
    ("serves after close()", "return [None if self._closed else self._load(k) for k in keys]",
     "return [self._load(k) for k in keys]", "test_close_with_work_in_flight"),
]


def _project(tmp_path: Path, bug: tuple[str, str, str, str] | None = None) -> Path:
    """A copy of the toy project (with ``bug`` put in), and beside it a folder holding only
    this checkout's ``lmc`` package: the child's whole import path besides the stdlib and
    site-packages."""
    project = tmp_path / "toy"
    shutil.copytree(TOY, project, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    if bug is not None:
        src = project / BACKEND
        text = src.read_text()
        assert text.count(bug[1]) == 1, f"the toy no longer has {bug[1]!r}: update BUGS"
        src.write_text(text.replace(bug[1], bug[2]))
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "lmc").symlink_to(ROOT / "lmc", target_is_directory=True)
    return project


def _run(project: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env["PYTHONPATH"] = os.pathsep.join([str(project), str(project.parent / "site")])
    return subprocess.run([sys.executable, *argv], cwd=project, env=env, capture_output=True,
                          text=True, timeout=300)


def _pytest(project: Path) -> subprocess.CompletedProcess:
    return _run(project, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o",
                "console_output_style=classic", str(project))


def test_the_child_sees_lmc_and_the_toy_only(tmp_path):
    """What the runs below prove rests on this: lmc's own tests are not importable there."""
    project = _project(tmp_path)
    probe = ("import importlib.util as u; "
             "print(u.find_spec('tests'), u.find_spec('lmc').origin, "
             "u.find_spec('lmc_toy_tier').origin)")
    out = _run(project, "-c", probe)
    assert out.returncode == 0, out.stderr
    tests, lmc, toy = out.stdout.split()
    assert tests == "None", f"lmc's tests are importable in the child: {tests}"
    assert lmc.startswith(str(tmp_path / "site" / "lmc")), lmc
    assert toy.startswith(str(project)), toy


def test_lmc_finds_the_installed_tier_through_its_entry_point(tmp_path):
    """Installed (here into a folder of its own, from the copy: nothing written into the
    repository), the toy is found by URL scheme through the ``lmc.storage.backends``
    entry-point group: nothing imports it by name."""
    project = _project(tmp_path)
    target = tmp_path / "installed"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                          "--no-build-isolation", "--no-index", "--target", str(target),
                          str(project)], capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stderr[-3000:]
    shutil.rmtree(project)  # only the installed copy is left to find
    probe = ("from lmc.storage.tier import backend_factory; "
             f"print(backend_factory('toyfiles://{tmp_path}/store').__module__)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), str(tmp_path / "site")])}
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["lmc_toy_tier.backend"], out.stdout


def test_a_third_party_tier_passes_the_contract_by_import(tmp_path):
    out = _pytest(_project(tmp_path))
    report = out.stdout[-6000:] + out.stderr[-3000:]
    assert out.returncode == 0, report
    assert " passed" in out.stdout and "failed" not in out.stdout and "error" not in out.stdout
    passed = int(out.stdout.rsplit(" passed", 1)[0].rsplit(None, 1)[-1])
    assert passed >= 18, f"only {passed} contract tests ran:\n{report}"


@pytest.mark.parametrize("bug", BUGS, ids=[b[0] for b in BUGS])
def test_a_broken_third_party_tier_fails_the_contract(tmp_path, bug):
    out = _pytest(_project(tmp_path, bug))
    report = out.stdout[-6000:] + out.stderr[-3000:]
    assert out.returncode == 1, f"a tier that {bug[0]} passed the contract:\n{report}"
    assert f"FAILED test_toy_tier.py::TestToyFileTier::{bug[3]}" in out.stdout, \
        f"{bug[3]} did not catch a tier that {bug[0]}:\n{report}"
