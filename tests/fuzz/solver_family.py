"""The ``solver`` family of deep programs (``tests/fuzz/deep.py``): iterative solvers in
``lax.while_loop``s, written the way optimal transport, implicit-layer and kernel-method libraries
write them, around a large value built once outside the loop.

One variant per case, by flag:

- ``sinkhorn``: log-domain Sinkhorn between the data cloud (projected by a learnable map) and
  learnable support points with weights ``v["aux"]``; the (rows, support) cost matrix is built
  outside the loop, the loop runs until the row marginal's error is under a tolerance or a maximum
  iteration count is reached; with ``every`` that error is computed only every few iterations, by
  a ``lax.cond`` in the body. The transport cost is a ``jax.custom_vjp`` in the envelope form: the
  forward solves on ``stop_gradient`` inputs, the backward rebuilds the plan from the saved
  potentials and the cost matrix.
- ``cg``: kernel ridge regression, ``(K + noise I) alpha = t`` for a (rows, rows) Gaussian kernel
  of learnable features and length scale, built outside the loop; solved by
  ``jax.scipy.sparse.linalg.cg`` as users call it (differentiated by ``custom_linear_solve``,
  whose backward solves again), or with ``hand`` by a hand-written residual-tolerance
  ``while_loop`` under a ``jax.custom_vjp`` whose backward solves again by a fixed number of
  conjugate-gradient steps.
- ``fixed_point``: a batched equilibrium layer, the rows of a batch iterating
  ``z = tanh(z @ W + h)`` until each row has converged: a per-row ``active`` mask, masked
  (``jnp.where``) updates and the predicate ``jnp.any(active)`` (the form ``jax.vmap`` of a while
  loop takes, written by hand), or with ``vmap_rows`` a per-row loop under ``jax.vmap`` (JAX makes
  it one loop with a batched predicate); under a ``jax.custom_vjp`` whose backward runs a fixed
  number of adjoint iterations.

Every backward pass is differentiable again (fixed-count ``fori_loop``s, ``custom_linear_solve``,
loops run on ``stop_gradient`` inputs only), so second-order wrappers apply. The solvers run in at
least float32 (a bfloat16 model promotes its cost or kernel matrix).

Tolerance crossings. A chunked sum rounds differently from jax.jit's, so a loop may stop at another
iteration than jax.jit's when the tested quantity lies within that rounding of the tolerance. The
accuracy rule (``tests/fuzz/accuracy.py``) holds memsafe to jax.jit's error against float64, the
larger of its own run and the median of four runs on one-ulp-perturbed inputs: jax.jit's float32
rounding moves the crossing against float64 by the same amount, so where a crossing is that close
jax.jit's measured error tends to include a one-iteration difference too, but only in
probability. The variants therefore keep such crossings rare: the global tests (Sinkhorn's
marginal error, CG's residual) contract by a factor of two or more between checks (Sinkhorn with
``eps`` 0.25-0.5 on costs of mean about 2 stops after 6-17 sweeps; the ridge ``0.05 rows`` keeps
the kernel system's condition number near 10) and their tolerances (1e-3, 1e-4) sit orders of
magnitude above float32 rounding of the quantity, so a case crosses at another iteration with a
chance of about the relative rounding over the log of the contraction (below 1e-4). Per-row tests
(the fixed point, tolerance 1e-5 or 1e-6 on ``max |z' - z|``, contraction about 0.5) are crossed at
another iteration by some rows in jax.jit's own run as well, and one iteration off moves a row by
at most about the tolerance.
"""

from __future__ import annotations

import random

import numpy as np

Sizes = dict[str, int]
Arrays = tuple[np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray], np.ndarray]
#: The variants, one of which every case's flags name.
VARIANTS = ("sinkhorn", "cg", "fixed_point")
#: The working dtype of the solvers: at least float32.
WORKING = "jnp.promote_types({}.dtype, jnp.float32)"


