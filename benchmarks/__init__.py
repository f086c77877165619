"""memsafe's benchmarks: workloads under jax.jit, memsafe.jit and the tools users pick instead."""
