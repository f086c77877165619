"""Tables, targets and plots from the results files (``benchmarks/results/**/<workload>.json``).

Targets are the issues' goals, as ratios of times measured in the same run (so that a loaded
machine slows both sides): e.g. kNN ``faiss / memsafe >= 1.5``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tools.plans import format_bytes as _bytes  # no jax import: reports read JSON only

RESULTS = Path(__file__).resolve().parent / "results"


def _secs(s: float | None) -> str:
    return "-" if s is None else (f"{s:.3f}" if s < 10 else f"{s:.1f}")


def one_line(res: dict) -> str:
    """A result in one line, for the runner's progress output."""
    status = res.get("status", "?")
    parts = [status]
    if "min_s" in res:
        parts.append(f"min {_secs(res['min_s'])} s, median {_secs(res['median_s'])} s")
    fp = res.get("footprint", {}).get("total")
    if fp is not None:
        parts.append(f"footprint {_bytes(fp)}")
    need = res.get("need_bytes")
    if need is not None and need != fp:
        parts.append(f"needs {_bytes(need)} with YNNPACK fusions off")
    if "rss_growth_bytes" in res:
        parts.append(f"RSS +{_bytes(res['rss_growth_bytes'])}")
    if "accuracy" in res:
        parts.append(", ".join(f"{k} {v:.3g}" for k, v in res["accuracy"].items()))
    if "error" in res:
        parts.append(res["error"].splitlines()[0][:200])
    return "; ".join(parts)


def merge(old: dict, new: dict) -> dict:
    """``old`` with the methods ``new`` ran replaced (cases matched by label)."""
    by_label = {c["case"]["label"]: c for c in old.get("cases", [])}
    for case in new["cases"]:
        label = case["case"]["label"]
        if label in by_label:
            by_label[label]["results"].update(case["results"])
            methods = list(by_label[label]["case"].get("methods", []))
            methods += [m for m in case["case"].get("methods", []) if m not in methods]
            by_label[label]["case"] = {**case["case"], "methods": methods}
        else:
            by_label[label] = case
    merged = {**old, **{k: v for k, v in new.items() if k != "cases"}}
    merged["cases"] = list(by_label.values())
    return merged


# -- targets ---------------------------------------------------------------------------------


def _find(record: dict, pred: Callable[[dict], bool]) -> dict | None:
    found = [c for c in record["cases"] if pred(c["case"])]
    return found[-1] if found else None


def _time(case: dict | None, method: str) -> float | None:
    if case is None:
        return None
    if method == "best_chunked":
        times = [
            r["min_s"]
            for m, r in case["results"].items()
            if m.startswith("chunked") and "min_s" in r
        ]
        return min(times) if times else None
    return case["results"].get(method, {}).get("min_s")


def _ratio_target(name: str, case: dict | None, num: str, den: str, goal: str) -> dict:
    a, b = _time(case, num), _time(case, den)
    value = None if a is None or b is None else a / b
    op, bound = goal.split()
    bound_f = float(bound)
    met = None if value is None else (value >= bound_f if op == ">=" else value <= bound_f)
    label = case["case"]["label"] if case else "?"
    text = (
        f"{label}: {num} {_secs(a)} s / {den} {_secs(b)} s = "
        + ("n/a" if value is None else f"{value:.2f}")
        + f" (goal {goal}): "
        + {True: "met", False: "NOT met", None: "not measured"}[met]
    )
    return {"name": name, "value": value, "goal": goal, "met": met, "text": text}


def _gemm_target(name: str, case: dict | None, method: str, most: float) -> dict:
    """``method``'s time as a multiple of the GEMM bound measured in the same run."""
    res = (case or {}).get("results", {}).get(method, {})
    x = res.get("x_gemm_bound")
    label = case["case"]["label"] if case else "?"
    text = f"{label}: {method} at " + ("n/a" if x is None else f"{x:.2f}") + " x the GEMM bound"
    return _fact_target(name, x, None if x is None else x <= most, f"{text} (goal <= {most:g})")


def _fact_target(name: str, value: Any, met: bool | None, text: str) -> dict:
    status = {True: "met", False: "NOT met", None: "not measured"}[met]
    return {"name": name, "value": value, "goal": None, "met": met, "text": f"{text}: {status}"}


