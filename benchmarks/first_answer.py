"""Time to first answer: a console script with no arguments, cold and warm, by phase.

``python benchmarks/first_answer.py [--commands sweep-optimize sweep-grid] [--runs 1]``

A command may carry overrides: ``--commands "sweep-grid grid=small latency=simulate"``.

Each command runs in a fresh process, its output in a fresh folder, first
with an empty persistent compilation cache (``SWEEP_COMPILATION_CACHE`` set
to a new folder: cold), then again with the cache the first run filled
(warm). The process times its phases itself:

* imports: ``import sweep.cli.<app>`` (the console script's module);
* compose: Hydra composing configs (``ConfigLoaderImpl.load_configuration``,
  each composition counted);
* trace, lower, compile: JAX's own duration events (``jax.monitoring``:
  tracing to a jaxpr, lowering to MLIR, XLA compiling a program the
  persistent cache did not hold), each counted;
* write: ``Dataset.to_zarr`` calls;
* the rest: evaluation, the preflight's checks, the summary, start-up;
* cache hits: programs read from the persistent cache, of those looked up
  there (a warm run should read every one).

``--programs N`` lists the N costliest programs of each run (trace, lower
and compile seconds by function name).

Wall is the process's whole life, measured outside it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WRAPPER = r"""
import atexit, collections, json, sys, time
t0 = time.perf_counter()
report, app = sys.argv[1], sys.argv[2]
times = collections.defaultdict(float)
counts = collections.Counter()
programs = collections.defaultdict(float)  # "phase fun_name" -> seconds

def timed(owner, name, key):
    inner = getattr(owner, name)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            times[key] += time.perf_counter() - start
            counts[key] += 1
    setattr(owner, name, wrapper)

t = time.perf_counter()
module = __import__(f"sweep.cli.{app}", fromlist=["x"])
times["imports"] = time.perf_counter() - t
import jax.monitoring
from hydra._internal.config_loader_impl import ConfigLoaderImpl
import xarray as xr

EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
          "/jax/core/compile/backend_compile_duration": "compile"}

def listen(event, duration, **kwargs):
    if event in EVENTS:
        times[EVENTS[event]] += duration
        counts[EVENTS[event]] += 1
        programs[f"{EVENTS[event]} {kwargs.get('fun_name', '?')}"] += duration

jax.monitoring.register_event_duration_secs_listener(listen)
CACHE = {"/jax/compilation_cache/compile_requests_use_cache": "cache requests",
         "/jax/compilation_cache/cache_hits": "cache hits"}
jax.monitoring.register_event_listener(
    lambda event, **kwargs: counts.update([CACHE[event]]) if event in CACHE else None)
timed(ConfigLoaderImpl, "load_configuration", "compose")
timed(xr.Dataset, "to_zarr", "write")

def dump():
    with open(report, "w") as f:
        json.dump({"times": times, "counts": counts, "programs": programs,
                   "in_process_s": time.perf_counter() - t0}, f)

atexit.register(dump)
sys.argv = [f"sweep-{app}", *sys.argv[3:]]
{"optimize": getattr(module, "main", None),
 "grid": getattr(module, "grid_main", None)}[app]()
"""

PHASES = ("imports", "compose", "trace", "lower", "compile", "write")


def run(command: str, cache: Path, folder: Path) -> dict:
    name, *overrides = command.split()
    app = name.removeprefix("sweep-")
    report = folder / f"{app}.json"
    out = folder / ("optimize.zarr" if app == "optimize" else "cube.zarr")
    env = {**os.environ, "SWEEP_COMPILATION_CACHE": str(cache)}
    env.setdefault("JAX_PLATFORMS", "cpu")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", WRAPPER, str(report), app,
                           *overrides, f"out={out}"], env=env, capture_output=True,
                          text=True, cwd=folder, check=False)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    r = json.loads(report.read_text())
    r["wall_s"] = wall
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commands", nargs="*", default=["sweep-optimize", "sweep-grid"])
    ap.add_argument("--runs", type=int, default=1, help="warm runs after the cold one")
    ap.add_argument("--programs", type=int, default=0, metavar="N",
                    help="also list the N costliest programs (trace, lower, "
                         "compile seconds, by function name) of each run")
    a = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs")
    head = "".join(f"{p:>13}" for p in (*PHASES, "rest"))
    print(f"{'command':15} {'cache':5} {'wall s':>7}{head}  cache hits")
    for command in a.commands:
        with tempfile.TemporaryDirectory() as tmp:
            cache = Path(tmp) / "cache"
            for i in range(1 + a.runs):
                folder = Path(tmp) / f"run{i}"
                folder.mkdir()
                r = run(command, cache, folder)
                t, n = r["times"], r["counts"]
                cells = "".join(
                    f"{t.get(p, 0):>8.2f} ({n.get(p, 0) if p != 'imports' else '':>2})"
                    if p != "imports" else f"{t.get(p, 0):>13.2f}" for p in PHASES)
                rest = r["wall_s"] - sum(t.get(p, 0) for p in PHASES)
                print(f"{command:15} {'cold' if i == 0 else 'warm':5} "
                      f"{r['wall_s']:>7.2f}{cells}{rest:>13.2f}  "
                      f"{n.get('cache hits', 0)}/{n.get('cache requests', 0)}",
                      flush=True)
                top = sorted(r["programs"].items(), key=lambda kv: -kv[1])
                for name, seconds in top[:a.programs]:
                    print(f"{'':22}{seconds:>8.2f}  {name}")


if __name__ == "__main__":
    main()
