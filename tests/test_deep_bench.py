"""The train-step benchmark's programs (benchmarks/train_step_model.py): the hand-written peer
(checkpoint + scan over stacked blocks + micro-batches) computes the user's loss and gradient
(memsafe's step against jax.jit's is checked by the benchmark and tests/test_deep.py)."""

from __future__ import annotations

import jax
import numpy as np

from benchmarks import train_step_model as gpt
from memsafe.xla import memsafe_jit

SMALL = gpt.Config(batch=4, length=32, width=32, blocks=3, vocab=64)


def _close(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


def test_hand_tuned_peer_equals_the_users_gradient():
    params, ids = gpt.init(SMALL), gpt.tokens(SMALL)
    value, grads = memsafe_jit(jax.value_and_grad(gpt.loss))(params, ids)
    want = (value, gpt.stacked(grads))
    got = memsafe_jit(gpt.hand_tuned_grad, static_argnums=2)(gpt.stacked(params), ids, 2)
    _close(got, want)


def test_the_scan_form_is_the_users_loss():
    """The model written with ``lax.scan`` over stacked blocks computes the loop's loss and
    gradient (the benchmark's second form)."""
    params, ids = gpt.init(SMALL), gpt.tokens(SMALL)
    value, grads = memsafe_jit(jax.value_and_grad(gpt.loss))(params, ids)
    got = memsafe_jit(jax.value_and_grad(gpt.scan_loss))(gpt.stacked(params), ids)
    _close(got, (value, gpt.stacked(grads)))
