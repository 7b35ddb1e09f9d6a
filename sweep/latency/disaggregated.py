"""Disaggregated prefill/decode, simulated: two pools of the step simulator.

DistServe (Zhong et al. 2024, arXiv:2401.09670), Splitwise (Patel et al.
2024, arXiv:2311.18677) and vLLM's disaggregated prefilling run a request's
prefill on one instance and its decode on another, the prompt's KV sent
between them. Here, with ``sweep.latency.simulate``'s scheduler for every
instance (``tests/reference_scheduler.py``'s
``simulate_disaggregated_reference`` is the step-by-step reference):

* the prefill pool: ``p`` instances, the stream round-robin over them in
  arrival order, each simulating its requests with one output token: its
  queue and chunked prefill (prefill-only steps at the token budget) give
  the end of each prefill; with a trace's block hashes, each instance's
  prompts find their prefixes in its own LRU cache
  (``sweep.latency.prefix_cache.pool_table``);
* the KV transfer: ``P kv_bytes_per_token / (tp kv_link_bytes_per_s)``
  (``roofline.kv_transfer_s``; ``tp`` the smaller of the two pools' TP
  sizes, each GPU sending or receiving its shard over its own link) after
  the prefill, over two links: the
  prefill instance's and the decode instance's, each carrying one transfer
  at a time, first come first served in the order the prefills end (a
  transfer starts when both are free: ``_transfers``); the first token
  reaches the user when it has arrived, so TTFT = prefill pool TTFT + the
  wait for the links + transfer; with a layer-wise connector
  (``hw.kv_layerwise``) the transfer may start ``S (L - 1) / L`` before its
  prefill ends (``S`` the prompt's own prefill, alone on its instance) and
  ends at least ``T / L`` after it (``roofline.kv_transfer_overlap``);
* the decode pool: ``d`` instances, the requests round-robin over them in
  the order their prefills end (a router picks the decode instance when it
  hands the request on), each with its whole prompt
  in KV but the last token (``simulate_requests``' ``cached_tokens``: the
  instance computes that token, as vLLM's KV consumer does, a step that
  costs a decode) and ``output - 1`` tokens to make; its first token is the
  request's second, so the instance's wait for a slot is the request's
  first inter-token gap (added to the ITL histogram as a point).

Percentiles are over every request. A request of one output token never
reaches the decode pool. A preempted decode-pool request finds its
received KV again (as prefix caching's blocks), which is kinder than a real
KV consumer, which recomputes it; a request whose prompt does not fit a
decode instance's KV is admitted alone and flagged, as in one engine.
The prefill pool's tensor parallelism may differ from the decode pool's
(``prefill_tp``: a grid's ``prefill_tensor_parallel`` axis, or the TP
``sweep-optimize`` searches for it).

``pools`` gives the same deployment's figures from the surrogate
(``sweep.latency.surrogate``), one aggregated-engine surrogate per pool on
the pool's share of the rate (module ``pools``' docstring).
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sweep.cube import status as flags
from sweep.latency.arrivals import Requests
from sweep.latency.simulate import (
    SimOutcome,
    SimResult,
    itl_add_points,
    pool,
    prompt_hits,
    simulate_requests,
    summarize,
)
from sweep.latency.surrogate import (
    LatencyWorkload,
    Link,
    cached_workload,
    latency_workload,
    surrogate,
)
from sweep.latency.surrogate.lengths import pad_hit_rows
from sweep.latency.workload import WorkloadTables, context_limit
from sweep.model import roofline
from sweep.model.batching import CONTINUOUS
from sweep.model.params import REJECT, TRUNCATE


def _round_robin(times, members, instances, max_instances: int):
    """``(max_instances, R)`` bool: request ``i`` is instance ``r``'s, the
    ``members`` taken in the order of ``times`` and dealt round-robin over
    the first ``instances``."""
    order = jnp.argsort(jnp.where(members, times, jnp.inf), stable=True)
    rank = jnp.argsort(order).astype(jnp.int32)
    r = jnp.arange(max_instances, dtype=jnp.int32)[:, None]
    return members[None, :] & (rank[None, :] % instances == r) & (r < instances)


def _transfers(ready, transfer_s, lead_s, tail_s, to_decode, pre_rows, dec_rows):
    """When each request's KV has arrived, each instance's link carrying one
    transfer at a time, first come first served in the order the prefills
    end (a prefill instance's sending link, a decode instance's receiving
    link: a transfer waits for both): it starts at ``ready - lead_s`` or when
    both are free, whichever is later, and ends ``transfer_s`` later, and
    not before ``ready + tail_s`` (``roofline.kv_transfer_overlap``; sent
    after the prefill, ``lead_s`` 0 and ``tail_s = transfer_s``). Requests
    not in ``to_decode`` send no KV over a shared link (their first token is
    the last; as on free links)."""
    dt = ready.dtype
    order = jnp.argsort(jnp.where(to_decode, ready, jnp.inf), stable=True)
    sender = jnp.argmax(pre_rows, axis=0)
    receiver = jnp.argmax(dec_rows, axis=0)

    def one(links, i):
        send_free, recv_free = links

        def done_from(free):  # the transfer's end, its links free from ``free``
            return jnp.maximum(jnp.maximum(ready[i] - lead_s[i], free) + transfer_s[i],
                               ready[i] + tail_s[i])

        done = done_from(jnp.maximum(send_free[sender[i]], recv_free[receiver[i]]))
        alone = done_from(-jnp.inf)
        shared = to_decode[i]
        send_free = send_free.at[sender[i]].set(
            jnp.where(shared, done, send_free[sender[i]]))
        recv_free = recv_free.at[receiver[i]].set(
            jnp.where(shared, done, recv_free[receiver[i]]))
        return (send_free, recv_free), jnp.where(shared, done, alone)

    links = (jnp.full(pre_rows.shape[0], -jnp.inf, dt),
             jnp.full(dec_rows.shape[0], -jnp.inf, dt))
    _, done = jax.lax.scan(one, links, order)
    return jnp.zeros_like(ready).at[order].set(done)


def _pick(rows, x):
    """Each request's value from the one row (instance) that served it."""
    return jnp.where(rows, x, jnp.zeros((), x.dtype)).sum(0, dtype=x.dtype)


