"""What the tests share besides fixtures (``conftest.py`` holds those).

* Independent float64 hand calculations of the SPEC's roofline rules and the
  SPEC's seed table: nothing in that section imports the package's model
  code; these are the numbers the model is checked against.
* Composing configs: the one way the tests do it, through the package's own
  composition (``sweep.config.resolve``) in a Hydra context over the shipped
  configs, opened and closed per call like the console scripts do.
* The plain-Python baseline (``benchmarks/numpy_model.py``) over a whole
  cube: the values a written cube is checked against.
* Running the installed console scripts.
"""

from __future__ import annotations

import importlib
import math
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]

# --- hand calculations --------------------------------------------------------

# the SPEC's seed: H100 SXM, Qwen3-8B bf16
BW, FLOPS, MEM, USD = 3.35e12, 989e12, 80e9, 4.29
NVLINK = 4.5e11  # the H100 SXM's interconnect, bytes/s
PARAMS, LAYERS, QH, KVH, HD, HIDDEN = 8.19e9, 36, 32, 8, 128, 4096
W = PARAMS * 2
KVB = 2 * LAYERS * KVH * HD * 2
FPK = 4 * LAYERS * QH * HD

SEED_TABLE = [  # concurrency, ITL ms, per-user tok/s, GPU tok/s, USD/1M out
    (1, 4.96, 202, 202, 5.91),
    (8, 5.42, 185, 1477, 0.81),
    (32, 7.00, 143, 4570, 0.26),
    (64, 9.12, 110, 7021, 0.17),
    (128, 13.34, 75, 9595, 0.12),
    (256, 21.79, 46, 11747, 0.10),
]


def step(new_tokens, kv_read_tokens, keys, bw=BW, flops=FLOPS, tp=1):
    # a TP group splits the bytes and FLOPs over its GPUs and adds two ring
    # all-reduces per layer of the new tokens' bf16 activations
    return (max((W + kv_read_tokens * KVB) / (tp * bw),
                (2 * PARAMS * new_tokens + FPK * keys) / (tp * flops))
            + 2 * LAYERS * 2 * (tp - 1) / tp * new_tokens * HIDDEN * 2 / NVLINK)


def decode(n, c, **kw):
    return step(n, n * c, n * c, **kw)


def chunk_keys(m, p):
    return m * p + m * (m + 1) / 2


def chunked(n, c, prompt, budget, tp=1):
    """Loop over chunks one by one: (total_s, steps, worst_s)."""
    total, steps, worst, done = 0.0, 0, 0.0, 0
    while done < prompt:
        m = min(budget, prompt - done)
        t = step(n + m, n * c + done, n * c + chunk_keys(m, done), tp=tp)
        total, steps, worst, done = total + t, steps + 1, max(worst, t), done + m
    return total, steps, worst


def cost_per_mtok(tokens_per_s, gpus=1, usd=USD):
    return usd * gpus / (tokens_per_s * 3600) * 1e6


def expected_max_enumerated(values, probs, batch):
    """E[max of batch draws] by enumerating every outcome (small batch only)."""
    import itertools

    total = 0.0
    for combo in itertools.product(range(len(values)), repeat=batch):
        p = math.prod(probs[i] for i in combo)
        total += p * max(values[i] for i in combo)
    return total


def lindley_waits(service, gaps):
    """FCFS waits of a single server, request by request in float64
    (Lindley: ``W_i = max(W_{i-1} + S_{i-1} - A_i, 0)``, ``W_0 = 0``), as the
    walk of service less gaps above its running minimum. ``gaps[i]`` is the
    time from request ``i - 1`` to request ``i`` (``gaps[0]`` unused)."""
    service, gaps = np.asarray(service, np.float64), np.asarray(gaps, np.float64)
    walk = np.concatenate([[0.0], np.cumsum(service[:-1] - gaps[1:])])
    return walk - np.minimum.accumulate(walk)


