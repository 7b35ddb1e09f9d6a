"""Every grid-sweep metric of one grid point, from the roofline and cost rules.

One pure function of scalar pytrees; ``sweep.grid.evaluate`` vmaps it over the
cube's axes (``grid_point`` takes one keyword argument per axis). Points whose
KV cache does not fit keep ``kv_fits = False`` and ``max_concurrency_fit`` and
get NaN for every other metric (SPEC: infeasible is data, not an exception).
A disaggregated point (``disaggregated = 1``) is a deployment of ``p``
prefill-only instances of ``prefill_tensor_parallel`` GPUs (0: the point's
tensor parallelism) and ``d`` decode-only instances of the point's
(``disaggregated_figures``): its ITL is the decode-only step,
its rate the smaller of the two pools', its cost over both pools' GPUs.
With ``grid.sensitivity=true`` each point also carries the elasticities of
its cost to the hardware and calibration constants (``cost_elasticities``),
by ``jax.jacfwd`` inside the same function: the grid's one ``jit`` compiles
them with the rest.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
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


class Disaggregated(NamedTuple):
    """A disaggregated deployment's figures (``disaggregated_figures``)."""

    gpus: jax.Array
    kv_transfer_s: jax.Array  # the mean prompt's KV, prefill -> decode instance
    prefill_s: jax.Array  # the mean prompt alone, prefill-only chunks at the budget
    prefill_pool_req_per_s: jax.Array
    decode_pool_req_per_s: jax.Array
    output_tokens_per_s: jax.Array  # the deployment's: min of the pools' rates


def disaggregated_figures(hw, model, wl: WorkloadParams, pt: GridPoint,
                          decode_output_rate, cached) -> Disaggregated:
    """``p`` prefill instances of ``pt.prefill_tp`` GPUs and ``d`` decode
    instances of ``tp`` GPUs.

    A prefill instance runs prefill-only steps: the mean prompt's uncached
    tokens in chunks of the token budget with no decodes beside them, so it
    completes ``1 / prefill_s`` requests a second. A decode instance runs
    decode-only steps at the concurrency (``decode_output_rate`` tokens a
    second) and makes each request's ``mean_output - 1`` tokens after the
    first, which the prefill emits. The deployment serves the smaller of the
    two pools' request rates. A prompt's KV crosses the smaller group's
    links (each GPU moves its share over its own).

    Args:
      model: at the point's precision (``precision.apply``).
      decode_output_rate: one decode instance's output tokens per second.
      cached: the mean prompt's tokens in the prefix cache.
    """
    tp, pre_tp = pt.tensor_parallel, pt.prefill_tp
    prefill_s = roofline.chunked_prefill(hw, model, pre_tp, 0.0, 0.0,
                                         wl.mean_prompt_tokens, pt.token_budget, 0.0,
                                         cached)[0]
    prefill_rate = pt.prefill_instances / prefill_s
    after_first = wl.mean_output_tokens - 1.0
    decode_rate = jnp.where(
        after_first > 0,
        pt.decode_instances * decode_output_rate / jnp.maximum(after_first, 1.0),
        jnp.inf)
    requests_per_s = jnp.minimum(prefill_rate, decode_rate)
    return Disaggregated(
        gpus=pre_tp * pt.prefill_instances + tp * pt.decode_instances,
        kv_transfer_s=roofline.kv_transfer_s(hw, model, jnp.minimum(pre_tp, tp),
                                             wl.mean_prompt_tokens),
        prefill_s=prefill_s, prefill_pool_req_per_s=prefill_rate,
        decode_pool_req_per_s=decode_rate,
        output_tokens_per_s=requests_per_s * wl.mean_output_tokens)


