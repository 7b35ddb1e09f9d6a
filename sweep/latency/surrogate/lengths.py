"""The surrogate's length summaries: prompt and output lengths by probability band.

**Lengths** (``latency_workload``). Prompt and output lengths are summarised
by the conditional means of fixed probability bands (``BAND_EDGES``, finer in
the upper tail so that p99 is resolved), computed once per workload in NumPy,
with the joint probability of (prompt band, output band): the product of the
marginals, or, when a trace's recorded (prompt, output) pairs are given, their
empirical joint; the decode-context moments follow the same law.

Under speculative decoding (``speculative_workload``) an output is fewer
deliveries; under prefix caching (``cached_workload``) a prompt's prefill
computes only what follows its cached prefix.
"""

from __future__ import annotations

from statistics import NormalDist
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sweep.latency.prefix_cache import cached_tokens
from sweep.latency.surrogate.bands import band_stats, membership
from sweep.latency.surrogate.bursts import (
    no_trace,
    sampled_prompts,
    trace_tables,
)
from sweep.latency.workload import WorkloadTables
from sweep.model import roofline

BAND_EDGES = np.array([0.0, 0.05, 0.15, 0.25, 0.35, 0.45, 0.55, 0.65, 0.75, 0.85,
                       0.9, 0.95, 0.97, 0.98, 0.99, 0.995, 0.998, 1.0])
"""Probability bands of the length summaries: finer where p99 lives."""

Z_EDGES = np.array([NormalDist().inv_cdf(min(max(u, 1e-4), 1 - 1e-4))
                     for u in BAND_EDGES])
Z_MID = np.array([NormalDist().inv_cdf(0.5 * (a + b))
                   for a, b in zip(BAND_EDGES[:-1], BAND_EDGES[1:])])


class LatencyWorkload(NamedTuple):
    """Length statistics the surrogate needs (built by ``latency_workload``)."""

    band_probs: jax.Array  # shape=(J,), probability of each band
    prompt_tokens: jax.Array  # shape=(J,), mean prompt length in each band
    prompt_spread_tokens: jax.Array  # shape=(J,), std of the prompt within it
    output_tokens: jax.Array  # shape=(J,), mean output length in each band
    joint_probs: jax.Array  # shape=(J, J), P(prompt band, output band)
    mean_prompt_tokens: jax.Array
    mean_prompt_sq_tokens: jax.Array  # E[P^2], tokens^2
    mean_output_tokens: jax.Array
    output_cv2: jax.Array  # Var(O) / E[O]^2
    decode_context_tokens: jax.Array  # mean context over all decode steps
    decode_context_cv: jax.Array  # its coefficient of variation
    slot_kv_tokens: jax.Array  # mean KV tokens a running request holds
    slot_kv_cv: jax.Array  # their coefficient of variation (time-weighted)
    # shape=(len(ROUTINGS), len(SPLIT_GRID), len(SHAPE_GRID), RHO_POINTS,
    # len(WAIT_EDGES) - 1): the FCFS wait on a trace's recorded arrivals, in
    # mean gaps, per routing, split and service shape (``bursts.trace_waits``);
    # no rows when Poisson (zero rows beside traced workloads: ``no_trace``);
    # one split's ``(len(SHAPE_GRID), RHO_POINTS, ...)`` inside the
    # surrogate (``split_workload``)
    trace_wait_gaps: jax.Array
    # shape=(RHO_POINTS,): the utilisations of its rows (``bursts.rho_grid``)
    trace_wait_rho: jax.Array
    # shape=(len(ROUTINGS), len(SPLIT_GRID), len(WINDOW_GRID), ...): earlier
    # arrivals within a window before each (``bursts.trace_counts``); as above
    trace_counts: jax.Array
    # shape as ``trace_counts``: the others decoding beside each arrival
    # (``bursts.trace_overlaps``)
    trace_overlaps: jax.Array
    trace_arrivals: jax.Array  # 1.0 when arrivals replay a trace's, else 0.0
    # prefix hits that differ between requests, by capacity row m (the rows
    # of ascending ``hit_capacity_tokens``, the first -inf, apply from their
    # KV capacity on): a distribution of shares (``WorkloadTables.hit_levels``;
    # one row) or an LRU cache of a trace's block hashes (a row per capacity
    # on its hit curve, ``lru_bands``). Each row: the prefill work ``P - c``
    # of every request by probability band, its spread, the band's mean
    # cached prefix ``c``, the joint of work and output bands, E[P - c] and
    # E[(P - c)^2] (``work_bands``). Without either: one row of the prompts'
    # own bands and no cache (unused: ``hit_distribution`` 0)
    hit_capacity_tokens: jax.Array  # shape=(M,)
    hit_work_tokens: jax.Array  # shape=(M, J)
    hit_work_spread_tokens: jax.Array  # shape=(M, J)
    hit_cached_tokens: jax.Array  # shape=(M, J)
    hit_joint_probs: jax.Array  # shape=(M, J, J)
    hit_mean_work_tokens: jax.Array  # shape=(M,)
    hit_mean_work_sq_tokens: jax.Array  # shape=(M,)
    hit_distribution: jax.Array  # 1.0 with hits that differ, else 0.0


