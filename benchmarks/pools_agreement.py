"""The surrogate's disaggregated pools against the simulator, through ``sweep-grid``.

Runs the installed ``sweep-grid`` twice per workload, with
``latency=surrogate`` and with ``latency=simulate`` (float32, as users run
them), over the same grid of disaggregated deployments: H100 SXM x
Qwen3-8B, TP 1, ``PREFILL`` prefill instances and ``DECODE`` decode
instances, concurrency x token budget ``CONCURRENCY`` x ``BUDGETS``, at
each workload's rates. The simulator runs every row of a trace (exact
replay) or ``REQUESTS`` requests, whichever is fewer. Prints, per workload
and rate, ``surrogate / simulator - 1`` of p99 ITL and p99 TTFT over the
grid's points: the median of ``|error|`` and the worst under and over, and
the same for the goodput share (``goodput_req_per_s`` over the offered
rate) at the ITL SLO of ``ITL_SLO_S``, as a difference.

Usage: ``SWEEP_DATA_DIR=... python benchmarks/pools_agreement.py
[--workloads code,chat,conversation] [--out DIR [--reuse]]``
"""

from __future__ import annotations

import argparse
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import xarray as xr

PREFILL, DECODE = [1, 2, 4], [2, 4]
CONCURRENCY, BUDGETS = [64, 256], [2048, 8192]
REQUESTS = 8819
ITL_SLO_S = 0.007
WORKLOADS = {
    # name: (overrides, rates)
    "code": (["workload=azure_code_2023", "workload.replay=exact"], [2.0, 4.0]),
    "chat": (["workload=seed_chat"], [2.0, 4.0]),
    "conversation": (["workload=azure_conv_2023", "workload.replay=exact"],
                     [3.0, 5.53]),
}


def sweep_grid(args: list[str], out: Path, reuse: bool = False) -> float:
    """Runs ``sweep-grid args`` into ``out`` (H100 SXM x Qwen3-8B, TP 1,
    continuous batching), replacing a cube there, or with ``reuse`` keeps
    one; its wall seconds (NaN: kept)."""
    if reuse and out.exists():
        return float("nan")
    if out.exists():
        shutil.rmtree(out)
    args = ["hardware=h100_sxm", "model=qwen3_8b", "grid.tensor_parallel=[1]",
            "grid.batching=[continuous]", "grid.traffic_tokens_per_day=[1e8]",
            *args, f"out={out}"]
    t0 = time.perf_counter()
    subprocess.run(["sweep-grid", *[str(a).replace(" ", "") for a in args]],
                   check=True, capture_output=True, text=True)
    return time.perf_counter() - t0


def grid(workload: list[str], rates: list[float], latency: str, out: Path,
         reuse: bool = False) -> float:
    """The pools' grid of ``workload`` at ``rates`` into ``out``
    (``sweep_grid``); wall seconds."""
    return sweep_grid([
        *workload, "grid.disaggregated=[true]", f"grid.prefill_instances={PREFILL}",
        f"grid.decode_instances={DECODE}", f"grid.concurrency={CONCURRENCY}",
        f"grid.token_budget={BUDGETS}", f"grid.arrival_rate_per_s={rates}",
        f"slo.itl_p99_s={ITL_SLO_S}", f"latency={latency}",
        f"latency.num_requests={REQUESTS}"], out, reuse)


def summary(errors: np.ndarray, percent: bool = True) -> str:
    """``median |e| [worst under, worst over]``."""
    scale, unit = (100.0, " %") if percent else (1.0, "")
    fmt = "{:.1f}" if percent else "{:.3f}"
    return (f"{fmt.format(np.median(np.abs(errors)) * scale)}{unit} "
            f"[{fmt.format(min(errors.min(), 0) * scale)}, "
            f"{fmt.format(max(errors.max(), 0) * scale)}]")


def command_line(doc: str, workloads, baseline: bool = False):
    """An agreement script's arguments (``--workloads``, ``--out``,
    ``--reuse``, and ``--baseline`` where asked) and its cubes' folder; prints
    the machine and the date."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--workloads", default=",".join(workloads))
    parser.add_argument("--out", type=Path, default=None,
                        help="keep the cubes here (default: a temporary folder)")
    parser.add_argument("--reuse", action="store_true",
                        help="read the cubes already in --out instead of running")
    if baseline:
        parser.add_argument("--baseline", type=Path, default=None,
                            help="a previous run's --out: its surrogate cubes too")
    args = parser.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="agreement_"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"# {platform.node()} {platform.processor() or platform.machine()}, "
          f"{time.strftime('%Y-%m-%d')}", end="; ")
    return args, root


def main() -> None:
    args, root = command_line(__doc__, WORKLOADS)
    print(f"P {PREFILL}, D {DECODE}, concurrency {CONCURRENCY}, budgets {BUDGETS}")
    print("| workload | rate | p99 ITL | p99 TTFT | goodput share at "
          f"{ITL_SLO_S * 1e3:g} ms | wall s (surrogate / simulator) |")
    print("| --- | ---: | --- | --- | --- | --- |")
    for name in args.workloads.split(","):
        overrides, rates = WORKLOADS[name]
        cubes, walls = {}, {}
        for latency in ("surrogate", "simulate"):
            out = root / f"{name}_{latency}.zarr"
            walls[latency] = grid(overrides, rates, latency, out, args.reuse)
            cubes[latency] = xr.open_zarr(out).load()
        sur, sim = cubes["surrogate"], cubes["simulate"]
        for rate in rates:
            pick = dict(arrival_rate_per_s=rate)
            row = []
            for var in ("itl_p99_s", "ttft_p99_s"):
                a = sur[var].sel(pick).values.ravel()
                b = sim[var].sel(pick).values.ravel()
                row.append(summary(a / b - 1.0))
            share = [c["goodput_req_per_s"].sel(pick).values.ravel() / rate
                     for c in (sur, sim)]
            row.append(summary(share[0] - share[1], percent=False))
            print(f"| {name} | {rate:g} | {' | '.join(row)} | "
                  f"{walls['surrogate']:.0f} / {walls['simulate']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
