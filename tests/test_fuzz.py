"""The differential fuzzer (tests/fuzz/): random programs under memsafe.jit against jax.jit.

``test_random_program`` runs the first ``DEFAULT_CASES`` seeds (each case: split, unchanged,
refused, or over the limit only inside an outer jax.jit that memsafe warned about; a wrong answer,
a footprint over the limit or a crash fails); ``test_found_by_campaigns`` reruns the programs
campaigns found wrong, once fixed (tests/fuzz/FOUND.md); ``test_schedule_*`` checks the campaign's
per-case time limit with a stand-in for a case. ``make fuzz`` runs thousands.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.budget import FULL
from tests.fuzz import generate, render
from tests.fuzz.accuracy import check, check_leaf, error_scale, identical
from tests.fuzz.inputs import make_inputs, next_after
from tests.fuzz.program import build
from tests.fuzz.runner import run_case, run_seed
from tests.fuzz.schedule import TimedOut, run_all
from tests.fuzz.wrappers import WRAPPERS

#: Random programs run (a few seconds each): 50 in the default suite, 110 in ``make test-full``.
DEFAULT_CASES = 110 if FULL else 50


@pytest.mark.parametrize("seed", range(DEFAULT_CASES))
def test_random_program(seed):
    result = run_seed(seed)
    assert not result.failed, result.describe()


#: Seeds of programs a campaign found answered wrongly, each fixed since (tests/fuzz/FOUND.md).
FOUND = (258, 448, 501, 716, 1871, 1937, 2548, 3194, 3919, 7313, 7374, 10014, 10468, 11300, 11524)


@pytest.mark.parametrize("seed", FOUND)
def test_found_by_campaigns(seed):
    result = run_seed(seed)
    assert not result.failed, result.describe()


#: Campaign seeds still answered wrongly (tests/fuzz/FOUND.md, open): strict xfails, so that a
#: fix shows here. 11307: XLA contracts a product and a sum of memsafe's loop into one rounding;
#: 12336: a max and the comparison of its gradient compiled into two kernels of one loop body;
#: 12527: a NaN input's gradient through max and a fori_loop, NaN spread over the gradient.
OPEN = (11307, 12336, 12527)


@pytest.mark.xfail(strict=True, reason="open in tests/fuzz/FOUND.md")
@pytest.mark.parametrize("seed", OPEN)
def test_open_wrong_answers_found_by_campaigns(seed):
    result = run_seed(seed)
    assert not result.failed, result.describe()


def test_unfused_evaluation_can_give_the_nans_top_k_orders_one_sign():
    """A NaN's sign is unspecified, and ``top_k`` orders by it (seed 10468; ``lax.sort`` does
    not): the unfused evaluation gives every NaN it orders the sign asked for, and only those."""
    from tests.fuzz import unfused

    x = jnp.array([1.0, jnp.nan, 3.0, -jnp.nan, 2.0], jnp.float32)

    def f(x):
        return jax.lax.top_k(x, 2)[1], jax.lax.top_k(x * 2.0, 5)[0], x * 1.0

    plain, neg, pos = (unfused.evaluate(f, (x,), sign) for sign in (None, True, False))
    assert plain[0].tolist() == [1, 2]  # +NaN first, -NaN last
    assert neg[0].tolist() == [2, 4] and np.signbit(neg[1][-2:]).all()
    assert pos[0].tolist() == [1, 3] and not np.signbit(pos[1][:2]).any()
    for out in (neg, pos):  # values no top_k orders keep their sign
        assert np.array_equal(np.signbit(out[2]), np.signbit(np.asarray(x)))


#: Campaign seeds memsafe once split and later refused (tests/fuzz/FOUND.md): each must split.
REFUSED_AFTER_A_FIT = (716,)


@pytest.mark.parametrize("seed", REFUSED_AFTER_A_FIT)
def test_seeds_that_once_split_split(seed):
    result = run_seed(seed)
    assert result.outcome == "split", result.describe()


#: Campaign seeds with some fields of the case changed, found answered wrongly, each fixed since
#: (tests/fuzz/FOUND.md): seed 1318 under lax.cond, at 70% of the way to jax.jit's footprint.
FOUND_VARIANTS = {"1318-cond": (1318, {"control": "cond", "frac": 0.7})}


@pytest.mark.parametrize("name", sorted(FOUND_VARIANTS))
def test_variants_found_by_campaigns(name):
    seed, changes = FOUND_VARIANTS[name]
    result = run_case(dataclasses.replace(generate(seed), **changes))
    assert result.outcome == "split", result.describe()


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


def test_schedule_kills_a_case_past_its_limit_and_reruns_the_others():
    """``time.sleep`` stands in for a case (its seed: seconds). Seed 60 passes the 2.5 s limit
    while 2 runs beside it and 0 waits in the queue: 60 times out, its pool is killed, and 2 and
    0 run again in a fresh pool; each seed is reported once (0 did not time out for waiting)."""
    start = time.monotonic()
    out = list(run_all(time.sleep, [60, 1, 2, 0], jobs=2, timeout=2.5))
    assert sorted(seed for seed, _ in out) == [0, 1, 2, 60]
    late = {seed: value for seed, value in out if isinstance(value, TimedOut)}
    assert list(late) == [60] and 2.5 <= late[60].seconds < 10
    assert time.monotonic() - start < 45


def test_perturbed_inputs_move_each_finite_float_by_one_ulp():
    case = dataclasses.replace(generate(3), inputs="inf", dtype="float32")
    inputs = make_inputs(case)
    x = inputs.args[0].at[0, 0].set(0.0)
    moved = inputs.perturbed(7, (x, *inputs.args[1:]))
    a, b = np.asarray(x), np.asarray(moved[0])
    same = ~np.isfinite(a) | (a == 0)
    assert np.array_equal(a[same], b[same], equal_nan=True) and same.sum() >= 1
    step = np.abs(b[~same] - a[~same]) / np.spacing(np.abs(a[~same]))
    assert np.all((step > 0.49) & (step < 1.01))  # one ulp (half of one below a power of 2)
    assert (b[~same] > a[~same]).any() and (b[~same] < a[~same]).any()
    assert np.array_equal(moved[3], inputs.args[3])  # labels are integers


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_next_after_on_the_host_is_lax_nextafter(dtype):
    """The perturbation moves floats on the host by their bits: the same bits as
    ``lax.nextafter`` toward +inf or -inf, at zeros, infinities, NaN, subnormals and the largest
    finite value too."""
    rng = np.random.default_rng(3)
    info = jnp.finfo(dtype)
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, float(info.max), -float(info.max)]
    special += [float(info.smallest_subnormal), -float(info.smallest_subnormal)]
    a = np.concatenate([rng.standard_normal(500) * 10.0 ** rng.integers(-3, 4, 500), special])
    a = np.asarray(jnp.asarray(a, dtype))
    up = rng.random(a.shape) < 0.5
    target = jnp.where(up, jnp.inf, -jnp.inf).astype(dtype)
    moved = jax.lax.nextafter(jnp.asarray(a), target)
    want = np.asarray(jnp.where(jnp.isfinite(a) & (a != 0), moved, a))
    assert next_after(a, up).tobytes() == want.tobytes()


def test_outputs_identical_to_jax_jit_pass_against_any_reference():
    """The runner skips the float64 reference where memsafe's outputs equal jax.jit's: those
    pass the rule whatever the reference, and any other output is not identical."""
    jit = (jnp.asarray([1.0, np.nan, -np.inf], jnp.bfloat16), jnp.asarray([3], jnp.int32))
    same = (jnp.asarray([1.0, np.nan, -np.inf], jnp.bfloat16), jnp.asarray([3], jnp.int32))
    assert identical(same, jit)
    assert check(same, jit, (np.asarray([7.0, 0.0, 0.0]), np.asarray([3]))) == []
    off = (jnp.asarray([1.0078125, np.nan, -np.inf], jnp.bfloat16), jit[1])
    assert not identical(off, jit)
    assert not identical((jit[0].astype(jnp.float32), jit[1]), jit)
    assert not identical((jit[0], jnp.asarray([4], jnp.int32)), jit)
    assert not identical([jit[0], jit[1]], jit)  # another structure


def test_jit_error_scale_is_its_usual_error_not_a_lucky_draw():
    """Seed 501: a sum of 788 cancelling terms where jax.jit's rounding happened to be 8x
    smaller than its usual size. One ulp moves of the inputs give its usual size; one wild
    draw does not set it (median)."""
    assert error_scale([1e-9], [[1e-6], [3e-6], [2e-6], [1e-6]]) == [1.5e-6]
    assert error_scale([1e-9], [[1e-6], [1e-6], [1e-6], [1.0]]) == [1e-6]
    assert error_scale([5e-6, 0.0], [[1e-6, 0.0]] * 4) == [5e-6, 0.0]
    assert error_scale([2e-6], []) == [2e-6]


def test_unfused_evaluation_runs_loops_branches_and_calls_one_primitive_at_a_time():
    from tests.fuzz.unfused import evaluate

    def fun(x):
        def step(c, r):
            return c + jnp.sum(r), jnp.where(r > 0, r, jnp.nan)

        c, ys = jax.lax.scan(step, 0.0, x, reverse=True)
        w = jax.lax.while_loop(lambda v: v[0] < 3, lambda v: (v[0] + 1, v[1] * 2), (0, c))[1]
        b = jax.lax.cond(w > 0, lambda: jax.jit(jnp.sin)(w), lambda: w)
        return ys, jax.checkpoint(lambda z: z * b)(x)

    x = jnp.asarray(np.random.default_rng(0).standard_normal((5, 3)), jnp.float32)
    for got, want in zip(evaluate(fun, (x,)), jax.jit(fun)(x)):
        np.testing.assert_allclose(got, want, rtol=1e-6)
