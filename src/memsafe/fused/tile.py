"""Equations evaluated on a tile: the region's own equations, bound at the tile's shape.

A kernel program holds a tile of each value: the split axis cut to the streamed columns, each
row axis to the program's rows (:mod:`memsafe.fused.rows`). Most primitives hold no shape in
their parameters and are bound unchanged; ``broadcast_in_dim`` and ``reshape`` get the tile's
shape written in. Other primitives (generators such as ``iota``, slices, gathers, scans, calls)
are not evaluated on tiles: a region holding one is not fused (:class:`NotFused`). Every result
is checked against the tile shape expected of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from memsafe._jax import JaxprEqn, bind_eqn, bind_eqn_with
from memsafe.primitives import SHAPE_FREE, facts


class NotFused(Exception):
    """A region, or one of its equations, is not run as a fused kernel (the message says why)."""


def tileable(eqn: JaxprEqn) -> bool:
    """Whether :func:`bind_tile` evaluates ``eqn``."""
    name = eqn.primitive.name
    return name in SHAPE_FREE or facts(name).shape_param is not None


def tile_shape(shape: tuple[int, ...], sizes: Mapping[int, int]) -> tuple[int, ...]:
    """``shape`` with the lengths ``sizes`` gives by axis."""
    return tuple(sizes.get(k, n) for k, n in enumerate(shape))


def bind_tile(eqn: JaxprEqn, invals: list[Any], shapes: list[tuple[int, ...]]) -> list[Any]:
    """``eqn`` on tile-shaped ``invals``, its results of ``shapes``; raises :class:`NotFused`
    where it cannot be evaluated on the tile."""
    name = eqn.primitive.name
    if not tileable(eqn):
        raise NotFused(f"{name} is not evaluated on tiles")
    shape_param = facts(name).shape_param
    if shape_param is not None:
        params: dict[str, Any] = {shape_param: tuple(shapes[0])}
        if name == "reshape":
            params["dimensions"] = None
        outs = bind_eqn_with(eqn, invals, **params)
    else:
        outs = bind_eqn(eqn, invals)
    for out, shape in zip(outs, shapes):
        if tuple(out.shape) != tuple(shape):
            raise NotFused(f"{name} gives {tuple(out.shape)} on a tile, not {tuple(shape)}")
    return outs
