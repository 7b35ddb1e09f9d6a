"""The grid model without JAX: the baselines of ``grid_throughput.py``.

Re-implementations of exactly what the sweep's roofline part computes (the
roofline of ``sweep.model.roofline``, the cost rules of ``sweep.model.cost`` and the
metrics of ``sweep.model.point``), with the same formulas in the same order, over
the same blocks (``sweep.grid.evaluate.Blocking``) and from the same inputs (the
part's stacked axes and its static-utilisation table):

* ``evaluate_region_flat``: vectorized NumPy in float32 over the block's points
  as a flat list, every parameter gathered per point (``unravel_index`` +
  indexing), the way a vectorized NumPy port of a point loop is written;
* ``evaluate_region_broadcast``: the same NumPy formulas on per-axis arrays
  that broadcast, so each sub-expression is computed at the rank of the axes
  it depends on, as ``sweep.grid.evaluate``'s nested ``vmap`` does;
* ``evaluate_points_python``: a per-point loop of plain Python floats and the
  ``math`` module (float64, since Python floats are), which also tabulates the
  static utilisation itself and prefills the long prompt chunk by chunk.

``tests/test_numpy_baseline.py`` checks all three against the JAX cube, so the
speed comparison is between programs that produce the same numbers.
"""

from __future__ import annotations

import math

import jax
import numpy as np

from sweep.model.batching import CONTINUOUS, REQUEST, STATIC
from sweep.model.cost import HOURS_PER_MONTH, SECONDS_PER_DAY
from sweep.model.params import GridPoint
from sweep.model.roofline import ACTIVATION_BYTES, ALLREDUCES_PER_LAYER

F32 = np.float32


WORKLOAD_AXIS, CONCURRENCY_AXIS = 2, 4  # the axes of the static-utilisation table


def to_numpy(tree):
    """The same pytree with NumPy leaves (dtypes kept)."""
    return jax.tree.map(np.asarray, tree)


# --- roofline (sweep.model.roofline) ------------------------------------------------


def _kv_bytes_per_token(m):
    return 2.0 * m.layers * m.kv_heads * m.head_dim * m.kv_dtype_bytes


def _attention_flops_per_key(m):
    return 4.0 * m.layers * m.q_heads * m.head_dim


def _weight_bytes_read(m, new_tokens):
    f = m.experts_per_token_fraction
    routed = f < 1.0
    safe_f = np.where(routed, f, F32(0.5))
    touched = np.where(routed, -np.expm1(new_tokens * np.log1p(-safe_f)), F32(1.0))
    return (m.shared_params + m.expert_params * touched) * m.weight_dtype_bytes


def _allreduce_s(hw, m, tp, new_tokens):
    moved = 2.0 * (tp - 1.0) / tp * new_tokens * m.hidden_size * ACTIVATION_BYTES
    return ALLREDUCES_PER_LAYER * m.layers * moved / hw.interconnect_bytes_per_s


def _step_s(hw, m, tp, new_tokens, kv_read_tokens, attention_keys):
    bytes_moved = _weight_bytes_read(m, new_tokens) + kv_read_tokens * (
        _kv_bytes_per_token(m)
    )
    flops = (
        2.0 * m.active_params * new_tokens
        + _attention_flops_per_key(m) * attention_keys
    )
    memory_s = bytes_moved / tp / (hw.memory_bandwidth_bytes_per_s * hw.mbu)
    compute_s = flops / tp / (hw.peak_flops_per_s * hw.mfu)
    return (
        np.maximum(memory_s, compute_s)
        + _allreduce_s(hw, m, tp, new_tokens)
        + hw.step_overhead_s
    )


def _chunk_attention_keys(chunk_tokens, cached_tokens):
    return chunk_tokens * cached_tokens + chunk_tokens * (chunk_tokens + 1.0) / 2.0


def _mixed_step_s(hw, m, tp, decodes, decode_context_tokens, chunk_tokens,
                  chunk_cached_tokens):
    return _step_s(
        hw, m, tp,
        decodes + chunk_tokens,
        decode_context_tokens + chunk_cached_tokens,
        decode_context_tokens
        + _chunk_attention_keys(chunk_tokens, chunk_cached_tokens),
    )


def _sum_linear(lo, hi, a, s):
    n = hi - lo
    return n * a + s * n * (hi + lo - 1.0) / 2.0


def _cached_prefix(prompt_tokens, hit):
    """The prompt's tokens in the prefix cache: whole 16-token blocks."""
    return np.floor(hit * prompt_tokens / F32(16.0)) * F32(16.0)


