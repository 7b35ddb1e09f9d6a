"""Fits ``mbu``, ``mfu``, ``step_overhead_s``, ``kv_mbu`` and
``sequence_overhead_s`` to measured data, by optax.

Two kinds of measurement, one loss (the mean squared log ratio of predicted
to measured, i.e. relative error weighted alike at 1 ms and at 1 s):

* **steps**: measured step latencies (``sweep.cli.calibrate_io.read_steps``),
  each predicted by the roofline step (``sweep.model.roofline.step_s``): a row of
  ``batch_size`` sequences with ``context_tokens`` cached tokens each and
  ``prefill_tokens`` new tokens each (0: a decode step, one new token each);
* **serving runs** (``vllm bench serve``, ``sweep.cli.calibrate_io.read_bench``):
  p50/p99 TTFT and ITL predicted by the analytic surrogate
  (``sweep.latency.surrogate``, smooth in the constants) with the run's own
  (prompt, output) pairs and arrival rate and the server's max-num-seqs and
  max-num-batched-tokens. The client's ``--max-concurrency`` is no server
  queue (vLLM's benchmark starts a request's clock when it is sent): it
  shows as the arrival rate, which a capped run's throughput measures, and
  Little's law then puts about that many requests in the server.

The constants are fitted in log space, each projected onto its box
(``LOG_LOW``, ``LOG_HIGH``: utilisations in ``[1e-3, 1]``) after every Adam
step (``optax.projections``), a few starts at once (``vmap``), the best kept.
A constant that no point depends on (``mfu`` with only decode steps, ``mbu``
with only long prefills, ``kv_mbu`` with no memory-bound step reading a KV
cache, ``sequence_overhead_s`` with one batch size) is not identified by the
data: it keeps the hardware's value (``kv_mbu``: follows ``mbu``) and the fit
says so. ``kv_mbu`` not fitted follows ``mbu``.
"""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sweep import exported, shapes
from sweep.latency.surrogate import LatencyWorkload, surrogate
from sweep.model import roofline
from sweep.model._numerics import computed_once, value_and_grad_fwd
from sweep.model.params import HardwareParams, ModelParams

CONSTANTS = ("mbu", "mfu", "step_overhead_s", "kv_mbu", "sequence_overhead_s")
FLOORS = (1e-3, 1e-3, 1e-7, 1e-3, 1e-9)
"""Smallest value of each constant; an overhead at its floor is written as 0."""
LOG_LOW = tuple(math.log(f) for f in FLOORS)
LOG_HIGH = (0.0, 0.0, math.log(10.0), 0.0, math.log(1e-2))
STARTS = ((0.6, 0.5, 1e-4, 0.6, 1e-6), (0.9, 0.8, 1e-4, 0.9, 1e-6),
          (0.8, 0.6, 3e-3, 0.8, 1e-5), (0.5, 0.9, 1e-5, 0.9, 1e-8))
"""Initial ``CONSTANTS`` of the starts fitted together."""
BENCH_METRICS = ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s")


class Steps(NamedTuple):
    """Measured steps, padded to a static length (``weight`` 0 on padding)."""

    batch_size: jax.Array  # shape=(N,), sequences in the step
    context_tokens: jax.Array  # shape=(N,), cached tokens of each sequence
    prefill_tokens: jax.Array  # shape=(N,), new tokens of each; 0 = decode
    tensor_parallel: jax.Array  # shape=(N,)
    seconds: jax.Array  # shape=(N,), measured
    weight: jax.Array  # shape=(N,)


class Runs(NamedTuple):
    """Serving runs, padded to a static count (``weight`` 0 on padding)."""

    workload: LatencyWorkload  # leaves with a leading run axis
    concurrency: jax.Array  # shape=(R,), the server's max-num-seqs
    token_budget: jax.Array  # shape=(R,), max-num-batched-tokens
    tensor_parallel: jax.Array  # shape=(R,)
    rate_per_s: jax.Array  # shape=(R,), request arrival rate
    measured: jax.Array  # shape=(R, 4), BENCH_METRICS
    weight: jax.Array  # shape=(R,)


