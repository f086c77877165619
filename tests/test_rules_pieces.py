"""A product read only in pieces (a fused qkv projection split in three, a gated MLP's halves)
is computed piece by piece, and the concatenated cotangents of its gradient are contracted piece
by piece: the same results, the product-sized values no longer stored (measured by XLA)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from memsafe.rewrite.algebraic import rewritten
from memsafe.xla import memsafe_jit


def _rand(shape, seed=0):
    return jax.random.normal(jax.random.PRNGKey(seed), shape)


def _close(a, b):
    """Within float32 rounding of jax.jit's answer, scaled to its largest entry: each element
    of the products is the same contraction, but XLA blocks products of other shapes and fuses
    their readers otherwise (the node update's gradient below differs from jax.jit's by up to
    1.6e-5 of entries up to 5; both are as far from a float64 run, checked by hand)."""
    scale = max(1.0, float(np.max(np.abs(b))))
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * scale)


def _rules(f, *args):
    g = rewritten(f)
    jax.tree_util.tree_map(_close, g(*args), jax.jit(f)(*args))
    return [r.rule for r in g.plan(*args).rules]


def _products(f, *args):
    """The result shapes of the products in ``f``'s rewritten program."""
    eqns = rewritten(f).jaxpr(*args).jaxpr.eqns
    return [tuple(e.outvars[0].aval.shape) for e in eqns if e.primitive.name == "dot_general"]


def qkv(x, w):
    q, k, v = jnp.split(x @ w, 3, axis=-1)
    return jnp.tanh(q * k + v)


def gated(x, w):
    y = jnp.einsum("bti,io->bto", x, w)
    return y[..., :24] * jax.nn.sigmoid(y[..., 24:])


def test_a_split_product_is_computed_in_pieces():
    x, w = _rand((2, 64, 16)), _rand((16, 48), 1)
    assert _rules(qkv, x, w) == ["product_in_pieces"]
    assert _products(qkv, x, w) == [(2, 64, 16)] * 3


def test_a_product_read_by_slices_is_computed_in_pieces():
    x, w = _rand((2, 64, 16)), _rand((16, 48), 1)
    assert _rules(gated, x, w) == ["product_in_pieces"]
    assert _products(gated, x, w) == [(2, 64, 24)] * 2


def test_pieces_along_a_batch_axis_and_the_left_operand():
    a, b = _rand((6, 32, 8)), _rand((6, 8, 32), 1)
    by_batch = lambda a, b: (lambda u, v: u + 2 * v)(*jnp.split(a @ b, 2, axis=0))
    assert _rules(by_batch, a, b) == ["product_in_pieces"]
    assert _products(by_batch, a, b) == [(3, 32, 32)] * 2
    by_rows = lambda a, b: (lambda m: jnp.exp(m[:, :10]).sum() + m[:, 10:].max())(a @ b)
    assert _rules(by_rows, a, b) == ["product_in_pieces"]
    assert _products(by_rows, a, b) == [(6, 10, 32), (6, 22, 32)]


def test_the_gradient_contracts_the_concatenated_cotangents_in_pieces():
    x, w = _rand((2, 64, 16)), _rand((16, 48), 1)
    grad = jax.grad(lambda x, w: qkv(x, w).sum(), 1)
    assert _rules(grad, x, w) == ["product_in_pieces"] * 2
    eqns = rewritten(grad).jaxpr(x, w).jaxpr.eqns
    cats = [e for e in eqns if e.primitive.name == "concatenate"]
    assert [tuple(e.outvars[0].aval.shape) for e in cats] == [(48, 16)]  # weight-sized only


def node_update(h, agg, w):
    return jnp.sum(jnp.tanh(jnp.concatenate([h, agg], axis=-1) @ w) ** 2)