def draw(rng: random.Random) -> tuple[Sizes, set[str]]:
    """Sizes and flags of one solver case (jax.jit's footprint about 1-40 MB)."""
    variant = rng.choice(VARIANTS)
    flags = {variant}
    if variant == "sinkhorn":
        sizes = {
            "rows": rng.choice((512, 768, 1024, 1536, 2048)),
            "support": rng.choice((128, 256, 384, 512, 1024)),
            "din": rng.randint(2, 24),
            "dim": rng.randint(2, 8),
            "most": rng.choice((40, 60, 100)),
            "every": rng.choice((2, 3, 5)),
            "tol_exp": rng.choice((3, 4)),
            "eps_pct": rng.choice((25, 50)),
            "classes": 1,
        }
        if rng.random() < 0.5:
            flags.add("every")
    elif variant == "cg":
        sizes = {
            "rows": rng.choice((384, 512, 768, 1024, 1536)),
            "din": rng.randint(2, 24),
            "dim": rng.randint(2, 8),
            "most": rng.choice((30, 50, 80)),
            "adjoint": rng.choice((24, 32)),
            "tol_exp": rng.choice((3, 4)),
            "classes": rng.randint(2, 16),
        }
        if rng.random() < 0.5:
            flags.add("hand")
    else:
        sizes = {
            "rows": rng.choice((256, 512, 1024, 2048, 4096)),
            "din": rng.randint(4, 64),
            "width": rng.choice((64, 128, 256, 384, 512)),
            "most": rng.choice((30, 50)),
            "adjoint": rng.choice((12, 16, 24)),
            "tol_exp": rng.choice((5, 6)),
            "classes": rng.randint(2, 32),
        }
        if rng.random() < 0.5:
            flags.add("vmap_rows")
    return sizes, flags


def body(sizes: Sizes, flags: frozenset[str]) -> list[str]:
    """The lines of ``model`` for the variant among ``flags``."""
    if "sinkhorn" in flags:
        return _sinkhorn(sizes, "every" in flags)
    if "cg" in flags:
        return _kernel_ridge(sizes, "hand" in flags)
    if "fixed_point" in flags:
        return _equilibrium(sizes, "vmap_rows" in flags)
    raise ValueError(f"no solver variant among {sorted(flags)}")


def _sinkhorn(sizes: Sizes, every: bool) -> list[str]:
    """Log-domain Sinkhorn with uniform weights on the data and ``v["aux"]`` on the support
    points; the transport cost's gradient by the envelope theorem."""
    tol, most, k = f"1e-{sizes['tol_exp']}", sizes["most"], sizes["every"]
    if every:
        check = [
            "            err = lax.cond(",
            f"                it % {k} == {k - 1},",
            "                lambda: marginal_error(c, f, g, la, lb),",
            "                lambda: err,",
            "            )",
        ]
    else:
        check = ["            err = marginal_error(c, f, g, la, lb)"]
    return [
        f"    eps = {sizes['eps_pct'] / 100}",
        "",
        "    def log_plan(c, f, g, la, lb):",
        "        return (f[:, None] + g[None, :] - c) / eps + la[:, None] + lb[None, :]",
        "",
        "    def marginal_error(c, f, g, la, lb):",
        "        rows = jnp.exp(jax.nn.logsumexp(log_plan(c, f, g, la, lb), axis=1))",
        "        return jnp.sum(jnp.abs(rows - jnp.exp(la)))",
        "",
        "    def solve(c, la, lb):",
        "        def keep_going(state):",
        "            it, _, _, err = state",
        f"            return (it < {most}) & (err > {tol})",
        "",
        "        def sweep(state):",
        "            it, f, g, err = state",
        "            f = -eps * jax.nn.logsumexp((g[None, :] - c) / eps + lb[None, :], axis=1)",
        "            g = -eps * jax.nn.logsumexp((f[:, None] - c) / eps + la[:, None], axis=0)",
        *check,
        "            return it + 1, f, g, err",
        "",
        "        init = (0, jnp.zeros_like(la), jnp.zeros_like(lb), jnp.asarray(jnp.inf, c.dtype))",
        "        _, f, g, _ = lax.while_loop(keep_going, sweep, init)",
        "        return f, g",
        "",
        "    def dual(c, f, g, la, lb):",
        "        mass = jnp.sum(jnp.exp(log_plan(c, f, g, la, lb)))",
        "        return jnp.dot(f, jnp.exp(la)) + jnp.dot(g, jnp.exp(lb)) - eps * (mass - 1)",
        "",
        "    @jax.custom_vjp",
        "    def transport_cost(c, la, lb):",
        "        return dual(c, *solve(c, la, lb), la, lb)",
        "",
        "    def transport_cost_fwd(c, la, lb):",
        "        f, g = solve(*lax.stop_gradient((c, la, lb)))",
        "        return dual(c, f, g, la, lb), (c, f, g, la, lb)",
        "",
        "    def transport_cost_bwd(res, ct):",
        "        c, f, g, la, lb = res",
        "        plan = jnp.exp(log_plan(c, f, g, la, lb))",
        "        return ct * plan, jnp.zeros_like(la), jnp.zeros_like(lb)",
        "",
        "    transport_cost.defvjp(transport_cost_fwd, transport_cost_bwd)",
        "",
        '    u = (x * scale) @ params["proj"]',
        '    z = params["support"]',
        "    c = jnp.sum(u * u, -1)[:, None] + jnp.sum(z * z, -1)[None, :] - 2 * u @ z.T",
        f"    c = (c / {sizes['dim']}).astype({WORKING.format('c')})",
        "    la = jnp.full(c.shape[0], -jnp.log(c.shape[0]), c.dtype)",
        '    lb = jnp.log(v["aux"].astype(c.dtype))',
        "    lb = lb - jax.nn.logsumexp(lb)",
        "    return transport_cost(c, la, lb) + 0.01 * jnp.mean(z * z)",
    ]


