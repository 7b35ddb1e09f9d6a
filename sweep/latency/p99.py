"""The p99 part of a grid cube: simulator or surrogate over the latency axes.

p99 latency depends on the hardware, model, workload, tensor parallelism,
concurrency, token budget, batching mode, precision, speculative decoding,
prefix caching, disaggregation (with its instance counts) and arrival rate,
not on the
roofline-only axes (context, long prompt, traffic): its variables live on
``DIMS`` only, and xarray broadcasts them against the rest of the cube.

* ``latency=simulate``: ``sweep.latency.simulate`` runs every configuration over
  ``latency.num_requests`` requests. Streams are sampled once per workload x
  rate from the run's seed; every configuration of a workload sees the same
  requests (common random numbers), the same arrivals compressed for a higher
  rate, so configurations and rates are compared on equal terms.
  With ``workload.replay=exact`` the stream is the trace's rows in recorded
  order (``sweep.latency.arrivals.replay_requests``). A disaggregated point
  (``grid.disaggregated``) runs its prefill and decode pools
  (``sweep.latency.disaggregated``) over the same stream; continuous batching
  only (other batching modes are ``UNMODELLED`` there).
* ``latency=surrogate``: ``sweep.latency.surrogate.surrogate``, closed forms for
  continuous batching; static and request-at-a-time points are NaN there.
  A disaggregated point is the surrogate of each of its pools
  (``sweep.latency.disaggregated.pools``).
  With ``grid.sensitivity=true`` each point also carries the elasticities of
  its p99 TTFT and ITL to the hardware and calibration constants.
  Of a trace it reads what the simulator replays: the first
  ``latency.num_requests`` rows (exact replay) or offsets, a shorter trace
  repeated, at that stretch's own pace (``arrivals.replayed_tables``): the
  two backends describe the same requests.

Prefix caching from a trace's block hashes (``workload.trace.hash_column``):
the simulator takes each request's hits from an LRU cache the size of the
configuration's KV capacity, the surrogate the share of prompt tokens it
finds (``sweep.latency.prefix_cache``, over the replayed stream as each model
serves it).

Context limit: a request whose prompt + output exceeds the model's
``max_context_tokens`` is rejected (``workload.overlong=reject``) or has its
prompt cut (``truncate``), per model (``sweep.latency.workload.context_limit``). The
simulator does it request by request; for the surrogate, the workload's
length tables are conditioned on the requests the model serves
(``sweep.latency.workload.served_tables``) and the arrival rate is the served one.
``rejected_fraction`` is the share rejected.

``slo_met`` compares p99 TTFT and ITL with the ``slo`` group and the rejected
fraction with ``slo.max_rejected_fraction``; each variable's ``method``
attribute says which model produced it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from sweep import shapes
from sweep.config.schema import (
    ArrivalKind,
    GridApp,
    LatencyMethod,
    Model,
    Overlong,
    Replay,
    Workload,
)
from sweep.cube import contract
from sweep.cube import status as flags
from sweep.grid.evaluate import Part, blocking, write_blocking
from sweep.latency.arrivals import replayed_tables, request_hits, workload_requests
from sweep.latency.disaggregated import (
    SurrogateEngine,
    no_link,
    pool_engines,
    pool_workloads,
    simulate_disaggregated,
    surrogates,
)
from sweep.latency.prefix_cache import Streams, padded_curves, padded_tables
from sweep.latency.prefix_cache import cached_tokens as prefix_cache_hits
from sweep.latency.simulate import simulate
from sweep.latency.surrogate import LatencyWorkload, latency_workload
from sweep.latency.surrogate.lengths import pad_hit_rows
from sweep.latency.workload import WorkloadTables, served_tables
from sweep.model import precision, roofline, sensitivity
from sweep.model.batching import is_continuous
from sweep.model.params import OVERLONG, prefill_tp, stack

DIMS = contract.dims(contract.P99)
"""The latency axes, in the cube's order."""


