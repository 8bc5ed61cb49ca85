"""``lmc stats``: what a running cache server holds and has done (its STATS answer).

For operators: one command to see occupancy, hit rates and per-tier figures of a daemon
without scraping Prometheus, in sections like ``redis-cli INFO`` (Server, Memory, Requests,
Tiers, Namespaces). Sizes and durations are in human units, every hit rate comes with its
denominator (hits/asked) -- GETs' keys and lookups' (EXISTS) keys apart -- and each tier
says its declared medium and capabilities. Rates are per second since the daemon started,
or over the last interval with ``--watch``. Nothing here imports torch at load time, so
the command answers in a fraction of a second. ``--json`` prints the raw answer for scripts.
Given an engine's server or ``lmc router`` (``--url http://host:port``) it prints the
hit-rate funnel instead (:mod:`lmc.storage.funnel`): best possible, found, loaded and used
tokens, and the misses by reason. The token
comes from ``--token-file`` or ``LMC_REMOTE_TOKEN`` (never a flag value, which ``ps`` would
show).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from lmc import units
from lmc.server.text import safe


def fetch(url: str, token: str | None, timeout: float) -> dict[str, Any]:
    """One STATS answer; a connection or protocol failure raises :class:`StatsError`."""
    # imported here: the client needs torch, which ``lmc stats --help`` should not wait for
    from lmc.storage.backends.server.client import Address, ClientConnection, ServerError

    try:
        conn = ClientConnection(Address.parse(url), token, timeout, "lmc-stats")
    except ServerError as e:  # reached, but turned away (a missing or wrong token)
        raise StatsError(f"{url} rejected the connection: {e}") from None
    except (OSError, ValueError) as e:
        raise StatsError(f"cannot reach {url}: {e}") from None
    try:
        return conn.stats()
    except Exception as e:  # auth failure, protocol error, timeout: say which
        raise StatsError(f"{url} did not answer STATS: {type(e).__name__}: {e}") from None
    finally:
        conn.close()


class StatsError(Exception):
    pass


# ------------------------------------------------------------------------------ sections
def _tiers(flat: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{"cpu.used": 1, "disk.get_hits": 2}`` -> ``{"cpu": {"used": 1}, "disk": {...}}``."""
    out: dict[str, dict[str, Any]] = {}
    for k, v in flat.items():
        tier, _, name = k.partition(".")
        out.setdefault(tier, {})[name] = v
    return out


def _rate(now: dict[str, Any], before: dict[str, Any] | None, key: str, seconds: float,
          fmt=units.rate) -> str:
    """Per second over the last interval (``--watch``), else since the daemon started."""
    base = (before or {}).get(key, 0)
    return fmt(max(0.0, (now.get(key, 0) - base)) / max(seconds, 1e-9))


_TIER_KEYS = {"capacity", "chunks", "used", "used_bytes", "get_hits", "get_misses",
              "read_bytes", "write_bytes", "queue_bytes", "put_chunks"}


