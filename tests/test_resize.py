"""A planned program at new shapes (another batch size) starts from the plan it had at smaller
ones (memsafe.search.Hint): the original, which did not fit there, is not compiled, and the
attempts start at the chunk scale that ran; the answers are jax.jit's, under the limit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import memsafe
from memsafe.search import Hint
from tests.agree import assert_like_jit
from tests.compiles import Compiles

LIMIT = 2 << 20


def _kernel_sum(x, y, v):
    return jnp.exp(-(x @ y.T)) @ v


def _inputs(n, m=2048, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype(np.float32) / 4
    y = rng.normal(size=(m, 8)).astype(np.float32) / 4
    v = rng.normal(size=(m,)).astype(np.float32)
    return x, y, v


def test_a_larger_batch_is_re_sized_without_compiling_the_original():
    f = memsafe.jit(_kernel_sum, memory_limit=LIMIT)
    small = _inputs(512)
    f(*small)
    first = f.plan(*small)
    assert first.time.origin == "planned" and first.splits
    large = _inputs(1024, seed=1)
    before = Compiles.count
    got = f(*large)
    plan = f.plan(*large)
    assert plan.time.origin == "re-sized" and plan.splits and plan.before is None
    assert Compiles.count - before == len(plan.attempts)  # the attempts only, no original
    assert plan.after.total <= LIMIT
    assert_like_jit(got, _kernel_sum, *large)
    assert "re-sized" in plan.time.describe()


def test_a_smaller_or_other_shaped_call_is_planned_in_full():
    f = memsafe.jit(_kernel_sum, memory_limit=LIMIT)
    f(*_inputs(1024))
    smaller = _inputs(512)
    f(*smaller)
    assert f.plan(*smaller).time.origin == "planned"
    assert f.plan(*smaller).before is not None
    other = _inputs(1024, m=1024)  # y and v shorter: not covered by the first plan's shapes
    f(*other)
    assert f.plan(*other).time.origin == "planned"


def test_the_hint_covers_only_shapes_as_large_in_every_dimension():
    a = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    hint = Hint((a,), 0.5, True)
    assert hint.covers((jax.ShapeDtypeStruct((8, 8), jnp.float32),))
    assert hint.covers((a,))
    assert not hint.covers((jax.ShapeDtypeStruct((8, 4), jnp.float32),))
    assert not hint.covers((jax.ShapeDtypeStruct((8, 8), jnp.float16),))
    assert not hint.covers((jax.ShapeDtypeStruct((8, 8, 1), jnp.float32),))
    assert not hint.covers((a, a))


def _mlp_step(batch):
    """An MLP's Adam training step (``tests/deep_models.py``) at ``batch`` rows, and its
    arguments: the gradients of its 8 weights are 8 dot sinks, whose accumulators the size model
    holds beside the loop (3 x 8 x 64 KiB), more than the room left at twice the batch."""
    from tests import deep_models as dm

    loss, params, data = dm.mlp(batch=batch, width=128, layers=8)
    step, state = dm.adam_step(loss, params)
    return step, (params, state, *data)


MLP_LIMIT = 4_849_901  # arguments and outputs, and a quarter of jax.jit's temporaries


def test_an_mlp_step_at_twice_the_batch_is_re_sized_in_one_compile():
    """The re-sized attempt starts from the budget in bytes its chunks were sized from at the
    smaller batch (``Hint.scale_at``), not from the share of the room: at twice the batch the
    room shrank under the model's held bytes, and the hint's scale floored every chunk (then 3
    compiles: the floored attempt, 8 times its scale over the limit, and one between)."""
    step, small = _mlp_step(1024)
    f = memsafe.jit(step, memory_limit=MLP_LIMIT)
    f.lower(*small).compile()
    _, large = _mlp_step(2048)
    before = Compiles.count
    got = f(*large)
    plan = f.plan(*large)
    assert plan.time.origin == "re-sized"
    assert Compiles.count - before == len(plan.attempts) == 1
    assert plan.after.total <= MLP_LIMIT
    assert plan.splits and not any(s.floored for s in plan.splits)
    assert_like_jit(got, step, *large)


def test_floored_chunks_that_fit_grow_to_chunks_the_room_holds():
    """An attempt that fits with floored chunks grows to the scale at which the size model sizes
    them to the room (``search._floored_up``), not in proportion to its measured temporaries,
    which a floored chunk does not set (then: 8 times the scale, over the limit, then between
    the two, over again, and the 147 floored chunks of 7 rows ran)."""
    step, args = _mlp_step(1024)
    f = memsafe.jit(step, memory_limit=MLP_LIMIT)
    got = f(*args)
    plan = f.plan(*args)
    assert [a.fits for a in plan.attempts] == [True, True]
    assert plan.after.total <= MLP_LIMIT
    (split,) = plan.splits
    assert not split.floored and split.loops <= 16
    assert_like_jit(got, step, *args)
