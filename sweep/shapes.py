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


def bucket(n: int) -> int:
    """The least of 1, 2, 3, 4, 6, 8, 12, 16, ... (powers of two and 1.5
    times them) that is at least ``n``: a batch of points padded to it costs
    at most a third more than ``n`` points."""
    two = power_of_two(n)
    return 3 * two // 4 if two >= 4 and 3 * two // 4 >= n else two


AXIS_MIN = 8
"""Fewest values an axis without tables is padded to: its values cost a few
bytes each, and most grids' axes then share a length."""
