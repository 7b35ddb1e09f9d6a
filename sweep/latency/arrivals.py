"""Request streams for the serving simulator: arrival times and lengths.

Arrivals are a Poisson process at ``arrival_rate_per_s`` (independent
exponential gaps, the usual open-loop load model of serving benchmarks such as
vLLM's ``benchmark_serving.py --request-rate``), or a trace's own timestamps
stretched so that their mean rate equals the target rate (its burstiness is
kept). Lengths are either

* sampled (``workload.replay=sampled``, ``sample_requests``): prompt and
  output drawn independently from the workload's tables
  (``sweep.latency.workload.WorkloadTables``), so a discrete mixture, a binned
  lognormal and a trace's empirical distribution are sampled alike; or
* replayed (``workload.replay=exact``, ``replay_requests``): the trace's rows
  in recorded order with their recorded (prompt, output) pairs, its first
  request at time 0.

Both are jittable and vmappable over keys and rates; the tables and the number
of requests are constants. ``route`` and ``split`` share one stream among
replicas as a load balancer does.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sweep.config.schema import ArrivalKind, Replay, Routing, Workload
from sweep.latency.workload import WorkloadTables


class Requests(NamedTuple):
    """A request stream sorted by arrival (every leaf shape ``(R,)``, float32)."""

    arrival_s: jax.Array  # arrival time, seconds from the start of the run
    prompt_tokens: jax.Array  # prompt length, tokens (>= 1)
    output_tokens: jax.Array  # output length, tokens, first token included (>= 1)


def _trace_arrivals_s(trace_arrival_s: np.ndarray, num_requests: int) -> np.ndarray:
    """``num_requests`` offsets from a trace, repeating it when it is shorter.

    A repeat starts one mean gap after the previous copy ends, so the mean rate
    of the result is the trace's mean rate. (``workload_tables`` refuses a
    trace with fewer than two distinct timestamps before this is reached.)
    """
    t = np.asarray(trace_arrival_s, dtype=np.float64)
    t = t - t[0]
    if len(t) < 2 or t[-1] <= 0.0:
        raise ValueError("trace_arrival_s needs >= 2 increasing timestamps")
    period = t[-1] * len(t) / (len(t) - 1)
    copies = -(-num_requests // len(t))
    out = (t[None, :] + period * np.arange(copies)[:, None]).ravel()
    return out[:num_requests]


def sample_requests(key, workload_tables: WorkloadTables, num_requests: int,
                    arrival_rate_per_s, trace_arrival_s=None) -> Requests:
    """Samples ``num_requests`` requests (the first one arrives after one gap).

    Args:
      key: PRNG key.
      workload_tables: length tables (constants).
      num_requests: static.
      arrival_rate_per_s: mean arrival rate (traced scalar).
      trace_arrival_s: optional trace timestamps (host array, seconds); when
        given, arrivals are the trace's offsets (repeated if the trace is
        shorter) scaled by ``trace_rate / arrival_rate_per_s``, where
        ``trace_rate = (n - 1) / span`` is the trace's own mean rate.

    Returns:
      ``Requests`` with float32 leaves of shape ``(num_requests,)``.
    """
    k_gap, k_prompt, k_output = jax.random.split(key, 3)
    rate = jnp.asarray(arrival_rate_per_s, jnp.float32)
    if trace_arrival_s is None:
        gaps = jax.random.exponential(k_gap, (num_requests,), jnp.float32)
        arrival = jnp.cumsum(gaps) / rate
    else:
        offsets = _trace_arrivals_s(trace_arrival_s, num_requests)
        t = np.asarray(trace_arrival_s, dtype=np.float64)
        trace_rate = float((len(t) - 1) / (t[-1] - t[0]))  # weak: rate's type
        # the first request arrives one mean gap after the start, as with Poisson
        arrival = jnp.asarray(offsets + 1.0 / trace_rate, jnp.float32) * (
            trace_rate / rate)

    def draw(k, values, probs):
        v = jnp.asarray(values, jnp.float32)
        p = jnp.asarray(probs, jnp.float32)
        return jnp.maximum(jax.random.choice(k, v, (num_requests,), p=p), 1.0)

    return Requests(
        arrival_s=arrival,
        prompt_tokens=draw(k_prompt, workload_tables.prompt_values,
                           workload_tables.prompt_probs),
        output_tokens=draw(k_output, workload_tables.output_values,
                           workload_tables.output_probs),
    )


def replay_requests(key, workload_tables: WorkloadTables, num_requests: int,
                    arrival_rate_per_s, trace_arrivals: bool) -> Requests:
    """The trace's first ``num_requests`` rows in recorded order (exact replay).

    Each request keeps its recorded (prompt, output) pair
    (``WorkloadTables.pairs``); a shorter trace repeats from its first row.

    Args:
      key: PRNG key (Poisson arrivals only).
      workload_tables: with ``pairs`` (constants).
      num_requests: static.
      arrival_rate_per_s: mean arrival rate (traced scalar).
      trace_arrivals: arrivals at the recorded offsets
        ``(t_i - t_0) * trace_rate / arrival_rate_per_s`` (the first at 0,
        ``trace_rate = (n - 1) / span`` over the rows replayed), repeated as
        in ``sample_requests``; otherwise Poisson, as there.
    """
    pairs = workload_tables.pairs
    rows = np.arange(num_requests) % len(pairs)
    rate = jnp.asarray(arrival_rate_per_s, jnp.float32)
    if trace_arrivals:
        t = workload_tables.pair_arrival_s
        offsets = _trace_arrivals_s(t, num_requests)
        # in units of the trace's mean gap, then at the target rate
        arrival = jnp.asarray(offsets * ((len(t) - 1) / (t[-1] - t[0])),
                              jnp.float32) / rate
    else:
        gaps = jax.random.exponential(key, (num_requests,), jnp.float32)
        arrival = jnp.cumsum(gaps) / rate
    return Requests(arrival_s=arrival,
                    prompt_tokens=jnp.asarray(pairs[rows, 0], jnp.float32),
                    output_tokens=jnp.asarray(pairs[rows, 1], jnp.float32))


def workload_requests(key, workload: Workload, workload_tables: WorkloadTables,
                      num_requests: int, arrival_rate_per_s) -> Requests:
    """A workload's stream: its ``replay`` and ``arrival`` settings applied.

    Drawn in float32, so ``JAX_ENABLE_X64`` draws the same requests, and held
    in the default float type: the simulator computes in its stream's, so
    under ``JAX_ENABLE_X64`` a console script's simulation runs in float64."""
    trace = workload.arrival == ArrivalKind.trace
    if workload.replay == Replay.exact:
        out = replay_requests(key, workload_tables, num_requests,
                              arrival_rate_per_s, trace)
    else:
        out = sample_requests(key, workload_tables, num_requests, arrival_rate_per_s,
                              workload_tables.trace_arrival_s if trace else None)
    return jax.tree.map(lambda x: x.astype(jax.dtypes.canonicalize_dtype(float)), out)