def _summary(r, slo, kv_ok, ok_status):
    """The cube's p99 variables from a latency model's outputs ``r`` (keys:
    ``Metric.key``); ``slo`` = (p99 TTFT, p99 ITL, rejected fraction)."""
    # past the capacity a queue grows without bound: no p99 is met in steady
    # state, whatever a pool's figures read (a decode pool at 1.02x its
    # capacity read p99s within the SLO)
    met = ((r["ttft_p99_s"] <= slo[0]) & (r["itl_p99_s"] <= slo[1])
           & (r["rejected_fraction"] <= slo[2])
           & ((ok_status & flags.SATURATED) == 0))
    out = {m.name: jnp.where(kv_ok, r[m.key], jnp.nan)
           for m in contract.metrics(contract.P99) if m.dtype == "float32"}
    out["slo_met"] = met & kv_ok
    out["latency_status"] = jnp.asarray(ok_status, jnp.int32)
    return out


def _capacities(hardware, model, tensor_parallel, pre_tp, disaggregated):
    """KV tokens an engine (or decode instance) holds, a prefill instance
    holds, and whether the point's GPUs hold the weights (both pools')."""
    capacity, pool_capacity = (roofline.kv_capacity_tokens(hardware, model, t)
                               for t in (tensor_parallel, pre_tp))
    fits = (capacity >= 1.0) & ((disaggregated == 0) | (pool_capacity >= 1.0))
    return capacity, pool_capacity, fits


@dataclass(frozen=True)
class SimulatePoint:
    """One configuration through the simulator (hashable: a static jit argument).

    Its ``workload`` input is the workload's ``overlong`` rule (an index into
    ``OVERLONG``); its requests come from the ``requests`` table. Which
    simulators are compiled is static: ``aggregated`` when the grid lists
    aggregated points, ``max_prefill_instances`` > 0 (and the pools' sizes)
    when it lists disaggregated ones; with both, each point takes its own.
    """

    max_slots: int
    aggregated: bool = True
    max_prefill_instances: int = 0
    max_decode_instances: int = 0

    def __call__(self, *, hardware, model, workload, tensor_parallel, concurrency,
                 token_budget, batching, weight_dtype, kv_dtype, spec_tokens,
                 spec_acceptance, spec_proposer, prefix_caching, disaggregated,
                 prefill_instances, decode_instances, prefill_tensor_parallel,
                 arrival_rate_per_s, requests, prefix_hit, prefix_cache, pool_cache,
                 slo):
        del arrival_rate_per_s  # the requests arrive at it already
        model = roofline.with_proposer(precision.apply(model, weight_dtype, kv_dtype),
                                       spec_proposer, spec_tokens)
        hit = jnp.where(prefix_caching > 0, prefix_hit, 0.0)
        engine = (hardware, model, tensor_parallel, concurrency, token_budget, requests)
        pre_tp = prefill_tp(prefill_tensor_parallel, tensor_parallel)
        capacity, pool_capacity, ok = _capacities(hardware, model, tensor_parallel,
                                                  pre_tp, disaggregated)
        # an LRU cache of the trace's block hashes, where the workload has
        # them: the engine's, or each prefill instance's of its own prompts
        cached, pool_cached = (
            jnp.where(prefix_caching > 0, prefix_cache_hits(t, c), 0.0)
            for t, c in ((prefix_cache, capacity), (pool_cache, pool_capacity)))
        if self.aggregated:
            r = simulate(*engine, batching, slo[0], slo[1], workload, None,
                         spec_tokens, spec_acceptance, hit, cached,
                         max_slots=self.max_slots)._asdict()
        if self.max_prefill_instances:
            d = simulate_disaggregated(
                *engine, prefill_instances, decode_instances, slo[0], slo[1], workload,
                spec_tokens, spec_acceptance, hit, pool_cached, pre_tp,
                max_prefill_instances=self.max_prefill_instances,
                max_decode_instances=self.max_decode_instances,
                max_slots=self.max_slots)._asdict()
            # both pools batch continuously (sweep.latency.disaggregated)
            d["status"] = jnp.where(is_continuous(batching), d["status"],
                                    flags.UNMODELLED)
            split = disaggregated > 0
            r = (jax.tree.map(lambda a, b: jnp.where(split, b, a), r, d)
                 if self.aggregated else d)
            ok = ok & ((r["status"] & flags.UNMODELLED) == 0)
        return _summary(r, slo, ok, r["status"])


