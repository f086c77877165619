"""Facts about JAX primitives, in one table.

Every pass that asks "is this primitive elementwise / fused by XLA / cheap to recompute / a
reduction?" reads the sets derived here, so adding a primitive is one line in :data:`TABLE`; a
primitive defined outside memsafe (a library's own ``jax.extend.core.Primitive``) is declared at
run time with :func:`declare`, and every derived set follows. Per-primitive *behaviour* (how a
split axis maps through it, how it is re-bound at chunk shape) lives in the split registry
(``memsafe.split.registry``, rules in ``memsafe.split.prims``), which finds the rule of an
elementwise primitive or a reduction by its row here; this module holds only what is true of the
primitive itself.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable, Iterator, Set
from dataclasses import dataclass
from typing import Any

import numpy as np


class Kind(enum.Enum):
    """What a primitive does to the shape of its operands."""

    ELEMENTWISE = "elementwise"  # operands have the result's shape (scalars broadcast)
    LAYOUT = "layout"  # moves, drops, adds or selects elements without computing on them
    GENERATOR = "generator"  # makes a value from parameters (iota)
    REDUCTION = "reduction"  # combines along ``axes``
    CUMULATIVE = "cumulative"  # scans along one ``axis``
    OTHER = "other"  # contractions, sorts, library calls, control flow: stored by XLA


class Scaling(enum.Enum):
    """How a factor constant along an axis passes through the primitive (online softmax)."""

    COMMUTES = "commutes"  # unary and homogeneous: f(c * x) == c * f(x)
    SAME = "same"  # the result is scaled like its (equally scaled) operands: c*x + c*y
    LAYOUT = "layout"  # the factor itself is moved the same way


@dataclass(frozen=True)
class Linear:
    """The operand positions a primitive is linear in, every other operand read as a
    coefficient (the same on every chunk): a sum of its results over shares of those operands
    is its result on their sum (``memsafe.split.linear``).

    Attributes:
        positions: the linear operands (a slice of the operand list, or their positions).
        jointly: linear in all of them together (every one a share or zero: a sum, a
            concatenation); false: in any one of them, the others then coefficients (a product).
        zero: operands that must be zero (a pad's padding value).
    """

    positions: slice | tuple[int, ...]
    jointly: bool = True
    zero: tuple[int, ...] = ()

    def indices(self, n: int) -> tuple[int, ...]:
        """The linear positions among ``n`` operands."""
        if isinstance(self.positions, slice):
            return tuple(range(n)[self.positions])
        return tuple(k for k in self.positions if k < n)


#: Linear in its one (first) operand.
_FIRST = Linear(slice(0, 1))


@dataclass(frozen=True)
class Facts:
    """What is known about one primitive.

    Attributes:
        kind: its shape behaviour.
        fusible: XLA's CPU and GPU backends fuse it into its consumer: it is never stored on
            its own, and a chain of such operations streams its inputs.
        cheap: a split region recomputes it per chunk even when its result is small (layout,
            generators and cheap arithmetic; not transcendental functions).
        commutative: a binary operation whose operands may be swapped.
        fold: a binary arithmetic operation a left fold (a chain of accumulations) is built of.
        monoid: for reductions, the name of the monoid combining partial results.
        scaling: how a factor constant along the split axis passes (None: it does not).
        lapack: on the CPU it is a LAPACK call (``memsafe.lapack_order``).
        decides: its result is a discrete decision on its operands' values (a comparison, an
            argmax, a sort order): recomputed in another compile, where XLA may round its
            floating-point operands otherwise (a contracted multiply-add), it can decide a tie
            the other way.
        call: it only wraps a sub-jaxpr (``jit``, ``checkpoint``): a call inlined for a
            forward program.
        remat: a call that checkpoints its body (``jax.checkpoint``, ``jax.remat``).
        custom_diff: it wraps a sub-jaxpr with a differentiation rule of its own
            (``custom_jvp``/``custom_vjp``): memsafe differentiates the original function, so
            its primal body is exact for a forward program.
        windowed: it reads overlapping windows of an axis (convolutions, pooling): a split along
            that axis runs on extended chunks (``memsafe.split.strategies.halo``).
        linear: the operands it is linear in where its ``scaling`` does not say so (products,
            contractions, selections, concatenations and the linear layout ops; None: none).
        adds: it adds its two operands (``a + b``): a running sum's step
            (``memsafe.split.strategies.replay`` recognises a carry that only accumulates by it).
        updates: it writes a piece into its first operand at a position
            (``dynamic_update_slice``): a step of a chain of in-place updates, moved with the
            chain where the roll pass reorders a program (``memsafe.graph.repeats.sunk``).
        in_place: it writes into a copy of its first operand that XLA makes in that operand's
            buffer where it can (``dynamic_update_slice``, the scatters): that operand is held
            as a buffer of its own (``memsafe.passes.tie``).
        replays: a loop its split rule may run once per chunk of a carry that only
            accumulates, where no other split of a value exists
            (``memsafe.split.strategies.replay``).
        control: control flow running programs of its own: ``"loop"`` (a body run again and
            again: ``scan``, ``while``) or ``"branch"`` (one of several: ``cond``); None: none.
        shape_free: its parameters name axes or dtypes, never lengths: it binds unchanged on
            a tile of its operands (elementwise primitives and reductions are so by kind).
        shape_param: the parameter holding its result's shape, where one does (a tile's shape
            is written there).
        broadcasts: its result repeats its operand along new axes: a contraction with it may
            fold into a reduction.
        flops: its floating-point work from its equation's shapes, where its kind does not say
            it (``memsafe.flops``: contractions, convolutions).
    """

    kind: Kind
    fusible: bool = False
    cheap: bool = False
    commutative: bool = False
    fold: bool = False
    monoid: str | None = None
    scaling: Scaling | None = None
    lapack: bool = False
    decides: bool = False
    call: bool = False
    remat: bool = False
    custom_diff: bool = False
    windowed: bool = False
    linear: Linear | None = None
    adds: bool = False
    updates: bool = False
    in_place: bool = False
    replays: bool = False
    control: str | None = None
    shape_free: bool = False
    shape_param: str | None = None
    broadcasts: bool = False
    flops: Callable[[Any], int] | None = None


def _elements(atom: Any) -> int:
    return math.prod(getattr(getattr(atom, "aval", None), "shape", ()))


def _contraction_flops(eqn: Any) -> int:
    """Two flops per multiply-add: per result element, the contracted length."""
    (contract, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    return 2 * _elements(eqn.outvars[0]) * math.prod(lhs[d] for d in contract)


def _conv_flops(eqn: Any) -> int:
    """Two flops per output element and kernel tap over one group's input features."""
    kernel = eqn.invars[1].aval.shape
    out_features = kernel[eqn.params["dimension_numbers"].rhs_spec[0]]
    return 2 * _elements(eqn.outvars[0]) * math.prod(kernel) // max(1, out_features)


