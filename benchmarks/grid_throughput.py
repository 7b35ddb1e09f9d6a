"""Grid points per second of the full model: JAX against NumPy and plain Python.

Each grid is composed from the shipped Hydra configs (every hardware x every
model, four tensor-parallel sizes, three batching modes, two traffic levels,
and concurrency / token budget / context ranges sized to about 1M and 10M
points), prepared with ``sweep.grid.prepare`` and evaluated three ways in one
process:

* JAX: ``sweep.evaluate.iterate_blocks`` (the sweep's own path: one compiled
  ``evaluate_block`` per block of ``grid.chunk_points`` points, results pulled
  to host NumPy arrays of the block's shape); compilation is timed apart;
* NumPy: ``benchmarks/numpy_model.py``, the same formulas vectorized over the
  same flat points, float32, cut into the same blocks;
* plain Python: the same rules one point at a time with the ``math`` module,
  measured on a subset of points spread over the grid and reported as a rate.

It also counts the bytes of the output cube and compares the rate at which the
JAX path produces them with this machine's memory bandwidth (a NumPy copy and
fill timed in the same process), and optionally times the full zarr write
(``sweep.grid.run``) on its own line.

Usage::

    python benchmarks/grid_throughput.py [--sizes 1M 10M] [--python-points 20000]
        [--repeats 3] [--zarr] [--chunk-points N]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from hydra import initialize_config_module

sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy_model  # noqa: E402

from sweep import grid  # noqa: E402
from sweep.config.resolve import grid_options  # noqa: E402
from sweep.config.store import register_configs  # noqa: E402
from sweep.evaluate import evaluate_block, iterate_blocks  # noqa: E402

SIZES = {
    # 6 hardware x 7 models x 4 TP x 3 batching x 2 traffic = 1,008 per (c, b, ctx)
    "1M": ["grid.concurrency=${range:8,1024,20,log}",
           "grid.token_budget=${range:256,16384,10,log}",
           "grid.context_tokens=${range:500,32000,5,log}"],  # 1,008,000 points
    "10M": ["grid.concurrency=${range:8,1024,50,log}",
            "grid.token_budget=${range:256,16384,20,log}",
            "grid.context_tokens=${range:500,32000,10,log}"],  # 10,080,000 points
}


def machine() -> str:
    """CPU model, cores and memory of this machine, in one line."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        mem_kb = next(int(ln.split()[1]) for ln in
                      Path("/proc/meminfo").read_text().splitlines()
                      if ln.startswith("MemTotal"))
        mem = f"{mem_kb / 2**20:.0f} GiB"
    except (OSError, StopIteration):
        mem = "unknown memory"
    return (f"{cpu}, {os.cpu_count()} cores, {mem}; python {platform.python_version()}, "
            f"jax {jax.__version__} ({jax.default_backend()}), numpy {np.__version__}")


def memory_bandwidth(nbytes: int = 1 << 28, repeats: int = 5) -> tuple[float, float]:
    """Best ``(copy, fill)`` bytes/s of NumPy on ``nbytes`` arrays.

    A copy moves ``2 * nbytes`` (read + write); a fill writes ``nbytes``.
    """
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    copy_s = fill_s = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        copy_s = min(copy_s, time.perf_counter() - t)
        t = time.perf_counter()
        dst.fill(2.0)
        fill_s = min(fill_s, time.perf_counter() - t)
    return 2 * nbytes / copy_s, nbytes / fill_s


def build_job(overrides: list[str]) -> grid.GridJob:
    """The job ``sweep-grid`` would run for these overrides."""
    with initialize_config_module("sweep.conf", version_base="1.3"):
        base, options = grid_options("grid", overrides)
    return grid.prepare(base, options)


def best_of(fn, repeats: int) -> float:
    """Shortest wall time of ``repeats`` calls of ``fn``, seconds."""
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def run_jax(job: grid.GridJob) -> int:
    """Evaluates every block to host arrays; returns the bytes produced."""
    produced = 0
    for _, _, values in iterate_blocks(job.inputs, job.plan):
        produced += sum(v.nbytes for v in values.values())
    return produced


def run_numpy(job: grid.GridJob, inputs) -> None:
    plan = job.plan
    for b in range(len(plan)):
        start, region = plan.block(b)
        out = numpy_model.evaluate_block_numpy(inputs, start, shape=plan.shape,
                                               size=plan.size)
        region_shape = tuple(r.stop - r.start for r in region)
        n = math.prod(region_shape)
        for v in out.values():
            v[:n].reshape(region_shape)


