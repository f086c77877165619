"""The catalogue of operations random programs are built from.

A program holds one large 2-D value ``s`` of shape ``(R, C)``. Bases create it from the inputs
``x`` (rows, d) and ``y`` (m, d); chain operations map it to another 2-D value (possibly of another
shape); sinks consume it into small outputs. Each entry is a code template, formatted with the
current shape, so a program renders to readable Python.

Templates may use: ``s`` (the large value), ``x``, ``y``, ``v`` (a float matrix with at least
``R`` and ``C`` rows and ``p`` columns), ``labels`` (int32, one per row of ``x``), and the format
fields ``{R}``, ``{C}``, ``{k}`` (a small count for top_k), ``{half}`` (``C // 2``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

Shape = tuple[int, int]


@dataclass(frozen=True)
class OpKind:
    """One kind of operation.

    ``family`` groups kinds in the report, ``template`` is a Python expression (see the module
    docstring), ``shape`` maps the input shape ``(R, C)`` to the output shape (chain operations
    only), ``applies`` says whether the kind can follow a value of shape ``(R, C)``, and for sinks
    ``floats`` says whether the result holds a differentiable float (False for indices only).
    """

    family: str
    name: str
    template: str
    shape: Callable[[int, int], Shape] = lambda r, c: (r, c)
    applies: Callable[[int, int], bool] = lambda r, c: True
    floats: bool = True


def _same(r: int, c: int) -> Shape:
    return (r, c)


#: Pairwise bases: a large (rows, m) value from x (rows, d) and y (m, d).
BASES: tuple[OpKind, ...] = (
    OpKind("base:dot", "dot", "x @ y.T"),
    OpKind("base:dot", "dot_t", "(y @ x.T).T"),
    OpKind("base:einsum", "einsum", "jnp.einsum('id,jd->ij', x, y)"),
    OpKind("base:sqdist", "sqdist", "jnp.sum((x[:, None, :] - y[None, :, :]) ** 2, -1)"),
    OpKind("base:diff", "l1", "jnp.sum(jnp.abs(x[:, None, :] - y[None, :, :]), -1)"),
    OpKind("base:diff", "maxdiff", "jnp.max(jnp.abs(x[:, None, :] - y[None, :, :]), -1)"),
    OpKind("base:diff", "prod_sum", "jnp.sum(x[:, None, :] * y[None, :, :], -1)"),
    OpKind("base:outer", "outer", "jnp.outer(x[:, 0], y[:, 0])"),
    OpKind("base:outer", "bcast_sub", "x[:, :1] - y[:, 0][None, :]"),
)

#: Chain operations: (R, C) -> another 2-D value.
CHAIN: tuple[OpKind, ...] = (
    OpKind("elementwise", "gauss", "jnp.exp(-s / 4)"),
    OpKind("elementwise", "tanh", "jnp.tanh(s)"),
    OpKind("elementwise", "sin", "jnp.sin(s)"),
    OpKind("elementwise", "sin_times", "jnp.sin(s) * s"),
    OpKind("elementwise", "abs", "jnp.abs(s)"),
    OpKind("elementwise", "square", "s * s"),
    OpKind("elementwise", "log1p_abs", "jnp.log1p(jnp.abs(s))"),
    OpKind("elementwise", "sqrt_abs", "jnp.sqrt(jnp.abs(s) + 1)"),
    OpKind("elementwise", "sigmoid", "jax.nn.sigmoid(s)"),
    OpKind("elementwise", "affine", "s * 0.5 + 1.0"),
    OpKind("elementwise", "neg", "-s"),
    OpKind("binary", "add_col", "s + v[:{C}, 0][None, :]"),
    OpKind("binary", "mul_row", "s * v[:{R}, 0][:, None]"),
    OpKind("binary", "maximum", "jnp.maximum(s, s * 0.5)"),
    OpKind("binary", "center", "s - jnp.mean(s)"),
    OpKind("compare_select", "relu", "jnp.where(s > 0, s, 0.0)"),
    OpKind("compare_select", "where_sin", "jnp.where(s < 1.0, s, jnp.sin(s))"),
    OpKind("compare_select", "clip", "jnp.clip(s, -1.0, 1.0)"),
    OpKind("compare_select", "mask_mul", "(s > 0).astype(s.dtype) * s"),
    OpKind("iota", "iota_col", "s + jnp.arange({C}, dtype=s.dtype)[None, :] * 1e-3"),
    OpKind("iota", "iota_mask", "jnp.where(jnp.arange({C})[None, :] % 3 == 0, s, -s)"),
    OpKind("cumsum", "cumsum1", "jnp.cumsum(s, axis=1) / {C}"),
    OpKind("cumsum", "cumsum0", "jnp.cumsum(s, axis=0) / {R}"),
    OpKind("cumsum", "cummax1", "lax.cummax(s, axis=1)"),
    OpKind("slice", "drop_first_col", "s[:, 1:]", lambda r, c: (r, c - 1), lambda r, c: c > 8),
    OpKind("slice", "stride_col", "s[:, ::2]", lambda r, c: (r, (c + 1) // 2), lambda r, c: c > 8),
    OpKind("slice", "half_col", "s[:, :{half}]", lambda r, c: (r, c // 2), lambda r, c: c > 8),
    OpKind("slice", "drop_first_row", "s[1:]", lambda r, c: (r - 1, c), lambda r, c: r > 2),
    OpKind(
        "slice",
        "dynamic_slice",
        "lax.dynamic_slice_in_dim(s, labels[0] % 4, {C} - 4, axis=1)",
        lambda r, c: (r, c - 4),
        lambda r, c: c > 8,
    ),
    OpKind("pad", "pad_col", "jnp.pad(s, ((0, 0), (1, 2)))", lambda r, c: (r, c + 3)),
    OpKind(
        "pad",
        "pad_col_value",
        "jnp.pad(s, ((0, 0), (0, 1)), constant_values=-1.0)",
        lambda r, c: (r, c + 1),
    ),
    OpKind(
        "concatenate",
        "concat_col",
        "jnp.concatenate([s, s * 0.5], axis=1)",
        lambda r, c: (r, 2 * c),
    ),
    OpKind(
        "concatenate",
        "concat_row",
        "jnp.concatenate([s, -s], axis=0)",
        lambda r, c: (2 * r, c),
    ),
    OpKind("rev", "rev_col", "s[:, ::-1]"),
    OpKind("rev", "flip_row", "jnp.flip(s, 0)"),
    OpKind("stack", "stack_max", "jnp.stack([s, s * 2.0]).max(0)"),
    OpKind("stack", "stack_sum", "jnp.stack([s, jnp.sin(s)], -1).sum(-1)"),
    OpKind(
        "reshape",
        "pair_sum",
        "s.reshape({R}, {half}, 2).sum(-1)",
        lambda r, c: (r, c // 2),
        lambda r, c: c % 2 == 0 and c > 8,
    ),
    OpKind("reshape", "flat_roundtrip", "s.reshape(-1).reshape({R}, {C})"),
    OpKind("reshape", "transpose", "s.T", lambda r, c: (c, r)),
)

#: Sinks: (R, C) -> small outputs (an array or a tuple of arrays).
SINKS: tuple[OpKind, ...] = (
    OpKind("reduce", "sum1", "jnp.sum(s, 1)"),
    OpKind("reduce", "sum0", "jnp.sum(s, 0)"),
    OpKind("reduce", "mean1", "jnp.mean(s, 1)"),
    OpKind("reduce", "max1", "jnp.max(s, 1)"),
    OpKind("reduce", "min0", "jnp.min(s, 0)"),
    OpKind("reduce", "sum_all", "jnp.sum(s)"),
    OpKind("argminmax", "argmax1", "jnp.argmax(s, 1)", floats=False),
    OpKind("argminmax", "argmin0", "jnp.argmin(s, 0)", floats=False),
    OpKind("argminmax", "argmax_all", "jnp.argmax(s)", floats=False),
    OpKind("top_k", "top_k1", "lax.top_k(s, {k})", applies=lambda r, c: c >= 8),
    OpKind(
        "top_k", "top_k0_neg", "lax.top_k(-s.T, {k})[1]", applies=lambda r, c: r >= 8, floats=False
    ),
    OpKind("softmax", "softmax_v", "jax.nn.softmax(s, axis=1) @ v[:{C}]"),
    OpKind("softmax", "logsumexp1", "jax.nn.logsumexp(s, axis=1)"),
    OpKind("softmax", "logsumexp0", "jax.nn.logsumexp(s, axis=0)"),
    OpKind("dot", "matvec", "s @ v[:{C}]"),
    OpKind("dot", "vecmat", "v[:{R}, 0] @ s"),
    OpKind("dot", "einsum_v", "jnp.einsum('ij,jk->ik', s, v[:{C}])"),
    OpKind(
        "gather",
        "pick",
        "jnp.take_along_axis("
        "s, (labels[jnp.arange({R}) % labels.shape[0]] % {C})[:, None], 1)[:, 0]",
    ),
    OpKind(
        "gather",
        "cross_entropy",
        "jnp.mean(jax.nn.logsumexp(s, axis=1) - jnp.take_along_axis("
        "s, (labels[jnp.arange({R}) % labels.shape[0]] % {C})[:, None], 1)[:, 0])",
    ),
    OpKind("sort", "sort_last", "jnp.sort(s, axis=1)[:, -1]"),
    OpKind("output", "first_rows", "s[:2]"),
    OpKind("cumsum", "cumsum_last", "jnp.cumsum(s, 1)[:, -1]"),
)

_BY_NAME = {kind.name: kind for kind in (*BASES, *CHAIN, *SINKS)}


def kind(name: str) -> OpKind:
    """The catalogue entry called ``name``."""
    return _BY_NAME[name]


def family_of(name: str) -> str:
    """The report family of the catalogue entry called ``name``."""
    return _BY_NAME[name].family