_P99S = ("ttft_p99_s", "itl_p99_s")
"""The figures whose elasticities a surrogate point carries."""


@dataclass(frozen=True)
class SurrogatePoint:
    """One configuration through the surrogate (continuous batching only).

    ``served`` describes the requests this model serves of the workload,
    ``pooled`` the same requests as a disaggregated deployment's pools see
    them (``sweep.latency.disaggregated.pool_workloads``), ``rejected`` the
    share it rejects; the served ones arrive at ``arrival_rate_per_s * pace *
    (1 - rejected)``, ``pace`` the replayed stretch of a trace's own rate
    over the whole trace's (``arrivals.replayed_tables``; 1 without one). The
    ``workload`` axis's own input is unused (the tables carry the
    workload). Which surrogates are compiled is static:
    ``aggregated`` when the grid lists aggregated points, ``pools`` when it
    lists disaggregated ones. With ``sensitivity`` the p99s' elasticities
    too (``sweep.model.sensitivity.differences``), NaN where the
    surrogate's status is not ok (saturated, infeasible).
    """

    sensitivity: bool = False
    aggregated: bool = True
    pools: bool = False

    def __call__(self, *, hardware, model, workload, tensor_parallel, concurrency,
                 token_budget, batching, weight_dtype, kv_dtype, spec_tokens,
                 spec_acceptance, spec_proposer, prefix_caching, disaggregated,
                 prefill_instances, decode_instances, prefill_tensor_parallel,
                 arrival_rate_per_s, served, pooled, rejected, pace, prefix_hit,
                 prefix_curve, pool_curve, slo):
        del workload
        model = roofline.with_proposer(precision.apply(model, weight_dtype, kv_dtype),
                                       spec_proposer, spec_tokens)
        pre_tp = prefill_tp(prefill_tensor_parallel, tensor_parallel)
        capacity, pool_capacity, fits = _capacities(hardware, model, tensor_parallel,
                                                    pre_tp, disaggregated)
        # or the share an LRU cache of the trace's block hashes finds: the
        # engine's, or the prefill instances' (each of its own prompts)
        hit, pool_hit = (jnp.where(prefix_caching > 0, jnp.maximum(
            prefix_hit, roofline.lru_hit_fraction(c, *curve)), 0.0)
            for c, curve in ((capacity, prefix_curve), (pool_capacity, pool_curve)))
        rate = arrival_rate_per_s * pace * (1.0 - rejected)
        split = disaggregated > 0

        def figures(hw):
            engine = SurrogateEngine(served, tensor_parallel, rate, slo[0], slo[1],
                                     spec_tokens, spec_acceptance, hit, None, 1.0)
            if not self.pools:
                r = engine.evaluate(hw, model, concurrency, token_budget)
                return {f: r[f] for f in _P99S}, r
            pool_list, deployment = pool_engines(
                hw, model, tensor_parallel, token_budget, pooled,
                served.mean_output_tokens, rate, prefill_instances, decode_instances,
                slo[0], slo[1], spec_tokens, spec_acceptance, pool_hit, pre_tp)
            # a grid of both kinds batches the engine with the pools: one
            # surrogate compiled, not two
            alone = ([engine._replace(link=no_link(pool_list[0].link), handover=0.0)]
                     if self.aggregated else [])
            *one, pre, dec = surrogates(hw, model, concurrency, token_budget,
                                        alone + pool_list)
            r = deployment(pre, dec)
            if one:
                r = jax.tree.map(lambda a, b: jnp.where(split, b, a), one[0], r)
            return {f: r[f] for f in _P99S}, r

        if self.sensitivity:
            _, r, elasticity = sensitivity.differences(figures, hardware, _P99S)
        else:
            r, elasticity = figures(hardware)[1], {}
        r["rejected_fraction"] = rejected
        continuous = is_continuous(batching)
        ok = fits & continuous
        served_any = rejected < 1.0
        # a saturated point's p99 grows without bound: no elasticity
        steady = ok & served_any & (r["status"] == flags.OK)
        # the closed forms describe continuous batching only
        out = _summary(r, slo, ok, r["status"] | jnp.where(
            continuous, flags.OK, flags.UNMODELLED))
        # every request beyond the context: no figure but the share rejected
        # (1), as the simulator gives
        out = {k: v if k == "rejected_fraction" or v.dtype.kind != "f"
               else jnp.where(served_any, v, jnp.nan) for k, v in out.items()}
        return out | {k: jnp.where(steady, v, jnp.nan) for k, v in elasticity.items()}


