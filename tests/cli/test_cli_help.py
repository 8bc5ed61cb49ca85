"""``--help`` and ``lmc config`` read as text for people: every subcommand has a description,
no RST markup or developer notes leak in, every flag's value is named for its kind (never a
bare ``VALUE``), ``lmc config`` prints sizes and durations in config units, and the daemon's
documented config file holds exactly the built-in defaults."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lmc.cli import build_parser, main
from lmc.cli_args import help_text
from lmc.server.server_config import ServerConfig

ROOT = Path(__file__).resolve().parents[2]


def _subcommands() -> dict[str, str]:
    p = build_parser()
    sub = next(a for a in p._actions if a.dest == "cmd")
    return {name: sp.format_help() for name, sp in sub.choices.items()}


def test_every_subcommand_has_a_clean_description():
    helps = _subcommands()
    assert {"config", "demo", "server", "stats"} <= set(helps)
    for name, text in helps.items():
        usage_end = text.index("\n\n")
        description = text[usage_end:].split("options:", 1)[0].strip()
        assert len(description) > 20, f"lmc {name} --help has no description"
        assert "``" not in text and ":class:" not in text, f"RST markup in lmc {name} --help"
        assert not re.search(r"(?<!=)\bVALUE\b", text), f"a bare VALUE placeholder in lmc {name}"
    assert "never lack one" not in helps["server"]  # the developer note stays in the source


def test_server_flags_name_their_kind():
    text = _subcommands()["server"]
    for flag, metavar in (("--prefault", "{true,false}"), ("--size", "SIZE"),
                          ("--port", "PORT"), ("--hello-timeout", "SECONDS"),
                          ("--token-file", "PATH"), ("--max-connections", "N"),
                          ("--log-level", "{DEBUG,INFO,WARNING,ERROR}")):
        assert f"{flag} {metavar}" in text, (flag, metavar)
    assert "(default 1GiB)" in text and "(default true)" in text


def test_help_text_strips_markup():
    assert help_text("``lmc x`` and **bold** and :class:`~a.B`") == "lmc x and bold and a.B"


def test_config_prints_sizes_and_durations_in_config_units(tmp_path, monkeypatch, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("local_cpu_size: 4GiB\nremote_timeout: 500ms\nlocal_disk_size: 1500MB\n")
    for k in list(os.environ):
        if k.startswith("LMC_") and k != "LMC_DEBUG_INVARIANTS":
            monkeypatch.delenv(k)
    assert main(["config", "--config", str(cfg)]) == 0
    out = yaml.safe_load(capsys.readouterr().out)
    assert out["local_cpu_size"] == "4GiB" and out["local_disk_size"] == "1500MB"
    assert out["remote_timeout"] == "500ms" and out["pin_timeout"] == "60s"
    assert out["chunk_size"] == 256
    # what it prints is a config lmc reads back to the same values
    again = tmp_path / "again.yaml"
    again.write_text(yaml.safe_dump(out))
    from lmc.config import CacheConfig

    assert CacheConfig.load(again) == CacheConfig.load(cfg)


def test_server_yaml_documents_exactly_the_defaults():
    path = ROOT / "configs/server/server.yaml"
    assert ServerConfig.load(path) == ServerConfig()
    written = set(yaml.safe_load(path.read_text()))
    assert written == set(ServerConfig.field_names()), "server.yaml must list every key"


@pytest.mark.parametrize("argv", [["config", "--keys"], ["--help"]])
def test_closed_stdout_is_quiet(argv):
    """A reader that goes away (``| head``) ends the command without a traceback."""
    p = subprocess.Popen([sys.executable, "-c", "import sys; from lmc.cli import main; "
                          f"sys.exit(main({argv!r}))"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, cwd=ROOT)
    p.stdout.close()  # before anything is written
    err = p.stderr.read().decode()
    p.wait(timeout=60)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["stats", "--help"],
                                  ["demo", "--help"], ["bench", "--help"], ["config", "--keys"],
                                  ["workload", "chat", "--help"], ["replay", "--help"],
                                  ["model", "list"], ["model", "get", "--help"]])
def test_help_and_light_commands_do_not_import_torch(argv):
    """torch takes seconds to import: ``lmc --help`` and the commands that never touch a
    tensor answer without it (``lmc`` imports its public names lazily)."""
    code = (f"import sys\nfrom lmc.cli import main\ntry:\n    rc = main({argv!r})\n"
            "except SystemExit as e:\n    rc = e.code\n"
            "heavy = sorted(m for m in ('torch', 'numpy', 'lmc.cache_engine') "
            "if m in sys.modules)\nprint('HEAVY', heavy, rc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.rstrip().splitlines()[-1] == "HEAVY [] 0", (argv, out.stdout[-500:])


def test_lmc_help_lists_every_command_with_its_own_summary():
    """The summaries ``lmc --help`` shows without importing a command's module are the ones
    that module registers (a table in lmc.cli that cannot drift from them)."""
    from lmc.cli import COMMANDS

    full = next(a for a in build_parser()._actions if a.dest == "cmd")
    light = next(a for a in build_parser(only="")._actions if a.dest == "cmd")
    own = {a.dest: a.help for a in full._choices_actions}
    listed = {a.dest: a.help for a in light._choices_actions}
    assert set(COMMANDS) <= set(listed) and set(listed) == set(own)
    assert listed == own


def test_public_api_imports_lazily():
    code = ("import sys, lmc\nassert 'torch' not in sys.modules\n"
            "from lmc import CacheConfig, CacheEngine, KVSpec\nfrom lmc.memory import invariants\n"
            "assert CacheEngine.__module__ == 'lmc.cache_engine' and 'torch' in sys.modules\n"
            "assert set(lmc.__all__) == set(lmc._LAZY) and set(lmc.__all__) <= set(dir(lmc))\n"
            "assert all(getattr(lmc, n) is not None for n in lmc.__all__)\n"
            "try:\n    lmc.no_such_name\nexcept AttributeError as e:\n"
            "    assert 'no_such_name' in str(e)\nelse:\n    raise SystemExit('no error')\n"
            "print('OK')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.stdout.strip() == "OK", out.stderr[-2000:]