def _elementwise(**facts: object) -> Facts:
    return Facts(Kind.ELEMENTWISE, fusible=True, **facts)  # type: ignore[arg-type]


def _layout(**facts: object) -> Facts:
    return Facts(Kind.LAYOUT, fusible=True, cheap=True, **facts)  # type: ignore[arg-type]


def _reduction(monoid: str) -> Facts:
    return Facts(Kind.REDUCTION, monoid=monoid)


_ARITH = _elementwise(cheap=True, fold=True)
_ARITH_COMM = _elementwise(cheap=True, fold=True, commutative=True)
_COMPARE = _elementwise(cheap=True, decides=True)
_MATH = _elementwise()  # transcendental and special functions: not recomputed per chunk
_MATH_CHEAP = _elementwise(cheap=True)

TABLE: dict[str, Facts] = {
    # arithmetic
    "add": _elementwise(cheap=True, fold=True, commutative=True, scaling=Scaling.SAME, adds=True),
    "add_any": _elementwise(
        cheap=True, fold=True, commutative=True, scaling=Scaling.SAME, adds=True
    ),
    "sub": _elementwise(cheap=True, fold=True, scaling=Scaling.SAME),
    "mul": _elementwise(cheap=True, fold=True, commutative=True, linear=Linear((0, 1), False)),
    "div": _elementwise(cheap=True, fold=True, linear=Linear((0,), False)),
    "rem": _elementwise(fold=True),
    "pow": _elementwise(fold=True),
    "atan2": _elementwise(fold=True),
    "max": _ARITH_COMM,
    "min": _ARITH_COMM,
    "integer_pow": _MATH_CHEAP,
    "neg": _elementwise(cheap=True, scaling=Scaling.COMMUTES),
    "abs": _MATH_CHEAP,
    "square": _MATH_CHEAP,
    "one_minus_square": _MATH_CHEAP,  # 1 - x*x: jax 0.11's derivative of tanh
    "sqrt": _MATH_CHEAP,
    "exp": _MATH_CHEAP,
    "log": _MATH_CHEAP,
    **dict.fromkeys(
        [
            "sign",
            "floor",
            "ceil",
            "round",
            "is_finite",
            "exp2",
            "log1p",
            "expm1",
            "tanh",
            "logistic",
            "sin",
            "cos",
            "tan",
            "asin",
            "acos",
            "atan",
            "sinh",
            "cosh",
            "asinh",
            "acosh",
            "atanh",
            "rsqrt",
            "cbrt",
            "clamp",
            "erf",
            "erfc",
            "erf_inv",
            "lgamma",
            "digamma",
            "igamma",
            "igammac",
            "nextafter",
            "real",
            "imag",
            "conj",
            "complex",
            "population_count",
            "clz",
            "polygamma",
            "zeta",
            "bessel_i0e",
            "bessel_i1e",
            "regularized_incomplete_beta",
            "igamma_grad_a",
            "random_gamma_grad",
        ],
        _MATH,
    ),
    # comparisons, logic, bits
    "eq": _elementwise(cheap=True, commutative=True, decides=True),
    "ne": _elementwise(cheap=True, commutative=True, decides=True),
    **dict.fromkeys(["lt", "le", "gt", "ge"], _COMPARE),
    "and": _elementwise(commutative=True),
    "or": _elementwise(commutative=True),
    "xor": _elementwise(commutative=True),
    **dict.fromkeys(
        ["not", "shift_left", "shift_right_logical", "shift_right_arithmetic"], _elementwise()
    ),
    "select_n": _elementwise(cheap=True, scaling=Scaling.SAME, linear=Linear(slice(1, None))),
    # conversions and identities
    "convert_element_type": _elementwise(cheap=True, scaling=Scaling.COMMUTES),
    "reduce_precision": _elementwise(scaling=Scaling.COMMUTES),
    "stop_gradient": _elementwise(cheap=True),
    "copy": _elementwise(cheap=True, scaling=Scaling.COMMUTES),
    "copy_p": _elementwise(cheap=True, scaling=Scaling.COMMUTES),
    "bitcast_convert_type": Facts(Kind.LAYOUT, fusible=True),
    # layout
    "broadcast_in_dim": _layout(scaling=Scaling.LAYOUT, shape_param="shape", broadcasts=True),
    "reshape": _layout(scaling=Scaling.LAYOUT, shape_param="new_sizes"),
    "squeeze": _layout(scaling=Scaling.LAYOUT, shape_free=True),
    "expand_dims": _layout(scaling=Scaling.LAYOUT),
    "transpose": Facts(Kind.LAYOUT, cheap=True, scaling=Scaling.LAYOUT, shape_free=True),
    **dict.fromkeys(["slice", "rev"], _layout(linear=_FIRST)),
    "pad": _layout(linear=Linear((0,), zero=(1,))),
    "concatenate": _layout(linear=Linear(slice(None))),
    "dynamic_slice": _layout(linear=_FIRST),
    "stack": _layout(),
    "iota": Facts(Kind.GENERATOR, fusible=True, cheap=True),
    # reductions and scans
    "reduce_sum": Facts(Kind.REDUCTION, monoid="sum", linear=_FIRST),
    "reduce_max": _reduction("max"),
    "reduce_min": _reduction("min"),
    "reduce_prod": _reduction("prod"),
    "reduce_and": _reduction("and"),
    "reduce_or": _reduction("or"),
    "reduce_xor": _reduction("xor"),
    "argmax": Facts(Kind.REDUCTION, monoid="argmax", decides=True),
    "argmin": Facts(Kind.REDUCTION, monoid="argmin", decides=True),
    # orders: what goes where depends on comparing the values
    **dict.fromkeys(["sort", "top_k"], Facts(Kind.OTHER, decides=True)),
    "cumsum": Facts(Kind.CUMULATIVE, linear=_FIRST),
    **dict.fromkeys(["cumprod", "cummax", "cummin", "cumlogsumexp"], Facts(Kind.CUMULATIVE)),
    # layout ops whose results are pieces of their operand
    **dict.fromkeys(["split", "unstack"], _layout()),
    # windows: XLA stores their results
    "conv_general_dilated": Facts(Kind.OTHER, windowed=True, flops=_conv_flops),
    **dict.fromkeys(
        [
            "reduce_window",
            "reduce_window_max",
            "reduce_window_min",
            "reduce_window_sum",
        ],
        Facts(Kind.OTHER, windowed=True),
    ),
    # contractions, gathers and scatters: XLA stores their results
    "dot_general": Facts(
        Kind.OTHER, linear=Linear((0, 1), False), shape_free=True, flops=_contraction_flops
    ),
    "dynamic_update_slice": Facts(
        Kind.OTHER, linear=Linear(slice(0, 2)), updates=True, in_place=True
    ),
    "gather": Facts(Kind.OTHER),
    **dict.fromkeys(
        [
            "scatter",
            "scatter-add",
            "scatter_add",
            "scatter-mul",
            "scatter_mul",
            "scatter-max",
            "scatter_max",
            "scatter-min",
            "scatter_min",
        ],
        Facts(Kind.OTHER, in_place=True),
    ),
    # the gradient of max pooling and its forward-mode derivative: each window's value goes
    # where comparing the operand's values picks (XLA stores their results)
    **dict.fromkeys(
        ["select_and_scatter_add", "select_and_gather_add"], Facts(Kind.OTHER, decides=True)
    ),
    # a key per element of its data (``jax.random.fold_in`` under ``jax.vmap``)
    "random_fold_in": _elementwise(),
    # random bits, barriers, calls and control flow
    **dict.fromkeys(
        [
            "random_bits",
            "optimization_barrier",
            # equinox's own: a primitive under vmap, a select on a scalar predicate
            "vprim",
            "select_if_vmap",
        ],
        Facts(Kind.OTHER),
    ),
    "scan": Facts(Kind.OTHER, replays=True, control="loop"),
    "while": Facts(Kind.OTHER, control="loop"),
    "cond": Facts(Kind.OTHER, control="branch"),
    # calls: a sub-jaxpr wrapped (custom_vmap_call: a memsafe function called inside a trace,
    # memsafe.batching)
    **dict.fromkeys(
        ["pjit", "jit", "closed_call", "core_call", "custom_vmap_call"],
        Facts(Kind.OTHER, call=True),
    ),
    **dict.fromkeys(["checkpoint", "remat2"], Facts(Kind.OTHER, call=True, remat=True)),
    **dict.fromkeys(
        ["custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"],
        Facts(Kind.OTHER, custom_diff=True),
    ),
    # linear algebra: LAPACK calls on the CPU
    **dict.fromkeys(
        [
            "cholesky",
            "triangular_solve",
            "lu",
            "geqrf",
            "geqp3",
            "householder_product",
            "eigh",
            "eig",
            "svd",
            "schur",
            "hessenberg",
            "tridiagonal",
            "tridiagonal_solve",
        ],
        Facts(Kind.OTHER, lapack=True),
    ),
}

