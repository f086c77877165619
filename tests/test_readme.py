"""The README and ``make demo`` agree: one problem size, and the numbers the README quotes are
the ones the demo computes (footprints, chunks, timeline peaks; times are the machine's)."""

from __future__ import annotations

from pathlib import Path

import jax

import memsafe
from memsafe import demo
from memsafe.limits import format_bytes
from memsafe.xla import Footprint

README = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")


def test_readme_quotes_the_demos_size_and_limit():
    size = f"n={demo.N_QUERIES:,} queries, m={demo.N_POINTS:,} points, d={demo.DIM}"
    assert size in README
    assert f'memory_limit="{demo.LIMIT}"' in README
    assert f"f32[{demo.N_POINTS},{demo.DIM}]" in README  # the command-line example too


def test_readme_numbers_are_what_the_demo_computes():
    args = demo.knn_arguments()
    report = memsafe.inspect(demo.knn, *args, memory_limit=demo.LIMIT)
    default = Footprint.from_compiled(jax.jit(demo.knn).lower(*args).compile())
    plan = report.plan
    quoted = {
        "jax.jit, buffers XLA accounts for": f"needs {format_bytes(report.footprint.total)}",
        "jax.jit, default CPU fusions": f"{format_bytes(default.total)} with its default",
        "chunks": f"into {plan.splits[0].loops} chunks",
        "memsafe footprint": f"footprint of {format_bytes(plan.after.total)}",
        "timeline peaks": " and ".join(format_bytes(t.peak) for t in report.timelines),
    }
    for what, text in quoted.items():
        assert text in " ".join(README.split()), f"README's {what} is not {text!r}"
