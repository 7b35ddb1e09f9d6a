"""Console entry points: ``sweep-grid`` (and the other apps as they land).

Each command first composes and validates its config outside Hydra's run
(so that bad input gets one line and exit code 2, with no run directory and
no compilation), then hands the command line to ``@hydra.main``, which
creates the run directory and runs the job on the preflight's config. Before
the first block, ``sweep-grid`` prints its plan (``sweep.plan``); while it
runs, its progress (``sweep.progress``); at the end, the cheapest feasible
point per scenario (``sweep.summary``).

Between the two, ``_place_run`` checks the output path (``sweep.outputs``)
and adds the Hydra settings that place the run: with ``out=``, no run
directory at all; without, a sweep continues the unfinished run of the same
config under ``outputs/`` in its own directory.
"""

from __future__ import annotations

import glob
import logging
import re
import sys
from functools import partial
from pathlib import Path

import hydra
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict
from rich.console import Console

from sweep import calibration, outputs
from sweep.config.resolve import config_yaml, grid_options, restore, stash_lists
from sweep.config.schema import ConfigError
from sweep.config.store import register_configs
from sweep.outputs import OutputError
from sweep.plan import grid_plan
from sweep.progress import BlockProgress
from sweep.summary import summary_table

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
                                    grid.config_digest(config_yaml(cfg)))
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


def quiet_backend_probe() -> None:
    """Keeps JAX's probing for absent accelerators out of the output.

    JAX logs at INFO each backend it fails to find (``Unable to initialize
    backend 'tpu'``) and Hydra prints INFO; only that logger is raised to
    WARNING, so JAX's warnings and errors, and a platform the user asked for
    with ``JAX_PLATFORMS`` that fails, still show.
    """
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)


def _grid_check(app: str, overrides: list[str]):
    """The preflight: compose and check, but stack and sample nothing."""
    from sweep import grid

    base, options = grid_options(app, overrides)
    grid.check(base, options)
    return base, options


# what the preflight composed from the same command line (Hydra's own
# settings aside, which do not change it); None when Hydra flags skip it
_preflight_options = None


@hydra.main(config_path=f"pkg://{CONFIG_MODULE}", config_name="grid",
            version_base="1.3")
def _grid_app(cfg: DictConfig) -> None:
    import jax

    from sweep import grid, results

    quiet_backend_probe()
    console = Console(stderr=True)
    try:
        base, options = _preflight_options or grid_options("grid", _overrides())
        job = grid.prepare(base, options)
    except ConfigError as e:
        _fail("sweep-grid", e)
    out = Path(job.app.out).expanduser() if job.app.out else Path(
        HydraConfig.get().runtime.output_dir) / "cube.zarr"
    _check_output("sweep-grid", out, f"out={job.app.out}" if job.app.out else str(out),
                  "cube")
    yaml_text = config_yaml(cfg)
    attrs = results.provenance(yaml_text, job.app.seed, restore(_overrides()))
    choices = calibration.choose(base.calibration, options["hardware"],
                                 options["model"])
    attrs.update(calibration.attrs(base.calibration, choices))
    if calibration.calibrated(choices):
        console.print(calibration.line(base.calibration, choices), markup=False,
                      highlight=False, soft_wrap=True)
    plan = grid_plan(base, options)
    progress = BlockProgress(console, "sweep-grid",
                             [(p.name, len(p.plan)) for p in job.parts])
    try:
        with outputs.lock(out, grid.fingerprint(yaml_text, job)):
            console.print(f"sweep-grid: {plan.line(jax.default_backend())} -> {out}",
                          markup=False, highlight=False, soft_wrap=True)
            try:
                ds = grid.run(job, out, attrs, yaml_text, progress=progress)
            finally:
                progress.close()
    except OutputError as e:
        _fail("sweep-grid", e)
    table, notes = summary_table(ds)
    # a table is unreadable squeezed to 80 columns when stdout is a pipe
    Console(width=max(Console().width, 200)).print(table)
    for note in notes:
        console.print(note, markup=False)
    console.print("USD/1M out: at full load (every slot busy); replicas: for the "
                  "row's traffic; effective_cost_per_mtok_out_usd in the cube "
                  "prices the traffic")
    console.print(f"cube written to {out}")


def grid_main() -> None:
    """``sweep-grid [hydra overrides]``: evaluate a grid, write ``cube.zarr``."""
    global _preflight_options
    # Hydra's grammar is quadratic in a list's length: long lists go by stash
    argv = stash_lists(sys.argv[1:])
    _preflight_options = _preflight("sweep-grid", "grid", argv, _grid_check)
    sys.argv[1:] = argv + (_preflight("sweep-grid", "grid", argv, partial(
        _place_run, command="sweep-grid", kind="cube", default_name="cube.zarr",
        resume=True)) or [])
    _grid_app()