def simulate_disaggregated_requests(
        hw, model, tp, concurrency, token_budget, requests: Requests,
        prefill_instances, decode_instances, ttft_slo_s=jnp.inf, itl_slo_s=jnp.inf,
        overlong=REJECT, spec_tokens=0, spec_acceptance=0.0, prefix_hit_fraction=0.0,
        cached_tokens=0.0, prefill_tp=None, *, max_prefill_instances: int,
        max_decode_instances: int, max_slots: int, max_iterations: int | None = None,
        turns_per_check: int = 64) -> SimOutcome:
    """One disaggregated deployment over a stream, per request (module docstring).

    Args:
      hw, model, tp, concurrency, token_budget, requests, ttft_slo_s,
        itl_slo_s, overlong, spec_tokens, spec_acceptance,
        prefix_hit_fraction, cached_tokens: as ``simulate_requests``
        (continuous batching in both pools; ``max_num_seqs`` and
        ``max_num_batched_tokens`` the same on both; prefix caching on the
        prefill pool, speculation on the decode pool): ``cached_tokens`` per
        request, found in the cache of the prefill instance it is dealt to
        (``sweep.latency.prefix_cache.pool_table``).
        ``hw.kv_link_bytes_per_s`` is the transfer link; ``tp`` the decode
        pool's tensor parallelism.
      prefill_tp: the prefill pool's (None: ``tp``).
      prefill_instances, decode_instances: ``p`` and ``d`` (traced; clipped to
        ``[1, max_*_instances]``).
      max_prefill_instances, max_decode_instances: static sizes of the pools'
        ``vmap`` (instances beyond ``p`` and ``d`` serve nothing).
      max_slots, max_iterations, turns_per_check: each instance's, as
        ``simulate_requests``'.
    """
    dt = jnp.asarray(requests.arrival_s).dtype
    arrival = jnp.asarray(requests.arrival_s, dt)
    prompt, output, fits = context_limit(
        jnp.maximum(jnp.round(requests.prompt_tokens), 1).astype(dt),
        jnp.maximum(jnp.round(requests.output_tokens), 1).astype(dt),
        jnp.asarray(model.max_context_tokens, dt),
        jnp.asarray(overlong) == TRUNCATE, xp=jnp)
    p = jnp.clip(jnp.floor(jnp.asarray(prefill_instances, dt)), 1,
                 max_prefill_instances).astype(jnp.int32)
    d = jnp.clip(jnp.floor(jnp.asarray(decode_instances, dt)), 1,
                 max_decode_instances).astype(jnp.int32)
    kw = dict(max_slots=max_slots, max_iterations=max_iterations,
              turns_per_check=turns_per_check)
    tp = jnp.asarray(tp, dt)
    pre_tp = tp if prefill_tp is None else jnp.asarray(prefill_tp, dt)
    inf = jnp.asarray(jnp.inf, dt)

    pre_rows = _round_robin(arrival, fits, p, max_prefill_instances)
    prefill_stream = Requests(arrival, prompt, jnp.ones_like(output))
    pre = jax.vmap(lambda mine: simulate_requests(
        hw, model, pre_tp, concurrency, token_budget, prefill_stream, CONTINUOUS, inf,
        inf, REJECT, mine, 0, 0.0, prefix_hit_fraction, cached_tokens,
        **kw))(pre_rows)

    to_decode = fits & (output > 1)
    ready = arrival + _pick(pre_rows, pre.ttft_s)  # the prefill's end
    dec_rows = _round_robin(ready, to_decode, d, max_decode_instances)
    link = roofline.kv_transfer_s(hw, model, jnp.minimum(pre_tp, tp), prompt)
    # each prompt's own prefill, alone on its instance, as the layer-wise
    # overlap's span (the cached prefix as the prefill pool finds it)
    alone = roofline.chunked_prefill(
        hw, model, pre_tp, 0.0, 0.0, prompt, token_budget, 0.0,
        prompt_hits(prompt, prefix_hit_fraction, cached_tokens))[0]
    lead, tail = roofline.kv_transfer_overlap(hw, model, link, alone)
    sent = _transfers(ready, link, lead, tail, to_decode, pre_rows, dec_rows)
    ttft = sent - arrival
    decode_stream = Requests(jnp.where(to_decode, sent, 0.0), prompt,
                             jnp.maximum(output - 1.0, 1.0))
    # the decode instance's "TTFT" is the request's first inter-token gap:
    # held to the ITL SLO
    dec = jax.vmap(lambda mine: simulate_requests(
        hw, model, tp, concurrency, token_budget, decode_stream, CONTINUOUS,
        itl_slo_s, itl_slo_s, REJECT, mine, spec_tokens, spec_acceptance, 0.0,
        prompt - 1.0, **kw))(dec_rows)
    first_gap = _pick(dec_rows, dec.ttft_s)
    e2e = ttft + jnp.where(to_decode, _pick(dec_rows, dec.e2e_s), 0.0)
    good = fits & (ttft <= ttft_slo_s) & (~to_decode | _pick(dec_rows, dec.good))

    pre_all = pool(pre, jnp.arange(max_prefill_instances, dtype=jnp.int32) < p)
    dec_all = pool(dec, jnp.arange(max_decode_instances, dtype=jnp.int32) < d)
    hist, lo, hi = itl_add_points(dec_all.itl_hist, dec_all.itl_min_s,
                                  dec_all.itl_max_s, first_gap,
                                  jnp.where(to_decode, 1.0, 0.0))
    nan = jnp.asarray(jnp.nan, dt)
    return SimOutcome(
        ttft_s=jnp.where(fits, ttft, nan), e2e_s=jnp.where(fits, e2e, nan),
        good=good, itl_hist=hist, itl_min_s=lo, itl_max_s=hi,
        duration_s=jnp.maximum(pre_all.duration_s, dec_all.duration_s),
        preemptions=pre_all.preemptions + dec_all.preemptions,
        steps=pre_all.steps + dec_all.steps,
        iterations=jnp.maximum(pre_all.iterations, dec_all.iterations),
        status=pre_all.status | dec_all.status,
        served=fits, rejected=~fits, output_tokens=output,
        gaps=jnp.where(to_decode, _pick(dec_rows, dec.gaps) + 1.0, 0.0),
    )