def _plain_value(key: str, v: Any) -> str:
    """A figure of an unknown group, in human units where its name says what it is."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return safe(v)
    if key.endswith("bytes"):
        return units.size(v)
    if key.endswith(("seconds", "_s")):
        return units.seconds(v)
    return f"{int(v):,}" if float(v).is_integer() else f"{v:.3g}"


def _per_s(x: float) -> str:
    return f"{x:,.1f}/s" if x >= 10 or x == 0 else f"{x:.3g}/s"


def _hits(parts: list[tuple[float, float, str]]) -> str:
    """``hits 50.0% (2/4) reads, 100.0% (4/4) lookups``: each kind that was asked; a tier
    nothing asked yet says so rather than ``- (0/0)``."""
    shown = [f"{units.ratio(h, n)} {what}" for h, n, what in parts if n]
    return "hits " + ", ".join(shown) if shown else "nothing asked yet"


_CAPABILITIES = {"layered_reads": "layered reads", "existence_without_reading":
                 "lookups without reading", "durable": "durable"}


def _declared(media: Any, name: str) -> str:
    """`` [local_storage: layered reads, durable]``: what the tier declares, when STATS
    says it (a daemon older than the ``media`` section does not)."""
    m = media.get(name) if isinstance(media, dict) else None
    if not isinstance(m, dict):
        return ""
    caps = [label for key, label in _CAPABILITIES.items() if m.get(key) is True]
    caps += [safe(k) for k, v in sorted(m.items())
             if k != "medium" and k not in _CAPABILITIES and v is True]
    return f" [{safe(m.get('medium', '?'))}" + (f": {', '.join(caps)}]" if caps else "]")


def _codec_line(t: dict[str, Any]) -> str:
    """``  codec int8.h64 (on): wrote 4.00 MiB of KV as 2.13 MiB (0.53), ...``: a coded
    tier's bytes before (raw) and after (stored) its codec stage (``lmc.storage.kvcodecs``),
    and why it is off when its gate kept it off (values then pass through exact)."""
    state = "on" if t.get("codec_active") else \
        f"off: {safe(t.get('codec_gate', 'gate closed'), 200)}; values stored exact"
    parts = []
    for op, did, how in (("write", "wrote", "as"), ("read", "read", "from")):
        raw, stored = t.get(f"codec_raw_bytes_{op}", 0), t.get(f"codec_stored_bytes_{op}", 0)
        share = f" ({stored / raw:.2f})" if raw else ""
        parts.append(f"{did} {units.size(raw)} of KV {how} {units.size(stored)}{share}")
    spent = [f"{what} {units.seconds(t[k])}" for k, what in
             (("codec_encode_seconds", "encode"), ("codec_decode_seconds", "decode"))
             if t.get(k)]
    odd = [f"{k.removeprefix('codec_')} {int(t[k]):,}" for k in
           ("codec_corrupt", "codec_skipped", "codec_alloc_failures") if t.get(k)]
    return (f"  codec {safe(t['codec'], 100)} ({state}): {', '.join(parts)}"
            + (f"; {', '.join(spent)}" if spent else "") + (f"; {', '.join(odd)}" if odd else ""))


def format_info(stats: dict[str, Any], before: dict[str, Any] | None = None,
                interval: float | None = None) -> str:
    """``redis-cli INFO``-style sections: ``# Section`` then ``key: value`` lines, sizes and
    durations in human units, every hit rate with its denominator. With ``before`` (the
    previous answer) rates are over ``interval`` seconds, else since the daemon started."""
    srv, pool = stats.get("server", {}), stats.get("pool", {})
    req = stats.get("requests", {})
    prev_req = (before or {}).get("requests") if before else None
    span = interval if before is not None and interval else srv.get("uptime_s", 0)
    over = f"last {units.seconds(span)}" if before is not None else "since start"
    lines = ["# Server",
             f"uptime: {units.seconds(srv.get('uptime_s', 0))}",
             f"connections: {srv.get('connections', 0)} "
             f"({srv.get('unauthenticated', 0)} not yet authenticated)",
             f"draining: {'yes' if srv.get('draining') else 'no'}",
             "", "# Memory",
             f"used: {units.size(pool.get('used', 0))} of {units.size(pool.get('capacity', 0))}"
             f" ({units.ratio(pool.get('used', 0), pool.get('capacity', 0)).split(' ')[0]})",
             f"objects: {pool.get('objects', 0):,}",
             f"fragmentation: {100 * pool.get('fragmentation', 0):.1f}%"]
    if "prefaulted" in pool:
        lines.append(f"pre-faulted: {units.size(pool['prefaulted'])} in "
                     f"{units.seconds(pool.get('prefault_seconds', 0))}")
    lines.append(f"leaks: {pool.get('leaks', 0)}")
    lines += ["", f"# Requests ({over})",
              f"puts: {req.get('puts', 0):,} ({req.get('stored', 0):,} of "
              f"{req.get('put_values', 0):,} values stored), "
              f"{_rate(req, prev_req, 'puts', span, _per_s)}",
              f"gets: {req.get('gets', 0):,}, {_rate(req, prev_req, 'gets', span, _per_s)}",
              f"hit rate: {units.ratio(req.get('hits', 0), req.get('get_keys', 0))} keys"]
    if "lookup_keys" in req:  # EXISTS (an engine's lookups); daemons before them omit it
        lines += [f"lookups: {req.get('lookups', 0):,}, "
                  f"{_rate(req, prev_req, 'lookups', span, _per_s)}; found "
                  f"{units.ratio(req.get('lookup_hits', 0), req.get('lookup_keys', 0))} keys"]
    lines += [
              f"in: {units.size(req.get('bytes_in', 0))}, "
              f"{_rate(req, prev_req, 'bytes_in', span)}",
              f"out: {units.size(req.get('bytes_out', 0))}, "
              f"{_rate(req, prev_req, 'bytes_out', span)}"]
    groups = _tiers({k: v for k, v in stats.get("tiers", {}).items()
                     if not k.startswith("namespaces.")})
    # a storage tier has storage figures; other groups (the P2P directory...) get a section
    tiers = {n: t for n, t in groups.items() if set(t) & _TIER_KEYS}
    others = {n: t for n, t in groups.items() if n not in tiers}
    memory = next(iter(tiers), None)  # STATS lists the memory tier (L1) first
    lower = [t for name, t in tiers.items() if name != memory]
    media = stats.get("media", {})
    lines += ["", "# Tiers"]
    for name, t in tiers.items():
        used = t.get("used", t.get("used_bytes", 0))
        held = (f"{t.get('chunks', 0):,} chunks, {units.size(used)} of "
                f"{units.size(t['capacity'])}; " if "capacity" in t else "")
        label = f"{safe(name)}{_declared(media, name)}"
        if name == memory:  # what GETs and lookups found without a lower tier
            hits = _hits([
                (max(0, req.get("hits", 0) - sum(x.get("get_hits", 0) for x in lower)),
                 req.get("get_keys", 0), "read keys"),
                (max(0, req.get("lookup_hits", 0) - sum(x.get("lookup_hits", 0)
                                                        for x in lower)),
                 req.get("lookup_keys", 0), "looked-up keys")])
            lines.append(f"{label}: {held}{hits}; evicted {t.get('evictions', 0):,} "
                         f"({units.size(t.get('evicted_bytes', 0))})")
            continue
        hits = _hits([(t.get("get_hits", 0), t.get("get_hits", 0) + t.get("get_misses", 0),
                       "reads"),
                      (t.get("lookup_hits", 0),
                       t.get("lookup_hits", 0) + t.get("lookup_misses", 0), "lookups")])
        extra = [f"{safe(k)} {int(v):,}" for k, v in sorted(t.items())
                 if (k.startswith(("errors_", "dropped_")) or k == "checksum_failures") and v]
        lines.append(f"{label}: {held}{hits}; "
                     f"read {units.size(t.get('read_bytes', 0))}, written "
                     f"{units.size(t.get('write_bytes', 0))}, queued "
                     f"{units.size(t.get('queue_bytes', 0))}"
                     + ("; " + ", ".join(extra) if extra else ""))
        if "codec" in t:
            lines.append(_codec_line(t))
    for name, t in others.items():
        lines += ["", f"# {safe(name)}"] + [f"{safe(k)}: {_plain_value(k, v)}"
                                           for k, v in sorted(t.items())]
    names = stats.get("namespaces", {})
    lines += ["", f"# Namespaces ({len(names)})"]
    for ns, c in sorted(names.items()):
        held = (f"{c['chunks']:,} chunks, {units.size(c.get('bytes', 0))} in memory"
                + (f" of quota {units.size(c['quota'])}" if c.get("quota") else "")
                + (f" (+{units.size(c['unsent_bytes'])} held by unsent replies)"
                   if c.get("unsent_bytes") else "") + "; "
                if "chunks" in c else "")
        lines.append(f"{safe(ns)}: {held}puts {c.get('puts', 0):,}, gets {c.get('gets', 0):,}, "
                     f"hit rate {units.ratio(c.get('hits', 0), c.get('get_keys', 0))} keys")
    return "\n".join(lines)


def render(stats: Any, before: dict[str, Any] | None = None,
           interval: float | None = None) -> str:
    """:func:`format_info`, with an answer of the wrong shape (a lying or foreign server: a
    string where a count belongs) a :class:`StatsError` naming what failed, not a
    traceback."""
    try:
        if not isinstance(stats, dict):
            raise TypeError(f"the answer is a {type(stats).__name__}, not a map")
        return format_info(stats, before, interval)
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
        raise StatsError(f"malformed STATS answer: {safe(e, 200)}") from None


def engine_funnel(url: str, timeout: float) -> dict[str, Any]:
    """An engine server's (or a router's) hit-rate funnel since it started, from its
    ``/lmc/stats`` and ``/metrics`` (:mod:`lmc.storage.funnel_report`)."""
    import urllib.error
    import urllib.request

    from lmc.storage.funnel_report import http_reader, view

    def get(path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(url.rstrip("/") + path, timeout=timeout) as r:
                return r.status, r.read(16 << 20)
        except urllib.error.HTTPError as e:
            return e.code, b""
        except urllib.error.URLError as e:
            raise OSError(str(e.reason)) from None

    figures = http_reader(get)()
    if not figures:
        raise StatsError(f"{url} answered neither /lmc/stats nor lmc's /metrics series")
    rows = view(figures)
    if rows is None:
        raise StatsError(f"{url} has no hit-rate funnel yet (no lookups, or lmc's funnel off)")
    return rows


def _funnel_main(args: argparse.Namespace) -> int:
    from lmc.storage.funnel_report import format_funnel
    try:
        rows = engine_funnel(args.url, args.timeout)
    except StatsError as e:
        print(f"lmc stats: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rows, indent=2, sort_keys=True))
    else:
        print(f"# {args.url}" + "\n".join(format_funnel(rows)))
    return 0


def _main(args: argparse.Namespace) -> int:
    if args.url.startswith(("http://", "https://")):
        return _funnel_main(args)
    token = os.environ.get("LMC_REMOTE_TOKEN")
    if args.token_file:
        try:
            token = Path(args.token_file).read_text().strip()
        except OSError as e:
            print(f"lmc stats: --token-file: {e.strerror}: {args.token_file}", file=sys.stderr)
            return 2
    before: dict[str, Any] | None = None
    while True:
        t0 = time.monotonic()
        try:
            stats = fetch(args.url, token, args.timeout)
        except StatsError as e:
            print(f"lmc stats: {e}", file=sys.stderr)
            return 2
        if args.json:
            print(json.dumps(stats, indent=2, sort_keys=True, default=str), flush=True)
        else:
            if args.watch and sys.stdout.isatty():
                print("\x1b[H\x1b[2J", end="")  # clear the screen: one screenful per sample
            if args.watch:
                print(f"# {args.url} at {time.strftime('%H:%M:%S')}")
            try:
                text = render(stats, before, args.watch)
            except StatsError as e:
                print(f"lmc stats: {args.url}: {e}", file=sys.stderr)
                return 2
            print(text, flush=True)
        if not args.watch:
            return 0
        before = stats
        time.sleep(max(0.0, args.watch - (time.monotonic() - t0)))
        if not args.json and not sys.stdout.isatty():
            print()


def _positive_seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text}")
    return v


def register_cli(subparsers: Any) -> None:
    from lmc.cli_args import add_command

    p = add_command(subparsers, "stats", "print a running lmc server's statistics", __doc__)
    p.add_argument("--url", default="lmc://127.0.0.1:7451", metavar="URL",
                   help="lmc://host:port or lmc+unix:///path (default %(default)s); an "
                        "engine's server or lmc router (http://host:port): its hit-rate "
                        "funnel")
    p.add_argument("--token-file", metavar="FILE",
                   help="file holding the token (else LMC_REMOTE_TOKEN)")
    p.add_argument("--timeout", type=_positive_seconds, default=5.0, metavar="SECONDS",
                   help="for the connection and the answer (default %(default)s)")
    p.add_argument("--json", action="store_true",
                   help="print the raw answer as JSON (bytes and seconds as numbers)")
    p.add_argument("--watch", type=_positive_seconds, nargs="?", const=2.0, default=None,
                   metavar="SECONDS",
                   help="print again every SECONDS (default 2), rates over the last interval; "
                        "Ctrl-C stops")
    p.set_defaults(func=_main)
