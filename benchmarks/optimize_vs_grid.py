"""The optax search against the exhaustive grid and Optuna TPE, same space.

Scenarios: hardware x model x workload x arrival rate x SLO from the shipped
configs (``--hardware`` etc.). Each scenario's candidates are the fitting TP
values; its discrete space is the lattice of ``sweep.search.descent`` (concurrency x
token budget, ``levels_per_octave``) x integer replicas in
``[1, replicas_max]``; cost = replicas x TP x price.

* **optax**: ``sweep.search.descent.search`` on every scenario's candidates at once
  (one compiled call); answer = cheapest surrogate-feasible integer
  configuration it evaluated. Evaluations = lanes x (steps + integer steps),
  each a surrogate value and gradient.
* **grid**: every lattice (TP, concurrency, budget) point, with its fewest
  feasible replicas by bisection on ``[1, replicas_max]`` (the surrogate's
  p99s fall with replicas, as the search also assumes); answer = cheapest.
  Evaluations = points x (1 + ceil(log2 replicas_max)) surrogate values.
* **Optuna TPE** (``optuna.samplers.TPESampler``, the sampler of Hydra's
  ``hydra-optuna-sweeper``): TP, lattice indices and log-replicas as
  parameters; value = cost, plus a large penalty when the surrogate misses
  the SLO; as many trials as optax's evaluations for that scenario (on a
  subset: ``--optuna``), one surrogate value each.

Then both optax's and the grid's answers run once through the simulator
(``--requests`` per replica; one stream at the full rate split over the
replicas round-robin, as ``sweep-optimize`` verifies),
without ``sweep-optimize``'s tightening rounds: the feasibility rate shows
what those rounds have to repair. Finally ``sweep-optimize``'s own loop
(``sweep.search.optimize.run``: search, simulate the cheapest answers, tighten the
surrogate targets of a missed candidate, search again) runs on every
scenario, and its answers are simulated once more on an independent request
stream (held out); TPE's answers are simulated as well.

Usage: ``python benchmarks/optimize_vs_grid.py [--optuna 10] [--no-loop]
[--requests 1000]``
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from sweep import exported
from sweep.config.schema import Routing
from sweep.config.store import register_configs
from sweep.cube.status import OK
from sweep.search import descent, optimize

register_configs()

LEVELS, REPLICAS_MAX = 2, 256
"""The default lattice (values per octave) and replicas bound of the scenarios."""
PENALTY = 1e6
"""Added to a TPE trial's cost where the surrogate misses the SLO."""


def scenarios(args):
    out = []
    with initialize_config_module("sweep.conf", version_base="1.3"):
        for h, m, w, rate, slo in itertools.product(args.hardware, args.model,
                                                    args.workload, args.rate,
                                                    args.slo):
            app = OmegaConf.to_object(compose("optimize", [
                f"hardware={h}", f"model={m}", f"workload={w}", f"slo={slo}",
                f"workload.arrival_rate_per_s={rate}",
                f"search.levels_per_octave={args.levels}",
                f"search.replicas_max={args.replicas_max}"]))
            try:
                job = optimize.prepare(app, [app.hardware], [app.model])
            except Exception as e:  # a model that fits nowhere: not a scenario
                print(f"skip {h} {m}: {e}")
                continue
            out.append(job)
    return out


def stacked(jobs):
    parts, owner = [], []
    for s, job in enumerate(jobs):
        n = len(job.candidates)
        c = optimize._candidates(job, np.full(n, job.app.slo.ttft_p99_s),
                                 np.full(n, job.app.slo.itl_p99_s))
        parts.append(jax.tree.map(lambda x: x[:n], c))
        owner += [(s, i) for i in range(n)]
    return jax.tree.map(lambda *x: jnp.concatenate(x), *parts), owner


def cost_of(job, cand, replicas):
    c = job.candidates[cand]
    return replicas * c.tp * c.hardware.usd_per_gpu_hour