def simulate_disaggregated(hw, model, tp, concurrency, token_budget,
                           requests: Requests, prefill_instances, decode_instances,
                           ttft_slo_s=jnp.inf, itl_slo_s=jnp.inf, overlong=REJECT,
                           spec_tokens=0, spec_acceptance=0.0,
                           prefix_hit_fraction=0.0, cached_tokens=0.0,
                           prefill_tp=None, **static) -> SimResult:
    """``summarize`` of ``simulate_disaggregated_requests`` (same arguments;
    the keyword-only ones static)."""
    return summarize(simulate_disaggregated_requests(
        hw, model, tp, concurrency, token_budget, requests, prefill_instances,
        decode_instances, ttft_slo_s, itl_slo_s, overlong, spec_tokens,
        spec_acceptance, prefix_hit_fraction, cached_tokens, prefill_tp, **static))


# --- the surrogate's two pools -------------------------------------------------


class SurrogateEngine(NamedTuple):
    """``surrogate``'s arguments after ``token_budget``: one engine's (an
    aggregated one, or a pool's instances)."""

    workload: LatencyWorkload
    tp: jax.Array
    arrival_rate_per_s: jax.Array
    ttft_slo_s: jax.Array
    itl_slo_s: jax.Array
    spec_tokens: jax.Array
    spec_acceptance: jax.Array
    prefix_hit_fraction: jax.Array
    link: Link
    split: jax.Array
    handover: jax.Array | None = None  # 1: a decode pool (``surrogate``'s)

    def evaluate(self, hw, model, concurrency, token_budget) -> dict:
        """``surrogate`` of this engine."""
        return surrogate(hw, model, self.workload, self.tp, concurrency, token_budget,
                         self.arrival_rate_per_s, self.ttft_slo_s, self.itl_slo_s,
                         self.spec_tokens, self.spec_acceptance,
                         self.prefix_hit_fraction, link=self.link, split=self.split,
                         handover=self.handover)


