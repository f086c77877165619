"""A program evaluated one primitive at a time: JAX's semantics with no fusion across operations.

XLA compiles jax.jit's program as fused kernels, and a value it recomputes inside two fusions can
round differently in each (fuzz seed 1871: the tie count of a max's gradient came out 0 in one
place, and 0/0 gave NaN where the float64 program and every unfused evaluation give a number).
Where memsafe's NaN or infinities differ from jax.jit's, the accuracy check asks this evaluation:
loops are unrolled in Python, calls inlined and branches chosen, so every primitive runs alone.

The sign of a NaN that arithmetic makes is not specified (IEEE 754), and XLA's kernels do not keep
one: LLVM folds a negation into a constant factor (``-(-s * 0.5 + 1)`` of a positive NaN comes out
negative alone and positive fused with its producer, fuzz seed 10468), so the sign depends on which
operations share a kernel. ``top_k`` orders NaNs by that sign (``lax.sort`` makes every NaN
alike). With ``nan_sign`` set, the evaluation gives every NaN that reaches a ``top_k`` that sign
(True: negative): one answer the program may give on some compile of it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from memsafe._jax import Literal, bind_eqn, inner_jaxpr, scan_counts


def evaluate(fun: Any, args: tuple, nan_sign: bool | None = None) -> Any:
    """``fun(*args)`` with every primitive run on its own (see the module docstring); with
    ``nan_sign`` set, every NaN a ``top_k`` orders has that sign bit."""
    closed, tree = jax.make_jaxpr(fun, return_shape=True)(*args)
    flat = jax.tree.leaves(args)
    outs = _run(closed.jaxpr, closed.consts, flat, nan_sign)
    return jax.tree.unflatten(jax.tree.structure(tree), outs)


def _signed_nans(x: Any, negative: bool) -> Any:
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        return x
    nan = jnp.asarray(-jnp.nan if negative else jnp.nan, jnp.result_type(x))
    return jnp.where(jnp.isnan(x), nan, x)


def _run(jaxpr: Any, consts: Any, args: list[Any], nan_sign: bool | None = None) -> list[Any]:
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def read(a: Any) -> Any:
        return a.val if isinstance(a, Literal) else env[a]

    for eqn in jaxpr.eqns:
        env.update(zip(eqn.outvars, _eqn(eqn, [read(a) for a in eqn.invars], nan_sign)))
    return [read(a) for a in jaxpr.outvars]


def _eqn(eqn: Any, invals: list[Any], nan_sign: bool | None) -> list[Any]:
    name = eqn.primitive.name
    if name == "scan":
        return _scan(eqn, invals, nan_sign)
    if name == "while":
        return _while(eqn, invals, nan_sign)
    if name == "cond":
        branches = eqn.params["branches"]
        branch = branches[int(np.clip(int(invals[0]), 0, len(branches) - 1))]
        return _run(branch.jaxpr, branch.consts, invals[1:], nan_sign)
    inner = inner_jaxpr(eqn)
    if inner is not None and name not in ("custom_vjp_call", "custom_vjp_call_jaxpr"):
        return _run(inner.jaxpr, inner.consts, invals, nan_sign)
    if nan_sign is not None and name == "top_k":
        invals = [_signed_nans(invals[0], nan_sign), *invals[1:]]
    return bind_eqn(eqn, invals)


def _scan(eqn: Any, invals: list[Any], nan_sign: bool | None) -> list[Any]:
    p = eqn.params
    consts, carry = scan_counts(p)
    body, length = p["jaxpr"], p["length"]
    c, xs = invals[consts : consts + carry], invals[consts + carry :]
    ys: dict[int, list[Any]] = {}
    for t in reversed(range(length)) if p["reverse"] else range(length):
        outs = _run(body.jaxpr, body.consts, [*invals[:consts], *c, *(x[t] for x in xs)], nan_sign)
        c, ys[t] = outs[:carry], outs[carry:]
    n_ys = len(eqn.outvars) - carry
    stacked = [
        jnp.stack([ys[t][k] for t in range(length)])
        if length
        else jnp.zeros(eqn.outvars[carry + k].aval.shape, eqn.outvars[carry + k].aval.dtype)
        for k in range(n_ys)
    ]
    return [*c, *stacked]


def _while(eqn: Any, invals: list[Any], nan_sign: bool | None) -> list[Any]:
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, c = invals[:cn], invals[cn : cn + bn], invals[cn + bn :]
    cond, body = p["cond_jaxpr"], p["body_jaxpr"]
    while bool(_run(cond.jaxpr, cond.consts, [*cconsts, *c], nan_sign)[0]):
        c = _run(body.jaxpr, body.consts, [*bconsts, *c], nan_sign)
    return c
