"""What the console scripts (``sweep-grid``, ``sweep-optimize``,
``sweep-calibrate``) share.

Each command first composes and validates its config outside Hydra's run
(``preflight``: bad input gets one line and exit code 2, with no run
directory and no compilation), then hands the command line to
``@hydra.main``, which creates the run directory and runs the job on the
preflight's config.

``Command`` is one console script: ``main`` runs the preflight and then the
Hydra app, whose job starts with ``prepared`` (the checked config, JAX's
backend probe quiet, the compilation cache on).

Between the two, ``place_run`` checks the output path (``sweep.cube.outputs``)
and adds the Hydra settings that place the run: with ``out=``, no run
directory at all; without, a sweep continues the unfinished run of the same
config under ``outputs/`` in its own directory. In the job, ``check_output``
checks the path again (and claims it under ``-m``), ``overrides`` gives the
command line back, and ``fail`` is the one-line exit.
"""

from __future__ import annotations

import glob
import logging
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

from hydra import initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

from sweep.config.resolve import (
    HydraSettings,
    composed,
    composing_once,
    config_yaml,
    stash_lists,
)
from sweep.config.store import register_configs, resolve_lists_to_nodes
from sweep.cube import outputs
from sweep.cube.outputs import OutputError
from sweep.errors import ConfigError

CONFIG_MODULE = "sweep.conf"
"""The package holding the shipped configs (``@hydra.main``'s ``pkg://`` path)."""
register_configs()


def fail(command: str, e: ConfigError) -> None:
    """One line ``<command>: error: <e>`` on stderr, then exit code 2."""
    print(f"{command}: error: {e}", file=sys.stderr)
    sys.exit(2)


def preflight(command: str, app: str, argv: list[str], *checks):
    """Composes and checks the config before Hydra creates a run directory.

    Each of ``checks`` is called with ``(app, argv)`` in turn, in one Hydra
    context that composes the app once per list of overrides
    (``sweep.config.resolve.composing_once``). Skipped when Hydra's own flags
    are given (``--help``, ``--cfg``, ``-m``): those are Hydra's to handle.

    Returns:
      What each check returned (None each when skipped).
    """
    if any(a.startswith("-") for a in argv):
        return [None] * len(checks)
    try:
        with initialize_config_module(CONFIG_MODULE, version_base="1.3"), \
                composing_once():
            return [check(app, argv) for check in checks]
    except ConfigError as e:
        fail(command, e)
    finally:
        GlobalHydra.instance().clear()


class Command:
    """One console script: its name, its Hydra app (config name), its
    ``check`` and how its output is placed (``place_run``).

    ``main`` runs the preflight (``start``) and then the ``@hydra.main``
    function, which begins with ``prepared``: the same checked config, or,
    when Hydra's own flags skipped the preflight (``-m``), the config
    checked again from this job's overrides.
    """

    def __init__(self, name: str, app: str, check, *, kind: str | None,
                 default_name: str, resume: bool):
        self.name, self.app, self.check = name, app, check
        self._place = dict(kind=kind, default_name=default_name, resume=resume)
        self._checked = None

    def main(self, hydra_app) -> None:
        """The console script: the preflight, then ``hydra_app()``. The
        compilation cache is on from the start: the preflight's checks may
        compile small programs too (``sweep-optimize``'s did, uncached)."""
        enable_compilation_cache()
        self._checked, hydra = start(self.name, self.app, self.check, **self._place)
        with known_mode(hydra):
            hydra_app()

    def prepared(self):
        """In the job, before any compilation: what ``check`` returns for this
        job, with JAX's backend probe quiet and the persistent compilation
        cache on (in each job: a launcher's workers too). Bad input: one
        line, exit code 2."""
        quiet_backend_probe()
        enable_compilation_cache()
        try:
            return self._checked or self.check(self.app, overrides())
        except ConfigError as e:
            fail(self.name, e)

    def fail(self, e: ConfigError) -> None:
        """One line ``<name>: error: <e>``, exit code 2."""
        fail(self.name, e)


def start(command: str, app: str, check, *, kind: str | None, default_name: str,
          resume: bool):
    """Readies ``sys.argv`` for the command's ``@hydra.main``.

    Long axis lists are stashed (Hydra's grammar is quadratic in a list's
    length), the config is checked (``preflight``) and the run is placed
    (``place_run``), all before Hydra creates a run directory.

    Returns:
      What ``check`` returned and Hydra's settings in the composition
      (``sweep.config.resolve.HydraSettings``), or ``(None, None)`` when
      Hydra's own flags skip the preflight.
    """
    argv = stash_lists(sys.argv[1:])
    if "--resolve" in argv:  # Hydra then resolves the config in place
        resolve_lists_to_nodes()
    checked, placement, hydra = preflight(command, app, argv, check, partial(
        place_run, command=command, kind=kind, default_name=default_name,
        resume=resume), lambda app, argv: composed(app, argv)[1])
    sys.argv[1:] = argv + (placement or [])
    return checked, hydra


@contextmanager
def known_mode(hydra: HydraSettings | None) -> Iterator[None]:
    """Within: Hydra takes ``hydra.mode`` as the config's run mode.

    Before the run's own composition, ``@hydra.main`` composes the whole
    config once more only to read ``hydra.mode`` (``Hydra.get_mode``): 0.5 s
    of a 4.4 s warm ``sweep-grid`` on a 2-core CPU. The preflight has read it
    from the same command line (the run's placement overrides only
    ``hydra.run``, ``hydra.output_subdir`` and ``hydra/job_logging``).
    None (no preflight): Hydra reads it itself.
    """
    from hydra._internal.hydra import Hydra

    own = Hydra.get_mode
    if hydra is not None:
        Hydra.get_mode = lambda self, config_name, overrides: hydra.mode
    try:
        yield
    finally:
        Hydra.get_mode = own


