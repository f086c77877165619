"""Run one case: choose the limit, run memsafe and jax.jit, check footprints and accuracy.

Outcomes: ``unchanged`` (memsafe ran the program as is), ``split`` (rewritten and verified),
``refused`` (MemoryLimitError naming operations memsafe has no rule for: a chunked program may
exist), ``unreachable`` (MemoryLimitError with no rule missing: no chunked program memsafe can
build fits, the limit is below what chunking reaches), ``outer`` (memsafe's own programs fit, but
called inside an outer ``jax.jit`` the outer compile's footprint is above the limit: memsafe
cannot verify that compile and says so with ``OuterJitWarning``), ``timeout`` (the campaign
killed the case after its time limit: slow, not known wrong; see :func:`timeout_result`), and the
failures ``wrong`` (a result breaks the accuracy rule), ``over`` (a footprint memsafe verified
above the limit) and ``crash`` (any other exception).

Cases are pairwise (``tests/fuzz/program.py``) or deep (``tests/fuzz/deep.py``); ``run_seed``
draws a share ``deep_fraction`` of seeds deep. Each result records whether its limit lay in the
interesting range, strictly between arguments+outputs and jax.jit's footprint.
"""

from __future__ import annotations

import contextlib
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

import jax
import numpy as np

import memsafe
from memsafe.batching import OuterJitWarning
from memsafe.xla import Footprint, memsafe_jit

from . import accuracy, deep, program, unfused
from .deep import DeepCase
from .inputs import Inputs, make_inputs
from .program import Case
from .wrappers import WRAPPERS

FAILURES = ("wrong", "over", "crash")
OUTCOMES = ("split", "unchanged", "refused", "unreachable", "outer", "timeout", *FAILURES)


