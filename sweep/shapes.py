"""Sizes rounded up so that few array shapes, hence few compiled programs,
cover the many sizes a job meets (XLA compiles once per shape)."""

from __future__ import annotations

SLOTS_MIN = 64
"""Fewest simulator slots compiled: below this a smaller program saves little."""


def power_of_two(n: int, minimum: int = 1) -> int:
    """The least power of two that is at least ``n`` and ``minimum``."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


def slots(concurrency: int) -> int:
    """Simulator slots for a concurrency (``max_num_seqs``) of at most this."""
    return power_of_two(concurrency, SLOTS_MIN)