def step_seconds(hw: HardwareParams, model: ModelParams, batch_size, context_tokens,
                 prefill_tokens, tensor_parallel):
    """Predicted time of one measured step row, seconds (see module docstring)."""
    decode = prefill_tokens == 0.0
    new = jnp.where(decode, batch_size, batch_size * prefill_tokens)
    cached = batch_size * context_tokens
    keys = jnp.where(decode, cached, batch_size * roofline.chunk_attention_keys(
        prefill_tokens, context_tokens))
    return roofline.step_s(hw, model, tensor_parallel, new, cached, keys, batch_size)


def step_bounds(hw: HardwareParams, model: ModelParams, s: Steps):
    """Each row's memory and compute time (without overhead), seconds."""
    decode = s.prefill_tokens == 0.0
    new = jnp.where(decode, s.batch_size, s.batch_size * s.prefill_tokens)
    cached = s.batch_size * s.context_tokens
    keys = jnp.where(decode, cached, s.batch_size * roofline.chunk_attention_keys(
        s.prefill_tokens, s.context_tokens))
    memory = (roofline.weight_bytes_read(model, new) + cached
              * roofline.kv_read_bytes_per_token(hw, model)) / s.tensor_parallel / (
        hw.memory_bandwidth_bytes_per_s * hw.mbu)
    compute = (roofline.linear_flops_per_token(hw, model) * new
               + roofline.attention_flops_per_key(model) * keys) / s.tensor_parallel / (
        hw.peak_flops_per_s * hw.mfu)
    return memory, compute


def run_metrics(hw: HardwareParams, model: ModelParams, runs: Runs):
    """The surrogate's ``BENCH_METRICS`` of every run, shape ``(R, 4)``."""

    def one(wl, conc, budget, tp, rate):
        r = surrogate(hw, model, wl, tp, conc, budget, rate)
        return jnp.stack([r[k] for k in BENCH_METRICS])

    return jax.vmap(one)(runs.workload, runs.concurrency, runs.token_budget,
                         runs.tensor_parallel, runs.rate_per_s)


def with_constants(hw: HardwareParams, log_c) -> HardwareParams:
    """``hw`` with ``CONSTANTS = exp(log_c)``."""
    c = jnp.exp(log_c)
    return hw._replace(**{k: c[i] for i, k in enumerate(CONSTANTS)})


def _sq_log_ratio(pred, measured, weight):
    # a saturated run's infinite prediction counts as a large, finite miss
    r = jnp.log(jnp.clip(pred, 1e-9, 1e6)) - jnp.log(measured)
    return jnp.where(weight > 0, weight * r * r, 0.0)


def loss(log_c, hw, model, steps: Steps | None, runs: Runs | None,
         tie_kv: bool = False):
    """Mean squared log ratio over every weighted step and run metric;
    ``tie_kv``: the KV cache streams at ``mbu``."""
    if tie_kv:
        log_c = log_c.at[3].set(log_c[0])
    h = with_constants(hw, log_c)
    total = jnp.zeros((), log_c.dtype)
    count = jnp.zeros((), log_c.dtype)
    if steps is not None:
        pred = step_seconds(h, model, steps.batch_size, steps.context_tokens,
                            steps.prefill_tokens, steps.tensor_parallel)
        total += _sq_log_ratio(pred, steps.seconds, steps.weight).sum()
        count += steps.weight.sum()
    if runs is not None:
        pred = run_metrics(h, model, runs)
        total += _sq_log_ratio(pred, runs.measured, runs.weight[:, None]).sum()
        count += runs.weight.sum() * len(BENCH_METRICS)
    return total / count


class FitResult(NamedTuple):
    log_constants: jax.Array  # shape=(5,), the best start's
    loss: jax.Array  # shape=(), its final loss
    nonfinite_steps: jax.Array  # shape=(), its steps whose gradient was not finite