def recorded_arrivals(workload: Workload, tables: WorkloadTables) -> np.ndarray | None:
    """The recorded arrivals a workload's streams replay
    (``workload.arrival=trace``: the pairs' under exact replay, else the
    trace's timestamps), or None."""
    if workload.arrival != ArrivalKind.trace:
        return None
    exact = workload.replay == Replay.exact and tables.pairs is not None
    return tables.pair_arrival_s if exact else tables.trace_arrival_s


def replay_repeat(workload: Workload, tables: WorkloadTables,
                  num_requests: int) -> str | None:
    """Where a stream of ``num_requests`` repeats a trace's recorded arrivals
    and ends inside a copy, what it replays: "the trace's N arrivals, then
    its first K again, at P x the target rate" (``stretch_pace``: the rows
    repeated may be busier or quieter than the whole). None otherwise."""
    t = recorded_arrivals(workload, tables)
    if t is None or num_requests <= len(t) or num_requests % len(t) == 0:
        return None
    copies, extra = divmod(num_requests, len(t))
    times = "" if copies == 1 else f" {copies} times"
    return (f"the trace's {len(t):,} arrivals{times}, then its first {extra:,} "
            f"again, at {stretch_pace(t, num_requests):.3f}x the target rate")


def replay_coverage(workload: Workload, tables: WorkloadTables,
                    num_requests: int) -> str | None:
    """Where a stream of ``num_requests`` replays only part of a trace's
    recorded arrivals, which part: "the trace's first N of M arrivals (X %
    of its span) at P x the target rate" (``stretch_pace``). A bursty
    trace's p99 depends on which of its bursts those rows hold. None
    otherwise."""
    t = recorded_arrivals(workload, tables)
    if t is None or num_requests >= len(t):
        return None
    share = (t[num_requests - 1] - t[0]) / (t[-1] - t[0])
    return (f"the trace's first {num_requests:,} of {len(t):,} arrivals "
            f"({share:.1%} of its span) at {stretch_pace(t, num_requests):.2f}x "
            "the target rate")


def stretch_pace(recorded_s: np.ndarray, num_requests: int) -> float:
    """The mean rate of a stream's first ``num_requests`` offsets of a trace
    (``_trace_arrivals_s``: a shorter trace repeated) over the trace's own:
    the share of the target rate they arrive at, once stretched by the whole
    trace's mean rate."""
    return _pace(recorded_s, _trace_arrivals_s(recorded_s, num_requests))