def run_optax(jobs, cands, owner, settings, restarts, key):
    init = descent.initial_theta(key, settings, len(owner), restarts)
    t0 = time.perf_counter()
    res = descent.search(cands, init, settings)
    wall = time.perf_counter() - t0
    best = {}
    for row, (s, i) in enumerate(owner):
        ok = res.feasible[row]
        if not ok.any():
            continue
        cost = np.where(ok, cost_of(jobs[s], i, res.replicas[row]), np.inf)
        r, k = np.unravel_index(np.argmin(cost), cost.shape)
        cfg = (i, int(res.concurrency[row, r, k]), int(res.token_budget[row, r, k]),
               int(res.replicas[row, r, k]))
        if s not in best or cost[r, k] < best[s][0]:
            best[s] = (float(cost[r, k]), cfg)
    per_scenario = {s: optax_evaluations(job, restarts) for s, job in enumerate(jobs)}
    return best, per_scenario, wall


@functools.cache
def _forward(round_robin: bool):
    """The search's surrogate of one replica, vmapped over points."""
    return jax.jit(jax.vmap(functools.partial(descent.replica_surrogate,
                                              round_robin=round_robin)))


def feasible(cands, rows, conc, budget, replicas, slo, round_robin):
    """Surrogate feasibility of points (NumPy in, NumPy out), in chunks."""
    out = np.zeros(len(rows), bool)
    chunk = 8192
    for a in range(0, len(rows), chunk):
        idx = rows[a:a + chunk]
        pad = chunk - len(idx)  # one shape: one compilation
        sel = np.concatenate([idx, np.repeat(idx[:1], pad)])
        take = jax.tree.map(lambda x: x[sel], cands)
        n = len(sel)

        def col(v, a=a):
            v = np.asarray(v[a:a + chunk], np.float32)
            return jnp.asarray(np.concatenate([v, np.repeat(v[:1], pad)]))
        r = _forward(round_robin)(take, col(conc), col(budget), col(replicas))
        ok = ((np.asarray(r["ttft_p99_s"]) <= slo[0][sel])
              & (np.asarray(r["itl_p99_s"]) <= slo[1][sel])
              & (np.asarray(r["status"]) == OK))[:n - pad]
        out[a:a + chunk] = ok
    return out