def _kernel_ridge(sizes: Sizes, hand: bool) -> list[str]:
    """Kernel ridge regression on learnable features, ``(K + 0.05 rows I) alpha = t`` (the
    ridge grows with the rows as in the textbook objective, so the system's condition number stays
    about 10 at every size); ``hand``: a hand-written CG."""
    tol, most, adjoint = f"1e-{sizes['tol_exp']}", sizes["most"], sizes["adjoint"]
    if hand:
        solver = [
            "    def conjugate_gradient(k, b):",
            "        bb = jnp.dot(b, b)",
            "",
            "        def keep_going(state):",
            "            it, _, _, _, rr = state",
            f"            return (it < {most}) & (rr > {tol} ** 2 * bb)",
            "",
            "        def step(state):",
            "            it, a, r, p, rr = state",
            "            kp = k @ p",
            "            alpha = rr / jnp.dot(p, kp)",
            "            a, r = a + alpha * p, r - alpha * kp",
            "            new = jnp.dot(r, r)",
            "            return it + 1, a, r, r + new / rr * p, new",
            "",
            "        init = (0, jnp.zeros_like(b), b, b, bb)",
            "        return lax.while_loop(keep_going, step, init)[1]",
            "",
            "    def safe_div(a, b):",
            "        return jnp.where(b > 0, a / jnp.where(b > 0, b, 1), 0)",
            "",
            "    def fixed_cg(k, b):",
            "        def step(_, state):",
            "            a, r, p, rr = state",
            "            kp = k @ p",
            "            alpha = safe_div(rr, jnp.dot(p, kp))",
            "            a, r = a + alpha * p, r - alpha * kp",
            "            new = jnp.dot(r, r)",
            "            return a, r, r + safe_div(new, rr) * p, new",
            "",
            f"        return lax.fori_loop(0, {adjoint}, step, (0 * b, b, b, jnp.dot(b, b)))[0]",
            "",
            "    @jax.custom_vjp",
            "    def kernel_solve(k, b):",
            "        return conjugate_gradient(k, b)",
            "",
            "    def kernel_solve_fwd(k, b):",
            "        a = conjugate_gradient(*lax.stop_gradient((k, b)))",
            "        return a, (k, a)",
            "",
            "    def kernel_solve_bwd(res, ct):",
            "        k, a = res",
            "        u = fixed_cg(k, ct)  # k is symmetric",
            "        return -jnp.outer(u, a), u",
            "",
            "    kernel_solve.defvjp(kernel_solve_fwd, kernel_solve_bwd)",
            "",
        ]
        solve = "    alpha = kernel_solve(k, t)"
    else:
        solver = []
        solve = (
            f"    alpha, _ = jax.scipy.sparse.linalg.cg(lambda a: k @ a, t, tol={tol}, "
            f"maxiter={most})"
        )
    return [
        *solver,
        '    feats = jnp.tanh((x * scale) @ params["proj"])',
        f"    feats = feats.astype({WORKING.format('feats')})",
        "    sq = jnp.sum(feats * feats, axis=-1)",
        "    d2 = jnp.maximum(sq[:, None] + sq[None, :] - 2 * feats @ feats.T, 0)",
        '    gram = jnp.exp(-d2 * jnp.exp(-2 * params["log_scale"]).astype(d2.dtype))',
        "    ridge = 0.05 * feats.shape[0]",
        "    k = gram + ridge * jnp.eye(feats.shape[0], dtype=gram.dtype)",
        '    t = (v["aux"][labels] + jnp.tanh(x @ params["w_t"])).astype(k.dtype)',
        solve,
        "    fit = gram @ alpha",
        "    return jnp.mean((fit - t) ** 2) + ridge * jnp.dot(alpha, gram @ alpha) / t.shape[0]",
    ]