def _fit(hw, model, steps, runs, init, learning_rate, n_steps, *,
         fit_mask: tuple[bool, ...]) -> dict:
    """The best start's constants, loss and count of steps whose gradient
    was not finite (they did not move it), as a dict (a result
    ``sweep.exported`` can keep). ``n_steps`` is a value, not a shape: a
    fit of another length runs the same compiled program."""
    tie_kv = not fit_mask[3]
    # (1, 5): a row for every start
    low = jnp.asarray([LOG_LOW], init.dtype)
    high = jnp.asarray([LOG_HIGH], init.dtype)
    mask = jnp.asarray([fit_mask])
    # optax's cosine decay over n_steps, read at count / n_steps over one
    # step (its own length must be a Python number)
    unit = optax.cosine_decay_schedule(learning_rate, 1, alpha=0.1)
    opt = optax.adam(lambda count: unit(count / n_steps.astype(init.dtype)))
    grad_fn = value_and_grad_fwd(loss)

    def step(i, carry):
        x, state, bad, _ = carry  # x: (starts, 5), Adam elementwise over both
        # the starts batched inside the loop: vmap of the loop batched its
        # traced body again (the fit's tracing took 15.1-15.3 s, now 9.3 s)
        # no vmap batches the loop index: the surrogate's stages are
        # computed once (``_numerics.materialize``)
        with computed_once(i):
            value, g = jax.vmap(
                lambda x1: grad_fn(x1, hw, model, steps, runs, tie_kv))(x)
        # the pass after the last step only reads the loss at its end
        # (one program: the loss evaluated apart compiled as long again)
        more = i < n_steps
        used = mask & jnp.isfinite(g)
        bad = bad + (more & jnp.any(mask & ~used, axis=-1)).astype(jnp.int32)
        g = jnp.where(used, g, 0.0)
        # optax mixes Python floats with its int32 step count (bias
        # correction, schedules): allowed here where a caller made it strict
        with jax.numpy_dtype_promotion("standard"):
            updates, state = opt.update(g, state, x)
        moved = optax.projections.projection_box(optax.apply_updates(x, updates),
                                                 low, high)
        return jnp.where(more, moved, x), state, bad, value

    with jax.numpy_dtype_promotion("standard"):
        state0 = opt.init(init)
    starts = init.shape[0]
    xs, _, bad, losses = jax.lax.fori_loop(
        0, n_steps + 1, step, (init, state0, jnp.zeros((starts,), jnp.int32),
                               jnp.zeros((starts,), init.dtype)))
    if tie_kv:
        xs = xs.at[:, 3].set(xs[:, 0])
    losses = jnp.where(jnp.isfinite(losses), losses, jnp.inf)
    best = jnp.argmin(losses)
    return {"log_constants": xs[best], "loss": losses[best],
            "nonfinite_steps": bad[best]}


def fit(hw: HardwareParams, model: ModelParams, steps: Steps | None,
        runs: Runs | None, *, fit: tuple[str, ...] = CONSTANTS, n_steps: int = 1000,
        learning_rate: float = 0.05) -> FitResult:
    """The constants minimising ``loss``; those not in ``fit`` keep ``hw``'s
    (``kv_mbu`` follows ``mbu``).

    Args:
      hw, model: float32 parameter pytrees (scalar leaves) of the hardware and
        model measured.
      steps, runs: the measurements (at least one given).
      fit: names of the constants fitted.
    """
    own = np.log(np.maximum([float(getattr(hw, c)) for c in CONSTANTS], FLOORS))
    mask = tuple(c in fit for c in CONSTANTS)
    # the surrogate's gradient costs ~0.1 s a step on a small CPU: one start
    starts = STARTS if runs is None else STARTS[1:2]
    init = np.array([[math.log(v) if m else o for v, m, o in zip(start, mask, own)]
                     for start in starts], np.float32)
    out = exported.call(_fit, {"fit_mask": mask}, hw, model, steps, runs,
                        jnp.asarray(init), jnp.float32(learning_rate),
                        jnp.int32(n_steps))
    return FitResult(out["log_constants"], out["loss"], out["nonfinite_steps"])


def predict(hw, model, log_c, steps: Steps | None, runs: Runs | None) -> dict:
    """Predictions at the fitted constants: per-step seconds, which rows are
    memory- and compute-bound, and the runs' metrics."""
    return exported.call(_predict, {}, hw, model, log_c, steps, runs, np.int32(0))


def _predict(hw, model, log_c, steps: Steps | None, runs: Runs | None, index):
    # index: 0, which the program cannot know is never negative; under it
    # the surrogate's stages are computed once (``computed_once``), as in
    # the fit's loop (its compilation 11.8 s -> 7.3-8.1 s)
    h = with_constants(hw, log_c)
    out = {}
    if steps is not None:
        out["steps_s"] = step_seconds(h, model, steps.batch_size,
                                      steps.context_tokens, steps.prefill_tokens,
                                      steps.tensor_parallel)
        memory, compute = step_bounds(h, model, steps)
        out["memory_bound"] = memory >= compute
    if runs is not None:
        with computed_once(index):
            out["runs"] = run_metrics(h, model, runs)
    return out


