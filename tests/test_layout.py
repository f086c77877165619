"""Passes are only passes: every module of ``memsafe/passes/`` is a pass of the pipeline (but the
protocol, ``base``), no pass imports another, and the pipelines are declared once, in
``memsafe.passes``."""

from __future__ import annotations

import ast

from memsafe import passes
from tests.test_imports import _graph, _module_paths

PACKAGE = "memsafe.passes"
#: Modules still naming pipeline passes by hand; ``jit.py`` keeps its own list of the algebraic
#: passes until it reads :data:`memsafe.passes.ALGEBRAIC`.
NAMING_PASSES: set[str] = set()


def _pass_modules() -> list[str]:
    return sorted(
        name
        for name in _module_paths()
        if name.startswith(PACKAGE + ".") and name != f"{PACKAGE}.base"
    )


def test_every_module_of_passes_is_a_pass_of_the_pipeline():
    in_pipeline = {module.__name__ for module in passes.PIPELINE}
    assert set(_pass_modules()) == in_pipeline
    assert len(in_pipeline) == len(passes.PIPELINE)


def test_no_pass_imports_another():
    graph = _graph()
    for name in _pass_modules():
        others = {m for m in graph[name] if m == PACKAGE or m.startswith(PACKAGE + ".")}
        assert others <= {f"{PACKAGE}.base"}, (name, others)


def test_the_named_pipelines_are_drawn_from_the_full_one_in_its_order():
    order = {module: k for k, module in enumerate(passes.PIPELINE)}
    for pipeline in (passes.ALGEBRAIC, passes.RETRIED_WITHOUT):
        positions = [order[module] for module in pipeline]
        assert positions == sorted(positions), pipeline
    assert [name for name, _ in passes.named_passes(passes.ALGEBRAIC)] == [
        "match_replace",
        "reorder",
    ]
    assert [run for _, run in passes.named_passes()] == [m.run for m in passes.PIPELINE]


def _lists_of_pass_names(tree: ast.AST, names: set[str]) -> list[int]:
    """Lines of tuple, list and set displays of two or more pass names and nothing else."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Tuple | ast.List | ast.Set) and len(node.elts) >= 2:
            values = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
            if all(v in names for v in values):
                found.append(node.lineno)
    return found


def test_pipelines_are_declared_only_in_the_passes_package():
    names = {passes.pass_name(module) for module in passes.PIPELINE}
    offenders = {}
    for name, path in _module_paths().items():
        if name == PACKAGE:
            continue
        lines = _lists_of_pass_names(ast.parse(path.read_text(encoding="utf-8")), names)
        if lines:
            offenders[name] = lines
    assert set(offenders) <= NAMING_PASSES, offenders
