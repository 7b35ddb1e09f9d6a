"""Configurations simulated per second: ``jit(vmap(simulate))`` vs baselines.

The seed workload (H100 SXM, Qwen3-8B bf16, 1,500-token prompts, outputs
100/300/800/2,000, Poisson arrivals at 3 req/s, from the shipped Hydra
configs) is simulated for ``--configs`` continuous-batching configurations
(concurrency and token budget varied) of ``--requests`` requests each, all in
one compiled call. Baselines run in the same process on a few of the same
configurations:

* the plain-Python step-by-step reference (``tests/reference_scheduler.py``);
* Vidur (PyPI ``vidur``), when it is installed and runs offline.

Run ``python benchmarks/simulate_throughput.py --configs 64 --requests 200``
for a quick check. ``--compare OLD.py`` times another version of
``sweep/latency/simulate.py`` (e.g.
``git show main:sweep/latency/simulate.py > OLD.py``) on
the same first pass, the two calls taking turns ``--repeats`` times in this
process, so a loaded machine slows both alike, and prints the size of both
compiled programs (instructions of the optimized HLO).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from hydra import initialize_config_module
from hydra.core.global_hydra import GlobalHydra

from sweep.config.convert import hardware_params, model_params
from sweep.config.resolve import grid_options
from sweep.config.store import register_configs
from sweep.latency.arrivals import sample_requests
from sweep.latency.simulate import STATUS_SLOTS, simulate
from sweep.latency.workload import workload_tables
from sweep.model.batching import CONTINUOUS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from reference_scheduler import simulate_reference  # noqa: E402

CONCURRENCY = (8, 16, 32, 64, 128, 256)
TOKEN_BUDGET = (256, 512, 1024, 2048, 4096, 8192)


def seed_inputs():
    """Hardware, model and workload tables of the shipped seed experiment."""
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_module("sweep.conf", version_base="1.3"):
        app, options = grid_options("grid", ["experiment=seed"])
    GlobalHydra.instance().clear()
    hw = hardware_params(options["hardware"][0], app.grid.gpu_memory_utilization)
    model = model_params(options["model"][0])
    workload = options["workload"][0]
    return hw, model, workload_tables(workload), workload.arrival_rate_per_s


def grid(configs: int):
    """``configs`` (concurrency, token budget) pairs cycling over both axes."""
    pairs = [(c, b) for c in CONCURRENCY for b in TOKEN_BUDGET]
    idx = np.arange(configs) % len(pairs)
    conc = np.array([pairs[i][0] for i in idx], np.float32)
    budget = np.array([pairs[i][1] for i in idx], np.float32)
    return conc, budget


def _compiled(hw, model, requests, conc, budget, slots, fn=simulate):
    f = jax.jit(jax.vmap(partial(fn, max_slots=slots),
                         in_axes=(None, None, None, 0, 0, None, None)))
    args = (jax.tree.map(jnp.float32, hw), jax.tree.map(jnp.float32, model), 1.0,
            jnp.asarray(conc), jnp.asarray(budget), requests, CONTINUOUS)
    t0 = time.perf_counter()
    compiled = f.lower(*args).compile()
    compile_s = time.perf_counter() - t0
    hlo = sum(" = " in line for line in compiled.as_text().splitlines())
    return (lambda: jax.block_until_ready(compiled(*args))), compile_s, hlo


def run_jax(hw, model, requests, conc, budget, slots):
    """All configurations with ``slots`` slots; those flagged ``STATUS_SLOTS``
    (their running set filled the slots) are rerun with the largest concurrency.

    Returns ``(results, compile_s, run_s, rerun_count)``.
    """
    full = int(conc.max())
    call, compile_s, _ = _compiled(hw, model, requests, conc, budget,
                                   min(slots, full))
    t0 = time.perf_counter()
    out = call()
    redo = np.flatnonzero(np.asarray(out.status) & STATUS_SLOTS)
    run_s = time.perf_counter() - t0
    if len(redo):
        call, c_s, _ = _compiled(hw, model, requests, conc[redo], budget[redo], full)
        compile_s += c_s
        t0 = time.perf_counter()
        again = call()
        run_s += time.perf_counter() - t0
        out = jax.tree.map(lambda a, b: np.asarray(a).copy(), out, out)
        for field, value in zip(out, again):
            field[redo] = np.asarray(value)
    return out, compile_s, run_s, len(redo)


def compare(path, hw, model, requests, conc, budget, slots, repeats):
    """Run times ``(repeats, 2)`` of ``path``'s ``simulate`` and this one, in
    turns, and the instructions of their optimized HLO programs ``(2,)``."""
    spec = importlib.util.spec_from_file_location("simulate_baseline", path)
    baseline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(baseline)
    slots = min(slots, int(conc.max()))
    calls, _, hlo = zip(*(_compiled(hw, model, requests, conc, budget, slots, fn)
                          for fn in (baseline.simulate, simulate)))
    for call in calls:
        call()
    times = np.zeros((repeats, 2))
    for i in range(repeats):
        for j, call in enumerate(calls):
            t0 = time.perf_counter()
            call()
            times[i, j] = time.perf_counter() - t0
    return times, hlo


def run_reference(hw, model, requests, conc, budget, count):
    arr, p, o = (np.asarray(x, np.float64) for x in requests)
    t0 = time.perf_counter()
    results = [simulate_reference(hw, model, 1.0, conc[i], budget[i], arr, p, o)
               for i in range(count)]
    return results, (time.perf_counter() - t0) / count


def vidur_status() -> str:
    if importlib.util.find_spec("vidur") is None:
        return "not installed"
    return "installed (not driven by this script; see benchmarks/README.md)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", type=int, default=1024)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--reference-configs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compare", metavar="SIMULATE_PY",
                    help="another sweep/latency/simulate.py to time against this one")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--slots", type=int, default=64,
                    help="slot array size of the first pass (configurations whose "
                    "running set fills it are rerun with the largest concurrency)")
    a = ap.parse_args()

    hw, model, tables, rate = seed_inputs()
    requests = sample_requests(jax.random.key(a.seed), tables, a.requests, rate)
    conc, budget = grid(a.configs)
    out, compile_s, run_s, redo = run_jax(hw, model, requests, conc, budget, a.slots)
    jax_rate = a.configs / run_s
    print(f"jax   : {a.configs} configs x {a.requests} requests in {run_s:.2f} s "
          f"(compile {compile_s:.1f} s; {a.slots} slots, {redo} configs rerun with "
          f"{int(conc.max())}) = {jax_rate:.1f} configs/s "
          f"= {jax_rate * a.requests / 1000:.1f} config-kreq/s")
    print(f"        loop turns: max {int(out.iterations.max())}, "
          f"mean {float(out.iterations.mean()):.0f}; scheduler steps: mean "
          f"{float(out.steps.mean()):.0f}; status != 0: {int((out.status != 0).sum())}")

    n_ref = min(a.reference_configs, a.configs)
    ref, ref_s = run_reference(hw, model, requests, conc, budget, n_ref)
    print(f"python: {ref_s:.2f} s per config ({n_ref} configs, one step per turn) "
          f"-> jax is {ref_s * jax_rate:.0f}x faster")
    for i, r in enumerate(ref):
        print(f"        config {i} (concurrency {conc[i]:.0f}, budget "
              f"{budget[i]:.0f}): steps {r.steps} vs {int(out.steps[i])}, p99 TTFT "
              f"{np.percentile(r.ttft_s, 99):.4f} vs {float(out.ttft_p99_s[i]):.4f} s, "
              f"p99 ITL {np.percentile(r.itl_s, 99):.5f} vs "
              f"{float(out.itl_p99_s[i]):.5f} s")
    if a.compare:
        t, hlo = compare(a.compare, hw, model, requests, conc, budget, a.slots,
                         a.repeats)
        kreq = a.configs * a.requests / 1000
        print(f"compare: {a.compare}: best {t[:, 0].min():.2f} s = "
              f"{kreq / t[:, 0].min():.1f} config-kreq/s; this: best "
              f"{t[:, 1].min():.2f} s = {kreq / t[:, 1].min():.1f} config-kreq/s; "
              f"time ratio this/that: median {np.median(t[:, 1] / t[:, 0]):.3f} "
              f"over {a.repeats} pairs")
        print(f"         optimized HLO: that {hlo[0]} instructions, this {hlo[1]}")
    print(f"vidur : {vidur_status()}")


if __name__ == "__main__":
    main()
