"""Graph: a read-only view of a jaxpr with shapes, bytes, producers, consumers and liveness."""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from memsafe._jax import ClosedJaxpr, JaxprEqn, Literal, Var, nbytes_of_aval, source_line


@dataclass(frozen=True)
class ValueInfo:
    """One jaxpr variable: its shape, dtype, bytes, producer and consumers (equation indices)."""

    var: Var
    shape: tuple[int, ...]
    dtype: Any
    bytes: int
    producer: int | None  # None for program inputs and constants
    consumers: tuple[int, ...]
    is_input: bool
    is_const: bool
    is_output: bool
    last_use: int  # index of the last consuming equation; len(eqns) if an output


@dataclass
class Graph:
    """The program as a dataflow graph over one ClosedJaxpr (top level; sub-jaxprs are opaque)."""

    closed: ClosedJaxpr
    _values: dict[Var, ValueInfo] = field(init=False, repr=False)
    _eqns: tuple[JaxprEqn, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        jaxpr = self.closed.jaxpr
        known = _BUILT.get(id(jaxpr))
        if known is not None and known[0]() is jaxpr and known[1] == _shape_of(jaxpr):
            self._eqns, self._values = known[2], known[3]
            return
        self._build(jaxpr)
        _remember(jaxpr, self._eqns, self._values)

    def _build(self, jaxpr: Any) -> None:
        self._eqns = tuple(jaxpr.eqns)
        producers: dict[Var, int] = {}
        consumers: dict[Var, list[int]] = {}
        for i, eqn in enumerate(jaxpr.eqns):
            for v in eqn.invars:
                if isinstance(v, Var):
                    consumers.setdefault(v, []).append(i)
            for v in eqn.outvars:
                producers[v] = i
        outputs = {v for v in jaxpr.outvars if isinstance(v, Var)}
        inputs = set(jaxpr.invars)
        consts = set(jaxpr.constvars)
        n = len(jaxpr.eqns)
        values: dict[Var, ValueInfo] = {}
        for v in [*jaxpr.constvars, *jaxpr.invars, *producers]:
            uses = tuple(consumers.get(v, ()))
            last = n if v in outputs else (max(uses) if uses else producers.get(v, -1))
            values[v] = ValueInfo(
                var=v,
                shape=tuple(v.aval.shape),
                dtype=v.aval.dtype,
                bytes=nbytes_of_aval(v.aval),
                producer=producers.get(v),
                consumers=uses,
                is_input=v in inputs,
                is_const=v in consts,
                is_output=v in outputs,
                last_use=last,
            )
        self._values = values

    @property
    def eqns(self) -> tuple[JaxprEqn, ...]:
        """The equations, in program order (the graph is read-only: one tuple, never copied)."""
        return self._eqns

    @property
    def inputs(self) -> list[Var]:
        return list(self.closed.jaxpr.invars)

    @property
    def outputs(self) -> list[Any]:
        return list(self.closed.jaxpr.outvars)

    def info(self, var: Var) -> ValueInfo:
        return self._values[var]

    def values(self) -> list[ValueInfo]:
        return list(self._values.values())

    def producer(self, var: Any) -> JaxprEqn | None:
        if isinstance(var, Literal):
            return None
        idx = self._values[var].producer
        return None if idx is None else self.closed.jaxpr.eqns[idx]

    def consumers(self, var: Var) -> list[JaxprEqn]:
        return [self.closed.jaxpr.eqns[i] for i in self._values[var].consumers]

    def where(self, index: int) -> str:
        """User source line of equation ``index``."""
        return source_line(self.closed.jaxpr.eqns[index])

    def largest(self, k: int = 10) -> list[ValueInfo]:
        """The k largest intermediate values (not inputs or constants)."""
        inter = [vi for vi in self._values.values() if vi.producer is not None]
        return sorted(inter, key=lambda vi: vi.bytes, reverse=True)[:k]


#: The graphs of the jaxprs seen last (their equations and value facts), by the jaxpr's ``id``,
#: with a weak reference that says the jaxpr is still that one: a plan builds the graph of one
#: program in several passes and analyses (8 times over the MLP step's gradient), and a jaxpr is
#: never edited in place (passes re-trace), so a graph is a function of its jaxpr object.
_BUILT: OrderedDict[int, tuple[Any, tuple[Any, ...], tuple[JaxprEqn, ...], dict]] = OrderedDict()
_BUILT_MAX = 32


def _shape_of(jaxpr: Any) -> tuple[Any, ...]:
    """What a cached graph is checked against besides the jaxpr's identity (cheap): its lists'
    objects and lengths, which an edit in place would change."""
    return (
        id(jaxpr.eqns),
        len(jaxpr.eqns),
        len(jaxpr.invars),
        len(jaxpr.outvars),
        len(jaxpr.constvars),
    )


def _remember(jaxpr: Any, eqns: tuple[JaxprEqn, ...], values: dict[Var, ValueInfo]) -> None:
    key = id(jaxpr)

    def forget(ref: Any, built: OrderedDict = _BUILT) -> None:  # the jaxpr is gone: its facts too
        entry = built.get(key)  # (the table bound here: at exit the module's names are None)
        if entry is not None and entry[0] is ref:
            built.pop(key, None)

    _BUILT[key] = (weakref.ref(jaxpr, forget), _shape_of(jaxpr), eqns, values)
    _BUILT.move_to_end(key)
    while len(_BUILT) > _BUILT_MAX:
        _BUILT.popitem(last=False)


#: Analyses kept per jaxpr (see :func:`memo`), by the jaxpr's ``id``, each with a weak
#: reference that says the jaxpr is still that one and the shape it had.
_MEMOS: dict[int, tuple[Any, tuple[Any, ...], dict[str, tuple[Any, dict]]]] = {}


def memo(closed: Any, name: str, valid: Any = None) -> dict:
    """A dict of analyses of ``closed``'s program (a ClosedJaxpr, or a Jaxpr) under ``name``, the
    same dict for as long as its jaxpr lives (unedited): what a pass computes of a program
    whatever its budget, kept for the search's next attempt at the same program (the roll
    pass's loops and rewrites), or what is read of a sub-program every block holds alike.

    What is stored must not refer to the jaxpr itself (nor to a :class:`Graph` of it), or the
    jaxpr would live as long as its memo. ``valid``: what the analyses were made under (the
    rewrite policy); asked under another, the dict is a new, empty one.
    """
    jaxpr = getattr(closed, "jaxpr", closed)
    key = id(jaxpr)
    entry = _MEMOS.get(key)
    if entry is None or entry[0]() is not jaxpr or entry[1] != _shape_of(jaxpr):

        def forget(ref: Any, memos: dict = _MEMOS) -> None:  # the jaxpr is gone: its analyses too
            known = memos.get(key)
            if known is not None and known[0] is ref:
                memos.pop(key, None)

        entry = (weakref.ref(jaxpr, forget), _shape_of(jaxpr), {})
        _MEMOS[key] = entry
    kept = entry[2].get(name)
    if kept is None or kept[0] != valid:
        kept = entry[2][name] = (valid, {})
    return kept[1]