def _under_limit(name: str, case: dict | None, method: str = "memsafe") -> dict:
    if case is None:
        return _fact_target(name, None, None, "case not run")
    res = case["results"].get(method, {})
    jax_res = case["results"].get("jax", {})
    need = jax_res.get("need_bytes", jax_res.get("footprint", {}).get("total"))
    fp = res.get("footprint", {}).get("total")
    limit = res.get("limit")
    ok = res.get("status") == "ok" and fp is not None and limit is not None and fp <= limit
    factor = None if need is None or limit is None else need / limit
    text = (
        f"{case['case']['label']}: {method} {res.get('status', 'not run')}, footprint "
        f"{_bytes(fp)} under limit {_bytes(limit)}; jax.jit needs {_bytes(need)}"
        + ("" if factor is None else f" ({factor:.1f}x the limit)")
    )
    return _fact_target(name, factor, ok if res else None, text)


def targets(workload: str, record: dict) -> list[dict]:
    """The issues' goals for ``workload``, evaluated on ``record``."""
    out: list[dict] = []
    if workload == "knn":
        l2 = _find(record, lambda c: c["metric"] == "l2" and "rule" not in c["label"])
        out += [
            _ratio_target("knn_vs_faiss", l2, "faiss", "memsafe", ">= 2"),
            _gemm_target("knn_vs_gemm_bound", l2, "memsafe", 2.0),
            _ratio_target("knn_vs_chunked", l2, "memsafe", "best_chunked", "<= 1.0"),
            _ratio_target(
                "knn_broadcast_vs_expanded", l2, "memsafe_broadcast", "memsafe", "<= 1.1"
            ),
            _ratio_target("knn_broadcast_vs_faiss", l2, "faiss", "memsafe_broadcast", ">= 1.5"),
            _under_limit("knn_l2_under_limit", l2),
            _under_limit("knn_l2_broadcast_under_limit", l2, "memsafe_broadcast"),
        ]
        rule = _find(record, lambda c: "rule" in c["label"])
        r = _ratio_target("knn_rule_value", rule, "jax_broadcast", "jax", ">= 0")
        r["goal"], r["met"] = None, None
        r["text"] = (
            r["text"]
            .replace(" (goal >= 0): not measured", "")
            .replace(
                " (goal >= 0): met", " (broadcast form under plain jax.jit vs expanded: recorded)"
            )
        )
        out.append(r)
        for metric, peer in (("l1", "keops"), ("cosine", "best_chunked")):
            case = _find(record, lambda c, m=metric: c["metric"] == m)
            out.append(_ratio_target(f"knn_{metric}_vs_{peer}", case, "memsafe", peer, "<= 1.0"))
            out.append(_under_limit(f"knn_{metric}_under_limit", case))
    elif workload == "kernel_matvec":
        big = _find(record, lambda c: True)
        out += [
            _ratio_target("kernel_vs_keops", big, "keops", "memsafe", ">= 3"),
            _ratio_target("kernel_vs_chunked", big, "memsafe", "best_chunked", "<= 1.0"),
            _under_limit("kernel_under_limit", big),
        ]
    elif workload == "sinkhorn":  # KeOps's own workload: held to the kernel matvec's goals
        big = _find(record, lambda c: True)
        out += [
            _ratio_target("sinkhorn_vs_keops", big, "keops", "memsafe", ">= 3"),
            _ratio_target("sinkhorn_vs_chunked", big, "memsafe", "best_chunked", "<= 1.0"),
            _under_limit("sinkhorn_under_limit", big),
        ]
    elif workload == "sgpr":
        g = _find(record, lambda c: c["what"] == "grad" and "gpflow" in c["methods"])
        b = _find(record, lambda c: c["what"] == "bound" and "gpflow" in c["methods"])
        for tag, case in (("grad", g), ("bound", b)):
            out += [
                _ratio_target(f"sgpr_{tag}_vs_gpflow", case, "memsafe", "gpflow", "<= 1.0"),
                _ratio_target(f"sgpr_{tag}_vs_jax", case, "memsafe", "jax", "<= 1.1"),
            ]
        for case in record["cases"]:
            if "gpflow" not in case["case"]["methods"]:
                out.append(_under_limit(f"sgpr_scale_{case['case']['what']}", case))
    elif workload == "attention":
        for mode in ("forward", "backward"):
            big = _find(record, lambda c, m=mode: c["mode"] == m)
            out += [
                _ratio_target(f"attention_{mode}_vs_chunked", big, "memsafe", "chunked", "<= 1.3"),
                _under_limit(f"attention_{mode}_under_limit", big),
            ]
    elif workload == "hutchinson":
        case = _find(record, lambda c: True)
        if case:
            res = case["results"]
            need = res.get("jax", {}).get("footprint", {}).get("total")
            for m in ("memsafe_same", "memsafe_half"):
                fp = res.get(m, {}).get("footprint", {}).get("total")
                diff = res.get(m, {}).get("accuracy", {}).get("max_abs_difference")
                ran = m in res
                ok = (
                    (False if ran else None)
                    if fp is None or need is None
                    else (fp <= need and diff is not None and diff <= 1e-5)
                )
                out.append(
                    _fact_target(
                        f"hutchinson_{m}",
                        fp,
                        ok,
                        f"{m}: {res.get(m, {}).get('status', 'not run')}, "
                        f"footprint {_bytes(fp)} vs "
                        f"jax.jit {_bytes(need)}, max |estimate difference| "
                        + ("-" if diff is None else f"{diff:.2e}"),
                    )
                )
    return out