def _chunked_prefill(hw, m, tp, decodes, context_tokens, prompt_tokens, token_budget,
                     spec, cached):
    b = token_budget
    left = prompt_tokens - cached
    full = np.floor(left / b)
    rest = left - full * b
    ctx = decodes * context_tokens
    kvb = _kv_bytes_per_token(m)
    # each decode verifies ``spec`` proposals: k + 1 tokens, token j over ctx + j keys
    verified = np.where(spec > 0, decodes * (spec + 1.0), decodes)
    dec_keys = np.where(spec > 0, (spec + 1.0) * ctx + decodes * (spec + 1.0) * spec
                        / 2.0, ctx)
    new = verified + b
    mem_bw = tp * hw.memory_bandwidth_bytes_per_s * hw.mbu
    flop_rate = tp * hw.peak_flops_per_s * hw.mfu
    fpk = _attention_flops_per_key(m)
    a_m = (_weight_bytes_read(m, new) + (ctx + cached) * kvb) / mem_bw
    s_m = b * kvb / mem_bw
    a_c = (2.0 * m.active_params * new
           + fpk * (dec_keys + b * cached + b * (b + 1.0) / 2.0)) / flop_rate
    s_c = fpk * b * b / flop_rate
    fixed = _allreduce_s(hw, m, tp, new) + hw.step_overhead_s
    d0, ds = a_m - a_c, s_m - s_c
    safe_ds = np.where(ds == 0.0, F32(1.0), ds)
    cross = -d0 / safe_ds
    suffix_start = np.clip(np.ceil(cross), F32(0.0), full)
    prefix_end = np.clip(np.floor(cross) + 1.0, F32(0.0), full)
    zero = np.zeros_like(full)
    mem_lo = np.where(ds > 0, suffix_start, zero)
    mem_hi = np.where(ds > 0, full, np.where(ds < 0, prefix_end, full))
    mem_hi = np.where((ds == 0.0) & (d0 < 0.0), zero, mem_hi)
    full_sum = (
        _sum_linear(mem_lo, mem_hi, a_m, s_m)
        + _sum_linear(zero, mem_lo, a_c, s_c)
        + _sum_linear(mem_hi, full, a_c, s_c)
        + full * fixed
    )
    last_full = np.maximum(a_m + s_m * (full - 1.0), a_c + s_c * (full - 1.0)) + fixed
    last_full = np.where(full > 0, last_full, zero)
    partial = _step_s(hw, m, tp, verified + rest, ctx + (cached + full * b),
                      dec_keys + _chunk_attention_keys(rest, cached + full * b))
    partial = np.where(rest > 0, partial, zero)
    steps = full + np.where(rest > 0, F32(1.0), F32(0.0))
    return full_sum + partial, steps, np.maximum(last_full, partial)


def _kv_capacity_tokens(hw, m, tp):
    usable = hw.memory_bytes * hw.gpu_memory_utilization * tp
    weights = (m.shared_params + m.expert_params) * m.weight_dtype_bytes
    return (usable - weights) / _kv_bytes_per_token(m)


# --- cost (sweep.model.cost) and one point (sweep.model.point) ----------------


def _cost_per_mtok_usd(usd_per_gpu_hour, gpus, tokens_per_s):
    return usd_per_gpu_hour * gpus / (tokens_per_s * 3600.0) * 1e6


