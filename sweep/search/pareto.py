"""The Pareto filter: points that no other point beats on two objectives.

One filter for the whole package: ``ds.sweep.pareto`` (a cube's fronts) and
``sweep.search.optimize`` (cost against p99 latency over the configurations a search
evaluated) both call ``front``. Each objective is minimised unless
``maximize`` says otherwise.
"""

from __future__ import annotations

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
    # as minimisation: larger-is-better objectives are negated
    a = -np.asarray(x, np.float64) if maximize[0] else np.asarray(x, np.float64)
    b = -np.asarray(y, np.float64) if maximize[1] else np.asarray(y, np.float64)
    idx = np.flatnonzero(np.isfinite(a) & np.isfinite(b))
    order = idx[np.lexsort((b[idx], a[idx]))]  # a ascending, then b; stable
    ys = b[order]
    # a point joins the front when its b beats every point sorted before it
    best_before = np.concatenate([[np.inf], np.minimum.accumulate(ys)[:-1]])
    out = np.zeros(a.shape, bool)
    out[order[ys < best_before]] = True
    return out