def _table(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sorted distinct values of samples, their frequencies, each sample's index."""
    v, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    return v, counts / counts.sum(), inverse


def _sums(d: np.ndarray) -> dict[str, np.ndarray]:
    """``D`` decode steps and the power sums of their index ``g = 1 .. D``."""
    return {"D": d, "G1": d * (d + 1) / 2, "G2": d * (d + 1) * (2 * d + 1) / 6}


def _context_moments(e: dict[str, float]) -> tuple[float, ...]:
    """Mean and cv of the decode context and of a running request's KV.

    Decode step ``g = 1 .. D`` of a request runs at context ``P + g``; its
    slot holds ``P + g`` KV tokens for one step each, ``g = 0 .. D``.

    Args:
      e: expectations over requests of ``D``, ``G1``, ``G2``, ``P``, ``P2``
        (``P^2``) and of the products ``PD``, ``PG1``, ``P2D``.

    Returns:
      ``(context, context_cv, slot_kv, slot_kv_cv)``.
    """
    def cv(m1, m2):
        return float(np.sqrt(max(m2 - m1 * m1, 0.0)) / m1)

    if e["D"] > 0:
        ctx = (e["PD"] + e["G1"]) / e["D"]
        ctx2 = (e["P2D"] + 2 * e["PG1"] + e["G2"]) / e["D"]
    else:  # single-token outputs: no decode step
        ctx, ctx2 = e["P"], e["P2"]
    steps = e["D"] + 1.0
    kv = (e["PD"] + e["P"] + e["G1"]) / steps
    kv2 = (e["P2D"] + e["P2"] + 2 * e["PG1"] + e["G2"]) / steps
    return ctx, cv(ctx, ctx2), kv, cv(kv, kv2)


def latency_workload(tables: WorkloadTables | None, dtype=jnp.float32,
                     pairs: np.ndarray | None = None,
                     arrival_s: np.ndarray | None = None,
                     trace_rows: bool = False, lru=None) -> LatencyWorkload:
    """Summarises a workload's lengths once, in float64 NumPy.

    Args:
      tables: the marginal length tables (used when ``pairs`` is None: prompt
        and output independent), and a distribution of prefix hits; may be
        None with ``pairs``.
      dtype: of the summaries.
      pairs: optional ``(N, 2)`` recorded (prompt, output) pairs of a trace;
        when given, every summary comes from them, with the empirical joint
        of prompt and output bands instead of independence.
      arrival_s: optional recorded arrival times (``workload.arrival=trace``):
        one per pair when ``pairs`` is given, the prompts then arriving in
        recorded order; otherwise prompts drawn from ``tables`` arrive at them
        (``bursts``).
      trace_rows: without ``arrival_s``, give the (zero) trace tables their
        rows all the same, to be stacked with traced workloads
        (``bursts.no_trace``).
      lru: ``lru_bands``' arguments: the prefill work through an LRU cache of
        the trace's block hashes, by capacity; None: none (or the tables'
        distribution of shares).
    """
    if arrival_s is None:
        traced, trace = no_trace(dtype, trace_rows), 0.0
    else:
        if pairs is None:
            prompts = sampled_prompts(tables.prompt_values, tables.prompt_probs,
                                      len(arrival_s))
        else:
            served = (pairs[:, 0] >= 1) & (pairs[:, 1] >= 1)
            arrival_s = np.asarray(arrival_s)[served]
            prompts = np.asarray(pairs, np.float64)[served, 0]
        traced, trace = trace_tables(arrival_s, prompts), 1.0
    if pairs is None:
        pv, pp = tables.prompt_values, tables.prompt_probs
        ov, op = tables.output_values, tables.output_probs
        mp, mo = membership(pp, BAND_EDGES), membership(op, BAND_EDGES)
        joint = np.outer(mp.sum(axis=0), mo.sum(axis=0))
        e = {k: op @ v for k, v in _sums(np.maximum(ov - 1.0, 0.0)).items()}
        e["P"], e["P2"] = pv @ pp, pv**2 @ pp
        e["PD"], e["PG1"] = e["P"] * e["D"], e["P"] * e["G1"]
        e["P2D"] = e["P2"] * e["D"]
    else:
        pairs = np.asarray(pairs, np.float64)
        pairs = pairs[(pairs[:, 0] >= 1) & (pairs[:, 1] >= 1)]
        pv, pp, ip = _table(pairs[:, 0])
        ov, op, io = _table(pairs[:, 1])
        mp, mo = membership(pp, BAND_EDGES), membership(op, BAND_EDGES)
        # each pair carries its values' band memberships (a value spanning
        # several bands splits its mass)
        joint = (mp[ip] / pp[ip, None]).T @ (mo[io] / op[io, None]) / len(pairs)
        p = pairs[:, 0]
        sums = _sums(pairs[:, 1] - 1.0)
        e = {k: v.mean() for k, v in sums.items()}
        e.update(P=p.mean(), P2=(p * p).mean(), PD=(p * sums["D"]).mean(),
                 PG1=(p * sums["G1"]).mean(), P2D=(p * p * sums["D"]).mean())
    ctx, ctx_cv, kv, kv_cv = _context_moments(e)
    p_mean, p_std = band_stats(pv, mp)
    o_mean, _ = band_stats(ov, mo)
    ep, ep2, eo = pv @ pp, pv**2 @ pp, ov @ op
    if lru is not None:
        hits = (*lru_bands(*lru), 1.0)
    elif tables is None or tables.hit_levels is None:
        hits = (*_rows([-np.inf], p_mean, p_std, np.zeros_like(p_mean), joint, ep,
                       ep2), 0.0)
    else:
        rows = (pairs[:, 0], np.full(len(pairs), 1.0 / len(pairs)),
                mo[io] / op[io, None]) if pairs is not None else (
            pv, pp, np.broadcast_to(mo.sum(axis=0), (len(pv), mo.shape[1])))
        hits = (*_rows([-np.inf], *hit_bands(*rows, tables.hit_levels,
                                             tables.hit_probs)), 1.0)
    return LatencyWorkload(
        *(jnp.asarray(x, dtype) for x in (
            np.diff(BAND_EDGES), p_mean, p_std, o_mean, joint, ep, ep2, eo,
            (ov**2 @ op - eo**2) / eo**2, ctx, ctx_cv, kv, kv_cv, *traced, trace,
            *hits))
    )


def _rows(capacity, *parts) -> tuple[np.ndarray, ...]:
    """One capacity row of ``work_bands``' results (their leading axis)."""
    return (np.asarray(capacity, np.float64), *(np.asarray(x)[None] for x in parts))


def work_bands(prompts: np.ndarray, cached: np.ndarray, mass: np.ndarray,
               output_bands: np.ndarray, group: np.ndarray) -> tuple[np.ndarray, ...]:
    """The prefill work ``P - c`` of rows of requests, by probability band,
    in float64: the rows sorted by work fall into the bands.

    A band's spread is that of the work within each ``group`` (a share, or
    cached or not), pooled: a band that straddles the gap between two
    groups' works (all 1,500-token prompts at shares 0 and 0.9: works of
    1,500 and 156) keeps its mean, without a kernel that reaches past the
    larger (a p99 TTFT at zero load 12 % above the whole prompt's prefill).

    Args:
      prompts, cached, mass: each row's prompt, cached prefix (``c < P``)
        and probability.
      output_bands: ``(rows, J)``, each row's output-band law (the output
        table's band masses under independence, its pair's output band for
        a trace's pairs).
      group: each row's group (integers).

    Returns:
      ``(work, work spread, cached, joint of work and output bands, E[work],
      E[work^2])``, per band where they are per band.
    """
    work = prompts - cached
    order = np.argsort(work, kind="stable")
    member = membership(mass[order], BAND_EDGES)
    w_mean, _ = band_stats(work[order], member)
    c_mean, _ = band_stats(cached[order], member)
    pooled = np.zeros_like(w_mean)
    for k in np.unique(group):
        part = member * (group[order] == k)[:, None]
        share = part.sum(axis=0)
        _, std = band_stats(work[order], np.where(share > 0, part, member))
        pooled += np.where(share > 0, share * std**2, 0.0)
    w_std = np.sqrt(pooled / member.sum(axis=0))
    joint = member.T @ output_bands[order]
    return (w_mean, w_std, c_mean, joint / joint.sum(), work @ mass,
            work**2 @ mass)


def hit_rows(prompts: np.ndarray, probs: np.ndarray, levels: np.ndarray,
             level_probs: np.ndarray) -> tuple[np.ndarray, ...]:
    """Prompts whose cached share is drawn from a distribution, every
    (prompt, level) a row, prompt by prompt: ``(prompt, cached prefix
    (roofline.cached_prefix_tokens: whole blocks), probability probs x
    level_probs, level index)``.

    Args:
      prompts, probs: the prompts (a table's values or a trace's pairs) and
        their probabilities.
      levels, level_probs: the shares and their probabilities.
    """
    cached = roofline.cached_prefix_tokens(prompts[:, None], levels[None, :], xp=np)
    return (np.repeat(prompts, len(levels)), cached.ravel(),
            (probs[:, None] * level_probs[None, :]).ravel(),
            np.tile(np.arange(len(levels)), len(prompts)))


def hit_bands(prompts: np.ndarray, probs: np.ndarray, output_bands: np.ndarray,
              levels: np.ndarray, level_probs: np.ndarray) -> tuple[np.ndarray, ...]:
    """``work_bands`` of ``hit_rows``, grouped by level (``output_bands``:
    ``(len(prompts), J)``, as ``work_bands``')."""
    rows, cached, mass, level = hit_rows(prompts, probs, levels, level_probs)
    return work_bands(rows, cached, mass, np.repeat(output_bands, len(levels), axis=0),
                      level)


HIT_ROWS = 32
"""Most capacity rows of an LRU cache's bands (``lru_bands``)."""
HIT_ROW_FIELDS = ("hit_capacity_tokens", "hit_work_tokens", "hit_work_spread_tokens",
                  "hit_cached_tokens", "hit_joint_probs", "hit_mean_work_tokens",
                  "hit_mean_work_sq_tokens")
"""``LatencyWorkload``'s fields with a leading capacity-row axis."""


def lru_bands(table, curve, prompts: np.ndarray, outputs: np.ndarray,
              served: np.ndarray) -> tuple[np.ndarray, ...]:
    """``work_bands`` of a stream through an LRU cache of its block hashes
    (``sweep.latency.prefix_cache``), at up to ``HIT_ROWS`` capacities of its
    hit curve, evenly spaced along it (the first, -inf: no hit): a capacity
    between two rows reads the smaller's, a few hits short.

    Args:
      table, curve: the stream's ``CacheTable`` and ``hit_curve``.
      prompts, outputs, served: the stream's requests as the model serves
        them (``prefix_cache.stream_requests``).

    Returns:
      ``(capacities, *work_bands)``, each with a leading row axis.
    """
    capacity = curve[0]
    at = np.unique(np.round(np.linspace(0, len(capacity) - 1,
                                        min(HIT_ROWS, len(capacity)))).astype(int))
    p, o = prompts[served], outputs[served]
    ov, op, io = _table(o)
    mo = membership(op, BAND_EDGES)
    out_bands = mo[io] / op[io, None]
    mass = np.full(len(p), 1.0 / len(p))
    rows = []
    for c in capacity[at]:
        cached = cached_tokens(table, c, xp=np)[served]
        rows.append(work_bands(p, cached, mass, out_bands, (cached > 0).astype(int)))
    return (capacity[at], *(np.stack(x) for x in zip(*rows)))


def pad_hit_rows(workloads: list[LatencyWorkload]) -> list[LatencyWorkload]:
    """The workloads with as many capacity rows each (to be stacked): the
    last row repeated at capacity inf, never read."""
    rows = max(len(w.hit_capacity_tokens) for w in workloads)

    def pad(w: LatencyWorkload) -> LatencyWorkload:
        extra = rows - len(w.hit_capacity_tokens)
        if not extra:
            return w
        fields = {f: jnp.concatenate([getattr(w, f), jnp.repeat(getattr(w, f)[-1:],
                                                               extra, axis=0)])
                  for f in HIT_ROW_FIELDS}
        fields["hit_capacity_tokens"] = fields["hit_capacity_tokens"].at[-extra:].set(
            jnp.inf)
        return w._replace(**fields)

    return [pad(w) for w in workloads]


def speculative_workload(wl: LatencyWorkload, spec_tokens, gain) -> LatencyWorkload:
    """The workload as the scheduler sees it under speculative decoding: an
    output of ``O`` tokens is ``1 + (O - 1) / gain`` deliveries (a decode
    step gains ``gain`` tokens, ``roofline.tokens_per_step``; the mean
    rather than the simulator's ceiling, smooth), and a running request
    holds ``spec_tokens`` more KV slots. Decode contexts, in tokens, keep
    their law. Unchanged at ``k = 0``."""
    spec = spec_tokens > 0

    def deliveries(o):
        return jnp.where(spec, 1.0 + (o - 1.0) / gain, o)

    kv = wl.slot_kv_tokens + jnp.where(spec, spec_tokens, 0.0)
    return wl._replace(
        output_tokens=deliveries(wl.output_tokens),
        mean_output_tokens=deliveries(wl.mean_output_tokens),
        slot_kv_tokens=kv,
        slot_kv_cv=jnp.where(spec, wl.slot_kv_cv * wl.slot_kv_tokens / kv,
                             wl.slot_kv_cv))


def cached_workload(wl: LatencyWorkload, hit_fraction, capacity_tokens=jnp.inf):
    """The workload's prefill work with prefix caching at hit fraction ``h``
    (the mean share, where the shares differ between requests).

    One share for all: each band's prompt less its cached prefix
    (``roofline.cached_prefix_tokens`` of the band's mean prompt), the spread
    of the work ``(1 - h)`` times the prompts' and its second moment
    ``(1 - h)^2`` times theirs. Shares that differ: the bands of the work
    itself (``work_bands``) at the row of ``capacity_tokens`` (the KV
    capacity, for an LRU cache's), each with its mean cached prefix, and
    their joint law with the outputs. The KV a request holds and the decode
    contexts keep the whole prompt.

    Returns ``(workload, cached tokens per band)``; exactly ``wl`` at h = 0.
    """
    on = hit_fraction > 0
    spread = on & (wl.hit_distribution > 0)
    rows = wl.hit_capacity_tokens
    row = jnp.clip(jnp.searchsorted(rows, capacity_tokens, side="right") - 1, 0,
                   len(rows) - 1)
    cached = roofline.cached_prefix_tokens(wl.prompt_tokens, hit_fraction)
    work = wl.prompt_tokens - cached
    keep = 1.0 - hit_fraction

    def pick(from_spread, from_one, off):
        return jnp.where(spread, from_spread[row], jnp.where(on, from_one, off))

    return wl._replace(
        prompt_tokens=pick(wl.hit_work_tokens, work, wl.prompt_tokens),
        prompt_spread_tokens=pick(wl.hit_work_spread_tokens,
                                  keep * wl.prompt_spread_tokens,
                                  wl.prompt_spread_tokens),
        joint_probs=jnp.where(spread, wl.hit_joint_probs[row], wl.joint_probs),
        mean_prompt_tokens=pick(wl.hit_mean_work_tokens, wl.band_probs @ work,
                                wl.mean_prompt_tokens),
        mean_prompt_sq_tokens=pick(wl.hit_mean_work_sq_tokens,
                                   keep**2 * wl.mean_prompt_sq_tokens,
                                   wl.mean_prompt_sq_tokens)), pick(
        wl.hit_cached_tokens, cached, cached)
