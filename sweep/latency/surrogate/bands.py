"""Probability bands: the unit of the surrogate's summaries.

A law is summarised by the conditional means of fixed probability bands
(edges in ``[0, 1]``, finer in the upper tail so that p99 is resolved):
the length tables' (``lengths.BAND_EDGES``) and a trace's waits and counts
(``bursts.WAIT_EDGES``).
"""

from __future__ import annotations

import numpy as np


def membership(probs: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """``(V, J)``: the probability of each of ``V`` ascending values (of
    probabilities ``probs``) that falls in each band between ``edges``; a
    value spanning several bands splits its mass."""
    hi = np.cumsum(probs)
    lo = hi - probs
    return np.clip(np.minimum(hi[:, None], edges[None, 1:])
                   - np.maximum(lo[:, None], edges[None, :-1]), 0.0, None)


def band_stats(values: np.ndarray, member: np.ndarray) -> tuple[np.ndarray, ...]:
    """Conditional mean and std of each band (``member``: ``membership``)."""
    mass = member.sum(axis=0)
    mean = values @ member / mass
    var = ((values[:, None] - mean[None]) ** 2 * member).sum(axis=0) / mass
    return mean, np.sqrt(np.maximum(var, 0.0))