def surrogates(hw, model, concurrency, token_budget,
               engines: list[SurrogateEngine]) -> list[dict]:
    """``surrogate`` of each engine, batched into one ``vmap`` (one call each
    traced, and compiled, the surrogate once each): the pools, and with them
    the aggregated engine of a grid that lists both."""
    workloads = pad_hit_rows([e.workload for e in engines])
    engines = [e._replace(workload=w) for e, w in zip(engines, workloads)]
    out = jax.vmap(lambda e: e.evaluate(hw, model, concurrency, token_budget))(
        jax.tree.map(lambda *x: jnp.stack(jnp.broadcast_arrays(*x)), *engines))
    return [{k: v[i] for k, v in out.items()} for i in range(len(engines))]


def no_link(link: Link) -> Link:
    """A link that carries nothing: an engine's own first token."""
    return jax.tree.map(jnp.zeros_like, link)._replace(
        arrival_scv=jnp.ones_like(link.arrival_scv))


RECEIVED_FRACTION = 0.999
"""The share of a prompt a decode instance holds on arrival, as the
surrogate's prefix hit fraction: all of it but the last block's remainder
(``roofline.cached_prefix_tokens`` keeps whole 16-token blocks), which the
instance computes in place of the simulator's one last token."""


class PoolWorkloads(NamedTuple):
    """The surrogate's summaries of what each pool serves."""

    prefill: LatencyWorkload  # every prompt, one output token
    decode: LatencyWorkload  # every prompt in KV, output - 1 tokens to make


