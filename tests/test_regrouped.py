"""Reshapes that regroup the split axis on extended chunks (``Regrouped`` in
``memsafe.split.strategies.halo.rules``): a convolutional network flattened into a dense head
(the spatial axis merged with the axes after it), its gradient (split back), and ``jax.vmap``
of it (the batch folded into the convolutions' batch axis); and convolutions split along
their groups (``Grouped``): an ensemble's, and per-example kernel gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import memsafe
from memsafe.xla import memsafe_jit
from tests.agree import assert_like_jit

DN = ("NHWC", "HWIO", "NHWC")


def _net(x, w1, w2, wd):
    h = jax.nn.relu(lax.conv_general_dilated(x, w1, (1, 1), "SAME", dimension_numbers=DN))
    h = jax.nn.relu(lax.conv_general_dilated(h, w2, (1, 1), "SAME", dimension_numbers=DN))
    return jnp.tanh(h.reshape(h.shape[0], -1) @ wd)


def _loss(params, x):
    return jnp.sum(jnp.square(_net(x, *params)))


def _params(rng, cin=8, c=16, side=32):
    return (
        jnp.asarray(rng.standard_normal((3, 3, cin, c)) * 0.2, jnp.float32),
        jnp.asarray(rng.standard_normal((3, 3, c, c)) * 0.1, jnp.float32),
        jnp.asarray(rng.standard_normal((side * side * c, 10)) * 0.01, jnp.float32),
    )


def _limit(f, *args, share=3):
    """Arguments + outputs + a ``share``-th of jax.jit's temporaries."""
    m = memsafe_jit(f).lower(*args).compile().memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes // share


def _fits(f, limit, *args):
    g = memsafe.jit(f, memory_limit=limit)
    m = g.lower(*args).compile().memory_analysis()
    used = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
    assert used - m.alias_size_in_bytes <= limit
    return g


def test_a_convolutional_network_with_a_flattened_dense_head_splits_along_its_rows():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 64, 64, 8)), jnp.float32)  # too few to split
    args = (x, *_params(rng, side=64))
    limit = _limit(_net, *args)
    g = _fits(_net, limit, *args)
    (split,) = g.plan(*args).splits
    assert split.axis == 1 and {"reshape", "dot_general"} <= set(split.ops)
    assert_like_jit(g(*args), _net, *args)


def test_its_training_gradient_splits_the_flattened_cotangent_back():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, 64, 64, 8)), jnp.float32)
    params = _params(rng, side=64)
    f = jax.value_and_grad(_loss)
    limit = _limit(f, params, x)
    g = _fits(f, limit, params, x)
    assert g.plan(params, x).splits
    assert_like_jit(g(params, x), f, params, x)


def test_a_vmap_of_it_fits_the_same_share_of_the_batched_temporaries():
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((4, 13, 32, 32, 8)), jnp.float32)
    params = _params(rng)
    batched = jax.vmap(_net, in_axes=(0, None, None, None))
    limit = _limit(batched, x, *params)
    got = jax.vmap(memsafe.jit(_net, memory_limit=limit), in_axes=(0, None, None, None))(x, *params)
    assert_like_jit(got, batched, x, *params)


def _cnn(params, x):
    w1, w2 = params
    h = jax.nn.relu(lax.conv_general_dilated(x, w1, (1, 1), "VALID", dimension_numbers=DN))
    h = jax.nn.relu(lax.conv_general_dilated(h, w2, (1, 1), "VALID", dimension_numbers=DN))
    return jnp.mean(h, axis=(1, 2, 3))


def _cnn_params(rng, members=None):
    lead = () if members is None else (members,)
    return (
        jnp.asarray(rng.standard_normal((*lead, 3, 3, 4, 16)) * 0.3, jnp.float32),
        jnp.asarray(rng.standard_normal((*lead, 3, 3, 16, 16)) * 0.1, jnp.float32),
    )


def _fits_like_jit(f, args, share=4):
    limit = _limit(f, *args, share=share)
    g = _fits(f, limit, *args)
    assert g.plan(*args).splits
    assert_like_jit(g(*args), f, *args)


def test_an_ensemble_of_convolutional_networks_splits_along_its_members():
    """``jax.vmap`` over members with their own kernels makes grouped convolutions (the
    members' kernels side by side along the feature axis): split along the groups."""
    rng = np.random.default_rng(3)
    params = _cnn_params(rng, members=4)
    x = jnp.asarray(rng.standard_normal((4, 1, 30, 30, 4)), jnp.float32)  # one image each
    _fits_like_jit(jax.vmap(_cnn), (params, x), share=3)  # refused before: best 502 KiB


def test_per_example_gradients_of_a_convolutional_network_split_along_the_examples():
    """Per-example kernel gradients under ``jax.vmap`` are convolutions grouped by example
    (the batch folded into the feature axis): split along the groups."""
    rng = np.random.default_rng(4)
    params = _cnn_params(rng)
    x = jnp.asarray(rng.standard_normal((4, 6, 30, 30, 4)), jnp.float32)
    grads = jax.vmap(jax.grad(lambda p, x: jnp.sum(_cnn(p, x) ** 2)), in_axes=(None, 0))
    _fits_like_jit(grads, (params, x))