# --- a whole sweep-calibrate job --------------------------------------------


class JobFit(NamedTuple):
    """What ``sweep-calibrate`` prints and writes."""

    constants: dict[str, float]
    rms_before: float  # root-mean-square relative error at the hardware's own
    rms_after: float  # ... and at the fitted constants
    points: int  # steps + run metrics fitted
    notes: list[str]
    steps: list[dict] | None  # one row per measured step
    runs: list[dict] | None  # one row per run and metric


def _scalars(tree):
    return jax.tree.map(lambda v: jnp.asarray(v, jnp.float32), tree)


def steps_input(tables) -> Steps:
    """Measured step tables, concatenated and padded to a power of two (at least 8)."""
    cols = {k: np.concatenate([getattr(t, k) for t in tables]) for k in (
        "batch_size", "context_tokens", "prefill_tokens", "tensor_parallel",
        "seconds")}
    n = len(cols["seconds"])
    pad = shapes.power_of_two(n, 8) - n
    # padding repeats the first row, weight 0 (a valid step: finite gradients)
    arrays = {k: np.concatenate([v, np.full(pad, v[0])]) for k, v in cols.items()}
    weight = np.concatenate([np.ones(n), np.zeros(pad)])
    return Steps(**{k: jnp.asarray(v, jnp.float32) for k, v in arrays.items()},
                 weight=jnp.asarray(weight, jnp.float32))


def runs_input(runs, max_num_seqs: int, token_budget: int, tp: int) -> Runs:
    """Serving runs as surrogate inputs, padded to a power of two."""
    from sweep.latency.surrogate import latency_workload

    n = len(runs)
    rows = list(runs) + [runs[0]] * (shapes.power_of_two(n) - n)
    wls = [latency_workload(None, pairs=r.pairs) for r in rows]
    f32 = partial(jnp.asarray, dtype=jnp.float32)
    return Runs(
        workload=jax.tree.map(lambda *x: jnp.stack(x), *wls),
        concurrency=f32([max_num_seqs] * len(rows)),
        token_budget=f32([token_budget] * len(rows)),
        tensor_parallel=f32([tp] * len(rows)),
        rate_per_s=f32([r.rate_per_s for r in rows]),
        measured=f32([[r.measured[k] for k in BENCH_METRICS] for r in rows]),
        weight=f32([1.0] * n + [0.0] * (len(rows) - n)))


def identified(job, names) -> tuple[tuple[str, ...], list[str]]:
    """The constants a job's data can tell apart, and notes on the others.

    A dense model reads the same weights in every step: with the KV cache's
    own ``kv_mbu`` fitted, the weights' time ``W / (bandwidth mbu)`` and
    ``step_overhead_s`` only show as their sum unless the steps come at two
    tensor-parallel sizes (or serving runs add their own evidence). The
    overhead then keeps the hardware's value, the weights' time goes to mbu.
    """
    names = tuple(names)
    tps = {float(x) for t in job.steps for x in np.unique(t.tensor_parallel)}
    dense = job.app.model.num_experts <= job.app.model.experts_per_token
    if (job.steps and not job.runs and dense and len(tps) == 1
            and {"mbu", "kv_mbu", "step_overhead_s"} <= set(names)):
        hw = job.app.hardware
        return tuple(n for n in names if n != "step_overhead_s"), [
            "step_overhead_s is not identified apart from mbu (a dense model's "
            "steps all read the same weights, at one tensor_parallel): kept at "
            f"hardware[{hw.name}].step_overhead_s = {hw.step_overhead_s:g}; "
            "steps at a second tensor_parallel tell them apart"]
    return names, []


def rounded(values: dict[str, float]) -> dict[str, float]:
    """Four significant digits; an overhead at its floor is none."""
    out = {}
    for (k, v), floor in zip(values.items(), FLOORS):
        out[k] = 0.0 if k.endswith("overhead_s") and v <= 2 * floor else float(
            f"{v:.4g}")
    return out


def log_constants(values: dict[str, float]) -> jax.Array:
    """``CONSTANTS`` as the fit's float32 log-space vector (floors applied)."""
    return jnp.log(jnp.asarray(np.maximum([values[c] for c in CONSTANTS], FLOORS),
                               jnp.float32))


