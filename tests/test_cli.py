"""The command line (memsafe inspect ...) and the demo."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import jax.numpy as jnp
import pytest

from memsafe import demo
from memsafe.cli import UsageError, main, parse_arg

KNN = textwrap.dedent(
    """
    import jax
    import jax.numpy as jnp

    def knn(x, y, k=10):
        d = jnp.sum((x[:, None] - y[None]) ** 2, -1)
        return jax.lax.top_k(-d, k)
    """
)


@pytest.fixture
def knn_file(tmp_path):
    path = tmp_path / "knn_user.py"
    path.write_text(KNN)
    return path


def test_parse_arg():
    s = parse_arg("f32[2000,64]")
    assert s.shape == (2000, 64) and s.dtype == jnp.float32
    assert parse_arg("bf16[]").shape == ()
    assert parse_arg("s32[3]").dtype == jnp.int32
    assert parse_arg("10") == 10 and parse_arg("'ij'") == "ij"
    for bad in ("f32[2000,a]", "f32[2000,64", "q7[3]", "nonsense("):
        with pytest.raises(UsageError):
            parse_arg(bad)


def test_inspect_file_function_writes_svg_and_html(knn_file, tmp_path, capsys):
    svg, page = tmp_path / "k.svg", tmp_path / "k.html"
    code = main(
        [
            "inspect",
            f"{knn_file}:knn",
            "--arg",
            "f32[200,16]",
            "--arg",
            "f32[3000,16]",
            "--kwarg",
            "k=5",
            "--svg",
            str(svg),
            "--html",
            str(page),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "knn(f32[200,16], f32[3000,16], k=static 5)" in out
    assert "2.3 MiB" in out  # the f32[200,3000] distances between kernels
    assert svg.read_text().startswith("<svg") and "2.3 MiB" in svg.read_text()
    assert "<svg" in page.read_text()


def test_module_function_and_xla_defaults(capsys):
    code = main(["inspect", "examples.seed002:f_sum_jax", "--arg", "f32[1024,2]", "--xla-defaults"])
    assert code == 0
    assert "XLA default compiler options" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["inspect", "KNN:knn", "--arg", "f32[2,a]"], "malformed"),
        (["inspect", "no_such_module_xyz:f"], "cannot import module"),
        (["inspect", "missing_file.py:f"], "no such file"),
        (["inspect", "examples.seed002"], "FILE.py:FUNCTION"),
        (["inspect", "examples.seed002:nope"], "no attribute"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_usage_errors_are_not_tracebacks(argv, message, knn_file, capsys):
    argv = [a.replace("KNN", str(knn_file)) for a in argv]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_trace_failure_is_reported(knn_file, capsys):
    code = main(["inspect", f"{knn_file}:knn", "--arg", "f32[3,4]", "--arg", "f32[5,6]"])
    assert code == 1
    err = capsys.readouterr().err
    assert "TypeError: sub got incompatible shapes" in err
    assert "while tracing knn at arguments (f32[3,4], f32[5,6])" in err


def test_python_dash_m(knn_file):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "memsafe",
            "inspect",
            f"{knn_file}:knn",
            "--arg",
            "f32[20,4]",
            "--arg",
            "f32[30,4]",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "Kernels" in result.stdout


def test_demo_prints_the_knn_report_and_writes_html(tmp_path, capsys):
    demo.main(["--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "1,600,000,000" in out or "1.5 GiB" in out  # the n x m distance matrix
    assert "<frozen" not in out and "demo.py:" in out  # the user's lines, not runpy's
    assert "Memory timeline, jax.jit" in out and "Memory timeline, memsafe.jit" in out
    assert (tmp_path / "demo_knn_report.html").read_text().startswith("<!DOCTYPE html>")


def test_plan_prints_the_split_and_the_verified_footprint(knn_file, capsys):
    argv = ["plan", f"{knn_file}:knn", "--arg", "f32[200,16]", "--arg", "f32[5000,16]"]
    assert main([*argv, "--limit", "2MiB", "--grad"]) == 0
    out = capsys.readouterr().out
    assert "split" in out and "gradient:" in out
    after = [line for line in out.splitlines() if line.strip().startswith("after:")]
    assert len(after) == 2  # forward and backward, both verified


def test_plan_reports_an_impossible_limit_and_rejects_a_malformed_one(knn_file, capsys):
    argv = ["plan", f"{knn_file}:knn", "--arg", "f32[200,16]", "--arg", "f32[5000,16]"]
    assert main([*argv, "--limit", "100KiB"]) == 1
    assert "arguments and outputs alone" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main([*argv, "--limit", "lots"])
    assert info.value.code == 2
    assert "cannot read memory_limit 'lots'" in capsys.readouterr().err


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A persistent plan store with two entries; the store's directory chosen by nothing."""
    from memsafe import plan_store

    monkeypatch.delenv("MEMSAFE_CACHE_DIR", raising=False)
    monkeypatch.delenv("MEMSAFE_CACHE_MAX_BYTES", raising=False)
    monkeypatch.setattr(plan_store, "_warned", set())
    monkeypatch.setattr(plan_store, "_chosen", tmp_path / "store")
    for limit in ("1", "2"):
        assert plan_store.save(plan_store.key(program="p", limit=limit), bytes(1000))
    monkeypatch.setattr(plan_store, "_chosen", plan_store._UNSET)
    return tmp_path / "store"


def test_cache_info_and_clear(store, monkeypatch, capsys):
    assert main(["cache", "info"]) == 0
    assert "off (set MEMSAFE_CACHE_DIR" in capsys.readouterr().out
    assert main(["cache", "info", "--dir", str(store)]) == 0
    out = capsys.readouterr().out
    assert (
        f"memsafe plan store: {store}\n  entries: 2\n  size: 2." in out
        and "of at most 1.0 GiB" in out
    )
    monkeypatch.setenv("MEMSAFE_CACHE_DIR", str(store))
    monkeypatch.setenv("MEMSAFE_CACHE_MAX_BYTES", "10MiB")
    assert main(["cache", "info"]) == 0
    assert "entries: 2" in (out := capsys.readouterr().out) and "of at most 10.0 MiB" in out
    assert main(["cache", "clear"]) == 0
    assert capsys.readouterr().out.strip() == f"removed 2 entries from {store}"
    assert main(["cache", "info", "--dir", str(store)]) == 0
    assert "entries: 0" in capsys.readouterr().out
    assert main(["cache", "info", "--dir", str(store / "new")]) == 0
    assert "(not created yet)" in capsys.readouterr().out


def test_cache_clear_reports_entries_it_cannot_remove(store, monkeypatch, capsys):
    from memsafe import plan_store

    monkeypatch.setattr(plan_store, "_remove", lambda path: False)
    assert main(["cache", "clear", "--dir", str(store)]) == 1
    captured = capsys.readouterr()
    assert "removed 0 entries" in captured.out and "2 entries could not be removed" in captured.err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["cache"], "required: action"),
        (["cache", "purge"], "invalid choice"),
        (["cache", "clear"], "no store to clear: give --dir PATH or set MEMSAFE_CACHE_DIR"),
        (["cache", "info", "--dir", "FILE"], "not a directory"),
        (["cache", "clear", "--dir", ""], "--dir needs a directory"),
        (["cache", "info", "--dir"], "expected one argument"),
    ],
)
def test_cache_usage_errors(argv, message, store, knn_file, capsys):
    with pytest.raises(SystemExit) as exc:
        main([a.replace("FILE", str(knn_file)) for a in argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert len(list(store.iterdir())) == 2  # nothing removed
