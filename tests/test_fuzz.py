"""The differential fuzzer (tests/fuzz/): random programs under memsafe.jit against jax.jit.

``test_random_program`` runs the first ``DEFAULT_CASES`` seeds (each case: split, unchanged,
refused, or over the limit only inside an outer jax.jit that memsafe warned about; a wrong answer,
a footprint over the limit or a crash fails); ``test_found_by_campaigns`` reruns the programs
campaigns found wrong, once fixed (tests/fuzz/FOUND.md). ``make fuzz`` runs thousands.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.fuzz import generate, render
from tests.fuzz.accuracy import check_leaf
from tests.fuzz.inputs import make_inputs
from tests.fuzz.program import build
from tests.fuzz.runner import run_seed
from tests.fuzz.wrappers import WRAPPERS

#: Random programs in the default suite (about a second each).
DEFAULT_CASES = 110


@pytest.mark.parametrize("seed", range(DEFAULT_CASES))
def test_random_program(seed):
    result = run_seed(seed)
    assert not result.failed, result.describe()


#: Seeds of programs a campaign found answered wrongly, each fixed since (tests/fuzz/FOUND.md).
FOUND = (448,)


@pytest.mark.parametrize("seed", FOUND)
def test_found_by_campaigns(seed):
    result = run_seed(seed)
    assert not result.failed, result.describe()


def test_cases_are_reproducible_from_their_seed():
    for seed in range(40):
        assert generate(seed) == generate(seed)
        assert render(generate(seed)) == render(generate(seed))
        with jax.enable_x64(generate(seed).dtype == "float64"):
            a, b = make_inputs(generate(seed)).args[0], make_inputs(generate(seed)).args[0]
        assert np.array_equal(a, b, equal_nan=True)
    assert len({render(generate(seed)) for seed in range(40)}) == 40


@pytest.mark.parametrize("seed", range(0, 400, 20))
def test_generated_programs_trace(seed):
    """Every drawn program is valid JAX under its wrapper's reference (shapes, dtypes, slices)."""
    case = generate(seed)
    with jax.enable_x64(case.dtype == "float64"):
        args = make_inputs(case).args
        out = jax.eval_shape(WRAPPERS[case.wrapper].ref(build(case)), *args)
    assert jax.tree.leaves(out)


def test_accuracy_rule_accepts_jit_sized_errors():
    ref = np.linspace(-3.0, 3.0, 50)
    jit = (ref + 1e-6).astype(np.float32)
    assert check_leaf(ref + 5e-6, jit, ref) is None  # 5x jax.jit's error
    assert check_leaf(ref.astype(np.float32), ref.astype(np.float32), ref) is None


def test_accuracy_rule_rejects_large_errors_and_nonfinite_or_index_mismatches():
    ref = np.linspace(-3.0, 3.0, 50)
    jit = ref.astype(np.float32)
    assert "error" in check_leaf(ref + 1e-3, jit, ref)
    nan = jit.copy()
    nan[3] = np.nan
    assert "NaN" in check_leaf(nan, jit, ref)
    inf = jit.copy()
    inf[4] = np.inf
    assert "+inf" in check_leaf(inf, jnp.where(jnp.arange(50) == 4, -jnp.inf, jit), ref)
    idx = np.arange(10, dtype=np.int32)
    assert check_leaf(idx, idx, idx) is None
    assert "integer" in check_leaf(idx[::-1], idx, idx)
