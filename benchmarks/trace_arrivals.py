"""The surrogate against the simulator on a trace's recorded arrivals.

Runs the installed ``sweep-grid`` twice per trace workload, ``latency=simulate``
and ``latency=surrogate``, on one grid (H100 SXM, Qwen3-8B, TP 1, concurrency
16/64/256, token budget 512/2,048/8,192, continuous batching) at a few arrival
rates, arrivals at the trace's recorded times rescaled to each rate
(``workload.arrival=trace``, the shipped traces' default), and prints, per
rate, the simulator's p99 range and the surrogate's error (surrogate /
simulator - 1): median |error|, worst under- and over-prediction.

    python benchmarks/trace_arrivals.py [--requests 8000] [--out DIR]
        [--replay sampled|exact]
        [--workload azure_code_2023=1,2,3,4 --workload azure_conv_2023=3,5.53,8,11]

``--replay exact`` replays the trace's rows in recorded order with their
recorded lengths (``workload.replay=exact``), in both backends; sampled
replay (the default) draws the lengths, and at a knee of the wait the p99
is then a draw's. Both backends read the trace's first ``--requests``
rows (``latency.num_requests``; the grid's surrogate summarises the stretch
its simulator replays): ``--requests 8819`` for all of the code trace,
``19366`` for the conversation trace (one ``--workload`` each).

Figures: ``benchmarks/README.md``, "Recorded arrivals".
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import xarray as xr

GRID = ["hardware=h100_sxm", "model=qwen3_8b", "grid.tensor_parallel=[1]",
        "grid.context_tokens=[1500]", "grid.traffic_tokens_per_day=[1e8]",
        "grid.concurrency=[16,64,256]", "grid.token_budget=[512,2048,8192]",
        "grid.batching=[continuous]"]
DEFAULT = ["azure_code_2023=1,2,3,4", "azure_conv_2023=3,5.53,8,11"]


def cube(out: Path, workload: str, rates: str, method: str,
         requests: int, replay: str = "sampled") -> xr.Dataset:
    path = out / f"{workload}-{replay}-{method}.zarr"
    # both backends read the same stretch of the trace: its first rows
    # (the surrogate summarises what the simulator replays)
    subprocess.run(["sweep-grid", *GRID, f"workload={workload}",
                    f"workload.replay={replay}",
                    f"grid.arrival_rate_per_s=[{rates}]", f"latency={method}",
                    f"latency.num_requests={requests}", f"out={path}"],
                   check=True, capture_output=True, text=True)
    return xr.open_zarr(path).load().squeeze()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", action="append",
                    help="NAME=RATE,RATE,... (default: the two Azure traces)")
    ap.add_argument("--requests", type=int, default=8000,
                    help="simulated requests (the trace's first rows)")
    ap.add_argument("--replay", choices=("sampled", "exact"), default="sampled",
                    help="the lengths drawn, or the recorded rows in order")
    ap.add_argument("--out", type=Path,
                    help="folder for the cubes (default: temporary)")
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="trace_arrivals_"))
    print("workload | rate req/s | metric | simulator p99 | median |error| | "
          "worst under | worst over")
    for spec in args.workload or DEFAULT:
        workload, rates = spec.split("=")
        sim, sur = (cube(out, workload, rates, m, args.requests, args.replay)
                    for m in ("simulate", "surrogate"))
        for rate in sim.arrival_rate_per_s.values:
            for name in ("ttft_p99_s", "itl_p99_s"):
                s = sim[name].sel(arrival_rate_per_s=rate).values.ravel()
                e = sur[name].sel(arrival_rate_per_s=rate).values.ravel() / s - 1.0
                print(f"{workload} | {rate:g} | {name} | "
                      f"{s.min():.3g}-{s.max():.3g} s | {np.median(np.abs(e)):.1%} | "
                      f"{e.min():+.0%} | {e.max():+.0%}")


if __name__ == "__main__":
    main()
