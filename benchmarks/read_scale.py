"""Peak memory and time of reading a large cube, against plain xarray reductions.

``python benchmarks/read_scale.py [--size 1e8] [--cube PATH] [--keep]``

Builds a roofline cube with ``sweep-grid`` (6 GPUs x 7 models x 4 TP x 3
batching x 2 traffic levels x concurrency x token budget x context, the
shipped configs; ``--size 1e8``: 100 x 50 x 20 of the last three, 100,800,000
points) in a temporary folder, or reads ``--cube``, and runs each case in a
fresh process on ``sweep.open_cube`` (lazy, one dask block per chunk file),
reporting its wall time and the process's peak RSS:

* ``plain min``: ``ds[cost].min(config dims).compute()``, the plain xarray
  reduction ``cheapest`` is compared with;
* ``cheapest``: ``ds.sweep.cheapest(config dims)`` and its cost computed
  (what ``plain min`` gives, with the argmin's position);
* ``cheapest, all variables``: the same with every variable at the best
  points computed (their chunks read);
* ``plain max of x, y``: ``ds[[x, y]].max(every dim but hardware)``, the plain
  reduction reading what ``pareto`` reads;
* ``pareto``: ``ds.sweep.pareto(x, y, by="hardware")`` of output tokens/s
  against tokens/s per user;
* ``summary table``: ``sweep.cube.summary.summary_table`` (what ``sweep-grid``
  prints at its end);
* ``sweep-report``: the whole report, charts included.

The ratio column is a case's time over its plain reduction's. The cube is
deleted at the end unless ``--keep`` (or ``--cube``) is given.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZES = {
    # 6 hardware x 7 models x 4 TP x 3 batching x 2 traffic = 1,008 per (c, b, ctx)
    "1e7": ["grid.concurrency=${range:8,1024,50,linear}",
            "grid.token_budget=${range:256,16384,20,log}",
            "grid.context_tokens=${range:500,32000,10,log}"],  # 10,080,000 points
    "1e8": ["grid.concurrency=${range:8,1024,100,linear}",
            "grid.token_budget=${range:256,16384,50,log}",
            "grid.context_tokens=${range:500,32000,20,log}"],  # 100,800,000 points
}

CASE = r"""
import json, resource, sys, time
path, case = sys.argv[1], sys.argv[2]
import sweep
from sweep.cube.accessor import CONFIG_DIMS

COST, X, Y = "cost_per_mtok_out_usd", "output_tokens_per_s", "user_tokens_per_s"
ds = sweep.open_cube(path)
over = [d for d in CONFIG_DIMS if d in ds.dims]
t = time.perf_counter()
if case == "plain min":
    ds[COST].min(over).compute()
elif case == "cheapest":
    ds.sweep.cheapest(over)[COST].compute()
elif case == "cheapest, all variables":
    ds.sweep.cheapest(over).compute()
elif case == "plain max of x, y":
    ds[[X, Y]].max([d for d in ds[X].dims if d != "hardware"]).compute()
elif case == "pareto":
    ds.sweep.pareto(X, Y, by="hardware")
elif case == "summary table":
    from sweep.cube.summary import summary_table
    summary_table(ds)
elif case == "sweep-report":
    import tempfile
    from sweep.cli.report import main
    with tempfile.TemporaryDirectory() as out:
        main([path, "--out", out + "/report"])
wall = time.perf_counter() - t
print(json.dumps({"points": int(ds[COST].size), "wall_s": wall,
                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""

CASES = (("plain min", None), ("cheapest", "plain min"),
         ("cheapest, all variables", "plain min"), ("plain max of x, y", None),
         ("pareto", "plain max of x, y"), ("summary table", None),
         ("sweep-report", None))


def build(size: str, out: Path) -> float:
    """Writes the cube with ``sweep-grid``; returns the seconds it took."""
    t = time.perf_counter()
    proc = subprocess.run(["sweep-grid", *SIZES[size], f"out={out}"],
                          capture_output=True, text=True, cwd=out.parent, check=False)
    if proc.returncode:
        raise SystemExit(proc.stderr[-2000:])
    return time.perf_counter() - t


def run_case(path: Path, case: str) -> dict:
    env = {**os.environ}
    env.setdefault("JAX_PLATFORMS", "cpu")
    proc = subprocess.run([sys.executable, "-c", CASE, str(path), case], env=env,
                          capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="1e8")
    ap.add_argument("--cube", type=Path, help="an existing cube to read instead")
    ap.add_argument("--keep", action="store_true", help="keep the cube built")
    a = ap.parse_args()
    folder = None
    if a.cube is None:
        folder = Path(tempfile.mkdtemp(prefix="read_scale_"))
        path = folder / "cube.zarr"
        print(f"sweep-grid: {a.size} points -> {path}: {build(a.size, path):.1f} s",
              flush=True)
    else:
        path = a.cube
    try:
        print(f"{'case':24} {'points':>12} {'wall s':>8} {'vs plain':>8} "
              f"{'peak RSS MB':>11}")
        walls = {}
        for case, base in CASES:
            r = run_case(path, case)
            walls[case] = r["wall_s"]
            ratio = f"{r['wall_s'] / walls[base]:.2f}" if base else ""
            print(f"{case:24} {r['points']:>12,} {r['wall_s']:>8.2f} {ratio:>8} "
                  f"{r['rss_mb']:>11,.0f}", flush=True)
    finally:
        if folder is not None and not a.keep:
            shutil.rmtree(folder)


if __name__ == "__main__":
    main()
