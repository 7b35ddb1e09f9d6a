"""The status flags of a latency figure, shared by the simulator and the surrogate.

A status is an int32 bit mask: 0 is ok, and each set bit says one thing
about how the figures were obtained (the CF convention for independent flags,
``flag_masks`` with ``flag_meanings``, CF Conventions 1.11, sec. 3.5). The
simulator sets ``RAN_OUT``, ``OVERSIZE``, ``SLOTS_SHORT`` and ``UNMODELLED``
(a point it does not model); the surrogate sets ``SATURATED``,
``KV_INFEASIBLE`` and ``UNMODELLED``. The cube's ``latency_status``
variable carries ``cf_attrs()``.
"""

from __future__ import annotations

OK = 0
RAN_OUT = 1
OVERSIZE = 2
SLOTS_SHORT = 4
SATURATED = 8
KV_INFEASIBLE = 16
UNMODELLED = 32

FLAGS: dict[int, tuple[str, str]] = {
    RAN_OUT: ("ran_out", "the simulation ran out of loop iterations before every "
              "request finished (metrics are NaN; raise max_iterations)"),
    OVERSIZE: ("oversize", "a request needed more KV than the capacity and ran "
               "alone"),
    SLOTS_SHORT: ("slots_short", "max_slots < concurrency and all slots filled up, "
                  "so the slot array may have limited admission (metrics are NaN; "
                  "rerun with max_slots >= concurrency)"),
    SATURATED: ("saturated", "the offered load is at or past the capacity (the "
                "surrogate's utilisation >= 1): waits grow without bound"),
    KV_INFEASIBLE: ("kv_infeasible", "not one average request's KV fits beside the "
                    "weights"),
    UNMODELLED: ("unmodelled", "this latency model does not cover the point "
                 "(the surrogate: batching other than continuous; the "
                 "simulator: disaggregated pools without continuous batching); "
                 "metrics are NaN"),
}
"""bit -> (name, message)."""

INVALID = RAN_OUT | SLOTS_SHORT | UNMODELLED
"""Flags under which the figures are NaN."""


def cf_attrs() -> dict[str, object]:
    """CF attributes of a status variable (``flag_masks``/``flag_values``/…)."""
    bits = sorted(FLAGS)
    return {
        "flag_masks": bits,
        "flag_values": bits,
        "flag_meanings": " ".join(FLAGS[b][0] for b in bits),
    }


def names(status: int) -> list[str]:
    """The flags set in ``status`` (``[]`` when it is ok)."""
    return [FLAGS[b][0] for b in sorted(FLAGS) if int(status) & b]


def describe(status: int) -> str:
    """One line saying what a status means."""
    if int(status) == OK:
        return "ok"
    return "; ".join(f"{FLAGS[b][0]}: {FLAGS[b][1]}" for b in sorted(FLAGS)
                     if int(status) & b)
