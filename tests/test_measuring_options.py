"""The compile that only measures an over-limit original: on a GPU with XLA's autotuner off (it
allocates buffers of the program's size while compiling), elsewhere memsafe's usual options."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import memsafe
from memsafe import compiling, search, xla


def test_gpu_measuring_compiles_turn_autotuning_off(monkeypatch):
    monkeypatch.setattr(xla.jax, "default_backend", lambda: "gpu")
    assert xla.measuring_options({"user": 1}) == {
        "user": 1,
        "xla_gpu_autotune_level": 0,
        "xla_gpu_experimental_enable_fusion_autotuner": False,
    }


def test_every_gpu_compile_turns_the_fusion_autotuner_off(monkeypatch):
    """XLA's fusion autotuner compiled one reduction fusion for minutes on an H100: memsafe's
    programs compile without it on a GPU, unless the user's options turn it back on."""
    monkeypatch.setattr(xla.jax, "default_backend", lambda: "gpu")
    assert xla.merged_options() == {"xla_gpu_experimental_enable_fusion_autotuner": False}
    back_on = {"xla_gpu_experimental_enable_fusion_autotuner": True}
    assert xla.merged_options(back_on) == back_on
    assert "xla_gpu_autotune_level" not in xla.merged_options()  # the program run stays tuned
    assert not any(k.startswith("xla_gpu") for k in xla.compiler_options("cpu"))


def test_cpu_measuring_options_are_memsafes_options():
    assert xla.measuring_options() == xla.merged_options()
    assert "xla_gpu_autotune_level" not in xla.measuring_options()


def _spy(monkeypatch) -> list:
    calls: list = []

    def spy(user=None):
        calls.append(user)
        return xla.merged_options(user)

    monkeypatch.setattr(search, "measuring_options", spy)
    monkeypatch.setattr(compiling, "measuring_options", spy)
    return calls


def _knn(x, y):
    return jax.lax.top_k(-jnp.sum((x[:, None] - y[None]) ** 2, -1), 3)


def test_only_an_original_expected_over_the_limit_is_compiled_to_measure(monkeypatch):
    calls = _spy(monkeypatch)
    x = np.random.default_rng(0).standard_normal((64, 8)).astype(np.float32)
    y = np.random.default_rng(1).standard_normal((32768, 8)).astype(np.float32)
    memsafe.jit(_knn, memory_limit="1GiB")(x, y)  # fits: compiled to run, as jax.jit would
    assert calls == []
    got = memsafe.jit(_knn, memory_limit="3MiB")(x, y)  # 8 MiB of distances: measured only
    assert calls
    np.testing.assert_array_equal(got[1], xla.memsafe_jit(_knn)(x, y)[1])


def test_the_attempt_that_fits_is_compiled_again_to_run(monkeypatch):
    """Where measuring differs from running (a GPU), attempts compile to measure and the one
    that fits compiles again with the usual options; its footprint is the plan's."""
    gpu_like = {**xla.merged_options(), "xla_gpu_autotune_level": 0}  # ignored by the CPU
    for module in (search, compiling):
        monkeypatch.setattr(
            module, "measuring_options", lambda user=None: {**gpu_like, **(user or {})}
        )
    compiled: list[str] = []
    real = search.compile_measured

    def spy(fun, avals, options, donate, hidden, what):
        compiled.append(f"{what[1]}: {'measure' if 'xla_gpu_autotune_level' in options else 'run'}")
        return real(fun, avals, options, donate, hidden, what)

    monkeypatch.setattr(search, "compile_measured", spy)
    x = np.random.default_rng(2).standard_normal((48, 8)).astype(np.float32)
    y = np.random.default_rng(3).standard_normal((32768, 8)).astype(np.float32)
    f = memsafe.jit(lambda x, y: _knn(x, y), memory_limit="3MiB")
    got = f(x, y)
    np.testing.assert_array_equal(got[1], xla.memsafe_jit(_knn)(x, y)[1])
    assert compiled[0].startswith("attempt 1") and compiled[0].endswith("measure"), compiled
    assert compiled[-1].endswith(", tuned: run"), compiled
    plan = f.plan(x, y)
    assert not plan.fits_unchanged and plan.after.total <= 3 * 2**20, plan
