"""Compute GPflow's SGPR values once and store them as test data (``tests/data/``).

The inputs follow a recipe (``examples.sgpr.make_data`` with a fixed NumPy seed, the default
parameters, 20 prediction points) and are stored too, so that the tests do not depend on NumPy's
random streams staying the same across versions. Run: ``python -m benchmarks.sgpr_reference``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from benchmarks import gpflow_env
from examples.sgpr import JITTER, default_params, make_data

DATA_DIR = Path(__file__).resolve().parent.parent / "tests" / "data"
RECIPE = {"N": 5000, "M": 100, "D": 3, "seed": 0, "xnew_seed": 1, "n_new": 20}


def inputs(recipe: dict = RECIPE) -> dict[str, np.ndarray]:
    """The reference problem's inputs, from the recipe."""
    x, y, z = make_data(recipe["N"], recipe["M"], recipe["D"], recipe["seed"])
    xnew = np.random.default_rng(recipe["xnew_seed"]).uniform(0, 1, (recipe["n_new"], recipe["D"]))
    params = default_params(z, recipe["D"])
    return {"x": x, "y": y, "xnew": xnew, **params}


def main() -> None:
    data = inputs()
    result = gpflow_env.run(data, "reference")
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(DATA_DIR / "sgpr_inputs.npz", **data)
    payload = {
        "recipe": {**RECIPE, "generator": "examples.sgpr.make_data + default_params"},
        "jitter": JITTER,
        "gradients_with_respect_to": "constrained values (GPflow parameters with transform=None)",
        **result,
    }
    (DATA_DIR / "sgpr_gpflow_reference.json").write_text(json.dumps(payload, indent=1))
    print(f"bound {result['bound']!r} written to {DATA_DIR}")


if __name__ == "__main__":
    main()
