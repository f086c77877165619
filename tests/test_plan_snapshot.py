"""tools/plans.py's diff on hand-made snapshots (no JAX, no MEMSAFE_PLAN_SNAPSHOT needed)."""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path
from typing import Any

from tools import plans

NODE = "tests/test_split.py::test_knn"


def _record(**changes: Any) -> dict[str, Any]:
    """A plausible record of a knn program split along its database axis."""
    rec: dict[str, Any] = {
        "node": NODE,
        "scope": "function",
        "function": "knn",
        "avals": ["float32[40,8]", "float32[1003,8]"],
        "limit": 60000,
        "build_s": 0.5,
        "fits_unchanged": False,
        "rules": [{"rule": "pairwise_sqdist", "where": "tests/test_split.py:17:9 (knn)"}],
        "splits": [
            {
                "value": "float32[40, 1003] (add at tests/test_split.py:17:9 (knn))",
                "bytes": 160480,
                "axis": 1,
                "size": 1003,
                "chunk": 100,
                "loops": 11,
                "ops": ["add", "dot_general", "top_k"],
                "sinks": ["top_k"],
                "where": "tests/test_split.py:17:9 (knn)",
            }
        ],
        "passes": [],
        "before": 197104,
        "after": 50392,
        "attempts": [{"chunk_scale": 1.0, "fits": True, "total": 50392}],
    }
    rec.update(changes)
    return rec


def _write(directory: Path, *records: dict[str, Any], name: str = "gw0.jsonl") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    return directory


def _diff(old: Path, new: Path, verbose: bool = False) -> tuple[plans.Summary, str]:
    out = io.StringIO()
    summary = plans.diff(old, new, verbose=verbose, out=out)
    return summary, out.getvalue()


def test_identical_up_to_line_numbers_and_small_footprint_changes(tmp_path: Path) -> None:
    old = _record()
    new = copy.deepcopy(old)
    new["rules"][0]["where"] = "tests/test_split.py:30:2 (knn)"  # the code moved
    new["splits"][0]["value"] = "float32[40, 1003] (add at tests/test_split.py:30:2 (knn))"
    new["after"] = 50500  # +0.2%
    new["build_s"] = 9.0
    a, b = _write(tmp_path / "a", old), _write(tmp_path / "b", new, name="gw1.jsonl")
    summary, text = _diff(a, b)
    assert (summary.programs, summary.identical, summary.changed) == (1, 1, 0)
    assert text.strip() == str(summary)
    summary, text = _diff(a, b, verbose=True)
    assert summary.identical == 1 and "(under 0.5%) after" in text


def test_changed_chunk_is_reported(tmp_path: Path) -> None:
    old = _record()
    new = copy.deepcopy(old)
    new["splits"][0].update(chunk=200, loops=6)
    new["after"] = 80000
    summary, text = _diff(_write(tmp_path / "a", old), _write(tmp_path / "b", new))
    assert (summary.identical, summary.changed) == (0, 1)
    assert "chunk 100 -> 200, loops 11 -> 6" in text
    assert "after: 49.2 KiB -> 78.1 KiB (+58.8%)" in text


def test_a_different_program_under_the_same_plan_is_reported(tmp_path: Path) -> None:
    # Records that carry the digest of the program that runs are identical only where the
    # programs are; a record without one (an older snapshot) compares by its plan alone.
    old = _record(program="0123456789abcdef")
    same, other, older = (copy.deepcopy(old) for _ in range(3))
    other["program"] = "fedcba9876543210"
    del older["program"]
    summary, _ = _diff(_write(tmp_path / "a", old), _write(tmp_path / "b", same))
    assert (summary.identical, summary.changed) == (1, 0)
    summary, text = _diff(_write(tmp_path / "c", old), _write(tmp_path / "d", other))
    assert (summary.identical, summary.changed) == (0, 1)
    assert "program text 0123456789abcdef -> fedcba9876543210" in text
    summary, _ = _diff(_write(tmp_path / "e", older), _write(tmp_path / "f", other))
    assert (summary.identical, summary.changed) == (1, 0)


def test_the_digest_is_the_programs_own() -> None:
    # Two builds of one program in one process give one digest; another program another.
    import jax
    import jax.numpy as jnp
    from plan_snapshot import program_digest

    f = lambda x: jnp.sin(x) * 2
    a, b = (jax.make_jaxpr(f)(jnp.ones(3)) for _ in range(2))
    c = jax.make_jaxpr(lambda x: jnp.cos(x) * 2)(jnp.ones(3))
    assert program_digest(a) == program_digest(b) != program_digest(c)


def test_new_failure_and_programs_on_one_side(tmp_path: Path) -> None:
    other = _record(node="tests/test_split.py::test_other")
    failed = _record(error={"type": "MemoryLimitError", "message": "knn: no rewrite fits\n..."})
    summary, text = _diff(_write(tmp_path / "a", _record()), _write(tmp_path / "b", failed, other))
    assert (summary.programs, summary.changed, summary.newly_failing, summary.only_new) == (
        2,
        1,
        1,
        1,
    )
    assert "newly failing: MemoryLimitError: knn: no rewrite fits" in text
    assert "+ only in new: tests/test_split.py::test_other" in text


def test_occurrences_and_fixture_duplicates(tmp_path: Path) -> None:
    # The same program built twice in one test is two programs; a module fixture set up on two
    # xdist workers is one.
    fixture = _record(node="tests/test_sgpr.py::<module fixture data>", scope="module")
    snap = tmp_path / "s"
    _write(snap, _record(), _record(), fixture)
    _write(snap, fixture, name="gw1.jsonl")
    loaded = plans.load(snap)
    assert sorted(k[4] for k in loaded if k[0] == NODE) == [0, 1]
    assert len(loaded) == 3
