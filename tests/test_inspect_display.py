"""How reports and plans show in notebooks and terminals: scoped HTML fragments, short reprs,
notebook cells and frozen frames in source lines, costs said as costs, the splittable finding."""

from __future__ import annotations

import sys
import types
from html.parser import HTMLParser

import jax
import jax.numpy as jnp

import memsafe
from examples import seed002
from examples.attention import attention
from memsafe.display import ROOT_CLASS, selectors
from memsafe.inspect.hlo import Instruction, Shape, Source
from memsafe.plan import RuleRecord
from memsafe.sources import display_file, short_location, shorten_paths

X = jax.ShapeDtypeStruct((1024 * 128, 2), jnp.float32)


def knn(x, y):
    return jax.lax.top_k(-jnp.sum((x[:, None] - y[None]) ** 2, -1), 5)


KNN_ARGS = (
    jax.ShapeDtypeStruct((200, 64), jnp.float32),
    jax.ShapeDtypeStruct((3000, 64), jnp.float32),
)


#: HTML elements without an end tag.
VOID = frozenset({"br", "hr", "img", "input", "meta", "link", "col", "wbr"})


class _Structure(HTMLParser):
    """The tags of an HTML text, its root element's classes, and its style sheets."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.root_classes: list[str] = []
        self.styles: list[str] = []
        self.depth = 0
        self.closed_at_zero = 0
        self._in_style = False

    def handle_starttag(self, tag, attrs):
        if not self.tags:
            self.root_classes = (dict(attrs).get("class") or "").split()
        self.tags.append(tag)
        self._in_style = tag == "style"
        self.depth += tag not in VOID

    def handle_startendtag(self, tag, attrs):  # <path .../> in SVG: opened and closed
        self.tags.append(tag)

    def handle_endtag(self, tag):
        self.depth -= 1
        self._in_style = False
        if self.depth == 0:
            self.closed_at_zero += 1

    def handle_data(self, data):
        if self._in_style:
            self.styles.append(data)


def _check_fragment(html: str) -> str:
    """The fragment is one element, with no document parts, every style rule under its class."""
    parser = _Structure()
    parser.feed(html)
    assert not {"html", "head", "body", "meta", "link", "script"} & set(parser.tags)
    assert parser.tags[0] == "div" and parser.closed_at_zero == 1  # one root element
    assert ROOT_CLASS in parser.root_classes
    (scope,) = [c for c in parser.root_classes if c != ROOT_CLASS]
    assert parser.styles
    for style in parser.styles:
        for selector in selectors(style):
            for part in selector.split(","):
                assert part.strip().startswith(f".{scope}"), part
    return scope


def test_report_html_is_a_fragment_with_styles_scoped_to_it():
    report = memsafe.inspect(seed002.f_sum_jax, X)
    first, second = _check_fragment(report._repr_html_()), _check_fragment(report._repr_html_())
    assert first != second  # two displays on one page do not share a class
    assert "reduction_barrier" in report._repr_html_()
    page = report.html()
    assert page.startswith("<!DOCTYPE html>") and "<body" in page  # what save() writes


def test_plan_html_is_a_fragment_with_footprints_and_splits():
    safe = memsafe.jit(knn, memory_limit="4MiB")
    plan = safe.plan(*KNN_ARGS)
    html = plan._repr_html_()
    _check_fragment(html)
    assert "before" in html and "after" in html and "limit 4.0 MiB" in html
    assert "split" in html and "test_inspect_display.py" in html
    assert "/tests/test_inspect_display.py" not in html  # directories dropped


def test_reprs_are_short_and_informative():
    report = memsafe.inspect(knn, *KNN_ARGS)
    text = repr(report)
    assert len(text) < 300 and "knn" in text and "largest temporary" in text
    plan = memsafe.jit(knn, memory_limit="4MiB").plan(*KNN_ARGS)
    text = repr(plan)
    assert len(text) < 200 and "limit 4.0 MiB" in text and "1 split," in text and "->" in text


def test_a_rule_that_costs_memory_says_so():
    record = RuleRecord("pairwise_sqdist", "knn.py:3", bytes_saved=-82_000, flops_saved=-4_000)
    text = record.describe()
    assert "costs 80.1 KiB" in text and "4e+03 more flops" in text
    assert "saves -" not in text and "-80" not in text
    assert "saves 1.0 KiB" in RuleRecord("r", "", bytes_saved=1024).describe()


# -- source lines ----------------------------------------------------------------------------------


def test_notebook_cells_are_named_by_their_number(monkeypatch):
    assert display_file("<ipython-input-12-0a1b2c3d4e5f>") == "cell [12]"
    cell = "/tmp/ipykernel_4242/3170521849.py"
    assert display_file(cell) == "notebook cell"  # no IPython running: the number is unknown
    shell = types.SimpleNamespace(compile=types.SimpleNamespace(_filename_map={cell: 7}))
    fake = types.ModuleType("IPython")
    fake.get_ipython = lambda: shell
    monkeypatch.setitem(sys.modules, "IPython", fake)
    assert display_file(cell) == "cell [7]"
    assert short_location(f"{cell}:3:8 (loss)") == "cell [7]:3:8 (loss)"
    assert short_location("/home/me/project/knn.py:12 (knn)") == "knn.py:12 (knn)"
    assert (
        shorten_paths(f"split f32[9] (add at {cell}:3:8 (f))")
        == "split f32[9] (add at cell [7]:3:8 (f))"
    )


def test_frozen_frames_are_skipped_to_the_users_frame():
    frames = (Source("<frozen runpy>", 88, "_run_code"), Source("/w/demo.py", 30, "knn"))
    inst = Instruction("f", Shape("f32", (2,)), "fusion", [], "", "main", stack=frames)
    assert inst.source == frames[1]
    only_frozen = Instruction("g", Shape("f32", (2,)), "fusion", [], "", "main", stack=frames[:1])
    assert only_frozen.source is None


def test_demo_source_lines_name_the_demo_not_runpy():
    from memsafe import demo

    report = memsafe.inspect(demo.knn, *KNN_ARGS)
    text = str(report)
    assert "<frozen" not in text and "demo.py:" in text


# -- the finding that points to memsafe.jit --------------------------------------------------------


def test_attention_temporaries_are_found_splittable():
    q = jax.ShapeDtypeStruct((2, 2048, 32), jnp.float32)
    report = memsafe.inspect(attention, q, q, q)
    (finding,) = report.finding("splittable_temporary")
    assert finding.fixed_by_memsafe_jit and finding.bytes == 32 << 20
    assert "size 2048" in finding.message and "memsafe.jit(f, memory_limit=" in finding.advice
    assert len(finding.arrays) >= 2  # the scores and what is computed from them: one finding
    assert "splittable_temporary" in str(report)


def test_small_temporaries_are_not_reported_splittable():
    report = memsafe.inspect(knn, *KNN_ARGS)  # the 146 MiB difference is most of the footprint
    small = memsafe.inspect(seed002.f_sum_jax, X)  # a 512 KiB temporary
    assert small.finding("splittable_temporary") == []
    assert report.finding("splittable_temporary")[0].arrays[0] == report.temporaries[0].name


def test_finding_quotes_the_plan_when_inspect_is_given_a_limit():
    q = jax.ShapeDtypeStruct((2, 2048, 32), jnp.float32)
    report = memsafe.inspect(attention, q, q, q, memory_limit="16MiB")
    (finding,) = report.finding("splittable_temporary")
    assert "At memory_limit=16.0 MiB it did: split" in finding.advice
