"""Built-in rules that avoid forming a matrix product only to read a small part of it."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from memsafe.rules.pattern import Rule


@jax.custom_vjp
def diag_of_product(a: jnp.ndarray, b: jnp.ndarray) -> jnp.ndarray:
    """diag(A @ B)_i = sum_k A_ik B_ki: row-wise sums of products, no n x n matrix; its
    gradient is the product's, non-finite values included (:func:`_diagonal_cotangents`)."""
    return jnp.sum(a * b.T, axis=1)


def _diag_fwd(a: jnp.ndarray, b: jnp.ndarray) -> tuple[jnp.ndarray, tuple]:
    return diag_of_product(a, b), (a, b)


def _diag_bwd(res: tuple, g: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    return _diagonal_cotangents(*res, g)


diag_of_product.defvjp(_diag_fwd, _diag_bwd)


@jax.custom_vjp
def trace_of_product(a: jnp.ndarray, b: jnp.ndarray) -> jnp.ndarray:
    """trace(A @ B) = sum_ik A_ik B_ki; its gradient is the product's, non-finite values
    included (:func:`_diagonal_cotangents`)."""
    return jnp.sum(a * b.T)


def _trace_fwd(a: jnp.ndarray, b: jnp.ndarray) -> tuple[jnp.ndarray, tuple]:
    return trace_of_product(a, b), (a, b)


def _trace_bwd(res: tuple, g: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    a, _ = res
    return _diagonal_cotangents(*res, jnp.broadcast_to(g, a.shape[:1]))


trace_of_product.defvjp(_trace_fwd, _trace_bwd)


def _diagonal_cotangents(
    a: jnp.ndarray, b: jnp.ndarray, g: jnp.ndarray
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """The cotangents of A (n x k) and B (k x n) for the cotangent ``g`` (n) of diag(A @ B), as
    the product's gradient gives them: ``dA = G @ B.T`` and ``dB = A.T @ G`` with ``G`` the n x n
    matrix of ``g`` on its diagonal and zeros elsewhere. Its zeros meet every other entry of the
    row of B (column of A): ``dA_ik = g_i B_ki``, NaN where ``B_kj`` is not finite for some
    ``j != i`` (``0 * inf``, ``0 * nan``), and likewise for ``dB``. Without them a NaN in B gave
    a NaN in one entry of dA where jax.jit gives a NaN column."""
    da = g[:, None] * b.T
    db = a.T * g[None, :]
    bad_b = ~jnp.isfinite(b)  # k x n
    bad_a = ~jnp.isfinite(a)  # n x k
    # the row k of B has a non-finite entry outside column i (count over the row, less B_ki's)
    other_b = jnp.sum(bad_b, axis=1)[None, :] - bad_b.T.astype(jnp.int32) > 0  # n x k
    other_a = jnp.sum(bad_a, axis=0)[:, None] - bad_a.T.astype(jnp.int32) > 0  # k x n
    nan = jnp.asarray(jnp.nan, da.dtype)
    return jnp.where(other_b, nan, da), jnp.where(other_a, nan, db)


def _kinds(x: jnp.ndarray, axis: int) -> dict[str, jnp.ndarray]:
    """Per position of the other axis of ``x``: whether some element along ``axis`` is NaN,
    +inf, -inf, zero, finite positive, finite negative."""
    finite = jnp.isfinite(x)
    return {
        "nan": jnp.any(jnp.isnan(x), axis),
        "pinf": jnp.any(x == jnp.inf, axis),
        "ninf": jnp.any(x == -jnp.inf, axis),
        "zero": jnp.any(x == 0, axis),
        "pos": jnp.any(finite & (x > 0), axis),
        "neg": jnp.any(finite & (x < 0), axis),
    }


def sum_of_product(a: jnp.ndarray, b: jnp.ndarray) -> jnp.ndarray:
    """sum(A @ B) = (1^T A)(B 1): two reductions and a dot of vectors.

    Exact for finite inputs. Where an input is not finite, the sum of the products is what
    IEEE gives the n x k x m products, found from which kinds of values each column of A and
    row of B hold: NaN where a product is NaN (a NaN, or an infinity times a zero) or where
    +inf and -inf products meet, else the infinity some product is, else the factored sum. The
    factored form alone gave -inf where the products summed to NaN (fuzz seed 7313)."""
    total = jnp.dot(jnp.sum(a, axis=0), jnp.sum(b, axis=1))
    if not jnp.issubdtype(a.dtype, jnp.floating) or not a.size or not b.size:
        return total
    x, y = _kinds(a, 0), _kinds(b, 1)
    inf_x, inf_y = x["pinf"] | x["ninf"], y["pinf"] | y["ninf"]
    up_y, down_y = y["pos"] | y["pinf"], y["neg"] | y["ninf"]
    nan = jnp.any(x["nan"] | y["nan"] | (inf_x & y["zero"]) | (x["zero"] & inf_y))
    pinf = jnp.any(
        (x["pinf"] & up_y) | (x["ninf"] & down_y) | (x["pos"] & y["pinf"]) | (x["neg"] & y["ninf"])
    )
    ninf = jnp.any(
        (x["pinf"] & down_y) | (x["ninf"] & up_y) | (x["pos"] & y["ninf"]) | (x["neg"] & y["pinf"])
    )
    return _as_products_sum(total, nan | (pinf & ninf), pinf, ninf)


@jax.custom_jvp
def _as_products_sum(
    total: jnp.ndarray, nan: jnp.ndarray, pinf: jnp.ndarray, ninf: jnp.ndarray
) -> jnp.ndarray:
    """``total`` where the products' sum is finite, else the NaN or infinity it is."""
    total = jnp.where(ninf, -jnp.inf, total)
    total = jnp.where(pinf, jnp.inf, total)
    return jnp.where(nan, jnp.nan, total)


@_as_products_sum.defjvp
def _as_products_sum_jvp(primals: tuple, tangents: tuple) -> tuple:
    """The derivative of ``sum(A @ B)`` is linear in ``A`` and ``B`` whatever their values: it is
    the factored sum's own. The selects' derivative would be zero wherever the sum is not finite,
    a zero gradient where jax.jit's is finite (fuzz seed 10014)."""
    return _as_products_sum(*primals), tangents[0]


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
    dtypes=(jnp.floating,),  # the non-finite cases are worked out for real numbers only
    description="sum(A @ B) -> sum(A, 0) . sum(B, 1)",
    needs=[("reduce_sum", "dot_general")],
    check_replacement=False,  # checked by tests/test_rules_builtin.py
)

#: Products read in part: diagonal, trace and sum of a matrix product.
LINALG_RULES = (DIAG, TRACE, SUM)
