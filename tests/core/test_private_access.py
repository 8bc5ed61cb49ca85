"""No module of lmc reads another module's private state.

A module's underscore names are its own: the split-off parts of a backend (the disk and
Redis tiers' layered readers) reach their tier through a small documented object the tier
hands them (``DiskReads``, ``RedisCalls``), never through ``tier._lock`` or ``tier._io``.
Read from the source with ``ast``, nothing imported: an attribute ``x._name`` (``x`` not
``self`` or ``cls``) is allowed only when ``_name`` is defined in the same file (a method,
a class attribute, ``self._name = ...``, a module name, a ``__slots__`` entry), i.e. the
object is one of this file's own classes; and no module imports another's ``_name``.

Third-party objects whose private names lmc has to use are listed below, each with why.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LMC = ROOT / "lmc"

# (file under lmc/, the expression as ast.unparse writes it): why it is allowed
EXCEPTIONS: dict[tuple[str, str], str] = {
    ("cli.py", "target._actions"): "argparse has no public list of a parser's flags",
    ("cli.py", "parser._actions"): "argparse has no public list of a parser's subparsers",
    ("cli.py", "argparse._SubParsersAction"): "argparse's subparser action has no public name",
    ("connectors/vllm/connector.py", "from vllm.v1.attention.backends.cpu_attn import "
     "_get_attn_isa"): "vLLM's CPU attention picks its ISA only here (pinned vLLM version)",
    ("connectors/vllm/stats.py", "REGISTRY._collector_to_names"):
        "prometheus_client has no public way to find a collector by name",
    ("memory/invariants.py", "sys._getframe"): "the stdlib's cheap caller frame",
    ("metrics.py", "c._name"): "prometheus_client keeps a metric's name only privately",
    ("metrics.py", "metric._labelnames"): "prometheus_client has no public label names",
    ("storage/backends/p2p/agent.py", "atexit._run_exitfuncs"): "the stdlib runs exit handlers only privately "
                                               "(before os._exit, which NIXL agents need)",
    ("storage/backends/p2p/agent.py", "os._exit"): "the stdlib's exit without cleanup (NIXL agents)",
    ("cli.py", "os._exit"): "after Ctrl-C and the command's own cleanup, exit 130 without a "
                            "finalization that could end the process by SIGINT",
    ("storage/backends/p2p/agent.py", "from nixl import _api"): "NIXL's Python bindings live in nixl._api",
    ("storage/backends/redis/nodes.py", "conn._sock"):
        "redis-py has no public accessor for a connection's socket",
    ("storage/backends/redis/url.py", "parts._replace"):
        "namedtuple's public API (underscored to stay clear of field names)",
    ("transfer/bound_caches.py", "t._base"): "torch has no public accessor for a view's base",
}


def _own_names(tree: ast.Module) -> set[str]:
    """Private names this file defines for its own objects."""
    names: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and (
                isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")):
            names.add(n.attr)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            names.add(n.id)
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            names.add(n.target.id)
        elif isinstance(n, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__slots__" for t in n.targets):
            names.update(c.value for c in ast.walk(n.value)
                         if isinstance(c, ast.Constant) and isinstance(c.value, str))
    return names


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def violations(source: str) -> list[tuple[int, str]]:
    """``(line, expression)`` of each private access across files in ``source``."""
    tree = ast.parse(source)
    own = _own_names(tree)
    out: list[tuple[int, str]] = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and _private(n.attr):
            base = n.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            if n.attr in own:
                continue
            out.append((n.lineno, ast.unparse(n)))
        elif isinstance(n, ast.ImportFrom):
            for a in n.names:
                if _private(a.name):
                    module = "." * n.level + (n.module or "")
                    out.append((n.lineno, f"from {module} import {a.name}"))
    return out


def _all() -> dict[tuple[str, str], list[int]]:
    found: dict[tuple[str, str], list[int]] = {}
    for path in sorted(LMC.rglob("*.py")):
        rel = path.relative_to(LMC).as_posix()
        for line, expr in violations(path.read_text(encoding="utf-8")):
            found.setdefault((rel, expr), []).append(line)
    return found


def test_no_module_reads_another_modules_private_state():
    bad = [f"lmc/{rel}:{lines[0]}: {expr}" for (rel, expr), lines in _all().items()
           if (rel, expr) not in EXCEPTIONS]
    assert not bad, ("private state read across files (give the owner a public method, or "
                     "list a third-party need in EXCEPTIONS with why):\n" + "\n".join(bad))


def test_every_exception_is_still_needed():
    found = _all()
    stale = [f"lmc/{rel}: {expr}" for rel, expr in EXCEPTIONS if (rel, expr) not in found]
    assert not stale, "exceptions no code needs any more:\n" + "\n".join(stale)


def test_the_check_sees_what_it_forbids():
    src = ("from .backend import _io_all\n"
           "class Reader:\n"
           "    def __init__(self, tier):\n"
           "        self._mine = 1\n"
           "    def run(self, tier, other):\n"
           "        tier._lock.acquire()\n"
           "        other._mine = 2\n"
           "        return self._mine, tier._buf('x')\n")
    assert [e for _, e in violations(src)] == ["from .backend import _io_all", "tier._lock",
                                               "tier._buf"]


# ---------------------------------------------------------------- the engine's tier manager
# ``CacheEngine.storage`` (the StorageManager) is the engine's own: the modules that are
# parts of the engine may use it; adapters and apps use the engine's public calls (by
# prefix, by key through ``engine.chunks``, flush, stats, tier_names).
ENGINE_PARTS = ("cache_engine.py", "cache_control.py", "keyed_chunks.py", "layerwise.py",
                "hybrid/", "events/")
ENGINE_NAMES = ("engine", "eng", "cache")  # what an adapter or app calls a CacheEngine
# (file under lmc/, the expression): why it must reach the manager
STORAGE_EXCEPTIONS: dict[tuple[str, str], str] = {
    ("planner/calibrate.py", "eng.conn.cache.storage"):
        "calibration empties L1 alone to time a lower tier's hit; no engine call should "
        "offer that (clear() empties every tier)",
    ("demo/run.py", "llm.kv_connector.cache.storage"):
        "the demo tells what each tier below L1 holds before its cold pass (a tier's len), "
        "which no engine call counts",
}


def _tail(node: ast.expr) -> str | None:
    """The last name of ``a.b.c`` (``c``), or of ``a`` alone."""
    if isinstance(node, ast.Name):
        return node.id
    return node.attr if isinstance(node, ast.Attribute) else None


def storage_reads(source: str) -> list[tuple[int, str]]:
    """``(line, expression)`` of each ``<engine>.storage`` in ``source``."""
    out = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Attribute) and n.attr == "storage" and (
                _tail(n.value) in ENGINE_NAMES):
            out.append((n.lineno, ast.unparse(n)))
    return out


def test_adapters_and_apps_use_the_engines_calls_not_its_storage():
    found: dict[tuple[str, str], int] = {}
    for path in sorted(LMC.rglob("*.py")):
        rel = path.relative_to(LMC).as_posix()
        if rel.startswith(ENGINE_PARTS):
            continue
        for line, expr in storage_reads(path.read_text(encoding="utf-8")):
            found.setdefault((rel, expr), line)
    bad = [f"lmc/{rel}:{line}: {expr}" for (rel, expr), line in found.items()
           if (rel, expr) not in STORAGE_EXCEPTIONS]
    assert not bad, ("the engine's StorageManager used outside the engine (give CacheEngine "
                     "the call, e.g. in lmc/keyed_chunks.py):\n" + "\n".join(bad))
    stale = [f"lmc/{rel}: {expr}" for rel, expr in STORAGE_EXCEPTIONS if (rel, expr) not in found]
    assert not stale, "exceptions no code needs any more:\n" + "\n".join(stale)


def test_the_storage_check_sees_an_engines_storage():
    src = ("def f(engine, conn, store):\n"
           "    engine.storage.put([], [])\n"
           "    conn.cache.storage.flush()\n"
           "    store.storage.delete([])\n"
           "    engine.chunks.put([], [])\n")
    assert [e for _, e in storage_reads(src)] == ["engine.storage", "conn.cache.storage"]