def served_requests(tables: WorkloadTables, workload: Workload, model: Model
                    ) -> tuple[WorkloadTables, bool, float, np.ndarray | None]:
    """The length tables of the requests ``model`` serves, whether they pair
    prompts with outputs as recorded (exact replay), the share rejected
    (``sweep.latency.workload.served_tables``), and the arrival times the
    served requests replay (``workload.arrival=trace``; None: Poisson)."""
    exact = workload.replay == Replay.exact
    served, rejected = served_tables(
        tables, float(model.max_context_tokens),
        workload.overlong == Overlong.truncate, exact)
    arrival_s = None
    if workload.arrival == ArrivalKind.trace:
        arrival_s = served.pair_arrival_s if exact else served.trace_arrival_s
    return served, exact, rejected, arrival_s


def served_workload(tables: WorkloadTables, workload: Workload, model: Model,
                    streams: Streams | None = None,
                    ) -> tuple[LatencyWorkload, float]:
    """The surrogate's summary of the requests ``model`` serves, and the share
    it rejects (``served_requests``).

    Under exact replay the summary takes the trace's recorded (prompt, output)
    pairs (their joint law); sampled streams draw the lengths independently.
    Recorded arrivals come with their own wait law
    (``sweep.latency.surrogate.bursts``). ``streams``: the stream an LRU
    cache of the trace's block hashes sees (its bands by capacity,
    ``lengths.lru_bands``), or None.
    """
    served, joint, rejected, arrival_s = served_requests(tables, workload, model)
    return _summary_of(served, joint, arrival_s,
                       lru=_lru(streams, model, workload)), rejected


def _lru(streams, model: Model, workload: Workload, prefill_instances: int = 0):
    """``lengths.lru_bands``' arguments for ``model``'s stream (with
    ``prefill_instances``, its prefill pool's: one output token each), or
    None."""
    if streams is None:
        return None
    limit, truncate = (float(model.max_context_tokens),
                       workload.overlong == Overlong.truncate)
    prompts, outputs, served, _ = streams.stream_requests(limit, truncate)
    return (*streams(limit, truncate, prefill_instances), prompts,
            np.ones_like(outputs) if prefill_instances else outputs, served)


def _pooled(served, models, workloads, streams, traced: bool,
            pool_sizes: list[int]):
    """The ``pooled`` lookup: ``pool_workloads`` per model, workload and
    prefill pool size (``pool_sizes``: the grid's, or none without
    disaggregated points: one summary, no cache's bands)."""
    rows = [pool_workloads(t, joint, arrival_s, traced,
                           _lru(streams[w], models[m], workloads[w], p) if p else None)
            for m, row in enumerate(served) for w, (t, joint, _, arrival_s)
            in enumerate(row) for p in pool_sizes or [0]]
    prefill = pad_hit_rows([r.prefill for r in rows])
    flat = [r._replace(prefill=f) for r, f in zip(rows, prefill)]
    if not pool_sizes:
        return _nested(flat, len(workloads)), ("model", "workload")
    return (_nested(flat, len(workloads), len(pool_sizes)),
            ("model", "workload", "prefill_instances"))


