"""memsafe's differential fuzzer: random programs run under memsafe.jit and compared with jax.jit.

``program`` draws and renders cases, ``inputs`` makes their arguments, ``wrappers`` says how
memsafe is applied, ``accuracy`` holds the accuracy rule, ``runner`` runs one case, ``schedule``
runs many in worker processes under a time limit per case and ``report`` tallies them.
``deep`` (with ``deep_families``) draws deep programs instead: training steps of MLPs, layer
stacks, transformers, CNNs, graph networks, several large values alive at once and iterative
solvers in while loops (``solver_family``).
``python -m tests.fuzz --budget SECONDS --cases N`` runs a campaign (``--help``: its options;
``--deep-fraction 0.4`` makes that share of seeds deep, ``--families solver`` every seed a deep
program of that family, ``forced``).
"""

from .program import Case, generate, render
from .runner import FAILURES, OUTCOMES, Result, run_case

__all__ = ["FAILURES", "OUTCOMES", "Case", "Result", "generate", "render", "run_case"]