# with out=, Hydra writes nothing: no run directory, no .hydra/, no log file
# (the output's attributes carry the config and the overrides)
_NO_RUN_DIR = ("hydra.run.dir=.", "hydra.output_subdir=null",
               "hydra/job_logging=stdout")


def _quote(value: str) -> str:
    """``value`` as a quoted Hydra override value."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def place_run(app: str, argv: list[str], *, command: str, kind: str | None,
              default_name: str, resume: bool) -> list[str]:
    """Checks ``out=`` and returns the Hydra overrides that place the run.

    With ``out=``: the path is checked for an output of ``kind``
    (``sweep.cube.outputs.check_target``; ``kind`` None: the command's
    ``check`` has checked it) and Hydra writes nothing. Without, when
    ``resume``: the latest unfinished ``default_name`` of the same config
    under the outputs root (the run directory's pattern, ``outputs/*/*``) is
    continued in its own run directory, and a line says which. The user's own
    ``hydra.*`` settings win.
    """
    cfg, hydra = composed(app, argv)  # the job's config (without Hydra's node)
    given = {o.split("=")[0].lstrip("+~") for o in argv}
    if cfg.out:
        if kind is not None:
            outputs.check_target(Path(cfg.out).expanduser(), f"out={cfg.out}", kind)
        return [o for o in _NO_RUN_DIR if o.split("=")[0] not in given]
    if not resume or "hydra.run.dir" in given:
        return []
    from sweep.cube import results
    from sweep.grid import job as grid
    folders = "*".join(glob.escape(p) for p in re.split(r"\$\{[^}]*\}",
                                                        hydra.run_dir))
    state = results.find_unfinished(folders, default_name,
                                    grid.config_digest(config_yaml(cfg)))
    if state is None:
        return []
    print(f"{command}: resuming the unfinished sweep in {state.out} "
          f"({len(state.done())} of {state.blocks} blocks done)", file=sys.stderr)
    return [f"hydra.run.dir={_quote(str(state.out.parent))}"]


def check_output(command: str, out: Path, label: str, kind: str,
                 sweep: str | None = None) -> None:
    """In the job: the output path is the tool's to write, and (under ``-m``)
    this job's alone, or shared with the other shards of the sweep ``sweep``;
    else one line and exit code 2."""
    try:
        outputs.check_target(out, label, kind)
        hc = HydraConfig.get()
        if hc.mode == RunMode.MULTIRUN:
            outputs.claim(out, Path(hc.sweep.dir), hc.job.num, label, sweep)
    except OutputError as e:
        fail(command, e)


def overrides() -> list[str]:
    """The command line's overrides, with the search path (a ``hydra.`` key)."""
    overrides = HydraConfig.get().overrides
    searchpath = [o for o in overrides.hydra if o.startswith("hydra.searchpath=")]
    return [*searchpath, *overrides.task]


CACHE_ENV = "SWEEP_COMPILATION_CACHE"
"""``off`` (or ``0``, ``false``, ``no``): no persistent compilation cache;
a folder: the cache's folder."""

CACHE_MIN_COMPILE_S = 0.0
"""Programs that compile faster than this are not cached. JAX's default, 1 s,
leaves out a grid's roofline program (0.5-1 s on a 2-core CPU); 0.1 s left
out the one-off operations (random-number setup, small table builds) that
a warm ``sweep-grid`` still compiled: 1.25 s of its compile time, 0.34 s
with every program cached (``benchmarks/first_answer.py``)."""


def compilation_cache_dir() -> str | None:
    """The persistent compilation cache's folder; None when turned off.

    ``SWEEP_COMPILATION_CACHE`` (a folder, or ``off``), else JAX's own
    ``JAX_COMPILATION_CACHE_DIR``, else ``$XDG_CACHE_HOME/llm-serving-sweep/jax``
    (``~/.cache/llm-serving-sweep/jax`` when ``XDG_CACHE_HOME`` is unset).
    """
    setting = os.environ.get(CACHE_ENV, "").strip()
    if setting.lower() in ("off", "0", "false", "no"):
        return None
    if setting:
        return os.path.expanduser(setting)
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return os.environ["JAX_COMPILATION_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(
        os.path.expanduser("~"), ".cache")
    return os.path.join(base, "llm-serving-sweep", "jax")


def enable_compilation_cache() -> None:
    """Keeps compiled programs in JAX's persistent cache (``compilation_cache_dir``)
    so that a second run with the same shapes skips compiling; before any
    compilation. A minimum compile time set in JAX's own environment variable
    is kept."""
    import jax

    folder = compilation_cache_dir()
    if folder is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return
    jax.config.update("jax_compilation_cache_dir", folder)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs",
                          CACHE_MIN_COMPILE_S)


def quiet_backend_probe() -> None:
    """Keeps JAX's probing for absent accelerators out of the output.

    JAX logs at INFO each backend it fails to find (``Unable to initialize
    backend 'tpu'``) and Hydra prints INFO; only that logger is raised to
    WARNING, so JAX's warnings and errors, and a platform the user asked for
    with ``JAX_PLATFORMS`` that fails, still show.
    """
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
