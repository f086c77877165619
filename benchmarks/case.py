"""Run one benchmark case in this (fresh) process and write its result as JSON.

``python -m benchmarks.case WORKLOAD METHOD PARAMS_JSON OUT_JSON``: the runner starts one such
process per (workload, case, method) so that peak RSS and compilation caches are the case's own.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
import traceback

from benchmarks.measure import current_rss, device_peak, environment, peak_rss


def main() -> None:
    workload, method, params_json, out_path = sys.argv[1:5]
    params = json.loads(params_json)
    module = importlib.import_module(f"benchmarks.{workload}")
    result: dict = {"workload": workload, "method": method, "params": params}
    start = time.perf_counter()
    try:
        result.update(module.run_case(method, params))
        result.setdefault("status", "ok")
    except ImportError as err:
        result.update(status="unavailable", error=str(err))
    except Exception as err:
        name = type(err).__name__
        status = "memory_limit_error" if name == "MemoryLimitError" else "error"
        result.update(status=status, error=f"{name}: {err}", traceback=traceback.format_exc())
    result["wall_s"] = time.perf_counter() - start
    result.setdefault("peak_rss_bytes", peak_rss())
    peak = device_peak()
    if peak is not None:
        result["device_peak_bytes"] = peak
    result["env"] = environment()
    result.setdefault("rss_end_bytes", current_rss())
    with open(out_path, "w") as fh:
        json.dump(result, fh, default=float)


if __name__ == "__main__":
    main()
