"""The surrogate in float32 (as the console scripts run it) against float64.

Evaluates ``jit(vmap(sweep.latency.surrogate.surrogate))`` on H100 x
Qwen3-8B over ``--configs`` random configurations (concurrency 1-256,
budget 512-8192, 0.05-8 req/s, the SLOs of ``slo=default``) of each shipped
workload named, once in float32 here and once in float64 in a child process
(x64 is a process-wide setting), and prints, per workload and output, the
largest and the 99th-percentile relative difference over the configurations
where both are finite, and how many differ by more than 0.5 %.

Usage: python benchmarks/surrogate_precision.py [--configs 2048]
       [--workloads seed_chat azure_conv_2023 azure_code_2023]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

SEED = 1


def evaluate(workloads: list[str], configs: int, x64: bool) -> dict[str, np.ndarray]:
    import jax

    jax.config.update("jax_enable_x64", x64)
    import jax.numpy as jnp
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from sweep.config.convert import hardware_params, model_params
    from sweep.config.schema import GridApp
    from sweep.config.store import register_configs
    from sweep.latency.surrogate import latency_workload, surrogate
    from sweep.latency.workload import workload_tables

    dtype = jnp.float64 if x64 else jnp.float32
    register_configs()
    rng = np.random.default_rng(SEED)
    conc = rng.choice([1.0, 8.0, 32.0, 64.0, 256.0], configs)
    budget = rng.choice([512.0, 2048.0, 8192.0], configs)
    rate = rng.uniform(0.05, 8.0, configs)
    out = {}
    with initialize_config_module("sweep.conf", version_base="1.3"):
        for name in workloads:
            cfg = compose("grid", ["hardware=h100_sxm", "model=qwen3_8b",
                                   f"workload={name}"])
            app: GridApp = OmegaConf.to_object(cfg)
            cast = lambda tree: jax.tree.map(lambda x: jnp.asarray(x, dtype), tree)  # noqa: E731
            hw = cast(hardware_params(app.hardware, 0.9))
            model = cast(model_params(app.model))
            wl = cast(latency_workload(workload_tables(app.workload)))
            slo = (app.slo.ttft_p99_s, app.slo.itl_p99_s)

            def one(c, b, r, hw=hw, model=model, wl=wl, slo=slo):
                return surrogate(hw, model, wl, 1.0, c, b, r, *slo)

            res = jax.jit(jax.vmap(one))(*(jnp.asarray(x, dtype)
                                           for x in (conc, budget, rate)))
            out.update({f"{name}/{k}": np.asarray(v) for k, v in res.items()})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", type=int, default=2048)
    p.add_argument("--workloads", nargs="+",
                   default=["seed_chat", "azure_conv_2023", "azure_code_2023"])
    p.add_argument("--child", help=argparse.SUPPRESS)  # float64, into this file
    a = p.parse_args()
    if a.child:
        np.savez(a.child, **evaluate(a.workloads, a.configs, x64=True))
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "x64.npz"
        child = subprocess.Popen([sys.executable, __file__, "--configs", str(a.configs),
                                  "--workloads", *a.workloads, "--child", str(path)])
        f32 = evaluate(a.workloads, a.configs, x64=False)
        if child.wait() != 0:
            sys.exit("the float64 evaluation failed")
        with np.load(path) as f:
            f64 = dict(f)
    print(f"{a.configs} configurations per workload; relative difference of "
          "float32 from float64 where both are finite")
    print(f"{'workload/output':45s} {'max':>9s} {'p99':>9s} {'> 0.5 %':>8s}")
    for k, ref in f64.items():
        if ref.dtype.kind != "f":
            continue
        got = f32[k].astype(np.float64)
        ok = np.isfinite(ref) & np.isfinite(got) & (ref != 0)
        if not ok.any():
            continue
        rel = np.abs(got[ok] - ref[ok]) / np.abs(ref[ok])
        print(f"{k:45s} {rel.max():9.1e} {np.quantile(rel, 0.99):9.1e} "
              f"{int((rel > 5e-3).sum()):8d}")


if __name__ == "__main__":
    main()
