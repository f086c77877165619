"""The documentation site: its sources (nav, pages, notebooks), the tutorial notebooks executed
(slow), and the built site checked structurally when ``make docs`` has produced ``site/``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SITE = ROOT / "site"
TUTORIALS = sorted((DOCS / "tutorials").glob("*.ipynb"))
#: Tutorials whose pages print a memsafe plan.
PLAN_TUTORIALS = ("knn", "kernel-sums", "sgpr", "attention", "custom-rules")
#: The top-level entries of the site's navigation, as the home page shows them.
NAV = (
    "Home",
    "Getting started",
    "How memsafe works",
    "Tutorials",
    "API reference",
    "FAQ",
    "Changelog",
)


def _nav_files() -> list[str]:
    """The page files the nav of mkdocs.yml lists, in order (read as text: the file's
    ``!!python/name`` tags need mkdocs' own YAML loader)."""
    config = (ROOT / "mkdocs.yml").read_text()
    assert re.search(r"^strict: true$", config, flags=re.M), "mkdocs.yml must set strict: true"
    nav = re.search(r"^nav:\n((?:[ -].*\n|\n)+)", config, flags=re.M)
    assert nav, "mkdocs.yml has no nav"
    return re.findall(r":\s*(\S+\.(?:md|ipynb))\s*$", nav.group(1), flags=re.M)


# -- sources (default suite) ----------------------------------------------------------------------


def test_nav_lists_every_page_and_every_page_exists():
    listed = _nav_files()
    assert listed[0] == "index.md"
    for name in listed:
        assert (DOCS / name).is_file(), f"mkdocs.yml lists {name}, which does not exist"
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*") if p.suffix in (".md", ".ipynb")}
    assert pages == set(listed), f"pages not in the nav: {sorted(pages - set(listed))}"
    assert ("accuracy.md" in listed) == (DOCS / "accuracy.md").is_file()


def test_pages_have_real_content():
    for page in DOCS.rglob("*.md"):
        text = page.read_text()
        assert len(text) > 600, f"{page.name} is nearly empty"
        assert not re.search(r"\b(TODO|TBD|placeholder|lorem ipsum)\b", text, re.I), page.name


def test_tutorials_are_stored_without_outputs_and_check_against_jax_jit():
    """The site executes the notebooks when it is built; what is committed is the source."""
    names = {p.stem for p in TUTORIALS}
    assert {"knn", "kernel-sums", "sgpr", "attention", "inspect", "custom-rules"} <= names
    for path in TUTORIALS:
        nb = json.loads(path.read_text())
        code = [c for c in nb["cells"] if c["cell_type"] == "code"]
        assert code, path.name
        assert all(not c.get("outputs") and c.get("execution_count") is None for c in code)
        source = "".join("".join(c["source"]) for c in code)
        assert "import memsafe" in source
        if path.stem != "inspect":
            assert "jax.jit(" in source, f"{path.name} does not compare with jax.jit"
            assert ".plan(" in source, f"{path.name} does not show a plan"


# -- the built site (default suite, when site/ exists) --------------------------------------------

needs_site = pytest.mark.skipif(
    not (SITE / "index.html").is_file(), reason="site/ not built (run `make docs`)"
)


def _body(page: Path) -> str:
    """The page's HTML without its <style> and <script> blocks (notebook CSS names stderr)."""
    html = page.read_text(encoding="utf-8")
    return re.sub(r"<(style|script)\b.*?</\1>", "", html, flags=re.S | re.I)


@needs_site
def test_home_page_has_the_navigation():
    body = _body(SITE / "index.html")
    links = re.findall(r'class="md-nav__link[^"]*"[^>]*>(.*?)</', body, flags=re.S)
    labels = {re.sub(r"<[^>]+>|\s+", " ", x).strip() for x in links}
    labels |= set(re.findall(r'<label class="md-nav__link"[^>]*>\s*([^<]+?)\s*<', body))
    text = re.sub(r"<[^>]+>", " ", body)
    for entry in NAV:
        assert entry in labels or entry in text, f"home page lacks the nav entry {entry!r}"
    assert "memsafe.jit" in text
    if (DOCS / "accuracy.md").is_file():
        assert "Accuracy" in text


@needs_site
@pytest.mark.parametrize("name", [p.stem for p in TUTORIALS])
def test_rendered_tutorial_ran_without_errors(name):
    page = SITE / "tutorials" / name / "index.html"
    assert page.is_file(), f"{name} was not rendered"
    body = _body(page)
    assert "jp-OutputArea-output" in body, f"{name} has no outputs: was it executed?"
    assert "Traceback" not in body
    assert not re.search(r'data-mime-type="application/vnd\.jupyter\.stderr"', body)
    assert "ansi-red-fg" not in body  # how nbconvert colours an error's name
    if name in PLAN_TUTORIALS:
        assert "memsafe plan (limit" in body


@needs_site
def test_pipeline_diagram_and_api_reference_are_rendered():
    pipeline = _body(SITE / "how-it-works" / "index.html")
    diagram = re.search(r'<div class="graphviz"[^>]*>(<svg.*?</svg>)</div>', pipeline, flags=re.S)
    assert diagram, "the pipeline diagram was not rendered to SVG"
    for step in ("match and replace", "split", "schedule", "verify", "MemoryLimitError"):
        assert step in diagram.group(1)
    api = _body(SITE / "api" / "jit" / "index.html")
    for name in ("memory_limit", "static_argnames", "backward_plan", "MemoryLimitError"):
        assert name in api
    for page in ("plan", "inspect", "rules", "errors"):
        assert (SITE / "api" / page / "index.html").is_file()


# -- the notebooks themselves (slow suite) --------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("path", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_tutorial_notebook_executes(path, tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError on the first failing cell
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert outputs
    assert not [o for o in outputs if o.get("output_type") == "error"]


# -- a headless browser, where one is installed (slow suite) --------------------------------------


def _browser() -> str | None:
    import shutil

    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.mark.slow
@needs_site
@pytest.mark.skipif(_browser() is None, reason="no headless chromium installed")
@pytest.mark.parametrize("page", ["index.html", "tutorials/knn/index.html"])
def test_page_renders_in_a_headless_browser(page, tmp_path):
    """The browser loads the page and runs its scripts; the rendered DOM has the navigation and,
    for a tutorial, the executed output; the screenshot is a real image, not a blank one."""
    import subprocess

    url = (SITE / page).as_uri()
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000"]
    dom = subprocess.run(
        [_browser(), *flags, "--dump-dom", url], capture_output=True, text=True, timeout=120
    ).stdout
    assert "md-nav" in dom and "Getting started" in dom
    if page.startswith("tutorials/"):
        assert "memsafe plan (limit" in dom and "Traceback" not in dom
    shot = tmp_path / "page.png"
    subprocess.run(
        [_browser(), *flags, "--window-size=1280,900", f"--screenshot={shot}", url],
        capture_output=True,
        timeout=120,
    )
    data = shot.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 20_000, len(data)
