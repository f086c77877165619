"""Plan snapshots: one JSON line per program ``memsafe.build.build_program`` builds.

As a pytest plugin (registered by ``tests/conftest.py``) it is active only when the environment
variable ``MEMSAFE_PLAN_SNAPSHOT=<dir>`` is set: each program built during a test is written to
``<dir>/<xdist worker id or 'main'>.jsonl``, keyed by the test's node id. A program built while a
module- or session-scoped fixture is set up is keyed by the fixture (``<file>::<fixture name>``)
instead of by whichever test happened to request it first, so that xdist's scheduling does not
move it between tests. ``tools/plans.py`` takes and diffs such snapshots.

The module depends on memsafe and pytest only, so that it can be copied next to an older checkout
and loaded there with ``-p plan_snapshot``.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import pytest

ENV_VAR = "MEMSAFE_PLAN_SNAPSHOT"


def _aval_str(aval: Any) -> str:
    """``float32[2000,64]`` for a ShapeDtypeStruct (or anything with dtype and shape)."""
    return f"{aval.dtype}[{','.join(str(d) for d in aval.shape)}]"


def _relative(text: str, root: str) -> str:
    """``text`` with the checkout's absolute path removed, so snapshots of two checkouts agree."""
    return text.replace(root + os.sep, "") if root else text


def plan_record(plan: Any, root: str = "") -> dict[str, Any]:
    """The JSON-ready fields of a ``memsafe.Plan``.

    Args:
        plan: the ``Plan`` of a built ``Program``.
        root: an absolute path stripped from source locations (the checkout's root).

    Returns:
        A dict with ``fits_unchanged``, ``rules``, ``splits``, ``passes``, ``before`` and
        ``after`` (footprint totals in bytes, or None) and ``attempts``.
    """
    from memsafe.plan import PassRecord, RuleRecord, SplitRecord

    rel = lambda s: _relative(str(s), root)
    rules, splits, passes = [], [], []
    for rec in plan.records:
        if isinstance(rec, RuleRecord):
            rules.append({"rule": rec.rule, "where": rel(rec.where)})
        elif isinstance(rec, SplitRecord):
            splits.append(
                {
                    "value": rel(rec.value),
                    "bytes": int(rec.bytes),
                    "axis": int(rec.axis),
                    "size": int(rec.size),
                    "chunk": int(rec.chunk),
                    "loops": int(rec.loops),
                    "ops": list(rec.ops),
                    "sinks": list(rec.sinks),
                    "where": rel(rec.where),
                }
            )
        elif isinstance(rec, PassRecord):
            passes.append({"pass_name": rec.pass_name, "description": rel(rec.description)})
    total = lambda fp: None if fp is None else int(fp.total)
    return {
        "fits_unchanged": bool(plan.fits_unchanged),
        "rules": rules,
        "splits": splits,
        "passes": passes,
        # read on a copy: a plan measures its ``before`` on first read (``Plan.measure_before``),
        # which the test that made it may still check is pending
        "before": total(copy.copy(plan).before),
        "after": total(plan.after),
        "attempts": [
            {"chunk_scale": float(a.chunk_scale), "total": total(a.footprint), "fits": a.fits}
            for a in plan.attempts
        ],
    }


def program_digest(closed: Any) -> str:
    """A digest of the program that runs (its jaxpr's text: equations, shapes, literals, in
    order; variable names are given in order of appearance), equal for the same program built
    in two processes or two checkouts."""
    return hashlib.sha256(str(closed).encode()).hexdigest()[:16]


class Recorder:
    """Wraps ``memsafe.build.build_program`` and writes one JSON line per call.

    Args:
        path: the ``.jsonl`` file to append to (opened on the first record).
        root: an absolute path stripped from source locations and error messages.
    """

    def __init__(self, path: Path, root: str = "") -> None:
        self.path = path
        self.root = root
        self.key = "<outside tests>"  # what a build is attributed to; set by the caller
        self.scope = "function"
        self._file: IO[str] | None = None
        self._original: Callable[..., Any] | None = None

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` as one JSON line (flushed, so a crash loses nothing written)."""
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a")
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()

    def install(self) -> None:
        """Replace ``memsafe.build.build_program`` by a recording wrapper."""
        module = importlib.import_module("memsafe.build")
        original = module.build_program
        self._original = original

        def build_program(
            flat_fun: Callable[..., Any],
            avals: Sequence[Any],
            memory_limit: int,
            donate: tuple[int, ...] = (),
            name: str = "function",
            **options: Any,  # compiler_options, progress
        ) -> Any:
            record: dict[str, Any] = {
                "node": self.key,
                "scope": self.scope,
                "function": name,
                "avals": [_aval_str(a) for a in avals],
                "limit": int(memory_limit),
            }
            start = time.perf_counter()
            try:
                program = original(flat_fun, avals, memory_limit, donate, name, **options)
            except Exception as err:
                record["error"] = {
                    "type": type(err).__name__,
                    "message": _relative(str(err), self.root),
                }
                record["build_s"] = round(time.perf_counter() - start, 3)
                self.write(record)
                raise
            record["build_s"] = round(time.perf_counter() - start, 3)
            record.update(plan_record(program.plan, self.root))
            record["program"] = program_digest(program.closed)
            self.write(record)
            return program

        module.build_program = build_program

    def uninstall(self) -> None:
        """Restore the original ``build_program`` and close the file."""
        if self._original is not None:
            importlib.import_module("memsafe.build").build_program = self._original
            self._original = None
        if self._file is not None:
            self._file.close()
            self._file = None

    @contextmanager
    def attributed_to(self, key: str, scope: str = "function") -> Iterator[None]:
        """Attribute the builds inside the ``with`` block to ``key`` (a test or fixture)."""
        saved = self.key, self.scope
        self.key, self.scope = key, scope
        try:
            yield
        finally:
            self.key, self.scope = saved


_recorder: Recorder | None = None


def pytest_sessionstart(session: pytest.Session) -> None:
    """Install the recorder when ``MEMSAFE_PLAN_SNAPSHOT`` names a directory."""
    global _recorder
    out = os.environ.get(ENV_VAR)
    if not out:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    _recorder = Recorder(Path(out) / f"{worker}.jsonl", str(session.config.rootpath))
    _recorder.install()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Restore ``build_program``."""
    global _recorder
    if _recorder is not None:
        _recorder.uninstall()
        _recorder = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """Attribute builds during a test (set-up, call, tear-down) to its node id."""
    if _recorder is None:
        return (yield)
    with _recorder.attributed_to(item.nodeid):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: Any, request: pytest.FixtureRequest) -> Any:
    """Attribute builds in a module/class/package/session fixture to the fixture, not the test."""
    if _recorder is None or fixturedef.scope == "function":
        return (yield)
    where = fixturedef.baseid or "<conftest>"
    key = f"{where}::<{fixturedef.scope} fixture {fixturedef.argname}>"
    with _recorder.attributed_to(key, fixturedef.scope):
        return (yield)