_UNKNOWN = Facts(Kind.OTHER)


def facts(name: str) -> Facts:
    """The facts of primitive ``name`` (an unknown primitive is stored and never recomputed)."""
    return TABLE.get(name, _UNKNOWN)


class Names(Set[str]):
    """The names of the primitives whose facts satisfy a predicate: a read-only set that follows
    :data:`TABLE` as :func:`declare` changes it.

    A union with another set (``ELEMENTWISE | {"dot_general"}``) follows too. Compared and hashed
    by identity, as a view that changes is.
    """

    def __init__(self, pred: Callable[[Facts], bool]) -> None:
        self._pred = pred
        self._names = {n for n, f in TABLE.items() if pred(f)}

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(self._names))

    def __len__(self) -> int:
        return len(self._names)

    def __or__(self, other: Iterable[Any]) -> Names:  # type: ignore[override]
        return _Union(self, other)

    __ror__ = __or__
    __eq__ = object.__eq__
    __hash__ = object.__hash__

    @classmethod
    def _from_iterable(cls, it: Iterable[Any]) -> frozenset[Any]:  # ``&`` and ``-``: a snapshot
        return frozenset(it)

    def _follow(self, name: str, row: Facts | None) -> None:
        if row is not None and self._pred(row):
            self._names.add(name)
        else:
            self._names.discard(name)

    def __repr__(self) -> str:
        return f"Names({sorted(self._names)})"