# --- composing configs ----------------------------------------------------------


@contextmanager
def hydra_context() -> Iterator[None]:
    """A Hydra context over the shipped configs, as the console scripts open it."""
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from sweep.config.store import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module("sweep.conf", version_base="1.3"):
            yield
    finally:
        GlobalHydra.instance().clear()


def compose_app(app: str, overrides: Sequence[str] = ()):
    """The validated config dataclasses of ``app`` (``grid`` or ``optimize``)."""
    from sweep.config.resolve import compose_object

    with hydra_context():
        return compose_object(app, list(overrides))


def config_yaml(app: str, overrides: Sequence[str] = ()) -> str:
    """The config text a run of ``app`` records (Hydra's own composition)."""
    from hydra import compose
    from omegaconf import OmegaConf

    with hydra_context():
        return OmegaConf.to_yaml(compose(config_name=app, overrides=list(overrides)))


def grid_inputs(overrides: Sequence[str]):
    """``sweep-grid``'s validated config and the option objects of each group."""
    from sweep.config.resolve import grid_options

    with hydra_context():
        return grid_options("grid", list(overrides))


def grid_job(overrides: Sequence[str]):
    """The checked ``sweep-grid`` job of ``overrides`` (nothing compiled yet)."""
    from sweep.grid import job as grid

    return grid.prepare(*grid_inputs(overrides))


def optimize_inputs(overrides: Sequence[str]):
    """``sweep-optimize``'s validated config, hardware and models."""
    from sweep.search import optimize

    with hydra_context():
        return optimize.options("optimize", list(overrides))


# --- the baseline a cube is checked against -----------------------------------


def numpy_baseline():
    """``benchmarks/numpy_model.py``: the grid model re-written without JAX."""
    folder = str(REPO / "benchmarks")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module("numpy_model")


def python_cube(job) -> dict:
    """Every roofline variable of ``job``'s cube, point by point in float64 by
    the plain-Python loop of ``numpy_model`` (its own static utilisation, the
    long prompt chunk by chunk), shaped like the cube (``sweep.model.point.DIMS``)."""
    import numpy as np

    from sweep.grid import calibration

    # the baseline knows the bound's step only (no kv_mbu, no per-sequence time)
    assert not calibration.calibrated(job.calibration), (
        "python_cube is the theoretical bound: compose the job with "
        "calibration=roofline")
    nm = numpy_baseline()
    part = job.parts[0]
    shape = part.plan.shape
    points = nm.evaluate_points_python(nm.to_numpy(part.axes),
                                       range(math.prod(shape)), shape)
    return {k: np.array([p[k] for p in points], np.float64).reshape(shape)
            for k in points[0]}


def assert_cube_matches_baseline(ds, job) -> None:
    """A cube read back holds, at every point, what ``python_cube`` computes:
    float32 against float64, a few float32 ulps per step apart (rtol 1e-4)."""
    import numpy as np

    from sweep.model.point import DIMS

    for name, want in python_cube(job).items():
        got = ds[name]
        assert got.dims == DIMS, (name, got.dims)
        np.testing.assert_allclose(got.values.astype(np.float64), want, rtol=1e-4,
                                   atol=0, err_msg=name)


# --- reading cubes ----------------------------------------------------------------


def squeeze_except(ds, *named: str):
    """``ds`` without its length-1 axes other than ``named`` (each taken at
    its one value, which stays a scalar coordinate): a test names the axes it
    reads, and an axis that a new option adds with one value leaves it as it
    was."""
    return ds.isel({d: 0 for d, n in ds.sizes.items() if n == 1 and d not in named})


# --- the simulator against the reference ---------------------------------------


def h100(dtype=None, memory_bytes=80e9, mfu=1.0):
    """The seed's H100 SXM at the bound (``HardwareParams`` in ``dtype``,
    float64 by default)."""
    import numpy as np

    from sweep.model.params import HardwareParams

    dtype = dtype or np.float64
    return HardwareParams(*(dtype(x) for x in (
        BW, FLOPS, memory_bytes, NVLINK, USD, 1.0, mfu, 0.0, 1.0)))


