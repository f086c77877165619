"""Deep programs of the differential fuzzer (tests/fuzz/deep.py): training steps of MLPs, layer
stacks, transformers, CNNs, graph networks, several large values alive at once and iterative
solvers in while loops.

``test_deep_family_runs`` runs one fixed case per family under memsafe.jit against jax.jit (split,
unchanged, refused, unreachable or outer pass; wrong, over the limit or a crash fail); the other
tests check that deep cases are reproducible from their seed, trace under every wrapper and are
drawn for the asked share of seeds only, and that every solver variant differentiates to second
order (its backward loops have fixed counts).
"""

from __future__ import annotations

from dataclasses import replace

import jax
import numpy as np
import pytest

from tests.fuzz import deep, forced
from tests.fuzz.deep_families import FAMILIES
from tests.fuzz.program import generate
from tests.fuzz.runner import run_case
from tests.fuzz.solver_family import VARIANTS
from tests.fuzz.wrappers import WRAPPERS

#: The solver family's fixed case: an SGD step through a per-row fixed point under jax.vmap (one
#: while loop with a batched predicate, split by rows) in a custom_vjp, fixed-count adjoint.
SOLVER_SEED = 16

#: One quick case per family (seed, forced fields), each a few seconds, together under a minute.
FAMILY_CASES: dict[str, tuple[int, dict]] = {
    "mlp": (31, {}),  # vmap outside, dict parameters
    "scan_layers": (18, {}),  # a Python loop of checkpointed layers
    "transformer": (34, {}),  # a padding mask, forward
    "cnn": (20, {}),  # SAME convolutions, average pooling
    "graph": (41, {}),  # sorted receivers, segment_min, an SGD step
    "multi": (8, {}),  # two (rows, rows) values alive at once, under an inner jax.jit
    "solver": (SOLVER_SEED, {}),
}


def test_every_family_has_a_fixed_case():
    assert sorted(FAMILY_CASES) == sorted(FAMILIES)


@pytest.mark.parametrize("family", sorted(FAMILY_CASES))
def test_deep_family_runs(family):
    seed, fields = FAMILY_CASES[family]
    case = deep.generate_deep(seed, family=family, **fields)
    result = run_case(case)
    assert not result.failed, result.describe()


def test_deep_cases_are_reproducible_from_their_seed():
    for seed in range(12):
        case = deep.generate_deep(seed)
        assert case == deep.generate_deep(seed)
        assert deep.render(case) == deep.render(deep.generate_deep(seed))
        with jax.enable_x64(case.dtype == "float64"):
            a, b = (jax.tree.leaves(deep.make_inputs(case).args) for _ in range(2))
        assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert len({deep.render(deep.generate_deep(seed)) for seed in range(24)}) == 24


@pytest.mark.parametrize("seed", range(0, 48, 4))
def test_deep_programs_trace(seed):
    """Every drawn deep program is valid JAX under its wrapper's reference."""
    case = deep.generate_deep(seed)
    with jax.enable_x64(case.dtype == "float64"):
        args = deep.make_inputs(case).args
        out = jax.eval_shape(WRAPPERS[case.wrapper].ref(deep.build(case)), *args)
    assert jax.tree.leaves(out)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_traces_under_batching_and_gradients(family):
    for wrapper in ("vmap_inside", "grad_outside"):
        case = deep.generate_deep(7, family=family, wrapper=wrapper)
        assert deep.valid(case), deep.render(case)


def test_deep_share_of_seeds():
    seeds = range(2000)
    assert all(deep.draw(s, 0.0) == generate(s) for s in range(50))
    assert all(isinstance(deep.draw(s, 1.0), deep.DeepCase) for s in range(50))
    share = np.mean([deep.is_deep(s, 0.4) for s in seeds])
    assert 0.35 < share < 0.45
    # a seed that is pairwise at some share stays the same pairwise case at a smaller one
    assert all(deep.draw(s, 0.2) == generate(s) for s in seeds if not deep.is_deep(s, 0.4))


