"""Plan snapshots: record what memsafe.jit planned for every program, and diff two records.

``python -m tools.plans snapshot OUT_DIR [--tests] [--examples] [--root CHECKOUT]`` runs the test
suite with the ``tests/plan_snapshot.py`` plugin on (``OUT_DIR/gw*.jsonl``) and/or plans every
example and quick benchmark case (``OUT_DIR/examples.jsonl``), one JSON line per program built;
neither flag means both. ``--root`` snapshots another checkout (its ``src``, tests, examples and
benchmarks) with this checkout's plugin.

``python -m tools.plans diff OLD_DIR NEW_DIR [--verbose]`` matches programs by (test node id,
function name, argument avals, memory limit, occurrence index), prints what changed in each, and
ends with a one-line summary. Source line numbers are ignored (file names are kept); footprints
within 0.5% count as equal (``--verbose`` shows them). Records that carry a digest of the program
that runs (``program``, :func:`plan_snapshot.program_digest`) also differ where the digests do:
an identical record is the same program, equation by equation.

This module imports neither jax nor memsafe unless it takes a snapshot.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

HERE = Path(__file__).resolve().parent.parent  # the checkout holding this tool
PLUGIN = HERE / "tests" / "plan_snapshot.py"
TOLERANCE = 0.005  # relative footprint change below which two footprints count as equal

Key = tuple[str, str, tuple[str, ...], int, int]  # node, function, avals, limit, occurrence


# -- loading -------------------------------------------------------------------------------------


def load(directory: Path) -> dict[Key, dict[str, Any]]:
    """Every record of a snapshot directory, by key.

    Args:
        directory: a directory of ``*.jsonl`` files written by the plugin or ``snapshot``.

    Returns:
        The records keyed by (node, function, avals, limit, occurrence), where occurrence counts
        the earlier records of the same (node, function, avals, limit) in the same file. A
        fixture-scoped key (a module fixture, say) that xdist set up on several workers keeps the
        records of the first file only.
    """
    out: dict[Key, dict[str, Any]] = {}
    for path in sorted(directory.glob("*.jsonl")):
        counts: dict[tuple[str, str, tuple[str, ...], int], int] = {}
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            rec = json.loads(line)
            base = (rec["node"], norm(rec["function"]), tuple(rec["avals"]), int(rec["limit"]))
            occ = counts.get(base, 0)
            counts[base] = occ + 1
            key = (*base, occ)
            if key in out and rec.get("scope", "function") != "function":
                continue  # the same fixture set up again on another worker
            out[key] = rec
    return out


# -- comparison ----------------------------------------------------------------------------------

_LINE = re.compile(r"(\.py):\d+(?::\d+)?")
_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


_TMP = re.compile(r"/tmp/pytest-of-[^/]+/pytest-\d+/")


def norm(text: str) -> str:
    """``text`` without source line/column numbers (``knn.py:12:9`` -> ``knn.py``), addresses
    or pytest's numbered temporary directories."""
    return _TMP.sub("/tmp/pytest/", _ADDRESS.sub("0x?", _LINE.sub(r"\1", text)))


