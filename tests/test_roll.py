"""The roll pass: same-shaped blocks written one after another (a Python loop over layers, and the
backward blocks of its gradient) become scans, so the remat pass recomputes their residuals
(``memsafe.passes.roll``, ``memsafe.graph.repeats``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import memsafe
from memsafe import primitives
from memsafe._jax import ClosedJaxpr, is_var, jaxpr_as_fun
from memsafe.context import PassContext
from memsafe.graph import Graph, inline_calls
from memsafe.graph.repeats import loops, sunk
from memsafe.passes import remat, roll
from memsafe.plan import Plan
from memsafe.xla import Footprint, memsafe_jit
from tests import deep_models as models
from tests.agree import assert_like_jit
from tests.budget import examples

B, D = 64, 32

# One layer's steps: (name, function of the hidden state and the layer's parameters).
STEPS = {
    "dense_tanh": lambda h, p: jnp.tanh(h @ p["w"]),
    "relu": lambda h, p: jnp.maximum(h @ p["w"], 0.0),
    "residual": lambda h, p: h + jnp.tanh(h @ p["w"]) @ p["v"],
    "layer_norm": lambda h, p: models._layer_norm(h, p["g"]),
    "softmax_mix": lambda h, p: jax.nn.softmax(h @ h.T / 8.0, -1) @ h,
    "scale": lambda h, p: h * 0.5 + p["g"],
}


def _params(layers: int, seed: int) -> list[dict[str, jax.Array]]:
    rng = np.random.default_rng(seed)

    def one() -> dict[str, jax.Array]:
        w, v = (rng.standard_normal((D, D), dtype=np.float32) / 6 for _ in range(2))
        return {"w": jnp.asarray(w), "v": jnp.asarray(v), "g": jnp.ones(D)}

    return [one() for _ in range(layers)]


def _model(
    steps: list[str], first: list[str], skip: bool, tied: bool, checkpointed=False, stacked=False
):
    """A Python loop over layers (``first`` the first layer's steps where given), optionally
    with a skip connection from two layers back, with every layer reading the first layer's
    parameters (tied weights), or with ``jax.checkpoint`` around each layer; ``stacked``: the
    parameters are one dict of arrays stacked over the layers, each layer reading its slice
    (``params["w"][i]``)."""

    def layer(names, h, p):
        for name in names:
            h = STEPS[name](h, p)
        return h

    def loss(params, x):
        before, h = x, x
        count = len(params["w"]) if stacked else len(params)
        for i in range(count):
            at = 0 if tied else i
            p = {k: v[at] for k, v in params.items()} if stacked else params[at]
            names = tuple(first if (i == 0 and first) else steps)
            run = jax.checkpoint(layer, static_argnums=0) if checkpointed else layer
            new = run(names, h, p)
            before, h = h, new + 0.5 * before if skip else new
        return jnp.sum(jnp.nan_to_num(h) ** 2)

    return loss


def _rolled(closed: ClosedJaxpr) -> tuple[ClosedJaxpr, Plan]:
    """``closed`` after the roll and remat passes at a budget that makes any pair worth it."""
    plan = Plan(memory_limit=1)
    ctx = PassContext(1, 0, plan)
    return remat.run(roll.run(closed, ctx), ctx), plan


def _run(closed: ClosedJaxpr, args):
    return memsafe_jit(jaxpr_as_fun(closed))(*args)


def _reads_only_the_block_before(closed: ClosedJaxpr, graph: Graph) -> None:
    """Every loop found reads, in each block, values of that block, of the block before, or
    from outside its run."""
    for alts in loops(graph):
        for lp in alts:
            run = lp.run
            for i in range(run.start, run.stop):
                for v in closed.jaxpr.eqns[i].invars:
                    p = graph.info(v).producer if is_var(v) else None
                    if p is not None and run.start <= p < run.stop:
                        assert run.locate(i)[0] - run.locate(p)[0] in (0, 1)


@settings(max_examples=examples(25), deadline=None)
@given(
    layers=st.integers(2, 5),
    steps=st.lists(st.sampled_from(sorted(STEPS)), min_size=1, max_size=4),
    first=st.lists(st.sampled_from(sorted(STEPS)), max_size=2),
    skip=st.booleans(),
    tied=st.booleans(),
    checkpointed=st.booleans(),
    stacked=st.booleans(),
    wrt_x=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_rolled_programs_give_the_unrolled_answers(
    layers, steps, first, skip, tied, checkpointed, stacked, wrt_x, seed
):
    """Random layer stacks and their gradients (``jax.checkpoint`` around each layer or not,
    parameters a list per layer or stacked arrays sliced per layer), rolled where the passes
    find loops, give the unrolled program's answers by the accuracy rule (NaN and infinities in
    the input included); stacks of three plain layers or more are rolled."""
    loss = _model(steps, first, skip, tied, checkpointed, stacked)
    params = _params(layers, seed)
    if stacked:
        params = {k: jnp.stack([p[k] for p in params]) for k in params[0]}
    x = np.random.default_rng(seed + 1).standard_normal((B, D), dtype=np.float32)
    x[3, 1], x[5, 0] = np.nan, np.inf
    fun = jax.value_and_grad(loss, (0, 1) if wrt_x else 0)
    args = (params, jnp.asarray(x))
    closed = inline_calls(jax.make_jaxpr(fun)(*args))
    _reads_only_the_block_before(closed, Graph(closed))
    new, plan = _rolled(closed)
    flat = jax.tree.leaves(args)
    got = jax.tree.unflatten(jax.tree.structure(fun(*args)), _run(new, flat))
    assert_like_jit(got, fun, *args)
    if layers >= 3 and not (first or skip or tied) and len(steps) > 1:
        assert any(r.pass_name == "roll" for r in plan.records), plan


def _transformer_grad(blocks: int = 4, length: int = 256):
    loss, params, batch = models.transformer(models.Shape(blocks=blocks, batch=1, length=length))
    return jax.value_and_grad(loss), (params, *batch)


def test_the_layers_and_their_backward_are_found_with_narrow_carries():
    """A 6-block transformer's gradient: the last five forward blocks and the five backward blocks
    that read them are loops (the first block differs: its input is not differentiated), each
    carrying one [B, L, D] value from block to block."""
    fun, args = _transformer_grad(blocks=6)
    graph = Graph(inline_calls(jax.make_jaxpr(fun)(*args)))
    found = loops(graph)
    assert [alts[0].run.count for alts in found] == [5, 5]
    width = np.prod(args[1].shape) * 4
    assert all(lp.carry_bytes() == width for alts in found for lp in alts)


def test_a_python_loop_transformer_is_rolled_and_rematerialized():
    """A Python-loop transformer's gradient (L=1024, width 64, 2 heads; jax.jit 80 MiB) under
    20 MiB, where without rolling the best footprint was 31 MiB: its blocks are rolled into
    scans, the residuals recomputed per layer, and the answers are jax.jit's."""
    shape = models.Shape(blocks=4, batch=1, length=1024, width=64, heads=2)
    loss, params, batch = models.transformer(shape)
    fun, args = jax.value_and_grad(loss), (params, *batch)
    limit = 20 * 2**20
    assert Footprint.from_compiled(jax.jit(fun).lower(*args).compile()).total > 3 * limit
    f = memsafe.jit(fun, memory_limit=limit)
    plan = f.plan(*args)
    names = [r.pass_name for r in plan.passes]
    assert "roll" in names and "remat" in names, plan
    assert plan.after.total <= limit
    assert_like_jit(f(*args), fun, *args)


