"""Imports go one way: no cycle between memsafe's modules, nor between its packages.

The graph is read from the source with ``ast`` and includes every ``memsafe`` import: at the top of
a module, inside functions (lazy) and under ``TYPE_CHECKING``. A cycle hidden by a lazy import is
still a cycle: the two modules cannot be understood, tested or changed one without the other.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import memsafe

SRC = Path(memsafe.__file__).resolve().parent.parent


def _module_paths() -> dict[str, Path]:
    """Every memsafe module by dotted name (a package by its own name)."""
    found = {}
    for path in sorted((SRC / "memsafe").rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The memsafe modules ``name`` imports anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in modules else base)
    return {m for m in out if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _module_paths()
    return {name: _imported(name, path, modules) for name, path in modules.items()}


def _package(module: str) -> str:
    """``memsafe.rules.pattern`` -> ``rules``; a top-level module is its own package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "memsafe"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read():
    graph = _graph()
    assert "memsafe.rules.pattern" in graph["memsafe.rewrite.match"]
    assert "memsafe.inspect.findings" in graph["memsafe.inspect.report"]


def test_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_modules():
    assert _cycles(_graph()) == []


def test_no_import_cycle_between_packages():
    packages: dict[str, set[str]] = {}
    for module, imported in _graph().items():
        packages.setdefault(_package(module), set()).update(
            _package(m) for m in imported if _package(m) != _package(module)
        )
    assert _cycles(packages) == []


def test_every_module_imports_in_a_fresh_interpreter():
    names = sorted(n for n in _module_paths() if n != "memsafe.__main__")
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    result = subprocess.run(
        [sys.executable, "-c", code, *names],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(SRC), "JAX_PLATFORMS": "cpu"},
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]


#: The split core: what every strategy builds on (memsafe.split.strategies' docstring).
SPLIT_CORE = (
    "memsafe.split.region",
    "memsafe.split.loop",
    "memsafe.split.registry",
    "memsafe.split.sinks",
    "memsafe.split.size",
    "memsafe.split.span",
    "memsafe.split.body",
    "memsafe.split.emit",
    "memsafe.split.peephole",
    "memsafe.split.linear",
    "memsafe.split.indices",
    "memsafe.split.topk",
    "memsafe.split.speed",
    "memsafe.split.window",
)


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """The modules ``start`` imports, directly or through others."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for m in graph.get(todo.pop(), ()):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


def _split_core(graph: dict[str, set[str]]) -> list[str]:
    """:data:`SPLIT_CORE` and the rules of ``memsafe.split.prims``."""
    return [*SPLIT_CORE, *sorted(m for m in graph if m.startswith("memsafe.split.prims"))]


def test_the_split_core_imports_no_strategy():
    """The split core and its rules (``memsafe.split.prims``) import nothing from
    memsafe.split.strategies, directly or through another module: a strategy plugs into it
    through its protocols, the rules' extensions (``registry.extend``) and the planner's tables;
    a rule is given what it needs through its ``RuleContext``."""
    graph = _graph()
    core = _split_core(graph)
    assert all(m in graph for m in SPLIT_CORE), set(SPLIT_CORE) - set(graph)
    assert "memsafe.split.prims.conv" in core and "memsafe.split.prims.loops" in core
    assert "memsafe.split.strategies.halo" in graph["memsafe.split.planner"]  # the graph is read
    found = {
        module: sorted(
            m for m in _reachable(graph, module) if m.startswith("memsafe.split.strategies")
        )
        for module in core
    }
    assert not any(found.values()), {k: v for k, v in found.items() if v}


def test_strategies_extend_the_rules_they_change():
    """The halo strategy's windows, groups and regrouped reshapes and the replay strategy's
    loops are extensions of the primitives' rules, registered by the strategies (none in
    ``memsafe.split.prims``)."""
    from memsafe.split import registry
    from memsafe.split.strategies import replay
    from memsafe.split.strategies.halo import Halo

    by_mapping = {
        name: {e.mapping.__name__ for e in exts} for name, exts in registry.EXTENSIONS.items()
    }
    assert by_mapping["conv_general_dilated"] == {"Halo", "Grouped"}
    assert by_mapping["reshape"] == {"Regrouped"}
    assert by_mapping["reduce_window_max"] == {"Halo"}
    assert by_mapping["select_and_scatter_add"] == {"Tiled"}
    assert by_mapping["scan"] == {"Replay"}
    assert all(
        issubclass(e.mapping, registry.Mapping) for x in registry.EXTENSIONS.values() for e in x
    )
    assert issubclass(replay.Replay, registry.Mapping) and issubclass(Halo, registry.Mapping)


def test_a_strategy_module_reloaded_registers_its_extensions_once():
    """Reloading a strategy's module (a notebook's ``importlib.reload``) replaces its
    extensions instead of asking each twice (in a process of its own: a reload here would leave
    this one's modules holding the old classes)."""
    import subprocess
    import sys

    code = (
        "import importlib\n"
        "from memsafe.split import registry\n"
        "from memsafe.split.strategies import replay\n"
        "before = {n: len(x) for n, x in registry.EXTENSIONS.items()}\n"
        "importlib.reload(replay)\n"
        "after = {n: len(x) for n, x in registry.EXTENSIONS.items()}\n"
        "assert after == before, (before, after)\n"
        "assert registry.EXTENSIONS['scan'][0].mapping is replay.Replay\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
