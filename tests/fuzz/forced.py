"""Campaigns of deep cases forced to some families (``python -m tests.fuzz --families solver``).

Seed ``s`` runs ``generate_deep(s, family=families[s % len(families)])``: the family is forced,
every other choice is the one :func:`tests.fuzz.deep.generate_deep` makes for that seed (the case
``tests/test_fuzz_deep.py`` and ``python -m tests.fuzz.minimize --deep --family`` rebuild). The
functions are module-level, so the campaign's spawned workers can run them.
"""

from __future__ import annotations

from dataclasses import replace

from .deep import DeepCase, generate_deep
from .runner import Result, run_case, timeout_result


def case_of(seed: int, families: tuple[str, ...]) -> DeepCase:
    """The deep case of ``seed`` forced to one of ``families`` (by the seed's remainder)."""
    return generate_deep(seed, family=families[seed % len(families)])


def run_seed(seed: int, families: tuple[str, ...]) -> Result:
    """Run the case of ``seed`` forced to one of ``families`` (a worker's entry point)."""
    return run_case(case_of(seed, families))


def timeout(seed: int, seconds: float, limit: float, families: tuple[str, ...]) -> Result:
    """The ``timeout`` result of the case of ``seed`` forced to one of ``families``, killed after
    ``seconds`` over its limit of ``limit`` seconds."""
    case = case_of(seed, families)
    late = timeout_result(seed, seconds, limit, 1.0)
    return replace(late, case=case, families=case.families())