def _rms(pred, measured) -> float:
    r = np.asarray(pred, np.float64) / np.asarray(measured, np.float64) - 1.0
    return float(np.sqrt(np.mean(r * r)))


def fit_job(job) -> JobFit:
    """Fits a checked ``sweep.cli.calibrate.CalibrateJob`` and tabulates it."""
    from sweep.config.convert import hardware_params, model_params

    app = job.app
    hw = _scalars(hardware_params(app.hardware, app.gpu_memory_utilization))
    model = _scalars(model_params(app.model))
    steps = steps_input(job.steps) if job.steps else None
    runs = (runs_input(job.runs, app.max_num_seqs, app.max_num_batched_tokens,
                       app.tensor_parallel) if job.runs else None)
    names, notes = identified(job, app.fit.fit)
    res = fit(hw, model, steps, runs, fit=names, n_steps=app.fit.steps,
              learning_rate=app.fit.learning_rate)
    bad = int(res.nonfinite_steps)
    if bad:
        notes.append(f"the fit's gradient was not finite at {bad} of {app.fit.steps} "
                     f"steps, which left the constants where they were: the fit "
                     f"is not to be trusted")
    own = log_constants({c: float(getattr(hw, c)) for c in CONSTANTS})
    before = predict(hw, model, own, steps, runs)
    after = predict(hw, model, res.log_constants, steps, runs)
    values = dict(zip(CONSTANTS, np.exp(np.asarray(res.log_constants, np.float64))))
    if steps is not None:
        n = int(steps.weight.sum())
        bound = np.asarray(after["memory_bound"])[:n]
        kv = bound & (np.asarray(steps.context_tokens)[:n] > 0)
        batches = len(np.unique(np.asarray(steps.batch_size)[:n]))
        for name, used, what in (
                ("mbu", bound.any(), "memory-bound step"),
                ("mfu", (~bound).any(), "compute-bound step"),
                ("kv_mbu", kv.any(), "memory-bound step reading a KV cache"),
                ("sequence_overhead_s", batches > 1, "second batch size")):
            if name in app.fit.fit and not used and runs is None:
                if name == "kv_mbu":
                    values[name], kept = values["mbu"], "it follows mbu"
                else:
                    values[name] = float(getattr(app.hardware, name))
                    kept = (f"kept at hardware[{app.hardware.name}].{name} = "
                            f"{values[name]:g}")
                notes.append(f"{name} is not identified (no {what} in the data): "
                             f"{kept}")
    values = rounded(values)
    # the rows at the constants written (rounded, kept where not identified)
    final = log_constants(values)
    after = predict(hw, model, final, steps, runs)
    measured, pb, pa = [], [], []
    step_rows = run_rows = None
    if steps is not None:
        n = int(steps.weight.sum())
        names = [Path(t.path).name for t in job.steps for _ in range(len(t))]
        s = {k: np.asarray(getattr(steps, k))[:n] for k in Steps._fields}
        b, a = np.asarray(before["steps_s"])[:n], np.asarray(after["steps_s"])[:n]
        mem = np.asarray(after["memory_bound"])[:n]
        step_rows = [{"file": names[i], **{k: float(s[k][i]) for k in (
            "batch_size", "context_tokens", "prefill_tokens", "tensor_parallel")},
            "measured_s": float(s["seconds"][i]), "bound_s": float(b[i]),
            "fitted_s": float(a[i]), "bound_by": "memory" if mem[i] else "compute"}
            for i in range(n)]
        measured += list(s["seconds"])
        pb += list(b)
        pa += list(a)
    if runs is not None:
        n = len(job.runs)
        b, a = np.asarray(before["runs"])[:n], np.asarray(after["runs"])[:n]
        run_rows = [{"file": Path(r.path).name, "metric": m,
                     "measured_s": r.measured[m], "bound_s": float(b[i, j]),
                     "fitted_s": float(a[i, j])}
                    for i, r in enumerate(job.runs)
                    for j, m in enumerate(BENCH_METRICS)]
        measured += [row["measured_s"] for row in run_rows]
        pb += [row["bound_s"] for row in run_rows]
        pa += [row["fitted_s"] for row in run_rows]
    return JobFit(values, _rms(pb, measured), _rms(pa, measured), len(measured),
                  notes, step_rows, run_rows)
