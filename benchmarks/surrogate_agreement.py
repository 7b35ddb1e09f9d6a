"""Agreement of the analytic surrogate (sweep/latency.py) with the simulator.

Runs a validation grid of hardware x model x workload x concurrency x token
budget x arrival rate through ``sweep.simulate.simulate`` (jit + vmap, Poisson
arrivals from ``sweep.arrivals.sample_requests``) and through
``sweep.latency.surrogate`` (jit + vmap), and reports the relative error of
the surrogate's p99 TTFT and p99 ITL (and p50s) against the simulator: median
and worst, split by the surrogate's utilisation (< 0.9 and >= 0.9).

Arrival rates are chosen per configuration so that the surrogate's utilisation
takes the values in ``LOAD``: every configuration is probed from light load to
near saturation (the simulator is the judge; the surrogate only places the
probes, and the split by utilisation uses the surrogate's own estimate).

Usage: python benchmarks/surrogate_agreement.py [--requests 1000] [--quick]
       [--csv out.csv]
"""

from __future__ import annotations

import argparse
import itertools
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from sweep.arrivals import sample_requests
from sweep.config.store import register_configs
from sweep.latency import latency_workload, surrogate
from sweep.params import hardware_params, model_params, stack
from sweep.simulate import simulate
from sweep.workload import workload_tables

DEPLOYMENTS = [  # (hardware, model, tensor_parallel)
    ("h100_sxm", "qwen3_8b", 1),
    ("a100_80gb_sxm", "llama3_1_8b", 1),
    ("l40s", "mistral_7b", 1),
    ("h200_sxm", "qwen3_32b", 1),
    ("mi300x", "qwen3_30b_a3b", 1),
    ("h100_sxm", "llama3_1_70b", 4),
]
WORKLOADS = ["seed_chat", "azure_conv_2023", "rag_long_prompt"]
CONCURRENCY = [16, 64, 256]
TOKEN_BUDGET = [512, 2048, 8192]
LOAD = [0.1, 0.3, 0.5, 0.7, 0.85, 0.95]
"""Target utilisations (the surrogate's) at which each configuration is probed."""
GPU_MEMORY_UTILIZATION = 0.9


def _configs():
    register_configs()
    with initialize_config_module("sweep.conf", version_base="1.3"):
        def get(group, name):
            return OmegaConf.to_object(getattr(compose(config_name=f"{group}/{name}"),
                                               group))
        hw = {h: get("hardware", h) for h in {d[0] for d in DEPLOYMENTS}}
        mo = {m: get("model", m) for m in {d[1] for d in DEPLOYMENTS}}
        wl = {w: get("workload", w) for w in WORKLOADS}
    return hw, mo, wl


def _rates_at(sur, args, targets, iters=24):
    """Per configuration, the arrival rates at which the surrogate's utilisation
    equals each target (bisection on log rate, all configurations at once)."""
    n = args[-1].shape[0]
    lo = np.full((n, len(targets)), np.log(1e-3))
    hi = np.full((n, len(targets)), np.log(1e3))
    rep = [jax.tree.map(lambda a: jnp.repeat(a, len(targets), axis=0), x)
           for x in args]
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        u = np.asarray(sur(*rep, jnp.asarray(np.exp(mid).ravel(), jnp.float32))[
            "utilization"]).reshape(lo.shape)
        up = u >= np.asarray(targets)[None]
        lo, hi = np.where(up, lo, mid), np.where(up, mid, hi)
    return np.exp(0.5 * (lo + hi))