def pool_workloads(served: WorkloadTables, joint: bool,
                   arrival_s: np.ndarray | None = None,
                   trace_rows: bool = False, lru=None) -> PoolWorkloads:
    """``PoolWorkloads`` of the requests a model serves (``served_tables``);
    ``joint``: from the recorded (prompt, output) pairs. A request of one
    output token counts as a one-token decode (the simulator sends it no
    further): the decode pool's load errs high. ``arrival_s``: the recorded
    arrival times (``sweep.latency.surrogate.bursts``), or None (Poisson;
    ``trace_rows``: as ``latency_workload``'s). ``lru``: the prefill pool's
    LRU caches of the trace's block hashes, as ``latency_workload``'s (each
    instance's of its own prompts, ``prefix_cache.pool_table``), or None."""
    def summary(pool_output, lru=None):
        """The summary with each request's output ``pool_output(output)``."""
        pairs = (np.stack([served.pairs[:, 0], pool_output(served.pairs[:, 1])],
                          axis=1) if joint else None)
        return latency_workload(
            replace(served, output_values=pool_output(served.output_values)),
            pairs=pairs, arrival_s=arrival_s, trace_rows=trace_rows, lru=lru)

    return PoolWorkloads(summary(np.ones_like, lru),
                         summary(lambda o: np.maximum(o - 1.0, 1.0)))


def pools(hw, model, tp, concurrency, token_budget, wl: PoolWorkloads,
          mean_output_tokens, arrival_rate_per_s, prefill_instances,
          decode_instances, ttft_slo_s=jnp.inf, itl_slo_s=jnp.inf, spec_tokens=0.0,
          spec_acceptance=0.0, prefix_hit_fraction=0.0, prefill_tp=None) -> dict:
    """A disaggregated deployment's figures from the surrogate
    (``pool_engines``): the keys of ``surrogate``'s dict."""
    engines, deployment = pool_engines(
        hw, model, tp, token_budget, wl, mean_output_tokens, arrival_rate_per_s,
        prefill_instances, decode_instances, ttft_slo_s, itl_slo_s, spec_tokens,
        spec_acceptance, prefix_hit_fraction, prefill_tp)
    return deployment(*surrogates(hw, model, concurrency, token_budget, engines))