def run_grid(jobs, cands, owner, settings):
    conc = np.unique(settings.concurrency_values)
    budget = np.unique(settings.token_budget_values)
    pts = np.array(list(itertools.product(range(len(owner)), conc, budget)))
    rows = pts[:, 0].astype(int)
    c, b = pts[:, 1], np.maximum(pts[:, 2], pts[:, 1])
    slo = (np.asarray(cands.ttft_target_s), np.asarray(cands.itl_target_s))
    t0 = time.perf_counter()
    r_max = settings.replicas_max
    rr = settings.routing == Routing.round_robin
    top = feasible(cands, rows, c, b, np.full(len(rows), r_max), slo, rr)
    lo, hi = np.zeros(len(rows), int), np.full(len(rows), r_max)
    for _ in range(settings.bisect_steps):
        mid = np.maximum((lo + hi) // 2, 1)
        live = hi - lo > 1
        ok = feasible(cands, rows, c, b, mid, slo, rr)
        hi = np.where(live & ok, mid, hi)
        lo = np.where(live & ~ok, mid, lo)
    wall = time.perf_counter() - t0
    best = {}
    for p in np.flatnonzero(top):
        s, i = owner[rows[p]]
        cost = cost_of(jobs[s], i, hi[p])
        if s not in best or cost < best[s][0]:
            best[s] = (cost, (i, int(c[p]), int(b[p]), int(hi[p])))
    per_scenario = {s: 0 for s in range(len(jobs))}
    for row, (s, _) in enumerate(owner):
        per_scenario[s] += len(conc) * len(budget) * (1 + settings.bisect_steps)
    return best, per_scenario, wall


def trial_value(job, cands_one, i, ci, bi, r):
    """One TPE trial: candidate ``i``, lattice indices ``ci``/``bi``, ``r`` replicas.

    Returns:
      ``(cost, plus PENALTY where the surrogate misses the SLO; the
      configuration (candidate, concurrency, budget, replicas))``.
    """
    s = job.settings
    c = float(np.unique(s.concurrency_values)[ci])
    b = max(float(np.unique(s.token_budget_values)[bi]), c)
    one = jax.tree.map(lambda x: x[i:i + 1], cands_one)
    out = _forward(s.routing == Routing.round_robin)(
        one, jnp.full(1, c, jnp.float32), jnp.full(1, b, jnp.float32),
        jnp.full(1, r, jnp.float32))
    slo = job.app.slo
    ok = (float(out["ttft_p99_s"][0]) <= slo.ttft_p99_s
          and float(out["itl_p99_s"][0]) <= slo.itl_p99_s
          and int(out["status"][0]) == OK)
    cost = float(cost_of(job, i, r))
    return (cost if ok else cost + PENALTY), (i, int(c), int(b), int(r))


def optax_evaluations(job, restarts):
    """Surrogate value+gradient evaluations the search spends on a scenario."""
    s = job.settings
    return restarts * len(job.candidates) * (s.steps + s.integer_steps)


def run_optuna(job, cands_one, settings, trials, seed):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    n_conc = len(np.unique(settings.concurrency_values))
    n_budget = len(np.unique(settings.token_budget_values))

    def objective(trial):
        value, config = trial_value(
            job, cands_one, trial.suggest_categorical("candidate",
                                                      list(range(len(job.candidates)))),
            trial.suggest_int("concurrency_index", 0, n_conc - 1),
            trial.suggest_int("budget_index", 0, n_budget - 1),
            trial.suggest_int("replicas", 1, settings.replicas_max, log=True))
        trial.set_user_attr("config", config)
        return value

    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=seed))
    t0 = time.perf_counter()
    study.optimize(objective, n_trials=trials)
    wall = time.perf_counter() - t0
    done = [t for t in study.trials if t.value < PENALTY]
    if not done:
        return math.inf, None, wall
    best = min(done, key=lambda t: t.value)
    return best.value, tuple(best.user_attrs["config"]), wall


