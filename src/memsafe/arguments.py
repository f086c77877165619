"""How a memsafe function's arguments divide into static values and flat dynamic arrays.

As in ``jax.jit``, ``static_argnums`` and ``static_argnames`` (and the two ``donate_*`` forms)
complete each other through the function's signature, so an argument declared static by position
is static when passed by keyword too, and the other way round.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np


def is_static_leaf(x: Any) -> bool:
    """Leaves that are not arrays (strings, callables, None) are static, as in memsafe.inspect."""
    arraylike = jax.Array | np.ndarray | np.generic | float | int | complex | bool
    return not isinstance(x, arraylike | jax.ShapeDtypeStruct)


def aval_of(x: Any) -> jax.ShapeDtypeStruct:
    """The abstract value jax.jit would see, keeping Python scalars weakly typed."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    if isinstance(x, float | int | complex | bool) and not isinstance(x, np.generic):
        return jax.ShapeDtypeStruct((), jax.numpy.asarray(x).dtype, weak_type=True)
    arr = x if hasattr(x, "shape") and hasattr(x, "dtype") else np.asarray(x)
    return jax.ShapeDtypeStruct(
        tuple(arr.shape), arr.dtype, weak_type=getattr(x, "weak_type", False)
    )


def as_tuple(x: Any, kind: type, what: str) -> tuple:
    """``x`` (None, one ``kind`` or a sequence of them) as a tuple; TypeError naming ``what``."""
    if x is None:
        return ()
    items = (x,) if isinstance(x, kind) else x
    try:
        items = tuple(items)
    except TypeError:
        items = (x,)
    bad = [i for i in items if not isinstance(i, kind) or isinstance(i, bool)]
    if bad:
        raise TypeError(f"memsafe.jit: {what} must be {kind.__name__}s, got {x!r}")
    return items


@dataclass(frozen=True)
class _Params:
    """The parameters a signature lets be named or numbered."""

    positional: tuple[str, ...]  # parameters that can be passed by position, in order
    named: frozenset[str]  # parameters that can be passed by keyword
    var_args: bool  # whether there is a *args
    var_kwargs: bool  # whether there is a **kwargs

    @classmethod
    def of(cls, fun: Callable[..., Any]) -> _Params | None:
        try:
            params = list(inspect.signature(fun).parameters.values())
        except (TypeError, ValueError):
            return None
        kinds = inspect.Parameter
        positional = tuple(
            p.name for p in params if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)
        )
        named = frozenset(
            p.name for p in params if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)
        )
        return cls(
            positional,
            named,
            any(p.kind == kinds.VAR_POSITIONAL for p in params),
            any(p.kind == kinds.VAR_KEYWORD for p in params),
        )