#: Deep seeds of the sample 2026-11-27 that memsafe refused in the interesting range and now
#: splits, each for a rule added since (tests/fuzz/campaigns/README.md): 142, a graph network's
#: ``segment_sum`` and ``segment_min`` over chunks of edges (a combining scatter carried from
#: chunk to chunk; folding per-chunk scatters held three node-sized copies each: 1.6 MiB at
#: best under a 0.9 MiB limit). Of the sample 2026-11-28: 347, a 3-round graph network's
#: forward (segment sum, max and min per round) at 12% of the way from arguments+outputs to
#: jax.jit's footprint (main: 991 KiB at best under 825 KiB; each round's fills copied and
#: the copies made at the start, and the node update of every round recomputed from every
#: round's sums in the last; tests/test_rounds.py). Of the sample 2026-11-28-500: 521, a
#: transformer step whose fused qkv projection was stored beside the pieces ``jnp.split`` copies
#: out of it (74,524 B at best for 72,667 B; computed in pieces, ``rules/pieces.py``, 68,316 B);
#: 527, a 3-round graph network step storing each round's ``concat([h, agg])`` for the node
#: update and its weight gradient (5.16 MB at best for 4.55 MB; from the pieces, 4.42 MB). Of
#: the campaign 2026-11-28-campaign-3000: 4064, 4135 and 4215, CNN training steps under an outer
#: ``jax.vmap`` whose convolutions fold the vmapped batch into their batch axis (reshapes that
#: regroup it, ``Regrouped``) and whose kernel gradients are grouped by it (``Grouped``). Of the
#: campaign 2026-11-29-campaign-7000: 7560, a transformer training step whose 16 KiB causal mask
#: the attention loops held, a tenth of its room (recomputed in them since the floor for loop
#: constants is relative to the room, ``policy.REWRITE.invariant_floor``).
REFUSED_BEFORE = (142, 347, 521, 527, 4064, 4135, 4215, 7560)


@pytest.mark.parametrize("seed", REFUSED_BEFORE)
def test_deep_refusals_since_split(seed):
    result = run_case(deep.generate_deep(seed))
    assert result.interesting and result.outcome == "split", result.describe()


#: Solver seeds (``--families solver``) refused before, since split. Of the sample
#: 2026-11-29-solver-sample-6000: 6000 (``jax.scipy.sparse.linalg.cg`` under an outer
#: ``jax.vmap``), 6021 (a fixed point per row under ``jax.vmap``) and 6023 (cg under an inner
#: ``jax.vmap``): a while loop with a batched predicate reading a kernel matrix or weights built
#: outside it, which the split pass moves into the loop; bound again through ``lax.while_loop``,
#: which takes scalar predicates only, the pass failed and was skipped
#: (tests/test_vmapped_solvers.py).
SOLVER_REFUSED_BEFORE = (6000, 6021, 6023)


@pytest.mark.slow
@pytest.mark.parametrize("seed", SOLVER_REFUSED_BEFORE)
def test_solver_refusals_since_split(seed):
    result = run_case(forced.case_of(seed, ("solver",)))
    assert result.interesting and result.outcome == "split", result.describe()


def _solver_cases(variant: str) -> list[deep.DeepCase]:
    """Solver cases of ``variant`` (with and without its sub-flag) among the first seeds."""
    cases = (deep.generate_deep(seed, family="solver") for seed in range(40))
    return [c for c in cases if variant in c.flags]


@pytest.mark.parametrize("variant", VARIANTS)
def test_solver_variants_differentiate_twice(variant):
    """A training step under a gradient wrapper differentiates the solver twice: no backward
    pass runs a while loop JAX cannot transpose."""
    found = _solver_cases(variant)
    subflags = {flag for c in found for flag in c.flags} & {"every", "hand"}
    assert found and (variant == "fixed_point" or subflags)
    for case in found[:4]:
        flags = tuple(sorted({*case.flags, "train"}))
        trial = replace(case, wrapper="grad_inside", batch=1, flags=flags)
        assert deep.valid(trial), deep.render(trial)


def test_families_option_forces_the_family():
    for seed in range(6):
        case = forced.case_of(seed, ("solver",))
        assert case == deep.generate_deep(seed, family="solver")
    assert {forced.case_of(s, ("cnn", "solver")).family for s in range(4)} == {"cnn", "solver"}


#: Deep seeds (deep fraction 0.34) a campaign found answered wrongly, since fixed
#: (tests/fuzz/FOUND.md): 3960, a bfloat16 graph network step split into 7,056 chunks of edges
#: whose sums accumulated in bfloat16 (tests/test_narrow_accumulators.py).
FIXED_WRONG = (3960,)


@pytest.mark.slow
@pytest.mark.parametrize("seed", FIXED_WRONG)
def test_wrong_answers_found_by_campaigns(seed):
    result = run_case(deep.draw(seed, 0.34))
    assert not result.failed, result.describe()