def test_checkpointed_layers_recompute_in_a_rolled_backward():
    """``jax.checkpoint`` around each layer of a Python loop: each backward block recomputes its
    layer, which XLA would merge with the forward when written one after another. The backward
    blocks are rolled into a scan alone; the program fits 28 MiB, where without rolling the
    best footprint was 31.6 MiB, with jax.jit's answers."""
    shape = models.Shape(blocks=4, batch=1, length=1024, width=64, heads=2)
    loss, params, batch = models.transformer(shape, checkpointed=True)
    fun, args = jax.value_and_grad(loss), (params, *batch)
    f = memsafe.jit(fun, memory_limit=28 * 2**20)
    plan = f.plan(*args)
    rolls = [r for r in plan.passes if r.pass_name == "roll"]
    assert rolls and "recomputing" in rolls[0].description, plan
    assert plan.after.total <= 28 * 2**20
    assert_like_jit(f(*args), fun, *args)


def test_checkpointed_layers_where_one_head_of_scores_is_over_the_limit():
    """``jax.checkpoint`` around each layer at L=2048 under 10 MiB, where one head's scores
    (16 MiB) exceed the limit: the backward splits along the queries. Refused before (best
    71.8 MiB): the split chose the heads, since the model held values for the query split that
    its loops never read, and the online-softmax loops ran their first chunk outside the loop,
    where XLA merged the forward's with the recomputation's and kept both alive."""
    shape = models.Shape(blocks=4, batch=1, length=2048, width=32, heads=2)
    loss, params, batch = models.transformer(shape, checkpointed=True)
    fun, args = jax.value_and_grad(loss), (params, *batch)
    limit = 10 * 2**20
    f = memsafe.jit(fun, memory_limit=limit)
    assert f.plan(*args).after.total <= limit
    assert_like_jit(f(*args), fun, *args)