# -- tables ----------------------------------------------------------------------------------


def _accuracy(res: dict) -> str:
    acc = res.get("accuracy")
    if not acc:
        return "-"
    return ", ".join(f"{k.replace('_', ' ')} {v:.2g}" for k, v in acc.items())


def table(record: dict) -> str:
    """A markdown table of one workload's results. A record merged from runs on several devices
    (a partial rerun, ``benchmarks.run --cases``) names each row's device."""
    devices = _devices(record)
    by_device = len(devices) > 1
    lines = [
        f"### {record['workload']} ({record['size']}, {record.get('env', {}).get('backend', '?')}"
        f", {'newest run ' if by_device else ''}started {record['started']}, load {_load(record)})",
        "",
        *_gemm_line(record),
        "| case | method | status | min s | median s | x GEMM bound | footprint "
        "| footprint, YNN off | limit | RSS growth | device peak | accuracy |"
        + (" device |" if by_device else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if by_device else ""),
    ]
    for case in record["cases"]:
        for method, res in case["results"].items():
            lines.append(
                f"| {case['case']['label']} | {method} | {res.get('status', '?')} "
                f"| {_secs(res.get('min_s'))} | {_secs(res.get('median_s'))} "
                f"| {_multiple(res.get('x_gemm_bound'))} "
                f"| {_bytes(res.get('footprint', {}).get('total'))} "
                f"| {_bytes(res.get('footprint_ynn_off', {}).get('total'))} "
                f"| {_bytes(res.get('limit'))} "
                f"| {_bytes(res.get('rss_growth_bytes'))} "
                f"| {_bytes(res.get('device_peak_bytes'))} | {_accuracy(res)} |"
                + (f" {res.get('env', {}).get('device', '-')} |" if by_device else "")
            )
    if by_device:
        lines += ["", "The GEMM rate is the newest run's; compare times only between rows of "
                  "one device."]  # fmt: skip
    if record.get("targets"):
        lines += ["", "Targets:", ""]
        lines += [f"- {t['text']}" for t in record["targets"]]
    return "\n".join(lines)


def _devices(record: dict) -> set[str]:
    """The devices the record's results ran on."""
    return {
        res["env"]["device"]
        for case in record["cases"]
        for res in case["results"].values()
        if res.get("env", {}).get("device")
    }


def _multiple(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}x"


def _gemm_line(record: dict) -> list[str]:
    """The GEMM rates measured in the run (``benchmarks.gemm``), before its table."""
    rates = record.get("gemm")
    if not rates:
        return []
    text = ", ".join(f"{k} {v / 1e9:,.0f} GFLOP/s" for k, v in rates.items())
    return [f"GEMM rate measured in this run (jax.jit of a square product): {text}.", ""]


