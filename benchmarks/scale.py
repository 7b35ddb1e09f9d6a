"""Points per second and peak memory of a sweep's evaluation on 1 and 4 devices.

``python benchmarks/scale.py [--roofline 1e6 1e7] [--surrogate 1e5] [--devices 1 4]
[--write]``

Each case runs in a fresh process with
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` on the CPU (or on the
machine's accelerators when ``JAX_PLATFORMS`` names them), evaluates a grid of
about the given number of points through
``sweep.grid.evaluate.iterate_blocks`` (the sweep's own path: write blocks in
compiled batches, one batch per device per call, results on the host) on the
first ``devices`` devices, and reports the time of a second pass (the first
compiles) and the process's peak RSS. The ratio column is points/s against the
1-device case of the same grid, measured the same way. Zarr writes are not
included, unless ``--write``: then each pass is ``sweep.grid.job.run``, the
whole sweep (evaluation, zarr writes with their block markers, the finished
store), into a fresh folder beside the system's temporary files, with the
summary table reduced from the blocks as they are written
(``sweep.cube.summary.Rows``); the time of that table from memory and of
the same table read back from the written cube are printed after the row
(the pass's time includes the in-memory reduction, not the tables).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CASE = r"""
import json, math, resource, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import jax
from helpers import grid_job
from sweep.grid import job as grid
from sweep.grid.evaluate import iterate_blocks

kind, points, devices = sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
write = sys.argv[5] == "write"
if kind == "roofline":
    # 6 GPUs x 7 models x 4 TP x conc x budget x 3 contexts x 3 batching x 2
    # traffics, in blocks of 2**18 points (several per device; with --write the
    # default blocks, as a user's sweep writes them)
    n = max(2, round(math.sqrt(points / (6 * 7 * 4 * 3 * 3 * 2))))
    args = [*([] if write else ["grid.chunk_points=262144"]),
            f"grid.concurrency=${{range:1,4096,{n},linear}}",
            f"grid.token_budget=${{range:256,65536,{n},linear}}"]
    part_index = 0
else:
    # 2 GPUs x 1 model x 4 TP x conc x budget x 10 rates, continuous batching
    n = max(2, round(math.sqrt(points / (2 * 4 * 10))))
    args = ["grid.hardware=[h100_sxm,h200_sxm]", "model=qwen3_8b", "latency=surrogate",
            "grid.batching=[continuous]", "grid.context_tokens=[1500]",
            "grid.arrival_rate_per_s=${range:0.5,20,10,log}",
            f"grid.concurrency=${{range:1,1024,{n},linear}}",
            f"grid.token_budget=${{range:256,16384,{n},linear}}"]
    part_index = 1
job = grid_job(args)
if write:
    job.parts = job.parts[:part_index + 1]
part = job.parts[part_index]
count = math.prod(part.plan.shape)

summary_s = {}

def sweep():
    if write:
        from sweep.cube import results, summary
        # the summary table of the cube as sweep-grid prints it: reduced from
        # the blocks in memory, and read back from the written cube
        rows = summary.Rows.of(results.template(job.coords, job.parts, {},
                                                job.extra), job.parts)
        with tempfile.TemporaryDirectory() as folder:
            ds = grid.run(job, Path(folder) / "cube.zarr", {}, "scale",
                          devices=jax.devices()[:devices],
                          observe=rows.add if rows else None)
            if rows:
                t = time.perf_counter(); memory = rows.table(ds)
                summary_s["memory"] = time.perf_counter() - t
                t = time.perf_counter(); cube = summary.summary_table(ds)
                summary_s["cube"] = time.perf_counter() - t
        return
    for _ in iterate_blocks(part.fn, part.axes, part.plan, part.tables,
                            part.table_dims, batch=part.batch,
                            devices=jax.devices()[:devices],
                            flat=part.flat, points=part.points,
                            xla_defaults=part.xla_defaults):
        pass

t0 = time.perf_counter(); sweep(); first = time.perf_counter() - t0
t0 = time.perf_counter(); sweep(); second = time.perf_counter() - t0
print(json.dumps({"points": count, "first_s": first, "second_s": second,
                  "summary_s": summary_s,
                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "backend": jax.default_backend()}))
"""


def run_case(kind: str, points: float, devices: int, write: bool) -> dict:
    here = Path(__file__).resolve().parents[1]
    env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") +
                                       " --xla_force_host_platform_device_count=4")}
    env.setdefault("JAX_PLATFORMS", "cpu")
    proc = subprocess.run([sys.executable, "-c", CASE, str(here / "tests"), kind,
                           str(points), str(devices),
                           "write" if write else "evaluate"],
                          env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--roofline", type=float, nargs="*", default=[1e6, 1e7])
    ap.add_argument("--surrogate", type=float, nargs="*", default=[1e5])
    ap.add_argument("--devices", type=int, nargs="*", default=[1, 4])
    ap.add_argument("--write", action="store_true",
                    help="time the whole sweep, zarr writes included")
    a = ap.parse_args()
    print(f"{'part':9} {'points':>11} {'dev':>3} {'compile+run s':>13} {'run s':>7} "
          f"{'points/s':>11} {'vs 1 dev':>8} {'peak RSS MB':>11}")
    for kind, sizes in (("roofline", a.roofline), ("surrogate", a.surrogate)):
        for points in sizes:
            base = None
            for d in a.devices:
                r = run_case(kind, points, d, a.write)
                rate = r["points"] / r["second_s"]
                base = base or rate
                summary = "".join(f"  summary from {k}: {v:.2f} s"
                                  for k, v in r["summary_s"].items())
                print(f"{kind:9} {r['points']:>11,} {d:>3} {r['first_s']:>13.2f} "
                      f"{r['second_s']:>7.2f} {rate:>11,.0f} {rate / base:>8.2f} "
                      f"{r['rss_mb']:>11,.0f}{summary}", flush=True)


if __name__ == "__main__":
    main()
