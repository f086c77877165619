"""The families of deep programs (``tests/fuzz/deep.py``): how each draws its sizes and options,
renders its model and makes its arguments.

Every family renders the body of ``model(params, x, v, labels, scale)``, a scalar loss of the
parameter pytree ``params`` on the data ``x`` (batched under a vmap wrapper), the float pytree
``v`` (per-class weights, edge features; never batched) and the int32 ``labels`` (batched with
``x``). Bodies are written without literal batch sizes, so the same source runs per example under
``jax.vmap``. Sizes are drawn so that jax.jit's footprint of a case is about 1-40 MB.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import solver_family

Sizes = dict[str, int]
Tree = Any
#: Arrays of a case before the cast to its dtype: x, params, v, labels.
Arrays = tuple[np.ndarray, Tree, dict[str, np.ndarray], np.ndarray]
#: Activations a family may draw, as flags, and the expression each renders to.
ACTIVATIONS: dict[str, str] = {
    "relu": "jax.nn.relu",
    "gelu": "jax.nn.gelu",
    "tanh": "jnp.tanh",
    "silu": "jax.nn.silu",
}


@dataclass(frozen=True)
class Family:
    """One family: ``draw(rng)`` gives its sizes and option flags; ``body(sizes, flags)`` the
    lines of ``model`` and ``helpers`` the shared helpers it calls (``tests/fuzz/deep.py``);
    ``arrays(sizes, flags, lead, rng)`` its arguments, with ``lead`` prefixed to ``x`` and
    ``labels`` (the vmap batch)."""

    draw: Callable[[random.Random], tuple[Sizes, set[str]]]
    body: Callable[[Sizes, frozenset[str]], list[str]]
    arrays: Callable[[Sizes, frozenset[str], tuple[int, ...], np.random.Generator], Arrays]
    helpers: tuple[str, ...] = ("cross_entropy",)


def act_of(flags: frozenset[str]) -> str:
    """The activation expression among ``flags`` (tanh when none is drawn)."""
    return next((ACTIVATIONS[a] for a in ACTIVATIONS if a in flags), "jnp.tanh")


def _dense(rng: np.random.Generator, *shape: int, gain: float = 1.0) -> np.ndarray:
    """A weight of ``shape`` scaled by the square root of its fan-in (the second-to-last axis)."""
    fan_in = shape[-2] if len(shape) > 1 else shape[-1]
    return rng.standard_normal(shape) * gain / np.sqrt(fan_in)


def _class_weights(rng: np.random.Generator, classes: int) -> dict[str, np.ndarray]:
    """``v`` of a classifier: positive per-class loss weights."""
    return {"aux": 0.5 + rng.random(classes)}


def _labels(rng: np.random.Generator, high: int, shape: tuple[int, ...]) -> np.ndarray:
    return rng.integers(0, high, shape).astype(np.int32)


# --- mlp: a dense network whose parameters are a dict or a list of layer dicts ---------------


def _mlp_draw(rng: random.Random) -> tuple[Sizes, set[str]]:
    depth = rng.randint(1, 3)
    sizes = {"rows": rng.choice((256, 512, 1024, 2048)), "din": rng.randint(8, 96)}
    sizes |= {f"h{i}": rng.choice((64, 128, 256, 384, 512)) for i in range(depth)}
    sizes |= {"depth": depth, "classes": rng.randint(4, 48)}
    flags = {rng.choice(tuple(ACTIVATIONS)), rng.choice(("dict", "list"))}
    if rng.random() < 0.5:
        flags.add("dropout")
    return sizes, flags


def _mlp_body(sizes: Sizes, flags: frozenset[str]) -> list[str]:
    act, drop = act_of(flags), "dropout" in flags
    lines = ["    h = x * scale"]
    if "list" in flags:
        lines += [
            "    *hidden, last = params",
            "    for i, layer in enumerate(hidden):",
            f'        h = {act}(h @ layer["w"] + layer["b"])',
            *(["        h = dropout(h, labels, i)"] if drop else []),
            '    logits = h @ last["w"] + last["b"]',
        ]
    else:
        depth = sizes["depth"]
        lines += [
            f"    for i in range({depth}):",
            f'        h = {act}(h @ params[f"w{{i}}"] + params[f"b{{i}}"])',
            *(["        h = dropout(h, labels, i)"] if drop else []),
            f'    logits = h @ params["w{depth}"] + params["b{depth}"]',
        ]
    return [*lines, '    return cross_entropy(logits, labels, v["aux"][labels])']


def _mlp_arrays(
    sizes: Sizes, flags: frozenset[str], lead: tuple[int, ...], rng: np.random.Generator
) -> Arrays:
    depth = sizes["depth"]
    widths = [sizes["din"], *(sizes[f"h{i}"] for i in range(depth)), sizes["classes"]]
    layers = [
        {"w": _dense(rng, a, b), "b": 0.1 * rng.standard_normal(b)}
        for a, b in itertools.pairwise(widths)
    ]
    params: Tree = layers
    if "dict" in flags:
        params = {f"{k}{i}": layer[k] for i, layer in enumerate(layers) for k in ("w", "b")}
    x = rng.standard_normal((*lead, sizes["rows"], sizes["din"]))
    labels = _labels(rng, sizes["classes"], (*lead, sizes["rows"]))
    return x, params, _class_weights(rng, sizes["classes"]), labels


# --- scan_layers: a stack of equal layers as lax.scan or a Python loop, ragged ends ----------


def _stack_draw(rng: random.Random) -> tuple[Sizes, set[str]]:
    sizes = {
        "rows": rng.choice((256, 512, 1024, 2048)),
        "din": rng.randint(8, 96),
        "width": rng.choice((64, 128, 256, 384)),
        "layers": rng.randint(2, 6),
        "classes": rng.randint(4, 48),
    }
    flags = {rng.choice(tuple(ACTIVATIONS)), rng.choice(("scan", "loop"))}
    flags |= {name for name in ("residual", "remat") if rng.random() < 0.4}
    return sizes, flags


def _stack_body(sizes: Sizes, flags: frozenset[str]) -> list[str]:
    act = act_of(flags)
    step = f"h + {act}(h @ w + b)" if "residual" in flags else f"{act}(h @ w + b)"
    lines = [
        f'    h = {act}(x * scale @ params["w_in"] + params["b_in"])',
        "",
        "    def layer(h, w, b):",
        f"        return {step}",
        "",
    ]
    if "remat" in flags:
        lines.append("    layer = jax.checkpoint(layer)")
    if "scan" in flags:
        lines += [
            "    def body(h, wb):",
            "        return layer(h, *wb), None",
            "",
            '    h, _ = lax.scan(body, h, (params["ws"], params["bs"]))',
        ]
    else:
        lines += [
            f"    for i in range({sizes['layers']}):",
            '        h = layer(h, params["ws"][i], params["bs"][i])',
        ]
    return [
        *lines,
        '    logits = h @ params["w_out"]',
        '    return cross_entropy(logits, labels, v["aux"][labels])',
    ]


def _stack_arrays(
    sizes: Sizes, flags: frozenset[str], lead: tuple[int, ...], rng: np.random.Generator
) -> Arrays:
    width, layers, classes = sizes["width"], sizes["layers"], sizes["classes"]
    gain = 0.5 if "residual" in flags else 1.0
    params = {
        "w_in": _dense(rng, sizes["din"], width),
        "b_in": 0.1 * rng.standard_normal(width),
        "ws": _dense(rng, layers, width, width, gain=gain),
        "bs": 0.1 * rng.standard_normal((layers, width)),
        "w_out": _dense(rng, width, classes),
    }
    x = rng.standard_normal((*lead, sizes["rows"], sizes["din"]))
    labels = _labels(rng, classes, (*lead, sizes["rows"]))
    return x, params, _class_weights(rng, classes), labels


# --- transformer: attention blocks with causal or padding masks, layernorm, MLP --------------


def _transformer_draw(rng: random.Random) -> tuple[Sizes, set[str]]:
    heads = rng.choice((1, 2, 4))
    sizes = {
        "seqs": rng.randint(1, 3),
        "length": rng.choice((64, 128, 192, 256)),
        "model": heads * rng.choice((8, 16, 32)),
        "heads": heads,
        "blocks": rng.randint(1, 2),
        "vocab": rng.randint(8, 64),
    }
    masks = rng.choice((("causal",), ("padding",), ("causal", "padding")))
    flags = set(masks)
    if rng.random() < 0.3:
        flags.add("dropout")
    return sizes, flags


def _transformer_body(sizes: Sizes, flags: frozenset[str]) -> list[str]:
    heads, model = sizes["heads"], sizes["model"]
    length = sizes["length"]
    mask = []
    if "causal" in flags:
        mask.append(f"jnp.tril(jnp.ones(({length}, {length}), bool))[None, None]")
    if "padding" in flags:
        mask.append("keep[:, None, None, :]")
    lines = [
        "    keep = (labels % 5 != 0) | (jnp.arange(labels.shape[-1]) == 0)",
        f"    mask = {' & '.join(mask)}",
        "    h = x * scale",
        '    for i, blk in enumerate(params["blocks"]):',
        '        a = layernorm(h, blk["ln1"])',
        '        q, k, w = jnp.split(a @ blk["wqkv"], 3, axis=-1)',
        f"        q, k, w = (t.reshape(t.shape[:-1] + ({heads}, {model // heads})) "
        "for t in (q, k, w))",
        f'        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / {np.sqrt(model // heads):.4f}',
        "        p = jax.nn.softmax(jnp.where(mask, s, -1e9), axis=-1)",
    ]
    if "dropout" in flags:
        lines.append("        p = dropout(p, labels, i)")
    return [
        *lines,
        '        o = jnp.einsum("bhqk,bkhd->bqhd", p, w).reshape(h.shape)',
        '        h = h + o @ blk["wo"]',
        '        h = h + jax.nn.gelu(layernorm(h, blk["ln2"]) @ blk["w1"]) @ blk["w2"]',
        '    logits = layernorm(h, params["ln_f"]) @ params["out"]',
        "    return cross_entropy(logits, labels, keep.astype(h.dtype))",
    ]


def _transformer_arrays(
    sizes: Sizes, flags: frozenset[str], lead: tuple[int, ...], rng: np.random.Generator
) -> Arrays:
    d = sizes["model"]

    def block() -> dict[str, np.ndarray]:
        return {
            "ln1": 1 + 0.1 * rng.standard_normal(d),
            "wqkv": _dense(rng, d, 3 * d),
            "wo": _dense(rng, d, d, gain=0.5),
            "ln2": 1 + 0.1 * rng.standard_normal(d),
            "w1": _dense(rng, d, 2 * d),
            "w2": _dense(rng, 2 * d, d, gain=0.5),
        }

    params = {
        "blocks": [block() for _ in range(sizes["blocks"])],
        "ln_f": 1 + 0.1 * rng.standard_normal(d),
        "out": _dense(rng, d, sizes["vocab"]),
    }
    shape = (*lead, sizes["seqs"], sizes["length"])
    x = rng.standard_normal((*shape, d))
    return x, params, {"aux": rng.random(1)}, _labels(rng, sizes["vocab"], shape)


# --- cnn: strided convolutions, max or average pooling, a dense head -------------------------


def _cnn_draw(rng: random.Random) -> tuple[Sizes, set[str]]:
    layers = rng.randint(2, 3)
    sizes = {
        "images": rng.randint(4, 16),
        "side": rng.choice((24, 32, 48, 64)),
        "cin": rng.randint(1, 4),
        "layers": layers,
        "kernel": rng.choice((3, 5)),
        "window": rng.choice((2, 3)),
        "pool_at": rng.randrange(layers),
        "classes": rng.randint(4, 16),
    }
    sizes |= {f"c{i}": rng.choice((8, 16, 24, 32)) for i in range(layers)}
    sizes |= {f"stride{i}": rng.choice((1, 1, 2)) for i in range(layers)}
    flags = {rng.choice(("maxpool", "avgpool")), rng.choice(("same", "valid"))}
    return sizes, flags


def _cnn_body(sizes: Sizes, flags: frozenset[str]) -> list[str]:
    layers, window = sizes["layers"], sizes["window"]
    strides = tuple(sizes[f"stride{i}"] for i in range(layers))
    dims = f"(1, {window}, {window}, 1)"
    if "maxpool" in flags:
        pool = f"lax.reduce_window(h, -jnp.inf, lax.max, {dims}, "
        pool += '(1, 2, 2, 1), "VALID")'
    else:
        pool = f"lax.reduce_window(h, 0.0, lax.add, {dims}, "
        pool += f'(1, 2, 2, 1), "SAME") / {window * window}'
    padding = '"SAME"' if "same" in flags else '"VALID"'
    return [
        "    h = x * scale",
        f"    for i, stride in enumerate({strides}):",
        "        h = lax.conv_general_dilated(",
        f'            h, params[f"k{{i}}"], (stride, stride), {padding},',
        '            dimension_numbers=("NHWC", "HWIO", "NHWC"),',
        "        )",
        '        h = jax.nn.relu(h + params[f"b{i}"])',
        f"        if i == {sizes['pool_at']}:",
        f"            h = {pool}",
        "    h = jnp.mean(h, axis=(1, 2))",
        '    logits = h @ params["head"]',
        '    return cross_entropy(logits, labels, v["aux"][labels])',
    ]


def _cnn_arrays(
    sizes: Sizes, flags: frozenset[str], lead: tuple[int, ...], rng: np.random.Generator
) -> Arrays:
    k, chans = sizes["kernel"], [sizes["cin"]] + [sizes[f"c{i}"] for i in range(sizes["layers"])]
    params: dict[str, np.ndarray] = {}
    for i, (a, b) in enumerate(itertools.pairwise(chans)):
        params[f"k{i}"] = rng.standard_normal((k, k, a, b)) / np.sqrt(k * k * a)
        params[f"b{i}"] = 0.1 * rng.standard_normal(b)
    params["head"] = _dense(rng, chans[-1], sizes["classes"])
    side = sizes["side"]
    x = rng.standard_normal((*lead, sizes["images"], side, side, sizes["cin"]))
    labels = _labels(rng, sizes["classes"], (*lead, sizes["images"]))
    return x, params, _class_weights(rng, sizes["classes"]), labels


# --- graph: message passing with segment reductions over (partly invalid) receivers ----------


def _graph_draw(rng: random.Random) -> tuple[Sizes, set[str]]:
    nodes = rng.randint(100, 2000)
    sizes = {
        "nodes": nodes,
        "edges": rng.randint(1000, 30000),
        "features": rng.choice((8, 16, 32)),
        "edge_features": rng.randint(2, 8),
        "hidden": rng.choice((16, 32, 64)),
        "rounds": rng.randint(1, 3),
        "receiving": rng.randint(nodes // 2, nodes),
        "classes": rng.randint(2, 8),
    }
    flags = {name for name in ("segment_max", "segment_min", "sorted") if rng.random() < 0.5}
    return sizes, flags


def _graph_aggregates(flags: frozenset[str]) -> list[str]:
    """The segment reductions per round: a sum and optionally a max and a min, whose empty
    segments (±inf) read as 0."""
    sort = ", indices_are_sorted=True" if "sorted" in flags else ""
    lines = [f"        aggs = [jax.ops.segment_sum(m, rcv, n{sort})]"]
    for op in ("segment_max", "segment_min"):
        if op in flags:
            lines += [
                f"        a = jax.ops.{op}(m, rcv, n{sort})",
                "        aggs.append(jnp.where(jnp.isfinite(a), a, 0))",
            ]
    return lines


def _graph_body(sizes: Sizes, flags: frozenset[str]) -> list[str]:
    return [
        "    h, n = x * scale, x.shape[0]",
        "    snd, rcv = labels[:, 0], labels[:, 1]",
        '    for rnd in params["rounds"]:',
        '        hs = jnp.take(h, snd, axis=0, mode="clip")',
        '        hr = jnp.take(h, rcv, axis=0, mode="clip")',
        '        m = jnp.concatenate([hs, hr, v["edges"]], axis=-1) @ rnd["w_msg"]',
        '        m = jnp.tanh(m + rnd["b_msg"])',
        *_graph_aggregates(flags),
        '        h = h + jnp.tanh(jnp.concatenate([h, *aggs], axis=-1) @ rnd["w_upd"])',
        '    logits = h @ params["out"]',
        "    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - logits[:, 0])",
    ]


def _graph_edges(sizes: Sizes, flags: frozenset[str], rng: np.random.Generator) -> np.ndarray:
    """(edges, 2) senders and receivers: receivers only among the first ``receiving`` nodes (the
    others are empty segments), about 2% of them out of range (-1 or past the last node)."""
    edges, nodes = sizes["edges"], sizes["nodes"]
    snd = rng.integers(0, nodes, edges)
    rcv = rng.integers(0, sizes["receiving"], edges)
    bad = rng.random(edges) < 0.02
    rcv[bad] = rng.choice(np.array([-1, nodes, nodes + 3]), int(bad.sum()))
    if "sorted" in flags:
        order = np.argsort(rcv, kind="stable")
        snd, rcv = snd[order], rcv[order]
    return np.stack([snd, rcv], axis=1).astype(np.int32)


def _graph_arrays(
    sizes: Sizes, flags: frozenset[str], lead: tuple[int, ...], rng: np.random.Generator
) -> Arrays:
    f, hid = sizes["features"], sizes["hidden"]
    aggs = 1 + sum(op in flags for op in ("segment_max", "segment_min"))
    rounds = [
        {
            "w_msg": _dense(rng, 2 * f + sizes["edge_features"], hid),
            "b_msg": 0.1 * rng.standard_normal(hid),
            "w_upd": _dense(rng, f + aggs * hid, f, gain=0.5),
        }
        for _ in range(sizes["rounds"])
    ]
    params = {"rounds": rounds, "out": _dense(rng, f, sizes["classes"])}
    x = rng.standard_normal((*lead, sizes["nodes"], f))
    edges = np.stack([_graph_edges(sizes, flags, rng) for _ in range(int(np.prod(lead)))])
    labels = edges.reshape(*lead, sizes["edges"], 2)
    v = {"edges": rng.standard_normal((sizes["edges"], sizes["edge_features"]))}
    return x, params, v, labels


# --- multi: two or three (rows, rows) values alive at once, all used by the loss -------------


def _multi_draw(rng: random.Random) -> tuple[Sizes, set[str]]:
    sizes = {
        "rows": rng.randint(300, 1500),
        "din": rng.randint(4, 48),
        "inner": rng.choice((8, 16, 32)),
        "values": rng.randint(2, 3),
        "out": rng.randint(1, 8),
    }
    return sizes, {rng.choice(("softmax_mix", "where_mix"))}


def _multi_body(sizes: Sizes, flags: frozenset[str]) -> list[str]:
    mix = "jax.nn.softmax(a, axis=-1) * jax.nn.sigmoid(b)"
    if "where_mix" in flags:
        mix = "jnp.where(a > b, jnp.exp(b - jnp.max(b, axis=-1, keepdims=True)), a * 0.01)"
    lines = [
        "    h = x * scale",
        '    q, k, r = h @ params["wq"], h @ params["wk"], h @ params["wr"]',
        f"    a = q @ k.T / {np.sqrt(sizes['inner']):.4f}",
        "    sq = jnp.sum(r * r, axis=-1)",
        "    b = 2 * r @ r.T - sq[:, None] - sq[None, :]",
        f"    w = {mix}",
    ]
    if sizes["values"] == 3:
        lines += ["    c = jnp.cos(q @ r.T)", "    w = w * c"]
    tail = " + jnp.mean(c[:, 0])" if sizes["values"] == 3 else ""
    return [
        *lines,
        '    out = w @ (h @ params["wv"]) * v["aux"]',
        "    picked = jnp.take_along_axis(a, labels[:, None], axis=1)",
        "    spread = jnp.mean(jax.nn.logsumexp(b / 16, axis=0))",
        f"    return jnp.mean(out**2) + spread - jnp.mean(picked){tail}",
    ]


def _multi_arrays(
    sizes: Sizes, flags: frozenset[str], lead: tuple[int, ...], rng: np.random.Generator
) -> Arrays:
    d, e = sizes["din"], sizes["inner"]
    params = {
        "wq": _dense(rng, d, e),
        "wk": _dense(rng, d, e),
        "wr": _dense(rng, d, e, gain=0.5),
        "wv": _dense(rng, d, sizes["out"]),
    }
    x = rng.standard_normal((*lead, sizes["rows"], d))
    labels = _labels(rng, sizes["rows"], (*lead, sizes["rows"]))
    return x, params, {"aux": rng.standard_normal(sizes["out"])}, labels


FAMILIES: dict[str, Family] = {
    "mlp": Family(_mlp_draw, _mlp_body, _mlp_arrays, ("cross_entropy", "dropout")),
    "scan_layers": Family(_stack_draw, _stack_body, _stack_arrays),
    "transformer": Family(
        _transformer_draw,
        _transformer_body,
        _transformer_arrays,
        ("cross_entropy", "layernorm", "dropout"),
    ),
    "cnn": Family(_cnn_draw, _cnn_body, _cnn_arrays),
    "graph": Family(_graph_draw, _graph_body, _graph_arrays, ()),
    "multi": Family(_multi_draw, _multi_body, _multi_arrays, ()),
    "solver": Family(solver_family.draw, solver_family.body, solver_family.arrays),
}
