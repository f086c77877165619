"""A peer in a virtual environment of its own, under ``benchmarks/.envs/`` (gitignored).

Some peers cannot be installed beside memsafe: GPflow needs TensorFlow and NumPy < 2, and ott-jax's
online Sinkhorn (``PointCloud(batch_size=...)``) calls a JAX function that JAX 0.10 removed. Each
gets an environment made once with pinned requirements and is run there as a subprocess.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent


@dataclass(frozen=True)
class SideEnv:
    """A virtual environment ``benchmarks/.envs/<name>`` holding ``requirements``.

    Attributes:
        name: the folder's name.
        requirements: pip requirement strings, pinned to versions that install together.
        probe: Python code that runs without error once the environment is usable.
        base: the environment variable naming the Python that creates it (``python3`` if unset).
    """

    name: str
    requirements: tuple[str, ...]
    probe: str
    base: str = "SIDE_ENV_PYTHON"

    @property
    def directory(self) -> Path:
        return ROOT / ".envs" / self.name

    @property
    def python(self) -> Path:
        return self.directory / "bin" / "python"

    def available(self, env: dict[str, str] | None = None) -> bool:
        """Whether the environment exists and runs ``probe``."""
        if not self.python.exists():
            return False
        probe = subprocess.run(
            [str(self.python), "-c", self.probe],
            capture_output=True,
            env={**os.environ, **(env or {})},
            check=False,
        )
        return probe.returncode == 0

    def ensure(self, quiet: bool = True, env: dict[str, str] | None = None) -> Path:
        """Create the environment if it is missing or broken; returns its Python.

        Raises:
            RuntimeError: the probe still fails after installing the requirements.
        """
        if self.available(env):
            return self.python
        self.directory.parent.mkdir(parents=True, exist_ok=True)
        base = os.environ.get(self.base, "python3")
        subprocess.run([base, "-m", "venv", str(self.directory)], check=True)
        pip = [str(self.python), "-m", "pip", "install"] + (["-q"] if quiet else [])
        subprocess.run([*pip, "--upgrade", "pip"], check=True)
        subprocess.run([*pip, *self.requirements], check=True)
        if not self.available(env):
            raise RuntimeError(
                f"{self.probe!r} failed in {self.directory} after installing {self.requirements}"
            )
        return self.python