def qwen3_8b(dtype, max_context_tokens=math.inf):
    """The seed's Qwen3-8B bf16 (``ModelParams`` in ``dtype``)."""
    from sweep.model.params import ModelParams

    return ModelParams(*(dtype(x) for x in (
        PARAMS, 0.0, PARAMS, LAYERS, QH, KVH, HD, 4096, 1.0, 2, 2,
        max_context_tokens)))


def jit_once(fn, /, **kwargs):
    """The project's ``jit`` of ``fn``, traced as the console scripts trace
    the surrogate: its stages computed once (``_numerics.computed_once``,
    from an index no ``vmap`` inside ``fn`` batches), not copied by XLA into
    every fusion that reads them. Called with ``fn``'s arguments."""
    from sweep.exported import jit
    from sweep.model._numerics import computed_once

    def flagged(index, *args, **kw):
        with computed_once(index):
            return fn(*args, **kw)

    run = jit(flagged, **kwargs)
    return lambda *args, **kw: run(np.int32(0), *args, **kw)


def itl_bound_s(hw, model, tp, budget, value_s):
    """The histogram's bound (``sweep.latency.simulate`` docstring) at ``value_s``.

    One bin (``2**-ITL_MANTISSA_BITS`` of the value) plus half the largest
    step-to-step increment a run can have: at most ``budget`` sequences'
    KV reads grow by a token a step, and attention keys by ``budget**2``.
    """
    from sweep.latency.simulate import ITL_MANTISSA_BITS

    kvb = 2.0 * model.layers * model.kv_heads * model.head_dim * model.kv_dtype_bytes
    fpk = 4.0 * model.layers * model.q_heads * model.head_dim
    slope_s = max(budget * kvb / (tp * hw.memory_bandwidth_bytes_per_s * hw.mbu),
                  fpk * budget**2 / (tp * hw.peak_flops_per_s * hw.mfu))
    return 2.0**-ITL_MANTISSA_BITS * value_s + float(slope_s) / 2.0


def assert_itl_percentiles(outcome, gaps, budget, hw=None, model=None, tp=1.0):
    """Within the histogram's bound of the interval NumPy interpolates in.

    Returns the percentiles (p50, p90, p99).
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    from sweep.latency.simulate import itl_percentiles

    hw = h100(np.float64) if hw is None else hw
    model = qwen3_8b(np.float64) if model is None else model
    q = np.array([50.0, 90.0, 99.0])
    with jax.enable_x64(True):
        got = np.asarray(itl_percentiles(
            jnp.asarray(outcome.itl_hist, jnp.float64), len(gaps), q,
            np.float64(outcome.itl_min_s), np.float64(outcome.itl_max_s)))
    # the smallest and largest gap are exact (to the simulation's precision)
    np.testing.assert_allclose([outcome.itl_min_s, outcome.itl_max_s],
                               [gaps.min(), gaps.max()], rtol=1e-5)
    want = np.percentile(gaps, q)
    srt = np.sort(gaps)
    pos = q / 100 * (len(gaps) - 1)
    lo, hi = srt[np.floor(pos).astype(int)], srt[np.ceil(pos).astype(int)]
    bound = itl_bound_s(hw, model, tp, budget, hi) + 1e-5 * hi
    assert np.all(got >= lo - bound) and np.all(got <= hi + bound), (got, want, bound)
    return got


def assert_matches_reference(got, ref, ttft_slo, itl_slo, itl_budget) -> None:
    """A float64 simulation (``SimOutcome``) is the step-by-step reference's
    run of the same stream (``tests/reference_scheduler.py``, float64): the
    same steps and preemptions; every request's TTFT and end-to-end time,
    and the run's duration, equal up to rounding (the closed-form sums
    differ from step-by-step accumulation only there); the same requests
    within ``ttft_slo`` and ``itl_slo``; the ITL histogram holds every gap
    exactly once, its percentiles within ``assert_itl_percentiles``' bound
    for steps of at most ``itl_budget`` tokens."""
    import numpy as np

    assert got.status == 0
    assert (got.steps, got.preemptions) == (ref.steps, ref.preemptions)
    np.testing.assert_allclose(got.ttft_s, ref.ttft_s, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(got.e2e_s, ref.e2e_s, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(got.duration_s, ref.duration_s, rtol=1e-12)
    good = (ref.ttft_s <= ttft_slo) & (ref.max_gap_s <= itl_slo)
    np.testing.assert_array_equal(got.good, good)
    np.testing.assert_allclose(got.itl_hist.sum(), len(ref.itl_s), rtol=1e-9)
    assert_itl_percentiles(got, ref.itl_s, itl_budget)


# --- the console scripts ------------------------------------------------------

CUBE_GRID = ["grid=small", "grid.hardware=[h100_sxm,l40s]", "model=qwen3_8b",
             "grid.concurrency=[1,8,64,512]", "grid.token_budget=[256,2048]"]
"""The session's roofline cube (``conftest.cube_path``)."""

