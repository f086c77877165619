"""Random programs as data: a :class:`Case` is drawn from a seed and rendered to Python source.

A case is a pairwise base that makes a large value ``s`` from ``x`` and ``y``, a chain of
operations on ``s``, one or two sinks that reduce it to small outputs, optionally a control-flow
construct around that piece, a wrapper (how memsafe is applied: plain, gradients inside or outside,
vmap, jit, static or keyword arguments), a dtype, an input kind (normal, ties, NaN, inf) and the
position of the memory limit between arguments+outputs and jax.jit's footprint.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from . import ops

#: Control-flow constructs placed around the piece, and how often each is drawn.
CONTROLS: dict[str, float] = {"none": 0.6, "fori": 0.1, "scan": 0.1, "map": 0.1, "cond": 0.1}
#: How memsafe is applied, and how often each is drawn (see ``tests/fuzz/wrappers.py``).
WRAPPERS: dict[str, float] = {
    "plain": 0.35,
    "grad_inside": 0.1,
    "grad_outside": 0.1,
    "vmap_outside": 0.06,
    "vmap_inside": 0.06,
    "jit_outside": 0.06,
    "jit_inside": 0.06,
    "static_argnums": 0.07,
    "static_argnames": 0.07,
    "kwargs": 0.07,
}
GRAD_WRAPPERS = ("grad_inside", "grad_outside")
BATCHED_WRAPPERS = ("vmap_outside", "vmap_inside")
STATIC_WRAPPERS = ("static_argnums", "static_argnames")
DTYPES: dict[str, float] = {"float32": 0.7, "bfloat16": 0.15, "float64": 0.15}
INPUTS: dict[str, float] = {"normal": 0.6, "ties": 0.15, "nan": 0.125, "inf": 0.125}


@dataclass(frozen=True)
class Case:
    """One random program and how to run it.

    ``n``, ``m``, ``d``: rows of ``x``, rows of ``y``, their shared width; ``p``: columns of ``v``;
    ``batch``: leading size of ``x`` and ``labels`` under a vmap wrapper (1 otherwise); ``k``: the
    count of top_k sinks; ``splits``: loop count of scan/map controls (divides ``n``); ``frac``:
    where the limit lies, 0 at arguments+outputs and 1 at jax.jit's footprint.
    """

    seed: int
    n: int
    m: int
    d: int
    p: int
    batch: int
    k: int
    splits: int
    dtype: str
    inputs: str
    base: str
    chain: tuple[str, ...]
    sinks: tuple[str, ...]
    control: str
    wrapper: str
    frac: float

    def families(self) -> list[str]:
        """The report families this case counts toward (one per distinct op family, control,
        wrapper, dtype and input kind)."""
        names = [self.base, *self.chain, *self.sinks]
        fams = {ops.family_of(name) for name in names}
        fams |= {f"sink:{ops.family_of(name)}" for name in self.sinks}
        fams |= {
            f"control:{self.control}",
            f"wrapper:{self.wrapper}",
            f"dtype:{self.dtype}",
            f"inputs:{self.inputs}",
        }
        return sorted(fams)

    def to_json(self) -> dict[str, Any]:
        """The case as a JSON-ready dict (``Case(**d)`` with tuples restored rebuilds it)."""
        return asdict(self)


def _pick(rng: random.Random, weights: dict[str, float]) -> str:
    names = list(weights)
    return rng.choices(names, weights=[weights[n] for n in names])[0]


def piece_rows(case_n: int, control: str, splits: int) -> int:
    """Rows of ``x`` the piece sees (scan and lax.map run it on blocks of rows)."""
    return case_n // splits if control in ("scan", "map") else case_n


def generate(seed: int, **overrides: Any) -> Case:
    """Draw a case from ``seed`` (the same seed always gives the same case); keyword arguments
    force fields (for example ``wrapper="plain"``) before the dependent choices are made."""
    rng = random.Random(seed)
    f: dict[str, Any] = {}
    f["splits"] = rng.choice((2, 4))
    f["n"] = 4 * rng.randint(4, 16)
    f["m"] = rng.randint(64, 1200)
    f["d"] = rng.randint(1, 6)
    f["p"] = rng.randint(1, 3)
    f["k"] = rng.randint(1, 5)
    f["dtype"] = _pick(rng, DTYPES)
    f["inputs"] = _pick(rng, INPUTS)
    f["control"] = _pick(rng, CONTROLS)
    f["wrapper"] = _pick(rng, WRAPPERS)
    f["frac"] = round(rng.uniform(0.05, 0.9), 3)
    f["base"] = rng.choice(ops.BASES).name
    f.update({k: v for k, v in overrides.items() if k not in ("chain", "sinks")})
    f["batch"] = rng.randint(2, 3) if f["wrapper"] in BATCHED_WRAPPERS else 1

    rows, cols = piece_rows(f["n"], f["control"], f["splits"]), f["m"]
    chain: list[str] = []
    concatenated = False
    for _ in range(rng.choice((0, 1, 1, 2, 2, 3))):
        options = [
            c
            for c in ops.CHAIN
            if c.applies(rows, cols) and not (concatenated and c.family == "concatenate")
        ]
        choice = rng.choice(options)
        concatenated |= choice.family == "concatenate"
        chain.append(choice.name)
        rows, cols = choice.shape(rows, cols)
    f["chain"] = tuple(overrides.get("chain", chain))
    rows, cols = _final_shape(
        f["base"], f["chain"], piece_rows(f["n"], f["control"], f["splits"]), f["m"]
    )

    need_float = f["wrapper"] in GRAD_WRAPPERS
    sinks: list[str] = []
    for _ in range(rng.choice((1, 1, 2))):
        options = [s for s in ops.SINKS if s.applies(rows, cols) and s.name not in sinks]
        sinks.append(rng.choice(options).name)
    if need_float and not any(ops.kind(s).floats for s in sinks):
        sinks.append(rng.choice([s for s in ops.SINKS if s.floats and s.applies(rows, cols)]).name)
    f["sinks"] = tuple(overrides.get("sinks", sinks))
    return Case(seed=seed, **f)


def _final_shape(base: str, chain: tuple[str, ...], rows: int, cols: int) -> tuple[int, int]:
    for name in chain:
        rows, cols = ops.kind(name).shape(rows, cols)
    return rows, cols


def v_rows(case: Case) -> int:
    """Rows of ``v``: enough for every shape the large value takes."""
    rows, cols = piece_rows(case.n, case.control, case.splits), case.m
    most = max(rows, cols)
    for name in case.chain:
        rows, cols = ops.kind(name).shape(rows, cols)
        most = max(most, rows, cols)
    return most


def render(case: Case) -> str:
    """Python source defining ``piece``, ``f`` (the program) and ``loss`` (the sum of its float
    outputs, for gradient wrappers), followed by comments saying how it is run."""
    rows, cols = piece_rows(case.n, case.control, case.splits), case.m
    body = [f"    s = {ops.kind(case.base).template}"]
    if case.wrapper in STATIC_WRAPPERS:
        body.append("    s = s * scale")
    for name in case.chain:
        op = ops.kind(name)
        body.append(f"    s = {_fill(op.template, rows, cols, case.k)}  # {op.family}")
        rows, cols = op.shape(rows, cols)
    outs = [_fill(ops.kind(s).template, rows, cols, case.k) for s in case.sinks]
    body.append(f"    return ({', '.join(outs)},)")
    lines = [
        f"# memsafe fuzz case seed={case.seed}: dtype={case.dtype} inputs={case.inputs} "
        f"control={case.control} wrapper={case.wrapper} frac={case.frac}",
        "import jax",
        "import jax.numpy as jnp",
        "from jax import lax",
        "",
        "",
        "def piece(x, y, v, labels, scale=1.0):",
        *body,
        "",
        "",
        "def f(x, y, v, labels, scale=1.0):",
        *_control_lines(case),
        "",
        "",
        "def loss(x, y, v, labels, scale=1.0):",
        "    outs = jax.tree.leaves(f(x, y, v, labels, scale))",
        "    floats = [o for o in outs if jnp.issubdtype(o.dtype, jnp.inexact)]",
        "    return sum(jnp.sum(o, dtype=jnp.promote_types(o.dtype, jnp.float32)) for o in floats)",
    ]
    return "\n".join(lines) + "\n"


def _fill(template: str, rows: int, cols: int, k: int) -> str:
    return template.format(R=rows, C=cols, k=min(k, cols, rows), half=cols // 2)


def _control_lines(case: Case) -> list[str]:
    call = "piece({x}, y, v, {labels}, scale)"
    if case.control == "none":
        return [f"    return {call.format(x='x', labels='labels')}"]
    if case.control == "fori":
        return [
            "    def body(i, acc):",
            f"        out = {call.format(x='x * (1 + i).astype(x.dtype)', labels='labels')}",
            "        return jax.tree.map(lambda a, b: a + b, acc, out)",
            "",
            f"    return lax.fori_loop(1, 3, body, {call.format(x='x', labels='labels')})",
        ]
    blocks = f"(x.reshape({case.splits}, -1, x.shape[-1]), labels.reshape({case.splits}, -1))"
    if case.control == "scan":
        return [
            "    def body(c, a):",
            f"        return c + jnp.sum(a[0]), {call.format(x='a[0]', labels='a[1]')}",
            "",
            f"    return lax.scan(body, jnp.zeros((), x.dtype), {blocks})",
        ]
    if case.control == "map":
        return [f"    return lax.map(lambda a: {call.format(x='a[0]', labels='a[1]')}, {blocks})"]
    if case.control == "cond":
        return [
            "    return lax.cond(",
            "        jnp.sum(x) > 0,",
            f"        lambda: {call.format(x='x', labels='labels')},",
            f"        lambda: {call.format(x='x * 0.5', labels='labels')},",
            "    )",
        ]
    raise ValueError(f"unknown control {case.control!r}")


def build(case: Case) -> dict[str, Any]:
    """Execute the rendered source; returns its namespace (``f``, ``loss``, ``piece``)."""
    namespace: dict[str, Any] = {"jax": jax, "jnp": jnp, "lax": lax}
    exec(compile(render(case), f"<fuzz case {case.seed}>", "exec"), namespace)
    return namespace