def pool_engines(hw, model, tp, token_budget, wl: PoolWorkloads, mean_output_tokens,
                 arrival_rate_per_s, prefill_instances, decode_instances,
                 ttft_slo_s=jnp.inf, itl_slo_s=jnp.inf, spec_tokens=0.0,
                 spec_acceptance=0.0, prefix_hit_fraction=0.0, prefill_tp=None):
    """A disaggregated deployment's pools as the surrogate's engines (``tp``
    the decode instances' tensor parallelism, ``prefill_tp`` the prefill
    instances', None: the same; a transfer crosses the smaller group's
    links), and the function that makes the deployment's figures of theirs.

    * the prefill pool: ``p`` engines each offered ``lam / p``, dealt
      round-robin as the simulator deals them (the surrogate's ``split``
      ``p``: Erlang-``p`` gaps, or on a trace's recorded arrivals its
      tables of ``p`` splits), every request one output
      token; its TTFT per prompt band, the wait for a link and that band's
      KV transfer (``roofline.kv_transfer_s``; with a layer-wise connector
      its part after the band's prefill alone,
      ``roofline.kv_transfer_exposed_s``) is the TTFT. The busier side's
      ``min(p, d)`` links each carry ``lam / min(p, d)`` of the transfers,
      dealt round-robin (Erlang-``min(p, d)`` gaps), one at a time, all of
      each: a GI/G/1 queue whose wait is added to the prefill's
      (``waiting.Link``);
    * the decode pool: ``d`` engines each offered ``lam / d`` (round-robin
      too), each prompt
      held in KV on arrival (``RECEIVED_FRACTION`` as a prefix hit) and
      ``output - 1`` tokens to make; its ITL is the deployment's. Each
      request's first gap there waits for the step in progress
      (``handover``: the surrogate's ITL law and its goodput hold it). The
      instance's own TTFT law is not held to the ITL SLO: it is that first
      gap again (held twice, the seed scenario's good share at a 7 ms ITL
      SLO on 2:2 read 0.21 against the reference's 0.48; once, 0.49:
      benchmarks/README.md, "The first gap held once"), so a wait for a
      slot before it is held to neither; links are not shared (no wait for
      a link).

    E2E percentiles add the pools' (an upper bound at p99), the achieved
    rate is the smaller pool's, and at most what the links carry
    (``lam E[T] / min(p, d)``, their load, is in the utilization, and
    ``SATURATED`` from 1), and goodput counts the requests that meet
    the TTFT SLO in the first pool and the ITL SLO in the second, taken as
    independent.

    Returns:
      The two pools' ``SurrogateEngine``s, and ``deployment(prefill,
      decode)``, the deployment's figures (the keys of ``surrogate``'s dict)
      from their surrogates' (``surrogates``).
    """
    p = jnp.maximum(jnp.floor(prefill_instances), 1.0)
    d = jnp.maximum(jnp.floor(decode_instances), 1.0)
    pre_tp = tp if prefill_tp is None else prefill_tp
    # the prefill pool's bands as its surrogate sees them (with prefix
    # caching, of the work left: ``cached_workload``), each band's whole
    # prompt sent; a layer-wise connector sends during the band's own
    # prefill (alone, its cached prefix found)
    work, cached = cached_workload(wl.prefill, prefix_hit_fraction,
                                   roofline.kv_capacity_tokens(hw, model, pre_tp))
    prompts = work.prompt_tokens + cached
    link_tp = jnp.minimum(pre_tp, tp)
    transfer = roofline.kv_transfer_s(hw, model, link_tp, prompts)
    # a link carries one transfer at a time, all of it whenever it starts:
    # the busier side's links (min(p, d) of them) carry every request
    links = jnp.minimum(p, d)
    link_load = arrival_rate_per_s * (work.band_probs @ transfer) / links
    alone = roofline.chunked_prefill(hw, model, pre_tp, 0.0, 0.0, prompts,
                                     token_budget, 0.0, cached)[0]
    link = Link(link_load, transfer,
                roofline.kv_transfer_s(hw, model, link_tp, work.prompt_spread_tokens),
                roofline.kv_transfer_exposed_s(hw, model, transfer, alone),
                1.0 / links)
    engines = [
        SurrogateEngine(wl.prefill, pre_tp, arrival_rate_per_s / p, ttft_slo_s,
                        jnp.inf, 0.0, 0.0, prefix_hit_fraction, link, p, 0.0),
        SurrogateEngine(wl.decode, tp, arrival_rate_per_s / d, jnp.inf, itl_slo_s,
                        spec_tokens, spec_acceptance, RECEIVED_FRACTION,
                        no_link(link), d, 1.0)]

    return engines, partial(_deployment, p=p, d=d, link_load=link_load,
                            mean_output_tokens=mean_output_tokens)


def _deployment(pre: dict, dec: dict, *, p, d, link_load, mean_output_tokens) -> dict:
    """The deployment's figures from its pools' surrogates (``pool_engines``)."""

    def share(r):  # of the requests offered to the pool
        return r["goodput_req_per_s"] / jnp.maximum(r["achieved_req_per_s"], 1e-30)

    rate = jnp.minimum(pre["achieved_req_per_s"] * p, dec["achieved_req_per_s"] * d)
    rate = rate * jnp.minimum(1.0, 1.0 / jnp.maximum(link_load, 1e-30))
    return {
        "ttft_p50_s": pre["ttft_p50_s"], "ttft_p99_s": pre["ttft_p99_s"],
        "itl_p50_s": dec["itl_p50_s"], "itl_p99_s": dec["itl_p99_s"],
        "e2e_p50_s": pre["ttft_p50_s"] + dec["e2e_p50_s"],
        "e2e_p99_s": pre["ttft_p99_s"] + dec["e2e_p99_s"],
        "output_tokens_per_s": rate * mean_output_tokens,
        "achieved_req_per_s": rate,
        "goodput_req_per_s": rate * share(pre) * share(dec),
        "utilization": jnp.maximum(jnp.maximum(pre["utilization"], dec["utilization"]),
                                   link_load),
        "slot_utilization": dec["slot_utilization"],
        "prefill_utilization": pre["prefill_utilization"],
        "mean_itl_s": dec["mean_itl_s"],
        "mean_running": p * pre["mean_running"] + d * dec["mean_running"],
        "status": (pre["status"] | dec["status"]
                   | jnp.where(link_load >= 1.0, flags.SATURATED, flags.OK)),
    }