class _Union(Names):
    """The union of live sets (:class:`Names`) and fixed ones: follows the live ones."""

    def __init__(self, *parts: Iterable[Any]) -> None:
        flat = [q for p in parts for q in (p._parts if isinstance(p, _Union) else (p,))]
        self._parts = tuple(p if isinstance(p, Names) else frozenset(p) for p in flat)

    def __contains__(self, name: object) -> bool:
        return any(name in p for p in self._parts)

    def __iter__(self) -> Iterator[str]:
        return iter(frozenset().union(*self._parts))

    def __len__(self) -> int:
        return len(frozenset().union(*self._parts))

    def _follow(self, name: str, row: Facts | None) -> None:
        pass  # its live parts follow

    def __repr__(self) -> str:
        return f"Names({sorted(self)})"


#: Elementwise primitives: operands have the result's shape (scalars broadcast).
ELEMENTWISE = Names(lambda f: f.kind is Kind.ELEMENTWISE)
#: Primitives XLA fuses into their consumers (elementwise, layout, generators).
FUSIBLE = Names(lambda f: f.fusible)
#: Primitives XLA evaluates inside the kernel that reads their result, never storing it: the
#: fusible ones, and transposes (XLA's loop fusions read their operand transposed).
STREAMED = FUSIBLE | {"transpose"}
#: Primitives a split region recomputes per chunk even when their result is small.
CHEAP = Names(lambda f: f.cheap)
#: Binary elementwise primitives whose operands may be swapped.
COMMUTATIVE = Names(lambda f: f.commutative)
#: Binary arithmetic a chain of accumulations is built of.
FOLDS = Names(lambda f: f.fold)
#: Reductions over ``axes`` (their monoid in :attr:`Facts.monoid`).
REDUCTIONS = Names(lambda f: f.kind is Kind.REDUCTION)
#: Scans along one ``axis``.
CUMULATIVE = Names(lambda f: f.kind is Kind.CUMULATIVE)
#: LAPACK calls on the CPU.
LAPACK = Names(lambda f: f.lapack)
#: Discrete decisions on their operands' values (comparisons, argmax, sort orders).
DECIDES = Names(lambda f: f.decides)
#: Calls that only wrap a sub-jaxpr.
CALLS = Names(lambda f: f.call)
#: Calls that checkpoint their body.
REMATS = Names(lambda f: f.remat)
#: Sub-jaxprs wrapped with a differentiation rule of their own.
CUSTOM_DIFF = Names(lambda f: f.custom_diff)
#: Operations reading overlapping windows of an axis.
WINDOWED = Names(lambda f: f.windowed)
#: Additions of two operands (a running sum's step).
ADDS = Names(lambda f: f.adds)
#: Primitives that write a piece into their first operand (see ``Facts.updates``).
UPDATES = Names(lambda f: f.updates)
#: Operations that write into their first operand's buffer.
IN_PLACE = Names(lambda f: f.in_place)
#: Loops whose split rule may replay them per chunk of an accumulator carry.
REPLAYS = Names(lambda f: f.replays)
#: Loops over a body (``scan``, ``while``).
LOOPS = Names(lambda f: f.control == "loop")
#: Control flow: loops and branches.
CONTROL = Names(lambda f: f.control is not None)
#: Primitives bound unchanged on tiles of their operands (their parameters hold no length).
SHAPE_FREE = Names(lambda f: f.shape_free or f.kind in (Kind.ELEMENTWISE, Kind.REDUCTION))
#: Primitives that make a value from parameters (``iota``).
GENERATORS = Names(lambda f: f.kind is Kind.GENERATOR)
#: Primitives whose result repeats an operand along new axes (broadcasts).
BROADCASTS = Names(lambda f: f.broadcasts)