def _pace(recorded_s: np.ndarray, offsets: np.ndarray) -> float:
    """``stretch_pace`` of the stream's ``offsets`` (1 for one request)."""
    if len(offsets) < 2:
        return 1.0
    t = np.asarray(recorded_s, np.float64)
    return float((len(offsets) - 1) / offsets[-1] / ((len(t) - 1) / (t[-1] - t[0])))


def replayed_tables(tables: WorkloadTables, workload: Workload, num_requests: int
                    ) -> tuple[WorkloadTables, float]:
    """What a stream of ``num_requests`` replays of a trace (``workload_requests``),
    as tables, and its pace: the stream's own mean rate over the trace's.

    Exact replay: the first rows, a shorter trace repeated, with their pairs,
    marginals and offsets; recorded arrivals under sampled replay: the
    offsets only (lengths are drawn from the trace's marginals). The stream's
    offsets keep the trace's time scale, as the stream stretches them by the
    whole trace's mean rate, so a stretch of it busier or quieter than the
    whole runs at ``pace`` times the target rate: 0.84 for the first 1,000
    rows of the Azure conversation trace of 2023, 0.75 for its code trace's.
    Tables without a trace come back as they are, at pace 1.
    """
    exact = workload.replay == Replay.exact and tables.pairs is not None
    recorded = recorded_arrivals(workload, tables)
    offsets, pace = None, 1.0
    if recorded is not None:
        offsets = _trace_arrivals_s(recorded, num_requests)
        pace = _pace(recorded, offsets)
    if not exact:
        if offsets is not None:
            tables = replace(tables, trace_arrival_s=offsets)
        return tables, pace
    rows = np.arange(num_requests) % len(tables.pairs)
    pairs = tables.pairs[rows]
    pv, pp = np.unique(pairs[:, 0], return_counts=True)
    ov, op = np.unique(pairs[:, 1], return_counts=True)
    hashes = (None if tables.pair_hashes is None
              else tuple(tables.pair_hashes[i] for i in rows))
    return replace(tables, prompt_values=pv.astype(np.float64),
                   prompt_probs=pp / len(rows), output_values=ov.astype(np.float64),
                   output_probs=op / len(rows),
                   pairs=pairs, pair_hashes=hashes,
                   pair_arrival_s=tables.pair_arrival_s if offsets is None
                   else offsets), pace


HIT_STREAM = 2
"""``fold_in`` tag of the draws of each request's cached share from its
stream's key (``request_hits``), apart from its lengths' and arrivals'."""


def request_hits(key, workload_tables: WorkloadTables, num_requests: int) -> np.ndarray:
    """Each request's share of its prompt in the prefix cache (host float32,
    ``(num_requests,)``): drawn independently from the workload's
    distribution of shares (``WorkloadTables.hit_levels``), or its one
    ``prefix_hit_fraction`` for all."""
    t = workload_tables
    if t.hit_levels is None:
        return np.full(num_requests, t.prefix_hit_fraction, np.float32)
    k = jax.random.choice(jax.random.fold_in(key, HIT_STREAM), len(t.hit_levels),
                          (num_requests,), p=jnp.asarray(t.hit_probs, jnp.float32))
    return np.asarray(t.hit_levels, np.float32)[np.asarray(k)]


def route(num_requests: int, replicas: int, routing: Routing, key) -> np.ndarray:
    """The replica of each request (in arrival order), as a load balancer picks.

    ``round_robin``: request ``i`` goes to replica ``i mod replicas``;
    ``random``: each to a uniformly random replica, independently (``key``).
    """
    if routing == Routing.round_robin:
        return np.arange(num_requests) % replicas
    return np.asarray(jax.random.randint(jax.random.fold_in(key, replicas),
                                         (num_requests,), 0, replicas))


def split(requests: Requests, replica: np.ndarray, replicas: int,
          length: int) -> tuple[Requests, np.ndarray]:
    """One stream as ``replicas`` sub-streams of a fixed length (host arrays).

    Args:
      requests: the stream, in arrival order.
      replica: each request's replica (``route``).
      length: static sub-stream length, at least the largest replica's count.

    Returns:
      ``(sub_streams, mine)``: leaves of shape ``(replicas, length)``, the
      requests of replica ``r`` first in arrival order; ``mine`` is False on
      the padding after them, which the simulator never serves.
    """
    replica = np.asarray(replica)
    counts = np.bincount(replica, minlength=replicas)
    if counts.max(initial=0) > length:
        raise ValueError(f"length {length} < the largest replica's {counts.max()}")
    order = np.argsort(replica, kind="stable")
    position = np.arange(len(replica)) - np.repeat(np.cumsum(counts) - counts, counts)
    index = np.zeros((replicas, length), np.int64)
    mine = np.zeros((replicas, length), bool)
    index[replica[order], position] = order
    mine[replica[order], position] = True
    return jax.tree.map(lambda x: np.asarray(x)[index], requests), mine
