"""``lmc stats``: what a running cache server holds and has done (its STATS answer).

For operators: one command to see occupancy, hit counts and per-tier figures of a daemon
without scraping Prometheus. The token comes from ``--token-file`` or ``LMC_REMOTE_TOKEN``
(never a flag value, which ``ps`` would show).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from lmc.server.client import Address, ClientConnection, ServerError


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, f"{key}."))
        else:
            out[key] = v
    return out


def _main(args: argparse.Namespace) -> int:
    token = os.environ.get("LMC_REMOTE_TOKEN")
    if args.token_file:
        token = Path(args.token_file).read_text().strip()
    try:
        conn = ClientConnection(Address.parse(args.url), token, args.timeout, "lmc-stats")
    except ServerError as e:  # reached, but turned away (a missing or wrong token)
        print(f"lmc stats: {args.url} rejected the connection: {e}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:
        print(f"lmc stats: cannot reach {args.url}: {e}", file=sys.stderr)
        return 2
    try:
        stats = conn.stats()
    except Exception as e:  # auth failure, protocol error, timeout: say which
        print(f"lmc stats: {args.url} did not answer STATS: {type(e).__name__}: {e}",
              file=sys.stderr)
        return 2
    finally:
        conn.close()
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True, default=str))
    else:
        flat = _flatten(stats)
        width = max((len(k) for k in flat), default=0)
        for k in sorted(flat):
            print(f"{k:<{width}}  {flat[k]}")
    return 0


def register_cli(subparsers: Any) -> None:
    p = subparsers.add_parser("stats", help="print a running lmc server's statistics",
                              description=__doc__)
    p.add_argument("--url", default="lmc://127.0.0.1:7451",
                   help="lmc://host:port or lmc+unix:///path (default %(default)s)")
    p.add_argument("--token-file", help="file holding the shared token (else LMC_REMOTE_TOKEN)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print the raw answer as JSON")
    p.set_defaults(func=_main)
