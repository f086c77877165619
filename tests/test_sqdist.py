"""The squared-distance rewrite (memsafe.rules.sqdist) gives jax.jit's answer: NaN and infinities
exactly, finite values and gradients within the accuracy rule (docs/accuracy.md), also for
non-finite, huge and nearly coincident inputs (issue 11, defects 1 and 2)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from memsafe.rules.sqdist import sqdist
from memsafe.xla import memsafe_jit
from tests.fuzz.accuracy import check


def naive(x, y):
    return jnp.sum((x[:, None, :] - y[None, :, :]) ** 2, -1)


def _value_and_vjp(f):
    """f(x, y) and its VJP at cotangent g, compiled as memsafe compiles (YNNPACK off)."""
    return memsafe_jit(lambda x, y, g: (f(x, y), *jax.vjp(f, x, y)[1](g)))


def _float64(f, *args):
    with jax.enable_x64():
        return _value_and_vjp(f)(*(np.asarray(a, np.float64) for a in args))


def assert_as_jit(x, y, g):
    """sqdist's value and gradients obey the accuracy rule against the direct form."""
    got = _value_and_vjp(sqdist)(x, y, g)
    want = _value_and_vjp(naive)(x, y, g)
    assert check(got, want, _float64(naive, x, y, g)) == []


@st.composite
def hard_inputs(draw):
    """Point clouds offset and scaled, with near-duplicates, NaN, +-inf and huge outliers (each
    huge value distinct by >= 2.5e19, so two outliers never nearly coincide: see the
    limitation in memsafe.rules.sqdist), and a cotangent with zeros, signs and NaN."""
    n, m, d = draw(st.integers(1, 12)), draw(st.integers(1, 12)), draw(st.integers(1, 9))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    offset = draw(st.sampled_from([0.0, 100.0, -3e4, 1e6]))
    scale = draw(st.sampled_from([1e-3, 1.0, 50.0]))
    x = rng.standard_normal((n, d)) * scale + offset
    y = rng.standard_normal((m, d)) * scale + offset
    dup = rng.random(m) < 0.5
    y[dup] = x[rng.integers(0, n, dup.sum())] + rng.standard_normal((dup.sum(), d)) * scale * 1e-3
    x, y = x.astype(np.float32), y.astype(np.float32)
    special = draw(st.sampled_from(["none", "nonfinite", "huge", "both"]))
    count = 0
    for a in (x, y):
        for kind in ("nonfinite", "huge"):
            if special not in (kind, "both"):
                continue
            mask = rng.random(a.shape) < draw(st.sampled_from([0.05, 0.3]))
            k = int(mask.sum())
            if kind == "nonfinite":
                a[mask] = rng.choice(np.array([np.inf, -np.inf, np.nan], np.float32), k)
            else:
                a[mask] = rng.choice([-1, 1], k) * 1e20 * (1 + 0.25 * np.arange(count, count + k))
                count += k
    g = rng.standard_normal((n, m)).astype(np.float32)
    g[rng.random((n, m)) < 0.3] = 0.0
    g[rng.random((n, m)) < draw(st.sampled_from([0.0, 0.05]))] = np.nan
    return x, y, g


@settings(max_examples=60)
@given(hard_inputs())
def test_sqdist_matches_the_direct_form(args):
    assert_as_jit(*args)