def _complete(
    params: _Params | None, fun_name: str, nums: tuple[int, ...], names: tuple[str, ...], what: str
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``nums`` and ``names`` completed through the signature (each named parameter's position,
    each numbered parameter's name); ValueError for a name or number the signature lacks."""
    if params is None:
        return nums, names
    n = len(params.positional)
    if not params.var_args:
        out_of_range = [i for i in nums if not -n <= i < n]
        if out_of_range:
            raise ValueError(
                f"memsafe.jit: {what}_argnums {out_of_range} out of range for {fun_name}, "
                f"which takes {n} positional argument(s) ({', '.join(params.positional)})"
            )
        nums = tuple(i % n for i in nums)
    unknown = [s for s in names if s not in params.named and s not in params.positional]
    if unknown and not params.var_kwargs:
        raise ValueError(
            f"memsafe.jit: {what}_argnames {unknown} are not parameters of {fun_name} "
            f"(parameters: {', '.join(sorted(params.named | set(params.positional)))})"
        )
    by_num = {params.positional[i] for i in nums if 0 <= i < n and params.positional[i]}
    by_name = {params.positional.index(s) for s in names if s in params.positional}
    named_by_num = {s for s in by_num if s in params.named}
    return tuple(sorted(set(nums) | by_name)), tuple(sorted(set(names) | named_by_num))


@dataclass(frozen=True)
class Call:
    """One call's arguments, divided: ``key`` identifies the program (shapes, dtypes, static
    values); ``flat`` are the dynamic arrays; ``rebuild(*flat)`` calls the user's function and
    returns its flat outputs (its output tree lands in ``out_tree[0]``); ``donate`` are the flat
    positions whose buffers may be donated; ``static_args`` (position, value) pairs,
    ``static_kwargs`` (name, value) pairs and ``n_args`` describe the call's static part."""

    key: Any
    flat: list[Any]
    rebuild: Callable[..., list[Any]]
    avals: tuple[jax.ShapeDtypeStruct, ...]
    donate: tuple[int, ...]
    out_tree: list[Any]
    static_args: tuple[tuple[int, Any], ...] = ()
    static_kwargs: tuple[tuple[str, Any], ...] = ()
    n_args: int = 0

    @property
    def family(self) -> Any:
        """``key`` without the arrays' sizes (ranks and dtypes kept): the same program at other
        shapes, such as another batch size."""
        treedef, _, *rest = self.key
        ranks = tuple((len(a.shape), str(a.dtype)) for a in self.avals)
        return (treedef, ranks, *rest)


@dataclass(frozen=True)
class ArgSpec:
    """Which arguments of ``fun`` are static and which donated, completed as ``jax.jit`` does."""

    fun: Callable[..., Any]
    static_argnums: tuple[int, ...] = ()
    static_argnames: tuple[str, ...] = ()
    donate_argnums: tuple[int, ...] = ()
    donate_argnames: tuple[str, ...] = ()

    @classmethod
    def infer(
        cls,
        fun: Callable[..., Any],
        static_argnums: int | Sequence[int] | None = (),
        static_argnames: str | Sequence[str] | None = (),
        donate_argnums: int | Sequence[int] | None = (),
        donate_argnames: str | Sequence[str] | None = (),
    ) -> ArgSpec:
        """The spec of ``fun`` with numbers and names completed through its signature.

        Raises:
            TypeError: a number that is not an int or a name that is not a str.
            ValueError: a number or name ``fun`` has no parameter for, or an argument both
                static and donated.
        """
        params = _Params.of(fun)
        name = getattr(fun, "__name__", repr(fun))
        snums, snames = _complete(
            params,
            name,
            as_tuple(static_argnums, int, "static_argnums"),
            as_tuple(static_argnames, str, "static_argnames"),
            "static",
        )
        dnums, dnames = _complete(
            params,
            name,
            as_tuple(donate_argnums, int, "donate_argnums"),
            as_tuple(donate_argnames, str, "donate_argnames"),
            "donate",
        )
        both = sorted(set(snums) & set(dnums)) + sorted(set(snames) & set(dnames))
        if both:
            raise ValueError(f"memsafe.jit: arguments {both} of {name} are both static and donated")
        return cls(fun, snums, snames, dnums, dnames)

    def split(self, args: tuple, kwargs: dict[str, Any]) -> Call:
        """Divide one call's arguments (see :class:`Call`).

        Raises:
            TypeError: a static argument that is not hashable.
        """
        n_args = len(args)
        static_pos = {i % n_args for i in self.static_argnums if -n_args <= i < n_args}
        static_args = tuple((i, args[i]) for i in sorted(static_pos))
        static_kwargs = tuple(
            sorted((k, v) for k, v in kwargs.items() if k in self.static_argnames)
        )
        dyn_args = [a for i, a in enumerate(args) if i not in static_pos]
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        leaves, treedef = jax.tree_util.tree_flatten((dyn_args, dyn_kwargs))
        donated = self._donated_leaves(args, static_pos, dyn_kwargs, len(leaves))
        static_leaves = tuple((i, x) for i, x in enumerate(leaves) if is_static_leaf(x))
        dynamic = [i for i, x in enumerate(leaves) if not is_static_leaf(x)]
        flat = [leaves[i] for i in dynamic]
        donate = tuple(j for j, i in enumerate(dynamic) if donated[i])
        avals = tuple(aval_of(x) for x in flat)
        key = (treedef, avals, static_args, static_kwargs, static_leaves, donate)
        try:
            hash(key)
        except TypeError as err:
            raise TypeError(f"memsafe.jit: static arguments must be hashable ({err})") from err
        out_tree: list[Any] = []
        rebuild = _rebuilder(
            self.fun, len(leaves), treedef, static_leaves, static_args, static_kwargs, n_args
        )
        return Call(
            key,
            flat,
            _flat_outputs(rebuild, out_tree),
            avals,
            donate,
            out_tree,
            static_args,
            static_kwargs,
            n_args,
        )

    def _donated_leaves(
        self, args: tuple, static_pos: set[int], dyn_kwargs: dict, n_leaves: int
    ) -> list[bool]:
        """For each leaf of ``(dynamic args, dynamic kwargs)``, whether it is donated."""
        if not (self.donate_argnums or self.donate_argnames):
            return [False] * n_leaves
        return _marked(args, static_pos, dyn_kwargs, self.donate_argnums, self.donate_argnames)

    def flags(self, args: tuple, kwargs: dict[str, Any], argnums: int | Sequence[int]) -> tuple:
        """For each dynamic array of a call (``Call.flat``), whether it lies in one of the
        positional arguments ``argnums`` (as ``jax.grad``'s ``argnums`` selects them).

        Raises:
            ValueError: an ``argnums`` entry out of range or naming a static argument.
        """
        n_args = len(args)
        nums = as_tuple(argnums, int, "argnums")
        static_pos = {i % n_args for i in self.static_argnums if -n_args <= i < n_args}
        for i in nums:
            if not -n_args <= i < n_args or i % n_args in static_pos:
                raise ValueError(
                    f"argnums {i} is not a dynamic positional argument of a call with "
                    f"{n_args} positional arguments (static: {sorted(static_pos)})"
                )
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        marks = _marked(args, static_pos, dyn_kwargs, nums, ())
        leaves = jax.tree_util.tree_leaves(
            ([a for i, a in enumerate(args) if i not in static_pos], dyn_kwargs)
        )
        return tuple(m for m, x in zip(marks, leaves) if not is_static_leaf(x))


def _marked(
    args: tuple, static_pos: set[int], dyn_kwargs: dict, nums: Sequence[int], names: Sequence[str]
) -> list[bool]:
    """For each leaf of ``(dynamic args, dynamic kwargs)``, whether its argument is one of the
    positions ``nums`` or the keywords ``names``."""
    n_args = len(args)
    at = {i % n_args for i in nums if -n_args <= i < n_args}
    mask_args = [
        jax.tree_util.tree_map(lambda _, d=i in at: d, a)
        for i, a in enumerate(args)
        if i not in static_pos
    ]
    mask_kwargs = {
        k: jax.tree_util.tree_map(lambda _, d=k in names: d, v) for k, v in dyn_kwargs.items()
    }
    return jax.tree_util.tree_leaves((mask_args, mask_kwargs))


def _rebuilder(
    fun: Callable[..., Any],
    n_leaves: int,
    treedef: Any,
    static_leaves: tuple,
    static_args: tuple,
    static_kwargs: tuple,
    n_args: int,
) -> Callable[..., Any]:
    """The function of the flat dynamic leaves that calls ``fun`` with everything in place and
    returns ``(flat outputs, output tree)``."""
    static_map = dict(static_leaves)
    static_arg_map = dict(static_args)

    def rebuild(*flat_dyn: Any) -> tuple[list[Any], Any]:
        it = iter(flat_dyn)
        full = [static_map[i] if i in static_map else next(it) for i in range(n_leaves)]
        dargs, dkwargs = jax.tree_util.tree_unflatten(treedef, full)
        it_args = iter(dargs)
        call_args = [
            static_arg_map[i] if i in static_arg_map else next(it_args) for i in range(n_args)
        ]
        out = fun(*call_args, **dkwargs, **dict(static_kwargs))
        return jax.tree_util.tree_flatten(out)

    return rebuild


def _flat_outputs(
    rebuild: Callable[..., tuple[list[Any], Any]], out_tree: list[Any]
) -> Callable[..., list[Any]]:
    """``rebuild`` returning its flat outputs only, keeping the output tree in ``out_tree[0]``."""

    def flat_fun(*flat_dyn: Any) -> list[Any]:
        leaves, tree = rebuild(*flat_dyn)
        out_tree[:] = [tree]
        return leaves

    flat_fun.__name__ = "rebuild"
    flat_fun.out_tree = out_tree  # type: ignore[attr-defined]
    return flat_fun
