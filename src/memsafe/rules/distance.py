"""Built-in rules for pairwise distances and similarities between the rows of two matrices.

Written naively, ``sum((x[:, None] - y[None]) ** 2, -1)`` is an n*m*d elementwise reduction that
XLA may store whole; ``|x|^2 + |y|^2 - 2 x y^T`` is one matrix product plus rank-one terms.
"""

from __future__ import annotations

import jax.numpy as jnp

from memsafe import policy
from memsafe.rules.pattern import Rule
from memsafe.rules.sqdist import gram as _gram
from memsafe.rules.sqdist import sqdist


def sqdist_gemm(x: jnp.ndarray, y: jnp.ndarray) -> jnp.ndarray:
    """|x_i|^2 + |y_j|^2 - 2 x_i.y_j in a centred frame, clamped at zero (one GEMM instead of an
    n*m*d reduction), with the direct form's NaN, infinities and exact gradient (rules.sqdist)."""
    return sqdist(x, y)


def l2dist_gemm(x: jnp.ndarray, y: jnp.ndarray) -> jnp.ndarray:
    """sqrt of the clamped GEMM expansion of the squared distance."""
    return jnp.sqrt(sqdist_gemm(x, y))


def pairwise_dot_gemm(x: jnp.ndarray, y: jnp.ndarray) -> jnp.ndarray:
    """x @ y.T instead of a broadcast multiply and sum."""
    return _gram(x, y)


def cosine_gemm(x: jnp.ndarray, y: jnp.ndarray) -> jnp.ndarray:
    """(x @ y.T) scaled by the inverse row norms, without normalized copies of x and y."""
    nx = jnp.sqrt(jnp.sum(x * x, axis=-1))
    ny = jnp.sqrt(jnp.sum(y * y, axis=-1))
    return _gram(x, y) / (nx[:, None] * ny[None, :])


def _deep_enough(match) -> bool:
    return match.sizes.get("d", policy.REWRITE.min_gemm_depth) >= policy.REWRITE.min_gemm_depth


def _diff(x: jnp.ndarray, y: jnp.ndarray) -> jnp.ndarray:
    return x[:, None, :] - y[None, :, :]


def _rdiff(x: jnp.ndarray, y: jnp.ndarray) -> jnp.ndarray:
    return y[None, :, :] - x[:, None, :]


def _normalize(v: jnp.ndarray) -> jnp.ndarray:
    return v / jnp.linalg.norm(v, axis=-1, keepdims=True)


#: The sums of squares. A squared norm, ``norm(x_i - y_j) ** 2``, is left to :data:`L2DIST`
#: (its norm becomes ``sqrt`` of the expansion, then squared): its gradient is the norm's, NaN
#: over the whole of both rows where the distance is NaN, infinite or zero, which the sum of
#: squares' exact gradient is not (a NaN in one coordinate of ``x_i`` made jax.jit's gradient of
#: ``x_i`` and of every ``y_j`` NaN, and memsafe's only at that coordinate).
SQDIST = Rule(
    "pairwise_sqdist",
    [
        lambda x, y: jnp.sum(_diff(x, y) ** 2, axis=-1),
        lambda x, y: jnp.sum(_rdiff(x, y) ** 2, axis=-1),
    ],
    sqdist_gemm,
    shapes="n d, m d",
    dtypes=(jnp.floating,),
    filters=(_deep_enough,),
    description="pairwise squared distance -> |x|^2 + |y|^2 - 2 x y^T (one centred GEMM), clamped",
    needs=[("reduce_sum", "square"), ("square", "sub")],
    check_replacement=False,  # checked by tests/test_rules_builtin.py
)

L2DIST = Rule(
    "pairwise_l2dist",
    [
        lambda x, y: jnp.sqrt(jnp.sum(_diff(x, y) ** 2, axis=-1)),
        lambda x, y: jnp.sqrt(jnp.sum(_rdiff(x, y) ** 2, axis=-1)),
        lambda x, y: jnp.linalg.norm(_diff(x, y), axis=-1),
        lambda x, y: jnp.linalg.norm(_rdiff(x, y), axis=-1),
    ],
    l2dist_gemm,
    shapes="n d, m d",
    dtypes=(jnp.floating,),
    filters=(_deep_enough,),
    description="pairwise distance -> sqrt of the clamped GEMM expansion",
    needs=[("sqrt", "reduce_sum"), ("reduce_sum", "square"), ("square", "sub")],
    check_replacement=False,  # checked by tests/test_rules_builtin.py
)

PAIRWISE_DOT = Rule(
    "pairwise_dot",
    lambda x, y: jnp.sum(x[:, None, :] * y[None, :, :], axis=-1),
    pairwise_dot_gemm,
    shapes="n d, m d",
    dtypes=(jnp.floating, jnp.complexfloating),
    filters=(_deep_enough,),
    description="sum(x[:, None] * y[None], -1) -> x @ y.T",
    needs=[("reduce_sum", "mul")],
    check_replacement=False,  # checked by tests/test_rules_builtin.py
)

COSINE = Rule(
    "pairwise_cosine",
    [
        lambda x, y: _normalize(x) @ _normalize(y).T,
        lambda x, y: _normalize(x) @ jnp.transpose(_normalize(y)),
    ],
    cosine_gemm,
    shapes="n d, m d",
    dtypes=(jnp.floating,),
    min_bytes_saved=1,
    description="normalized rows then x @ y.T -> scale the GEMM by inverse norms (no copies)",
    needs=[("dot_general", "div"), ("div", "sqrt"), ("sqrt", "reduce_sum")],
    check_replacement=False,  # checked by tests/test_rules_builtin.py
)

#: The pairwise distance and similarity rules, in the order match-and-replace tries them.
DISTANCE_RULES = (L2DIST, SQDIST, PAIRWISE_DOT, COSINE)
