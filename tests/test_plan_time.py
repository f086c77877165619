"""What makes a plan cheaper to find without changing it (issue 42): the option probe run
once per process, beside the trace."""

from __future__ import annotations

import pytest

from memsafe import xla


@pytest.fixture
def fresh_probe(monkeypatch):
    """No probe started in this process yet, and a count of the probes run."""
    runs: list[int] = []
    real = xla._probe

    def counted() -> bool:
        runs.append(1)
        return real()

    monkeypatch.setattr(xla, "_probe_done", [])
    monkeypatch.setattr(xla, "_probe", counted)
    return runs


def test_the_option_probe_runs_once_per_process(fresh_probe, monkeypatch):
    monkeypatch.delenv("MEMSAFE_KEEP_YNN", raising=False)
    xla.start_probe()
    xla.start_probe()
    first = xla._cpu_option_supported()
    assert xla._cpu_option_supported() is first
    assert xla.compiler_options("cpu") == (dict(xla.CPU_COMPILER_OPTIONS) if first else {})
    assert len(fresh_probe) == 1


def test_the_probe_is_not_started_where_its_option_is_not_used(fresh_probe, monkeypatch):
    monkeypatch.setenv("MEMSAFE_KEEP_YNN", "1")
    xla.start_probe()
    assert xla._probe_done == [] and fresh_probe == []
    assert xla.compiler_options("cpu") == {}
    assert fresh_probe == []


def test_a_plan_starts_the_probe_before_it_traces(fresh_probe, monkeypatch):
    import jax.numpy as jnp

    import memsafe

    monkeypatch.delenv("MEMSAFE_KEEP_YNN", raising=False)
    started: list[bool] = []
    real_trace = memsafe.build.trace

    def trace(*args, **kwargs):
        started.append(bool(xla._probe_done))
        return real_trace(*args, **kwargs)

    monkeypatch.setattr(memsafe.build, "trace", trace)
    memsafe.jit(lambda x: x * 2, memory_limit="1GiB").plan(jnp.ones(3))
    assert started and started[0]
    assert len(fresh_probe) == 1
