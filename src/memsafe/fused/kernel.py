"""The ``pallas_call`` of a fused region: a grid over tiles of its row axes, each program
streaming the split axis through the tile body it is given.

Each operand's block holds the program's rows (its row axes cut to their tiles) and the whole
split axis; the body loads one tile of the split axis at a time (``pl.ds``), so a program never
holds more than a tile of any value the region computes. Each result's block holds the
program's rows. Row tiles past the end of a row axis compute garbage rows, which Pallas drops
when it writes the block (rows are independent: no equation reduces over a row axis).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from memsafe._jax import Var
from memsafe.fused.rows import RowAxis
from memsafe.fused.tile import tile_shape

#: A tile body: (operands read whole along the split axis, by value; a function giving the
#: streamed operands' tiles from a start along it) -> the kernel's results on the program's rows.
Body = Callable[[dict[Var, Any], Callable[[Any], dict[Var, Any]]], list[Any]]


@dataclass(frozen=True)
class Layout:
    """How a fused region's values are cut into tiles.

    Attributes:
        size: length of the split axis.
        cols: length of its tiles (at most ``size``).
        split_at: the split axis of each value carrying it.
        rows: the row axes.
        tiles: the tile length of each row axis.
    """

    size: int
    cols: int
    split_at: Mapping[Var, int]
    rows: tuple[RowAxis, ...]
    tiles: tuple[int, ...]

    @property
    def grid(self) -> tuple[int, ...]:
        """Programs along each row axis."""
        return tuple(-(-r.size // t) for r, t in zip(self.rows, self.tiles))

    def row_dims(self, v: Var) -> dict[int, int]:
        """Position of each row axis ``v`` carries -> the row axis's index."""
        return {r.at[v]: k for k, r in enumerate(self.rows) if v in r.at}

    def block(self, v: Var) -> tuple[int, ...]:
        """Shape of ``v`` in one program: its row axes cut to their tiles."""
        return tile_shape(v.aval.shape, {a: self.tiles[k] for a, k in self.row_dims(v).items()})

    def shape(self, v: Var) -> tuple[int, ...]:
        """Shape of ``v`` on a tile: rows and the split axis both cut."""
        sizes = {a: self.tiles[k] for a, k in self.row_dims(v).items()}
        if v in self.split_at:
            sizes[self.split_at[v]] = self.cols
        return tile_shape(v.aval.shape, sizes)

    def tile_at(self, j: Any) -> tuple[Any, Any]:
        """(start, fresh) of the ``j``-th tile of the split axis: the last one ends at the
        axis's end, ``fresh`` marks its positions no earlier tile held."""
        j = jnp.asarray(j, jnp.int32)
        start = jnp.minimum(j * self.cols, self.size - self.cols)
        fresh = start + lax.iota(jnp.int32, self.cols) >= j * self.cols
        return start, fresh

    @property
    def steps(self) -> int:
        """Tiles of the split axis each program streams."""
        return -(-self.size // self.cols)


def stream(layout: Layout, step: Callable[[Any, Any], Any]) -> Any:
    """``step(None, 0)`` (the first tile's state), then ``state = step(state, j)`` for the other
    tiles, in order, in one loop."""
    state = step(None, 0)
    if layout.steps > 1:
        state = lax.fori_loop(1, layout.steps, lambda j, s: step(s, j), state)
    return state


def _spec(layout: Layout, v: Var) -> Any:
    if not v.aval.shape:
        return pl.BlockSpec((1,), lambda *ids: (0,))
    dims = layout.row_dims(v)
    rank = len(v.aval.shape)

    def index(*ids: Any) -> tuple[Any, ...]:
        return tuple(ids[dims[a]] if a in dims else 0 for a in range(rank))

    return pl.BlockSpec(layout.block(v), index)


def call(
    layout: Layout,
    inputs: tuple[Var, ...],
    outputs: tuple[Var, ...],
    body: Body,
    interpret: bool,
) -> Callable[[list[Any]], list[Any]]:
    """The kernel as a function of the operands' values (``inputs`` order) giving the results
    (``outputs``' shapes and dtypes; each carries every row axis).

    Args:
        layout: the tiles.
        inputs: the values the kernel reads.
        outputs: values of the shapes and dtypes it writes.
        body: what one program computes from its blocks.
        interpret: run Pallas in interpret mode.

    Returns:
        The function running the ``pallas_call``.
    """
    n_in = len(inputs)

    def kernel(*refs: Any) -> None:
        fixed: dict[Var, Any] = {}
        streamed: dict[Var, Any] = {}
        for v, ref in zip(inputs, refs[:n_in]):
            if v in layout.split_at:
                streamed[v] = ref
            else:
                fixed[v] = ref[...] if v.aval.shape else jnp.reshape(ref[...], ())

        def load(start: Any) -> dict[Var, Any]:
            return {
                v: ref[
                    tuple(
                        pl.ds(start, layout.cols) if a == layout.split_at[v] else slice(None)
                        for a in range(len(v.aval.shape))
                    )
                ]
                for v, ref in streamed.items()
            }

        for ref, val in zip(refs[n_in:], body(fixed, load)):
            ref[...] = val.astype(ref.dtype)

    fused = pl.pallas_call(
        kernel,
        grid=layout.grid,
        in_specs=[_spec(layout, v) for v in inputs],
        out_specs=[_spec(layout, v) for v in outputs],
        out_shape=[jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in outputs],
        interpret=interpret,
    )

    def run(operands: list[Any]) -> list[Any]:
        ops = [jnp.reshape(x, (1,)) if not v.aval.shape else x for v, x in zip(inputs, operands)]
        return list(fused(*ops))

    return run
