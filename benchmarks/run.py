"""The benchmark runner: every workload under jax.jit, memsafe.jit and its peers, in one run.

``python -m benchmarks.run --size quick|full|gpu [--only knn,sgpr] [--repeats 3]``

Each (case, method) runs in a fresh subprocess (``benchmarks.case``) so that its peak RSS (and on a
GPU its peak device memory) is its own. Each run first measures the machine's GEMM rate
(``benchmarks.gemm``) and reports every time also as a multiple of its GEMM bound. Results go to
``benchmarks/results/<workload>.json`` (full size on the CPU), ``results/quick/`` (quick size) or
``results/<backend>/`` (a GPU run, beside the CPU's), and the tables and plots of every results
file are rebuilt (``benchmarks.report``).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# A GPU process must not take most of the device's memory up front: each case's peak device memory
# is measured, and the runner's own process shares the device with the case it starts.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from benchmarks import gemm, report

WORKLOADS = ("knn", "kernel_matvec", "sinkhorn", "sgpr", "attention", "hutchinson")
ROOT = Path(__file__).resolve().parent.parent


def results_dir(size: str, backend: str) -> Path:
    base = report.RESULTS
    if backend != "cpu":
        base = base / backend
    return base / "quick" if size == "quick" else base


def run_method(workload: str, method: str, params: dict, timeout: float) -> dict:
    """One (case, method) in a subprocess; a crash or a timeout is recorded, not raised."""
    with tempfile.TemporaryDirectory(prefix="memsafe-bench-") as tmp:
        out = Path(tmp) / "result.json"
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTHONPATH": path}
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.case",
            workload,
            method,
            json.dumps(params),
            str(out),
        ]
        start = time.perf_counter()
        try:
            proc = subprocess.run(
                cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired:
            return {"method": method, "status": "timeout", "timeout_s": timeout}
        if out.exists():
            return json.loads(out.read_text())
        return {
            "method": method,
            "status": "crashed",
            "returncode": proc.returncode,
            "wall_s": time.perf_counter() - start,
            "stderr": proc.stderr[-2000:],
        }


def with_gemm_bound(module, params: dict, results: dict[str, dict], rates: dict) -> None:
    """Each result's time also as a multiple of its GEMM bound: the flops of the products the
    program must do (the workload's ``gemm_flops``) at the rate measured in this run."""
    if not hasattr(module, "gemm_flops"):
        return
    flops, dtype = module.gemm_flops(params)
    bound = gemm.bound_seconds(flops, dtype, rates)
    if bound is None:
        return
    for res in results.values():
        res["gemm_bound_s"] = bound
        if "min_s" in res:
            res["x_gemm_bound"] = res["min_s"] / bound


def run_workload(name: str, args: argparse.Namespace, rates: dict[str, float]) -> dict:
    module = importlib.import_module(f"benchmarks.{name}")
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    record: dict = {
        "workload": name,
        "size": args.size,
        "started": started,
        "loadavg_start": os.getloadavg(),
        "gemm": rates,
        "cases": [],
    }
    for case in module.cases(args.size):
        if args.cases and case["label"] not in args.cases:
            continue
        methods = [m for m in case["methods"] if not args.methods or m in args.methods]
        params = {k: v for k, v in case.items() if k != "methods"}
        params.update(repeats=args.repeats, budget_s=args.budget, jax_cap=args.jax_cap)
        results: dict[str, dict] = {}
        for method in methods:
            print(f"[{name}] {case['label']}: {method} ...", flush=True)
            res = run_method(name, method, params, args.timeout)
            results[method] = res
            print(f"    {report.one_line(res)}", flush=True)
        if hasattr(module, "postprocess"):
            module.postprocess(case, results)
        with_gemm_bound(module, params, results, rates)
        record["cases"].append({"case": {**params, "methods": methods}, "results": results})
    record["loadavg_end"] = os.getloadavg()
    record["env"] = next(
        (r["env"] for c in record["cases"] for r in c["results"].values() if "env" in r), {}
    )
    try:
        record["targets"] = report.targets(name, record)
    except Exception as err:  # a report bug must not lose an hour of measurements
        record["targets"] = [{"name": "error", "met": None, "text": f"targets failed: {err!r}"}]
    return record


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("quick", "full", "gpu"), default="quick")
    parser.add_argument("--only", default="", help=f"comma-separated subset of {WORKLOADS}")
    parser.add_argument("--methods", default="", help="comma-separated subset of methods")
    parser.add_argument("--cases", default="", help="comma-separated subset of case labels")
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed calls after a warm-up (0: one call only)"
    )
    parser.add_argument("--budget", type=float, default=None, help="seconds of repeats per method")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per method")
    parser.add_argument(
        "--jax-cap",
        type=int,
        default=6 * 2**30,
        help="bytes above which plain jax.jit is compiled but not run",
    )
    args = parser.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if args.budget is None:
        args.budget = {"quick": 30.0, "full": 150.0, "gpu": 10.0}[args.size]
    if args.timeout is None:
        args.timeout = {"quick": 900.0, "full": 3600.0, "gpu": 300.0}[args.size]
    names = [n for n in args.only.split(",") if n] or list(WORKLOADS)
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown:
        parser.error(f"unknown workload(s) {unknown}; choose from {WORKLOADS}")
    import jax

    backend = jax.default_backend()
    out_dir = results_dir(args.size, backend)
    out_dir.mkdir(parents=True, exist_ok=True)
    rates = gemm.measure(lambda w, m, p: run_method(w, m, p, args.timeout))
    print("GEMM rates: " + ", ".join(f"{k} {v / 1e9:.0f} GFLOP/s" for k, v in rates.items()))
    for name in names:
        record = run_workload(name, args, rates)
        path = out_dir / f"{name}.json"
        if (args.methods or args.cases) and path.exists():  # a partial rerun updates what it ran
            record = report.merge(json.loads(path.read_text()), record)
            module = importlib.import_module(f"benchmarks.{name}")
            for case in record["cases"]:  # accuracy against references run earlier
                if hasattr(module, "postprocess"):
                    module.postprocess(case["case"], case["results"])
            record["targets"] = report.targets(name, record)
        path.write_text(json.dumps(record, indent=1, default=float))
        print(f"wrote {path}")
        for t in record["targets"]:
            print(f"  target {t['name']}: {t['text']}")
    report.write_all()


if __name__ == "__main__":
    main()
