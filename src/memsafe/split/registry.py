"""The split rule of each primitive: how a split axis maps through it, and how it is re-bound.

A :class:`SplitRule` is registered per primitive name, the way JAX registers a batching rule.
Its ``axis_map``, given one operand or result of an equation that carries the split axis at
position ``axis``, answers with a :class:`Mapping` (where the axis sits in every operand and
result; ``None`` for one that does not carry it and is used whole), a
:class:`~memsafe.split.sinks.Sink` (the equation consumes the axis; its reducer combines the
chunks' results), or raises :class:`NoRule` naming why the axis cannot pass. Its ``rebind``
evaluates the equation on chunk-shaped operands: most primitives have no shape in their params
and are bound unchanged; those that do (broadcast_in_dim, reshape, iota, slice, ...) get the
chunk's size written in, and iota along the axis is offset by the chunk's start.

The rules themselves live in ``memsafe.split.prims``, one module per family of primitives. A
primitive with no rule registered by its name takes the rule of its kind in
``memsafe.primitives.TABLE`` (every elementwise primitive one rule, every reduction another), so a
primitive declared with ``memsafe.primitives.declare`` splits with no further step.

A split strategy that maps the axis through some primitives its own way (the halo strategy's
windows on extended chunks, the replay strategy's loops replayed per chunk of an accumulator)
registers an :class:`Extension` of their rules with :func:`extend`: it answers with mappings of
its own type and re-binds those, and the rules know nothing of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
from jax import lax

from memsafe._jax import JaxprEqn, bind_eqn
from memsafe.primitives import Kind, facts
from memsafe.split.sinks import Sink

Axis = int | None


@dataclass(frozen=True)
class Mapping:
    """The split axis in each operand and result of an equation (None: does not carry it)."""

    ins: tuple[Axis, ...]
    outs: tuple[Axis, ...]


class NoRule(Exception):
    """The split axis cannot pass through this equation (the message says why).

    ``inherent`` is True when no chunked program along the axis exists (each result of a sort
    depends on every element along it); False when one may exist that memsafe has no rule for.
    """

    def __init__(self, message: str, *, inherent: bool = False) -> None:
        super().__init__(message)
        self.inherent = inherent


#: Side of the equation the known axis is on: ("in", operand index) or ("out", result index).
Side = tuple[str, int]


@dataclass(frozen=True)
class RuleContext:
    """What a split rule is told besides its equation, as JAX's batching rules are told
    ``axis_data``: how the region it answers for grows. Rules read it from their argument only,
    so an answer depends on nothing else (memsafe.split.body caches answers by it).

    Attributes:
        extended: the region grows on extended chunks (:mod:`memsafe.split.strategies.halo`):
            windowed operations map the axis through as a ``memsafe.split.strategies.halo.Halo``,
            values of several lengths along it may join, and only positional equations may.
        trying: the planner's retries in force (``memsafe.split.planner.Retry``: the replay
            strategy's, say), which the :class:`Extension` of their strategy tests for.
    """

    extended: bool = False
    trying: frozenset[Any] = frozenset()

    def in_body(self) -> RuleContext:
        """The context inside a loop's or call's body, which runs on plain chunks."""
        return RuleContext(trying=self.trying)


#: Plain chunks, no replays: the context of every question asked outside region growth.
PLAIN = RuleContext()


@dataclass(frozen=True)
class Through(Mapping):
    """The mapping of a loop or call through its body, with the context the body was reached
    in (``ctx``, already :meth:`RuleContext.in_body`): its re-bind reaches the body the same way."""

    ctx: RuleContext = PLAIN


#: How the axis maps through an equation, given it sits at ``axis`` of ``side``.
AxisMap = Callable[[JaxprEqn, Side, int, RuleContext], "Mapping | Sink"]
#: The equation on chunk-shaped operands: (eqn, operand values, mapping, chunk start, chunk size).
Rebind = Callable[[JaxprEqn, list[Any], Mapping, Any, int], list[Any]]
#: A mapping widened to more chunked operands: (eqn, the rule's answer from one of them or None,
#: operand position -> axis, context).
Widen = Callable[[JaxprEqn, "Mapping | None", dict[int, int], RuleContext], Mapping]


def bind_unchanged(
    eqn: JaxprEqn, invals: list[Any], mapping: Mapping, start: Any, size: int
) -> list[Any]:
    """Re-bind an equation whose params hold no shape: the same equation on the chunk."""
    return bind_eqn(eqn, invals)


class Running:
    """An equation that scans along the split axis: each chunk depends on the chunks before it,
    through a value the loop threads from chunk to chunk (the *carried* value).

    Subclasses say when the equation scans along the axis, which way, what the chunk's
    equation reads of the carried value, what it hands on, and which of its results exist only
    after the last chunk (results without the split axis, like a loop's final carry)."""

    def applies(self, eqn: JaxprEqn, mapping: Mapping) -> bool:
        """Whether ``eqn``, mapped as ``mapping``, scans along the split axis."""
        raise NotImplementedError

    def reverse(self, eqn: JaxprEqn) -> bool:
        """Whether it scans from the end (the loop visits the chunks last first)."""
        return False

    def feed(self, eqn: JaxprEqn, invals: list[Any], carried: Any) -> list[Any]:
        """The chunk's operands given the value carried from the chunks before it."""
        return invals

    def record(
        self, eqn: JaxprEqn, outs: list[Any], mapping: Mapping, size: int, carried: Any
    ) -> tuple[list[Any], Any]:
        """(the chunk's results, the value carried to the next chunk) from the equation's
        results on the chunk and the value carried into it (None on the first chunk)."""
        raise NotImplementedError

    def finals(self, eqn: JaxprEqn, carried: Any) -> dict[int, Any]:
        """The results that exist only after the last chunk (those ``mapping.outs`` marks
        None), from the value carried out of it, keyed by result position."""
        return {}

    def keeping(self, eqn: JaxprEqn, mapping: Mapping, live: frozenset[int]) -> Running | None:
        """The rule where only the results after the loop at positions ``live`` are read (the
        others are dead); None where the chunks then need nothing carried between them."""
        return self

    def sink(self, eqn: JaxprEqn, mapping: Mapping) -> Sink | None:
        """The equation as a sink where no value can be carried from chunk to chunk (a loop
        body that runs whole on each chunk, a value made of pieces): a combining scatter whose
        chunks, each scattered into its own copy, fold by its combiner; None where it has none
        (a scan along the axis)."""
        return None

    def same_inside(self, eqn: JaxprEqn, mapping: Mapping) -> bool:
        """Whether, inside a loop body that runs whole on each chunk, the equation needs no
        carry between chunks: its results without the split axis read nothing of it (a nested
        loop's counter), so every chunk computes them alike and they are read whole."""
        return False


@dataclass(frozen=True)
class LastChunk(Running):
    """An equation whose results without the split axis are the same on every chunk (they read
    nothing of it): the last chunk's are the results after the loop, of those at positions
    ``kept`` (None: all). Subclasses say when it applies."""

    kept: frozenset[int] | None = None

    def keeping(self, eqn: JaxprEqn, mapping: Mapping, live: frozenset[int]) -> Running | None:
        return type(self)(live) if live else None

    def record(
        self, eqn: JaxprEqn, outs: list[Any], mapping: Mapping, size: int, carried: Any
    ) -> tuple[list[Any], Any]:
        kept = range(len(outs)) if self.kept is None else self.kept
        return outs, {k: outs[k] for k in kept if mapping.outs[k] is None}

    def finals(self, eqn: JaxprEqn, carried: Any) -> dict[int, Any]:
        return dict(carried)


@dataclass(frozen=True)
class Accumulate(Running):
    """A cumulative op (cumsum): each chunk's result is combined with the last value of the
    chunks before it.

    Attributes:
        combine: (carry of size 1 along the axis, the chunk's own scan) -> the chunk's result.
        axis: the axis the equation scans along.
        reversed: whether the equation scans from the end (its loop visits the chunks last
            first, and a chunk's first value carries into the chunk before it).
    """

    combine: Callable[[Any, Any], Any]
    axis: Callable[[JaxprEqn], int]
    reversed: Callable[[JaxprEqn], bool] = lambda eqn: False

    def applies(self, eqn: JaxprEqn, mapping: Mapping) -> bool:
        return mapping.outs[0] == self.axis(eqn)

    def reverse(self, eqn: JaxprEqn) -> bool:
        return self.reversed(eqn)

    def record(
        self, eqn: JaxprEqn, outs: list[Any], mapping: Mapping, size: int, carried: Any
    ) -> tuple[list[Any], Any]:
        (out,), axis = outs, mapping.outs[0]
        if carried is not None:
            out = self.combine(jnp.broadcast_to(carried, out.shape), out)
        edge = 0 if self.reverse(eqn) else size - 1  # the side the next chunk is on
        return [out], lax.slice_in_dim(out, edge, edge + 1, axis=axis)


@dataclass(frozen=True)
class SplitRule:
    """How one primitive takes part in a split region.

    Attributes:
        axis_map: where the split axis goes through an equation of the primitive.
        rebind: the equation evaluated on one chunk.
        running: how chunks carry into the next where the equation scans along the split axis
            or sums over it into results that exist after the loop (the first that applies).
        piece_rebind: the equation on one piece of a concatenation (the distribute pass), where
            ``rebind`` uses a device meant for chunk loops (None: ``rebind``).
        positional: whether, where the axis passes (a :class:`Mapping`, no running carry),
            result position ``o`` along it is computed from operand position ``o`` alone and
            from values read whole, whatever the chunk's start: such equations run unchanged
            on an extended chunk (:mod:`memsafe.split.strategies.halo`).
        widen: the mapping again where more operands than the one it was asked from carry the
            axis (:func:`widen`); None where the rule's answer is all there is.
    """

    axis_map: AxisMap
    rebind: Rebind = bind_unchanged
    running: tuple[Running, ...] = ()
    piece_rebind: Rebind | None = None
    positional: bool | Callable[[JaxprEqn, Mapping], bool] = False
    widen: Widen | None = None


@dataclass(frozen=True)
class Extension:
    """What a split strategy adds to a primitive's rule (registered with :func:`extend`).

    Attributes:
        axis_map: asked as the rule's ``axis_map`` is: a mapping of type ``mapping`` (or a sink),
            or None where the rule's own answer stands.
        mapping: the type of the mappings ``axis_map`` answers with; equations mapped so are
            re-bound by ``rebind`` (the rule's ``positional`` still answers for them).
        rebind: the equation evaluated on one chunk, mapped as ``mapping``.
        running: how chunks carry into the next where the equation, mapped as ``mapping``,
            needs it (asked before the rule's own).
        fallback: asked only where the rule raises :class:`NoRule` (its error stands where the
            extension answers None); else asked before the rule.
    """

    axis_map: Callable[[JaxprEqn, Side, int, RuleContext], Mapping | Sink | None]
    mapping: type[Mapping]
    rebind: Rebind
    running: tuple[Running, ...] = ()
    fallback: bool = False


#: Split rules by primitive name.
SPLIT_RULES: dict[str, SplitRule] = {}
#: What strategies add to the rules, by primitive name (:func:`extend`).
EXTENSIONS: dict[str, tuple[Extension, ...]] = {}
#: Split rules by the kind of primitive (``memsafe.primitives.Kind``), for primitives with no rule
#: of their own in :data:`SPLIT_RULES`.
KIND_RULES: dict[Kind, SplitRule] = {}


def split_rule(
    *names: str,
    kind: Kind | None = None,
    rebind: Rebind = bind_unchanged,
    running: Running | tuple[Running, ...] = (),
    piece_rebind: Rebind | None = None,
    positional: bool | Callable[[JaxprEqn, Mapping], bool] | None = None,
    widen: Widen | None = None,
) -> Callable[[AxisMap], AxisMap]:
    """Register the decorated axis map, with ``rebind`` (``running`` for scans, ``piece_rebind``
    where pieces bind otherwise than chunks, ``widen`` where other operands may join the axis),
    as the split rule of ``names``, and with ``kind`` as that of every primitive of that kind in
    ``memsafe.primitives.TABLE`` without a rule registered by name. ``positional`` (see
    :class:`SplitRule`) defaults to whether the equation is re-bound unchanged. A later
    registration of a name replaces the earlier one."""

    runs = running if isinstance(running, tuple) else (running,)
    plain = rebind is bind_unchanged if positional is None else positional

    def deco(axis_map: AxisMap) -> AxisMap:
        rule = SplitRule(axis_map, rebind, runs, piece_rebind, plain, widen)
        for n in names:
            SPLIT_RULES[n] = rule
        if kind is not None:
            KIND_RULES[kind] = rule
        return axis_map

    return deco


def extend(*names: str, extension: Extension) -> None:
    """Add ``extension`` to the split rules of ``names`` (after those added before). An
    extension whose ``axis_map`` is the same function by name (its module and qualified name) as
    one added before replaces it in place: a module reloaded registers its extensions again."""
    for n in names:
        known = EXTENSIONS.get(n, ())
        same = [k for k, ext in enumerate(known) if _named(ext) == _named(extension)]
        if same:
            EXTENSIONS[n] = (*known[: same[0]], extension, *known[same[0] + 1 :])
        else:
            EXTENSIONS[n] = (*known, extension)


def _named(extension: Extension) -> tuple[str, str]:
    fun = extension.axis_map
    return getattr(fun, "__module__", ""), getattr(fun, "__qualname__", repr(fun))


def rule_of(name: str) -> SplitRule | None:
    """The split rule of primitive ``name``: the one registered by its name, else that of its
    kind in ``memsafe.primitives.TABLE`` (None: it has none)."""
    rule = SPLIT_RULES.get(name)
    return rule if rule is not None else KIND_RULES.get(facts(name).kind)


def _rule(eqn: JaxprEqn) -> SplitRule:
    rule = rule_of(eqn.primitive.name)
    if rule is None:
        raise NoRule(f"no splitting rule for primitive '{eqn.primitive.name}'")
    return rule


def axis_map(eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext) -> Mapping | Sink:
    """Where the split axis goes through ``eqn``, given it sits at ``axis`` of ``side``, for a
    region growing in context ``ctx``: the answer of the first :class:`Extension` of its rule
    that gives one, else the rule's own."""
    rule, extensions = _rule(eqn), EXTENSIONS.get(eqn.primitive.name, ())
    for ext in extensions:
        got = None if ext.fallback else ext.axis_map(eqn, side, axis, ctx)
        if got is not None:
            return got
    try:
        return rule.axis_map(eqn, side, axis, ctx)
    except NoRule:
        for ext in extensions:
            got = ext.axis_map(eqn, side, axis, ctx) if ext.fallback else None
            if got is not None:
                return got
        raise


def widen(
    eqn: JaxprEqn, mapping: Mapping | Sink | None, ins: dict[int, int], ctx: RuleContext
) -> Mapping | Sink:
    """The equation's mapping where the operands at ``ins`` (position -> axis) all carry the
    split axis, ``mapping`` its rule's answer asked from one of them (None where the rule
    refused that one alone): a ``cond`` asked from one operand reads whole another that one
    branch passes to a result, which the region has chunked. The rule's ``widen`` answers
    (raising :class:`NoRule` where it cannot); ``mapping`` itself where it already reads each
    of them chunked, or where the rule has no ``widen`` or an extension answered."""
    if mapping is not None and (
        not isinstance(mapping, Mapping) or all(mapping.ins[k] == a for k, a in ins.items())
    ):
        return mapping
    rule = _rule(eqn)
    if rule.widen is None or (mapping is not None and _extension(eqn, mapping) is not None):
        if mapping is None:
            raise NoRule(f"{eqn.primitive.name}: no mapping with every chunked operand")
        return mapping
    return rule.widen(eqn, mapping, ins, ctx)


def _extension(eqn: JaxprEqn, mapping: Mapping) -> Extension | None:
    """The extension of ``eqn``'s rule whose mappings ``mapping`` is, if any (the one of its
    own type before one of a base type: a convolution's halos and its groups)."""
    extensions = EXTENSIONS.get(eqn.primitive.name, ())
    exact = next((e for e in extensions if type(mapping) is e.mapping), None)
    return exact or next((e for e in extensions if isinstance(mapping, e.mapping)), None)


def running_along(eqn: JaxprEqn, mapping: Mapping) -> Running | None:
    """The running carry of ``eqn`` when it scans along the split axis (or sums over it into
    results after the loop), else None."""
    ext = _extension(eqn, mapping)
    runs = _rule(eqn).running if ext is None else (*ext.running, *_rule(eqn).running)
    return next((run for run in runs if run.applies(eqn, mapping)), None)


def positional(eqn: JaxprEqn, mapping: Mapping) -> bool:
    """Whether ``eqn``, mapped as ``mapping``, is positional (:class:`SplitRule`) and carries
    nothing from chunk to chunk."""
    rule = _rule(eqn)
    plain = rule.positional(eqn, mapping) if callable(rule.positional) else rule.positional
    return plain and running_along(eqn, mapping) is None


def rebind(eqn: JaxprEqn, invals: list[Any], mapping: Mapping, start: Any, size: int) -> list[Any]:
    """Evaluate ``eqn`` on chunk-shaped ``invals`` (chunk of ``size`` starting at ``start``)."""
    ext = _extension(eqn, mapping)
    return (_rule(eqn).rebind if ext is None else ext.rebind)(eqn, invals, mapping, start, size)


def rebind_piece(
    eqn: JaxprEqn, invals: list[Any], mapping: Mapping, start: Any, size: int
) -> list[Any]:
    """Evaluate ``eqn`` on one piece of a concatenation (``size`` long, from ``start``)."""
    rule, ext = _rule(eqn), _extension(eqn, mapping)
    bind = rule.piece_rebind or rule.rebind if ext is None else ext.rebind
    return bind(eqn, invals, mapping, start, size)


# -- helpers the rules share -----------------------------------------------------------------


def shape(atom: Any) -> tuple[int, ...]:
    return tuple(getattr(atom.aval, "shape", ()))


def with_size(sizes: Any, at: int | None, size: int) -> tuple[int, ...]:
    """``sizes`` (a shape-like param) with the entry at ``at`` set to the chunk's ``size``."""
    out = list(sizes)
    assert at is not None
    out[at] = size
    return tuple(out)


def size_at(eqn: JaxprEqn, side: Side, axis: int) -> int:
    atoms = eqn.invars if side[0] == "in" else eqn.outvars
    return shape(atoms[side[1]])[axis]


def passing(eqn: JaxprEqn, axis: int) -> Mapping:
    """The axis at the same position in every operand of the result's rank and every result."""
    rank = len(shape(eqn.outvars[0]))
    ins = tuple(axis if len(shape(a)) == rank else None for a in eqn.invars)
    return Mapping(ins=ins, outs=tuple(axis for _ in eqn.outvars))


# -- families --------------------------------------------------------------------------------


def _elementwise_map(eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext) -> Mapping:
    out_shape = shape(eqn.outvars[0])
    size = size_at(eqn, side, axis)
    rank = len(out_shape)

    def carries(atom: Any) -> Axis:
        s = shape(atom)
        if len(s) == rank and s[axis] == size and size > 1:
            return axis
        if (len(s) == rank and s[axis] in (1, size)) or len(s) == 0:
            return None
        raise NoRule(f"{eqn.primitive.name}: operand shape {s} does not align with the axis")

    return Mapping(ins=tuple(carries(a) for a in eqn.invars), outs=tuple(axis for _ in eqn.outvars))


def elementwise(*names: str, kind: Kind | None = None) -> None:
    """Register elementwise primitives: the axis passes at the same position (size-1 and scalar
    operands are used whole); with ``kind``, as the rule of every primitive of that kind."""
    split_rule(*names, kind=kind)(_elementwise_map)


def identity_unless(
    names: Sequence[str],
    acting_axes: Callable[[JaxprEqn], Sequence[int]],
    what: str,
    inherent: bool = False,
) -> None:
    """Register primitives acting along ``acting_axes`` (scans, sorts, ...): the split axis
    passes unchanged if it is not among them; ``what`` says what they do along it, and
    ``inherent`` whether no chunked program along such an axis exists."""

    def rule(eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext) -> Mapping:
        if axis in tuple(acting_axes(eqn)):
            raise NoRule(f"{eqn.primitive.name} {what} along the split axis", inherent=inherent)
        return passing(eqn, axis)

    split_rule(*names)(rule)


def batch_only(name: str, what: str) -> None:
    """Register a one-operand matrix primitive acting on its last two axes: batch axes pass."""

    def rule(eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext) -> Mapping:
        rank = len(shape(eqn.invars[0]))
        if axis >= rank - 2:
            raise NoRule(f"{eqn.primitive.name} {what} along the split axis")
        return Mapping(ins=(axis,), outs=tuple(axis for _ in eqn.outvars))

    split_rule(name)(rule)
