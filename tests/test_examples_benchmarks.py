"""The benchmark peers agree with the examples, and the runner measures, records and judges."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from benchmarks import report, run
from benchmarks.peers import chunked_attention, chunked_jax
from examples import attention, kernel_matvec, knn, sinkhorn


@pytest.mark.parametrize("metric", ["l2", "l1", "cosine"])
@pytest.mark.parametrize("kind", ["database", "queries"])
def test_hand_chunked_knn_is_exact(metric, kind):
    x, y = knn.make_inputs(40, 1000, 6)
    # A chunk that does not divide m: the padded rows must never be selected.
    dist, idx = chunked_jax.make_knn(kind, metric, 5, ynn=False, chunk=300)(x, y)
    err = knn.neighbour_errors(x, y, metric, np.asarray(dist), np.asarray(idx), np.arange(40))
    assert err["recall"] == 1.0 and err["max_abs_distance_error"] < 1e-4
    assert int(np.asarray(idx).max()) < 1000


def test_faiss_peer_is_exact():
    pytest.importorskip("faiss")
    from benchmarks.peers import faiss_knn

    x, y = knn.make_inputs(30, 800, 8)
    for metric in ("l2", "l1", "cosine"):
        dist, idx = faiss_knn.knn(x, y, 4, metric)
        err = knn.neighbour_errors(x, y, metric, dist, idx, np.arange(30))
        assert err["recall"] == 1.0 and err["max_abs_distance_error"] < 1e-4


def test_hand_chunked_kernel_matvec():
    x, y, v = kernel_matvec.make_inputs(300, 400, 3)
    fun = chunked_jax.jit(chunked_jax.gaussian_kernel_matvec, ynn=False, static_argnums=4)
    out = fun(x, y, v, np.float32(0.5), 64)
    assert kernel_matvec.relative_error(out, kernel_matvec.reference(x, y, v, 0.5)) < 1e-5


def test_sinkhorn_peers_give_the_float64_potentials():
    x, y = sinkhorn.make_inputs(300, 200)
    want = sinkhorn.reference(x, y, 0.05, 5)
    fun = chunked_jax.jit(chunked_jax.sinkhorn, ynn=False, static_argnums=(2, 3, 4))
    assert sinkhorn.max_error(fun(x, y, 0.05, 5, 64), want) < 1e-5
    pytest.importorskip("pykeops")
    from benchmarks.peers import keops

    assert sinkhorn.max_error(keops.sinkhorn(x, y, 0.05, 5), want) < 1e-5


@pytest.mark.parametrize("causal", [False, True])
def test_chunked_attention_equals_textbook_forward_and_backward(causal):
    q, k, v = attention.make_inputs(2, 256, 8)
    kw = {"causal": causal, "query_chunk": 64, "key_chunk": 128}
    out = jax.jit(functools.partial(chunked_attention.attention, **kw))(q, k, v)
    ref = jax.jit(functools.partial(attention.attention, causal=causal))(q, k, v)
    np.testing.assert_allclose(out, ref, atol=1e-5)
    got = jax.jit(functools.partial(chunked_attention.attention_value_and_grad, **kw))(q, k, v)
    want = jax.jit(functools.partial(attention.attention_value_and_grad, causal=causal))(q, k, v)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="multiples"):
        chunked_attention.attention(q[:, :200], k, v, query_chunk=64)


def test_runner_measures_a_case_in_a_subprocess():
    params = {
        "label": "tiny",
        "metric": "l2",
        "n": 50,
        "m": 2000,
        "d": 8,
        "k": 5,
        "limit": "1GiB",
        "repeats": 2,
        "budget_s": 5.0,
        "jax_cap": 2**30,
    }
    res = run.run_method("knn", "jax", params, timeout=300)
    assert res["status"] == "ok", res.get("error")
    assert len(res["times_s"]) == 2 and res["min_s"] <= res["median_s"]
    assert res["footprint"]["total"] > 50 * 2000 * 4  # the distance matrix at least
    assert res["accuracy"]["recall"] == 1.0
    assert res["peak_rss_bytes"] > 0 and "loadavg" in res["env"]
    capped = run.run_method("knn", "jax", {**params, "jax_cap": 1000}, timeout=300)
    assert capped["status"] == "does_not_fit" and "min_s" not in capped
    bad = run.run_method("knn", "no_such_method", params, timeout=300)
    assert bad["status"] == "error" and "unknown method" in bad["error"]


def _record(times: dict[str, float]) -> dict:
    results = {m: {"status": "ok", "min_s": t, "median_s": t} for m, t in times.items()}
    case = {"label": "l2 big", "metric": "l2", "methods": list(times)}
    return {
        "workload": "knn",
        "size": "full",
        "started": "now",
        "cases": [{"case": case, "results": results}],
    }


def test_targets_are_ratios_in_one_run():
    targets = {
        t["name"]: t
        for t in report.targets(
            "knn",
            _record(
                {
                    "memsafe": 10.0,
                    "memsafe_broadcast": 10.5,
                    "faiss": 20.0,
                    "chunked_db": 9.0,
                    "chunked_db_ynn": 12.0,
                }
            ),
        )
    }
    assert targets["knn_vs_faiss"]["value"] == pytest.approx(2.0)
    assert targets["knn_vs_faiss"]["met"] is True
    # memsafe against the best hand-chunked variant: 10 / 9 > 1, not met.
    assert targets["knn_vs_chunked"]["value"] == pytest.approx(10 / 9)
    assert targets["knn_vs_chunked"]["met"] is False
    assert targets["knn_broadcast_vs_expanded"]["met"] is True
    missing = {t["name"]: t for t in report.targets("knn", _record({"memsafe": 1.0}))}
    assert missing["knn_vs_faiss"]["met"] is None


def test_merge_replaces_only_rerun_methods():
    old = _record({"memsafe": 1.0, "faiss": 2.0})
    new = _record({"memsafe": 3.0})
    merged = report.merge(old, new)
    res = merged["cases"][0]["results"]
    assert res["memsafe"]["min_s"] == 3.0 and res["faiss"]["min_s"] == 2.0


def test_table_lists_every_method():
    text = report.table(_record({"memsafe": 1.0, "faiss": 2.0}))
    assert "| l2 big | memsafe | ok |" in text and "| l2 big | faiss | ok |" in text


def test_gemm_rate_and_bound_multiples():
    """The runner's GEMM measurement gives a rate, and each workload's time is reported as a
    multiple of the time its products take at that rate."""
    from benchmarks import gemm
    from benchmarks import knn as knn_bench

    res = gemm.run_case("jax", {"dtype": "float32", "precision": "default"})
    assert res["n"] == 2048 and res["rate_flops"] == 2 * 2048**3 / res["min_s"]
    rates = {"float32 default": 1e11}
    params = {"n": 1000, "m": 2000, "d": 50, "k": 10, "metric": "l2"}
    results = {"memsafe": {"min_s": 0.4}, "faiss": {"status": "error"}}
    run.with_gemm_bound(knn_bench, params, results, rates)
    bound = 2 * 1000 * 2000 * 50 / 1e11
    assert results["memsafe"]["gemm_bound_s"] == bound
    assert results["memsafe"]["x_gemm_bound"] == pytest.approx(0.4 / bound)
    assert "x_gemm_bound" not in results["faiss"]
    record = {"workload": "knn", "size": "quick", "started": "-", "gemm": rates,
              "cases": [{"case": {"label": "c"}, "results": results}]}  # fmt: skip
    text = report.table(record)
    assert "float32 default 100 GFLOP/s" in text and f"{0.4 / bound:.1f}x" in text
