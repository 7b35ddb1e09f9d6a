"""Compilation time of the surrogate: what sweep-grid and sweep-optimize compile.

Lowers and compiles ``jit(vmap(sweep.latency.surrogate.surrogate))`` (a grid's
``latency=surrogate`` part) and ``jit(vmap(grad))`` of a log-p99 objective in
(log concurrency, log budget, rate) (what the optax search differentiates,
by reverse mode) and the same by
forward mode (``value_and_grad_fwd``, as the calibration differentiates),
for a batch of 16 points on H100 x Qwen3-8B x seed_chat, at XLA's default
optimisation level and at level 0 (what tests/test_latency.py uses). Each is
compiled ``--repeats`` times from scratch (``jax.clear_caches``); the best
wall and process-CPU times are printed (XLA compiles on several threads, so
CPU time exceeds wall time; on a shared machine CPU time moves less), with the
number of StableHLO operations traced.

Usage: python benchmarks/surrogate_compile.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from sweep.config.convert import hardware_params, model_params
from sweep.config.store import register_configs
from sweep.latency.surrogate import latency_workload, surrogate
from sweep.latency.workload import workload_tables
from sweep.model._numerics import value_and_grad_fwd
from sweep.model.params import stack

BATCH = 16


def _inputs():
    register_configs()
    with initialize_config_module("sweep.conf", version_base="1.3"):
        def get(group, name):
            return OmegaConf.to_object(getattr(compose(config_name=f"{group}/{name}"),
                                               group))
        hw = hardware_params(get("hardware", "h100_sxm"), 1.0)
        model = model_params(get("model", "qwen3_8b"))
        wl = latency_workload(workload_tables(get("workload", "seed_chat")))
    hws = jax.tree.map(lambda x: jnp.broadcast_to(jnp.asarray(x, jnp.float32),
                                                  (BATCH,)), hw)

    def full(v):
        return jnp.full((BATCH,), v, jnp.float32)

    return (hws, model, stack([wl] * BATCH), full(1.0), full(64.0), full(2048.0),
            full(5.0))


def _objective(hw, model, wl, tp, log_c, log_b, rate):
    out = surrogate(hw, model, wl, tp, jnp.exp(log_c), jnp.exp(log_b), rate)
    return jnp.log(out["ttft_p99_s"]) + jnp.log(out["itl_p99_s"])


def _forward_gradient(hw, model, wl, tp, log_c, log_b, rate):
    """The gradient by forward mode, as the calibration takes it:
    ``value_and_grad_fwd`` over the three as one vector."""
    def objective(x):
        return _objective(hw, model, wl, tp, x[0], x[1], x[2])

    return value_and_grad_fwd(objective)(jnp.stack([log_c, log_b, rate]))[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    hw, model, wl, tp, c, b, r = _inputs()
    inputs = (hw, model, wl, tp, jnp.log(c), jnp.log(b), r)
    axes = (0, None, 0, 0, 0, 0, 0)
    fns = {
        "surrogate": lambda hw, model, wl, tp, lc, lb, r: surrogate(
            hw, model, wl, tp, jnp.exp(lc), jnp.exp(lb), r),
        "gradient": jax.grad(_objective, argnums=(4, 5, 6)),
        "gradient, forward mode": _forward_gradient,
    }
    print(f"{jax.devices()[0].platform}, JAX {jax.__version__}, batch {BATCH}")
    print("| function | XLA level | ops | trace + lower (s) | compile wall (s) | "
          "compile CPU (s) | run (ms) |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for name, fn in fns.items():
        for level in ("default", 0):
            opts = {} if level == "default" else {
                "xla_backend_optimization_level": level}
            best = None
            for _ in range(args.repeats):
                jax.clear_caches()
                jitted = jax.jit(jax.vmap(fn, in_axes=axes), compiler_options=opts)
                t0 = time.perf_counter()
                lowered = jitted.lower(*inputs)
                t1, c1 = time.perf_counter(), time.process_time()
                compiled = lowered.compile()
                t2, c2 = time.perf_counter(), time.process_time()
                jax.block_until_ready(compiled(*inputs))
                t3 = time.perf_counter()
                jax.block_until_ready(compiled(*inputs))
                t4 = time.perf_counter()
                row = (t1 - t0, t2 - t1, c2 - c1, t4 - t3)
                best = row if best is None else tuple(map(min, best, row))
            ops = lowered.as_text().count("stablehlo.")
            print(f"| {name} | {level} | {ops:,} | {best[0]:.1f} | {best[1]:.1f} | "
                  f"{best[2]:.1f} | {1e3 * best[3]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
