"""Console entry points: ``sweep-grid`` (and the other apps as they land).

Each command first composes and validates its config outside Hydra's run
(so that bad input gets one line and exit code 2, with no run directory and
no compilation), then hands the command line to ``@hydra.main``, which
composes again, creates the run directory and runs the job.

Between the two, ``_place_run`` checks the output path (``sweep.outputs``)
and adds the Hydra settings that place the run: with ``out=``, no run
directory at all; without, a sweep continues the unfinished run of the same
config under ``outputs/`` in its own directory.
"""

from __future__ import annotations

import glob
import re
import sys
from functools import partial
from pathlib import Path

import hydra
import numpy as np
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict
from rich.console import Console
from rich.progress import BarColumn, Progress, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from sweep import outputs
from sweep.config.resolve import grid_options
from sweep.config.schema import ConfigError
from sweep.config.store import register_configs
from sweep.outputs import OutputError

CONFIG_MODULE = "sweep.conf"
register_configs()


def _fail(command: str, e: ConfigError) -> None:
    print(f"{command}: error: {e}", file=sys.stderr)
    sys.exit(2)


def _preflight(command: str, app: str, argv: list[str], check):
    """Composes and checks the config before Hydra creates a run directory.

    Skipped when Hydra's own flags are given (``--help``, ``--cfg``, ``-m``):
    those are Hydra's to handle.

    Returns:
      What ``check`` returned, or None when skipped.
    """
    if any(a.startswith("-") for a in argv):
        return None
    try:
        with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
            return check(app, argv)
    except ConfigError as e:
        _fail(command, e)
    finally:
        GlobalHydra.instance().clear()


# with out=, Hydra writes nothing: no run directory, no .hydra/, no log file
# (the output's attributes carry the config and the overrides)
_NO_RUN_DIR = ("hydra.run.dir=.", "hydra.output_subdir=null",
               "hydra/job_logging=stdout")


