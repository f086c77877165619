"""Deep random programs: whole training steps and models rather than pairwise pieces.

A :class:`DeepCase` is drawn from a seed like a pairwise :class:`~tests.fuzz.program.Case` and
renders to Python source defining ``model`` (a scalar loss of a parameter pytree), ``f`` and
``loss`` with the signature ``(x, y, v, labels, scale=1.0)`` of the pairwise programs, so every
wrapper of ``tests/fuzz/wrappers.py`` applies unchanged: ``x`` is the data (batched under vmap
wrappers), ``y`` the parameter pytree (a dict or a list), ``v`` a float pytree (per-class weights,
edge features and, for Adam, the optimizer's moments) and ``labels`` int32 (class ids or edges).

``f`` is either the forward loss or a training step: ``jax.value_and_grad`` of the model and an
SGD or Adam-like update written by hand, returning the loss, the new parameters (and moments).
``loss`` sums ``f``'s outputs, so the gradient wrappers differentiate a training step (second
order) or the model (first order). Families (``tests/fuzz/deep_families.py``): ``mlp``,
``scan_layers``, ``transformer``, ``cnn``, ``graph``, ``multi`` and ``solver``
(``tests/fuzz/solver_family.py``: Sinkhorn, conjugate gradients and a batched fixed point in
``while_loop``s under ``custom_vjp``).

:func:`draw` picks, per seed, a deep or a pairwise case given the share of deep ones.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .deep_families import FAMILIES
from .inputs import Inputs
from .program import BATCHED_WRAPPERS, DTYPES, GRAD_WRAPPERS, Case, _pick, generate
from .program import WRAPPERS as WRAPPER_WEIGHTS
from .program import render as render_pairwise
from .wrappers import WRAPPERS

#: The families a deep seed draws from, so that the seeds of earlier campaigns keep their
#: programs; a family added later (``solver``) runs where a campaign forces it
#: (``--families``, ``tests/fuzz/forced.py``).
DRAWN = ("cnn", "graph", "mlp", "multi", "scan_layers", "transformer")

#: Learning rate of the rendered updates (times ``scale``).
LEARNING_RATE = 0.05

#: Helper functions a family's model may call, rendered before it.
HELPERS: dict[str, list[str]] = {
    "cross_entropy": [
        "def cross_entropy(logits, labels, weights):",
        "    logp = jax.nn.log_softmax(logits, axis=-1)",
        "    picked = jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]",
        "    return -jnp.mean(picked * weights)",
    ],
    "layernorm": [
        "def layernorm(h, gain):",
        "    mu = jnp.mean(h, axis=-1, keepdims=True)",
        "    var = jnp.mean((h - mu) ** 2, axis=-1, keepdims=True)",
        "    return (h - mu) * lax.rsqrt(var + 1e-5) * gain",
    ],
    # the mask is drawn in float32 under every dtype, so the float64 reference drops the same
    "dropout": [
        "def dropout(h, labels, salt):",
        "    key = jax.random.fold_in(jax.random.key({seed}), labels.reshape(-1)[0] + salt)",
        "    keep = jax.random.uniform(key, h.shape, jnp.float32) < 0.8",
        "    return jnp.where(keep, h / 0.8, 0).astype(h.dtype)",
    ],
}


@dataclass(frozen=True)
class DeepCase:
    """One deep program and how to run it: ``family`` (a key of ``FAMILIES``), its ``sizes``
    (name, value) and option ``flags`` (``train``: ``f`` is a training step; ``adam``: its
    update is Adam-like, else SGD; the family's own options), ``batch`` (leading size of ``x`` and
    ``labels`` under a vmap wrapper, 1 otherwise), ``dtype``, ``wrapper`` and ``frac`` as for
    pairwise cases. ``inputs`` is always ``normal``."""

    seed: int
    family: str
    dtype: str
    wrapper: str
    frac: float
    batch: int
    sizes: tuple[tuple[str, int], ...]
    flags: tuple[str, ...]
    inputs: str = "normal"

    @property
    def size(self) -> dict[str, int]:
        """The sizes as a dict."""
        return dict(self.sizes)

    def families(self) -> list[str]:
        """The report rows this case counts toward: ``deep``, its family, wrapper, dtype and each
        flag, all prefixed ``deep:``."""
        rows = {"deep", f"deep:{self.family}", f"deep:wrapper:{self.wrapper}"}
        rows |= {f"deep:dtype:{self.dtype}"} | {f"deep:flag:{flag}" for flag in self.flags}
        return sorted(rows)

    def to_json(self) -> dict[str, Any]:
        """The case as a JSON-ready dict, marked ``deep``."""
        return {"deep": True, **asdict(self)}


def is_deep(seed: int, fraction: float) -> bool:
    """Whether ``seed`` draws a deep case when a share ``fraction`` of seeds are deep (the
    choice is its own draw, so a seed's pairwise case is the same under any fraction)."""
    return fraction > 0 and random.Random(f"deep-or-not-{seed}").random() < fraction


def draw(seed: int, fraction: float = 0.0) -> Case | DeepCase:
    """The case of ``seed``: deep (:func:`generate_deep`) for a share ``fraction`` of seeds,
    else pairwise (``program.generate``)."""
    return generate_deep(seed) if is_deep(seed, fraction) else generate(seed)


def generate_deep(seed: int, **overrides: Any) -> DeepCase:
    """Draw a deep case from ``seed`` (the same seed always gives the same case); keyword
    arguments force fields (``family``, ``wrapper``, ``dtype``, ...) before the dependent choices
    are made."""
    rng = random.Random(f"deep-case-{seed}")
    f: dict[str, Any] = {
        "family": rng.choice(DRAWN),
        "dtype": _pick(rng, DTYPES),
        "wrapper": _pick(rng, WRAPPER_WEIGHTS),
        "frac": round(rng.uniform(0.05, 0.9), 3),
    }
    f.update({k: v for k, v in overrides.items() if k in f})
    f["batch"] = rng.randint(2, 3) if f["wrapper"] in BATCHED_WRAPPERS else 1
    sizes, flags = FAMILIES[f["family"]].draw(rng)
    # under a gradient wrapper a training step is differentiated to second order: drawn less
    if rng.random() < (0.3 if f["wrapper"] in GRAD_WRAPPERS else 0.75):
        flags.add("train")
        if rng.random() < 0.4:
            flags.add("adam")
    case = DeepCase(seed=seed, sizes=tuple(sizes.items()), flags=tuple(sorted(flags)), **f)
    rest = {k: v for k, v in overrides.items() if k not in f}
    return replace(case, **rest) if rest else case


def render(case: DeepCase) -> str:
    """Python source defining the helpers, ``model``, ``f`` and ``loss`` of ``case``."""
    family, flags = FAMILIES[case.family], frozenset(case.flags)
    lines = [
        f"# memsafe deep fuzz case seed={case.seed}: family={case.family} dtype={case.dtype} "
        f"wrapper={case.wrapper} frac={case.frac} batch={case.batch}",
        f"# sizes {dict(case.sizes)}; flags {', '.join(case.flags)}",
        "import jax",
        "import jax.numpy as jnp",
        "from jax import lax",
    ]
    for name in family.helpers:
        if name != "dropout" or "dropout" in flags:
            lines += ["", "", *(line.format(seed=case.seed) for line in HELPERS[name])]
    lines += ["", "", "def model(params, x, v, labels, scale):"]
    lines += family.body(case.size, flags)
    lines += ["", "", "def f(x, y, v, labels, scale=1.0):", *_step_lines(flags)]
    lines += [
        "",
        "",
        "def loss(x, y, v, labels, scale=1.0):",
        "    outs = jax.tree.leaves(f(x, y, v, labels, scale))",
        "    return sum(jnp.sum(o, dtype=jnp.promote_types(o.dtype, jnp.float32)) for o in outs)",
    ]
    return "\n".join(lines) + "\n"


def _step_lines(flags: frozenset[str]) -> list[str]:
    """The body of ``f``: the forward loss, or a training step (SGD or Adam-like)."""
    if "train" not in flags:
        return ["    return (model(y, x, v, labels, scale),)"]
    lr = f"{LEARNING_RATE} * scale"
    lines = ["    value, grads = jax.value_and_grad(model)(y, x, v, labels, scale)"]
    if "adam" not in flags:
        return [*lines, f"    return value, jax.tree.map(lambda p, g: p - {lr} * g, y, grads)"]
    return [
        *lines,
        '    m = jax.tree.map(lambda a, g: 0.9 * a + 0.1 * g, v["m"], grads)',
        '    u = jax.tree.map(lambda a, g: 0.99 * a + 0.01 * g * g, v["u"], grads)',
        f"    new = jax.tree.map(lambda p, a, b: p - {lr} * a / (jnp.sqrt(b) + 1e-3), y, m, u)",
        "    return value, new, m, u",
    ]


def build(case: DeepCase) -> dict[str, Any]:
    """Execute the rendered source; returns its namespace (``model``, ``f``, ``loss``)."""
    namespace: dict[str, Any] = {"jax": jax, "jnp": jnp, "lax": lax}
    exec(compile(render(case), f"<deep fuzz case {case.seed}>", "exec"), namespace)
    return namespace


def make_inputs(case: DeepCase) -> Inputs:
    """The arguments ``(x, params, v, labels)`` of ``case`` in its dtype, drawn from its seed;
    with the ``adam`` flag ``v`` also holds moments ``m`` (normal) and ``u`` (positive) shaped
    like the parameters."""
    rng = np.random.default_rng(case.seed)
    lead = (case.batch,) if case.wrapper in BATCHED_WRAPPERS else ()
    x, params, v, labels = FAMILIES[case.family].arrays(case.size, frozenset(case.flags), lead, rng)
    if "adam" in case.flags:
        v = {
            **v,
            "m": jax.tree.map(lambda p: 0.01 * rng.standard_normal(p.shape), params),
            "u": jax.tree.map(lambda p: 1e-4 * (0.5 + rng.random(p.shape)), params),
        }
    dtype = jnp.dtype(case.dtype)

    def cast(tree: Any) -> Any:
        return jax.tree.map(lambda a: jnp.asarray(a, dtype), tree)

    return Inputs(args=(cast(x), cast(params), cast(v), jnp.asarray(labels)), note="")


def source(case: Case | DeepCase) -> str:
    """The rendered program of a pairwise or deep case."""
    return render(case) if isinstance(case, DeepCase) else render_pairwise(case)


def valid(case: DeepCase) -> bool:
    """Whether ``case`` renders, makes its arguments and traces under its wrapper's reference
    (a simplification of a failing case may not: a dropped mask, heads that no longer divide)."""
    try:
        with jax.enable_x64(case.dtype == "float64"):
            jax.eval_shape(WRAPPERS[case.wrapper].ref(build(case)), *make_inputs(case).args)
    except Exception:
        return False
    return True


def candidates(case: DeepCase) -> list[dict[str, Any]]:
    """Single simplifications of ``case`` for the minimizer: the plain wrapper, float32, each
    flag dropped, each size halved."""
    out: list[dict[str, Any]] = [{"wrapper": "plain", "batch": 1}, {"dtype": "float32"}]
    out += [{"flags": tuple(f for f in case.flags if f != flag)} for flag in case.flags]
    for i, (name, value) in enumerate(case.sizes):
        if value > 1:
            sizes = (*case.sizes[:i], (name, value // 2), *case.sizes[i + 1 :])
            out.append({"sizes": sizes})
    return out