def test_a_layers_concatenated_input_is_not_held_for_the_backward_pass():
    """A graph network's node update ``concat([h, agg]) @ w``: the forward contracts the
    concatenated axis, so it still reads the concatenation (its pieces' products would be
    summed in another order); the weight gradient ``concat^T @ g`` reads the pieces, so the
    concatenation is not held until the backward pass; the gradient's ``g @ w^T``, read as two
    slices (the transpose of the concatenation), is computed one product per piece."""
    h, agg, w = _rand((512, 32)), _rand((512, 32), 1), _rand((64, 16), 2)
    grad = jax.value_and_grad(node_update, (0, 2))
    assert _rules(grad, h, agg, w) == ["product_in_pieces"] * 2
    eqns = rewritten(grad).jaxpr(h, agg, w).jaxpr.eqns
    cats = [e for e in eqns if e.primitive.name == "concatenate"]
    assert [tuple(e.outvars[0].aval.shape) for e in cats] == [(512, 64), (16, 64)]
    readers = [e for e in eqns if any(v is cats[0].outvars[0] for v in e.invars)]
    assert len(readers) == 1  # the forward product alone
    assert (512, 64) not in _products(grad, h, agg, w)
    assert _products(grad, h, agg, w).count((512, 32)) == 1  # dh; dagg is not asked for
    # read last by another operation: it lives as long either way, left as it is
    late = lambda h, agg, x: (lambda c: (c.T @ x, jnp.sin(c)))(jnp.concatenate([h, agg], -1))
    assert _rules(late, h, agg, _rand((512, 16), 3)) == []


def test_a_node_updates_temps_fall_measured():
    """``value_and_grad`` of a node update over 65,536 nodes w.r.t. ``h`` and ``w``: XLA holds
    the concatenation f32[65536, 128] (32 MiB) from the forward product to the weight gradient
    and stores the gradient's ``g @ w^T`` beside its two slices (64 MiB of temps at jax 0.10.2);
    rewritten, 32 MiB."""
    h, agg, w = _rand((65536, 64)), _rand((65536, 64), 1), _rand((128, 64), 2)
    f = jax.value_and_grad(node_update, (0, 2))
    before = memsafe_jit(f).lower(h, agg, w).compile().memory_analysis().temp_size_in_bytes
    after = memsafe_jit(rewritten(f)).lower(h, agg, w).compile().memory_analysis()
    assert before - after.temp_size_in_bytes >= 65536 * 128 * 4 // 2, (before, after)


def test_no_rewrite_where_the_product_is_stored_anyway_or_read_twice():
    x, w = _rand((2, 64, 16)), _rand((16, 48), 1)
    also_whole = lambda x, w: (lambda y: (jnp.split(y, 3, -1)[0], y.sum()))(x @ w)
    assert _rules(also_whole, x, w) == []
    returned = lambda x, w: (lambda y: (y, y[..., :16]))(x @ w)
    assert _rules(returned, x, w) == []
    overlapping = lambda x, w: (lambda y: y[..., :40] + y[..., 8:])(x @ w)
    assert _rules(overlapping, x, w) == []
    strided = lambda x, w: (x @ w)[..., ::2]
    assert _rules(strided, x, w) == []
    # the weight slices would cost more than the product: a short sequence, a wide weight
    x, w = _rand((1, 4, 256)), _rand((256, 96), 1)
    assert _rules(qkv, x, w) == []


def test_temps_fall_by_the_product_measured():
    """A training step's projection, ``value_and_grad`` w.r.t. the weight: XLA stores the fused
    product f32[8, 1024, 768] (24 MiB) beside the pieces the backward reads (48 MiB of temps at
    jax 0.10.2); computed in pieces, it does not (32 MiB)."""
    x, w = _rand((8, 1024, 256)), _rand((256, 768), 1)
    f = jax.value_and_grad(lambda x, w: jnp.sum(qkv(x, w)), 1)
    before = memsafe_jit(f).lower(x, w).compile().memory_analysis().temp_size_in_bytes
    after = memsafe_jit(rewritten(f)).lower(x, w).compile().memory_analysis().temp_size_in_bytes
    product = 8 * 1024 * 768 * 4
    assert before - after >= product // 2, (before, after)
