"""A run's plan: its size, and estimates of its time, peak memory and disk.

The entry points print the plan before compiling anything, and refuse a run
whose estimated peak memory exceeds the budget (``max_memory_gb``; by default
80 % of the machine's physical memory, or of the container's limit when
lower) with the number and the setting that permits it.

The estimates are linear models of the work: points for the roofline;
configurations, requests and slots per block for the simulator;
configurations for the surrogate; evaluations for the search. Memory is what
a run holds at once (the compiled programs, one block, the request streams):
XLA's own buffer sizes of compiled blocks and the peak resident memory of
real runs (``benchmarks/plan_calibration.py``), the same on any machine.
Time is not: on the 2-core CPU machine the same runs were about 12x slower
at load average 5-9 than quiet, so the line gives the quiet estimate and
``LOADED_SLOWDOWN`` times it, and the progress lines then give the rate
measured on the run's own blocks. An accelerator is faster than both.
Constants and their sources: benchmarks/README.md, "Run plans".
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sweep import shapes
from sweep.config.schema import LatencyMethod
from sweep.cube import contract
from sweep.errors import ConfigError
from sweep.grid.evaluate import Blocking, blocking, flat_points, write_blocking

# -- measured constants (benchmarks/README.md, "Run plans") --------------------
# Time, on the 2-core CPU machine when quiet: the rates of the quiet reruns of
# 2026-11-30 in benchmarks/README.md where those exist; the rest measured by
# benchmarks/plan_calibration.py under load and divided by LOADED_SLOWDOWN.
LOADED_SLOWDOWN = 12.0
"""How much slower the same runs were at load average 5-9 (measured: 15x for
the roofline's rate, 12x for a simulator block, against the quiet reruns)."""
ROOFLINE_FIXED_S = 2.6
"""Process start, config composition, compilation, cube set-up (31 s loaded)."""
ROOFLINE_POINTS_PER_S = 1.9e6
"""Roofline points evaluated and written per second (``grid.run``, 10M points)."""
SIM_FIXED_S = 3.3
"""Compilation of the simulator's block."""
SIM_S_PER_KREQ_BLOCK = 0.165
SIM_S_PER_KREQ_CONFIG = 0.71e-3
SIM_S_PER_KREQ_CONFIG_SLOT = 16.7e-6
"""A simulator block of C configurations with S slots takes, per 1,000
requests, ``0.165 s + C x (0.71 ms + S x 16.7 us)`` (fitted to the quiet
runs: 256 and 1,024 configurations at 64 slots, 1,024 at 256)."""
SURROGATE_FIXED_S = 2.3
"""Compilation of the surrogate's block (27 s loaded)."""
SURROGATE_CONFIGS_PER_S = 2.0e4
"""Surrogate configurations per second (1,682 loaded)."""
SEARCH_FIXED_S = 6.2
"""Compilation and first evaluation of the search (74 s loaded)."""
SEARCH_EVALUATIONS_PER_S = 5.0e4

# Memory, the same on any machine: XLA's own buffer sizes of the compiled
# blocks (``memory_analysis()``) and the peak resident memory of real runs.
BASE_BYTES = 0.45e9
"""Peak resident memory of ``sweep-grid`` on a 24-point grid."""
ROOFLINE_BYTES_PER_POINT = 190.0
"""Per point of a roofline block: 53 bytes of XLA output, and host copies; 100
more since one block is written while the next evaluates (peak 843 -> 1,025
MB with blocks of 1.79M points, ``benchmarks/scale.py --write``)."""
SIM_FIXED_BYTES = 0.35e9
"""The simulator's compilation and runtime, beyond the base."""
SIM_BYTES_PER_CONFIG_REQUEST = 21.0
SIM_BYTES_PER_CONFIG_SLOT = 200.0
SIM_BYTES_PER_CONFIG = 0.2e6
"""XLA's buffers for a simulator block: per configuration and request (its
per-request results), per configuration and slot, per configuration (the
ITL histogram)."""
SURROGATE_FIXED_BYTES = 0.45e9
SURROGATE_BYTES_PER_CONFIG = 16e3
SEARCH_FIXED_BYTES = 0.85e9
"""The search's compilation (peak 1.31 GB for ``search=quick``)."""
STREAM_BYTES_PER_REQUEST = 12
"""A request stream: arrival, prompt and output, float32 each."""
SUMMARY_BYTES_PER_POINT = 100.0
"""The summary table's reading of a cube (up to ``LOAD_POINTS``)."""
OPTIMIZE_DISK_BYTES_PER_EVALUATION = 8
"""optimize.zarr keeps the configurations of the last search."""

BUDGET_SHARE = 0.8
LOAD_POINTS = 1 << 21
"""The summary reads cubes up to this many points whole, larger ones chunk by
chunk."""


@dataclass(frozen=True)
class Plan:
    """What a run will do and the estimates of what it costs."""

    what: str  # e.g. "1,234 points in 2 block(s); 96 configurations ..."
    time_s: float  # on a quiet 2-core CPU (LOADED_SLOWDOWN x under load)
    memory_bytes: float
    disk_bytes: float
    budget_bytes: float
    budget_source: str
    driver: str  # the settings that set the peak memory, for the refusal
    round_s: float | None = None  # sweep-optimize: one round; time_s: all rounds

    def line(self, backend: str = "cpu") -> str:
        """The plan line printed before a run."""
        def span(t: float) -> str:
            return f"{duration(t)}-{duration(t * LOADED_SLOWDOWN)}"

        took = span(self.time_s)
        if self.round_s is not None:
            took = f"{span(self.round_s)} for the first round, up to {took}"
        on = "on a 2-core CPU (quiet to loaded)" + (
            "" if backend == "cpu" else f" (this run uses the {backend})")
        return (f"{self.what}; estimated {took} {on}, peak memory "
                f"~{gb(self.memory_bytes)} (budget {gb(self.budget_bytes)}), disk "
                f"<= {gb(self.disk_bytes)}")

    def check_memory(self) -> None:
        """Refuses a plan whose peak memory exceeds the budget."""
        if self.memory_bytes <= self.budget_bytes:
            return
        need = math.ceil(self.memory_bytes / 1e9 * 1.1)
        raise ConfigError(
            f"{self.driver}: the run needs an estimated {gb(self.memory_bytes)} of "
            f"memory, above the budget of {gb(self.budget_bytes)} "
            f"({self.budget_source}); allowed: a smaller setting, or "
            f"max_memory_gb={need} to run anyway")


def gb(n: float) -> str:
    """Bytes as a short decimal figure."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def duration(s: float) -> str:
    """Seconds as ``45 s``, ``12 min`` or ``3.4 h``."""
    if s < 90:
        return f"{max(s, 1):.0f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def machine_memory_bytes() -> float:
    """Physical memory, or the container's (cgroup) limit when lower."""
    total = float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    for path in ("/sys/fs/cgroup/memory.max",
                 "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, float(text))
    return total


def budget(max_memory_gb: float) -> tuple[float, str]:
    """The memory budget in bytes and where it comes from."""
    if max_memory_gb > 0:
        return max_memory_gb * 1e9, f"max_memory_gb={max_memory_gb:g}"
    total = machine_memory_bytes()
    return BUDGET_SHARE * total, (f"{BUDGET_SHARE:.0%} of this machine's "
                                  f"{gb(total)}; set max_memory_gb to change it")


def _disk_bytes(part: str, options: frozenset[str] = frozenset()) -> int:
    """Bytes per point of a cube part's variables before compression."""
    return sum(np.dtype(m.dtype).itemsize for m in contract.metrics(part, options))


def _padded(plan: Blocking) -> int:
    """Configurations evaluated, a block sticking out of the cube counted whole."""
    return len(plan) * plan.size


def simulation(configs: int, requests: int, slots: int, streams: int
               ) -> tuple[float, float]:
    """Time (s, quiet) and memory (bytes, beyond the base) of one simulator block
    of ``configs`` configurations over ``requests`` requests with ``slots``
    slots, with ``streams`` request streams in memory."""
    time_s = requests / 1e3 * (SIM_S_PER_KREQ_BLOCK + configs * (
        SIM_S_PER_KREQ_CONFIG + slots * SIM_S_PER_KREQ_CONFIG_SLOT))
    memory = SIM_FIXED_BYTES + configs * (
        requests * SIM_BYTES_PER_CONFIG_REQUEST + slots * SIM_BYTES_PER_CONFIG_SLOT
        + SIM_BYTES_PER_CONFIG)
    return time_s, memory + streams * requests * STREAM_BYTES_PER_REQUEST


def grid_plan(app, options: dict[str, list]) -> Plan:
    """The plan of a ``sweep-grid`` job from its validated config (no JAX work).

    Args:
      app: the ``GridApp``.
      options: the hardware, model and workload objects of the grid.
    """
    g = app.grid
    sizes = {k: len(v) for k, v in g.axes.items()} | {
        k: len(options[k]) for k in ("hardware", "model", "workload")} | {
        "batching": len(g.batching)} | {
        d: len(g.precision(d, options["model"])) for d in ("weight_dtype", "kv_dtype")}
    shape = tuple(sizes[d] for d in contract.dims(contract.ROOFLINE))
    roof = blocking(shape, g.chunk_points)
    points = math.prod(shape)
    # optional variables (the elasticities) scale the evaluation, its output
    # buffers and the write with the bytes per point (benchmarks/README.md,
    # "Cost elasticities")
    bytes_per_point = _disk_bytes(contract.ROOFLINE, g.optional_variables)
    more = bytes_per_point / _disk_bytes(contract.ROOFLINE)
    time_s = ROOFLINE_FIXED_S + _padded(roof) / ROOFLINE_POINTS_PER_S * more
    block_bytes = roof.size * ROOFLINE_BYTES_PER_POINT * more
    memory, driver = block_bytes, f"grid.chunk_points = {g.chunk_points}"
    disk = points * bytes_per_point
    what = f"{points:,} points in {len(roof):,} block(s)"
    method = app.latency.method
    if method != LatencyMethod.none:
        rates = sizes.get("arrival_rate_per_s") or len(
            {w.arrival_rate_per_s for w in options["workload"]})
        sizes["arrival_rate_per_s"] = rates
        p99_shape = tuple(sizes[d] for d in contract.dims(contract.P99))
        p99 = blocking(p99_shape, app.latency.chunk_configs)
        configs = math.prod(p99_shape)
        # the p99 elasticities come from the surrogate only (sweep.latency.p99)
        p99_vars = _disk_bytes(contract.P99, g.optional_variables
                               if method == LatencyMethod.surrogate else frozenset())
        disk += configs * p99_vars
        if method == LatencyMethod.simulate:
            n = app.latency.num_requests
            slots = int(max(g.axes["concurrency"]))
            # a block's configurations padded as they are simulated
            block_s, p99_bytes = simulation(flat_points(p99.size, None), n, slots,
                                            sizes["workload"] * rates)
            time_s += SIM_FIXED_S + len(p99) * block_s
            what += (f"; {configs:,} configurations x {n:,} requests simulated in "
                     f"{len(p99):,} block(s)")
            p99_driver = (f"latency.num_requests = {n} with latency.chunk_configs = "
                          f"{app.latency.chunk_configs} and {slots} slots (the "
                          "largest grid.concurrency)")
        else:
            # the p99 elasticities evaluate each configuration at 2 x 8 scaled
            # constants too (sweep.model.sensitivity.differences)
            runs = 2 * len(contract.SENSITIVITY) + 1 if g.sensitivity else 1
            time_s += SURROGATE_FIXED_S + _padded(p99) * runs / SURROGATE_CONFIGS_PER_S
            # one compiled block's work, the write block it fills on the host
            # and the one written meanwhile
            p99_bytes = (SURROGATE_FIXED_BYTES
                         + p99.size * runs * SURROGATE_BYTES_PER_CONFIG
                         + 2 * write_blocking(p99_shape, p99.size).size * p99_vars)
            what += f"; {configs:,} configurations through the surrogate"
            p99_driver = f"latency.chunk_configs = {app.latency.chunk_configs}"
        if p99_bytes > memory:
            memory, driver = p99_bytes, p99_driver
    summary = min(points, LOAD_POINTS) * SUMMARY_BYTES_PER_POINT
    if summary > memory:
        memory, driver = summary, f"the summary of {points:,} points"
    limit, source = budget(app.max_memory_gb)
    return Plan(what, time_s, BASE_BYTES + memory, disk, limit, source, driver)


def optimize_plan(app, candidates: int, settings, trace_rows: int = 0) -> Plan:
    """The plan of a ``sweep-optimize`` job (no JAX work).

    Args:
      app: the ``OptimizeApp``.
      candidates: hardware x model x TP candidates that fit.
      settings: the job's ``search.Settings`` (for its scan length).
      trace_rows: arrivals of the trace the verification replays whole
        (``optimize.trace_rows``; 0 without one).
    """
    from sweep.search.descent import PAD

    s = app.search
    padded = candidates + (-candidates % PAD)
    evaluations = padded * s.restarts * (s.steps + settings.integer_steps)
    slots = shapes.slots(s.concurrency_max)
    # a verified configuration of R replicas simulates R rows, each of its
    # share of its requests (Search.verified_requests), from one stream of
    # verify_requests_max: the largest call of verify_top such configurations
    replicas = min(s.replicas_max, -(-s.verify_requests_max // s.verify_requests))
    calls = [simulation(shapes.power_of_two(s.verify_top * r),
                        -(-s.verified_requests(r, trace_rows) // r), slots, 0)
             for r in range(1, replicas + 1)]
    sim_s, sim_bytes = (max(c[i] for c in calls) for i in (0, 1))
    sim_bytes += s.verify_requests_max * STREAM_BYTES_PER_REQUEST
    round_s = evaluations / SEARCH_EVALUATIONS_PER_S + sim_s
    first = SEARCH_FIXED_S + SIM_FIXED_S + round_s
    memory, driver = SEARCH_FIXED_BYTES, f"search.restarts = {s.restarts}"
    if sim_bytes > memory:
        memory, driver = sim_bytes, (
            f"search.verify_requests = {s.verify_requests} with search.verify_top = "
            f"{s.verify_top}, search.verify_requests_max = {s.verify_requests_max} "
            f"and {slots} slots (search.concurrency_max)"
            + (f", a trace of {trace_rows:,} arrivals replayed whole"
               if trace_rows > s.verify_requests else ""))
    what = (f"{candidates} candidate(s) x {s.restarts} restarts: {evaluations:,} "
            f"surrogate evaluations and up to {s.verify_top} verified "
            f"configurations of <= {s.verify_requests_max:,} requests a round "
            "(and the cheapest confirmed on fewer replicas, halving), at most "
            f"{s.rounds} round(s)")
    limit, source = budget(app.max_memory_gb)
    return Plan(what, first + (s.rounds - 1) * round_s, BASE_BYTES + memory,
                OPTIMIZE_DISK_BYTES_PER_EVALUATION * evaluations, limit, source,
                driver, round_s=first)