def _hit(hw, model, wl: WorkloadParams, pt: GridPoint):
    """The share of each prompt in the prefix cache: the workload's hit
    fraction, or what an LRU cache of its trace's block hashes finds in this
    configuration's KV capacity (one engine's, or where the point is
    disaggregated, each prefill instance's of its own prompts); 0 with
    caching off."""
    split = jnp.asarray(pt.disaggregated) > 0
    instances = jnp.where(split, jnp.floor(pt.prefill_instances), 0.0)
    row = jnp.argmax(jnp.asarray(wl.lru_pools) == instances)
    lru = roofline.lru_hit_fraction(
        roofline.kv_capacity_tokens(hw, model, pt.prefill_tp),
        jnp.asarray(wl.lru_capacity_tokens)[row], jnp.asarray(wl.lru_share)[row])
    return jnp.where(pt.prefix_caching > 0,
                     jnp.maximum(wl.prefix_hit_fraction, lru), 0.0)


def _deployment(hw, model, wl, pt: GridPoint, static_utilization):
    """``(decode figures, disaggregated figures, deployment output rate, its
    GPUs)``: the aggregated engine's rate and ``tp`` GPUs, exactly, unless
    the point is disaggregated."""
    decode = _decode(hw, model, pt, static_utilization)
    cached = roofline.cached_prefix_tokens(wl.mean_prompt_tokens,
                                           _hit(hw, model, wl, pt))
    dis = disaggregated_figures(hw, model, wl, pt, decode[-1], cached)
    split = jnp.asarray(pt.disaggregated) > 0
    return (decode, dis, jnp.where(split, dis.output_tokens_per_s, decode[-1]),
            jnp.where(split, dis.gpus, pt.tensor_parallel))


def cost_elasticities(hw, model, wl, pt: GridPoint, static_utilization) -> dict:
    """``d_cost_d_<p>``: the elasticities of ``cost_per_mtok_out_usd`` to
    each constant ``p`` of ``contract.SENSITIVITY``
    (``sweep.model.sensitivity``).

    Args:
      model: at the point's precision (``precision.apply``).
    """
    def figures(scaled):
        *_, rate, gpus = _deployment(scaled, model, wl, pt, static_utilization)
        return {COST: cost.cost_per_mtok_usd(scaled.usd_per_gpu_hour, gpus, rate)}

    return sensitivity.elasticities(figures, hw, (COST,))