OPTIMIZE_QUICK = ["hardware=h100_sxm", "model=qwen3_8b", "search=quick",
                  "search.tensor_parallel=[1,2]", "search.kv_dtype=[bf16,fp8]",
                  "search.verify_requests=200"]
"""The session's ``sweep-optimize`` run (``conftest.optimize_run``)."""


def script(name: str) -> str:
    """The installed console script ``name``."""
    exe = shutil.which(name)
    assert exe, f"{name} is not installed (pip install -e .)"
    return exe


def run_script(name: str, args: Sequence[str], cwd, env=None,
               timeout: float = 900) -> subprocess.CompletedProcess:
    """Runs the installed console script ``name`` in ``cwd``; output captured."""
    return subprocess.run([script(name), *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout, env=env)


def report(argv: Sequence) -> None:
    """``sweep-report argv`` in this process (its exit is ``SystemExit``)."""
    from sweep.cli.report import main

    main([str(a) for a in argv])


PNG = b"\x89PNG\r\n\x1a\n"


def check_png(path: Path) -> None:
    """A PNG file, not blank."""
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == PNG
    assert imread(path).std() > 0


def shared_data_dir() -> Path | None:
    """``shared/data`` beside this checkout, or beside its main worktree."""
    roots = [REPO]
    common = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--path-format=absolute",
         "--git-common-dir"], capture_output=True, text=True, check=False)
    if common.returncode == 0:
        roots.append(Path(common.stdout.strip()).parent)
    return next((r.parent / "shared" / "data" for r in roots
                 if (r.parent / "shared" / "data").is_dir()), None)


SHARED_DATA = shared_data_dir()


def conversation_stream(rng, num, block=16):
    """Multi-turn sessions: each turn's prompt extends its session's last
    prompt, so its hashes extend the last turn's (prefix-chained); a few
    requests share a system prompt's blocks."""
    sessions, next_hash = [], 1000
    hashes, prompts, outputs = [], [], []
    system = list(range(1, 4))
    for _ in range(num):
        if sessions and rng.random() < 0.6:
            s = sessions[rng.integers(len(sessions))]
        else:
            s = {"hashes": list(system) if rng.random() < 0.5 else []}
            sessions.append(s)
        grow = int(rng.integers(1, 6))
        s["hashes"] = s["hashes"] + list(range(next_hash, next_hash + grow))
        next_hash += grow
        prompt = len(s["hashes"]) * block - int(rng.integers(0, block))
        hashes.append(np.array(s["hashes"]))
        prompts.append(prompt)
        outputs.append(int(rng.integers(1, 40)))
    return hashes, np.array(prompts, float), np.array(outputs, float)
