"""Shared test set-up: CPU only, strict passes, deterministic hypothesis profile."""

from __future__ import annotations

import os
from pathlib import Path

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

#: Tests measured slow (tools/slow_tests.py): marked ``slow`` here, left out of ``make test``.
SLOW_LIST = Path(__file__).with_name("slow.txt")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark the tests :data:`SLOW_LIST` names ``slow`` before ``-m`` selects."""
    lines = (line.strip() for line in SLOW_LIST.read_text().splitlines())
    slow = {line for line in lines if line and not line.startswith("#")}
    for item in items:
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)


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