def format_bytes(n: float | None) -> str:
    """``12.3 MiB`` for a byte count (``-`` for None)."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _pct(old: float, new: float) -> float:
    """Relative change of ``new`` against ``old`` (infinite when ``old`` is 0, ``new`` not)."""
    if old == new:
        return 0.0
    return (new - old) / old if old else float("inf")


def _first_line(text: str, width: int = 160) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= width else line[: width - 3] + "..."


@dataclass
class Comparison:
    """The differences found between two records of one program.

    ``lines`` are real changes; ``minor`` are footprint changes under the tolerance (shown only
    with ``--verbose``); ``status`` is '' or 'newly failing' / 'newly passing'.
    """

    lines: list[str] = field(default_factory=list)
    minor: list[str] = field(default_factory=list)
    status: str = ""

    @property
    def changed(self) -> bool:
        return bool(self.lines)


def _footprint(cmp: Comparison, label: str, old: int | None, new: int | None) -> None:
    if old == new:
        return
    if old is None or new is None:
        cmp.lines.append(f"{label}: {format_bytes(old)} -> {format_bytes(new)}")
        return
    pct = _pct(old, new)
    text = f"{label}: {format_bytes(old)} -> {format_bytes(new)} ({pct:+.1%})"
    (cmp.lines if abs(pct) >= TOLERANCE else cmp.minor).append(text)


def _split_key(split: dict[str, Any]) -> str:
    return norm(split["value"])


_SPLIT_FIELDS = ("axis", "size", "chunk", "loops", "bytes")


def _split_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """'chunk 100 -> 200' and the like for two splits of (presumably) the same value."""
    out = []
    if norm(old["value"]) != norm(new["value"]):
        out.append(f"value {old['value']!r} -> {new['value']!r}")
    for name in _SPLIT_FIELDS:
        if old[name] != new[name]:
            out.append(f"{name} {old[name]} -> {new[name]}")
    for name in ("ops", "sinks"):
        gone = sorted(set(old[name]) - set(new[name]))
        added = sorted(set(new[name]) - set(old[name]))
        if gone or added:
            out.append(f"{name} " + " ".join([*(f"-{o}" for o in gone), *(f"+{o}" for o in added)]))
        elif old[name] != new[name]:
            out.append(f"{name} reordered: {','.join(old[name])} -> {','.join(new[name])}")
    if norm(old["where"]) != norm(new["where"]):
        out.append(f"where {norm(old['where'])} -> {norm(new['where'])}")
    return out


def _short_split(split: dict[str, Any]) -> str:
    return (
        f"{norm(split['value'])} axis {split['axis']} (size {split['size']}) chunk "
        f"{split['chunk']} x{split['loops']}, sinks {','.join(split['sinks']) or '-'}"
    )


def _compare_splits(cmp: Comparison, old: list[dict], new: list[dict]) -> None:
    """Pair splits by value (then by position among the unpaired) and list their changes."""
    unpaired_new = list(range(len(new)))
    pairs: list[tuple[int | None, int | None]] = []
    unpaired_old = []
    for i, s in enumerate(old):
        j = next((j for j in unpaired_new if _split_key(new[j]) == _split_key(s)), None)
        if j is None:
            unpaired_old.append(i)
        else:
            unpaired_new.remove(j)
            pairs.append((i, j))
    while unpaired_old and unpaired_new:  # the value's description changed: pair by position
        pairs.append((unpaired_old.pop(0), unpaired_new.pop(0)))
    pairs += [(i, None) for i in unpaired_old] + [(None, j) for j in unpaired_new]
    for i, j in sorted(pairs, key=lambda p: (p[0] if p[0] is not None else 1e9, p[1] or 0)):
        if i is not None and j is None:
            cmp.lines.append(f"- split {_short_split(old[i])}")
        elif i is None and j is not None:
            cmp.lines.append(f"+ split {_short_split(new[j])}")
        elif i is not None and j is not None:
            changes = _split_changes(old[i], new[j])
            if changes:
                cmp.lines.append(f"split {norm(old[i]['value'])}: {', '.join(changes)}")
    keys_old, keys_new = [_split_key(s) for s in old], [_split_key(s) for s in new]
    if keys_old != keys_new and sorted(keys_old) == sorted(keys_new):
        cmp.lines.append("splits reordered")


def _compare_list(cmp: Comparison, label: str, old: Iterable[str], new: Iterable[str]) -> None:
    """'- x' / '+ y' for the items of one list missing from the other (multiset difference)."""
    old, new = list(old), list(new)
    rest = list(new)
    gone = []
    for item in old:
        if item in rest:
            rest.remove(item)
        else:
            gone.append(item)
    cmp.lines += [f"- {label} {g}" for g in gone] + [f"+ {label} {a}" for a in rest]
    if not gone and not rest and old != new:
        cmp.lines.append(f"{label}s reordered")


def compare(old: dict[str, Any], new: dict[str, Any]) -> Comparison:
    """The differences between two records of the same program.

    Args:
        old, new: records as the plugin writes them.

    Returns:
        A ``Comparison``: its ``lines`` are empty when the plans agree up to line numbers and
        footprint changes under 0.5%.
    """
    cmp = Comparison()
    old_err, new_err = old.get("error"), new.get("error")
    if old_err and new_err:
        if _error_line(old_err) != _error_line(new_err) or norm(old_err["message"]) != norm(
            new_err["message"]
        ):
            cmp.lines += [
                f"error was: {_error_line(old_err)}",
                f"error now: {_error_line(new_err)}",
            ]
    elif new_err:
        cmp.status = "newly failing"
        cmp.lines.append(f"newly failing: {_error_line(new_err)}")
        cmp.lines.append(f"  (footprint was {format_bytes(old.get('after'))})")
    elif old_err:
        cmp.status = "newly passing"
        cmp.lines.append(f"newly passing (was {_error_line(old_err)})")
        cmp.lines.append(f"  footprint now {format_bytes(new.get('after'))}")
    if old_err or new_err:
        return cmp
    if old["fits_unchanged"] != new["fits_unchanged"]:
        cmp.lines.append(f"fits_unchanged {old['fits_unchanged']} -> {new['fits_unchanged']}")
    _compare_list(
        cmp,
        "rule",
        (f"{r['rule']} at {norm(r['where'])}" for r in old["rules"]),
        (f"{r['rule']} at {norm(r['where'])}" for r in new["rules"]),
    )
    _compare_splits(cmp, old["splits"], new["splits"])
    _compare_list(
        cmp,
        "pass",
        (f"{p['pass_name']}: {norm(p['description'])}" for p in old["passes"]),
        (f"{p['pass_name']}: {norm(p['description'])}" for p in new["passes"]),
    )
    _footprint(cmp, "before", old["before"], new["before"])
    _footprint(cmp, "after", old["after"], new["after"])
    old_att, new_att = old["attempts"], new["attempts"]
    scales = lambda att: [round(a["chunk_scale"], 6) for a in att]
    if scales(old_att) != scales(new_att) or [a["fits"] for a in old_att] != [
        a["fits"] for a in new_att
    ]:
        fmt = lambda att: ", ".join(
            f"{a['chunk_scale']:.3g}:{format_bytes(a['total'])}{'' if a['fits'] else '!'}"
            for a in att
        )
        cmp.lines.append(
            f"attempts {len(old_att)} -> {len(new_att)}: [{fmt(old_att)}] -> [{fmt(new_att)}]"
        )
    else:
        for i, (a, b) in enumerate(zip(old_att, new_att)):
            if a["total"] != b["total"] and len(old_att) > 1:
                _footprint(cmp, f"attempt {i}", a["total"], b["total"])
    old_prog, new_prog = old.get("program"), new.get("program")
    if old_prog and new_prog and old_prog != new_prog:
        cmp.lines.append(f"program text {old_prog} -> {new_prog}")
    return cmp


def _error_line(err: dict[str, str]) -> str:
    """``MemoryLimitError: first line of the message`` (line numbers removed)."""
    return f"{err['type']}: {_first_line(norm(err['message']))}"


def _describe_key(key: Key) -> str:
    node, function, avals, limit, occ = key
    suffix = f" #{occ}" if occ else ""
    return f"{node} | {function}({', '.join(avals)}) @ {format_bytes(limit)}{suffix}"


@dataclass
class Summary:
    """Counts of a diff."""

    programs: int = 0
    identical: int = 0
    changed: int = 0
    only_old: int = 0
    only_new: int = 0
    newly_failing: int = 0
    newly_passing: int = 0

    def __str__(self) -> str:
        extra = ""
        if self.newly_failing or self.newly_passing:
            extra = f" ({self.newly_failing} newly failing, {self.newly_passing} newly passing)"
        return (
            f"{self.programs} programs, {self.identical} identical, {self.changed} changed{extra}, "
            f"{self.only_old} only in old, {self.only_new} only in new"
        )


def diff(old_dir: Path, new_dir: Path, verbose: bool = False, out: TextIO = sys.stdout) -> Summary:
    """Print the differences between two snapshot directories and return their counts.

    Args:
        old_dir, new_dir: directories written by ``snapshot`` (or by the plugin).
        verbose: also print footprint changes under 0.5% (the program still counts as identical).
        out: where to print.

    Returns:
        The ``Summary`` printed on the last line.
    """
    old, new = load(old_dir), load(new_dir)
    summary = Summary()
    for key in sorted(set(old) | set(new), key=lambda k: (k[0], k[1], k[2], k[3], k[4])):
        summary.programs += 1
        if key not in new:
            summary.only_old += 1
            status = "FAILED" if old[key].get("error") else format_bytes(old[key].get("after"))
            print(f"- only in old: {_describe_key(key)} [{status}]", file=out)
            continue
        if key not in old:
            summary.only_new += 1
            status = "FAILED" if new[key].get("error") else format_bytes(new[key].get("after"))
            print(f"+ only in new: {_describe_key(key)} [{status}]", file=out)
            continue
        cmp = compare(old[key], new[key])
        if cmp.changed:
            summary.changed += 1
            summary.newly_failing += cmp.status == "newly failing"
            summary.newly_passing += cmp.status == "newly passing"
        else:
            summary.identical += 1
        shown = cmp.lines + (cmp.minor if verbose else [])
        if shown:
            mark = "~" if cmp.changed else "="
            print(f"{mark} {_describe_key(key)}", file=out)
            for line in cmp.lines:
                print(f"    {line}", file=out)
            if verbose:
                for line in cmp.minor:
                    print(f"    (under 0.5%) {line}", file=out)
    print(summary, file=out)
    return summary


# -- taking a snapshot ---------------------------------------------------------------------------


def _env(root: Path, plugin_dir: Path) -> dict[str, str]:
    """The environment of a snapshot subprocess: ``root``'s sources first, then the plugin and
    this tool (for a checkout that has neither)."""
    path = [str(root / "src"), str(root), str(plugin_dir), str(HERE)]
    if os.environ.get("PYTHONPATH"):
        path.append(os.environ["PYTHONPATH"])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "JAX_PLATFORMS": "cpu"}


def snapshot(
    out_dir: Path,
    tests: bool = True,
    examples: bool = True,
    root: Path = HERE,
    workers: int = 2,
    pytest_args: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Take a snapshot of ``root`` into ``out_dir`` (whose old ``*.jsonl`` files are removed).

    Args:
        out_dir: where the ``*.jsonl`` files and ``meta.json`` go.
        tests: run the test suite (``pytest -n workers``) with the plugin on.
        examples: plan every example and quick benchmark case (``examples.jsonl``).
        root: the checkout whose ``src``, tests, examples and benchmarks are snapshot.
        workers: pytest-xdist workers (0: no xdist).
        pytest_args: extra pytest arguments (a subset of tests, say).

    Returns:
        What is written to ``meta.json``: root, commit, seconds per part, pytest's exit status and
        the number of programs per file.
    """
    out_dir = out_dir.resolve()
    root = root.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("*.jsonl"):
        old.unlink()
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=False
    ).stdout.strip()
    meta: dict[str, Any] = {"root": str(root), "commit": commit, "seconds": {}}
    with tempfile.TemporaryDirectory(prefix="plan-snapshot-") as tmp:
        # A copy of the plugin alone on the path: an older checkout's tests/ lacks it, and putting
        # this checkout's tests/ on the path would shadow the other checkout's conftest.
        shutil.copy(PLUGIN, Path(tmp) / "plan_snapshot.py")
        env = _env(root, Path(tmp))
        if tests:
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
            cmd += ["-p", "plan_snapshot", "--rootdir", str(root)]
            cmd += ["-n", str(workers)] if workers else []
            cmd += list(pytest_args)
            start = time.perf_counter()
            proc = subprocess.run(
                cmd, cwd=root, env={**env, "MEMSAFE_PLAN_SNAPSHOT": str(out_dir)}, check=False
            )
            meta["seconds"]["tests"] = round(time.perf_counter() - start, 1)
            meta["pytest_returncode"] = proc.returncode
        if examples:
            cmd = [
                sys.executable,
                "-m",
                "tools.plans",
                "_examples",
                str(out_dir / "examples.jsonl"),
            ]
            start = time.perf_counter()
            proc = subprocess.run(cmd, cwd=root, env=env, check=False)
            meta["seconds"]["examples"] = round(time.perf_counter() - start, 1)
            meta["examples_returncode"] = proc.returncode
    meta["programs"] = {
        p.name: sum(1 for line in p.read_text().splitlines() if line.strip())
        for p in sorted(out_dir.glob("*.jsonl"))
    }
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def _example_cases() -> Iterator[tuple[str, Callable[[], Any]]]:
    """(key, thunk) for every memsafe function of ``examples/`` at its script's default sizes
    and every memsafe method of each quick benchmark case; a thunk builds the plan(s)."""
    import functools
    import importlib

    import jax
    import jax.numpy as jnp

    import memsafe

    def sds(tree: Any) -> Any:
        """Arrays as ShapeDtypeStructs (plan() needs no data); Python scalars stay."""
        return jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype) if hasattr(a, "shape") else a, tree
        )

    from examples import attention, kernel_matvec, knn, sgpr

    for metric, fun in knn.FUNCTIONS.items():  # python -m examples.knn defaults, every metric
        x, y = knn.make_inputs(2000, 100_000, 64)
        safe = memsafe.jit(fun, memory_limit="256MiB", static_argnames="k")
        yield f"examples/knn.py::{metric}", functools.partial(safe.plan, *sds((x, y)), k=10)
    x, y, v = kernel_matvec.make_inputs(20_000, 20_000, 3)
    safe = memsafe.jit(kernel_matvec.gaussian_kernel_matvec, memory_limit="64MiB")
    yield "examples/kernel_matvec.py", functools.partial(safe.plan, *sds((x, y, v)), 0.5)
    q, k, v = attention.make_inputs(8, 4096, 64)
    for label in ("attention", "attention_value_and_grad"):
        safe = memsafe.jit(
            getattr(attention, label), memory_limit="256MiB", static_argnames="causal"
        )
        yield (
            f"examples/attention.py::{label}",
            functools.partial(safe.plan, *sds((q, k, v)), causal=False),
        )

    def sgpr_plan() -> Any:
        with jax.enable_x64(True):
            x, y, z = sgpr.make_data(20_000, 200, 3)
            params = {k: jnp.asarray(v) for k, v in sgpr.default_params(z, 3).items()}
            safe = memsafe.jit(sgpr.sgpr_elbo_and_grad, memory_limit="512MiB")
            return safe.plan(*sds((params, jnp.asarray(x), jnp.asarray(y))))

    yield "examples/sgpr.py::sgpr_elbo_and_grad", sgpr_plan

    from benchmarks import run

    def plan_only(fun: Callable[..., Any], args: tuple, params: dict) -> tuple[None, dict]:
        memsafe.jit(fun, memory_limit=params["limit"]).plan(*sds(args))
        return None, {}

    for name in run.WORKLOADS:
        module = importlib.import_module(f"benchmarks.{name}")
        module.run_memsafe = plan_only  # type: ignore[attr-defined]
        for case in module.cases("quick"):
            params = {k: v for k, v in case.items() if k != "methods"}
            params.update(repeats=0, budget_s=0.0, jax_cap=6 * 2**30)
            for method in case["methods"]:
                if "memsafe" in method:
                    yield (
                        f"benchmarks/{name}.py::{case['label']}::{method}",
                        functools.partial(module.run_case, method, params),
                    )