def test_a_read_from_two_blocks_back_is_not_a_carry():
    """A skip connection from two layers back: no run with that read reads as a loop over one
    layer per block, and what is rolled gives the unrolled answers."""
    loss = _model(["dense_tanh", "residual"], [], skip=True, tied=False)
    params, x = _params(5, 0), jnp.ones((B, D))
    fun = jax.grad(loss)
    closed = inline_calls(jax.make_jaxpr(fun)(params, x))
    _reads_only_the_block_before(closed, Graph(closed))
    new, _ = _rolled(closed)
    flat = jax.tree.leaves((params, x))
    got = jax.tree.unflatten(jax.tree.structure(fun(params, x)), _run(new, flat))
    assert_like_jit(got, fun, params, x)


def test_nothing_is_rolled_where_the_residuals_fit():
    """Where what the backward reads of the forward is under the remat pass's share of the
    budget, the program is left as it is."""
    fun, args = _transformer_grad()
    closed = inline_calls(jax.make_jaxpr(fun)(*args))
    ctx = PassContext(2**40, 0, Plan(memory_limit=2**40))
    assert roll.run(closed, ctx) is closed


def test_the_program_as_written_is_planned_again_where_no_rolled_attempt_fits():
    """A small ResNet's two same-shaped conv/batch-norm blocks are rolled into scans, and the
    scans stop the split of the batch through its batch-norm stages: no rolled attempt fits a
    third of jax.jit's footprint (best 4.4 MiB against 1.1 MiB). The driver plans the program
    as written again, without rolling, and that fits, with jax.jit's answers."""
    from tests import test_conv

    fun, args = jax.grad(test_conv._resnet_loss), test_conv._resnet_inputs(batch=16, size=16)
    graph = Graph(inline_calls(jax.make_jaxpr(fun)(*args)))
    assert roll.chosen(graph, test_conv._a_third(fun, args)), "the blocks are rolled at first"
    plan = test_conv._under_limit(fun, args, test_conv._a_third)
    assert not any(r.pass_name == "roll" for r in plan.passes), plan
    assert len(plan.attempts) > 1


def test_cheap_work_only_the_results_read_is_moved_to_the_end():
    """``repeats.sunk``: the gradient of a stacked parameter read per layer sums one zero pad per
    layer, each with its own padding, and the forward reads one slice per layer, each at its own
    position (both cut the repeated blocks). Moved to the end, the pads with the cheap work only
    the results read, and to the start, the slices of the inputs, the program computes the same,
    the rest keeps its order (the cotangent the next layer reads stays where it was), and the
    backward's blocks are found as a loop."""
    loss = _model(["dense_tanh", "residual"], [], skip=False, tied=False, stacked=True)
    params = {k: jnp.stack([p[k] for p in _params(4, 0)]) for k in ("w", "v", "g")}
    args = (params, jnp.ones((B, D)))
    closed = inline_calls(jax.make_jaxpr(jax.grad(loss))(*args))
    moved = sunk(closed)
    assert moved is not closed
    eqns, new = closed.jaxpr.eqns, moved.jaxpr.eqns
    assert sorted(map(id, eqns)) == sorted(map(id, new))
    dots = [i for i, e in enumerate(new) if e.primitive.name == "dot_general"]
    assert all(i > dots[-1] for i, e in enumerate(new) if e.primitive.name == "pad")
    assert all(i < dots[0] for i, e in enumerate(new) if e.primitive.name == "slice")
    fixed = {id(e) for e in new if e.primitive.name not in primitives.CHEAP}
    assert [id(e) for e in eqns if id(e) in fixed] == [id(e) for e in new if id(e) in fixed]
    flat = jax.tree.leaves(args)
    for a, b in zip(_run(moved, flat), _run(closed, flat), strict=True):
        np.testing.assert_array_equal(a, b)
    assert len(loops(Graph(moved))) > len(loops(Graph(closed)))


