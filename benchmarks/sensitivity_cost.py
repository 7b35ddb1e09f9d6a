"""What ``grid.sensitivity=true`` (the cost elasticities, ``d_cost_d_*``) adds
to the default ``sweep-grid`` run.

The default run (no other argument: every shipped hardware x model, the
default grid, ``calibration=auto``) is prepared with ``sweep.grid.job.prepare``
with and without ``grid.sensitivity=true``, and each one's roofline part
evaluated block by block (``iterate_blocks``, the sweep's own path) in one
process, taking turns, best of ``--repeats``. It prints the first pass
(compilation included) and the best evaluation time of each, their ratio,
and the cube's bytes per point with and without (the zarr write grows with
them). ``--write`` also times each whole sweep, zarr write included
(``sweep.grid.job.run``), once.

Usage::

    python benchmarks/sensitivity_cost.py [--repeats 3] [--write]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from datetime import date
from pathlib import Path

import jax
import numpy as np
from hydra import initialize_config_module

from sweep.config.resolve import grid_options
from sweep.config.store import register_configs
from sweep.grid import job as grid
from sweep.grid.evaluate import evaluate_region, iterate_blocks

WAYS = {"without": [], "with": ["grid.sensitivity=true"]}


def evaluate(part) -> float:
    """Seconds to evaluate every block of ``part`` (compiled)."""
    t = time.perf_counter()
    for _ in iterate_blocks(part.fn, part.axes, part.plan, part.tables,
                            part.table_dims):
        pass
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--write", action="store_true",
                    help="also time each whole default sweep with its zarr write")
    args = ap.parse_args()
    register_configs()
    jobs = {}
    for name, extra in WAYS.items():
        with initialize_config_module("sweep.conf", version_base="1.3"):
            jobs[name] = grid.prepare(*grid_options("grid", extra))
    job = jobs["without"]
    print(f"{date.today()}, {jax.default_backend()}, default sweep-grid "
          f"(calibration={job.app.calibration.name}): {job.points:,} points in "
          f"{len(job.parts[0].plan)} block(s)")
    for name, j in jobs.items():
        evaluate_region.clear_cache()
        print(f"{name:>8} elasticities: first pass (compile + evaluate) "
              f"{evaluate(j.parts[0]):.2f} s")
    best = {name: np.inf for name in jobs}
    for _ in range(args.repeats):
        for name, j in jobs.items():
            best[name] = min(best[name], evaluate(j.parts[0]))
    for name, s in best.items():
        print(f"{name:>8} elasticities: {s:.3f} s, {job.points / s / 1e6:.1f} M "
              f"points/s (best of {args.repeats})")
    print(f"evaluation time with / without: {best['with'] / best['without']:.2f}x")
    size = {name: sum(np.dtype(m.dtype).itemsize for m in j.parts[0].variables)
            for name, j in jobs.items()}
    print(f"cube bytes per point (before compression): {size['with']} with, "
          f"{size['without']} without ({size['with'] / size['without']:.2f}x)")
    if args.write:
        for name, j in jobs.items():
            with tempfile.TemporaryDirectory() as tmp:
                t = time.perf_counter()
                grid.run(j, Path(tmp) / "cube.zarr", {}, name)
                print(f"{name:>8} elasticities: whole sweep, zarr write included "
                      f"(compiled), {time.perf_counter() - t:.2f} s")


if __name__ == "__main__":
    main()