def snapshot_examples(path: Path) -> int:
    """Plan every example and quick benchmark case in this process, recording into ``path``.

    Args:
        path: the ``.jsonl`` file to write (appended to).

    Returns:
        The number of cases whose plan raised (their builds are recorded with the error).
    """
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from plan_snapshot import Recorder

    recorder = Recorder(path, os.getcwd())
    recorder.install()
    failed = 0
    try:
        for key, thunk in _example_cases():
            start = time.perf_counter()
            with recorder.attributed_to(key):
                try:
                    thunk()
                    status = "ok"
                except Exception as err:
                    failed += 1
                    status = f"{type(err).__name__}: {_first_line(str(err), 100)}"
            print(f"{key}: {status} ({time.perf_counter() - start:.1f} s)", flush=True)
    finally:
        recorder.uninstall()
    return failed


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit status (diff: 1 when anything differs)."""
    parser = argparse.ArgumentParser(
        prog="python -m tools.plans", description=__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    snap = sub.add_parser("snapshot", help="record the plans of the tests and/or examples")
    snap.add_argument("out_dir", type=Path)
    snap.add_argument("--tests", action="store_true", help="the test suite (pytest -n 2)")
    snap.add_argument("--examples", action="store_true", help="examples and quick benchmarks")
    snap.add_argument("--root", type=Path, default=HERE, help="checkout to snapshot")
    snap.add_argument("--workers", type=int, default=2, help="pytest-xdist workers (0: none)")
    snap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    dif = sub.add_parser("diff", help="compare two snapshots")
    dif.add_argument("old_dir", type=Path)
    dif.add_argument("new_dir", type=Path)
    dif.add_argument("-v", "--verbose", action="store_true", help="show changes under 0.5%%")
    ex = sub.add_parser("_examples")  # internal: run by snapshot in the checkout's environment
    ex.add_argument("path", type=Path)
    args = parser.parse_args(argv)
    if args.command == "snapshot":
        both = not args.tests and not args.examples
        meta = snapshot(
            args.out_dir,
            tests=args.tests or both,
            examples=args.examples or both,
            root=args.root,
            workers=args.workers,
            pytest_args=tuple(args.pytest_args),
        )
        print(json.dumps(meta))
        return 0
    if args.command == "diff":
        for d in (args.old_dir, args.new_dir):
            if not d.is_dir():
                parser.error(f"{d} is not a directory")
        summary = diff(args.old_dir, args.new_dir, verbose=args.verbose)
        return int(summary.identical != summary.programs)
    return 1 if snapshot_examples(args.path) else 0


if __name__ == "__main__":
    sys.exit(main())
