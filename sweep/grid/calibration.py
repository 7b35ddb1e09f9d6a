"""Applies a ``calibration`` config: measured constants per hardware x model.

A calibration config (``conf/calibration/``, or a user's through
``hydra.searchpath``) lists profiles, each the constants of one hardware x
model x engine: ``mbu``, ``mfu``, ``step_overhead_s``, and the step's
measured shape, ``kv_mbu`` (0: ``mbu``) and ``sequence_overhead_s``. A run's
hardware x model takes, among the profiles of its hardware and the config's
``engine``: the model's own; else one for any model (``model: ""``); else the
one whose model size (active parameters) is nearest in ratio. Hardware with
no profile keeps its own constants: the theoretical bound as shipped
(``calibration=roofline`` has no profile at all). The apps' default is
``calibration=auto``, the shipped measured profiles (engine vLLM); the seed
experiment pins ``roofline``.

The grid gets the constants as a table over (hardware, model) that replaces
the three leaves of ``HardwareParams`` inside each point function
(``Calibrated``), so one compiled program serves every pair; with no profile
the parts are left exactly as they were. ``sweep-optimize`` gets them in each
candidate's hardware. The choice is printed in one line (``line``), whatever
the calibration, and recorded in the output's attributes (``attrs``).
``sweep-calibrate`` writes such configs (``sweep.cli.calibrate_io.write_profile``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

import numpy as np

from sweep.config.schema import Calibration, CalibrationProfile, Hardware, Model

CONSTANTS = ("mbu", "mfu", "step_overhead_s", "kv_mbu", "sequence_overhead_s")


@dataclass(frozen=True)
class Choice:
    """The constants one hardware x model runs with, and where they come from."""

    hardware: str
    model: str
    profile: CalibrationProfile | None  # None: the hardware's own constants
    mbu: float
    mfu: float
    step_overhead_s: float
    kv_mbu: float  # resolved: never 0
    sequence_overhead_s: float


def _nearest(profiles: list[CalibrationProfile], model: Model):
    sized = [p for p in profiles if p.active_params > 0]
    if not sized:
        return profiles[0]
    return min(sized,
               key=lambda p: abs(math.log(p.active_params / model.active_params)))


def choose(cal: Calibration, hardware: list[Hardware],
           models: list[Model]) -> list[list[Choice]]:
    """The constants of every hardware x model (rows: hardware)."""
    out = []
    for h in hardware:
        mine = [p for p in cal.profiles
                if p.hardware == h.name and p.engine == cal.engine]
        row = []
        for m in models:
            exact = ([p for p in mine if p.model == m.name]
                     or [p for p in mine if p.model == ""])
            p = exact[0] if exact else (_nearest(mine, m) if mine else None)
            src = p if p is not None else h
            row.append(Choice(h.name, m.name, p, float(src.mbu), float(src.mfu),
                              float(src.step_overhead_s),
                              float(src.kv_mbu or src.mbu),
                              float(src.sequence_overhead_s)))
        out.append(row)
    return out


def calibrated(choices: list[list[Choice]]) -> bool:
    """Whether any hardware x model takes a profile."""
    return any(c.profile is not None for row in choices for c in row)


def table(choices: list[list[Choice]]) -> np.ndarray:
    """``(hardware, model, 5)`` float32: the ``CONSTANTS``."""
    return np.array([[[getattr(c, k) for k in CONSTANTS] for c in row]
                     for row in choices], np.float32)


def _own(c: Choice) -> str:
    return (f"hardware's own constants (mbu {c.mbu:.3g}, mfu {c.mfu:.3g}, overhead "
            f"{c.step_overhead_s * 1e3:.3g} ms)")


def line(cal: Calibration, choices: list[list[Choice]]) -> str:
    """One line: the constants each hardware runs with, and their source."""
    if not cal.profiles:
        return (f"calibration={cal.name}: no measured profile, the theoretical "
                "bound; " + "; ".join(f"{row[0].hardware}: {_own(row[0])}"
                                     for row in choices))
    parts = []
    for row in choices:
        taken = [c for c in row if c.profile is not None]
        if not taken:
            parts.append(f"{row[0].hardware}: no {cal.engine} profile, {_own(row[0])}")
            continue
        if len(taken) > 2:  # the attributes keep each model's constants

            def span(k, scale=1.0):
                lo, hi = (f(getattr(c, k) * scale for c in taken) for f in (min, max))
                return f"{lo:.3g}" if lo == hi else f"{lo:.3g}-{hi:.3g}"

            values = (f"{len(taken)} models mbu {span('mbu')} kv_mbu "
                      f"{span('kv_mbu')} mfu {span('mfu')} overhead "
                      f"{span('step_overhead_s', 1e3)} ms + "
                      f"{span('sequence_overhead_s', 1e6)} us/sequence")
        else:
            values = ", ".join(
                f"{c.model} mbu {c.mbu:.3g} kv_mbu {c.kv_mbu:.3g} mfu {c.mfu:.3g} "
                f"overhead {c.step_overhead_s * 1e3:.3g} ms + "
                f"{c.sequence_overhead_s * 1e6:.3g} us/sequence"
                + ("" if c.profile.model in ("", c.model)
                   else f" (as {c.profile.model})")
                for c in taken)
        p = taken[0].profile
        origin = "; ".join(x for x in (p.source, p.version, p.license) if x)
        parts.append(f"{row[0].hardware}: {values}"
                     + (f" [{origin}]" if origin else ""))
    return f"calibration={cal.name} (engine {cal.engine}): " + "; ".join(parts)


def mixed(cal: Calibration, choices: list[list[Choice]]) -> str:
    """A warning line when some hardware runs with measured profiles and some
    without (their rows are not comparable: the bound is optimistic); else ""."""
    bare = [row[0] for row in choices if all(c.profile is None for c in row)]
    if not bare or len(bare) == len(choices):
        return ""
    return (f"note: {', '.join(c.hardware for c in bare)} without a measured "
            f"{cal.engine} profile: "
            + "; ".join(f"{c.hardware} at the {_own(c)}" for c in bare)
            + "; the other hardware runs with measured profiles, so these rows "
            "read cheaper and faster than a measured engine would")


def attrs(cal: Calibration, choices: list[list[Choice]]) -> dict[str, str]:
    """Output attributes recording the calibration and every pair's constants."""
    rows = [{"hardware": c.hardware, "model": c.model,
             **{k: getattr(c, k) for k in CONSTANTS},
             "profile": None if c.profile is None else dataclasses.asdict(c.profile)}
            for row in choices for c in row]
    return {"calibration": cal.name, "calibration_engine": cal.engine,
            "calibration_choice": line(cal, choices),
            "calibration_constants": json.dumps(rows)}


@dataclass(frozen=True)
class Calibrated:
    """A point function whose ``hardware`` takes the (hardware, model)
    constants of its ``calibration`` table (hashable: a static jit argument)."""

    point: object

    def __call__(self, *, hardware, calibration, **values):
        hardware = hardware._replace(
            **{k: calibration[i] for i, k in enumerate(CONSTANTS)})
        return self.point(hardware=hardware, **values)


def attach(parts, choices: list[list[Choice]]) -> None:
    """Makes each grid part take its constants from ``choices`` (in place);
    nothing changes when no pair takes a profile."""
    if not calibrated(choices):
        return
    values = table(choices)
    for part in parts:
        part.point = Calibrated(part.point)
        part.lookups["calibration"] = (values, ("hardware", "model"))


def hardware_for(h: Hardware, choice: Choice) -> Hardware:
    """``h`` with the constants of ``choice`` (for per-candidate hardware)."""
    if choice.profile is None:
        return h
    return dataclasses.replace(h, **{k: getattr(choice, k) for k in CONSTANTS})