def run(num_requests: int, quick: bool, seed: int = 0):
    hw_cfg, mo_cfg, wl_cfg = _configs()
    deployments = DEPLOYMENTS[:2] if quick else DEPLOYMENTS
    conc = CONCURRENCY[1:] if quick else CONCURRENCY
    rows = []
    sim_s = sur_s = 0.0
    max_slots = max(conc)
    sim = jax.jit(jax.vmap(partial(simulate, max_slots=max_slots),
                           in_axes=(0, 0, 0, 0, 0, 0)))
    sur = jax.jit(jax.vmap(surrogate))
    for wname in WORKLOADS:
        tables = workload_tables(wl_cfg[wname])
        lw = latency_workload(tables)
        pts = list(itertools.product(deployments, conc, TOKEN_BUDGET))
        hw = stack([hardware_params(hw_cfg[d[0]], GPU_MEMORY_UTILIZATION)
                    for (d, _, _) in pts])
        mo = stack([model_params(mo_cfg[d[1]]) for (d, _, _) in pts])
        tp = jnp.asarray([d[2] for (d, _, _) in pts], jnp.float32)
        cc = jnp.asarray([c for (_, c, _) in pts], jnp.float32)
        bb = jnp.asarray([b for (_, _, b) in pts], jnp.float32)
        lws = jax.tree.map(lambda x: jnp.broadcast_to(x, (len(pts),) + x.shape), lw)
        n = len(pts) * len(LOAD)

        def rep(x):
            return jax.tree.map(lambda a: jnp.repeat(a, len(LOAD), axis=0), x)

        rate = jnp.asarray(_rates_at(sur, (hw, mo, lws, tp, cc, bb), LOAD).ravel(),
                           jnp.float32)
        keys = jax.random.split(jax.random.key(seed), n)
        reqs = jax.vmap(lambda k, r: sample_requests(k, tables, num_requests, r))(
            keys, rate)
        t0 = time.perf_counter()
        out_sim = jax.block_until_ready(sim(rep(hw), rep(mo), rep(tp), rep(cc),
                                            rep(bb), reqs))
        sim_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        out_sur = jax.block_until_ready(sur(rep(hw), rep(mo), rep(lws), rep(tp),
                                            rep(cc), rep(bb), rate))
        sur_s += time.perf_counter() - t0
        for i in range(n):
            d, c, b = pts[i // len(LOAD)]
            row = dict(workload=wname, hardware=d[0], model=d[1], tp=d[2],
                       concurrency=c, token_budget=b, load=LOAD[i % len(LOAD)],
                       rate=float(rate[i]))
            for k in ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s",
                      "e2e_p99_s", "output_tokens_per_s"):
                row[f"sim_{k}"] = float(getattr(out_sim, k)[i])
                row[f"sur_{k}"] = float(out_sur[k][i])
            row["sim_status"] = int(out_sim.status[i])
            row["sim_preemptions"] = int(out_sim.preemptions[i])
            row["utilization"] = float(out_sur["utilization"][i])
            rows.append(row)
        print(f"{wname}: {n} configurations", flush=True)
    return rows, sim_s, sur_s


def _report(rows, sim_s, sur_s, num_requests):
    n = len(rows)
    print(f"\n{n} configurations x {num_requests} requests; simulator {sim_s:.1f} s, "
          f"surrogate {sur_s:.2f} s (incl. compilation)")
    metrics = ("ttft_p99_s", "itl_p99_s", "ttft_p50_s", "itl_p50_s", "e2e_p99_s")
    util = np.array([r["utilization"] for r in rows])
    ok = np.array([r["sim_status"] == 0 and np.isfinite(r["sim_ttft_p99_s"])
                   for r in rows])
    for name, mask in (("utilization < 0.9", (util < 0.9) & ok),
                       ("utilization >= 0.9", (util >= 0.9) & ok)):
        print(f"\n{name}: {mask.sum()} configurations")
        head = ("metric", "median", "p90", "worst", "<=15%")
        print("  {:12s} {:>8s} {:>8s} {:>9s} {:>7s}".format(*head))
        for k in metrics:
            sim = np.array([r[f"sim_{k}"] for r in rows])[mask]
            sur = np.array([r[f"sur_{k}"] for r in rows])[mask]
            err = np.abs(sur / sim - 1.0)
            if len(err) == 0:
                continue
            print(f"  {k:12s} {np.median(err):8.1%} {np.quantile(err, 0.9):8.1%} "
                  f"{err.max():9.1%} {np.mean(err <= 0.15):7.1%}")
    print(f"\nsimulator runs not OK (status != 0): {int((~ok).sum())}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--csv", default="")
    args = ap.parse_args()
    rows, sim_s, sur_s = run(args.requests, args.quick)
    _report(rows, sim_s, sur_s, args.requests)
    if args.csv:
        import csv

        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    main()
