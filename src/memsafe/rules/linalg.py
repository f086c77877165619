"""Built-in rules that avoid forming a matrix product only to read a small part of it."""

from __future__ import annotations

import jax.numpy as jnp

from memsafe.rules.pattern import Rule


def diag_of_product(a: jnp.ndarray, b: jnp.ndarray) -> jnp.ndarray:
    """diag(A @ B)_i = sum_k A_ik B_ki: row-wise sums of products, no n x n matrix."""
    return jnp.sum(a * b.T, axis=1)


def trace_of_product(a: jnp.ndarray, b: jnp.ndarray) -> jnp.ndarray:
    """trace(A @ B) = sum_ik A_ik B_ki."""
    return jnp.sum(a * b.T)


def sum_of_product(a: jnp.ndarray, b: jnp.ndarray) -> jnp.ndarray:
    """sum(A @ B) = (1^T A)(B 1): two reductions and a dot of vectors."""
    return jnp.dot(jnp.sum(a, axis=0), jnp.sum(b, axis=1))


DIAG = Rule(
    "diag_of_product",
    [lambda a, b: jnp.diag(a @ b), lambda a, b: jnp.diagonal(a @ b)],
    diag_of_product,
    shapes="n k, k n",
    dtypes=(jnp.floating, jnp.complexfloating, jnp.integer),
    description="diag(A @ B) -> sum(A * B.T, 1)",
    needs=[("gather", "dot_general")],
    check_replacement=False,  # checked by tests/test_rules_builtin.py
)

TRACE = Rule(
    "trace_of_product",
    lambda a, b: jnp.trace(a @ b),
    trace_of_product,
    shapes="n k, k n",
    dtypes=(jnp.floating, jnp.complexfloating, jnp.integer),
    description="trace(A @ B) -> sum(A * B.T)",
    needs=[("select_n", "dot_general"), ("reduce_sum", "select_n")],
    check_replacement=False,  # checked by tests/test_rules_builtin.py
)

SUM = Rule(
    "sum_of_product",
    lambda a, b: jnp.sum(a @ b),
    sum_of_product,
    shapes="n k, k m",
    dtypes=(jnp.floating, jnp.complexfloating),
    description="sum(A @ B) -> sum(A, 0) . sum(B, 1)",
    needs=[("reduce_sum", "dot_general")],
    check_replacement=False,  # checked by tests/test_rules_builtin.py
)

#: Products read in part: diagonal, trace and sum of a matrix product.
LINALG_RULES = (DIAG, TRACE, SUM)