def simulate_answers(jobs, answers, requests_per_replica, key):
    """Simulator verdict per (scenario, config): p99s within the SLO.

    Each scenario's configurations go through ``sweep-optimize``'s own
    verification (``optimize.simulate_configs``: one stream at the full rate
    split over the replicas by the load balancer).
    """
    verdict = {}
    by_scenario = {}
    for s, cfg in answers:
        by_scenario.setdefault(s, []).append(cfg)
    for s, cfgs in by_scenario.items():
        job = jobs[s]
        job.app.search.verify_requests = requests_per_replica
        job.app.search.verify_requests_max = max(job.app.search.verify_requests_max,
                                                 requests_per_replica)
        configs = [optimize.Config(i, c, b, r, {}, 0.0, 0.0) for i, c, b, r in cfgs]
        sims = optimize.simulate_configs(job, configs, key, len(configs))
        for cfg, sim in zip(cfgs, sims):
            verdict[(s, cfg)] = optimize.met(job, sim)
    return verdict


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hardware", nargs="+",
                   default=["a100_80gb_sxm", "h100_sxm", "h200_sxm", "b200"])
    p.add_argument("--model", nargs="+", default=["qwen3_8b", "llama3_1_70b"])
    p.add_argument("--workload", nargs="+", default=["seed_chat", "azure_conv_2023"])
    p.add_argument("--rate", nargs="+", type=float, default=[1, 4, 16, 64])
    p.add_argument("--slo", nargs="+", default=["interactive", "batch"])
    p.add_argument("--levels", type=int, default=LEVELS)
    p.add_argument("--replicas-max", type=int, default=REPLICAS_MAX)
    p.add_argument("--restarts", type=int, default=4)
    p.add_argument("--optuna", type=int, default=10, help="scenarios for Optuna")
    p.add_argument("--no-loop", dest="loop", action="store_false",
                   help="skip sweep-optimize's own loop (search, simulate, tighten)")
    p.add_argument("--requests", type=int, default=1000)
    args = p.parse_args()

    jobs = scenarios(args)
    settings = jobs[0].settings
    cands, owner = stacked(jobs)
    print(f"{len(jobs)} scenarios, {len(owner)} candidates, lattice "
          f"{len(np.unique(settings.concurrency_values))} x "
          f"{len(np.unique(settings.token_budget_values))}, replicas 1.."
          f"{settings.replicas_max}")
    key = jax.random.key(0)

    # the timed call reuses the timed compilation through the persistent cache
    jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp())
    init = descent.initial_theta(key, settings, len(owner), args.restarts)
    t0 = time.perf_counter()
    search = exported.jitted(descent._search, settings=settings)
    search.lower(cands, init).compile()
    opt_compile = time.perf_counter() - t0
    opt, opt_evals, opt_first = run_optax(jobs, cands, owner, settings,
                                          args.restarts, key)
    t0 = time.perf_counter()
    feasible(cands, np.zeros(1, int), np.ones(1), np.ones(1), np.ones(1),
             (np.ones(len(owner)), np.ones(len(owner))),
             settings.routing == Routing.round_robin)
    grid_compile = time.perf_counter() - t0
    grid, grid_evals, grid_wall = run_grid(jobs, cands, owner, settings)
    print(f"optax: {sum(opt_evals.values()):,} value+grad evaluations, "
          f"{opt_first:.1f} s (+ {opt_compile:.1f} s compilation, timed apart)")
    print(f"grid: {sum(grid_evals.values()):,} surrogate evaluations, "
          f"{grid_wall:.1f} s (+ {grid_compile:.1f} s compilation)")

    n = len(jobs)
    both = [s for s in range(n) if s in grid]
    within = [s for s in both if s in opt and opt[s][0] <= grid[s][0] * 1.02]
    missing = [s for s in both if s not in opt]
    cheaper = [s for s in both if s in opt and opt[s][0] < grid[s][0] * (1 - 1e-9)]
    print(f"grid-feasible scenarios: {len(both)} of {n}; optax within 2 %: "
          f"{len(within)} ({100 * len(within) / max(len(both), 1):.1f} %); optax "
          f"found none: {len(missing)}; optax cheaper than grid: {len(cheaper)}")
    for s in both:
        if s not in within:
            print(f"  off: {_name(jobs[s])}: grid {grid[s]} optax {opt.get(s)}")

    answers = sorted({(s, opt[s][1]) for s in opt} | {(s, grid[s][1]) for s in grid})
    t0 = time.perf_counter()
    verdict = simulate_answers(jobs, answers, args.requests, jax.random.key(1))
    sim_wall = time.perf_counter() - t0
    opt_ok = sum(verdict[(s, opt[s][1])] for s in opt)
    grid_ok = sum(verdict[(s, grid[s][1])] for s in grid)
    print(f"simulated {len(answers)} answers ({args.requests} requests each, "
          f"{sim_wall:.1f} s): optax feasible {opt_ok}/{len(opt)}, grid feasible "
          f"{grid_ok}/{len(grid)}")

    if args.loop:
        cli_loop(jobs, grid, args.requests)
    if args.optuna:
        optuna_subset(jobs, cands, owner, settings, grid, opt_evals, opt_first,
                      args)


