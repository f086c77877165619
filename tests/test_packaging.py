"""Packaging: license, type marker, metadata, and (slow) a wheel built from the checkout and
installed into a clean virtual environment, where a small memsafe.jit program runs."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]


def test_license_file_matches_the_declared_license():
    assert PROJECT["license"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text


def test_typed_marker_is_shipped():
    assert (ROOT / "src" / "memsafe" / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["memsafe"]


def test_metadata_declares_the_tested_jax_range_classifiers_and_urls():
    jax_req = [d for d in PROJECT["dependencies"] if d.replace(" ", "").startswith("jax>")]
    assert jax_req == ["jax>=0.10,<0.12"]
    assert "Typing :: Typed" in PROJECT["classifiers"]
    assert any(c.startswith("Programming Language :: Python :: 3.") for c in PROJECT["classifiers"])
    urls = PROJECT["urls"]
    assert {"Homepage", "Documentation", "Source"} <= set(urls)
    assert all(u.startswith("https://") for u in urls.values())
    assert "docs" in PROJECT["optional-dependencies"]


SMOKE = """
import pathlib
import jax, jax.numpy as jnp, numpy as np
import memsafe

assert pathlib.Path(memsafe.__file__).with_name("py.typed").is_file()
assert "site-packages" in memsafe.__file__, memsafe.__file__

def gram_rowsum(x):
    return jnp.sum(jnp.exp(-(x @ x.T)), axis=1)

x = np.random.default_rng(0).standard_normal((2048, 8)).astype(np.float32)
safe = memsafe.jit(gram_rowsum, memory_limit="4MiB")
out = safe(x)
plan = safe.plan(x)
assert plan.splits and plan.after.total <= 4 * 2**20, str(plan)
np.testing.assert_allclose(np.asarray(out), np.asarray(jax.jit(gram_rowsum)(x)), rtol=1e-5)
print("ok", memsafe.__version__, jax.__version__)
"""


@pytest.mark.slow
def test_wheel_installs_into_a_clean_environment_and_runs(tmp_path):
    """Build the wheel, install it (and its dependencies, from the package index) into a fresh
    virtual environment without the system's site-packages, and run memsafe from there."""
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(ROOT)],
        check=True,
        timeout=600,
    )
    (wheel,) = dist.glob("memsafe-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "memsafe/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names
    metadata = zipfile.ZipFile(wheel).read(
        next(n for n in names if n.endswith(".dist-info/METADATA"))
    )
    assert b"Requires-Dist: jax<0.12,>=0.10" in metadata or b"jax>=0.10,<0.12" in metadata
    assert b"Classifier: Typing :: Typed" in metadata

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True, system_site_packages=False, clear=True).create(env_dir)
    python = env_dir / "bin" / "python"
    clean_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    clean_env["JAX_PLATFORMS"] = "cpu"
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", str(wheel)],
        check=True,
        timeout=1800,
        env=clean_env,
    )
    result = subprocess.run(
        [str(python), "-c", SMOKE],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,  # not the checkout: the installed package must be the one imported
        env=clean_env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.startswith("ok 0."), result.stdout
