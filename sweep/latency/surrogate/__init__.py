"""Analytic surrogate of the serving simulator: smooth p50/p99 TTFT, ITL and E2E.

One grid point in, scalars out, differentiable in the concurrency, the token
budget and the arrival rate (the optax search descends it in log space). It
shares the roofline of ``sweep.model.roofline`` with the simulator and replaces the
simulation by the approximations of its sections, one module each; their
agreement with the simulator is measured in ``benchmarks/surrogate_agreement.py``
(``benchmarks/README.md``). Where an approximation cannot be exact it is
chosen to err high (a configuration the surrogate accepts should pass the
simulator).

The sections: ``lengths`` (the band summaries), ``bursts`` (the wait on a
trace's recorded arrivals), ``chunks`` (chunk steps along a prompt),
``state`` (the steady state), ``waiting`` (the admission and prefill
waits) and ``percentiles`` (TTFT, ITL, E2E and goodput); ``surrogate``
below composes them.

Not modelled: the correlation between consecutive steps' batch sizes; the
finite horizon of a simulation (past saturation a simulator's p99 TTFT grows
with the number of requests; here it is a large finite number, growing with
the overload up to ``rho = 10``); a preempted request's own recompute gap.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sweep.cube import status as flags
from sweep.latency.surrogate.bursts import (
    carries_trace,
    service_shape,
    split_workload,
    trace_wait_gaps_at,
)
from sweep.latency.surrogate.chunks import prefill_work
from sweep.latency.surrogate.lengths import (
    BAND_EDGES,
    LatencyWorkload,
    cached_workload,
    latency_workload,
    speculative_workload,
)
from sweep.latency.surrogate.percentiles import (
    LEVELS,
    e2e_quantiles,
    good_fraction,
    itl_law,
    ttft_law,
    ttft_quantiles,
    ttft_table,
)
from sweep.latency.surrogate.state import (
    slot_count,
    solve_decodes,
    steady_state,
    tagged_gap_s,
    throughput,
)
from sweep.latency.surrogate.waiting import Link, prefill_wait, slot_queue
from sweep.model import roofline
from sweep.model._numerics import materialize, quantile

__all__ = ["BAND_EDGES", "LatencyWorkload", "Link", "cached_workload",
           "latency_workload", "speculative_workload", "surrogate"]


def engine_state(hw, model, tp, wl, concurrency, token_budget, lam, spec_tokens,
                 cached_tokens):
    """One engine's steady state at an admitted rate: ``(slots, kv_mean_slots,
    n, state, d state / d n, queue)``, its slots (``state.slot_count``), the
    mean decodes (``state.solve_decodes``) with the state there and its slope
    in them, and the admission queue (``waiting.slot_queue``)."""
    mean_decodes = wl.mean_output_tokens - 1.0
    slots, kv_mean_slots = slot_count(hw, model, tp, wl, concurrency)

    def state_at(decodes, rate):
        return steady_state(hw, model, tp, wl, decodes, token_budget, rate,
                            spec_tokens, cached_tokens)

    n, st, d_st = solve_decodes(lambda d: state_at(d, lam), lam, mean_decodes, slots)
    queue = slot_queue(state_at, st, d_st, lam, mean_decodes, slots,
                       wl.band_probs)
    return slots, kv_mean_slots, n, st, d_st, queue


def surrogate(hw, model, wl: LatencyWorkload, tp, concurrency, token_budget,
              arrival_rate_per_s, ttft_slo_s=jnp.inf, itl_slo_s=jnp.inf,
              spec_tokens=0.0, spec_acceptance=0.0, prefix_hit_fraction=0.0,
              link=None, split=None, random_split=False, handover=None):
    """p50/p99 TTFT, ITL and E2E, throughput and goodput of one point.

    Args:
      hw, model: ``HardwareParams`` / ``ModelParams`` of the point.
      wl: the workload's ``LatencyWorkload``.
      tp: tensor-parallel GPUs.
      concurrency: most sequences running at once (real-valued: relaxed).
      token_budget: tokens per step (real-valued: relaxed).
      arrival_rate_per_s: arrival rate offered, requests per second: Poisson,
        or a trace's recorded arrivals at that mean rate where ``wl`` carries
        them (``bursts``).
      ttft_slo_s, itl_slo_s: the SLOs a good request meets (goodput only;
        default: none).
      spec_tokens, spec_acceptance: speculative decoding
        (``speculative_workload``; every decode step verifies ``k``
        proposals, ``roofline.verify_step_s``, after the draft model's ``k``
        steps when ``model`` carries one: ``roofline.with_proposer``); ITL is
        the gap between deliveries, as in the simulator. 0: off.
      prefix_hit_fraction: prefix caching (``cached_workload``): each
        prompt's prefill computes only what follows its cached prefix, as
        chunks that read the prefix. 0: off.
      link: a disaggregated prefill instance's KV link
        (``waiting.Link``; ``sweep.latency.disaggregated.pools``): each
        request's first token reaches the user when its KV has crossed it,
        the band's exposed transfer after the wait for the link (added to
        the wait before the prefill: ``waiting._wait_lattice``). None: no link.
      split, random_split: the engines the stream is dealt over, this one
        among them (real-valued; None, the default: the whole stream, not
        dealt, whose prefill wait is Pollaczek-Khinchine's), and whether
        each arrival goes to a random one (default: round-robin). Dealt
        round-robin, a Poisson stream reaches an engine with Erlang-``split``
        gaps (squared coefficient of variation ``1 / split``: ``waiting``'s
        prefill wait), dealt at random it stays Poisson; a trace's recorded
        arrivals are read from the tables of that split and routing
        (``bursts.split_workload``).
      handover: 1 for a disaggregated decode pool, whose requests arrive from
        a prefill instance and wait for the step in progress
        (``percentiles.itl_law``), 0 for any other engine batched with one;
        None (default): no such pool in the program.

    Returns:
      A dict of scalars: ``ttft_p50_s``, ``ttft_p99_s``, ``itl_p50_s``,
      ``itl_p99_s``, ``e2e_p50_s``, ``e2e_p99_s``, ``output_tokens_per_s``
      (achieved),
      ``achieved_req_per_s`` (the offered rate up to the capacity of the
      slots and of the prefill server), ``goodput_req_per_s`` (achieved
      requests meeting both SLOs), ``utilization`` (the larger of the slot
      and prefill-server utilisations; >= 1 is saturated),
      ``slot_utilization``, ``prefill_utilization``, ``mean_itl_s``,
      ``mean_running`` and ``status`` (int32 bit mask of ``sweep.cube.status``
      flags: ``SATURATED``, ``KV_INFEASIBLE``).
    """
    dtype = wl.band_probs.dtype
    tp, conc, budget, lam, ttft_slo_s, itl_slo_s, k, a, h = (
        jnp.asarray(x, dtype) for x in (tp, concurrency, token_budget,
                                        arrival_rate_per_s, ttft_slo_s, itl_slo_s,
                                        spec_tokens, spec_acceptance,
                                        prefix_hit_fraction))
    tokens_out = wl.mean_output_tokens
    dealt = split is not None
    split = jnp.asarray(1.0 if split is None else split, dtype)
    arrival_scv = jnp.where(random_split, 1.0, 1.0 / jnp.maximum(split, 1.0))
    wl = split_workload(wl, split, random_split)
    wl = speculative_workload(wl, k, roofline.tokens_per_step(k, a))
    # each stage's values computed once (``_numerics.materialize``)
    wl, cached = materialize(cached_workload(
        wl, h, roofline.kv_capacity_tokens(hw, model, tp)))
    w = wl.band_probs
    mean_decodes = wl.mean_output_tokens - 1.0
    slots, kv_mean_slots, n, st, d_st, queue = materialize(engine_state(
        hw, model, tp, wl, conc, budget, lam, k, cached))
    slot_util, utilization, rate = throughput(st, wl, lam, mean_decodes, slots)
    gap_s = tagged_gap_s(st, d_st, n, slots)
    _, per_token = jax.jvp(
        lambda p: prefill_work(hw, model, tp, wl, n, budget, p, k, cached).fluid_s,
        (wl.prompt_tokens,), (jnp.ones_like(wl.prompt_tokens),))
    per_token = jax.lax.stop_gradient(jnp.abs(per_token))
    trace_gaps = (trace_wait_gaps_at(wl.trace_wait_gaps, wl.trace_wait_rho,
                                     st.prefill_util, service_shape(st.service_s, wl))
                  if carries_trace(wl) else None)
    wait = prefill_wait(st, wl, slots, queue, gap_s, per_token, lam, trace_gaps,
                        arrival_scv if dealt else None, link)
    wait, gap_s, per_token, rate, slot_util, utilization = materialize(
        (wait, gap_s, per_token, rate, slot_util, utilization))
    engine_ttft_band, ttft_lo, ttft_hi = ttft_law(st, wait, wl, n, lam, per_token)
    delay = jnp.zeros_like(w) if link is None else link.exposed_s

    def ttft_band(t):  # as engine_ttft_band: t of shape (..., 1) -> (..., J)
        return engine_ttft_band(t - delay.reshape((1,) * (t.ndim - 1) + (-1,)))

    ttft_hi = ttft_hi + jnp.max(delay)
    table = ttft_table(ttft_band, ttft_lo, ttft_hi)
    ttft_p50, ttft_p99 = ttft_quantiles(ttft_band, table, w)

    itl_cdf, itl_sf, itl_lo, itl_hi, slow = itl_law(
        hw, model, tp, wl, st, d_st.pre, n, slots, k, cached, trace_gaps,
        None if handover is None else jnp.asarray(handover, dtype),
        1.0 / arrival_scv)
    itl_p50, itl_p99 = quantile(itl_cdf, LEVELS, itl_lo, itl_hi, sf=itl_sf)
    e2e_p50, e2e_p99 = e2e_quantiles(table, wl, gap_s)
    good = good_fraction(ttft_band, slow, wl, gap_s, lam, ttft_slo_s, itl_slo_s)

    status = (jnp.where(kv_mean_slots < 1.0, flags.KV_INFEASIBLE, flags.OK)
              | jnp.where(utilization >= 1.0, flags.SATURATED, flags.OK))
    return {
        "ttft_p50_s": ttft_p50,
        "ttft_p99_s": ttft_p99,
        "itl_p50_s": itl_p50,
        "itl_p99_s": itl_p99,
        "e2e_p50_s": e2e_p50,
        "e2e_p99_s": e2e_p99,
        "output_tokens_per_s": rate * tokens_out,
        "achieved_req_per_s": rate,
        "goodput_req_per_s": rate * good,
        "utilization": utilization,
        "slot_utilization": slot_util,
        "prefill_utilization": st.prefill_util,
        "mean_itl_s": gap_s,
        "mean_running": lam * st.residence_s,
        "status": status.astype(jnp.int32),
    }
