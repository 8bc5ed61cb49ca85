"""``lmc cache``: steer a running cache -- pin a prompt for a while, set its retention
priority, delete it, clear a namespace, prefetch a prompt into memory.

    lmc cache pin    --server http://127.0.0.1:8000 --prompt "You are a coding agent..." --ttl 10m
    lmc cache delete --server http://127.0.0.1:8200 --tokens 1,2,3,4 --token-file ops.token
    lmc cache clear  --daemon lmc://127.0.0.1:7451?ns=team-a --token-file team-a.token

``--server`` is an engine's OpenAI-style server (the reference server) or ``lmc router``
(which forwards to its instances): the op is its ``POST /admin/cache/<op>``, the prompt
tokenized there exactly as a completion's (text, ``--tokens``, or ``--messages-file`` with
chat turns). ``--daemon`` is an ``lmc server``: it knows chunks by the engines' keys, not by
tokens, so only ``clear`` (its CLEAR op, for the URL's ``?ns=`` or ``--namespace``) is
offered there. The secret comes from ``--token-file`` (never a flag value, which ``ps`` would
show), else ``LMC_REMOTE_TOKEN`` for a daemon. One line says what was done; ``--json`` prints
the answer. Exit status: 0 done, 1 refused or unreachable (the reason in one line), 2 a
mistake in the command.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

OPS = ("pin", "unpin", "priority", "delete", "clear", "prefetch")


class CacheCliError(Exception):
    """A refusal or a failure to reach the target: exit status 1."""


def register_cli(sub: Any) -> None:
    from lmc.cli_args import add_command, float_in, int_in
    p = add_command(sub, "cache", "pin, prioritise, delete, clear or prefetch cached "
                    "prompts of a running server, router or daemon", __doc__)
    p.add_argument("op", choices=OPS)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--server", metavar="URL", help="http://host:port of an engine's "
                       "server or of lmc router")
    where.add_argument("--daemon", metavar="URL", help="lmc://host:port[?ns=NS] or "
                       "lmc+unix:///path of an lmc server (clear only)")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--prompt", metavar="TEXT", help="the prompt, as text")
    what.add_argument("--prompt-file", metavar="FILE", help="the prompt, as a text file")
    what.add_argument("--tokens", metavar="IDS", help="the prompt, as comma-separated ids")
    what.add_argument("--messages-file", metavar="FILE",
                      help="the prompt, as a JSON list of chat turns")
    p.add_argument("--ttl", metavar="DURATION", help="pin: how long ('90s', '10m')")
    p.add_argument("--priority", type=int_in(-10, 10), metavar="N",
                   help="retention priority, -10..10 (higher is kept longer)")
    p.add_argument("--session", metavar="ID", help="pin/unpin: the session owning the pins")
    p.add_argument("--cache-salt", metavar="SALT", help="the requests' cache_salt")
    p.add_argument("--namespace", metavar="NS", help="the namespace (default: the target's)")
    p.add_argument("--token-file", metavar="FILE", help="the admin secret")
    p.add_argument("--timeout", type=float_in(0, 3600, low_open=True), default=60.0,
                   metavar="SECONDS")
    p.add_argument("--json", action="store_true", help="print the answer as JSON")
    p.set_defaults(func=run)


def _body(args: argparse.Namespace) -> dict[str, Any]:
    from lmc.settings import parse_duration
    body: dict[str, Any] = {}
    if args.prompt is not None:
        body["prompt"] = args.prompt
    elif args.prompt_file is not None:
        body["prompt"] = _read(args.prompt_file, "--prompt-file")
    elif args.tokens is not None:
        try:
            body["prompt"] = [int(t) for t in args.tokens.split(",") if t.strip()]
        except ValueError:
            raise ValueError(f"--tokens: expected comma-separated integers, got "
                             f"{args.tokens[:60]!r}") from None
    elif args.messages_file is not None:
        try:
            body["messages"] = json.loads(_read(args.messages_file, "--messages-file"))
        except ValueError as e:
            raise ValueError(f"--messages-file {args.messages_file}: not JSON ({e})") from None
    if args.ttl is not None:
        body["ttl"] = parse_duration(args.ttl, "--ttl", minimum=0.001)
    for key in ("priority", "session", "cache_salt", "namespace"):
        if getattr(args, key) is not None:
            body[key] = getattr(args, key)
    return body


def _read(path: str, flag: str) -> str:
    try:
        if Path(path).stat().st_size > 1 << 20:
            raise ValueError(f"{flag} {path}: larger than 1 MiB")
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot read it ({e.strerror})") from None


def _secret(args: argparse.Namespace, daemon: bool) -> str | None:
    if args.token_file:
        return _read(args.token_file, "--token-file").strip()
    return os.environ.get("LMC_REMOTE_TOKEN") if daemon else None


def via_server(url: str, op: str, body: dict[str, Any], secret: str | None,
               timeout: float) -> dict[str, Any]:
    headers = {"Content-Type": "application/json"}
    if secret:
        headers["Authorization"] = f"Bearer {secret}"
    req = urllib.request.Request(url.rstrip("/") + f"/admin/cache/{op}",
                                 data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read(1 << 20))
    except urllib.error.HTTPError as e:
        try:
            msg = json.loads(e.read(1 << 16))["error"]["message"]
        except (ValueError, KeyError, TypeError):
            msg = e.reason
        raise CacheCliError(f"{url} refused {op} ({e.code}): {msg}") from None
    except (OSError, ValueError) as e:
        raise CacheCliError(f"cannot reach {url}: {e}") from None


def via_daemon(url: str, namespace: str | None, secret: str | None, timeout: float
               ) -> dict[str, Any]:
    from lmc.storage.backends.server.client import Address, ClientConnection, ServerError
    addr = Address.parse(url)
    ns = namespace if namespace is not None else addr.namespace
    if ns is None:
        raise ValueError("clear on a daemon needs its namespace: ?ns= in the URL or "
                         "--namespace")
    try:
        conn = ClientConnection(addr, secret, timeout, "lmc-cache")
    except (ServerError, OSError) as e:
        raise CacheCliError(f"cannot reach {url}: {e}") from None
    try:
        return {"namespace": ns, "deleted": conn.clear(ns)}
    except Exception as e:  # a forbidden namespace, a refusal, a timeout: say which
        raise CacheCliError(f"{url} refused clear of {ns!r}: {e}") from None
    finally:
        conn.close()


def summary(op: str, out: dict[str, Any]) -> str:
    if "instances" in out:  # a router's answer: one part per instance
        return "; ".join(f"{u}: {summary(op, a) if a.get('status') == 200 else a}"
                         for u, a in out["instances"].items()) or "no healthy instance"
    if op == "pin":
        return f"pinned {out['pinned_tokens']} of {out['prompt_tokens']} tokens"
    if op == "unpin":
        return f"unpinned {out['unpinned_chunks']} chunks"
    if op == "priority":
        return f"priority set on {out['chunks']} chunks in memory"
    if op == "delete":
        return f"deleted {out['deleted']} chunk copies"
    if op == "clear" and "cleared" in out:
        return "cleared " + ", ".join(f"{t}: {'?' if n is None else n}"
                                      for t, n in out["cleared"].items())
    if op == "clear":
        return f"cleared namespace {out['namespace']!r}: {out['deleted']} values"
    return f"prefetch of {out.get('prompt_tokens', '?')} tokens queued"


def run(args: argparse.Namespace) -> int:
    try:
        if args.daemon is not None:
            if args.op != "clear":
                raise ValueError(f"{args.op} needs an engine's server (--server): a daemon "
                                 "knows chunks by the engines' keys, not by tokens")
            out = via_daemon(args.daemon, args.namespace, _secret(args, True), args.timeout)
        else:
            body = _body(args)
            if args.op == "pin" and "ttl" not in body:
                raise ValueError("pin needs --ttl")
            out = via_server(args.server, args.op, body, _secret(args, False), args.timeout)
    except ValueError as e:
        print(f"lmc cache: {e}", file=sys.stderr)
        return 2
    except CacheCliError as e:
        print(f"lmc cache: {e}", file=sys.stderr)
        return 1
    print(json.dumps(out, indent=2) if args.json else
          f"lmc cache {args.op}: {summary(args.op, out)}")
    return 0
