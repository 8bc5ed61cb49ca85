"""``lmc config``: check a config file the way the program that reads it would, and print it
resolved. Three kinds of file are shown to it:

* an engine config (``CacheConfig``: ``configs/cpu.yaml``), checked as the engine loads it;
* the same with a connector section (``vllm:``, as in ``configs/vllm.yaml``), checked by the
  vLLM connector's own loader, so the section's options are checked too;
* a daemon config (``ServerConfig``: ``configs/server/server.yaml``), with ``--server`` or
  recognised by its keys (``host``, ``port``, ...), checked as ``lmc server --config`` loads
  it, token files and the storage's ``cache:`` keys included.

A file that mixes engine and daemon keys is refused with a sentence saying which are which.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

SECTIONS = ("vllm",)  # connector sections an engine config may hold (lmc.config.load_connector_settings)

DOC = """Validate a config file and print it resolved.

Reads the YAML file (if given), then the LMC_* environment variables (LMC_SERVER_* for a
daemon config), checks every key and value as the program that reads the file would, and
prints the result as YAML (sizes as 2GiB, durations as 500ms; secrets as ***). Exit status 2
and a message naming the key when something is wrong.

Engine configs may hold the vLLM connector's vllm: section (configs/vllm.yaml); it is checked
with the connector's own loader. A daemon config (configs/server/server.yaml: host, port,
size, ...) is recognised by its keys, or named with --server, and checked as lmc server
--config reads it (token files, the storage's cache: keys)."""


def add_arguments(c: argparse.ArgumentParser) -> None:
    c.add_argument("--config", metavar="FILE", help="YAML file (defaults only when omitted)")
    c.add_argument("--server", action="store_true",
                   help="FILE is an lmc server (daemon) config (recognised by its keys "
                        "without this flag)")
    c.add_argument("--keys", action="store_true", help="list every key with its default "
                   "(with --server: the daemon's keys)")


def run(args: argparse.Namespace) -> int:
    from lmc.config import CacheConfig
    from lmc.server.server_config import ServerConfig

    if args.keys:
        for key, default, doc in (ServerConfig if args.server else CacheConfig).describe():
            print(f"{key:20s} default {default!r:12}  {doc}")
        return 0
    try:
        kind, note = _kind(args.config, args.server)
        shown = _check_daemon(args.config) if kind == "daemon" else _check_engine(args.config)
    except (ValueError, OSError) as e:
        print(f"lmc config: {e}", file=sys.stderr)
        return 2
    if note:
        print(f"# {note}")
    print(yaml.safe_dump(shown, sort_keys=False).rstrip())
    return 0


def _keys(path: str | None) -> tuple[str, list[str]]:
    from lmc.settings import read_yaml

    if path is None:
        return "", []
    file = read_yaml(path)
    return file.path, list(file.data)


def _kind(path: str | None, server: bool) -> tuple[str, str]:
    """``("engine" | "daemon", a comment for the output)``; a file mixing the two schemas is
    a :class:`ValueError` saying which keys belong where."""
    from lmc.config import CacheConfig
    from lmc.server.server_config import ServerConfig

    name, keys = _keys(path)
    engine = set(CacheConfig.field_names()) | set(SECTIONS)
    daemon = set(ServerConfig.field_names())
    if server:
        if keys and not set(keys) & daemon - engine and set(keys) - daemon:
            wrong = sorted(set(keys) - daemon)
            raise ValueError(f"{name}: {', '.join(wrong)}: engine config keys, not the "
                             "daemon's; check an engine config without --server")
        return "daemon", ""
    only_daemon = [k for k in keys if k in daemon and k not in engine]
    if not only_daemon:
        return "engine", ""
    only_engine = [k for k in keys if k in engine and k not in daemon]
    if only_engine:
        raise ValueError(f"{name} mixes daemon keys ({', '.join(only_daemon)}) with engine "
                         f"keys ({', '.join(only_engine)}): an engine config takes none of the "
                         "first; a daemon config puts engine keys under cache: "
                         "(configs/server/server.yaml)")
    return "daemon", (f"{name}: an lmc server (daemon) config, recognised by its keys "
                      f"({', '.join(only_daemon[:3])}); checked as lmc server --config "
                      "reads it")


def _check_engine(path: str | None) -> dict[str, Any]:
    """The engine's settings (and the ``vllm:`` section, by the connector's own loader)."""
    from lmc.config import CacheConfig
    from lmc.storage.chain import check_chain
    from lmc.units import readable_settings

    _, keys = _keys(path)
    if "vllm" in keys:
        from lmc.connectors.vllm.extra_config import load_settings

        settings = load_settings({"lmc.config_file": path})
        cache: CacheConfig = settings.cache
        check_chain(cache)
        return {**readable_settings(cache), "vllm": readable_settings(settings.vllm)}
    cfg = CacheConfig.load(path)
    check_chain(cfg)
    # secrets masked; sizes and durations in units the file accepts again (2GiB, 500ms)
    return readable_settings(cfg)


def _check_daemon(path: str | None) -> dict[str, Any]:
    """The daemon's settings as ``lmc server --config`` loads them, then what it reads at
    start-up before binding: the token files and the storage's keys and options."""
    from lmc.server.server_config import ServerConfig
    from lmc.storage.chain import check_chain
    from lmc.units import readable_settings, size_exact

    cfg = ServerConfig.load(Path(path) if path else None)
    cfg.authenticator()
    check_chain(cfg.cache_config())
    out = readable_settings(cfg)
    # in the forms the file takes again: a mode in octal, quotas as sizes
    out["unix_socket_mode"] = f"{cfg.unix_socket_mode:04o}"
    if cfg.quota_default is not None:
        out["quota_default"] = size_exact(cfg.quota_default)
    out["quotas"] = {ns: size_exact(n) for ns, n in cfg.quotas.items()}
    return out