def _equilibrium(sizes: Sizes, vmap_rows: bool) -> list[str]:
    """An equilibrium layer whose rows iterate to their own tolerance, then a classifier: the
    rows in one loop with a per-row ``active`` mask, masked updates and ``jnp.any(active)`` as
    the predicate, or with ``vmap_rows`` a per-row loop under ``jax.vmap`` (which JAX turns into
    one loop with a batched predicate)."""
    tol, most, adjoint = f"1e-{sizes['tol_exp']}", sizes["most"], sizes["adjoint"]
    if vmap_rows:
        loop = [
            "    def iterate_row(w, h):",
            "        def keep_going(state):",
            "            it, _, delta = state",
            f"            return (it < {most}) & (delta > {tol})",
            "",
            "        def step(state):",
            "            it, z, _ = state",
            "            new = cell(w, h, z)",
            "            return it + 1, new, jnp.max(jnp.abs(new - z))",
            "",
            "        init = (0, jnp.zeros_like(h), jnp.asarray(jnp.inf, h.dtype))",
            "        return lax.while_loop(keep_going, step, init)[1]",
            "",
            "    def iterate(w, h):",
            "        return jax.vmap(iterate_row, in_axes=(None, 0))(w, h)",
            "",
        ]
    else:
        loop = [
            "    def iterate(w, h):",
            "        def keep_going(state):",
            "            it, _, active = state",
            f"            return (it < {most}) & jnp.any(active)",
            "",
            "        def step(state):",
            "            it, z, active = state",
            "            new = cell(w, h, z)",
            "            delta = jnp.max(jnp.abs(new - z), axis=-1)",
            "            z = jnp.where(active[:, None], new, z)",
            f"            return it + 1, z, active & (delta > {tol})",
            "",
            "        init = (0, jnp.zeros_like(h), jnp.ones(h.shape[:-1], bool))",
            "        return lax.while_loop(keep_going, step, init)[1]",
            "",
        ]
    return [
        "    def cell(w, h, z):",
        "        return jnp.tanh(z @ w + h)",
        "",
        *loop,
        "    @jax.custom_vjp",
        "    def equilibrium(w, h):",
        "        return iterate(w, h)",
        "",
        "    def equilibrium_fwd(w, h):",
        "        z = iterate(*lax.stop_gradient((w, h)))",
        "        return z, (w, h, z)",
        "",
        "    def equilibrium_bwd(res, ct):",
        "        w, h, z = res",
        "        _, vjp_z = jax.vjp(lambda z: cell(w, h, z), z)",
        f"        u = lax.fori_loop(0, {adjoint}, lambda _, u: ct + vjp_z(u)[0], ct)",
        "        _, vjp_wh = jax.vjp(lambda w, h: cell(w, h, z), w, h)",
        "        return vjp_wh(u)",
        "",
        "    equilibrium.defvjp(equilibrium_fwd, equilibrium_bwd)",
        "",
        '    h = (x * scale) @ params["w_in"] + params["b_in"]',
        f"    h = h.astype({WORKING.format('h')})",
        '    z = equilibrium(params["w"].astype(h.dtype), h)',
        '    logits = z.astype(x.dtype) @ params["w_out"]',
        '    return cross_entropy(logits, labels, v["aux"][labels])',
    ]


def arrays(
    sizes: Sizes, flags: frozenset[str], lead: tuple[int, ...], rng: np.random.Generator
) -> Arrays:
    """The arguments of a solver case: ``x`` (``lead`` + (rows, din)) normal, the parameters
    of its variant, ``v["aux"]`` (support weights, regression offsets or class weights) and
    ``labels`` (class ids, or zeros for Sinkhorn)."""
    rows, din = sizes["rows"], sizes["din"]
    x = rng.standard_normal((*lead, rows, din))
    labels = rng.integers(0, sizes["classes"], (*lead, rows)).astype(np.int32)
    if "sinkhorn" in flags:
        dim, support = sizes["dim"], sizes["support"]
        params = {
            "proj": rng.standard_normal((din, dim)) / np.sqrt(din),
            "support": 0.8 * rng.standard_normal((support, dim)) + 0.2,
        }
        return x, params, {"aux": 0.5 + rng.random(support)}, labels
    if "cg" in flags:
        dim = sizes["dim"]
        params = {
            "proj": rng.standard_normal((din, dim)) / np.sqrt(din),
            "log_scale": np.asarray(0.5 * np.log(dim / 4.0)),
            "w_t": rng.standard_normal(din) / np.sqrt(din),
        }
        return x, params, {"aux": rng.standard_normal(sizes["classes"])}, labels
    width = sizes["width"]
    params = {
        "w_in": rng.standard_normal((din, width)) / np.sqrt(din),
        "b_in": 0.1 * rng.standard_normal(width),
        # spectral norm about 0.5: the iteration contracts, each row converging at its own rate
        "w": 0.25 * rng.standard_normal((width, width)) / np.sqrt(width),
        "w_out": rng.standard_normal((width, sizes["classes"])) / np.sqrt(width),
    }
    return x, params, {"aux": 0.5 + rng.random(sizes["classes"])}, labels
