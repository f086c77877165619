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


def _layers_grad(layers: int = 4):
    """A Python loop of layers and its gradient, calls inlined: blocks the roll pass rolls."""
    import jax
    import jax.numpy as jnp

    from memsafe.graph import inline_calls
    from tests import test_roll

    loss = test_roll._model(["dense_tanh", "residual"], [], skip=False, tied=False)
    params, x = test_roll._params(layers, 0), jnp.ones((test_roll.B, test_roll.D))
    return inline_calls(jax.make_jaxpr(jax.value_and_grad(loss, (0, 1)))(params, x))


def _counting(monkeypatch, module, name: str) -> list[int]:
    calls: list[int] = []
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def _ctx(budget: int):
    from memsafe.context import PassContext
    from memsafe.plan import Plan

    return PassContext(budget, 0, Plan(memory_limit=budget))


def test_the_roll_pass_finds_a_programs_loops_and_rewrites_it_once(monkeypatch):
    """Attempts at other chunk scales (budgets) that choose the same pairs take the rewrite
    made first, the same program, and record the same; the loops are found once per program
    (and once in its order with the inputs' slices first and the results' cheap work last,
    where its own order rolls no forward run: ``repeats.sunk``); another program object of the
    same text is rewritten alike."""
    from memsafe.passes import roll

    closed = _layers_grad()
    found = _counting(monkeypatch, roll, "loops")
    traced = _counting(monkeypatch, roll, "retrace")
    first, second = _ctx(1), _ctx(2)
    new = roll.run(closed, first)
    assert new is not closed and first.plan.records
    assert roll.run(closed, second) is new
    assert second.plan.records == first.plan.records
    assert roll.run(closed, _ctx(2**40)) is closed  # nothing worth rolling at this budget
    assert (len(found), len(traced)) == (2, 1)
    assert roll.run(closed, _ctx(2**41)) is closed  # both orders' loops are kept
    assert (len(found), len(traced)) == (2, 1)
    again = _layers_grad()  # another jaxpr object: found and rewritten again, alike
    assert again.jaxpr is not closed.jaxpr
    assert str(roll.run(again, _ctx(1)).jaxpr) == str(new.jaxpr)
    assert (len(found), len(traced)) == (3, 2)


def test_the_remat_pass_rewrites_a_program_once_per_choice(monkeypatch):
    from memsafe.passes import remat, roll

    rolled = roll.run(_layers_grad(), _ctx(1))
    pairs = _counting(monkeypatch, remat, "_pairs")
    traced = _counting(monkeypatch, remat, "retrace")
    first, second = _ctx(1), _ctx(3)
    new = remat.run(rolled, first)
    assert new is not rolled and first.plan.records
    assert remat.run(rolled, second) is new
    assert second.plan.records == first.plan.records
    assert remat.run(rolled, _ctx(2**40)) is rolled
    assert (len(pairs), len(traced)) == (1, 1)


def test_later_scale_free_passes_run_once_per_program_in_a_search(monkeypatch):
    """fission and recompute, after the roll and remat passes, depend on their program alone:
    an attempt that gives them the program an earlier attempt gave takes their program and
    records again, and each attempt's program is the one the whole pipeline makes."""
    import jax

    from memsafe import passes
    from memsafe.context import PassContext
    from memsafe.graph import inline_calls
    from memsafe.passes import fission, recompute
    from memsafe.pipeline import run_passes
    from memsafe.plan import Plan, PlanTime
    from memsafe.search import Search

    assert {"fission", "recompute"} <= passes.scale_free_names()
    assert passes.scale_free_lead() == 5  # fold, match_replace, reorder, unflatten, inplace
    closed = _layers_grad()
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
    limit = 1 << 12  # the residuals are worth rolling and recomputing at both scales
    search = Search(closed, avals, limit, (), "layers", None, 0, None, PlanTime())
    runs = {name: _counting(monkeypatch, module, "run")
            for name, module in (("fission", fission), ("recompute", recompute))}  # fmt: skip
    first = search.attempt(0, 1.0, 0)
    second = search.attempt(1, 0.5, 0)
    # fission follows the roll and remat passes (the same program at both scales); recompute
    # follows the split (here the same as well where nothing is split)
    assert len(runs["fission"]) == 1 and len(runs["recompute"]) in (1, 2)
    names = [[getattr(r, "pass_name", "") for r in t.plan.records] for t in (first, second)]
    assert "roll" in names[1] and "remat" in names[1]
    ctx = PassContext(limit, 0, Plan(memory_limit=limit), chunk_scale=0.5)
    whole = run_passes(passes.named_passes(), inline_calls(search.flat), ctx, "layers")
    assert str(whole.jaxpr) == str(second.program.jaxpr)
    assert ctx.plan.records == second.plan.records
    assert names[0].count("recompute") == names[1].count("recompute")


def test_a_sub_programs_key_is_structural_and_made_once(monkeypatch):
    """Two equations whose sub-programs are equal but other objects (their variables other
    ones) have one signature; a body that computes otherwise gives another; each sub-program
    object's key is made once."""
    import jax
    import jax.numpy as jnp

    from memsafe.graph import repeats

    def looped(op):
        def f(x):
            return jax.lax.scan(lambda c, y: (op(c) + y, c * 2), x[0], x)

        return f

    x = jnp.ones((4, 3))
    made = _counting(monkeypatch, repeats, "_program_key")
    a, b = (jax.make_jaxpr(looped(jnp.sin))(x).jaxpr.eqns[-1] for _ in range(2))
    c = jax.make_jaxpr(looped(jnp.cos))(x).jaxpr.eqns[-1]
    assert a.params["jaxpr"].jaxpr is not b.params["jaxpr"].jaxpr
    assert repeats.signature(a) == repeats.signature(b) != repeats.signature(c)
    for _ in range(3):
        repeats.signature(a)
    assert len(made) == 3


def _depends_by_full_walk(graph, maps):
    """region_depends as it was written first: every equation walked, a new set for each."""
    from memsafe._jax import is_var

    depends = {}
    for i, eqn in enumerate(graph.eqns):
        if i in maps:
            for o in eqn.outvars:
                depends[o] = {i}
            continue
        acc = set()
        for atom in eqn.invars:
            if is_var(atom):
                acc |= depends.get(atom, set())
        for o in eqn.outvars:
            depends[o] = acc
    return depends


def test_region_depends_is_the_full_walks_answer():
    """For regions of every few equations of two programs: each value depends on the region
    equations the walk of every equation finds (values before the region on none)."""
    from memsafe.graph import Graph
    from memsafe.split.region import region_depends

    for closed in [*_programs(), _layers_grad(2)]:
        graph = Graph(closed)
        n = len(graph.eqns)
        for start, step in ((0, 3), (n // 3, 5), (n // 2, 2), (n - 1, 1)):
            maps = {i: None for i in range(start, n, step)}
            want = _depends_by_full_walk(graph, maps)
            got = region_depends(graph, maps)
            for v, deps in want.items():
                assert set(got[v]) == deps and bool(got.get(v)) == bool(deps)
