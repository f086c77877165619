"""Shared test set-up: CPU only, strict passes, deterministic hypothesis profile."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# A pass that raises is a bug in that pass: under the tests it fails instead of being skipped.
os.environ.setdefault("MEMSAFE_STRICT", "1")
# A developer's plan store never reaches the tests (tests/test_stored.py sets its own).
os.environ.pop("MEMSAFE_CACHE_DIR", None)

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "memsafe",
    deadline=None,
    max_examples=25,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)
settings.load_profile("memsafe")

# Plan snapshots (tests/plan_snapshot.py), inactive unless MEMSAFE_PLAN_SNAPSHOT names a directory.
pytest_plugins = ["plan_snapshot"]


@pytest.fixture(autouse=True)
def _fresh_program_cache():
    """Each test plans its own programs: memsafe.cache would hand it those of an earlier test
    (tests/test_compile_cache.py tests the cache itself)."""
    from memsafe import cache

    cache.clear()


@pytest.fixture
def ran(monkeypatch):
    """The verified executables memsafe ran, in order (memsafe.program.Program.run recorded)."""
    from memsafe.program import Program

    seen: list = []
    run = Program.run

    def record(self, flat):
        seen.append(self.executable)
        return run(self, flat)

    monkeypatch.setattr(Program, "run", record)
    return seen
