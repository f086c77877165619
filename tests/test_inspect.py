"""memsafe.inspect: kernels, arrays, constants, loops and footprint, checked against XLA."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import memsafe
from examples import seed002
from memsafe.xla import compiler_options, memsafe_jit

X = jax.ShapeDtypeStruct((1024 * 128, 2), jnp.float32)  # seed 002's 1 MiB probe array


def knn(x, y, k=10):
    d = jnp.sum((x[:, None] - y[None]) ** 2, -1)
    return jax.lax.top_k(-d, k)


def test_well_fused_is_one_kernel():
    report = memsafe.inspect(seed002.f_well_fused, X)
    assert [k.opcode for k in report.kernels] == ["fusion"]
    assert report.temporaries == []
    assert report.footprint.temps == 0


def test_sum_jax_is_two_kernels_with_a_temporary_between():
    report = memsafe.inspect(seed002.f_sum_jax, X)
    assert len(report.kernels) == 2
    (temp,) = report.temporaries
    assert (temp.shape, temp.dtype, temp.bytes) == ((131072,), "f32", 524288)
    producer, consumer = report.kernels
    assert temp.producer == producer.name and temp.consumers == [consumer.name]
    assert any(s.function == "f_sum_jax" for s in producer.sources)


def test_naive_knn_has_the_160mb_temporary_between_kernels():
    x = jax.ShapeDtypeStruct((2000, 64), jnp.float32)
    y = jax.ShapeDtypeStruct((20000, 64), jnp.float32)
    for options in ("memsafe", None):
        report = memsafe.inspect(knn, x, y, compiler_options=options)
        sizes = {a.bytes for a in report.temporaries}
        assert 160_000_000 in sizes, options
        big = next(a for a in report.temporaries if a.bytes == 160_000_000)
        assert big.shape == (2000, 20000)
        assert [report.kernel(c).target for c in big.consumers] == ["TopK"]
    # With memsafe's options (YNNPACK fusions off) XLA stores the whole n*m*d difference.
    report = memsafe.inspect(knn, x, y)
    assert report.temporaries[0].bytes == 2000 * 20000 * 64 * 4
    assert "memsafe compiler options" in report.mode


def test_footprint_is_memory_analysis():
    for f, args in [(seed002.f_sum_jax, (X,)), (knn, (jnp.ones((50, 8)), jnp.ones((300, 8))))]:
        report = memsafe.inspect(f, *args)
        stats = memsafe_jit(f).lower(*args).compile().memory_analysis()
        fp = report.footprint
        assert fp.arguments == stats.argument_size_in_bytes
        assert fp.outputs == stats.output_size_in_bytes
        assert fp.temps == stats.temp_size_in_bytes
        assert fp.aliases == stats.alias_size_in_bytes
        assert fp.total == fp.arguments + fp.outputs + fp.temps - fp.aliases + fp.constants


def test_numpy_constant_is_reported_with_its_size_and_counted_in_the_total():
    report = memsafe.inspect(seed002.f_numpy, X)
    (const,) = report.constants
    assert const.bytes == 131072 * 2 * 4 and const.shape == (131072, 2)
    assert const.kind == "folded" and const.closed_over and not const.counted
    assert "f_numpy" in const.where
    stats = memsafe_jit(seed002.f_numpy).lower(X).compile().memory_analysis()
    counted = stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
    assert report.footprint.total == counted + const.bytes
    assert memsafe.inspect(seed002.f, X).constants == []


def test_closed_over_jax_array_is_a_constant():
    table = jnp.arange(100_000, dtype=jnp.float32)

    def g(x):
        return x * table

    report = memsafe.inspect(g, jnp.ones(100_000))
    assert [c.bytes for c in report.constants] == [400_000]
    assert report.footprint.constants >= 400_000


def test_loop_state_and_invariants():
    report = memsafe.inspect(seed002.f_filter_with_temp, jnp.zeros((64, 64, 64)))
    (loop,) = report.loops
    assert loop.trip_count == 5
    kinds = {(report.array(s.array).type, s.invariant) for s in loop.state}
    assert kinds == {("s32[]", False), ("f32[64,64,64]", False), ("c64[64,64,33]", True)}
    body = [k for k in report.kernels if k.parent == loop.name]
    assert sorted(k.target for k in body if k.opcode == "fft") == ["IRFFT", "RFFT"]
    recalc = memsafe.inspect(seed002.f_filter_with_recalc, jnp.zeros((64, 64, 64)))
    assert all(not s.invariant for s in recalc.loops[0].state)


def test_arrays_and_kernels_agree():
    report = memsafe.inspect(seed002.f_fft_multi, jnp.zeros((2, 16, 16, 8)), 3)
    kernels = {k.name: k for k in report.kernels}
    for a in report.arrays:
        assert a.bytes == int(np.prod(a.shape, dtype=np.int64)) * {"f32": 4, "c64": 8}[a.dtype]
        if a.producer:
            assert a.name in kernels[a.producer].outputs
        for c in a.consumers:
            assert a.name in kernels[c].inputs
    assert {a.role for a in report.arrays} == {"parameter", "temporary", "output"}


def test_static_arguments_and_pytrees():
    def f(params, x, power):
        return (x @ params["w"]) ** power

    params = {"w": jnp.ones((8, 4))}
    report = memsafe.inspect(f, params, jnp.ones((3, 8)), 2)
    assert report.arguments == ["f32[8,4]", "f32[3,8]", "static 2"]
    report_kw = memsafe.inspect(f, params, jnp.ones((3, 8)), power=3)
    assert report_kw.arguments[-1] == "power=static 3"


def test_trace_failure_names_function_and_shapes():
    with pytest.raises(TypeError, match="incompatible shapes") as info:
        memsafe.inspect(knn, jnp.ones((3, 4)), jnp.ones((5, 6)))
    note = "memsafe.inspect: while tracing knn at arguments (f32[3,4], f32[5,6])"
    assert note in info.value.__notes__
    with pytest.raises(ValueError, match="compiler_options"):
        memsafe.inspect(knn, jnp.ones((3, 4)), jnp.ones((5, 4)), compiler_options="fast")


def test_mode_is_stated():
    report = memsafe.inspect(seed002.f, X, compiler_options=None)
    assert report.mode == "XLA default compiler options"
    if compiler_options():
        assert "xla_cpu_experimental_ynn_fusion_type" in memsafe.inspect(seed002.f, X).mode


def test_text_report_lists_kernels_arrays_and_footprint():
    report = memsafe.inspect(seed002.f_sum_jax, X)
    text = str(report)
    for k in report.kernels:
        assert k.name in text
    assert "512.0 KiB" in text and "Footprint" in text and "reduction_barrier" in text


def test_svg_edges_carry_byte_sizes(tmp_path):
    report = memsafe.inspect(seed002.f_filter_with_temp, jnp.zeros((64, 64, 64)))
    svg = report.svg()
    assert svg.startswith("<svg")
    labels = [a.type for a in report.temporaries if a.bytes > 1000]
    for a in report.temporaries:
        if a.bytes > 1000 and a.consumers:
            assert a.type in svg
    assert labels and "1.0 MiB" in svg
    assert "body of while.1" in svg or "body of " in svg  # the loop is a cluster
    assert 'stroke="red"' in svg  # the largest temporary is highlighted
    html = report._repr_html_()
    assert "<svg" in html and "loop_invariant_temp" in html
    report.save(str(tmp_path / "r.html"))
    report.save(str(tmp_path / "r.svg"))
    assert (tmp_path / "r.html").read_text().startswith("<!DOCTYPE html>")
    assert (tmp_path / "r.svg").read_text().startswith("<svg")
