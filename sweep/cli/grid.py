"""``sweep-grid``: evaluate a grid of deployments, write ``cube.zarr``.

As every console script (``sweep.cli.commands``), the command first composes and
validates its config outside Hydra's run (bad input: one line, exit code 2,
no run directory, no compilation), then hands the command line to
``@hydra.main``, which creates the run directory (or, without ``out=``,
continues the unfinished run of the same config) and runs the job on the
preflight's config. Before the first block, ``sweep-grid`` prints its plan
(``sweep.grid.plan``); while it runs, its progress (``sweep.grid.progress``); at the
end, the cheapest feasible point per scenario (``sweep.cube.summary``), reduced
from the blocks as they are evaluated (``summary.Rows``) where the cube has
one part.
"""

from __future__ import annotations

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from rich.console import Console

from sweep.cli.commands import CONFIG_MODULE, Command, check_output, overrides
from sweep.config.resolve import config_yaml, grid_options, restore
from sweep.config.schema import LatencyMethod
from sweep.cube import outputs
from sweep.cube.outputs import OutputError
from sweep.cube.summary import Rows, summary_table
from sweep.errors import ConfigError
from sweep.grid import calibration
from sweep.grid.plan import grid_plan
from sweep.grid.progress import BlockProgress


def check(app: str, argv: list[str]):
    """The preflight: compose and check, but stack and sample nothing.

    Returns:
      The validated base config and the grid's options (``grid_options``).

    Raises:
      ConfigError: one line naming the field, its value and what is allowed.
    """
    from sweep.grid import job as grid

    base, options = grid_options(app, argv)
    grid.check(base, options)
    return base, options


COMMAND = Command("sweep-grid", "grid", check, kind="cube", default_name="cube.zarr",
                  resume=True)


@hydra.main(config_path=f"pkg://{CONFIG_MODULE}", config_name="grid",
            version_base="1.3")
def _grid_app(cfg: DictConfig) -> None:
    import jax

    from sweep.cube import results
    from sweep.grid import job as grid
    base, options = COMMAND.prepared()
    console = Console(stderr=True)
    try:
        job = grid.prepare(base, options)
    except ConfigError as e:
        COMMAND.fail(e)
    out = Path(job.app.out).expanduser() if job.app.out else Path(
        HydraConfig.get().runtime.output_dir) / "cube.zarr"
    shard = job.app.shards
    # the sweep's config, the same for each of its shards
    sweep_cfg = cfg.copy()
    sweep_cfg.shard = None
    yaml_text = config_yaml(sweep_cfg)
    fingerprint = grid.fingerprint(yaml_text, job)
    check_output(COMMAND.name, out, f"out={job.app.out}" if job.app.out else str(out),
                  "cube", sweep=fingerprint if shard else None)
    attrs = results.provenance(
        yaml_text, job.app.seed,
        [o for o in restore(overrides()) if not o.startswith("shard=")], options)
    attrs.update(calibration.attrs(base.calibration, job.calibration))
    if job.notes:
        attrs["trace_replay"] = "\n".join(job.notes)
    plan = grid_plan(base, options)
    what = f"shard {shard[0]}/{shard[1]} of " if shard else ""
    progress = BlockProgress(console, "sweep-grid",
                             [(p.name, len(p.plan)) for p in job.parts])
    # the table's rows, reduced from each block while it is in memory
    rows = Rows.of(results.template(job.coords, job.parts, attrs, job.extra),
                   job.parts)
    try:
        with outputs.lock(out, fingerprint, shared=shard is not None):
            console.print(f"sweep-grid: {what}{plan.line(jax.default_backend())} -> "
                          f"{out}", markup=False, highlight=False, soft_wrap=True)
            console.print(calibration.line(base.calibration, job.calibration),
                          markup=False, highlight=False, soft_wrap=True)
            for note in job.notes:
                console.print(note, markup=False, highlight=False, soft_wrap=True)
            if base.grid.sensitivity and base.latency.method == LatencyMethod.simulate:
                console.print("grid.sensitivity: cost elasticities only; the p99 "
                              "elasticities need latency=surrogate (the simulator's "
                              "percentiles have no gradient)", markup=False,
                              highlight=False, soft_wrap=True)
            try:
                ds = grid.run(job, out, attrs, yaml_text, progress=progress,
                              shard=shard, observe=rows.add if rows else None)
            finally:
                progress.close()
    except OutputError as e:
        COMMAND.fail(e)
    if ds is None:
        console.print(f"sweep-grid: shard {shard[0]}/{shard[1]} done; the cube "
                      f"appears at {out} when the last shard finishes (or rerun "
                      "without shard= to evaluate what the others left)",
                      markup=False, highlight=False, soft_wrap=True)
        return
    table, notes = rows.table(ds) if rows else summary_table(ds)
    # a table is unreadable squeezed to 80 columns when stdout is a pipe
    Console(width=max(Console().width, 200)).print(table)
    for note in notes:
        console.print(note, markup=False)
    if warning := calibration.mixed(base.calibration, job.calibration):
        console.print(warning, markup=False, highlight=False, soft_wrap=True)
    console.print("USD/1M out: at full load (every slot busy); replicas: for the "
                  "row's traffic; effective_cost_per_mtok_out_usd in the cube "
                  "prices the traffic")
    console.print(f"cube written to {out}")


def grid_main() -> None:
    """``sweep-grid [hydra overrides]``: evaluate a grid, write ``cube.zarr``."""
    COMMAND.main(_grid_app)
