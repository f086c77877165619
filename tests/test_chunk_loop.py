"""The chunk loop's emission (memsafe.split.loop): where the chunk body reads nothing of the
carry, every full chunk runs inside the loop.

A forward region and the backward region that recomputes it compute the same first chunk from the
same operands. Computed before each loop, at the program's top level, XLA's CSE merges the two and
keeps the forward's chunk alive until the backward: one chunk per split region that survives the
rematerialization the split was for.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import memsafe
from benchmarks import train_step_model as gpt
from memsafe.split.loop import Fold, Written, chunked
from memsafe.xla import Footprint, memsafe_jit
from tests.agree import assert_like_jit

#: A 4-block GPT gradient (a Python loop over the blocks) whose attention probabilities the split
#: recomputes head by head in the backward.
SMALL = gpt.Config(batch=1, length=512, width=64, heads=4, blocks=4, vocab=64)


@pytest.mark.slow  # 5 compile attempts, about a minute on 2 cores
def test_recomputed_first_chunks_are_not_kept_from_the_forward():
    """Under arguments + outputs + a quarter of jax.jit's temporaries it fits (12.1 MiB); with the
    first chunk before each loop it was refused at 17.2 MiB, 2 heads' probabilities per block
    kept from the forward."""
    params, ids = gpt.init(SMALL), gpt.tokens(SMALL)
    grad = jax.value_and_grad(gpt.loss)
    plain = Footprint.from_compiled(memsafe_jit(grad).lower(params, ids).compile())
    limit = plain.arguments + plain.outputs + plain.temps // 4
    safe = memsafe.jit(grad, memory_limit=limit)
    assert safe.plan(params, ids).after.total <= limit
    assert_like_jit(safe(params, ids), grad, params, ids)


def test_the_first_chunk_runs_in_the_scan_and_starts_the_carry():
    """A sum over 4 chunks and values written per chunk: one scan of 4 steps, nothing of chunk
    shape computed outside it, and the answers of the unsplit program."""
    x = jnp.arange(24.0).reshape(8, 3)

    def body(start, n, ops, fed):
        rows = jax.lax.dynamic_slice_in_dim(ops[0], start, n, 0)
        return ([rows.sum(0)], ()), [rows * 2]

    def run(x):
        carry = Fold(sinks=((None, _Sum()),))
        written = Written(values=(None,), axes=(0,))
        return chunked(body, 8, 2, [x], carry, written)

    (parts, _), (doubled,) = run(x)
    np.testing.assert_array_equal(parts[0], x.sum(0))
    np.testing.assert_array_equal(doubled, x * 2)
    top = jax.make_jaxpr(run)(x).jaxpr.eqns
    assert [e.params["length"] for e in top if e.primitive.name == "scan"] == [4]
    assert not any(e.primitive.name == "dynamic_slice" for e in top)
    # the step number is carried, not scanned over: XLA stores an index array for the whole
    # loop (fuzz seed 542, whose budget it exceeded by 93 bytes)
    (scan,) = [e for e in top if e.primitive.name == "scan"]
    assert scan.params["num_consts"] + scan.params["num_carry"] == len(scan.invars)
    assert not any(e.primitive.name == "iota" for e in top)


class _Sum:
    """A stand-in sink: partials added."""

    class reducer:  # mirrors Sink.reducer
        @staticmethod
        def fold(eqn, acc, new):
            return acc + new
