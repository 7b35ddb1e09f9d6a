"""A trace's recorded arrivals in the surrogate (``sweep.latency.surrogate.bursts``):
the wait table against Lindley's recursion run request by request in float64."""

from __future__ import annotations

import numpy as np
import pytest

from sweep.latency.surrogate.bursts import RHO_GRID, WAIT_EDGES, trace_waits


def _lindley(t: np.ndarray, p: np.ndarray, rho: float) -> np.ndarray:
    """FCFS waits, one request at a time: service ``rho`` mean gaps times the
    prompt over the mean prompt."""
    gap = (t[-1] - t[0]) / (len(t) - 1)
    s = rho * gap * p / p.mean()
    w = np.zeros(len(t))
    for i in range(1, len(t)):
        w[i] = max(0.0, w[i - 1] + s[i - 1] - (t[i] - t[i - 1]))
    return w / gap


def test_wait_table_is_lindley_band_by_band():
    # bursts of up to 30 requests at one instant between quiet spells: n a
    # multiple of 10,000, so every band is whole order statistics
    rng = np.random.default_rng(3)
    n = 10_000
    sizes = rng.integers(1, 31, size=n)
    t = np.repeat(np.cumsum(rng.exponential(15.0, size=n)), sizes)[:n]
    p = rng.lognormal(7.0, 1.0, size=n)
    table = trace_waits(t, p)
    assert table.shape == (len(RHO_GRID), len(WAIT_EDGES) - 1)
    cuts = np.round(WAIT_EDGES * n).astype(int)
    for i in (0, 8, 20, 32, 40):
        w = np.sort(_lindley(t, p, RHO_GRID[i]))
        want = [w[a:b].mean() for a, b in zip(cuts[:-1], cuts[1:])]
        np.testing.assert_allclose(table[i], want, rtol=1e-9, atol=1e-9)
    assert (table[0] == 0).all()
    assert table[20, -1] > 10.0  # bursts of 30: the last waits ~15 mean gaps


@pytest.mark.parametrize("n", [2, 3, 7])
def test_one_burst_by_hand(n):
    # n requests at once, then one a long time later: waits 0, s, 2s, ...
    t = np.array([0.0] * n + [1000.0 * n])
    p = np.ones(n + 1)
    table = trace_waits(t, p)
    gap = 1000.0 * n / n  # span / (rows - 1)
    rho = RHO_GRID[20]
    waits = np.array([k * rho * gap for k in range(n)] + [0.0]) / gap
    assert np.isclose(table[20] @ np.diff(WAIT_EDGES), waits.mean())
    # the top band lies within the largest order statistic
    assert np.isclose(table[20, -1], waits.max())
