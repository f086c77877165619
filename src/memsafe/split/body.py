"""A split axis through a loop body: which body values carry it, and the body on a chunk.

A loop whose body maps the split axis through every equation (a batch of rows through a scan
over time or layers) runs chunk by chunk like any other equation: each chunk runs the whole loop
on its rows. :func:`propagate` finds where the axis sits in each body value from where it sits in
some of the body's inputs, growing that set to a fixed point (a loop carry that takes the axis in
must give it back, and one that gives it back must take it in). It refuses a body that reduces
the axis or reads a chunked value whole, and one with a result that does not carry the axis.
:func:`chunk_body` is the body re-traced on chunk-shaped operands.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

from memsafe._jax import ClosedJaxpr, Jaxpr, JaxprEqn, Var, bind_eqn
from memsafe.split import registry
from memsafe.split.registry import Mapping, NoRule
from memsafe.split.sinks import Sink

#: Where the axis sits in each body value that carries it.
Axes = dict[Var, int]


def propagate(
    jaxpr: Jaxpr, seeds: dict[Any, int], tied: Sequence[tuple[int, int]] = ()
) -> tuple[Axes, dict[int, Mapping]]:
    """The axis of every body value that carries it, and each equation's mapping.

    Args:
        jaxpr: the loop body.
        seeds: body input position -> axis, where the chunked operands enter.
        tied: (input position, output position) pairs that must agree (a loop's carry).

    Returns:
        The axes of the body values, and the mapping of each equation (by index) that touches
        the axis. Raises :class:`NoRule` naming what stops the axis.
    """
    seeds = dict(seeds)
    for _ in range(len(jaxpr.invars) + 1):
        pulled = dict(seeds)  # the walk adds the inputs chunked operands are computed from
        axes, maps = _forward(jaxpr, pulled)
        grown = _tie(jaxpr, axes, pulled, tied)
        if grown == seeds:
            _check_outputs(jaxpr, axes)
            return axes, maps
        seeds = grown
    raise NoRule("the loop carry never settles on the split axis")


def reach(
    jaxpr: Jaxpr,
    ins: dict[int, int],
    outs: dict[int, int],
    tied: Sequence[tuple[int, int]] = (),
) -> tuple[Axes, dict[int, Mapping]]:
    """:func:`propagate` from the body inputs in ``ins``; with none, from the first body input
    axis that lands on the one result in ``outs`` (a result is reached from the inputs).

    Answers (and refusals) are remembered per body and seeds: region growth asks the same loop
    the same question once per candidate value and axis, and each answer walks the whole body.
    The returned dicts are shared: read them, do not change them."""
    got, err = _reach_once(
        jaxpr, tuple(sorted(ins.items())), tuple(sorted(outs.items())), tuple(tied)
    )
    if err is not None:
        raise NoRule(str(err), inherent=err.inherent)
    return got


@functools.lru_cache(maxsize=1024)
def _reach_once(
    jaxpr: Jaxpr, ins: tuple, outs: tuple, tied: tuple
) -> tuple[tuple[Axes, dict[int, Mapping]] | None, NoRule | None]:
    try:
        return _reach(jaxpr, dict(ins), dict(outs), tied), None
    except NoRule as err:
        return None, err


def _reach(
    jaxpr: Jaxpr, ins: dict[int, int], outs: dict[int, int], tied: Sequence[tuple[int, int]]
) -> tuple[Axes, dict[int, Mapping]]:
    if ins:
        return propagate(jaxpr, ins, tied)
    (o, a), target = next(iter(outs.items())), jaxpr.outvars
    for k, v in enumerate(jaxpr.invars):
        for b in range(len(v.aval.shape)):
            try:
                axes, maps = propagate(jaxpr, {k: b}, tied)
            except NoRule:
                continue
            if axes.get(target[o]) == a:
                return axes, maps
    raise NoRule("no input of the body carries the split axis to this result")


def _forward(jaxpr: Jaxpr, seeds: dict[Any, int]) -> tuple[Axes, dict[int, Mapping]]:
    """One walk in program order from the seeds: body inputs (by position) and generators
    (``("made", equation, result)``: a broadcast or iota made at chunk shape)."""
    axes: Axes = {jaxpr.invars[k]: a for k, a in seeds.items() if isinstance(k, int)}
    made = {key[1]: (key[2], a) for key, a in seeds.items() if isinstance(key, tuple)}
    maps: dict[int, Mapping] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        found = [(k, axes[v]) for k, v in enumerate(eqn.invars) if isinstance(v, Var) and v in axes]
        if found:
            m = _axis_map(eqn, ("in", found[0][0]), found[0][1])
        elif i in made:
            m = _axis_map(eqn, ("out", made[i][0]), made[i][1])
        else:
            continue
        if isinstance(m, Sink):
            raise NoRule(f"{eqn.primitive.name} inside the loop body reduces the split axis")
        _check_operands(eqn, m, axes, seeds, jaxpr)
        for o, ax in zip(eqn.outvars, m.outs):
            if ax is None:
                raise NoRule(f"{eqn.primitive.name} inside the loop body consumes the split axis")
            axes[o] = ax
        maps[i] = m
    return axes, maps


def _axis_map(eqn: JaxprEqn, side: registry.Side, axis: int) -> Mapping | Sink:
    """The equation's mapping inside a loop body, where a scan along the axis (``cumsum``) has
    no running carry to thread from chunk to chunk: each chunk of the loop runs the whole body,
    so a chunk's scan would miss the rows of the chunks before it."""
    m = registry.axis_map(eqn, side, axis)
    if isinstance(m, Mapping) and registry.running_along(eqn, m) is not None:
        raise NoRule(f"{eqn.primitive.name} inside the loop body scans along the split axis")
    return m


def _check_operands(
    eqn: JaxprEqn, m: Mapping, axes: Axes, seeds: dict[Any, int], jaxpr: Jaxpr
) -> None:
    """Every operand the mapping chunks must be chunked there, and no chunked operand may be
    read whole; a body input the mapping chunks joins the seeds on the next round."""
    for v, ax in zip(eqn.invars, m.ins):
        if not isinstance(v, Var):
            if ax is not None:
                raise NoRule(f"{eqn.primitive.name}: a constant would need the split axis")
            continue
        have = axes.get(v)
        if have == ax:
            continue
        if have is None and ax is not None and _pull(jaxpr, v, ax, seeds):
            continue
        raise NoRule(f"{eqn.primitive.name} inside the loop body reads a value both ways")


def _pull(
    jaxpr: Jaxpr,
    var: Var,
    axis: int,
    seeds: dict[Any, int],
    done: dict[tuple[Var, int], bool] | None = None,
) -> bool:
    """Seed the body inputs ``var`` is computed from so that it comes out chunked along
    ``axis``, or its generator where no operand carries the axis (a broadcast mask made at
    chunk shape); the next forward walk checks the whole body again. False if it cannot.
    ``done`` holds the answers for values already walked: a body whose values share inputs many
    times over (the gradient of an associative scan) is walked once per value, not per path."""
    done = {} if done is None else done
    if (var, axis) not in done:
        done[(var, axis)] = _pull_once(jaxpr, var, axis, seeds, done)
    return done[(var, axis)]


def _pull_once(
    jaxpr: Jaxpr, var: Var, axis: int, seeds: dict[Any, int], done: dict[tuple[Var, int], bool]
) -> bool:
    """:func:`_pull` of one value whose answer is not known yet."""
    if var in jaxpr.invars:
        k = jaxpr.invars.index(var)
        if seeds.get(k, axis) != axis:
            return False
        seeds[k] = axis
        return True
    index = next((i for i, e in enumerate(jaxpr.eqns) if var in e.outvars), None)
    if index is None:
        return False
    producer = jaxpr.eqns[index]
    try:
        m = _axis_map(producer, ("out", producer.outvars.index(var)), axis)
    except NoRule:
        return False
    if isinstance(m, Sink):
        return False
    pulled = [(v, a) for v, a in zip(producer.invars, m.ins) if a is not None]
    if not pulled:
        seeds[("made", index, producer.outvars.index(var))] = axis
        return True
    return all(isinstance(v, Var) and _pull(jaxpr, v, a, seeds, done) for v, a in pulled)


def _tie(jaxpr: Jaxpr, axes: Axes, seeds: dict[Any, int], tied: Sequence[tuple[int, int]]):
    grown = dict(seeds)
    for i, o in tied:
        inner, outer = jaxpr.invars[i], jaxpr.outvars[o]
        got = axes.get(outer) if isinstance(outer, Var) else None
        have = grown.get(i)
        if got is not None and have is None:
            grown[i] = got
        elif have is not None and got is None and outer is not inner:
            raise NoRule("a loop carry takes the split axis in but not out")
        elif have is not None and got is not None and have != got:
            raise NoRule("a loop carry moves the split axis")
    return grown


def _check_outputs(jaxpr: Jaxpr, axes: Axes) -> None:
    """Every result must carry the axis: one that does not would be the same on every chunk,
    which a chunked loop cannot give back."""
    for k, v in enumerate(jaxpr.outvars):
        if not (isinstance(v, Var) and v in axes):
            raise NoRule(f"the loop's result {k} does not carry the split axis")


def chunk_body(
    body: ClosedJaxpr,
    axes: Axes,
    maps: dict[int, Mapping],
    size: int,
    in_avals: Sequence[Any],
) -> ClosedJaxpr:
    """The body on operands chunked to ``size`` along their axes, with the chunk's start as an
    extra first input (index arithmetic such as ``iota`` along the axis offsets by it)."""
    jaxpr = body.jaxpr

    def run(start: Any, *args: Any) -> list[Any]:
        env: dict[Var, Any] = dict(zip(jaxpr.constvars, body.consts))
        env.update(zip(jaxpr.invars, args))
        read: Callable[[Any], Any] = lambda a: env[a] if isinstance(a, Var) else a.val
        for i, eqn in enumerate(jaxpr.eqns):
            invals = [read(a) for a in eqn.invars]
            if i in maps:
                outs = registry.rebind(eqn, invals, maps[i], start, size)
            else:
                outs = bind_eqn(eqn, invals)
            env.update(zip(eqn.outvars, outs))
        return [read(a) for a in jaxpr.outvars]

    chunked = [_chunk_aval(aval, axes.get(v), size) for v, aval in zip(jaxpr.invars, in_avals)]
    start = jax.ShapeDtypeStruct((), jax.numpy.int32)
    return jax.make_jaxpr(run)(start, *chunked)


def _chunk_aval(aval: Any, axis: int | None, size: int) -> jax.ShapeDtypeStruct:
    shape = list(aval.shape)
    if axis is not None:
        shape[axis] = size
    return jax.ShapeDtypeStruct(tuple(shape), aval.dtype)