def evaluate_point_numpy(hw, m, wl, pt: GridPoint, static_utilization) -> dict:
    """``sweep.model.point.evaluate_point`` on arrays of points (float32)."""
    tp = pt.tensor_parallel
    running = np.where(pt.batching == REQUEST, F32(1.0), pt.concurrency)
    cached = running * pt.context_tokens
    spec = pt.spec_tokens
    new = spec + 1.0
    step = _step_s(hw, m, tp, running * new, cached,
                   running * (new * pt.context_tokens + new * spec / 2.0))
    at_one = pt.spec_acceptance >= 1.0
    a = np.where(at_one, F32(0.5), pt.spec_acceptance)
    gained = np.where(spec > 0, np.where(at_one, new, (1.0 - a**new) / (1.0 - a)),
                      F32(1.0))
    utilization = np.where(pt.batching == STATIC, static_utilization, F32(1.0))
    output_rate = running * gained / step * utilization
    zero = np.zeros_like(step)
    hit = np.where(pt.prefix_caching > 0, wl.prefix_hit_fraction, F32(0.0))
    prompt_cached = _cached_prefix(wl.mean_prompt_tokens, hit)
    prefill = _mixed_step_s(hw, m, tp, zero, zero,
                            wl.mean_prompt_tokens - prompt_cached, prompt_cached)
    prefill_rate = wl.mean_prompt_tokens / prefill
    long_s, long_steps, long_worst = _chunked_prefill(
        hw, m, tp, running, pt.context_tokens, pt.long_prompt_tokens, pt.token_budget,
        spec, _cached_prefix(pt.long_prompt_tokens, hit))
    chunked = pt.batching == CONTINUOUS
    nan = F32(np.nan)
    capacity_per_day = output_rate * SECONDS_PER_DAY
    replicas = np.maximum(np.ceil(pt.traffic_tokens_per_day / capacity_per_day),
                          F32(1.0))
    capacity = _kv_capacity_tokens(hw, m, tp)
    fits = running * (pt.context_tokens + spec) <= capacity
    monthly_usd = replicas * hw.usd_per_gpu_hour * tp * HOURS_PER_MONTH
    monthly_tokens = pt.traffic_tokens_per_day * HOURS_PER_MONTH / 24.0
    metrics = {
        "step_s": step,
        "tokens_per_step": gained,
        "tpot_s": step / gained,
        "user_tokens_per_s": gained / step,
        "output_tokens_per_s": output_rate,
        "slot_utilization": utilization,
        "cost_per_mtok_out_usd": _cost_per_mtok_usd(hw.usd_per_gpu_hour, tp,
                                                    output_rate),
        "prefix_hit_fraction": prompt_cached / wl.mean_prompt_tokens,
        "prefill_tokens_per_s": prefill_rate,
        "cost_per_mtok_in_usd": _cost_per_mtok_usd(hw.usd_per_gpu_hour, tp,
                                                   prefill_rate),
        "long_prefill_s": np.where(chunked, long_s, nan),
        "long_prefill_steps": np.where(chunked, long_steps, nan),
        "long_prefill_worst_itl_s": np.where(chunked, long_worst, nan),
        "replicas": replicas,
        "effective_cost_per_mtok_out_usd": monthly_usd / monthly_tokens * 1e6,
    }
    metrics = {k: np.where(fits, v, nan) for k, v in metrics.items()}
    metrics["kv_fits"] = fits
    metrics["max_concurrency_fit"] = np.maximum(
        np.floor(capacity / (pt.context_tokens + spec)), F32(0.0)
    )
    return metrics


def _region_indices(starts, shape, chunks) -> list[np.ndarray]:
    """Each axis's indices in the block; past the cube's end, the last index."""
    return [np.minimum(s + np.arange(c), n - 1)
            for s, c, n in zip(starts, chunks, shape)]


def _point_args(axes, index):
    """``evaluate_point_numpy``'s parameters, axis ``d`` read by ``index(x, d)``."""
    take = lambda tree, d: jax.tree.map(lambda x: index(x, d), tree)  # noqa: E731
    # the point model reads only the mean prompt and hit fraction of a workload
    w = axes[WORKLOAD_AXIS]
    wl = w._replace(
        mean_prompt_tokens=index(w.mean_prompt_tokens, WORKLOAD_AXIS),
        prefix_hit_fraction=index(w.prefix_hit_fraction, WORKLOAD_AXIS))
    pt = GridPoint(*(index(axes[d], d) for d in range(3, len(axes))))
    return take(axes[0], 0), take(axes[1], 1), wl, pt


def evaluate_region_flat(axes: tuple, utilization: np.ndarray, starts, *,
                         shape: tuple[int, ...], chunks: tuple[int, ...]) -> dict:
    """The block's points as one flat list, every parameter gathered per point.

    Args:
      axes: ``to_numpy`` of the roofline part's axes (``sweep.model.point.DIMS`` order).
      utilization: the part's static-utilisation table, workload x concurrency.
      starts: the block's first index along each axis.

    Returns:
      A dict of arrays of shape ``chunks``.
    """
    idx = _region_indices(starts, shape, chunks)
    flat = np.unravel_index(np.arange(math.prod(chunks)), chunks)
    point = [i[f] for i, f in zip(idx, flat)]
    out = evaluate_point_numpy(
        *_point_args(axes, lambda x, d: x[point[d]]),
        utilization[point[WORKLOAD_AXIS], point[CONCURRENCY_AXIS]],
    )
    return {k: v.reshape(chunks) for k, v in out.items()}


