"""Grid points per second of the full model: JAX against NumPy and plain Python.

Each grid is composed from the shipped Hydra configs (every hardware x every
model, four tensor-parallel sizes, three batching modes, two traffic levels,
and concurrency / token budget / context ranges sized to about 1M and 10M
points), prepared with ``sweep.grid.job.prepare`` and its roofline part (every
roofline variable of ``sweep.cube.contract.METRICS``) evaluated four ways in one
process:

* JAX: ``sweep.grid.evaluate.iterate_blocks``, the sweep's own path (one compiled
  ``evaluate_region`` per block of ``grid.chunk_points`` points, results pulled
  to host NumPy arrays of the region's shape); compilation is timed apart;
* NumPy, flat: ``benchmarks/numpy_model.py``, the same formulas in float32
  over the same blocks, each block's points as a flat list with every
  parameter gathered per point;
* NumPy, broadcasting: the same NumPy formulas on per-axis arrays that
  broadcast, the NumPy counterpart of the nested ``vmap``;
* plain Python: the same rules one point at a time with the ``math`` module,
  measured on a random subset of the points and reported as a rate.

The methods take turns, best of ``--repeats``, so a slowdown of a shared
machine hits all of them. The script also counts the bytes of the output cube
and compares the rate at which JAX produces them with this machine's memory
bandwidth (a NumPy copy and fill timed in the same process), and optionally
times the full zarr write (``sweep.grid.job.run``) on its own line.

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

from sweep.config.resolve import grid_options  # noqa: E402
from sweep.config.store import register_configs  # noqa: E402
from sweep.grid import job as grid  # noqa: E402
from sweep.grid.evaluate import Part, evaluate_region, iterate_blocks  # noqa: E402

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
    return (f"{cpu}, {os.cpu_count()} cores, {mem}; "
            f"python {platform.python_version()}, "
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


def run_jax(part: Part) -> int:
    """Evaluates every block to host arrays; returns the bytes produced."""
    produced = 0
    for _, _, values in iterate_blocks(part.fn, part.axes, part.plan, part.tables,
                                       part.table_dims):
        produced += sum(v.nbytes for v in values.values())
    return produced


def run_numpy(part: Part, evaluate, axes, utilization) -> None:
    """A NumPy baseline over the same blocks, cut to each region as JAX's are."""
    plan = part.plan
    for b in range(len(plan)):
        region = plan.region(b)
        out = evaluate(axes, utilization, [r.start for r in region],
                       shape=plan.shape, chunks=plan.chunks)
        cut = tuple(slice(0, r.stop - r.start) for r in region)
        for v in out.values():
            v[cut]


def compile_s(part: Part) -> float:
    """Time to trace and compile the part's block evaluation."""
    plan = part.plan
    starts = jnp.zeros(len(plan.shape), jnp.int32)
    t = time.perf_counter()
    evaluate_region.lower(part.fn, part.axes, part.tables, starts, shape=plan.shape,
                          chunks=plan.chunks, table_dims=part.table_dims).compile()
    return time.perf_counter() - t


def interleaved_best(methods: dict, repeats: int) -> dict[str, float]:
    """Best wall time of each method, the methods taking turns.

    Taking turns spreads any slowdown of a shared machine over all methods
    instead of charging it to whichever ran at that moment.
    """
    best = dict.fromkeys(methods, math.inf)
    for _ in range(repeats):
        for name, fn in methods.items():
            t = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t)
    return best


def bench_size(label: str, args, bandwidth: tuple[float, float]) -> None:
    """Times every method on one grid size and prints the comparison."""
    overrides = SIZES[label] + [f"grid.chunk_points={args.chunk_points}"]
    job = build_job(overrides)
    part = job.parts[0]
    plan = part.plan
    points, blocks = job.points, len(plan)
    print(f"\n== {label}: {points:,} points, {blocks} block(s) of shape {plan.chunks} "
          f"in a cube of shape {plan.shape}")
    print("   overrides: " + " ".join(overrides))
    jit_s = compile_s(part)
    axes = numpy_model.to_numpy(part.axes)
    (utilization,) = part.tables
    methods = {
        "jax": lambda: run_jax(part),
        "numpy": lambda: run_numpy(part, numpy_model.evaluate_region_flat, axes,
                                   utilization),
        "numpy_broadcast": lambda: run_numpy(
            part, numpy_model.evaluate_region_broadcast, axes, utilization),
    }
    # the first call through jit compiles once more; keep it out of the timings
    produced = run_jax(part)
    best = interleaved_best(methods, args.repeats)
    rng = np.random.default_rng(0)
    sample = np.sort(rng.choice(points, size=min(args.python_points, points),
                                replace=False)).tolist()
    t = time.perf_counter()
    numpy_model.evaluate_points_python(axes, sample, plan.shape)
    best["python"] = (time.perf_counter() - t) / len(sample) * points
    rate = {k: points / v for k, v in best.items()}
    print(f"   compile evaluate_region: {jit_s:.2f} s (once per block shape, not in "
          "the times below)")
    rows = [
        ("jax", "JAX sweep.grid.evaluate.iterate_blocks -> host"),
        ("numpy", "NumPy, flat points, per-point gathers"),
        ("numpy_broadcast", "NumPy, broadcasting"),
    ]
    for key, text in rows:
        print(f"   {text:45s} {best[key]:8.2f} s {rate[key] / 1e6:8.2f} M points/s")
    text = f"Python loop, {len(sample):,} points, extrapolated"
    print(f"   {text:45s} {best['python']:8.1f} s {rate['python'] / 1e3:8.2f} "
          "k points/s")
    print(f"   ratios: JAX / NumPy flat = {rate['jax'] / rate['numpy']:.2f}x, "
          f"JAX / NumPy broadcasting = {rate['jax'] / rate['numpy_broadcast']:.2f}x, "
          f"JAX / Python = {rate['jax'] / rate['python']:,.0f}x")
    copy_bw, fill_bw = bandwidth
    print(f"   output cube {produced / 1e9:.3f} GB ({produced / points:.0f} B/point), "
          f"produced by JAX at {produced / best['jax'] / 1e9:.2f} GB/s = "
          f"{produced / best['jax'] / fill_bw:.0%} of fill, "
          f"{produced / best['jax'] / copy_bw:.0%} of copy bandwidth")
    if args.zarr:
        with tempfile.TemporaryDirectory() as tmp:
            t = time.perf_counter()
            grid.run(job, Path(tmp) / "cube.zarr", {}, "benchmark")
            zarr_s = time.perf_counter() - t
        print(f"   sweep.grid.job.run to zarr (evaluate + write + consolidate): "
              f"{zarr_s:8.2f} s {points / zarr_s / 1e6:8.2f} M points/s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--python-points", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk-points", type=int, default=1 << 21,
                        help="grid.chunk_points (the sweep's default is 2**21)")
    parser.add_argument("--zarr", action="store_true",
                        help="also time sweep.grid.job.run writing a zarr cube")
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
