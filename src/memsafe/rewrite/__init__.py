"""Rewrites that take a program and return it rewritten with what they did, no pass context
involved: the algebraic ones (rules matched and replaced, matrix chains reordered, and
``rewritten``, which applies both to a function), loop invariants recomputed inside loops, and
constants fitted to generators. Passes (:mod:`memsafe.passes`) and the split planner run them; no
module here imports a pass."""
