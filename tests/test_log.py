"""The memsafe logger (trace, passes, compile attempts against the limit, times) and the progress
line (off by default, on by parameter or MEMSAFE_PROGRESS=1, silent for short plans)."""

from __future__ import annotations

import io
import logging
import time

import jax.numpy as jnp
import numpy as np
import pytest

import memsafe
from memsafe import log, progress


def sqdist_sum(x, y):
    return jnp.sum((x[:, None, :] - y[None, :, :]) ** 2, axis=(1, 2))


X = jnp.ones((100, 16))
Y = jnp.asarray(np.random.default_rng(0).normal(size=(5000, 16)), jnp.float32)


def test_logger_is_silent_by_default():
    logger = logging.getLogger("memsafe")
    assert any(isinstance(h, logging.NullHandler) for h in logger.handlers)
    assert logger.level == logging.NOTSET


def test_info_reports_trace_attempts_against_the_limit_and_outcome(caplog):
    caplog.set_level(logging.INFO, logger="memsafe")
    f = memsafe.jit(sqdist_sum, memory_limit="4MiB")
    np.testing.assert_allclose(f(X, Y), sqdist_sum(X, Y), rtol=1e-5)
    messages = [r.getMessage() for r in caplog.records if r.name == "memsafe"]
    assert any(m.startswith("sqdist_sum: traced in ") and "equations" in m for m in messages)
    original = next(m for m in messages if "original program compiled in" in m)
    assert "vs limit 4.0 MiB (over by" in original  # the unsplit program does not fit
    attempts = [m for m in messages if ": attempt " in m]
    assert attempts and attempts[-1].endswith("vs limit 4.0 MiB (fits)")
    assert len(attempts) == len(f.plan(X, Y).attempts)
    assert any("planned in" in m and "fits the limit" in m for m in messages)
    assert not any(r.levelno == logging.DEBUG for r in caplog.records)


def test_debug_reports_each_pass_with_records_and_peaks(caplog):
    caplog.set_level(logging.DEBUG, logger="memsafe")
    f = memsafe.jit(sqdist_sum, memory_limit="4MiB")
    f(X, Y)
    passes = [r.getMessage() for r in caplog.records if ": pass " in r.getMessage()]
    names = {m.split(": pass ")[1].split(" ")[0] for m in passes}
    assert {"match_replace", "split", "schedule"} <= names
    split = next(m for m in passes if ": pass split " in m)
    assert "estimated peak" in split and "-> " in split and "into" in split and "chunks" in split


def test_a_plan_that_cannot_fit_is_logged(caplog):
    caplog.set_level(logging.INFO, logger="memsafe")
    with pytest.raises(memsafe.MemoryLimitError):
        memsafe.jit(lambda x: x * 2, memory_limit="1KiB")(jnp.ones(1000))
    assert any("no plan fits" in r.getMessage() for r in caplog.records)


def test_set_verbosity_adds_and_removes_one_stderr_handler(capsys):
    try:
        memsafe.set_verbosity("info")
        memsafe.set_verbosity("info")  # not twice
        memsafe.jit(lambda x: x + 1, memory_limit="1MiB")(jnp.ones(3))
        err = capsys.readouterr().err
        assert err.count("memsafe INFO: <lambda>: traced in") == 1
        with pytest.raises(ValueError, match="unknown level 'loud'"):
            memsafe.set_verbosity("loud")
    finally:
        memsafe.set_verbosity(None)
    memsafe.jit(lambda x: x + 2, memory_limit="1MiB")(jnp.ones(3))
    assert capsys.readouterr().err == ""


def test_progress_is_off_unless_asked(monkeypatch):
    monkeypatch.delenv("MEMSAFE_PROGRESS", raising=False)
    assert not progress.enabled(None)
    monkeypatch.setenv("MEMSAFE_PROGRESS", "1")
    assert progress.enabled(None)
    assert not progress.enabled(False)
    monkeypatch.setenv("MEMSAFE_PROGRESS", "0")
    assert not progress.enabled(None) and progress.enabled(True)


def test_progress_line_shows_the_latest_message_after_the_delay():
    stream = io.StringIO()
    line = progress.ProgressLine("knn", stream, delay=0.05, interval=0.01)
    with log.listening(line.update):
        line.start()
        log.note(logging.DEBUG, "knn: pass split (0.10 s): split something")
        time.sleep(0.2)
        line.stop()
    out = stream.getvalue()
    assert "\rmemsafe: knn [" in out and "] pass split (0.10 s): split something" in out
    assert out.endswith("\n")


def test_short_plans_print_no_progress(capsys):
    f = memsafe.jit(lambda x: x + 1, memory_limit="1MiB", progress=True)
    f(jnp.ones(3))
    assert capsys.readouterr().err == ""


def test_a_plan_shows_its_progress_on_stderr_when_asked(monkeypatch, capsys):
    monkeypatch.setattr(progress, "DELAY", 0.0)  # as if the plan were a long one
    monkeypatch.setattr(progress, "INTERVAL", 0.001)
    f = memsafe.jit(sqdist_sum, memory_limit="4MiB", progress=True)
    f(X, Y)
    err = capsys.readouterr().err
    assert "\rmemsafe: sqdist_sum [" in err and err.endswith("\n")
    assert "planned in" in err.rsplit("\r", 1)[-1]  # the last state drawn is the outcome
