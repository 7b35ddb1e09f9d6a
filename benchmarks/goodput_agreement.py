"""The surrogate's goodput against the simulator's, through ``sweep-grid``.

A request is good when its TTFT is within the TTFT SLO and none of its gaps
exceeds the ITL SLO (the simulator's rule). This runs the installed
``sweep-grid`` with ``latency=surrogate`` and ``latency=simulate`` (float32,
as users run them) at each ITL SLO of ``ITL_SLOS_S`` (the TTFT SLO loose,
``TTFT_SLO_S``, so that the ITL decides), over H100 SXM x Qwen3-8B, TP 1,
concurrency x token budget ``CONCURRENCY`` x ``BUDGETS``, at each workload's
rates; the simulator runs ``REQUESTS`` requests (a trace's first rows,
replayed exactly). Prints, per workload and SLO, the goodput share
(``goodput_req_per_s`` over the offered rate) of the surrogate less the
simulator's over the grid's points: the median of ``|difference|`` and the
worst under and over, and the simulator's own range of shares.

``--baseline DIR`` also reports the surrogate cubes a previous run kept
there (``--out``) against the same simulator cubes.

Usage: ``SWEEP_DATA_DIR=... python benchmarks/goodput_agreement.py
[--workloads chat,rag,conversation,code] [--out DIR [--reuse]] [--baseline DIR]``
"""

from __future__ import annotations

from pathlib import Path

import xarray as xr
from pools_agreement import command_line, summary, sweep_grid

ITL_SLOS_S = [0.007, 0.008, 0.012, 0.03]
TTFT_SLO_S = 30.0
CONCURRENCY, BUDGETS = [16, 64, 256], [2048]
REQUESTS = 4000
WORKLOADS = {
    # name: (overrides, rates)
    "chat": (["workload=seed_chat"], [1.0, 2.0, 4.0]),
    "rag": (["workload=rag_long_prompt"], [0.5, 1.0, 2.0]),
    "conversation": (["workload=azure_conv_2023", "workload.replay=exact"],
                     [3.0, 5.53]),
    "code": (["workload=azure_code_2023", "workload.replay=exact"], [1.0, 2.0, 3.0]),
}


def cube(root: Path, name: str, latency: str, slo: float, reuse: bool) -> xr.Dataset:
    """The ``latency`` cube of workload ``name`` at ITL SLO ``slo`` (run
    unless ``reuse`` finds it under ``root``)."""
    overrides, rates = WORKLOADS[name]
    out = root / f"{name}_{latency}_{slo:g}.zarr"
    sweep_grid([*overrides, f"grid.concurrency={CONCURRENCY}",
                f"grid.token_budget={BUDGETS}", f"grid.arrival_rate_per_s={rates}",
                f"slo.itl_p99_s={slo}", f"slo.ttft_p99_s={TTFT_SLO_S}",
                f"latency={latency}", f"latency.num_requests={REQUESTS}"], out, reuse)
    return xr.open_zarr(out).load()


def share(ds: xr.Dataset):
    """Goodput over the offered rate, one value per point."""
    return (ds.goodput_req_per_s / ds.arrival_rate_per_s).values.ravel()


def main() -> None:
    args, root = command_line(__doc__, WORKLOADS, baseline=True)
    print(f"concurrency {CONCURRENCY}, budgets {BUDGETS}, {REQUESTS:,} requests, "
          f"TTFT SLO {TTFT_SLO_S:g} s")
    head = "| workload | ITL SLO ms | simulator's shares | surrogate - simulator |"
    print(head + (" baseline - simulator |" if args.baseline else ""))
    print("| --- | ---: | --- | --- |" + (" --- |" if args.baseline else ""))
    for name in args.workloads.split(","):
        for slo in ITL_SLOS_S:
            sim = share(cube(root, name, "simulate", slo, args.reuse))
            sur = share(cube(root, name, "surrogate", slo, args.reuse))
            row = [f"{sim.min():.3f}-{sim.max():.3f}",
                   summary(sur - sim, percent=False)]
            if args.baseline:
                base = share(cube(args.baseline, name, "surrogate", slo, True))
                row.append(summary(base - sim, percent=False))
            print(f"| {name} | {slo * 1e3:g} | {' | '.join(row)} |", flush=True)


if __name__ == "__main__":
    main()