def evaluate_region_broadcast(axes: tuple, utilization: np.ndarray, starts, *,
                              shape: tuple[int, ...], chunks: tuple[int, ...]
                              ) -> dict:
    """The same block by broadcasting: each axis's values vary along it only.

    Arguments as ``evaluate_region_flat``; the results are materialized at the
    block's shape, as the JAX path's are.
    """
    dims = len(shape)
    idx = _region_indices(starts, shape, chunks)

    def along(x, d):
        return x[idx[d]].reshape([-1 if i == d else 1 for i in range(dims)])

    table = utilization[np.ix_(idx[WORKLOAD_AXIS], idx[CONCURRENCY_AXIS])].reshape(
        [chunks[i] if i in (WORKLOAD_AXIS, CONCURRENCY_AXIS) else 1
         for i in range(dims)])
    out = evaluate_point_numpy(*_point_args(axes, along), table)
    return {k: np.ascontiguousarray(np.broadcast_to(v, chunks)) for k, v in out.items()}


# --- plain Python, one point at a time ----------------------------------------


def _py_step_s(hw, m, tp, new_tokens, kv_read_tokens, attention_keys):
    f = m["experts_per_token_fraction"]
    touched = -math.expm1(new_tokens * math.log1p(-f)) if f < 1.0 else 1.0
    weights = (m["shared_params"] + m["expert_params"] * touched) * m[
        "weight_dtype_bytes"]
    kvb = 2.0 * m["layers"] * m["kv_heads"] * m["head_dim"] * m["kv_dtype_bytes"]
    fpk = 4.0 * m["layers"] * m["q_heads"] * m["head_dim"]
    memory_s = (weights + kv_read_tokens * kvb) / tp / (
        hw["memory_bandwidth_bytes_per_s"] * hw["mbu"])
    compute_s = (2.0 * m["active_params"] * new_tokens + fpk * attention_keys) / tp / (
        hw["peak_flops_per_s"] * hw["mfu"])
    allreduce = (ALLREDUCES_PER_LAYER * m["layers"] * 2.0 * (tp - 1.0) / tp
                 * new_tokens * m["hidden_size"] * ACTIVATION_BYTES
                 / hw["interconnect_bytes_per_s"])
    return max(memory_s, compute_s) + allreduce + hw["step_overhead_s"]


def _py_chunked_prefill(hw, m, tp, decodes, context_tokens, prompt_tokens, budget,
                        spec=0, cached=0.0):
    """Chunk by chunk, as the SPEC describes it (no closed form), from the
    ``cached`` prefix on; each decode verifies ``spec`` proposals (k + 1
    tokens, token j over context + j keys)."""
    ctx = decodes * context_tokens
    dec_keys = decodes * sum(context_tokens + j for j in range(int(spec) + 1))
    total = worst = 0.0
    steps = 0
    done = cached
    while done < prompt_tokens:
        chunk = min(budget, prompt_tokens - done)
        keys = dec_keys + chunk * done + chunk * (chunk + 1.0) / 2.0
        s = _py_step_s(hw, m, tp, decodes * (spec + 1) + chunk, ctx + done, keys)
        total += s
        worst = max(worst, s)
        steps += 1
        done += chunk
    return total, float(steps), worst


