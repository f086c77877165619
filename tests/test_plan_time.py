"""What makes a plan cheaper to find without changing it (issue 42): the option probe run
once per process, beside the trace."""

from __future__ import annotations

import pytest

from memsafe import xla


@pytest.fixture
def fresh_probe(monkeypatch):
    """No probe started in this process yet, and a count of the probes run."""
    runs: list[int] = []
    real = xla._probe

    def counted() -> bool:
        runs.append(1)
        return real()

    monkeypatch.setattr(xla, "_probe_done", [])
    monkeypatch.setattr(xla, "_probe", counted)
    return runs


def test_the_option_probe_runs_once_per_process(fresh_probe, monkeypatch):
    monkeypatch.delenv("MEMSAFE_KEEP_YNN", raising=False)
    xla.start_probe()
    xla.start_probe()
    first = xla._cpu_option_supported()
    assert xla._cpu_option_supported() is first
    assert xla.compiler_options("cpu") == (dict(xla.CPU_COMPILER_OPTIONS) if first else {})
    assert len(fresh_probe) == 1


def test_the_probe_is_not_started_where_its_option_is_not_used(fresh_probe, monkeypatch):
    monkeypatch.setenv("MEMSAFE_KEEP_YNN", "1")
    xla.start_probe()
    assert xla._probe_done == [] and fresh_probe == []
    assert xla.compiler_options("cpu") == {}
    assert fresh_probe == []


def test_a_plan_starts_the_probe_before_it_traces(fresh_probe, monkeypatch):
    import jax.numpy as jnp

    import memsafe

    monkeypatch.delenv("MEMSAFE_KEEP_YNN", raising=False)
    started: list[bool] = []
    real_trace = memsafe.build.trace

    def trace(*args, **kwargs):
        started.append(bool(xla._probe_done))
        return real_trace(*args, **kwargs)

    monkeypatch.setattr(memsafe.build, "trace", trace)
    memsafe.jit(lambda x: x * 2, memory_limit="1GiB").plan(jnp.ones(3))
    assert started and started[0]
    assert len(fresh_probe) == 1


def _cone_by_scan(graph, atom, stop=frozenset(), dead=frozenset()):
    """exclusive_cone as it was written first: every equation before the term's producer
    looked at, latest first."""
    from memsafe._jax import Var, is_var

    if not is_var(atom):
        return set()
    root = graph.info(atom).producer
    if root is None or graph.info(atom).is_output:
        return set()
    if any(c not in stop and c not in dead for c in graph.info(atom).consumers):
        return set()
    eqns = graph.eqns
    for v in eqns[root].outvars:
        if v is atom or not isinstance(v, Var):
            continue
        other = graph.info(v)
        if other.is_output or any(c not in dead for c in other.consumers):
            return set()
    cone = {root}
    for q in range(root - 1, -1, -1):
        if q in stop or q in dead:
            continue
        outs = [graph.info(v) for v in eqns[q].outvars if isinstance(v, Var)]
        if not outs or any(vi.is_output for vi in outs):
            continue
        uses = [c for vi in outs for c in vi.consumers if c not in dead]
        if uses and all(c in cone for c in uses):
            cone.add(q)
    return cone


def _programs():
    import jax
    import jax.numpy as jnp

    def branches(x):
        terms = [jnp.fft.ifft(jnp.fft.fft(x * k)).real for k in range(1, 5)]
        shared = jnp.sin(x)
        return terms[0] + terms[1] * shared + terms[2] + terms[3] + shared

    def mlp(params, x):
        for w in params:
            x = jnp.tanh(x @ w)
        return jnp.sum(x**2)

    x = jnp.ones((16, 16))
    params = [jnp.ones((16, 16)) * 0.1 for _ in range(3)]
    yield jax.make_jaxpr(branches)(x)
    yield jax.make_jaxpr(jax.value_and_grad(mlp))(params, x)


def test_exclusive_cone_walks_only_what_the_term_reads():
    """The cone found from the term's producer back through what it reads is the cone a scan of
    every earlier equation finds, for every value, with and without stops and dead equations."""
    from memsafe._jax import Var
    from memsafe.graph import Graph
    from memsafe.graph.branches import dead_equations, exclusive_cone, find_chains

    for closed in _programs():
        graph = Graph(closed)
        dead = dead_equations(graph)
        stops = [frozenset()]
        stops += [frozenset(s.index for s in chain.steps) for chain in find_chains(graph)]
        checked = 0
        for eqn in graph.eqns:
            for v in eqn.outvars:
                if not isinstance(v, Var):
                    continue
                for stop in stops:
                    for d in (frozenset(), dead):
                        want = _cone_by_scan(graph, v, stop, d)
                        assert exclusive_cone(graph, v, stop, d) == want
                        checked += len(want) > 1
        assert checked > 0


def test_a_jaxprs_graph_is_built_once():
    """Graph(closed) of a jaxpr seen before reuses its facts (hit); another jaxpr, even of the
    same function, gets its own (miss), and so does a jaxpr whose equations list was edited."""
    import gc

    import jax
    import jax.numpy as jnp

    from memsafe._jax import ClosedJaxpr
    from memsafe.graph import Graph
    from memsafe.graph import graph as graph_module

    def f(x):
        return jnp.sin(x) * 2 + x

    closed = jax.make_jaxpr(f)(jnp.ones(3))
    first = Graph(closed)
    again = Graph(ClosedJaxpr(closed.jaxpr, closed.consts))
    assert again._values is first._values and again.eqns is first.eqns  # hit
    other = jax.make_jaxpr(lambda x: f(x))(jnp.ones(3))  # (make_jaxpr caches f's)
    fresh = Graph(other)
    assert fresh._values is not first._values  # miss: another jaxpr object
    assert [v.bytes for v in fresh.values()] == [v.bytes for v in first.values()]
    key = id(other.jaxpr)
    assert key in graph_module._BUILT
    del other, fresh
    gc.collect()
    assert key not in graph_module._BUILT  # forgotten with its jaxpr


def test_the_graph_cache_is_bounded():
    import jax
    import jax.numpy as jnp

    from memsafe.graph import Graph
    from memsafe.graph import graph as graph_module

    kept = [jax.make_jaxpr(lambda x, k=k: x + k)(jnp.ones(2)) for k in range(40)]
    for closed in kept:
        Graph(closed)
    assert len(graph_module._BUILT) <= graph_module._BUILT_MAX
    assert (
        id(kept[-1].jaxpr) in graph_module._BUILT and id(kept[0].jaxpr) not in graph_module._BUILT
    )


def test_an_emitted_program_without_lapack_is_compiled_as_it_is():
    """lapack_order.ordered traces a function to find its LAPACK calls; a program memsafe
    emitted carries its jaxpr, so without LAPACK calls it is compiled without that trace (the
    same function), and with them it is still ordered."""
    import jax
    import jax.numpy as jnp

    from memsafe import lapack_order
    from memsafe._jax import lapack_waits_on_its_pool
    from memsafe.compiling import emit

    x = jnp.ones((4, 4))
    plain = emit(jax.make_jaxpr(lambda a: jnp.sin(a) @ a)(x))
    assert lapack_order.ordered(plain) is plain
    solve = lambda a: jax.scipy.linalg.cholesky(a @ a.T + 4 * jnp.eye(4))
    emitted = emit(jax.make_jaxpr(solve)(x))
    wrapped = lapack_order.ordered(emitted)
    assert (wrapped is not emitted) == lapack_waits_on_its_pool()
    np_out = jax.jit(wrapped)(x)
    assert jnp.allclose(np_out[0], solve(x), rtol=1e-5)