def _load(record: dict) -> str:
    a, b = record.get("loadavg_start"), record.get("loadavg_end")
    if not a or not b:
        return "?"
    return f"{a[0]:.1f} -> {b[0]:.1f}"


# -- plots -----------------------------------------------------------------------------------

#: Per workload: the parameter that measures problem size, and the one that separates series.
SWEEPS = {
    "kernel_matvec": ("n", None),
    "sinkhorn": ("n", None),
    "attention": ("L", "mode"),
    "sgpr": ("n", "what"),
}


def plots(record: dict, out_dir: Path) -> list[Path]:
    """Peak memory (footprint) against size for jax.jit and memsafe, time against size for every
    method, for workloads with a size sweep."""
    name = record["workload"]
    if name not in SWEEPS:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key, group = SWEEPS[name]
    groups = sorted({c["case"].get(group) for c in record["cases"]}, key=str)
    fig, axes = plt.subplots(2, len(groups), figsize=(6 * len(groups), 8), squeeze=False)
    for col, g in enumerate(groups):
        cases = sorted(
            (c for c in record["cases"] if c["case"].get(group) == g), key=lambda c: c["case"][key]
        )
        methods = sorted({m for c in cases for m in c["results"]})
        ax_mem, ax_time = axes[0][col], axes[1][col]
        for method in ("jax", "memsafe"):
            pts = [
                (c["case"][key], c["results"][method]["footprint"]["total"])
                for c in cases
                if "footprint" in c["results"].get(method, {})
            ]
            if pts:
                ax_mem.plot(*zip(*pts), "o-", label=f"{method} (compiled footprint)")
            rss = [
                (c["case"][key], c["results"][method]["rss_growth_bytes"])
                for c in cases
                if "rss_growth_bytes" in c["results"].get(method, {})
            ]
            if rss:
                ax_mem.plot(*zip(*rss), "x--", label=f"{method} (RSS growth)")
        limits = [
            (c["case"][key], c["results"]["memsafe"]["limit"])
            for c in cases
            if "limit" in c["results"].get("memsafe", {})
        ]
        if limits:
            ax_mem.plot(*zip(*limits), ":", color="gray", label="memsafe limit")
        for method in methods:
            pts = [
                (c["case"][key], c["results"][method]["min_s"])
                for c in cases
                if "min_s" in c["results"].get(method, {})
            ]
            if pts:
                ax_time.plot(*zip(*pts), "o-", label=method)
        title = f"{name}" + (f" ({g})" if g is not None else "")
        ax_mem.set(xscale="log", yscale="log", xlabel=key, ylabel="bytes", title=title)
        ax_time.set(xscale="log", yscale="log", xlabel=key, ylabel="min time (s)")
        for ax in (ax_mem, ax_time):
            ax.grid(True, which="both", alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / f"{name}.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return [path]


def write_all() -> None:
    """Rebuild ``results/README.md`` and the plots from every results file."""
    sections = [
        "# Benchmark results",
        "",
        "Written by `python -m benchmarks.run` (see `benchmarks/run.py`). Times are seconds (min "
        "and median of the repeats after a warm-up call); footprint is XLA's `memory_analysis()` "
        "total (arguments + outputs + temps - aliases + generated code) of the program that ran; "
        "RSS growth is the growth of the case's own process's peak RSS while it ran. Targets are "
        "ratios of times measured in the same run. `does_not_fit`: plain jax.jit compiled, its "
        "footprint is shown, and it was not run.",
    ]
    for path in sorted(RESULTS.rglob("*.json")):
        record = json.loads(path.read_text())
        if "workload" not in record:  # written by another script (train_step, compile_cost)
            continue
        rel = path.parent.relative_to(RESULTS)
        sections += ["", f"## {rel / path.stem if str(rel) != '.' else path.stem}", ""]
        sections.append(table(record))
        for plot in plots(record, path.parent):
            sections += ["", f"![{plot.stem}]({plot.relative_to(RESULTS)})"]
    (RESULTS / "README.md").write_text("\n".join(sections) + "\n")
