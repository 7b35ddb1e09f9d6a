"""``sweep-calibrate``: fit ``mbu``, ``mfu``, ``step_overhead_s`` to measurements.

As every console script (``sweep.cli.commands``): the config is composed and
every input file read and checked before Hydra creates a run directory (bad
input: one line naming the file and field, exit code 2, nothing written).
The job then fits the constants of one hardware x model x engine
(``sweep.search.calibrate``), prints them and each point's residual before and
after, and writes ``<out>/calibration/<name>.yaml``
(``sweep.cli.calibrate_io.write_profile``): a
config of the ``calibration`` group that ``sweep-grid`` and
``sweep-optimize`` select with ``hydra.searchpath=[file://<out>]
calibration=<name>``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import hydra
import numpy as np
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

from sweep.cli.calibrate_io import (
    BenchRun,
    StepTable,
    check_writable,
    profile_path,
    read_bench,
    read_steps,
    write_profile,
)
from sweep.cli.commands import CONFIG_MODULE, Command
from sweep.config.resolve import compose_object
from sweep.config.schema import CalibrateApp, CalibrationProfile, check_tensor_parallel
from sweep.errors import ConfigError


@dataclass
class CalibrateJob:
    """A checked ``sweep-calibrate`` run: its config and every measurement read."""

    app: CalibrateApp
    steps: list[StepTable]
    runs: list[BenchRun]
    target: Path | None  # the config file written; None: in the run directory

    @property
    def description(self) -> str:
        parts = [f"{Path(t.path).name} ({len(t)} steps)" for t in self.steps]
        parts += [f"{Path(r.path).name} (vllm bench serve, {len(r.pairs)} requests)"
                  for r in self.runs]
        return ", ".join(parts)


def _read_each(field: str, paths, read) -> list:
    """``read`` of every path; a refusal names the field that listed it."""
    try:
        return [read(p) for p in paths]
    except ConfigError as e:
        raise ConfigError(f"{field}: {e}") from None


def prepare(app: CalibrateApp) -> CalibrateJob:
    """Reads and checks every input; raises ``ConfigError`` (one line)."""
    hw = app.hardware
    check_tensor_parallel("tensor_parallel", [app.tensor_parallel], [hw], [app.model])
    steps = _read_each("steps_csv", app.steps_csv,
                       lambda p: read_steps(p, hw.name, hw.max_gpus_per_node))
    for t in steps:
        check_tensor_parallel(f"{Path(t.path).name}: tensor_parallel",
                              np.unique(t.tensor_parallel), [hw], [app.model])
    runs = _read_each("bench_json", app.bench_json, lambda p: read_bench(p, hw.name))
    target = None
    if app.out:
        target = profile_path(Path(app.out).expanduser(), app.name)
        check_writable(target)
    return CalibrateJob(app, steps, runs, target)


def check(app: str, argv: list[str]) -> CalibrateJob:
    """The preflight: compose, then read and check every input (no JAX work).

    Raises:
      ConfigError: one line naming the file or field and what is allowed.
    """
    return prepare(compose_object(app, argv))


def _pct(x: float) -> str:
    return f"{x * 100:+.1f} %"


def _ms(x: float) -> str:
    return f"{x * 1e3:,.3f}"


def _report(console: Console, job: CalibrateJob, fitted) -> None:
    """The fitted constants, then every point before (bound) and after."""
    app = job.app
    c = fitted.constants
    console.print(
        f"{COMMAND.name}: {app.hardware.name} x {app.model.name} x {app.engine}: "
        f"mbu {c['mbu']:.4f}, kv_mbu {c['kv_mbu']:.4f}, mfu {c['mfu']:.4f}, "
        f"step_overhead_s {c['step_overhead_s']:.4g} "
        f"({c['step_overhead_s'] * 1e3:.3f} ms), sequence_overhead_s "
        f"{c['sequence_overhead_s']:.4g} ({c['sequence_overhead_s'] * 1e6:.2f} us); "
        "rms "
        f"relative error {fitted.rms_before * 100:.1f} % (bound) -> "
        f"{fitted.rms_after * 100:.1f} % (fitted) over {fitted.points} points",
        markup=False, highlight=False, soft_wrap=True)
    for note in fitted.notes:
        console.print(f"{COMMAND.name}: {note}", markup=False, highlight=False,
                      soft_wrap=True)
    if fitted.steps is not None:
        table = Table(title="measured steps (ms)")
        for col in ("file", "batch", "context", "prefill", "TP", "measured", "bound",
                    "fitted", "residual", "bound by"):
            table.add_column(col, justify="left" if col in ("file", "bound by")
                             else "right")
        for r in fitted.steps:
            table.add_row(r["file"], f"{r['batch_size']:g}", f"{r['context_tokens']:g}",
                          f"{r['prefill_tokens']:g}", f"{r['tensor_parallel']:g}",
                          _ms(r["measured_s"]), _ms(r["bound_s"]), _ms(r["fitted_s"]),
                          _pct(r["fitted_s"] / r["measured_s"] - 1), r["bound_by"])
        console.print(table)
    if fitted.runs is not None:
        table = Table(title="vllm bench serve runs (ms; surrogate)")
        for col in ("file", "metric", "measured", "bound", "fitted", "residual"):
            table.add_column(col, justify="left" if col in ("file", "metric")
                             else "right")
        for r in fitted.runs:
            table.add_row(r["file"], r["metric"], _ms(r["measured_s"]),
                          _ms(r["bound_s"]), _ms(r["fitted_s"]),
                          _pct(r["fitted_s"] / r["measured_s"] - 1))
        console.print(table)


# out= names a config folder (a search-path root), which may hold a user's
# own configs: ``check`` refuses only a file there it did not write
COMMAND = Command("sweep-calibrate", "calibrate", check, kind=None,
                  default_name="calibration", resume=False)


@hydra.main(config_path=f"pkg://{CONFIG_MODULE}", config_name="calibrate",
            version_base="1.3")
def _calibrate_app(cfg: DictConfig) -> None:
    from sweep.search.calibrate import fit_job

    job = COMMAND.prepared()
    err = Console(stderr=True)
    target = job.target or profile_path(
        Path(HydraConfig.get().runtime.output_dir), job.app.name)
    try:
        check_writable(target)
    except ConfigError as e:
        COMMAND.fail(e)
    err.print(f"{COMMAND.name}: fitting {', '.join(job.app.fit.fit)} of "
              f"{job.app.hardware.name} x {job.app.model.name} x {job.app.engine} to "
              f"{job.description}", markup=False, highlight=False, soft_wrap=True)
    fitted = fit_job(job)
    console = Console(width=max(Console().width, 160))
    _report(console, job, fitted)
    app = job.app
    c = fitted.constants
    profile = CalibrationProfile(
        hardware=app.hardware.name, model=app.model.name, engine=app.engine,
        mbu=c["mbu"], mfu=c["mfu"], step_overhead_s=c["step_overhead_s"],
        kv_mbu=0.0 if c["kv_mbu"] == c["mbu"] else c["kv_mbu"],
        sequence_overhead_s=c["sequence_overhead_s"],
        source=app.source or f"{COMMAND.name}: {job.description}",
        version=app.version, license=app.license,
        active_params=app.model.active_params, fitted_points=fitted.points,
        rms_relative_error=round(fitted.rms_after, 4))
    write_profile(target, app.name, profile)
    root = target.parent.parent.resolve()
    console.print(f"calibration written to {target}; use it with: sweep-grid "
                  f"hydra.searchpath=[file://{root}] calibration={app.name}",
                  markup=False, highlight=False, soft_wrap=True)


def main() -> None:
    """``sweep-calibrate [hydra overrides]``: fit, print, write the config."""
    COMMAND.main(_calibrate_app)

