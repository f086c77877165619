"""The HLO text parser: shapes, instructions, metadata, on text JAX prints."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from examples import seed002
from memsafe.inspect.hlo import HloParseError, parse_hlo, parse_shape
from memsafe.xla import memsafe_jit


def test_array_and_tuple_shapes():
    shape, used = parse_shape("f32[131072,2]{1,0} parameter(0)")
    assert (shape.dtype, shape.dims, shape.layout, shape.bytes) == (
        "f32",
        (131072, 2),
        (1, 0),
        1 << 20,
    )
    assert used == len("f32[131072,2]{1,0}")
    tup, _ = parse_shape("(s32[], f32[64,64,64]{2,1,0}, /*index=2*/c64[64,64,33]{2,1,0}) while(")
    assert [e.dtype for e in tup.elements] == ["s32", "f32", "c64"]
    assert tup.bytes == 4 + 64**3 * 4 + 64 * 64 * 33 * 8
    assert parse_shape("pred[]")[0].bytes == 1
    assert parse_shape("bf16[3,5]")[0].bytes == 30


def test_bad_text_is_rejected():
    with pytest.raises(HloParseError, match="HloModule"):
        parse_hlo("not hlo")
    with pytest.raises(HloParseError):
        parse_shape("???")


def test_module_instructions_and_source_lines():
    x = jnp.zeros((1024, 2))
    module = parse_hlo(memsafe_jit(seed002.f_sum_jax).lower(x).compile().as_text())
    entry = module.entry_computation
    assert entry.is_entry
    ops = [i.opcode for i in entry.instructions]
    assert ops[0] == "parameter" and ops.count("fusion") == 2
    fusions = [i for i in entry.instructions if i.opcode == "fusion"]
    assert all(f.fusion_kind == "kLoop" and f.called("calls") for f in fusions)
    reduce_fusion = fusions[0]
    assert reduce_fusion.operands == [entry.instructions[0].name]
    # The reduce inside the fusion names seed002.py and the line of jnp.sum.
    inner = module.computations[reduce_fusion.called("calls")[0]]
    reduce = next(i for i in inner.instructions if i.opcode == "reduce")
    assert reduce.int_list("dimensions") == (1,)
    assert reduce.source is not None and reduce.source.file.endswith("seed002.py")
    assert reduce.source.function == "f_sum_jax"
    # kvec_mesh's iota: innermost frame first, then its caller.
    iota = next(i for i in inner.instructions if i.opcode == "iota")
    assert [s.function for s in iota.stack[:2]] == ["kvec_mesh", "f_sum_jax"]


def test_while_attributes():
    module = parse_hlo(memsafe_jit(seed002.f_for).lower(jnp.zeros((8, 2))).compile().as_text())
    whiles = [
        i for c in module.computations.values() for i in c.instructions if i.opcode == "while"
    ]
    assert len(whiles) == 1
    w = whiles[0]
    assert w.called("body")[0] in module.computations
    assert w.called("condition")[0] in module.computations
    assert w.shape.is_tuple


def test_default_compiler_options_parse_too():
    module = parse_hlo(jax.jit(seed002.f_stored).lower(jnp.zeros((1024, 2))).compile().as_text())
    assert module.entry_computation.root.is_root