def _quote(value: str) -> str:
    """``value`` as a quoted Hydra override value."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _place_run(app: str, argv: list[str], *, command: str, kind: str,
               default_name: str, resume: bool) -> list[str]:
    """Checks ``out=`` and returns the Hydra overrides that place the run.

    With ``out=``: the path is checked for an output of ``kind``
    (``sweep.outputs.check_target``) and Hydra writes nothing. Without, when
    ``resume``: the latest unfinished ``default_name`` of the same config
    under the outputs root (the run directory's pattern, ``outputs/*/*``) is
    continued in its own run directory, and a line says which. The user's own
    ``hydra.*`` settings win.
    """
    cfg = compose(config_name=app, overrides=argv, return_hydra_config=True)
    given = {o.split("=")[0].lstrip("+~") for o in argv}
    if cfg.out:
        outputs.check_target(Path(cfg.out).expanduser(), f"out={cfg.out}", kind)
        return [o for o in _NO_RUN_DIR if o.split("=")[0] not in given]
    if not resume or "hydra.run.dir" in given:
        return []
    from sweep import grid, results

    run_dir = OmegaConf.to_container(cfg.hydra.run, resolve=False)["dir"]
    folders = "*".join(glob.escape(p) for p in re.split(r"\$\{[^}]*\}", run_dir))
    with open_dict(cfg):
        del cfg["hydra"]  # what the job's config is (``@hydra.main`` drops it)
    state = results.find_unfinished(folders, default_name,
                                    grid.config_digest(OmegaConf.to_yaml(cfg)))
    if state is None:
        return []
    print(f"{command}: resuming the unfinished sweep in {state.out} "
          f"({len(state.done)} of {state.blocks} blocks done)", file=sys.stderr)
    return [f"hydra.run.dir={_quote(str(state.out.parent))}"]


def _check_output(command: str, out: Path, label: str, kind: str) -> None:
    """In the job: the output path is the tool's to write, and (under ``-m``)
    this job's alone; else one line and exit code 2."""
    try:
        outputs.check_target(out, label, kind)
        hc = HydraConfig.get()
        if hc.mode == RunMode.MULTIRUN:
            outputs.claim(out, Path(hc.sweep.dir), hc.job.num, label)
    except OutputError as e:
        _fail(command, e)


def _overrides() -> list[str]:
    """The command line's overrides, with the search path (a ``hydra.`` key)."""
    overrides = HydraConfig.get().overrides
    searchpath = [o for o in overrides.hydra if o.startswith("hydra.searchpath=")]
    return [*searchpath, *overrides.task]


def _progress_bar(console: Console):
    """A progress callback that draws a bar once a job has several blocks."""
    state = {}

    def update(done: int, total: int) -> None:
        if total <= 1:
            return
        if "bar" not in state:
            bar = Progress("{task.description}", BarColumn(),
                           "{task.completed}/{task.total} blocks",
                           TimeElapsedColumn(), TimeRemainingColumn(),
                           console=console, transient=True)
            bar.start()
            state["bar"] = bar
            state["task"] = bar.add_task("evaluating", total=total)
        state["bar"].update(state["task"], completed=done)
        if done >= total:
            state["bar"].stop()

    return update


def summary_table(ds) -> Table:
    """Cheapest fitting point per hardware x model, and the largest concurrency.

    When the cube has p99 metrics, the cheapest point that also meets the SLO,
    with its p99 TTFT and ITL.
    """
    cost = ds["cost_per_mtok_out_usd"]
    slo = "slo_met" in ds
    if slo:
        cost = cost.where(ds["slo_met"])
    title = ("cheapest point meeting the p99 SLO" if slo else
             "cheapest point that fits") + ", per hardware x model"
    table = Table(title=title)
    cols = ["hardware", "model", "TP", "conc.", "context tok", "batching",
            "ITL ms", "tok/s/user", "USD/1M out", "max conc."]
    if slo:
        cols[6:6] = ["budget tok", "req/s", "p99 TTFT s", "p99 ITL ms"]
    for col in cols:
        left = col in ("hardware", "model", "batching")
        table.add_column(col, justify="left" if left else "right", no_wrap=True)
    for h in ds.hardware.values:
        for m in ds.model.values:
            c = cost.sel(hardware=h, model=m)
            if bool(np.isnan(c.values).all()):
                table.add_row(h, m, *[""] * (len(cols) - 4),
                              "meets no SLO" if slo else "does not fit", "")
                continue
            pos = np.unravel_index(np.nanargmin(c.values), c.shape)
            pt = ds.sel(hardware=h, model=m).isel(dict(zip(c.dims, pos)))
            row = [h, m, str(int(pt.tensor_parallel)), str(int(pt.concurrency)),
                   f"{int(pt.context_tokens):,}", str(pt.batching.values),
                   f"{float(pt.step_s) * 1e3:.2f}",
                   f"{float(pt.user_tokens_per_s):,.0f}",
                   f"{float(pt.cost_per_mtok_out_usd):.3f}",
                   f"{int(pt.max_concurrency_fit):,}"]
            if slo:
                row[6:6] = [f"{int(pt.token_budget):,}",
                            f"{float(pt.arrival_rate_per_s):g}",
                            f"{float(pt.ttft_p99_s):.3f}",
                            f"{float(pt.itl_p99_s) * 1e3:.2f}"]
            table.add_row(*row)
    return table


def _grid_check(app: str, overrides: list[str]) -> None:
    """The preflight: compose and check, but stack and sample nothing."""
    from sweep import grid

    grid.check(*grid_options(app, overrides))


def _grid_job(app: str, overrides: list[str]):
    from sweep import grid

    return grid.prepare(*grid_options(app, overrides))


@hydra.main(config_path=f"pkg://{CONFIG_MODULE}", config_name="grid",
            version_base="1.3")
def _grid_app(cfg: DictConfig) -> None:
    from sweep import grid, results

    console = Console(stderr=True)
    try:
        job = _grid_job("grid", _overrides())
    except ConfigError as e:
        _fail("sweep-grid", e)
    out = Path(job.app.out).expanduser() if job.app.out else Path(
        HydraConfig.get().runtime.output_dir) / "cube.zarr"
    _check_output("sweep-grid", out, f"out={job.app.out}" if job.app.out else str(out),
                  "cube")
    config_yaml = OmegaConf.to_yaml(cfg)
    attrs = results.provenance(config_yaml, job.app.seed, _overrides())
    blocks = sum(len(p.plan) for p in job.parts)
    try:
        with outputs.lock(out, grid.fingerprint(config_yaml, job)):
            console.print(f"sweep-grid: {job.points:,} points in {blocks} block(s) "
                          f"-> {out}")
            ds = grid.run(job, out, attrs, config_yaml,
                          progress=_progress_bar(console))
    except OutputError as e:
        _fail("sweep-grid", e)
    # a table is unreadable squeezed to 80 columns when stdout is a pipe
    Console(width=max(Console().width, 200)).print(summary_table(ds))
    console.print("USD/1M out: at full load (every slot busy); "
                  "effective_cost_per_mtok_out_usd in the cube prices the traffic")
    console.print(f"cube written to {out}")


def grid_main() -> None:
    """``sweep-grid [hydra overrides]``: evaluate a grid, write ``cube.zarr``."""
    argv = sys.argv[1:]
    _preflight("sweep-grid", "grid", argv, _grid_check)
    sys.argv += _preflight("sweep-grid", "grid", argv, partial(
        _place_run, command="sweep-grid", kind="cube", default_name="cube.zarr",
        resume=True)) or []
    _grid_app()