def _nested(flat: list, *inner: int):
    """``stack`` of a flat list in C order into axes of sizes ``(len /
    prod(inner), *inner)``."""
    if not inner:
        return stack(flat)
    size = math.prod(inner)
    return stack([_nested(flat[i:i + size], *inner[1:])
                  for i in range(0, len(flat), size)])


def _summary_of(served: WorkloadTables, joint: bool, arrival_s: np.ndarray | None,
                trace_rows: bool = False, lru=None) -> LatencyWorkload:
    return latency_workload(served, pairs=served.pairs if joint else None,
                            arrival_s=arrival_s, trace_rows=trace_rows, lru=lru)


def _rates(app: GridApp, workloads) -> np.ndarray:
    if "arrival_rate_per_s" in app.grid.axes:
        return np.asarray(app.grid.axes["arrival_rate_per_s"])
    return np.unique([w.arrival_rate_per_s for w in workloads])


def part(app: GridApp, workloads, tables, streams, models, inputs, coords):
    """The p99 ``Part`` of a grid job and the arrival-rate coordinate.

    Args:
      streams: per workload, its ``prefix_cache.Streams`` (a trace with block
        hashes) or None.
      inputs: the roofline part's inputs by axis name (hardware, model and
        the serving settings are shared).
      coords: the roofline axes' coordinates.
    """
    rates = _rates(app, workloads)
    slo = np.array([app.slo.ttft_p99_s, app.slo.itl_p99_s,
                    app.slo.max_rejected_fraction], np.float32)
    sizes = {d: len(coords[d]) for d in DIMS[:-1]} | {"arrival_rate_per_s": len(rates)}
    shape = tuple(sizes[d] for d in DIMS)
    batch = app.latency.chunk_configs
    shared = {d: inputs[d] for d in DIMS if d in inputs and d != "workload"}
    rate_input = rates.astype(np.float32)
    method = app.latency.method
    # each workload's (mean) prefix hit fraction, used where prefix_caching is on
    prefix_hit = (np.array([t.prefix_hit_fraction for t in tables], np.float32),
                  ("workload",))
    # an LRU cache of a trace's block hashes (workload.trace.hash_column):
    # one per model and workload, and one per prefill pool size of the
    # disaggregated points (flat: ``by_model`` and ``by_pool`` shape them)
    caches = [s and s(float(m.max_context_tokens), w.overlong == Overlong.truncate)
              for m in models for w, s in zip(workloads, streams)]
    split_points = bool(app.grid.prefill_pools)
    pool_caches = [s(float(m.max_context_tokens), w.overlong == Overlong.truncate,
                     int(p)) if s is not None and split_points else None
                   for m in models for w, s in zip(workloads, streams)
                   for p in coords["prefill_instances"]]

    def by_model(x):
        return x.reshape(len(models), len(workloads), *x.shape[1:])

    def by_pool(x):
        return x.reshape(len(models), len(workloads), len(coords["prefill_instances"]),
                         *x.shape[1:])
    if method == LatencyMethod.simulate:
        keys = jax.random.split(jax.random.key(app.seed), len(workloads))
        arrivals = [[workload_requests(k, w, t, app.latency.num_requests, r)
                     for r in rates] for w, t, k in zip(workloads, tables, keys)]
        requests = jax.tree.map(lambda *x: jnp.stack(x),
                                *[jax.tree.map(lambda *x: jnp.stack(x), *s)
                                  for s in arrivals])
        axes = app.grid.axes
        split = max(axes["disaggregated"]) > 0
        fn = SimulatePoint(
            int(max(axes["concurrency"])), aggregated=min(axes["disaggregated"]) == 0,
            max_prefill_instances=(shapes.power_of_two(int(max(
                axes["prefill_instances"]))) if split else 0),
            max_decode_instances=(shapes.power_of_two(int(max(
                axes["decode_instances"]))) if split else 0))
        overlong = np.array([OVERLONG.index(w.overlong.value) for w in workloads],
                            np.int32)
        lookups = {"requests": (requests, ("workload", "arrival_rate_per_s")),
                   # each request's own share (one for all, or drawn from the
                   # workload's distribution; the same requests at every rate)
                   "prefix_hit": (np.stack([
                       request_hits(k, t, app.latency.num_requests)
                       for t, k in zip(tables, keys)]), ("workload",)),
                   "prefix_cache": (jax.tree.map(by_model, padded_tables(
                       [c and c[0] for c in caches], app.latency.num_requests)),
                                    ("model", "workload")),
                   "pool_cache": (jax.tree.map(by_pool, padded_tables(
                       [c and c[0] for c in pool_caches], app.latency.num_requests)),
                                  ("model", "workload", "prefill_instances")),
                   "slo": (slo, ())}
        workload_input = overlong
        # a simulated block takes seconds or more: its chunk is written (and a
        # resumed run restarts) one compiled block at a time
        plan, batch_points = blocking(shape, batch), None
    else:
        split = app.grid.axes["disaggregated"]
        fn = SurrogatePoint(app.grid.sensitivity, aggregated=min(split) == 0,
                            pools=max(split) > 0)
        # of a trace, the stretch the simulator replays (not the optimizer's
        # search: its verification streams differ in length by candidate)
        replayed = [replayed_tables(t, w, app.latency.num_requests)
                    for w, t in zip(workloads, tables)]
        served = [[served_requests(t, w, m) for w, (t, _) in zip(workloads, replayed)]
                  for m in models]

        # a grid without recorded arrivals compiles none of their terms;
        # one that mixes them with Poisson ones stacks zero tables beside them
        traced = any(s[3] is not None for row in served for s in row)

        lookups = {
            # the engine's requests, with an LRU cache's bands by capacity
            # where the workload has block hashes
            "served": (_nested(pad_hit_rows([
                _summary_of(t, joint, arrival_s, traced,
                            _lru(streams[w], models[m], workloads[w]))
                for m, row in enumerate(served)
                for w, (t, joint, _, arrival_s) in enumerate(row)]), len(workloads)),
                ("model", "workload")),
            # the pools' summaries, read only where the grid has such points:
            # per prefill pool size, its instances' LRU caches' bands
            "pooled": _pooled(served, models, workloads, streams, traced,
                              [int(p) for p in coords["prefill_instances"]]
                              if split_points else []),
            "rejected": (np.array([[s[2] for s in row] for row in served], np.float32),
                         ("model", "workload")),
            "pace": (np.array([pace for _, pace in replayed], np.float32),
                     ("workload",)),
            "prefix_hit": prefix_hit,
            "prefix_curve": (tuple(map(by_model,
                                       padded_curves([c and c[1] for c in caches]))),
                             ("model", "workload")),
            "pool_curve": (tuple(map(by_pool, padded_curves(
                [c and c[1] for c in pool_caches]))),
                           ("model", "workload", "prefill_instances")),
            "slo": (slo, ())}
        workload_input = np.zeros(len(workloads), np.float32)
        plan, batch_points = write_blocking(shape, batch), batch
    # the simulator's percentiles are order statistics and histogram bins:
    # no useful gradient, so its cube carries the cost elasticities only
    options = (app.grid.optional_variables if method == LatencyMethod.surrogate
               else frozenset())
    return Part(contract.P99, fn, {**shared, "workload": workload_input,
                                   "arrival_rate_per_s": rate_input}, plan,
                lookups=lookups, attrs={"method": method.value},
                batch_points=batch_points, options=options,
                xla_defaults=method != LatencyMethod.surrogate), rates