def evaluate_point(hw, model, wl: WorkloadParams, pt: GridPoint, static_utilization,
                   sensitivity: bool = False, disaggregation: bool = False):
    """Metrics of one point (a dict of scalars; names carry units).

    Args:
      static_utilization: ``E[out] / E[max of concurrency outputs]`` for this
        workload and concurrency, computed once per (workload, concurrency);
        the batching policy (``sweep.model.batching``) decides what it costs.
      sensitivity: also the cost elasticities (``cost_elasticities``).
      disaggregation: also the disaggregated deployment's own figures
        (``contract.DISAGGREGATION_OPTION``).
    """
    model = roofline.with_proposer(precision.apply(model, pt.weight_dtype, pt.kv_dtype),
                                   pt.spec_proposer, pt.spec_tokens)
    tp = pt.tensor_parallel
    decode, dis, output_rate, gpus = _deployment(hw, model, wl, pt, static_utilization)
    running, step, gained, utilization, _ = decode
    split = jnp.asarray(pt.disaggregated) > 0
    # with prefix caching each prompt's first h P tokens (whole blocks) are
    # read from the cache, not computed; input tokens count the cached ones
    hit = _hit(hw, model, wl, pt)
    cached = roofline.cached_prefix_tokens(wl.mean_prompt_tokens, hit)
    # the GPUs that prefill: a disaggregated point's prefill instance
    prefill = roofline.prefill_step_s(hw, model, pt.prefill_tp, wl.mean_prompt_tokens,
                                     cached, pt.spec_tokens)
    prefill_rate = wl.mean_prompt_tokens / prefill
    long_s, long_steps, long_worst = roofline.chunked_prefill(
        hw, model, tp, running, pt.context_tokens, pt.long_prompt_tokens,
        pt.token_budget, pt.spec_tokens,
        roofline.cached_prefix_tokens(pt.long_prompt_tokens, hit),
    )
    # disaggregated, the long prompt is prefilled on a prefill instance with
    # no decodes beside it: the decoding users' steps stay decode-only
    alone_s, alone_steps, _ = roofline.chunked_prefill(
        hw, model, pt.prefill_tp, 0.0, 0.0, pt.long_prompt_tokens, pt.token_budget, 0.0,
        roofline.cached_prefix_tokens(pt.long_prompt_tokens, hit))
    long_s = jnp.where(split, alone_s, long_s)
    long_steps = jnp.where(split, alone_steps, long_steps)
    long_worst = jnp.where(split, step, long_worst)
    # chunked prefill only exists under continuous batching
    chunked = batching.is_continuous(pt.batching)
    replicas = cost.replicas_for_traffic(output_rate, pt.traffic_tokens_per_day)
    # the engine reserves KV slots for the k proposed tokens of each sequence
    held = pt.context_tokens + pt.spec_tokens
    # disaggregated, a prefill instance also holds the mean prompt's KV
    fits = roofline.kv_fits(hw, model, tp, running, held) & (
        ~split | roofline.kv_fits(hw, model, pt.prefill_tp, 1.0, wl.mean_prompt_tokens))
    metrics = {
        "step_s": step,
        "tokens_per_step": gained,
        "tpot_s": step / gained,
        "user_tokens_per_s": gained / step,
        "output_tokens_per_s": output_rate,
        "slot_utilization": utilization,
        "cost_per_mtok_out_usd": cost.cost_per_mtok_usd(
            hw.usd_per_gpu_hour, gpus, output_rate
        ),
        "prefix_hit_fraction": cached / wl.mean_prompt_tokens,
        "prefill_tokens_per_s": prefill_rate,
        "cost_per_mtok_in_usd": cost.cost_per_mtok_usd(
            hw.usd_per_gpu_hour, pt.prefill_tp, prefill_rate
        ),
        "long_prefill_s": jnp.where(chunked, long_s, jnp.nan),
        "long_prefill_steps": jnp.where(chunked, long_steps, jnp.nan),
        "long_prefill_worst_itl_s": jnp.where(chunked, long_worst, jnp.nan),
        "replicas": replicas,
        "effective_cost_per_mtok_out_usd": cost.effective_cost_per_mtok_usd(
            hw.usd_per_gpu_hour, gpus, replicas, pt.traffic_tokens_per_day
        ),
    }
    if disaggregation:
        nan = jnp.nan
        metrics.update({
            "gpus": gpus,
            "kv_transfer_s": jnp.where(split, dis.kv_transfer_s, 0.0),
            "zero_load_ttft_s": dis.prefill_s + jnp.where(
                split, roofline.kv_transfer_exposed_s(hw, model, dis.kv_transfer_s,
                                                      dis.prefill_s), 0.0),
            "prefill_pool_req_per_s": jnp.where(split, dis.prefill_pool_req_per_s,
                                                nan),
            "decode_pool_req_per_s": jnp.where(split, dis.decode_pool_req_per_s, nan),
        })
    if sensitivity:
        metrics.update(cost_elasticities(hw, model, wl, pt, static_utilization))
    metrics = {k: jnp.where(fits, v, jnp.nan) for k, v in metrics.items()}
    metrics["kv_fits"] = fits
    metrics["max_concurrency_fit"] = roofline.max_concurrency_fit(hw, model, tp, held)
    return metrics


def _point_function(sensitivity: bool, disaggregation: bool):
    def grid_point(*, hardware, model, workload: WorkloadParams, static_utilization,
                   **settings):
        """``evaluate_point`` with one keyword argument per cube axis
        (``DIMS``): the serving settings are the ``GridPoint`` fields, by name."""
        return evaluate_point(hardware, model, workload, GridPoint(**settings),
                              static_utilization, sensitivity=sensitivity,
                              disaggregation=disaggregation)

    return grid_point


_POINT_FUNCTIONS = {(s, d): _point_function(s, d)
                    for s in (False, True) for d in (False, True)}


def point_function(options: frozenset[str]):
    """The roofline part's point function for a cube's optional variables
    (``contract.Metric.option``): the elasticities, the disaggregated
    deployment's figures. One function object per choice, so a compiled
    program is reused."""
    return _POINT_FUNCTIONS[(contract.SENSITIVITY_OPTION in options,
                             contract.DISAGGREGATION_OPTION in options)]


grid_point = point_function(frozenset())
"""``evaluate_point`` with one keyword argument per cube axis."""