@dataclass
class Result:
    """What happened to one case. ``limit``, ``fixed`` (arguments + outputs) and ``jit_total``
    (jax.jit's footprint) are bytes; ``ms_total`` is the largest footprint memsafe verified or
    compiled (None when refused); ``blockers`` lists (operation, reason) of a refusal;
    ``warnings`` the RuntimeWarnings memsafe emitted (skipped passes); ``interesting``: whether
    the limit lay strictly between arguments+outputs and jax.jit's footprint."""

    case: Case | DeepCase
    outcome: str
    families: list[str]
    limit: int = 0
    fixed: int = 0
    jit_total: int = 0
    ms_total: int | None = None
    outer_total: int | None = None
    blockers: list[tuple[str, str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    message: str = ""
    inputs_note: str = ""
    seconds: float = 0.0
    interesting: bool = False

    @property
    def failed(self) -> bool:
        return self.outcome in FAILURES

    def describe(self) -> str:
        """The case's source, how it was run and what went wrong, ready to paste in a report."""
        wrapper = WRAPPERS[self.case.wrapper]
        lines = [
            deep.source(self.case).rstrip(),
            "",
            f"# inputs: {self.inputs_note or self.case.inputs}; "
            f"limit {self.limit} B (arguments+outputs {self.fixed} B, jax.jit {self.jit_total} B)",
            f"# memsafe: {wrapper.code}",
            f"# outcome: {self.outcome}: {self.message}",
        ]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["case"] = self.case.to_json()
        return d


def choose_limit(footprint: Footprint, frac: float) -> tuple[int, int]:
    """The limit ``frac`` of the way from arguments+outputs to the footprint; returns
    (limit, arguments + outputs)."""
    fixed = footprint.arguments + footprint.outputs
    room = max(footprint.total - fixed, 0)
    return int(fixed + frac * room) + 1, fixed


def in_range(limit: int, fixed: int, jit_total: int) -> bool:
    """Whether ``limit`` lies strictly between arguments+outputs and jax.jit's footprint (where
    memsafe must rewrite the program and can)."""
    return fixed < limit < jit_total


def run_case(case: Case | DeepCase) -> Result:
    """Run ``case`` and classify it (never raises for memsafe's failures: they are outcomes)."""
    start = time.perf_counter()
    result = Result(case=case, outcome="crash", families=case.families())
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            _run(case, result)
        result.warnings = sorted(
            {str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)}
        )
    except Exception as err:  # the harness itself failed: report it as a crash
        result.outcome = "crash"
        result.message = f"harness: {type(err).__name__}: {err}\n{traceback.format_exc(limit=4)}"
    result.seconds = round(time.perf_counter() - start, 3)
    return result


def run_seed(seed: int, deep_fraction: float = 0.0) -> Result:
    """Run the case drawn from ``seed``, deep for a share ``deep_fraction`` of seeds (a picklable
    entry point for worker processes, with ``functools.partial`` for the share)."""
    return run_case(deep.draw(seed, deep_fraction))


def timeout_result(seed: int, seconds: float, limit: float, deep_fraction: float = 0.0) -> Result:
    """The result of the case drawn from ``seed`` when it was killed after running ``seconds``,
    over its time limit of ``limit`` seconds (nothing known of its footprints or answers)."""
    case = deep.draw(seed, deep_fraction)
    message = f"killed after {seconds:g} s (the limit per case is {limit:g} s)"
    return Result(
        case=case, outcome="timeout", families=case.families(), message=message, seconds=seconds
    )


def _x64(case: Case | DeepCase) -> Any:
    return jax.enable_x64(True) if case.dtype == "float64" else contextlib.nullcontext()


def _build(case: Case | DeepCase) -> tuple[dict, Inputs]:
    """The namespace of the rendered case and its arguments (call under :func:`_x64`)."""
    if isinstance(case, DeepCase):
        return deep.build(case), deep.make_inputs(case)
    return program.build(case), make_inputs(case)


def _run(case: Case | DeepCase, result: Result) -> None:
    wrapper = WRAPPERS[case.wrapper]
    with _x64(case):
        ns, inputs = _build(case)
        result.inputs_note = inputs.note
        args = inputs.args
        compiled = memsafe_jit(wrapper.ref(ns)).lower(*args).compile()
        plain = Footprint.from_compiled(compiled)
        result.limit, result.fixed = choose_limit(plain, case.frac)
        result.jit_total = plain.total
        result.interesting = in_range(result.limit, result.fixed, result.jit_total)
        jit_out = compiled(*args)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", OuterJitWarning)
                obj = wrapper.make(ns, result.limit)
                ms_out = jax.block_until_ready(wrapper.call(obj, args))
        except memsafe.MemoryLimitError as err:
            result.outcome = "refused" if err.missing_rules else "unreachable"
            result.blockers = [(b.operation, b.reason) for b in err.blockers]
            result.message = str(err).splitlines()[0]
            return
        except Exception as err:
            result.outcome = "crash"
            result.message = f"{type(err).__name__}: {err}"[:2000]
            return
        plans = wrapper.plans(obj, args)
        totals = [_total(plan) for plan in plans]
        unchanged = bool(plans) and all(plan.fits_unchanged for plan in plans)
        if wrapper.outer:
            outer = memsafe_jit(lambda *a: wrapper.call(obj, a)).lower(*args).compile()
            result.outer_total = Footprint.from_compiled(outer).total
            warned = any(issubclass(w.category, OuterJitWarning) for w in caught)
    result.ms_total = max(totals) if totals else None
    if result.ms_total is not None and result.ms_total > result.limit:
        result.outcome = "over"
        result.message = f"footprint {result.ms_total} B > limit {result.limit} B ({totals})"
        return
    # the same bits as jax.jit's obey the rule whatever the reference: not computed then
    same = accuracy.identical(ms_out, jit_out)
    ref, jit_errors = (jit_out, None) if same else _reference(case, ns, inputs, jit_out, compiled)
    problems = accuracy.check(ms_out, jit_out, ref, jit_errors)
    if problems:
        # jax.jit's fused kernels may round a recomputed value differently from JAX's own
        # semantics (tests/fuzz/unfused.py), or give a NaN another sign (which top_k and sort
        # order by): then memsafe is held to the unfused answer, its NaN and infinities where
        # that answer has them and its values within jax.jit's own error of it. The float64
        # reference follows jax.jit's kernels, not that answer (seed 7374: a top_k whose rows
        # hold a NaN in the unfused answer and not in jax.jit's compares other entries)
        # A NaN's sign is not specified either (unfused.py): where a top_k orders NaNs, memsafe
        # may give the answer of the program with every NaN there of one sign (seed 10468), one
        # XLA gives on some compile of the program
        for nan_sign, why in (
            (None, "jax.jit differs from its unfused evaluation"),
            (True, "the unfused evaluation with negative NaNs where top_k orders them"),
            (False, "the unfused evaluation with positive NaNs where top_k orders them"),
        ):
            with _x64(case):  # a float64 case's program, as its arguments were made
                unfused_out = unfused.evaluate(wrapper.ref(ns), args, nan_sign)
            if not accuracy.check(ms_out, unfused_out, unfused_out, jit_errors):
                result.message = f"{why}, which memsafe gives: " + "; ".join(problems)
                problems = []
                break
    if problems:
        result.outcome = "wrong"
        result.message = "; ".join(problems)
        return
    result.outcome = "unchanged" if unchanged else "split"
    if result.outer_total is not None and result.outer_total > result.limit:
        result.outcome = "outer" if warned else "over"
        result.message = (
            f"outer jax.jit footprint {result.outer_total} B > limit {result.limit} B "
            f"(memsafe's own {totals}; OuterJitWarning {'given' if warned else 'MISSING'})"
        )


def _total(plan: Any) -> int:
    """The footprint a plan verified (after splitting, or as it was)."""
    fp = plan.after or plan.before
    return fp.total if fp is not None else 0


def _reference(
    case: Case | DeepCase, ns: dict, inputs: Any, jit_out: Any, compiled: Any
) -> tuple[Any, list[float]]:
    """The float64 reference of the program, and per output jax.jit's error scale
    (:func:`accuracy.error_scale`). For float64 programs the reference is jax.jit's own result and
    the error is estimated from the float32 program, scaled by the ratio of machine epsilons."""
    ref_fun = WRAPPERS[case.wrapper].ref(ns)
    if case.dtype == "float64":
        low, args = memsafe_jit(ref_fun), inputs.cast("float32")
        scale = float(np.finfo(np.float64).eps / np.finfo(np.float32).eps)
        high, ref = compiled, jit_out
    else:
        low, args, scale = compiled, inputs.args, 1.0
        high = memsafe_jit(ref_fun)
        with jax.enable_x64(True):
            ref = jax.tree.map(np.asarray, high(*inputs.cast("float64")))

    def error(at: tuple) -> list[float]:
        out = low(*at)
        with jax.enable_x64(True):
            return accuracy.max_error(out, high(*inputs.cast("float64", at)))

    first = accuracy.max_error(low(*args) if case.dtype == "float64" else jit_out, ref)
    # Ties are exact on a half-integer grid; moving them by an ulp would make near-ties.
    draws = (
        []
        if case.inputs == "ties"
        else [
            error(inputs.perturbed(case.seed * accuracy.DRAWS + k, args))
            for k in range(accuracy.DRAWS)
        ]
    )
    return ref, [e * scale for e in accuracy.error_scale(first, draws)]
