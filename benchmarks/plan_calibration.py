"""Measures what ``sweep.grid.plan`` estimates: wall time and peak memory of real runs.

Runs the installed ``sweep-grid`` (and ``sweep-optimize``) as a user does, at
two sizes per kind of work, reads each run's wall time and peak resident
memory (``os.wait4``), and prints them beside the plan line's estimates and
the constants the pairs imply:

* roofline: a 24-point grid and a ~3.1M-point one (two blocks of 2^21);
* simulator: 64 configurations x 2,000 and x 20,000 requests at 64 slots,
  x 2,000 at 512 slots, and 256 configurations x 2,000 at 64 slots;
* surrogate: 64 and 65,536 configurations;
* optimize: ``search=quick`` (its log gives the first round's time).

With ``--xla`` it instead compiles (does not run) the p99 block of four
simulator shapes and the roofline block in-process and prints XLA's own
buffer sizes (``Compiled.memory_analysis()``): exact, and the same on any
machine, which the resident-memory differences of loaded runs are not.

    python benchmarks/plan_calibration.py [--only roofline,simulate,...] [--xla]

The results and the constants chosen from them are in benchmarks/README.md
("Run plans"). Time constants depend on the machine and its load; memory
constants do not.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

BASE = ["hardware=h100_sxm", "model=qwen3_8b", "workload=seed_chat",
        "grid.context_tokens=[1500]", "grid.long_prompt_tokens=[8192]",
        "grid.traffic_tokens_per_day=[1e8]"]
SIM = [*BASE, "grid.tensor_parallel=[1]", "grid.token_budget=[512,1024,2048,4096]",
       "grid.batching=[continuous]", "grid.arrival_rate_per_s=[1,2,3,4]",
       "latency=simulate"]
RUNS = {
    "roofline": [
        ("24 points", ["hardware=h100_sxm", "model=qwen3_8b", "grid=small"]),
        ("3.1M points", ["grid.hardware=[h100_sxm,h200_sxm]",
                         "grid.model=[qwen3_8b,llama3_1_8b]",
                         "grid.concurrency=${range:1,1024,128}",
                         "grid.token_budget=${range:256,16384,16,log}",
                         "grid.context_tokens=${range:500,32000,16,log}",
                         "grid.traffic_tokens_per_day=[1e7,1e9]"]),
    ],
    "simulate": [
        ("64 configs x 2k req, 64 slots",
         [*SIM, "grid.concurrency=[8,16,32,64]", "latency.num_requests=2000"]),
        ("64 configs x 20k req, 64 slots",
         [*SIM, "grid.concurrency=[8,16,32,64]", "latency.num_requests=20000"]),
        ("64 configs x 2k req, 512 slots",
         [*SIM, "grid.concurrency=[8,16,32,512]", "latency.num_requests=2000"]),
        ("256 configs x 2k req, 64 slots",
         [*SIM, "grid.concurrency=${range:4,64,16}", "latency.num_requests=2000"]),
    ],
    "surrogate": [
        ("64 configs", [*SIM[:-1], "grid.concurrency=[8,16,32,64]",
                        "latency=surrogate"]),
        ("65,536 configs", [*BASE, "grid.tensor_parallel=[1,2,4,8]",
                            "grid.concurrency=${range:1,1024,64}",
                            "grid.token_budget=${range:256,16384,16,log}",
                            "grid.batching=[continuous]",
                            "grid.arrival_rate_per_s=${range:0.5,20,16,log}",
                            "latency=surrogate"]),
    ],
    "optimize": [
        ("search=quick, TP 1,2", ["hardware=h100_sxm", "model=qwen3_8b",
                                  "search=quick", "search.tensor_parallel=[1,2]",
                                  "search.verify_requests=200"]),
    ],
}
PLAN = re.compile(r"estimated (?:~(?P<round>[\d.]+ \w+) for one round, up to )?"
                  r"~(?P<time>[\d.]+ \w+) on .*peak memory ~(?P<mem>[\d.]+ \w+)")


def run(command: str, args: list[str], cwd: Path, env: dict) -> dict:
    """One run: wall time (s), peak RSS (bytes), the plan's estimates, stderr."""
    exe = shutil.which(command)
    assert exe, f"{command} is not installed (pip install -e .)"
    start = time.perf_counter()
    with open(cwd / "err.txt", "w") as err, open(cwd / "out.txt", "w") as out:
        proc = subprocess.Popen([exe, *args, "out=result.zarr"], cwd=cwd, env=env,
                                stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    text = (cwd / "err.txt").read_text()
    m = PLAN.search(text)
    shutil.rmtree(cwd / "result.zarr", ignore_errors=True)
    return {"wall_s": wall, "rss": usage.ru_maxrss * 1024.0,
            "status": os.waitstatus_to_exitcode(status),
            "plan_time": m["time"] if m else "?", "plan_round": m and m["round"],
            "plan_mem": m["mem"] if m else "?", "log": text}


XLA_CASES = {
    # name: (overrides on SIM, configurations, requests, slots)
    "sim 64 x 2k x 64": (["grid.concurrency=[8,16,32,64]",
                          "latency.num_requests=2000"], 64, 2000, 64),
    "sim 64 x 20k x 64": (["grid.concurrency=[8,16,32,64]",
                           "latency.num_requests=20000"], 64, 20000, 64),
    "sim 64 x 2k x 512": (["grid.concurrency=[8,16,32,512]",
                           "latency.num_requests=2000"], 64, 2000, 512),
    "sim 256 x 2k x 64": (["grid.concurrency=${range:4,64,16}",
                           "latency.num_requests=2000"], 256, 2000, 64),
    "surrogate 256": (["grid.concurrency=${range:4,64,16}", "latency=surrogate"],
                      256, 0, 0),
}


def xla_buffers() -> None:
    """XLA's buffer sizes of compiled blocks, and the constants they imply."""
    import jax.numpy as jnp
    from hydra import initialize_config_module

    from sweep.config.resolve import grid_options
    from sweep.config.store import register_configs
    from sweep.grid import job as grid
    from sweep.grid.evaluate import evaluate_region

    register_configs()
    sizes = {}
    with initialize_config_module("sweep.conf", version_base="1.3"):
        cases = {**XLA_CASES, "roofline": (RUNS["roofline"][1][1], 0, 0, 0)}
        for name, (extra, *_) in cases.items():
            overrides = extra if name == "roofline" else [*SIM, *extra]
            base, options = grid_options("grid", overrides)
            part = grid.prepare(base, options).parts[-1]
            plan = part.plan
            compiled = evaluate_region.lower(
                part.fn, part.axes, part.tables, jnp.zeros(len(plan.shape), jnp.int32),
                shape=plan.shape, chunks=plan.chunks, table_dims=part.table_dims,
                flat=part.flat).compile()
            m = compiled.memory_analysis()
            sizes[name] = total = (m.temp_size_in_bytes + m.argument_size_in_bytes
                                   + m.output_size_in_bytes)
            print(f"{name:18} block of {plan.size:>9,}: temp "
                  f"{m.temp_size_in_bytes:>12,} B, arguments "
                  f"{m.argument_size_in_bytes:>10,} B, outputs "
                  f"{m.output_size_in_bytes:>11,} B ({total / plan.size:,.1f} B per "
                  "point)", flush=True)
    a, b = sizes["sim 64 x 2k x 64"], sizes["sim 64 x 20k x 64"]
    per_req = (b - a) / (64 * 18_000)
    per_slot = (sizes["sim 64 x 2k x 512"] - a) / (64 * 448)
    per_config = (sizes["sim 256 x 2k x 64"] - a) / 192 - 2000 * per_req - 64 * (
        per_slot)
    print(f"  -> simulator: {per_req:.1f} B per config-request, {per_slot:.0f} B per "
          f"config-slot, {per_config:,.0f} B per config; surrogate: "
          f"{sizes['surrogate 256'] / 256:,.0f} B per config")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=",".join(RUNS))
    p.add_argument("--xla", action="store_true")
    args = p.parse_args()
    if args.xla:
        xla_buffers()
        return
    env = dict(os.environ)
    # a fresh compilation cache: every run compiles, as a user's first run does
    env["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="plan-cal-cache-")
    print(f"load average at start: {os.getloadavg()}")
    for kind in args.only.split(","):
        results = []
        for label, overrides in RUNS[kind]:
            command = "sweep-optimize" if kind == "optimize" else "sweep-grid"
            with tempfile.TemporaryDirectory() as d:
                r = run(command, overrides, Path(d), env)
            results.append(r)
            print(f"{kind:9} {label:32} exit {r['status']}  wall {r['wall_s']:7.1f} s"
                  f" (plan ~{r['plan_time']}"
                  + (f", one round ~{r['plan_round']}" if r["plan_round"] else "")
                  + f")  peak RSS {r['rss'] / 1e9:6.3f} GB (plan ~{r['plan_mem']})")
            if r["status"] != 0:
                print(r["log"][-2000:])
            if kind == "optimize":
                print("\n".join(ln for ln in r["log"].splitlines()
                                if ln.startswith("round")))
        if kind == "roofline" and len(results) == 2:
            a, b = results
            rate = (3_145_728 - 24) / (b["wall_s"] - a["wall_s"])
            per_point = (b["rss"] - a["rss"]) / (1 << 21)
            print(f"  -> {rate:,.0f} points/s beyond the fixed cost; {per_point:,.0f} "
                  f"bytes per block point above a {a['rss'] / 1e9:.3f} GB base")
        if kind == "simulate" and len(results) == 4:
            a, b, c, d = results
            # one block's time per 1,000 requests: A + configs x (B + slots x C)
            per_kreq_64 = (b["wall_s"] - a["wall_s"]) / 18.0
            per_config = ((d["wall_s"] - a["wall_s"]) / 2.0) / 192
            fixed_kreq = per_kreq_64 - 64 * per_config
            per_slot = (c["wall_s"] - a["wall_s"]) / (2.0 * 64 * 448)
            per_req = (b["rss"] - a["rss"]) / (64 * 18_000)
            slot_bytes = (c["rss"] - a["rss"]) / (64 * 448)
            config_bytes = (d["rss"] - a["rss"]) / 192 - 2000 * per_req - 64 * (
                slot_bytes)
            print(f"  -> a block of C configs at S slots takes per 1,000 requests "
                  f"{fixed_kreq:.3f} s + C x ({per_config * 1e3:.3f} ms at 64 slots, "
                  f"{per_slot * 1e6:.1f} us more per slot); memory: "
                  f"{per_req:.1f} B per config-request, {slot_bytes:,.0f} B per "
                  f"config-slot, {config_bytes:,.0f} B per config; fixed: "
                  f"{a['rss'] / 1e9:.3f} GB peak at 64 configs x 2k requests")
        if kind == "surrogate" and len(results) == 2:
            a, b = results
            print(f"  -> {(65_536 - 64) / (b['wall_s'] - a['wall_s']):,.0f} "
                  f"configs/s beyond the fixed cost")
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
