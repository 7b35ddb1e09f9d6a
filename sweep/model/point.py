"""Every grid-sweep metric of one grid point, from the roofline and cost rules.

One pure function of scalar pytrees; ``sweep.grid.evaluate`` vmaps it over the
cube's axes (``grid_point`` takes one keyword argument per axis). Points whose
KV cache does not fit keep ``kv_fits = False`` and ``max_concurrency_fit`` and
get NaN for every other metric (SPEC: infeasible is data, not an exception).
With ``grid.sensitivity=true`` each point also carries the elasticities of
its cost to the hardware and calibration constants (``cost_elasticities``),
by ``jax.jacfwd`` inside the same function: the grid's one ``jit`` compiles
them with the rest.
"""

from __future__ import annotations

import jax.numpy as jnp

from sweep.cube import contract
from sweep.model import batching, cost, precision, roofline, sensitivity
from sweep.model.params import GridPoint, WorkloadParams

DIMS = contract.dims(contract.ROOFLINE)
"""The roofline cube's axes, in order."""
COST = "cost_per_mtok_out_usd"


def _decode(hw, model, pt: GridPoint, static_utilization):
    """The decode step and what it yields: ``(running sequences, step_s,
    tokens gained per sequence, slot utilisation, replica output rate)``."""
    running = batching.running(pt.batching, pt.concurrency)
    # with speculation a step verifies k proposals per sequence and yields
    # ``gained`` tokens on average, delivered together: the gap between them
    # (the ITL) is the whole step, the per-user rate ``gained / step``
    step = roofline.speculative_step_s(hw, model, pt.tensor_parallel, running,
                                       pt.context_tokens, pt.spec_tokens)
    gained = roofline.tokens_per_step(pt.spec_tokens, pt.spec_acceptance)
    utilization = batching.slot_utilization(pt.batching, static_utilization)
    return running, step, gained, utilization, running * gained / step * utilization


def cost_elasticities(hw, model, pt: GridPoint, static_utilization) -> dict:
    """``d_cost_d_<p>``: the elasticities of ``cost_per_mtok_out_usd`` to
    each constant ``p`` of ``contract.SENSITIVITY``
    (``sweep.model.sensitivity``).

    Args:
      model: at the point's precision (``precision.apply``).
    """
    def figures(scaled):
        rate = _decode(scaled, model, pt, static_utilization)[-1]
        return {COST: cost.cost_per_mtok_usd(scaled.usd_per_gpu_hour,
                                             pt.tensor_parallel, rate)}

    return sensitivity.elasticities(figures, hw, (COST,))


def evaluate_point(hw, model, wl: WorkloadParams, pt: GridPoint, static_utilization,
                   sensitivity: bool = False):
    """Metrics of one point (a dict of scalars; names carry units).

    Args:
      static_utilization: ``E[out] / E[max of concurrency outputs]`` for this
        workload and concurrency, computed once per (workload, concurrency);
        the batching policy (``sweep.model.batching``) decides what it costs.
      sensitivity: also the cost elasticities (``cost_elasticities``).
    """
    model = precision.apply(model, pt.weight_dtype, pt.kv_dtype)
    tp = pt.tensor_parallel
    running, step, gained, utilization, output_rate = _decode(
        hw, model, pt, static_utilization)
    # with prefix caching each prompt's first h P tokens (whole blocks) are
    # read from the cache, not computed; input tokens count the cached ones
    hit = jnp.where(pt.prefix_caching > 0, wl.prefix_hit_fraction, 0.0)
    cached = roofline.cached_prefix_tokens(wl.mean_prompt_tokens, hit)
    prefill = roofline.prefill_step_s(hw, model, tp, wl.mean_prompt_tokens, cached)
    prefill_rate = wl.mean_prompt_tokens / prefill
    long_s, long_steps, long_worst = roofline.chunked_prefill(
        hw, model, tp, running, pt.context_tokens, pt.long_prompt_tokens,
        pt.token_budget, pt.spec_tokens,
        roofline.cached_prefix_tokens(pt.long_prompt_tokens, hit),
    )
    # chunked prefill only exists under continuous batching
    chunked = batching.is_continuous(pt.batching)
    replicas = cost.replicas_for_traffic(output_rate, pt.traffic_tokens_per_day)
    # the engine reserves KV slots for the k proposed tokens of each sequence
    held = pt.context_tokens + pt.spec_tokens
    fits = roofline.kv_fits(hw, model, tp, running, held)
    metrics = {
        "step_s": step,
        "tokens_per_step": gained,
        "tpot_s": step / gained,
        "user_tokens_per_s": gained / step,
        "output_tokens_per_s": output_rate,
        "slot_utilization": utilization,
        "cost_per_mtok_out_usd": cost.cost_per_mtok_usd(
            hw.usd_per_gpu_hour, tp, output_rate
        ),
        "prefix_hit_fraction": cached / wl.mean_prompt_tokens,
        "prefill_tokens_per_s": prefill_rate,
        "cost_per_mtok_in_usd": cost.cost_per_mtok_usd(
            hw.usd_per_gpu_hour, tp, prefill_rate
        ),
        "long_prefill_s": jnp.where(chunked, long_s, jnp.nan),
        "long_prefill_steps": jnp.where(chunked, long_steps, jnp.nan),
        "long_prefill_worst_itl_s": jnp.where(chunked, long_worst, jnp.nan),
        "replicas": replicas,
        "effective_cost_per_mtok_out_usd": cost.effective_cost_per_mtok_usd(
            hw.usd_per_gpu_hour, tp, replicas, pt.traffic_tokens_per_day
        ),
    }
    if sensitivity:
        metrics.update(cost_elasticities(hw, model, pt, static_utilization))
    metrics = {k: jnp.where(fits, v, jnp.nan) for k, v in metrics.items()}
    metrics["kv_fits"] = fits
    metrics["max_concurrency_fit"] = roofline.max_concurrency_fit(hw, model, tp, held)
    return metrics


def grid_point(*, hardware, model, workload: WorkloadParams, static_utilization,
               **settings):
    """``evaluate_point`` with one keyword argument per cube axis (``DIMS``):
    the serving settings are the ``GridPoint`` fields, by name."""
    return evaluate_point(hardware, model, workload, GridPoint(**settings),
                          static_utilization)


def grid_point_with_sensitivity(*, hardware, model, workload: WorkloadParams,
                                static_utilization, **settings):
    """``grid_point`` and the cost elasticities (``grid.sensitivity=true``)."""
    return evaluate_point(hardware, model, workload, GridPoint(**settings),
                          static_utilization, sensitivity=True)
