"""Hydra's Optuna sweeper (TPE) on one scenario of ``optimize_vs_grid.py``.

``optimize_vs_grid.py`` drives Optuna's ``TPESampler`` directly; this script
runs the real thing: a Hydra multirun (``-m``) with
``hydra/sweeper=optuna`` and ``hydra/sweeper/sampler=tpe``
(``hydra-optuna-sweeper``), one Hydra job per trial, each job evaluating the
same surrogate objective (cost = replicas x TP x price per GPU-hour, plus a
large penalty when the surrogate misses the SLO) on the same discrete space
(candidate TP, concurrency and token-budget lattice indices, log-uniform
integer replicas). By default it gets as many trials as the optax search
spends evaluations on the scenario (restarts x candidates x its steps). It
prints the sweeper's best cost against the exhaustive grid's optimum, its
wall time and the time per trial.

Usage: ``python benchmarks/optuna_sweeper.py h100_sxm qwen3_8b seed_chat 4
interactive [--trials N]``
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import hydra
import numpy as np
import optimize_vs_grid as bench  # this folder is on sys.path when run as a script
import yaml
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

_cache: dict[tuple, tuple] = {}


def scenario(cfg) -> tuple:
    """The prepared job and stacked candidates of a scenario (once a process)."""
    key = (cfg.hardware, cfg.model, cfg.workload, float(cfg.rate), cfg.slo)
    if key not in _cache:
        args = argparse.Namespace(hardware=[cfg.hardware], model=[cfg.model],
                                  workload=[cfg.workload], rate=[float(cfg.rate)],
                                  slo=[cfg.slo], levels=cfg.levels,
                                  replicas_max=cfg.replicas_max)
        jobs = bench.scenarios(args)
        cands, owner = bench.stacked(jobs)
        _cache[key] = (jobs, cands, owner)
    return _cache[key]


def trial(cfg: DictConfig) -> float:
    """One Optuna trial (a Hydra job): ``optimize_vs_grid.trial_value``."""
    (job,), cands, _ = scenario(cfg.scenario)
    value, _ = bench.trial_value(job, cands, int(cfg.candidate),
                                 int(cfg.concurrency_index), int(cfg.budget_index),
                                 int(cfg.replicas))
    return value


def store(scenario_cfg: dict, params: dict[str, str]) -> None:
    """The trial app's config: the Optuna sweeper with TPE over ``params``."""
    ConfigStore.instance().store(name="tpe", node={
        "defaults": [{"override hydra/sweeper": "optuna"},
                     {"override hydra/sweeper/sampler": "tpe"},
                     {"override hydra/job_logging": "disabled"},
                     {"override hydra/hydra_logging": "disabled"}, "_self_"],
        # a key of its own: sweep's config groups (hardware, model, ...) are
        # registered in the same process
        "scenario": scenario_cfg,
        "candidate": 0, "concurrency_index": 0, "budget_index": 0, "replicas": 1,
        "hydra": {"sweeper": {"direction": "minimize", "n_jobs": 1,
                              "sampler": {"seed": 0}, "params": params}},
    })


app = hydra.main(config_path=None, config_name="tpe", version_base="1.3")(trial)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("hardware")
    p.add_argument("model")
    p.add_argument("workload")
    p.add_argument("rate", type=float)
    p.add_argument("slo")
    p.add_argument("--trials", type=int, default=None,
                   help="default: optax's evaluations on this scenario")
    p.add_argument("--restarts", type=int, default=4)
    args = p.parse_args()
    scenario_cfg = {k: getattr(args, k)
                    for k in ("hardware", "model", "workload", "rate", "slo")}
    scenario_cfg.update(levels=bench.LEVELS, replicas_max=bench.REPLICAS_MAX)
    (job,), cands, owner = scenario(argparse.Namespace(**scenario_cfg))
    s = job.settings
    trials = args.trials or bench.optax_evaluations(job, args.restarts)
    grid, _, _ = bench.run_grid([job], cands, owner, s)
    ref = grid[0][0] if grid else float("inf")

    sweep_dir = Path(tempfile.mkdtemp(prefix="optuna_sweeper_"))
    conc, budget = np.unique(s.concurrency_values), np.unique(s.token_budget_values)
    n = len(job.candidates)
    store(scenario_cfg, {
        "candidate": f"choice({','.join(map(str, range(n)))})",
        "concurrency_index": f"int(interval(0, {len(conc) - 1}))",
        "budget_index": f"int(interval(0, {len(budget) - 1}))",
        "replicas": f"tag(log, int(interval(1, {s.replicas_max})))"})
    sys.argv = [sys.argv[0], "-m", f"hydra.sweeper.n_trials={trials}",
                f"hydra.sweep.dir={sweep_dir}"]
    # compile the one-point surrogate outside the timed sweep
    trial(OmegaConf.create({"scenario": scenario_cfg, "candidate": 0,
                            "concurrency_index": 0, "budget_index": 0,
                            "replicas": 1}))
    t0 = time.perf_counter()
    app()
    wall = time.perf_counter() - t0
    best = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    value = best["best_value"]
    found = value if value < bench.PENALTY else float("inf")
    print(f"Hydra Optuna sweeper (TPE) {args.hardware} {args.model} {args.workload} "
          f"{args.rate:g} {args.slo}: best {found:.4g} vs grid {ref:.4g} "
          f"({'within' if found <= ref * 1.02 else 'not within'} 2 %), {trials} "
          f"trials in {wall:.1f} s = {1e3 * wall / trials:.1f} ms per trial; best "
          f"params {best['best_params']}")


if __name__ == "__main__":
    main()
