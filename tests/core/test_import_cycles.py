"""No module of lmc imports, at load time, a module that imports it back.

A cycle at module level means two modules need each other to exist: the coupling issue 11
removed (the layer-wise copies calling the engine's private methods, the P2P directory ops
calling the daemon session's). Imports under ``TYPE_CHECKING`` are annotations only and
imports inside functions are deliberate late bindings (a plugin chosen at run time), so
neither counts for cycles. The direction of imports (the ranks below) counts both: a late
binding that points up the ranks is a dependency all the same. Read from the source with
``ast``: nothing is imported to check it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"lmc": ROOT / "lmc"}


def _modules() -> dict[str, Path]:
    out = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([package, *parts])] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _load_time_imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The lmc modules ``name`` imports when it is loaded."""
    return _imports(name, path, modules, late=False)


def _imports(name: str, path: Path, modules: dict[str, Path], *, late: bool) -> set[str]:
    """The lmc modules ``name`` imports when it is loaded and, with ``late``, also those its
    functions and classes import when they run (not under ``TYPE_CHECKING``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def resolve(node: ast.Import | ast.ImportFrom) -> None:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
            return
        base = node.module or ""
        if node.level:
            parts = package.split(".")
            parts = parts[: len(parts) - (node.level - 1)]
            base = ".".join(parts + ([base] if base else []))
        subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
        found.update(subs)
        if len(subs) < len(node.names) and base in modules:
            found.add(base)  # names defined in the module (or package) itself

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                resolve(node)
            elif isinstance(node, ast.If) and not _is_type_checking(node):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)
            elif late and not isinstance(node, ast.If):
                for child in ast.iter_child_nodes(node):  # function bodies, with, for, ...
                    if isinstance(child, ast.stmt):
                        visit([child])
                    elif isinstance(child, (ast.excepthandler, ast.match_case)):
                        visit(child.body)

    visit(ast.parse(path.read_text(encoding="utf-8")).body)
    found.discard(name)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def test_no_module_level_import_cycles():
    modules = _modules()
    graph = {name: _load_time_imports(name, path, modules) for name, path in modules.items()}
    assert len(graph) > 50  # the walk found the tree
    found = _cycles(graph)
    detail = "; ".join(" <-> ".join(c) + " (" + ", ".join(
        f"{m} imports {sorted(graph[m] & set(c))}" for m in c) + ")" for c in found)
    assert not found, f"module-level import cycles: {detail}"


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_layerwise_copies_know_the_engine_only_through_their_protocol():
    modules = _modules()
    tree = ast.parse(modules["lmc.layerwise"].read_text(encoding="utf-8"))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "lmc.cache_engine" not in imported
    source = modules["lmc.layerwise"].read_text(encoding="utf-8")
    assert "host._" not in source, "layerwise calls a private method of its host"


# The direction of imports (docs/design.md, "Where things live"): a folder imports, at load
# time or inside a function, only folders of its own rank or below. Ranks, lowest first:
RANKS: list[tuple[str, ...]] = [
    ("lmc.units", "lmc.ratelog", "lmc.settings", "lmc.config", "lmc.metrics", "lmc.lazy_import",
     "lmc.token_database", "lmc._tokens", "lmc._kvcodecs", "lmc.strict_json", "lmc.remote_counters",
     "lmc.bounded_io",
     "lmc.user_cache", "lmc.priority",
     # the parser helpers and argparse types every subcommand's parser takes
     "lmc.cli_args",
     # the kv_events setting's own schema, part of the config schema (no registry in it)
     "lmc.events.events_config", "lmc.events.endpoints",
     # what a component serving lossy KV asks before it turns it on: any tier may ask
     "lmc.quality.feature", "lmc.quality.verdict", "lmc.quality.gate"),
    ("lmc.memory",),
    # the KV codec interface (torch only) and its C kernels' binding rank with transfer: its
    # CUDA kernels (transfer/cuda_codecs.py) implement it beside the gather/scatter kernels
    ("lmc.transfer", "lmc.storage.kvcodecs.base", "lmc.storage.kvcodecs.native"),
    ("lmc.storage",),
    ("lmc.cache_engine", "lmc.cache_control", "lmc.keyed_chunks", "lmc.layerwise", "lmc.events",
     "lmc.hybrid"),
    ("lmc.http",),  # plumbing: what every HTTP front shares
    # the built-in engine knows lmc only by name (connector_api.CONNECTOR_MODULES); its
    # segment blending builds on the API; the models it runs come from lmc.models (its
    # checkpoints and chat templates)
    ("lmc.reference", "lmc.blend", "lmc.models", "lmc.quality"),
    ("lmc.connectors",),
    # the apps, in three ranks. Services: processes that serve others (the daemon, the
    # router and pd-proxy)
    ("lmc.server", "lmc.router"),
    # features: what a user runs once for an answer, built on engines and services (the
    # planner replays the workloads' traces and runs the demo's model; the quality CLI and
    # its blending gate; the contract suite a tier's tests compose)
    ("lmc.blend.gate", "lmc.blend.lossy", "lmc.quality.check", "lmc.quality.cli",
     "lmc.planner", "lmc.workloads", "lmc.testing", "lmc.demo"),
    # entry points: the command line and the package's own names
    ("lmc.cli", "lmc.config_cli", "lmc.control_cli", "lmc"),
]
# imports that point up the ranks (at load time or inside a function), each with the reason
# it must (none today: each protocol lives with the tier that speaks it, the daemon imports
# it from there; the subcommands' parser helpers live below them in lmc.cli_args)
ALLOWED_UPWARD: set[tuple[str, str]] = set()


def _rank(name: str) -> tuple[int, str]:
    best = (-1, "")
    for i, prefixes in enumerate(RANKS):
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and len(p) > len(best[1]):
                best = (i, p)
    return best


def test_imports_point_down_the_ranks():
    modules = _modules()
    wrong = []
    for name, path in modules.items():
        r, _ = _rank(name)
        loaded = _load_time_imports(name, path, modules)
        for dep in _imports(name, path, modules, late=True):
            d, folder = _rank(dep)
            allowed = any(name.startswith(a) and (dep == b or dep.startswith(b + "."))
                          for a, b in ALLOWED_UPWARD)
            if d > r and not allowed:
                when = "" if dep in loaded else " inside a function"
                wrong.append(f"{name} imports {dep}{when} ({folder} ranks above)")
    assert all(_rank(n)[0] >= 0 for n in modules), [n for n in modules if _rank(n)[0] < 0]
    assert not wrong, "; ".join(sorted(wrong))


def test_the_rank_walk_sees_imports_inside_functions(tmp_path):
    """A late binding counts for the direction: the walk finds an import in a method, a
    ``with`` and an ``except`` block, and none under ``TYPE_CHECKING``."""
    src = tmp_path / "m.py"
    src.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from lmc.cli import main\n"
        "class C:\n    def f(self):\n        with open('x'):\n"
        "            from lmc.router import app\n"
        "        try:\n            pass\n        except OSError:\n"
        "            import lmc.demo\n", encoding="utf-8")
    modules = {"lmc.router.app": src, "lmc.demo": src, "lmc.cli": src, "lmc.m": src}
    assert _imports("lmc.m", src, modules, late=False) == set()
    assert _imports("lmc.m", src, modules, late=True) == {"lmc.router.app", "lmc.demo"}
