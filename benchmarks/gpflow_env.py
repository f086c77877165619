"""GPflow in its own environment: create ``benchmarks/.envs/gpflow`` and run SGPR there.

GPflow 2.11.2 needs the ``tensorflow`` package and NumPy < 2; memsafe's environment has JAX 0.10
and NumPy 2. So GPflow gets a virtual environment of its own (gitignored, about 2 GB) and runs as
a subprocess (``benchmarks/gpflow_worker.py``), exchanging an ``.npz`` of inputs and a JSON of
results.

``python -m benchmarks.gpflow_env`` creates the environment (a large download, once).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.side_env import SideEnv

ROOT = Path(__file__).resolve().parent
WORKER = ROOT / "gpflow_worker.py"
#: Versions that install together on Python 3.11 with NumPy < 2.
ENV = SideEnv(
    "gpflow",
    ("gpflow==2.11.2", "tensorflow==2.15.1", "tensorflow-probability==0.23.0", "numpy<2"),
    probe="import gpflow",
    base="GPFLOW_ENV_PYTHON",
)
_QUIET_TF = {"TF_CPP_MIN_LOG_LEVEL": "3"}


def available() -> bool:
    """Whether the GPflow environment exists and imports GPflow."""
    return ENV.available(_QUIET_TF)


def ensure_env(quiet: bool = True) -> Path:
    """Create the environment if it is missing; returns its Python."""
    return ENV.ensure(quiet, _QUIET_TF)


def run(
    data: dict[str, np.ndarray], mode: str, timeout: float | None = None, **request: object
) -> dict:
    """Run the worker on ``data`` (x, y, Z, variance, lengthscales, noise[, xnew]) in ``mode``
    ('reference' or 'bench', with ``what`` and ``repeats``); returns its JSON result."""
    python = ensure_env()
    with tempfile.TemporaryDirectory(prefix="memsafe-gpflow-") as tmp:
        data_path = Path(tmp) / "data.npz"
        np.savez(data_path, **{k: np.asarray(v, np.float64) for k, v in data.items()})
        req_path, res_path = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req_path.write_text(json.dumps({"mode": mode, "data": str(data_path), **request}))
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}
        env.pop("PYTHONPATH", None)
        proc = subprocess.run(
            [str(python), str(WORKER), str(req_path), str(res_path)],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"GPflow worker failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        return json.loads(res_path.read_text())


if __name__ == "__main__":
    print(ensure_env(quiet="-v" not in sys.argv))
