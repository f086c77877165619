"""The compile that only measures an over-limit original: on a GPU with XLA's autotuner off (it
allocates buffers of the program's size while compiling), elsewhere memsafe's usual options."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np

import memsafe
from memsafe import xla

jit_module = importlib.import_module("memsafe.jit")  # memsafe.jit is also the function


def test_gpu_measuring_compiles_turn_autotuning_off(monkeypatch):
    monkeypatch.setattr(xla.jax, "default_backend", lambda: "gpu")
    assert xla.measuring_options({"user": 1}) == {"user": 1, "xla_gpu_autotune_level": 0}


def test_cpu_measuring_options_are_memsafes_options():
    assert xla.measuring_options() == xla.merged_options()
    assert "xla_gpu_autotune_level" not in xla.measuring_options()


def _spy(monkeypatch) -> list:
    calls: list = []

    def spy(user=None):
        calls.append(user)
        return xla.merged_options(user)

    monkeypatch.setattr(jit_module, "measuring_options", spy)
    return calls


def _knn(x, y):
    return jax.lax.top_k(-jnp.sum((x[:, None] - y[None]) ** 2, -1), 3)


def test_only_an_original_expected_over_the_limit_is_compiled_to_measure(monkeypatch):
    calls = _spy(monkeypatch)
    x = np.random.default_rng(0).standard_normal((64, 8)).astype(np.float32)
    y = np.random.default_rng(1).standard_normal((4096, 8)).astype(np.float32)
    memsafe.jit(_knn, memory_limit="1GiB")(x, y)  # fits: compiled to run, as jax.jit would
    assert calls == []
    got = memsafe.jit(_knn, memory_limit="2MiB")(x, y)  # 8 MiB of differences: measured only
    assert len(calls) == 1
    np.testing.assert_array_equal(got[1], xla.memsafe_jit(_knn)(x, y)[1])
