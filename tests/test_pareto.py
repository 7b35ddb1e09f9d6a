"""The one Pareto filter (``sweep.search.pareto.front``): hand-checked fronts in
every sense, and the definition checked pairwise on random points."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sweep.search.pareto import front, front_of_fronts

# cost (minimised) and throughput (maximised), by hand: (1, 2) and (3, 5) are
# beaten by nothing; (2, 2) is beaten by (1, 2); (3, 5) twice is kept once;
# (4, 6) is the best throughput; NaN and inf are off
COST = np.array([1.0, 2.0, 3.0, 3.0, 4.0, np.nan, np.inf])
RATE = np.array([2.0, 2.0, 5.0, 5.0, 6.0, 9.0, 9.0])


def test_mixed_senses_by_hand():
    np.testing.assert_array_equal(front(COST, RATE, maximize=(False, True)),
                                  [True, False, True, False, True, False, False])


def test_each_sense_is_the_negated_other():
    # minimising (x, y) is maximising (-x, -y), whatever the points
    x, y = np.array([1.0, 2.0, 0.5, 2.0]), np.array([3.0, 1.0, 4.0, 1.0])
    np.testing.assert_array_equal(front(x, y), [True, True, True, False])
    np.testing.assert_array_equal(front(-x, -y, maximize=(True, True)),
                                  front(x, y))
    np.testing.assert_array_equal(front(x, -y, maximize=(False, True)), front(x, y))


@pytest.mark.parametrize("n", [0, 1])
def test_tiny_inputs(n):
    assert front(np.ones(n), np.ones(n)).tolist() == [True] * n
    assert front(np.full(n, np.nan), np.ones(n)).tolist() == [False] * n


def _dominated(a, b, i):
    """Whether some point beats point ``i`` (both minimised), or an identical
    point comes before it."""
    better = (a <= a[i]) & (b <= b[i]) & ((a < a[i]) | (b < b[i]))
    same = (a == a[i]) & (b == b[i])
    return bool(better.any() or same[:i].any())


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), max_size=25),
       st.tuples(st.booleans(), st.booleans()))
def test_front_is_the_set_of_non_dominated_points(points, maximize):
    xy = np.array(points, np.float64).reshape(-1, 2)
    got = front(xy[:, 0], xy[:, 1], maximize=maximize)
    a = -xy[:, 0] if maximize[0] else xy[:, 0]
    b = -xy[:, 1] if maximize[1] else xy[:, 1]
    want = [not _dominated(a, b, i) for i in range(len(xy))]
    assert got.tolist() == want


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0.0, 1.0, 2.0, 3.0, np.nan, np.inf]),
                          st.sampled_from([0.0, 1.0, 2.0, np.nan]),
                          st.integers(0, 3)), max_size=40),
       st.tuples(st.booleans(), st.booleans()))
def test_front_of_fronts_is_the_front(points, maximize):
    # points split into up to four parts at random (interleaved, as a cube's
    # blocks interleave in its flat order), ties and NaN included: the front
    # of the parts' fronts is the front of the whole, identical points kept
    # once at their first position
    xy = np.array([p[:2] for p in points], np.float64).reshape(-1, 2)
    part = np.array([p[2] for p in points], int)
    parts = [(np.flatnonzero(part == k), xy[part == k, 0], xy[part == k, 1])
             for k in range(4)]
    pos, x, y = front_of_fronts(parts, maximize=maximize)
    want = np.flatnonzero(front(xy[:, 0], xy[:, 1], maximize=maximize))
    np.testing.assert_array_equal(pos, want)
    np.testing.assert_array_equal(x, xy[want, 0])
    np.testing.assert_array_equal(y, xy[want, 1])
    assert front_of_fronts([], maximize=maximize)[0].size == 0


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**32 - 1), st.tuples(st.booleans(), st.booleans()))
def test_front_of_many_float32_points(seed, maximize):
    # hundreds of float32 points over a wide range, a third of them repeated,
    # some NaN: the front (whose sort sees only the points no bin below
    # beats) is the set of non-dominated points by the definition
    rng = np.random.default_rng(seed)
    xy = (rng.lognormal(0, 3, (400, 2)) * rng.choice([-1, 1], 2)).astype(np.float32)
    xy[rng.integers(0, 400, 130)] = xy[rng.integers(0, 400, 130)]
    xy[rng.integers(0, 400, 20), rng.integers(0, 2, 20)] = np.nan
    got = front(xy[:, 0], xy[:, 1], maximize=maximize)
    a = -xy[:, 0] if maximize[0] else xy[:, 0]
    b = -xy[:, 1] if maximize[1] else xy[:, 1]
    want = [bool(np.isfinite(a[i]) and np.isfinite(b[i])) and not _dominated(a, b, i)
            for i in range(len(xy))]
    assert got.tolist() == want
    assert 0 < got.sum() < 400
