"""How a case applies memsafe, and the jax.jit program it is compared with.

A :class:`Wrapper` turns the namespace of a rendered case (``f`` and ``loss``) into the reference
function (compiled by the runner with memsafe's compiler options, YNNPACK off) and the memsafe
call, and says which plans and which compiled footprints must stay under the limit.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax

import memsafe
from memsafe.plan import Plan

Args = tuple[Any, ...]
VMAP_AXES = (0, None, None, 0)
GRAD_ARGNUMS = (0, 1)


@dataclass(frozen=True)
class Wrapper:
    """``ref(ns)``: the reference as a function of the four arguments; ``make(ns, limit)``: the
    memsafe object; ``call(obj, args)``: run it; ``plans(obj, args)``: the plans whose footprints
    must stay under the limit; ``outer``: whether the memsafe call sits inside an outer ``jax.jit``,
    whose compile memsafe cannot verify (it warns with ``OuterJitWarning``): the outer program's
    footprint is then measured and reported apart; ``code``:
    how it reads, for the rendered case."""

    ref: Callable[[dict], Callable[..., Any]]
    make: Callable[[dict, int], Any]
    call: Callable[[Any, Args], Any]
    plans: Callable[[Any, Args], list[Plan]]
    outer: bool
    code: str


def _plain_plans(obj: Any, args: Args) -> list[Plan]:
    return [obj.plan(*args)]


def _forward_and_backward_plans(obj: Any, args: Args) -> list[Plan]:
    """The forward plan and the plan of the backward program the gradient ran (of the
    differentiated arguments only)."""
    plan = obj.plan(*args)
    return [plan, plan.backward]


def batched_plans(obj: Any, args: Args = ()) -> list[Plan]:
    """The plans memsafe verified at the batched shapes under ``jax.vmap`` (the programs that
    ran), reached through the function's cache of re-planned programs."""
    found, stack = [], list(obj._batched_programs.values())
    while stack:
        batched = stack.pop()
        found.extend(child.program.plan for child in batched._children.values())
        stack.extend(batched._children.values())
    return found


#: Environment variable holding compiler options (JSON) for every memsafe function of a case
#: (``--ynn-dot``); jax.jit's reference keeps memsafe's defaults.
OPTIONS_VARIABLE = "MEMSAFE_FUZZ_COMPILER_OPTIONS"


def _ms(fun: Callable, limit: int, **kw: Any) -> memsafe.jit:
    options = os.environ.get(OPTIONS_VARIABLE)
    if options:
        kw["compiler_options"] = json.loads(options)
    return memsafe.jit(fun, memory_limit=limit, **kw)


WRAPPERS: dict[str, Wrapper] = {
    "plain": Wrapper(
        ref=lambda ns: ns["f"],
        make=lambda ns, lim: _ms(ns["f"], lim),
        call=lambda o, a: o(*a),
        plans=_plain_plans,
        outer=False,
        code="memsafe.jit(f, memory_limit=LIMIT)(x, y, v, labels)",
    ),
    "grad_inside": Wrapper(
        ref=lambda ns: jax.grad(ns["loss"], argnums=GRAD_ARGNUMS),
        make=lambda ns, lim: _ms(jax.grad(ns["loss"], argnums=GRAD_ARGNUMS), lim),
        call=lambda o, a: o(*a),
        plans=_plain_plans,
        outer=False,
        code="memsafe.jit(jax.grad(loss, argnums=(0, 1)), memory_limit=LIMIT)(x, y, v, labels)",
    ),
    "grad_outside": Wrapper(
        ref=lambda ns: jax.grad(ns["loss"], argnums=GRAD_ARGNUMS),
        make=lambda ns, lim: _ms(ns["loss"], lim),
        call=lambda o, a: jax.grad(o, argnums=GRAD_ARGNUMS)(*a),
        plans=_forward_and_backward_plans,
        outer=False,
        code="jax.grad(memsafe.jit(loss, memory_limit=LIMIT), argnums=(0, 1))(x, y, v, labels)",
    ),
    "vmap_outside": Wrapper(
        ref=lambda ns: jax.vmap(ns["f"], in_axes=VMAP_AXES),
        make=lambda ns, lim: _ms(ns["f"], lim),
        call=lambda o, a: jax.vmap(o, in_axes=VMAP_AXES)(*a),
        plans=batched_plans,
        outer=False,
        code="jax.vmap(memsafe.jit(f, memory_limit=LIMIT), in_axes=(0, None, None, 0))"
        "(x, y, v, labels)",
    ),
    "vmap_inside": Wrapper(
        ref=lambda ns: jax.vmap(ns["f"], in_axes=VMAP_AXES),
        make=lambda ns, lim: _ms(jax.vmap(ns["f"], in_axes=VMAP_AXES), lim),
        call=lambda o, a: o(*a),
        plans=_plain_plans,
        outer=False,
        code="memsafe.jit(jax.vmap(f, in_axes=(0, None, None, 0)), memory_limit=LIMIT)"
        "(x, y, v, labels)",
    ),
    "jit_outside": Wrapper(
        ref=lambda ns: ns["f"],
        make=lambda ns, lim: _ms(ns["f"], lim),
        call=lambda o, a: jax.jit(o)(*a),
        plans=_plain_plans,
        outer=True,
        code="jax.jit(memsafe.jit(f, memory_limit=LIMIT))(x, y, v, labels)",
    ),
    "jit_inside": Wrapper(
        ref=lambda ns: ns["f"],
        make=lambda ns, lim: _ms(jax.jit(ns["f"]), lim),
        call=lambda o, a: o(*a),
        plans=_plain_plans,
        outer=False,
        code="memsafe.jit(jax.jit(f), memory_limit=LIMIT)(x, y, v, labels)",
    ),
    "static_argnums": Wrapper(
        ref=lambda ns: lambda *a: ns["f"](*a, 0.5),
        make=lambda ns, lim: _ms(ns["f"], lim, static_argnums=4),
        call=lambda o, a: o(*a, 0.5),
        plans=lambda o, a: [o.plan(*a, 0.5)],
        outer=False,
        code="memsafe.jit(f, memory_limit=LIMIT, static_argnums=4)(x, y, v, labels, 0.5)",
    ),
    "static_argnames": Wrapper(
        ref=lambda ns: lambda *a: ns["f"](*a, scale=0.5),
        make=lambda ns, lim: _ms(ns["f"], lim, static_argnames="scale"),
        call=lambda o, a: o(*a, scale=0.5),
        plans=lambda o, a: [o.plan(*a, scale=0.5)],
        outer=False,
        code="memsafe.jit(f, memory_limit=LIMIT, static_argnames='scale')"
        "(x, y, v, labels, scale=0.5)",
    ),
    "kwargs": Wrapper(
        ref=lambda ns: ns["f"],
        make=lambda ns, lim: _ms(ns["f"], lim),
        call=lambda o, a: o(a[0], a[1], v=a[2], labels=a[3]),
        plans=lambda o, a: [o.plan(a[0], a[1], v=a[2], labels=a[3])],
        outer=False,
        code="memsafe.jit(f, memory_limit=LIMIT)(x, y, v=v, labels=labels)",
    ),
}