def cli_loop(jobs, grid, requests):
    """``sweep-optimize``'s own loop (search, simulate, tighten) per scenario.

    Its answer is confirmed by its own simulation by construction; it is then
    simulated again on an independent request stream (held out), so a pass
    is not just the verification stream's luck.
    """
    chosen, infeasible, took, evals, sims = {}, [], {}, 0, 0
    t0 = time.perf_counter()
    for s, job in enumerate(jobs):
        try:
            out = optimize.run(job, log=lambda line: None)
        except optimize.Infeasible as e:
            infeasible.append((s, str(e)))
            continue
        c = out.chosen
        chosen[s] = (cost_of(job, c.candidate, c.replicas),
                     (c.candidate, c.concurrency, c.token_budget, c.replicas))
        took[s] = out.rounds
        evals += out.evaluations
        sims += out.simulations
    wall = time.perf_counter() - t0
    held = simulate_answers(jobs, sorted((s, a[1]) for s, a in chosen.items()),
                            requests, jax.random.key(2))
    ok = sum(held[(s, a[1])] for s, a in chosen.items())
    ratio = np.array([chosen[s][0] / grid[s][0] for s in chosen if s in grid])
    hist = {int(k): int(v)
            for k, v in zip(*np.unique(list(took.values()), return_counts=True))}
    print(f"sweep-optimize loop on {len(jobs)} scenarios: {wall:.1f} s, {evals:,} "
          f"surrogate evaluations, {sims} simulations; scenarios per number of "
          f"rounds {hist}; answered {len(chosen)}, infeasible {len(infeasible)}")
    print(f"  simulator-confirmed: {len(chosen)}/{len(chosen)} by construction; "
          f"held-out simulation ({requests} other requests per replica) within the "
          f"SLO: {ok}/{len(chosen)}")
    print(f"  cost / grid's surrogate optimum: within 2 % {int(np.sum(ratio <= 1.02))}"
          f"/{len(ratio)}, median {np.median(ratio):.3f}, max {ratio.max():.3f}")
    for s, msg in infeasible:
        print(f"  infeasible: {_name(jobs[s])}: {msg}")
    for s in chosen:
        if s in grid and chosen[s][0] > grid[s][0] * 1.02:
            print(f"  off: {_name(jobs[s])}: {took[s]} round(s), {chosen[s]} vs grid "
                  f"{grid[s]}")
    for s in chosen:
        if not held[(s, chosen[s][1])]:
            print(f"  held-out miss: {_name(jobs[s])}: {chosen[s]}")


def _name(job) -> str:
    app = job.app
    return (f"{app.hardware.name} {app.model.name} {app.workload.name} "
            f"{app.workload.arrival_rate_per_s:g} {app.slo.name}")


def optuna_subset(jobs, cands, owner, settings, grid, opt_evals, opt_first, args):
    """TPE at optax's evaluation budget on evenly spaced scenarios."""
    n = len(jobs)
    picks = np.linspace(0, n - 1, min(args.optuna, n)).astype(int)
    rows = {s: [k for k, (t, _) in enumerate(owner) if t == s] for s in picks}
    found, hits, t_tpe, budget = {}, 0, 0.0, 0
    for s in picks:
        one = jax.tree.map(lambda x: x[np.asarray(rows[s])], cands)
        best, cfg, wall = run_optuna(jobs[s], one, settings, opt_evals[s], seed=0)
        t_tpe += wall
        budget += opt_evals[s]
        ref = grid.get(s, (math.inf,))[0]
        hits += bool(best <= ref * 1.02)
        if cfg is not None:
            found[s] = cfg
        print(f"  optuna {_name(jobs[s])}: {best:.4g} vs grid {ref:.4g} "
              f"({opt_evals[s]} trials, {wall:.1f} s)", flush=True)
    t_opt = opt_first * sum(opt_evals[s] for s in picks) / sum(opt_evals.values())
    verdict = simulate_answers(jobs, sorted(found.items()), args.requests,
                               jax.random.key(1))
    print(f"optuna TPE on {len(picks)} scenarios: within 2 % of grid {hits}/"
          f"{len(picks)}, {budget:,} trials, {t_tpe:.1f} s (optax's share of its "
          f"call for these scenarios: {t_opt:.1f} s); simulator-feasible "
          f"{sum(verdict.values())}/{len(found)} of its answers")


if __name__ == "__main__":
    main()
