"""R replicas verified two ways: a stream slowed R times vs one split R ways.

``sweep-optimize`` used to verify R replicas by simulating one replica fed
the whole stream slowed to ``rate / R``; it now splits one full-rate stream
over R simulated schedulers as a load balancer does
(``sweep.search.optimize.simulate_configs``). On a Poisson stream the two agree in
distribution (a Poisson process split at random is Poisson); on a bursty
trace a burst in the slowed stream lands on one replica, while the balancer
spreads it over all of them. This prints p99 TTFT of both (and of random
routing) for a few deployments, over the same requests: those the
verification takes (``optimize.verification_requests``: ``--requests x R``
of the stream, on a trace's recorded arrivals at least the whole trace,
so the same rows of a trace), split R ways
or all fed to one replica at ``rate / R``; and the p99 TTFT the search's
surrogate gives one replica under each routing
(``sweep.search.descent.replica_surrogate``: Erlang-R gaps for round
robin, Poisson at ``rate / R`` for random).

Usage: ``python benchmarks/replica_routing.py [--requests 1000]``
"""

from __future__ import annotations

import argparse
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from hydra import initialize_config_module

from sweep.config.convert import hardware_params, model_params
from sweep.config.schema import Routing
from sweep.config.store import register_configs
from sweep.latency.arrivals import workload_requests
from sweep.latency.simulate import simulate
from sweep.model.batching import CONTINUOUS
from sweep.search import descent, optimize

register_configs()

# (workload, rate per replica, replicas, concurrency, token budget)
CASES = [
    ("azure_conv_2023", 12.0, 4, 64, 2048),
    ("azure_conv_2023", 10.0, 4, 16, 2048),
    ("azure_conv_2023", 10.0, 8, 16, 2048),
    ("azure_code_2023", 4.0, 4, 64, 2048),
    ("seed_chat", 8.0, 4, 64, 2048),
    ("seed_chat", 8.0, 2, 64, 2048),
    ("seed_chat", 8.0, 8, 64, 2048),
]


def job_of(workload: str, rate: float, requests: int, routing: str):
    with initialize_config_module("sweep.conf", version_base="1.3"):
        base, hardware, models = optimize.options("optimize", [
            "hardware=h100_sxm", "model=qwen3_8b", f"workload={workload}",
            f"workload.arrival_rate_per_s={rate}", "search.tensor_parallel=[1]",
            f"search.verify_requests={requests}", f"search.routing={routing}"])
        return optimize.prepare(base, hardware, models)


@partial(jax.jit, static_argnames=("max_slots",))
def _slowed(hw, model, conc, budget, requests, ttft, itl, *, max_slots):
    return simulate(hw, model, 1.0, conc, budget, requests, CONTINUOUS, ttft, itl,
                    max_slots=max_slots)


def slowed(job, cfg, key):
    """The old verification: one replica fed the stream at rate / R."""
    app = job.app
    req = workload_requests(jax.random.fold_in(key, 0), app.workload, job.tables,
                            optimize.verification_requests(job, cfg.replicas),
                            app.workload.arrival_rate_per_s / cfg.replicas)
    cand = job.candidates[cfg.candidate]
    out = _slowed(hardware_params(cand.hardware, app.search.gpu_memory_utilization),
                  model_params(cand.model), jnp.float32(cfg.concurrency),
                  jnp.float32(cfg.token_budget), req,
                  jnp.float32(app.slo.ttft_p99_s), jnp.float32(app.slo.itl_p99_s),
                  max_slots=64)
    return float(out.ttft_p99_s)


@partial(jax.jit, static_argnames=("round_robin",))
def _searched(cand, conc, budget, replicas, round_robin):
    return descent.replica_surrogate(cand, conc, budget, replicas, round_robin)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=1000)
    args = p.parse_args()
    key = jax.random.key(0)
    print("| workload | rate req/s | replicas | max_num_seqs | p99 TTFT s: slowed | "
          "round robin | random | surrogate: round robin | random |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for workload, per_replica, replicas, conc, budget in CASES:
        rate = per_replica * replicas
        cfg = optimize.Config(0, conc, budget, replicas, {}, 0.0, 0.0)
        ttft = {}
        for routing in (r.value for r in Routing):
            job = job_of(workload, rate, args.requests, routing)
            ttft[routing] = optimize.simulate_configs(job, [cfg], key, 1)[0][
                "ttft_p99_s"]
        slo = job.app.slo
        one = jax.tree.map(lambda x: x[0], optimize._candidates(
            job, np.full(1, slo.ttft_p99_s), np.full(1, slo.itl_p99_s)))
        searched = [float(_searched(one, float(conc), float(budget), float(replicas),
                                    rr)["ttft_p99_s"])
                    for rr in (True, False)]
        print(f"| {workload} | {rate:g} | {replicas} | {conc} | "
              f"{slowed(job, cfg, key):.3f} | {ttft['round_robin']:.3f} | "
              f"{ttft['random']:.3f} | {searched[0]:.3f} | {searched[1]:.3f} |",
              flush=True)
    print(f"(H100 SXM, Qwen3-8B, TP 1, max_num_batched_tokens 2048; "
          f"{args.requests} requests per replica; jax {jax.__version__})")


if __name__ == "__main__":
    main()