def test_stacked_checkpointed_layers_are_rolled_alone():
    """``jax.checkpoint`` around each layer reading its slice of stacked parameters: each backward
    block recomputes its layer from the forward's values, which XLA would merge with the forward
    and keep alive. Found once the pads of the parameters' gradients are moved to the end, the
    backward blocks are rolled into a scan alone (the forward's blocks differ by the slices they
    read), with the unrolled program's answers. The scan reads the stacked parameters whole and
    slices them per iteration: it stacks no copy of their slices."""
    loss = _model(["relu", "residual"], [], skip=False, tied=False, checkpointed=True, stacked=True)
    params = {k: jnp.stack([p[k] for p in _params(4, 1)]) for k in ("w", "v", "g")}
    args = (params, jnp.ones((B, D)))
    fun = jax.value_and_grad(loss)
    closed = inline_calls(jax.make_jaxpr(fun)(*args))
    new, plan = _rolled(closed)
    rolls = [r for r in plan.records if r.pass_name == "roll"]
    assert rolls and "recomputing" in rolls[0].description, plan
    stacks = [e.outvars[0].aval.shape for e in new.jaxpr.eqns if e.primitive.name == "stack"]
    assert stacks and all(shape[1:] != (D, D) for shape in stacks), stacks
    got = jax.tree.unflatten(jax.tree.structure(fun(*args)), _run(new, jax.tree.leaves(args)))
    assert_like_jit(got, fun, *args)


def _adam_step(layers: int):
    """A training step as the deep fuzzer writes it (family scan_layers, a Python loop): layers of
    a residual ReLU MLP, each under ``jax.checkpoint``, reading their slices of stacked
    parameters, then Adam's moments and the new parameters."""

    def model(params, x, labels):
        h = jax.nn.relu(x @ params["w_in"] + params["b_in"])
        layer = jax.checkpoint(lambda h, w, b: h + jax.nn.relu(h @ w + b))
        for i in range(layers):
            h = layer(h, params["ws"][i], params["bs"][i])
        logp = jax.nn.log_softmax(h @ params["w_out"], -1)
        return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], -1))

    def step(params, m, u, x, labels):
        value, grads = jax.value_and_grad(model)(params, x, labels)
        m = jax.tree.map(lambda a, g: 0.9 * a + 0.1 * g, m, grads)
        u = jax.tree.map(lambda a, g: 0.99 * a + 0.01 * g * g, u, grads)
        new = jax.tree.map(lambda p, a, b: p - 0.05 * a / (jnp.sqrt(b) + 1e-3), params, m, u)
        return value, new, m, u

    return step


def test_an_adam_step_over_stacked_checkpointed_layers_fits():
    """Deep fuzz seed 501's program at a smaller size (4 layers of 192 x 192, 128 rows): at 55%
    of the way from arguments + outputs (3.77 MB) to jax.jit's footprint (5.54 MB) it was
    refused (best 5.02 MB: XLA merged each layer's recomputation with the forward and kept the
    pre-activations alive); its backward blocks are rolled into a scan and it fits, with
    jax.jit's answers."""
    rng = np.random.default_rng(0)

    def arr(*shape):
        scale = np.sqrt(shape[-2]) if len(shape) > 1 else 1.0
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) / scale)

    layers, width = 4, 192
    params = {
        "w_in": arr(32, width),
        "b_in": arr(width),
        "ws": arr(layers, width, width),
        "bs": arr(layers, width),
        "w_out": arr(width, 10),
    }
    m = jax.tree.map(lambda a: 0.1 * a, params)
    u = jax.tree.map(lambda a: a * a, params)
    x, labels = arr(128, 32), jnp.asarray(rng.integers(0, 10, 128), jnp.int32)
    step, args = _adam_step(layers), (params, m, u, x, labels)
    plain = Footprint.from_compiled(jax.jit(step).lower(*args).compile())
    fixed = plain.arguments + plain.outputs
    limit = int(fixed + 0.55 * (plain.total - fixed))
    f = memsafe.jit(step, memory_limit=limit)
    plan = f.plan(*args)
    assert plan.after is not None and plan.after.total <= limit, plan
    rolls = [r for r in plan.passes if r.pass_name == "roll"]
    assert rolls and "recomputing" in rolls[0].description, plan
    assert_like_jit(f(*args), step, *args)