#: Every set derived from the table (:func:`declare` keeps each true).
DERIVED = {
    "ELEMENTWISE": ELEMENTWISE,
    "FUSIBLE": FUSIBLE,
    "CHEAP": CHEAP,
    "COMMUTATIVE": COMMUTATIVE,
    "FOLDS": FOLDS,
    "REDUCTIONS": REDUCTIONS,
    "CUMULATIVE": CUMULATIVE,
    "LAPACK": LAPACK,
    "DECIDES": DECIDES,
    "CALLS": CALLS,
    "REMATS": REMATS,
    "CUSTOM_DIFF": CUSTOM_DIFF,
    "WINDOWED": WINDOWED,
    "ADDS": ADDS,
    "UPDATES": UPDATES,
    "IN_PLACE": IN_PLACE,
    "REPLAYS": REPLAYS,
    "LOOPS": LOOPS,
    "CONTROL": CONTROL,
    "SHAPE_FREE": SHAPE_FREE,
    "GENERATORS": GENERATORS,
    "BROADCASTS": BROADCASTS,
}


def declare(name: str, row: Facts | None) -> Facts | None:
    """Add, replace (or, with None, remove) the row of primitive ``name`` in :data:`TABLE` at run
    time, keeping every derived set (:data:`ELEMENTWISE`, :data:`FUSIBLE`, ...) true.

    This is how a primitive defined outside memsafe (a library's ``jax.extend.core.Primitive``)
    is described: an elementwise one (``Facts(Kind.ELEMENTWISE, fusible=True)``) or a reduction
    over ``axes`` (``Facts(Kind.REDUCTION, monoid="sum")``) then splits with no further step, the
    split registry finding its rule by its kind. Write to :data:`TABLE` through this function
    only.

    Args:
        name: the primitive's name (``Primitive.name``).
        row: its facts; None removes its row (it is then an unknown primitive, stored by XLA).

    Returns:
        The row it had (None: none), to restore with another call.
    """
    before = TABLE.pop(name, None)
    if row is not None:
        TABLE[name] = row
    for names in DERIVED.values():
        names._follow(name, row)
    return before


def compares_floats(eqn: Any) -> bool:
    """Whether ``eqn`` decides on floating-point values (a comparison, an argmax, a sort; the
    gradient of a maximum compares each value with the maximum). A value recomputed in another
    program, or in another order of additions, may round otherwise and decide a tie the
    other way."""
    return eqn.primitive.name in DECIDES and any(
        np.issubdtype(getattr(a.aval, "dtype", np.int32), np.inexact) for a in eqn.invars
    )


def contraction_axes(eqn: Any) -> list[tuple[int | None, int | None]]:
    """For each axis of a ``dot_general``'s result, the (lhs, rhs) operand axes it runs along:
    both for a batch axis, one and None for a free axis (the result's order: batch axes, the
    lhs's free axes, the rhs's free axes)."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lrank, rrank = (len(getattr(a.aval, "shape", ())) for a in eqn.invars[:2])
    axes: list[tuple[int | None, int | None]] = [(int(a), int(b)) for a, b in zip(lb, rb)]
    axes += [(d, None) for d in range(lrank) if d not in lc and d not in lb]
    axes += [(None, d) for d in range(rrank) if d not in rc and d not in rb]
    return axes