def compile_s(job: grid.GridJob) -> float:
    """Time to trace and compile ``evaluate_block`` for this job's block shape."""
    t = time.perf_counter()
    evaluate_block.lower(job.inputs, jnp.int32(0), shape=job.plan.shape,
                         size=job.plan.size).compile()
    return time.perf_counter() - t


def bench_size(label: str, args, bandwidth: tuple[float, float]) -> dict:
    overrides = SIZES[label] + [f"grid.chunk_points={args.chunk_points}"]
    job = build_job(overrides)
    points, blocks = job.points, len(job.plan)
    print(f"\n== {label}: {points:,} points, {blocks} block(s) of {job.plan.size:,} "
          f"points, shape {job.plan.shape}")
    print("   overrides: " + " ".join(overrides))
    c_s = compile_s(job)
    # the first call through jit compiles once more; keep it out of the timings
    run_jax(job)
    produced = run_jax(job)
    jax_s = best_of(lambda: run_jax(job), args.repeats)
    inputs = numpy_model.to_numpy(job.inputs)
    numpy_s = best_of(lambda: run_numpy(job, inputs), max(1, args.repeats - 1))
    rng = np.random.default_rng(0)
    sample = np.sort(rng.choice(points, size=min(args.python_points, points),
                                replace=False)).tolist()
    t = time.perf_counter()
    numpy_model.evaluate_points_python(inputs, sample, job.plan.shape)
    python_s = (time.perf_counter() - t) / len(sample) * points
    jax_rate, numpy_rate, python_rate = points / jax_s, points / numpy_s, points / python_s
    per_point = produced / points
    copy_bw, fill_bw = bandwidth
    print(f"   compile evaluate_block (once per block shape): {c_s:8.2f} s")
    print(f"   JAX   evaluate + to host : {jax_s:8.2f} s  {jax_rate / 1e6:8.2f} M points/s")
    print(f"   NumPy same formulas      : {numpy_s:8.2f} s  {numpy_rate / 1e6:8.2f} M points/s")
    print(f"   Python loop (on {len(sample):,} points, extrapolated): {python_s:8.1f} s  "
          f"{python_rate / 1e3:8.2f} k points/s")
    print(f"   JAX / NumPy  = {jax_rate / numpy_rate:6.2f}x")
    print(f"   JAX / Python = {jax_rate / python_rate:6.0f}x")
    print(f"   output {produced / 1e9:.3f} GB ({per_point:.0f} B/point); JAX writes it at "
          f"{produced / jax_s / 1e9:.2f} GB/s = {produced / jax_s / fill_bw:.1%} of "
          f"fill bandwidth, {produced / jax_s / copy_bw:.1%} of copy bandwidth")
    row = dict(label=label, points=points, blocks=blocks, compile_s=c_s, jax_s=jax_s,
               numpy_s=numpy_s, python_s=python_s, python_n=len(sample),
               bytes=produced)
    if args.zarr:
        with tempfile.TemporaryDirectory() as tmp:
            t = time.perf_counter()
            grid.run(job, Path(tmp) / "cube.zarr", {}, "benchmark")
            row["zarr_s"] = time.perf_counter() - t
        print(f"   full sweep.grid.run to zarr (evaluate + write + consolidate): "
              f"{row['zarr_s']:8.2f} s  {points / row['zarr_s'] / 1e6:8.2f} M points/s")
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--python-points", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk-points", type=int, default=1 << 21,
                        help="grid.chunk_points (the sweep's default is 2**21)")
    parser.add_argument("--zarr", action="store_true",
                        help="also time sweep.grid.run writing a zarr cube")
    args = parser.parse_args(argv)
    register_configs()
    print(f"grid throughput, {date.today().isoformat()}")
    print(machine())
    bandwidth = memory_bandwidth()
    print(f"memory bandwidth (NumPy, 256 MiB): copy {bandwidth[0] / 1e9:.1f} GB/s "
          "(read + write), fill {:.1f} GB/s (write)".format(bandwidth[1] / 1e9))
    for label in args.sizes:
        bench_size(label, args, bandwidth)


if __name__ == "__main__":
    main()