def _py_point(hw, m, wl, pt, static_utilization):
    tp = pt["tensor_parallel"]
    running = 1.0 if pt["batching"] == REQUEST else pt["concurrency"]
    ctx = pt["context_tokens"]
    k, a = pt["spec_tokens"], pt["spec_acceptance"]
    kvb = 2.0 * m["layers"] * m["kv_heads"] * m["head_dim"] * m["kv_dtype_bytes"]
    weights = (m["shared_params"] + m["expert_params"]) * m["weight_dtype_bytes"]
    capacity = (hw["memory_bytes"] * hw["gpu_memory_utilization"] * tp - weights) / kvb
    out = {"kv_fits": running * (ctx + k) <= capacity,
           "max_concurrency_fit": max(float(math.floor(capacity / (ctx + k))), 0.0)}
    nan = math.nan
    if not out["kv_fits"]:
        return {**{k: nan for k in PY_METRICS}, **out}
    # k proposals verified per sequence: token j attends to ctx + j keys; the
    # accepted run is geometric, truncated at k (plus the target's own token)
    step = _py_step_s(hw, m, tp, running * (k + 1), running * ctx,
                      running * sum(ctx + j for j in range(int(k) + 1)))
    gained = sum(a**j for j in range(int(k) + 1))
    util = static_utilization if pt["batching"] == STATIC else 1.0
    rate = running * gained / step * util
    prompt = wl["mean_prompt_tokens"]
    hit = wl["prefix_hit_fraction"] if pt["prefix_caching"] > 0 else 0.0
    hit_tokens = math.floor(hit * prompt / 16.0) * 16.0  # whole 16-token blocks
    new = prompt - hit_tokens
    prefill_rate = prompt / _py_step_s(hw, m, tp, new, hit_tokens,
                                       new * hit_tokens + new * (new + 1.0) / 2.0)
    if pt["batching"] == CONTINUOUS:
        long_prompt = pt["long_prompt_tokens"]
        long = _py_chunked_prefill(hw, m, tp, running, ctx, long_prompt,
                                   pt["token_budget"], k,
                                   math.floor(hit * long_prompt / 16.0) * 16.0)
    else:
        long = (nan, nan, nan)
    price = hw["usd_per_gpu_hour"] * tp
    traffic = pt["traffic_tokens_per_day"]
    replicas = max(math.ceil(traffic / (rate * SECONDS_PER_DAY)), 1.0)
    return {
        "step_s": step,
        "tokens_per_step": gained,
        "tpot_s": step / gained,
        "user_tokens_per_s": gained / step,
        "output_tokens_per_s": rate,
        "slot_utilization": util,
        "cost_per_mtok_out_usd": price / (rate * 3600.0) * 1e6,
        "prefix_hit_fraction": hit_tokens / prompt,
        "prefill_tokens_per_s": prefill_rate,
        "cost_per_mtok_in_usd": price / (prefill_rate * 3600.0) * 1e6,
        "long_prefill_s": long[0],
        "long_prefill_steps": long[1],
        "long_prefill_worst_itl_s": long[2],
        "replicas": float(replicas),
        "effective_cost_per_mtok_out_usd": replicas * price * 24.0 / traffic * 1e6,
        **out,
    }


PY_METRICS = (
    "step_s", "tokens_per_step", "tpot_s", "user_tokens_per_s", "output_tokens_per_s",
    "slot_utilization",
    "cost_per_mtok_out_usd", "prefix_hit_fraction", "prefill_tokens_per_s",
    "cost_per_mtok_in_usd",
    "long_prefill_s", "long_prefill_steps", "long_prefill_worst_itl_s", "replicas",
    "effective_cost_per_mtok_out_usd",
)


def _py_static_utilization(values, probs, batch):
    total = sum(probs)
    mean = sum(v * p for v, p in zip(values, probs)) / total
    emax, cdf, below = 0.0, 0.0, 0.0
    for v, p in zip(values, probs):
        cdf = min(cdf + p / total, 1.0)
        emax += v * (cdf**batch - below**batch)
        below = cdf
    return mean / emax


def evaluate_points_python(axes: tuple, flat_indices, shape: tuple[int, ...]
                           ) -> list[dict]:
    """Metrics of the given flat (C-order) points of the cube, one at a time.

    Args:
      axes: ``to_numpy`` of the roofline part's axes.
      flat_indices: iterable of ints in ``[0, prod(shape))``.
    """
    leaves = lambda tree, i: {  # noqa: E731
        k: float(v[i]) if np.ndim(v) == 1 else np.asarray(v[i], float).tolist()
        for k, v in tree._asdict().items() if v is not None  # no draft model
    }
    hw_list = [leaves(axes[0], i) for i in range(shape[0])]
    model_list = [leaves(axes[1], i) for i in range(shape[1])]
    wl_list = [leaves(axes[2], i) for i in range(shape[2])]
    point_axes = [[float(x) for x in a] for a in axes[3:]]
    utilization = {}
    out = []
    for flat in flat_indices:
        idx, rest = [0] * len(shape), flat
        for d in reversed(range(len(shape))):
            rest, idx[d] = divmod(rest, shape[d])
        pt = {n: point_axes[k][idx[3 + k]] for k, n in enumerate(GridPoint._fields)}
        pt["batching"] = int(pt["batching"])
        wl = wl_list[idx[2]]
        key = (idx[2], idx[4])
        if key not in utilization:
            utilization[key] = _py_static_utilization(
                wl["output_values"], wl["output_probs"], pt["concurrency"])
        out.append(_py_point(hw_list[idx[0]], model_list[idx[1]], wl, pt,
                             utilization[key]))
    return out
