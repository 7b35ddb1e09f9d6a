"""The Pareto filter: points that no other point beats on two objectives.

One filter for the whole package: ``ds.sweep.pareto`` (a cube's fronts) and
``sweep.search.optimize`` (cost against p99 latency over the configurations a search
evaluated) both call ``front``. Each objective is minimised unless
``maximize`` says otherwise.

A cube larger than memory is filtered in parts (``front_of_fronts``): a
point beaten in the whole is beaten by a point of the whole front, so the
front of the parts' fronts, taken in the points' order, is the whole front.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


def front(x, y, *, maximize: tuple[bool, bool] = (False, False)) -> np.ndarray:
    """Mask of the non-dominated points of ``(x, y)``.

    A point is off the front when another is at least as good on both
    objectives and better on one. Points with identical ``(x, y)`` are kept
    once (the first in order); points with a non-finite value are off.

    Args:
      x, y: 1-D arrays of the same length, one value per point.
      maximize: per objective, whether larger is better (default: smaller).

    Returns:
      A bool array of the points' shape.

    Examples:
      >>> front(np.array([1.0, 2.0, 2.0, 3.0]), np.array([5.0, 4.0, 6.0, 1.0]))
      array([ True,  True, False,  True])
    """
    out = np.zeros(np.shape(x), bool)
    out[front_indices(x, y, maximize=maximize)] = True
    return out


def front_indices(x, y, *, maximize: tuple[bool, bool] = (False, False)
                  ) -> np.ndarray:
    """``front`` as the indices of the front's points, increasing."""
    x, y = np.asarray(x), np.asarray(y)
    idx = np.flatnonzero(np.isfinite(x) & np.isfinite(y))
    # as minimisation: larger-is-better objectives are negated (floats as
    # they are: a float32 compares as its float64 does)
    a, b = (v[idx] if v.dtype.kind == "f" else v[idx].astype(np.float64)
            for v in (x, y))
    if maximize[0]:
        np.negative(a, out=a)
    if maximize[1]:
        np.negative(b, out=b)
    # most of a cube's points are beaten by far: dropped before the sort
    keep = ~_beaten_from_below(a, b)
    idx, a, b = idx[keep], a[keep], b[keep]
    keep = ~_beaten_from_below(b, a)  # the other way, on the points left
    idx, a, b = idx[keep], a[keep], b[keep]
    perm = np.lexsort((b, a))  # a ascending, then b; stable
    ys = b[perm]
    # a point joins the front when its b beats every point sorted before it
    best_before = np.concatenate([[np.inf], np.minimum.accumulate(ys)[:-1]])
    return np.sort(idx[perm[ys < best_before]])


def _beaten_from_below(a: np.ndarray, b: np.ndarray, bins: int = 1024) -> np.ndarray:
    """Points (both objectives minimised) that a point of a lower bin of ``a``
    beats: the bins split ``a``'s range evenly, so a point of a lower bin has
    a smaller ``a``, and beats those with no smaller ``b``. One pass, no sort;
    it finds most points off the front, never one on it."""
    if a.size == 0:
        return np.zeros(0, bool)
    lo = a.min()
    span = float(a.max()) - float(lo)
    big = float(np.finfo(a.dtype).max)  # a - lo and the scale are in a's dtype
    if not (0 < span <= big and bins / span <= big):
        return np.zeros(a.shape, bool)
    # bins 0 .. bins - 1 (rounding stays below bins), non-decreasing in a
    k = ((a - lo) * a.dtype.type((bins - 1) / span)).astype(np.intp)
    least = np.full(bins, np.inf, b.dtype)  # of b's dtype: ``at``'s fast loop
    np.minimum.at(least, k, b)
    below = np.concatenate([[np.inf], np.minimum.accumulate(least)[:-1]])
    return b >= below[k]


def front_of_fronts(parts: Iterable[tuple[np.ndarray, np.ndarray, np.ndarray]], *,
                    maximize: tuple[bool, bool] = (False, False)
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``front`` of a sequence of points given in parts, part by part.

    Each part is filtered alone, then the survivors of all parts together in
    the order of their positions, so that of identical points the first in
    the sequence is kept, as ``front`` keeps it.

    Args:
      parts: ``(pos, x, y)`` per part: the points' positions in the whole
        sequence (increasing within a part; the parts may interleave) and
        their values.
      maximize: as for ``front``.

    Returns:
      ``(pos, x, y)`` of the front's points, by position: ``pos`` equals
      ``np.flatnonzero(front(x_all, y_all))`` of the whole sequence.
    """
    kept = [(p[i], x[i], y[i]) for p, x, y in parts
            for i in [front_indices(x, y, maximize=maximize)]]
    if not kept:
        return np.zeros(0, np.int64), np.zeros(0), np.zeros(0)
    pos, x, y = (np.concatenate(c) for c in zip(*kept))
    order = np.argsort(pos, kind="stable")
    pos, x, y = pos[order], x[order], y[order]
    last = front_indices(x, y, maximize=maximize)
    return pos[last], x[last], y[last]
