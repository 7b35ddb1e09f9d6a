"""The ``sweep-optimize`` job: cheapest deployment within a p99 SLO, verified.

1. **Candidates.** Every hardware x model (at each weight x KV dtype of
   ``search.weight_dtype`` / ``search.kv_dtype``, default the model's own)
   x tensor parallelism of the search space whose weights and one average
   request's KV fit in
   ``gpu_memory_utilization`` of the replica's memory (others are listed as
   excluded). They are stacked, padded to a multiple of ``descent.PAD`` (fewer
   distinct shapes to compile), with per-candidate surrogate targets that
   start at the SLO.
2. **Search** (``sweep.search.descent``): one compiled call optimises every candidate
   x restart and returns, per lattice neighbour of each answer, the fewest
   replicas meeting the targets under the surrogate, each replica's arrivals
   as ``search.routing`` deals them (``descent.replica_surrogate``). A
   candidate's answer is
   its cheapest such configuration (ties: the most slack). If none meets the
   SLO anywhere, the SLO is infeasible (``Infeasible``, exit code 3 unless
   a disaggregated deployment meets it): the message names the binding
   constraint and the best p99 reached.
3. **Verification.** The ``verify_top`` cheapest answers not simulated yet
   run through the simulator (``sweep.latency.simulate``). Their replicas are fed as
   a load balancer feeds them: one stream at the workload's full rate (one
   PRNG stream for every configuration: common random numbers), of which a
   configuration of ``R`` replicas takes the first ``verify_requests * R``
   requests (on a trace's recorded arrivals at least the whole trace; at most
   ``verify_requests_max``: ``verification_requests``), split over the ``R`` replicas by
   ``search.routing`` (``sweep.latency.arrivals.route``/``split``); every replica of
   every configuration is one row of one ``jit(vmap)`` call, and the p99s
   are over all of a configuration's requests (``sweep.latency.simulate.pool``),
   never over one replica fed a stream slowed ``R`` times. With a trace's
   block hashes (``workload.trace.hash_column``) each replica has an LRU
   prefix cache of the requests routed to it (``sweep.latency.prefix_cache``;
   the search takes the share one replica's cache finds). A candidate whose
   simulated p99 misses an SLO gets its surrogate target for that metric scaled by
   ``slo / simulated * surrogate / target * tighten_margin`` (the simulator's
   excess, assumed proportional), and the search runs again. Where the
   cheapest answer is confirmed, each answer the simulator confirmed below
   the surrogate's p99 raises its candidate's targets by that ratio, times
   ``loosen_margin`` (``_loosen``; not on part of a trace), and the search
   runs again for a cheaper answer, chosen only if the simulator confirms
   it too. And while the cheapest confirmed configuration has more than
   one replica, the surrogate's best on one replica fewer (the search held
   there, ``_fewer``) is simulated, then counts halfway between the most
   replicas that missed and the fewest confirmed, until none is left
   between them. Rounds stop when the cheapest answer is confirmed and no
   target rises, or after ``rounds``.
4. **Result.** The cheapest confirmed configuration, runner-ups, every
   round's verifications, and the Pareto fronts of cost against p99 ITL and
   p99 TTFT over all integer configurations the last search evaluated, as an
   ``xarray.Dataset`` (``to_dataset``) written to zarr (``write``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import xarray as xr

from sweep import exported, shapes
from sweep.config.convert import hardware_params, model_params, models_params
from sweep.config.schema import (
    ConfigError,
    Hardware,
    Model,
    OptimizeApp,
    Overlong,
    check_tensor_parallel,
)
from sweep.cube import contract, engines, outputs, status
from sweep.grid import calibration
from sweep.grid.plan import optimize_plan
from sweep.latency import prefix_cache
from sweep.latency.arrivals import (
    Requests,
    recorded_arrivals,
    replay_coverage,
    request_hits,
    route,
    split,
    workload_requests,
)
from sweep.latency.p99 import served_workload
from sweep.latency.simulate import pool, simulate_requests, summarize
from sweep.latency.surrogate import LatencyWorkload
from sweep.latency.surrogate.lengths import pad_hit_rows
from sweep.latency.workload import WorkloadTables, workload_tables
from sweep.model import precision, roofline
from sweep.model.batching import CONTINUOUS
from sweep.model.cost import HOURS_PER_MONTH, cost_per_mtok_usd
from sweep.model.params import OVERLONG, stack
from sweep.search import descent, pareto


class Infeasible(Exception):
    """No configuration meets the SLO; the message names the binding constraint.

    ``outcome``: what the search found all the same (``chosen`` None), for a
    caller that goes on (the disaggregated search) and writes it.
    """

    def __init__(self, message: str, outcome: Outcome | None = None):
        super().__init__(message)
        self.outcome = outcome


def model_label(m: Model) -> str:
    """The model's name, with its precision unless it is bf16 throughout."""
    return precision.label(m.name, m.weight_dtype, m.kv_dtype)


@dataclass
class Candidate:
    hardware: Hardware
    model: Model  # at the candidate's weight and KV dtypes
    tp: int
    spec_tokens: int = 0  # speculative proposals per step; 0: off
    # who proposes them (sweep.model.roofline.PROPOSERS); under "draft" the
    # model carries its draft model's config (Model.draft), under "eagle3"
    # its EAGLE-3 head's there, else none
    spec_proposer: str = "ngram"
    spec_acceptance: float = 0.0  # the proposer's (search.spec_acceptance)
    kv_tokens: float = 0.0  # KV tokens the memory holds beside the weights

    @property
    def label(self) -> str:
        return self.label_at(f" x TP {self.tp}")

    def label_at(self, tp: str) -> str:
        """``label`` with ``tp`` in place of its TP part (a disaggregated
        deployment names each pool's)."""
        spec = f" x spec k={self.spec_tokens}" if self.spec_tokens else ""
        if self.spec_tokens and self.spec_proposer == "draft":
            spec += f" (draft {self.model.draft.name})"
        elif self.spec_tokens and self.spec_proposer == "eagle3":
            spec += " (EAGLE-3 head)"
        return f"{self.hardware.name} x {model_label(self.model)}{tp}{spec}"


def _proposers(s, k: int) -> list[str]:
    """The proposers searched at ``k`` proposals: none to choose at k = 0."""
    return list(s.spec_proposer) if k > 0 else ["ngram"]


@dataclass
class OptimizeJob:
    """Everything the search needs, checked, before any compilation."""

    app: OptimizeApp
    candidates: list[Candidate]
    excluded: list[str]
    tables: WorkloadTables
    # per model name: the surrogate's summary of the requests it serves, and
    # the share it rejects (context limit)
    served: dict[str, tuple[LatencyWorkload, float]]
    settings: descent.Settings
    # the validated configs searched, per axis (provenance of the dataset)
    specs: dict[str, list] = field(default_factory=dict)
    # LRU prefix-cache tables of the verification stream's first n requests,
    # by n (a trace with block hashes: ``lru``)
    streams: dict[int, prefix_cache.Streams] = field(default_factory=dict)
    # one replica's LRU table, by (context limit, its requests' indices):
    # configurations with as many replicas share the routing (``_replica_hits``)
    replica_tables: dict[tuple, prefix_cache.CacheTable] = field(default_factory=dict)


def prepare(app: OptimizeApp, hardware: list[Hardware],
            models: list[Model]) -> OptimizeJob:
    """Checks the search space and loads the workload; raises ``ConfigError``."""
    s = app.search
    settings = descent.Settings.of(s)
    try:
        descent.make_optimizer(s.optimizer, settings.optimizer_options,
                               settings.knobs().learning_rate)
    except (AttributeError, TypeError) as e:
        raise ConfigError(
            f"search.optimizer = {s.optimizer!r} with options "
            f"{dict(s.optimizer_options)}: not an optax optimizer alias with these "
            f"options ({e})") from None
    check_tensor_parallel("search.tensor_parallel", s.tp_values, hardware, models)
    tables = workload_tables(app.workload, app.data_dir)
    # an LRU cache of the trace's block hashes sees one replica's verification
    # stream (``lru``): the surrogate's bands by capacity come from it
    streams = ({s.verify_requests: prefix_cache.Streams(tables, s.verify_requests)}
               if tables.pair_hashes is not None else {})
    served = {m.name: served_workload(tables, app.workload, m,
                                      streams.get(s.verify_requests))
              for m in models}
    limit = app.slo.max_rejected_fraction
    too_long = [m for m in models if served[m.name][1] > limit]
    if len(too_long) == len(models):
        least = min(too_long, key=lambda m: served[m.name][1])
        raise ConfigError(
            f"slo.max_rejected_fraction = {limit:g}: every model searched rejects "
            f"more of the workload's requests (prompt + output above "
            f"max_context_tokens); the fewest: {least.name} "
            f"({served[least.name][1]:.4g} at {least.max_context_tokens:,} tokens); "
            f"allowed: slo.max_rejected_fraction >= {served[least.name][1]:.4g}, "
            "workload.overlong=truncate, or a model with a longer context")
    request_kv = tables.mean_prompt_tokens + tables.mean_output_tokens
    for m in models:
        for w in s.weight_dtype or [m.weight_dtype]:
            if any(precision.supported(h, w) for h in hardware):
                continue
            runs = [d for d in precision.WEIGHT_DTYPES
                    if any(precision.supported(h, d) for h in hardware)]
            key = (f"search.weight_dtype = {list(s.weight_dtype)}" if s.weight_dtype
                   else f"model[{m.name}].weight_dtype = {w}")
            raise ConfigError(
                f"{key}: no hardware searched has {w} "
                f"tensor cores (hardware.{precision.rate_field(w)} = 0 on "
                f"{', '.join(h.name for h in hardware)}); allowed: "
                f"{', '.join(runs)}, or hardware with them")
    rejecting = {m.name for m in too_long}
    variants = [dataclasses.replace(m, weight_dtype=w, kv_dtype=kv) for m in models
                for w in s.weight_dtype or [m.weight_dtype]
                for kv in s.kv_dtype or [m.kv_dtype]]
    keep, excluded = [], []
    chosen = calibration.choose(app.calibration, hardware, variants)
    for h, row in zip(hardware, chosen):
        hp = hardware_params(h, s.gpu_memory_utilization)
        for m, choice in zip(variants, row):
            if not precision.supported(h, m.weight_dtype):
                excluded.append(
                    f"{h.name} x {model_label(m)}: no {m.weight_dtype} tensor cores "
                    f"(hardware.{precision.rate_field(m.weight_dtype)} = 0)")
                continue
            if m.name in rejecting:
                excluded.append(
                    f"{h.name} x {m.name}: rejects {served[m.name][1]:.2%} of the "
                    f"requests (max_context_tokens {m.max_context_tokens:,}), more "
                    f"than slo.max_rejected_fraction = {limit:g}")
                continue
            for tp, k in ((tp, k) for tp in s.tp_values for k in s.spec_values):
                for proposer in _proposers(s, int(k)):
                    mk = dataclasses.replace(
                        m, draft={"draft": m.draft, "eagle3": m.eagle3}.get(proposer),
                        eagle3=None)
                    cap = float(roofline.kv_capacity_tokens(hp, model_params(mk),
                                                            float(tp)))
                    # each running request holds k more KV slots for its proposals
                    c = Candidate(calibration.hardware_for(h, choice), mk, int(tp),
                                  int(k), proposer, s.acceptance.get(proposer, 0.0),
                                  cap)
                    if cap >= request_kv + k:
                        keep.append(c)
                    else:
                        excluded.append(f"{c.label}: weights + one average request's "
                                        "KV exceed the GPU memory")
    if not keep:
        raise ConfigError(
            f"search: no hardware x model x tensor_parallel of the search space fits "
            f"one average request ({request_kv:,.0f} KV tokens) beside the weights; "
            f"allowed: larger search.tensor_parallel "
            f"(now {[int(t) for t in s.tp_values]}) or hardware with more memory")
    job = OptimizeJob(app, keep, excluded, tables, served, settings,
                      {"hardware": hardware, "model": models,
                       "workload": [app.workload]}, streams=streams)
    optimize_plan(app, len(keep), job.settings, trace_rows(job)).check_memory()
    return job


def options(app_name: str, overrides: list[str]):
    """The validated app config and the hardware and model options to search.

    ``search.hardware`` when listed; else the ``hardware`` named on the command
    line; else every shipped option. ``search.model`` when listed; else the
    chosen ``model``. Each option is composed with the other overrides.
    """
    from sweep.config.resolve import grid_options

    base, out = grid_options(app_name, overrides, section="search",
                             groups=("hardware", "model"), every=("hardware",))
    return base, out["hardware"], out["model"]


def _candidates(job: OptimizeJob, ttft_target_s, itl_target_s) -> descent.Candidates:
    cands = job.candidates + [job.candidates[0]] * (-len(job.candidates) % descent.PAD)
    n = len(cands)
    f32 = jnp.float32
    served = [job.served[c.model.name] for c in cands]
    rate = job.app.workload.arrival_rate_per_s
    hw, model, tp = _stacked(job, cands)
    return descent.Candidates(
        hw=hw, model=model, workload=stack(pad_hit_rows([lw for lw, _ in served])),
        tp=tp,
        # rejected requests never reach the replicas
        arrival_rate_per_s=jnp.asarray([rate * (1.0 - r) for _, r in served], f32),
        ttft_target_s=jnp.asarray(np.resize(ttft_target_s, n), f32),
        itl_target_s=jnp.asarray(np.resize(itl_target_s, n), f32),
        spec_tokens=jnp.asarray([c.spec_tokens for c in cands], f32),
        spec_acceptance=jnp.asarray([c.spec_acceptance for c in cands], f32),
        prefix_hit_fraction=jnp.asarray(_prefix_hits(job, cands, hw, model, tp), f32),
    )


def _stacked(job: OptimizeJob, cands: list[Candidate]):
    """The candidates' hardware, model and tensor-parallel size, stacked."""
    util = job.app.search.gpu_memory_utilization
    return (stack([hardware_params(c.hardware, util) for c in cands]),
            models_params([c.model for c in cands]),
            jnp.asarray([c.tp for c in cands], jnp.float32))


def caching(job: OptimizeJob) -> bool:
    """Whether the deployment caches prefixes: a hit fraction (or a
    distribution of them), or a trace's block hashes
    (``sweep.latency.prefix_cache``)."""
    return (job.app.workload.mean_prefix_hit > 0
            or job.tables.pair_hashes is not None)


def _prefix_hits(job: OptimizeJob, cands: list[Candidate], hw, model,
                 tp) -> np.ndarray:
    """Each candidate's share of prompt tokens in the prefix cache: the
    workload's (mean) hit fraction, or what an LRU cache of the trace's block hashes
    finds in the candidate's KV capacity (from its stacked ``hw``, ``model``
    and ``tp``) over one replica's verification stream
    (``prefix_cache.hit_curve``; split over replicas, each cache sees fewer of
    the blocks, which the verification simulates)."""
    hit = np.full(len(cands), job.app.workload.mean_prefix_hit)
    if job.tables.pair_hashes is None:
        return hit
    capacity = np.asarray(jax.vmap(roofline.kv_capacity_tokens)(hw, model, tp))
    for i, c in enumerate(cands):
        _, curve = lru(job, job.app.search.verify_requests, c.model)
        hit[i] = max(hit[i], float(roofline.lru_hit_fraction(capacity[i], *curve)))
    return hit


def lru(job: OptimizeJob, requests: int, model: Model, prefill_instances: int = 0):
    """``prefix_cache.stream_table`` of the verification stream's first
    ``requests`` as ``model`` serves them, or with ``prefill_instances``
    ``pool_table``'s (each built once: ``prefix_cache.Streams``)."""
    if requests not in job.streams:
        job.streams[requests] = prefix_cache.Streams(job.tables, requests)
    return job.streams[requests](float(model.max_context_tokens), truncates(job),
                                 prefill_instances)


def truncates(job: OptimizeJob) -> bool:
    return job.app.workload.overlong == Overlong.truncate


@dataclass
class Config:
    """One integer configuration of one candidate, with its surrogate numbers."""

    candidate: int
    concurrency: int
    token_budget: int
    replicas: int
    surrogate: dict[str, float]
    cost_per_mtok_out_usd: float
    cost_per_month_usd: float
    simulated: dict[str, float] | None = None
    round: int = 0

    @property
    def key(self) -> tuple[int, int, int, int]:
        return (self.candidate, self.concurrency, self.token_budget, self.replicas)


@dataclass
class Verification:
    round: int
    config: Config
    ttft_target_s: float
    itl_target_s: float
    met: bool
    action: str


@dataclass
class Outcome:
    """What ``run`` found (NumPy and plain Python only)."""

    chosen: Config | None
    answers: list[Config | None]  # per candidate, the last search's answer
    verifications: list[Verification]
    last: descent.SearchResult
    ttft_target_s: np.ndarray
    itl_target_s: np.ndarray
    rounds: int
    evaluations: int
    simulations: int
    search_s: float
    simulate_s: float
    log: list[str] = field(default_factory=list)


def _costs(job: OptimizeJob, replicas) -> tuple[np.ndarray, np.ndarray]:
    """USD per 1M output tokens and per month; ``replicas`` has leading axis C."""
    r = np.asarray(replicas, float)
    shape = (-1,) + (1,) * (r.ndim - 1)
    gpus = r * np.array([c.tp for c in job.candidates], float).reshape(shape)
    usd = np.array([c.hardware.usd_per_gpu_hour for c in job.candidates]).reshape(shape)
    tokens_per_s = job.app.workload.arrival_rate_per_s * job.tables.mean_output_tokens
    return cost_per_mtok_usd(usd, gpus, tokens_per_s), usd * gpus * HOURS_PER_MONTH


def _answers(job: OptimizeJob, res: descent.SearchResult, ttft_t, itl_t,
             rnd: int) -> list[Config | None]:
    """Each candidate's cheapest feasible configuration (ties: most slack)."""
    n = len(job.candidates)
    per_mtok, per_month = _costs(job, res.replicas[:n])
    worst = np.maximum(res.metrics["ttft_p99_s"][:n] / ttft_t[:n, None, None],
                       res.metrics["itl_p99_s"][:n] / itl_t[:n, None, None])
    out = []
    for c in range(n):
        ok = res.feasible[c]
        if not ok.any():
            out.append(None)
            continue
        score = np.where(ok, per_mtok[c] * (1.0 + 1e-6 * np.nan_to_num(worst[c])),
                         np.inf)
        r, k = np.unravel_index(np.argmin(score), score.shape)
        out.append(Config(
            candidate=c, concurrency=int(res.concurrency[c, r, k]),
            token_budget=int(res.token_budget[c, r, k]),
            replicas=int(res.replicas[c, r, k]),
            surrogate={m: float(res.metrics[m][c, r, k]) for m in descent.METRICS},
            cost_per_mtok_out_usd=float(per_mtok[c, r, k]),
            cost_per_month_usd=float(per_month[c, r, k]), round=rnd))
    return out


def _surrogate_infeasible(job: OptimizeJob, res: descent.SearchResult) -> str:
    """The message of an SLO no candidate meets under the surrogate."""
    slo = job.app.slo
    n = len(job.candidates)
    ttft, itl = res.reach["ttft_p99_s"][:n], res.reach["itl_p99_s"][:n]
    r_max = job.settings.replicas_max

    def where(flat: int) -> str:
        c, r, k = np.unravel_index(flat, ttft.shape)
        cand = job.candidates[c]
        return (f"{cand.label}, max_num_seqs {int(res.concurrency[c, r, k])}, "
                f"max_num_batched_tokens {int(res.token_budget[c, r, k])}, "
                f"{count_text(r_max, 'replica')}")

    util = res.reach["utilization"][:n]
    if np.isfinite(util).any() and np.nanmin(util) >= 1.0:
        # saturated everywhere: each configuration's achieved rate is its
        # capacity (the utilization past it measures the queue, not the load)
        served = np.where(np.isfinite(util), res.reach["achieved_req_per_s"][:n],
                          np.nan)
        i = int(np.nanargmax(served))
        capacity = float(served.flat[i])
        rate = job.app.workload.arrival_rate_per_s
        per_replica = rate / r_max
        who = "one replica" if r_max == 1 else f"each of {r_max} replicas"
        fewest = max(math.ceil(rate / capacity), r_max + 1)
        return (f"infeasible at search.replicas_max = {r_max}: {who} would "
                f"receive {per_replica:.4g} req/s, at or past every configuration's "
                f"capacity (the most one serves: {capacity:.4g} req/s, at "
                f"{where(i)}); allowed: search.replicas_max >= {fewest:,} (the "
                "replicas that keep each below capacity; the SLO needs more), or "
                "a lower workload.arrival_rate_per_s")
    i_itl = int(np.nanargmin(np.where(np.isfinite(itl), itl, np.nan)))
    i_ttft = int(np.nanargmin(np.where(np.isfinite(ttft), ttft, np.nan)))
    best_itl, best_ttft = float(itl.flat[i_itl]), float(ttft.flat[i_ttft])
    if best_itl > slo.itl_p99_s:
        return (f"infeasible SLO: binding constraint slo.itl_p99_s = {slo.itl_p99_s:g}"
                f" s; the best p99 ITL reached on the candidate hardware is "
                f"{best_itl:.4g} s ({where(i_itl)}); allowed: slo.itl_p99_s >= "
                f"{best_itl:.4g}, or faster hardware / more tensor parallelism")
    if best_ttft > slo.ttft_p99_s:
        return (f"infeasible SLO: binding constraint slo.ttft_p99_s = "
                f"{slo.ttft_p99_s:g} s; the best p99 TTFT reached on the candidate "
                f"hardware is {best_ttft:.4g} s ({where(i_ttft)}); allowed: "
                f"slo.ttft_p99_s >= {best_ttft:.4g}, or faster hardware / more "
                "tensor parallelism")
    return (f"infeasible SLO: slo.ttft_p99_s = {slo.ttft_p99_s:g} s and "
            f"slo.itl_p99_s = {slo.itl_p99_s:g} s are each reachable but not "
            f"together: the lowest p99 ITL ({best_itl:.4g} s) comes with p99 TTFT "
            f"{float(ttft.flat[i_itl]):.4g} s ({where(i_itl)}); the lowest p99 TTFT "
            f"({best_ttft:.4g} s) with p99 ITL {float(itl.flat[i_ttft]):.4g} s; "
            "allowed: relax either limit")


class Engines(NamedTuple):
    """Per simulated row (leading axis): one engine and its settings."""

    hw: object  # HardwareParams
    model: object  # ModelParams
    tp: jax.Array
    concurrency: jax.Array
    token_budget: jax.Array
    spec_tokens: jax.Array
    spec_acceptance: jax.Array


class Shared(NamedTuple):
    """Scalars every row of one job's simulation shares."""

    ttft_slo_s: jax.Array
    itl_slo_s: jax.Array
    overlong: jax.Array


def simulation_inputs(job: OptimizeJob, cands: list[Candidate], concurrency: list[int],
                      token_budget: list[int]) -> tuple[Engines, Shared]:
    """The simulator's inputs for rows of (candidate, max_num_seqs,
    max_num_batched_tokens), and the job's shared scalars."""
    app, f32 = job.app, jnp.float32
    util = app.search.gpu_memory_utilization
    rows = Engines(
        stack([hardware_params(c.hardware, util) for c in cands]),
        models_params([c.model for c in cands]),
        jnp.asarray([c.tp for c in cands], f32), jnp.asarray(concurrency, f32),
        jnp.asarray(token_budget, f32),
        jnp.asarray([c.spec_tokens for c in cands], f32),
        jnp.asarray([c.spec_acceptance for c in cands], f32))
    shared = Shared(
        jnp.asarray(app.slo.ttft_p99_s, f32), jnp.asarray(app.slo.itl_p99_s, f32),
        jnp.int32(OVERLONG.index(app.workload.overlong.value)))
    return rows, shared


def _simulate_replicas(rows: Engines, shared: Shared, requests, mine, hits, cached,
                       owner, configs, *, max_slots: int):
    """Every row (one replica's share of a stream), pooled per configuration:
    ``SimResult``'s fields as a dict.

    Args:
      rows, requests, mine: per row (leading axis K).
      hits: per row, each request's share of its prompt in the prefix cache
        (``verification_hits``).
      cached: per row, each request's cached prefix (tokens) from an LRU cache
        of the trace's block hashes (0 without them).
      owner: int ``(K,)``, each row's configuration (-1: padding).
      configs: int ``(W,)``, ``arange(W)``.
    """
    def one(e: Engines, req, mine, hits, cached):
        return simulate_requests(
            e.hw, e.model, e.tp, e.concurrency, e.token_budget, req, CONTINUOUS,
            shared.ttft_slo_s, shared.itl_slo_s, shared.overlong, mine, e.spec_tokens,
            e.spec_acceptance, hits, cached, max_slots=max_slots)

    pooled = jax.vmap(one)(rows, requests, mine, hits, cached)
    return jax.vmap(lambda c: summarize(pool(pooled, owner == c))._asdict())(configs)


def trace_rows(job: OptimizeJob) -> int:
    """Arrivals of the trace the streams replay (0 without one)."""
    t = recorded_arrivals(job.app.workload, job.tables)
    return 0 if t is None else len(t)


def verification_requests(job: OptimizeJob, replicas: int) -> int:
    """Requests simulated for a configuration of ``replicas`` replicas
    (``Search.verified_requests`` at the job's trace rows).

    A trace's p99 is set by its bursts, and its first rows need not hold
    them: on the Azure conversation trace of 2023 at 20 req/s, B200 TP 1
    with 4 replicas read p99 TTFT 817 ms over its first 4,000 rows, where 5
    replicas read 1.21 s over all of it (``benchmarks/README.md``,
    "Verification replays the whole trace")."""
    return job.app.search.verified_requests(replicas, trace_rows(job))


def verification_stream(job: OptimizeJob, key) -> Requests:
    """The verification stream: ``verify_requests_max`` requests at the
    workload's full rate (host arrays); a configuration takes a prefix."""
    app = job.app
    return jax.tree.map(np.asarray, workload_requests(
        jax.random.fold_in(key, 0), app.workload, job.tables,
        app.search.verify_requests_max, app.workload.arrival_rate_per_s))


def verification_hits(job: OptimizeJob, key) -> np.ndarray:
    """Each request of ``verification_stream`` (same key): its share of its
    prompt in the prefix cache (``request_hits``; 0 without caching)."""
    if not caching(job):
        return np.zeros(job.app.search.verify_requests_max, np.float32)
    return request_hits(jax.random.fold_in(key, 0), job.tables,
                        job.app.search.verify_requests_max)


def simulate_configs(job: OptimizeJob, configs: list[Config], key,
                     width: int) -> list[dict[str, float]]:
    """Simulates each configuration's replicas behind a load balancer.

    Configuration ``c`` takes the first ``verify_requests(job, R_c)`` requests
    of one stream at the workload's full rate and splits them over its
    ``R_c`` replicas by ``search.routing``. The rows (``sum R_c``, padded to
    a power of two) and the sub-stream length (rounded up to 64) are the
    compiled shapes.

    Args:
      key: PRNG key of the request stream and the routing (the same for
        every configuration).
      width: static number of configurations per call (>= ``len(configs)``).

    Returns:
      Per configuration, its ``SimResult`` fields over all of its requests,
      with ``requests`` (simulated) added.
    """
    s = job.app.search
    stream = verification_stream(job, key)
    hits = verification_hits(job, key)
    routes = [route(verification_requests(job, c.replicas), c.replicas, s.routing,
                    jax.random.fold_in(key, 1)) for c in configs]
    longest = max(int(np.bincount(r).max()) for r in routes)
    length = -(-longest // 64) * 64
    subs, mines, owner, row_config = [], [], [], []
    for i, (c, r) in enumerate(zip(configs, routes)):
        sub, mine = split(jax.tree.map(lambda x, n=len(r): x[:n], (stream, hits)), r,
                          c.replicas, length)
        subs.append(sub)
        mines.append(mine)
        owner += [i] * c.replicas
        row_config += [c] * c.replicas
    rows = shapes.power_of_two(len(owner), width)
    pad = rows - len(owner)
    requests, row_hits = jax.tree.map(
        lambda *x: np.concatenate([*x, np.repeat(x[0][:1], pad, 0)]), *subs)
    mine = np.concatenate([*mines, np.zeros((pad, length), bool)])
    owner += [-1] * pad
    row_config += [configs[0]] * pad
    rows, shared = simulation_inputs(
        job, [job.candidates[c.candidate] for c in row_config],
        [c.concurrency for c in row_config], [c.token_budget for c in row_config])
    cached = np.zeros(mine.shape, np.float32)
    if job.tables.pair_hashes is not None:
        capacity = np.asarray(jax.vmap(roofline.kv_capacity_tokens)(
            rows.hw, rows.model, rows.tp))
        at = 0
        for c, r in zip(configs, routes):
            for replica in range(c.replicas):
                cached[at] = _replica_hits(job, c, r, replica, capacity[at], length)
                at += 1
    out = exported.call(
        _simulate_replicas, {"max_slots": shapes.slots(max(c.concurrency
                                                            for c in configs))},
        rows, shared, jax.tree.map(jnp.asarray, requests), jnp.asarray(mine),
        jnp.asarray(row_hits), jnp.asarray(cached), jnp.asarray(owner, jnp.int32),
        jnp.arange(width, dtype=jnp.int32))
    out = jax.tree.map(np.asarray, out)
    return [{**{k: float(v[i]) for k, v in out.items()}, "requests": len(r)}
            for i, r in enumerate(routes)]


def _replica_hits(job: OptimizeJob, c: Config, replicas: np.ndarray, replica: int,
                  capacity_tokens: float, length: int) -> np.ndarray:
    """The cached prefixes of one replica's requests (its sub-stream's order,
    padded to ``length``): its own LRU cache sees only the blocks of the
    requests routed to it."""
    mine = np.flatnonzero(replicas == replica)
    limit = float(job.candidates[c.candidate].model.max_context_tokens)
    key = (limit, mine.tobytes())
    if key not in job.replica_tables:
        job.replica_tables[key], _ = prefix_cache.stream_table(
            job.tables, mine, limit, truncates(job))
    table = job.replica_tables[key]
    out = np.zeros(length, np.float32)
    out[:len(mine)] = prefix_cache.cached_tokens(table, capacity_tokens, xp=np)
    return out


def met(job: OptimizeJob, sim: dict[str, float]) -> bool:
    """Whether simulated p99s are within the SLO (and the simulation finished)."""
    slo = job.app.slo
    return (int(sim["status"]) & status.INVALID == 0
            and sim["ttft_p99_s"] <= slo.ttft_p99_s
            and sim["itl_p99_s"] <= slo.itl_p99_s
            and sim["rejected_fraction"] <= slo.max_rejected_fraction)


def trace_coverage(job: OptimizeJob, requests: int) -> str | None:
    """A note when the simulated requests replay only part of the trace's
    recorded arrivals (``workload.arrival=trace``): a bursty trace's p99
    depends on which of its bursts the simulated rows hold
    (``arrivals.replay_coverage``). None otherwise."""
    part = replay_coverage(job.app.workload, job.tables, requests)
    if part is None:
        return None
    return (f"  the simulated requests replay {part} (the search read the whole "
            "trace at it), and its bursts outside them are not simulated; "
            f"search.verify_requests_max={trace_rows(job)} replays all of it")


def run(job: OptimizeJob, log=print) -> Outcome:
    """Search, verify and tighten; raises ``Infeasible`` when nothing meets the SLO.

    Args:
      log: called with one line per step worth reporting.
    """
    app, s = job.app, job.app.search
    n = len(job.candidates)
    ttft_t = np.full(n, app.slo.ttft_p99_s)
    itl_t = np.full(n, app.slo.itl_p99_s)
    key_init, key_sim = jax.random.split(jax.random.key(app.seed))
    init = descent.initial_theta(key_init, job.settings,
                                n + (-n % descent.PAD), s.restarts)
    cache: dict[tuple, Config] = {}
    missed: dict[int, int] = {}  # per candidate probed: most replicas that missed
    # one replica of the cheapest candidate: nothing costs less
    least_usd = float(_costs(job, np.ones(n))[0].min()) * (1.0 + 1e-9)
    verifications: list[Verification] = []
    lines: list[str] = []
    evaluations, search_s, simulate_s = 0, 0.0, 0.0

    def say(line: str) -> None:
        lines.append(line)
        log(line)

    for rnd in range(1, s.rounds + 1):
        t0 = time.perf_counter()
        res = descent.search(_candidates(job, ttft_t, itl_t), init, job.settings)
        search_s += time.perf_counter() - t0
        evaluations += res.evaluations
        answers = [cache.get(a.key, a) if a is not None else None
                   for a in _answers(job, res, ttft_t, itl_t, rnd)]
        order = sorted((a for a in answers if a is not None),
                       key=lambda a: a.cost_per_mtok_out_usd)
        took = time.perf_counter() - t0
        say(f"round {rnd}: searched {n} candidates x {s.restarts} restarts "
            f"({res.evaluations:,} surrogate evaluations, {took:.1f} s); "
            f"{len(order)} meet the surrogate targets")
        if not order:
            if rnd == 1:
                raise Infeasible(_surrogate_infeasible(job, res), Outcome(
                    None, answers, verifications, res, ttft_t, itl_t, rnd,
                    evaluations, 0, search_s, simulate_s, lines))
            break
        # what costs as much as an answer confirmed already cannot be chosen
        confirmed_usd = _confirmed_usd(job, cache)
        todo = [a for a in order[:s.verify_top]
                if a.key not in cache and a.cost_per_mtok_out_usd < confirmed_usd]
        if todo:
            t0 = time.perf_counter()
            sims = simulate_configs(job, todo, key_sim, s.verify_top)
            simulate_s += time.perf_counter() - t0
            for a, sim in zip(todo, sims):
                a.simulated = sim
                cache[a.key] = a
                ok = met(job, sim)
                c = a.candidate
                targets = float(ttft_t[c]), float(itl_t[c])
                action = "confirmed" if ok else _tighten(job, a, ttft_t, itl_t)
                verifications.append(Verification(rnd, a, *targets, ok, action))
                say(_simulated_line(job, a, action))
            note = trace_coverage(job, max(int(sim["requests"]) for sim in sims))
            if note and note not in lines:
                say(note)
        best = cache.get(order[0].key)
        if best is not None and not met(job, best.simulated):
            continue  # tightened: search again
        # the cheapest answer is confirmed, or costs as much as one that is:
        # fewer replicas of the cheapest confirmed configuration's candidate,
        # the surrogate's best at each, simulated (``_fewer``)
        while (fewer := _fewer(job, cache, rnd, init, ttft_t, itl_t,
                               missed)) is not None:
            t0 = time.perf_counter()
            fewer.simulated = simulate_configs(job, [fewer], key_sim, s.verify_top)[0]
            simulate_s += time.perf_counter() - t0
            cache[fewer.key] = fewer
            ok = met(job, fewer.simulated)
            c = fewer.candidate
            if not ok:
                missed[c] = max(missed[c], fewer.replicas)
            action = f"{'confirmed' if ok else 'missed'} (fewer replicas)"
            verifications.append(Verification(
                rnd, fewer, float(ttft_t[c]), float(itl_t[c]), ok, action))
            say(_simulated_line(job, fewer, action))
        # answers confirmed just now with the surrogate above the simulator:
        # a cheaper configuration the surrogate put past the SLO may meet
        # it; raise their targets and look (``_loosen``), unless an answer
        # confirmed (this round's best, or fewer replicas of it) already
        # costs what one replica of the cheapest candidate costs (with no
        # best simulated, nothing was: ``todo`` is empty)
        cheaper = rnd < s.rounds and _confirmed_usd(job, cache) > least_usd
        raised = [line for line in (_loosen(job, a, ttft_t, itl_t) for a in todo
                                    if met(job, a.simulated))
                  if line] if cheaper else []
        if not raised:
            break
        for line in raised:
            say(f"  {line}")
    confirmed = [c for c in cache.values() if met(job, c.simulated)]
    chosen = min(confirmed, key=lambda c: c.cost_per_mtok_out_usd, default=None)
    out = Outcome(chosen, answers, verifications, res, ttft_t, itl_t, rnd,
                  evaluations, len(cache), search_s, simulate_s, lines)
    if chosen is None:
        raise Infeasible(_simulated_infeasible(job, list(cache.values()), rnd), out)
    # a candidate's row shows its cheapest confirmed configuration (the chosen
    # one's, the chosen), even from an earlier round: a later round's answer
    # at raised or lowered targets is the surrogate's word only
    shown: dict[int, Config] = {}
    for a in confirmed:
        c = a.candidate
        if c not in shown or a.cost_per_mtok_out_usd < shown[c].cost_per_mtok_out_usd:
            shown[c] = a
    for c, a in shown.items():
        answers[c] = a
    return out


def _confirmed_usd(job: OptimizeJob, cache: dict[tuple, Config]) -> float:
    """What the cheapest configuration the simulator confirmed costs (USD
    per 1M output tokens; inf: none)."""
    return min((c.cost_per_mtok_out_usd for c in cache.values()
                if met(job, c.simulated)), default=math.inf)


def _simulated_line(job: OptimizeJob, a: Config, action: str) -> str:
    """What a simulated configuration's line says."""
    sim = a.simulated
    rejected = (f", {sim['rejected_fraction']:.2%} rejected"
                if sim["rejected_fraction"] > 0 else "")
    return (f"  simulated {job.candidates[a.candidate].label}, "
            f"{count_text(a.replicas, 'replica')}, max_num_seqs {a.concurrency}, "
            f"max_num_batched_tokens {a.token_budget}: p99 TTFT "
            f"{sim['ttft_p99_s']:.4g} s, p99 ITL {sim['itl_p99_s']:.4g} s "
            f"over {sim['requests']:,} requests{rejected} -> {action}")


HELD_STEPS = 40
"""Optimizer steps of a search held on fewer replicas (``_best_at``), at
most ``search.steps``. Its lanes all search one candidate from the
round's starts (96 with the default settings), which the search of
every candidate spends 4 each on: on 17 probes of five workloads the best
of 96 lanes after 40 steps read a ``max(p99 / target)`` as low as after
150, or lower, where 5 lanes after 150 read up to 27 % higher
(``benchmarks/README.md``, "Fewer replicas: one candidate in every
lane")."""


def _fewer(job: OptimizeJob, cache: dict[tuple, Config], rnd: int, init,
           ttft_t, itl_t, missed: dict[int, int]) -> Config | None:
    """The surrogate's best configuration of the cheapest confirmed one's
    candidate on fewer replicas, with its numbers there; None where no
    count is left between the most replicas that missed (``missed``) and
    the confirmed ones, the surrogate finds no steady state there, or its
    best was simulated already.

    The first probe of a candidate is one replica fewer; then the counts
    are halved between the two (the simulator's p99s rise as replicas are
    taken away), so 34 confirmed replicas take about 6 probes, not 33.
    The search runs on that many replicas only (``descent.at_replicas``,
    the same compiled program, every lane on the candidate: ``_best_at``):
    its optimizer moves the concurrency and the token budget, and the
    lattice neighbour with the least ``max(p99 / target)`` is kept. The
    raised targets of ``_loosen`` look for a cheaper answer through the
    surrogate, which may still put it past a target that the simulator
    finds met; this asks the simulator directly, whatever
    ``search.loosen_margin``."""
    confirmed = [a for a in cache.values() if met(job, a.simulated)]
    if not confirmed:
        return None
    top = min(confirmed, key=lambda a: a.cost_per_mtok_out_usd)
    c = top.candidate
    cands = None  # stacked once for every probe of this call
    while (r := probe_count(top.replicas, missed.get(c))) is not None:
        missed.setdefault(c, 0)
        if cands is None:
            cands = _candidates(job, ttft_t, itl_t)
        found = _best_at(job, c, r, top, init, cands, ttft_t, itl_t, rnd)
        if found is not None and found.key not in cache:
            return found
        # no steady state there, or simulated already (a miss: met, it would
        # be the cheapest): halve again below the confirmed count
        missed[c] = r
    return None


def probe_count(confirmed: int, missed: int | None) -> int | None:
    """The replicas to simulate next below the fewest ``confirmed``: one
    fewer at first (``missed`` None: none probed yet), then halfway to the
    most that ``missed``; None where no count is left between them."""
    r = confirmed - 1 if missed is None else (missed + confirmed) // 2
    return r if r > (missed or 0) else None


def _best_at(job: OptimizeJob, c: int, r: int, top: Config, init,
             cands: descent.Candidates, ttft_t, itl_t, rnd: int) -> Config | None:
    """The surrogate's best configuration of candidate ``c`` of ``cands``
    (``_candidates`` at targets ``ttft_t``, ``itl_t``) on ``r`` replicas
    (``_fewer``), with its numbers there; None where the surrogate finds no
    steady state.

    The round's compiled search runs with every lane on ``c``: from every
    start of ``init`` (each candidate's) and from ``top``'s engine settings,
    ``HELD_STEPS`` steps each, and the lattice neighbour with the least
    ``max(p99 / target)`` of them all is kept, of those below the capacity
    (the surrogate's utilisation below 1: a steady state)."""
    every = jax.tree.map(lambda x: np.repeat(np.asarray(x)[c:c + 1], len(x), axis=0),
                         cands)
    start = np.array(init, np.float32)
    start[..., 2] = np.log(r)
    start[0, 0] = np.log([top.concurrency, top.token_budget, r])
    s = job.settings
    res = descent.search(every, start, s,
                         descent.at_replicas(s, r, min(s.steps, HELD_STEPS)))
    worst = np.maximum(res.reach["ttft_p99_s"] / ttft_t[c],
                       res.reach["itl_p99_s"] / itl_t[c])
    # past the capacity a queue grows without bound: a finite simulated
    # stream can read it within the SLO (one H100 at 3.8x its capacity: p99
    # TTFT 40.9 s over 1,000 requests, 582 s over 10,000)
    worst = np.where(res.reach["utilization"] < 1.0, worst, np.nan)
    if not np.isfinite(worst).any():
        return None
    i = np.unravel_index(np.argmin(np.where(np.isfinite(worst), worst, np.inf)),
                         worst.shape)
    per_mtok, per_month = _costs(job, np.full(len(job.candidates), r))
    return Config(candidate=c, concurrency=int(res.concurrency[i]),
                  token_budget=int(res.token_budget[i]), replicas=r,
                  surrogate={m: float(res.reach[m][i]) for m in descent.METRICS},
                  cost_per_mtok_out_usd=float(per_mtok[c]),
                  cost_per_month_usd=float(per_month[c]), round=rnd)


def _held(job: OptimizeJob, ttft_t, itl_t):
    """``(metric, the candidates' surrogate targets, the SLO's limit)`` of
    each p99 the SLO holds: what ``_tighten`` lowers and ``_loosen`` raises."""
    slo = job.app.slo
    return (("ttft", ttft_t, slo.ttft_p99_s), ("itl", itl_t, slo.itl_p99_s))


def _tighten(job: OptimizeJob, a: Config, ttft_t, itl_t) -> str:
    """Lowers the candidate's surrogate targets by the simulator's excess."""
    slo, margin = job.app.slo, job.app.search.tighten_margin
    sim, c = a.simulated, a.candidate
    done = []
    for name, target, limit in _held(job, ttft_t, itl_t):
        simulated = sim[f"{name}_p99_s"]
        if not np.isfinite(simulated) or simulated > limit:
            ratio = (limit / simulated if np.isfinite(simulated) else margin)
            surrogate = a.surrogate[f"{name}_p99_s"]
            target[c] = min(target[c], surrogate * ratio) * margin
            done.append(f"{name.upper()} target -> {target[c]:.4g} s")
    rejected = sim["rejected_fraction"]
    if not rejected <= slo.max_rejected_fraction:
        done.append(f"rejected {rejected:.2%} > slo.max_rejected_fraction")
    return "missed; " + ", ".join(done)


def _loosen(job: OptimizeJob, a: Config, ttft_t, itl_t) -> str:
    """Raises the candidate's surrogate targets where the simulator read its
    confirmed answer ``a`` below the surrogate, to the surrogate's p99 that maps
    to the SLO under the same ratio (``surrogate * slo / simulated``, the
    converse of ``_tighten``), times ``search.loosen_margin``; '' where none
    rises. What the raised targets admit is simulated like any answer: a
    cheaper configuration is chosen only if confirmed (one that misses is
    tightened again). On the Azure code trace at its recorded pace the
    surrogate read two TP-1 replicas' p99 TTFT at 1.07 s, the simulator
    0.93 s (SLO 1 s): the search answered three, 50 % dearer
    (``benchmarks/README.md``, "Confirmed answers with slack"). The margin:
    the ratio at the answer confirmed is not the ratio one replica fewer
    (there 1.04 at three replicas, 1.15 at two); ``_fewer`` asks the
    simulator there directly. Not where the simulated
    requests replay only part of a trace (``trace_coverage``): the bursts
    outside them would make the ratio the window's, not the surrogate's."""
    sim, c = a.simulated, a.candidate
    if trace_coverage(job, int(sim["requests"])):
        return ""
    done = []
    for name, target, limit in _held(job, ttft_t, itl_t):
        simulated, surrogate = sim[f"{name}_p99_s"], a.surrogate[f"{name}_p99_s"]
        if 0.0 < simulated < surrogate:
            raised = surrogate * limit / simulated * job.app.search.loosen_margin
            if raised > target[c] * (1.0 + 1e-6):
                target[c] = raised
                done.append(f"{name.upper()} target -> {raised:.4g} s")
    if not done:
        return ""
    return (f"{job.candidates[c].label}: the simulator reads below the surrogate, "
            "looking for a cheaper answer: " + ", ".join(done))


def _simulated_infeasible(job: OptimizeJob, tried: list[Config], rounds: int) -> str:
    slo = job.app.slo
    ttft = min(tried, key=lambda c: c.simulated["ttft_p99_s"])
    itl = min(tried, key=lambda c: c.simulated["itl_p99_s"])
    miss_itl = itl.simulated["itl_p99_s"] > slo.itl_p99_s
    binding, best = (("slo.itl_p99_s", itl) if miss_itl or not np.isfinite(
        itl.simulated["itl_p99_s"]) else ("slo.ttft_p99_s", ttft))
    metric = binding.split(".")[1]
    return (f"infeasible SLO: binding constraint {binding} = {getattr(slo, metric):g} "
            f"s; the simulator missed it on every verified configuration after "
            f"{rounds} round(s); best simulated p99 {best.simulated[metric]:.4g} s "
            f"({job.candidates[best.candidate].label}, "
            f"{count_text(best.replicas, 'replica')}, "
            f"max_num_seqs {best.concurrency}, max_num_batched_tokens "
            f"{best.token_budget}); allowed: a looser limit, more search.rounds or "
            "search.replicas_max")


def speculation_line(job: OptimizeJob, out: Outcome) -> str:
    """Which speculative proposal length (and proposer, where several are
    searched) wins: the cheapest answer at each k of ``search.spec_tokens``
    and proposer of ``search.spec_proposer`` (empty when one is searched)."""
    s = job.app.search
    several = len(s.spec_proposer) > 1
    choices = [(int(k), p) for k in s.spec_values for p in _proposers(s, int(k))]
    if len(choices) < 2:
        return ""

    def name(k: int, p: str) -> str:
        return f"k={k}" + (f" {p}" if k and several else "")

    best: dict[tuple[int, str], float] = {}
    for a in out.answers:
        if a is not None:
            c = job.candidates[a.candidate]
            key = (c.spec_tokens, c.spec_proposer)
            best[key] = min(best.get(key, math.inf), a.cost_per_mtok_out_usd)
    per = ", ".join(f"{name(*c)}: " + (f"{best[c]:.4g}" if c in best
                                       else "none meets the SLO") for c in choices)
    words = {"ngram": "n-gram", "draft": "draft model", "eagle3": "EAGLE-3 head"}
    rates = set(s.acceptance.values())
    how = (" and ".join(words[p] for p in s.spec_proposer)
           + (f", acceptance {rates.pop():g}" if len(rates) == 1 else
              ", acceptance " + ", ".join(f"{a:g} ({words[p]})"
                                          for p, a in s.acceptance.items())))
    if out.chosen is None:
        win = "no aggregated deployment is confirmed"
    else:
        c = job.candidates[out.chosen.candidate]
        win = f"{name(c.spec_tokens, c.spec_proposer)} wins"
    return (f"speculative decoding ({how}): "
            f"{win}; cheapest USD / 1M output tokens per k"
            f"{' and proposer' if several else ''} (surrogate): {per}")


def count_text(n: int, noun: str) -> str:
    """``"1 replica"``, ``"3 replicas"``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def engine_flags(job: OptimizeJob, cand: Candidate, engine: str, concurrency,
                 token_budget, *, prefill: bool = True,
                 decode: bool = True) -> dict[str, int | float | str]:
    """A candidate's arguments for ``engine`` (``sweep.cube.engines``) at these
    settings, its model's quantisation and KV-cache dtype included: prefix
    caching where it prefills, speculation where it decodes (a
    disaggregated pool does one of the two)."""
    return engines.flags(
        engine, tensor_parallel=cand.tp, concurrency=concurrency,
        token_budget=token_budget,
        gpu_memory_utilization=job.app.search.gpu_memory_utilization,
        memory_bytes=cand.hardware.memory_bytes,
        weight_bytes=_weight_bytes(model_params(cand.model)),
        weight_dtype=cand.model.weight_dtype, kv_dtype=cand.model.kv_dtype,
        spec_tokens=cand.spec_tokens if decode else 0,
        prefix_caching=prefill and caching(job),
        draft_model=_draft_hf_id(cand) if decode else "",
        eagle3=cand.spec_proposer == "eagle3")


def engine_notes(job: OptimizeJob, cand: Candidate, engine: str) -> list[str]:
    """What ``engine_flags`` cannot say (``sweep.cube.engines.notes``)."""
    return engines.notes(engine, cand.model.weight_dtype, cand.spec_tokens,
                         caching(job), _draft_hf_id(cand),
                         cand.spec_proposer == "eagle3")


def serving_flags(job: OptimizeJob, c: Config, engine: str = "vllm") -> str:
    """A configuration's arguments for ``engine`` and its replicas."""
    values = engine_flags(job, job.candidates[c.candidate], engine, c.concurrency,
                          c.token_budget)
    return f"{engines.command_line(values)}  (x {count_text(c.replicas, 'replica')})"


def serving_notes(job: OptimizeJob, c: Config, engine: str = "vllm") -> list[str]:
    """What ``serving_flags`` cannot say."""
    return engine_notes(job, job.candidates[c.candidate], engine)


def _weight_bytes(model) -> float:
    """Both models' weights where the candidate loads a draft model."""
    d = roofline.draft_model(model)
    return float(roofline.weight_bytes(model)
                 + (0.0 if d is None else roofline.weight_bytes(d)))


def _draft_hf_id(cand: Candidate) -> str:
    """The Hugging Face id of the candidate's draft model or EAGLE-3 head (""
    under n-gram)."""
    if cand.spec_proposer == "ngram" or cand.model.draft is None:
        return ""
    return cand.model.draft.hf_id or cand.model.draft.name


def kv_note(job: OptimizeJob, c: Config) -> str | None:
    """A line where ``max_num_seqs`` is above the requests of the workload's
    mean context (prompt + output) the KV cache holds: a grid point at that
    concurrency does not fit (``kv_fits``: every sequence at its context at
    once), an engine's ``max_num_seqs`` only caps admission; each request
    holds its proposals' slots too, as ``prepare`` counts them. None
    otherwise."""
    cand = job.candidates[c.candidate]
    context = job.tables.mean_prompt_tokens + job.tables.mean_output_tokens
    held = int(cand.kv_tokens // (context + cand.spec_tokens))
    if c.concurrency <= held:
        return None
    return (f"max_num_seqs {c.concurrency} caps admission: the KV cache holds "
            f"about {held:,} requests of the workload's mean context ({context:,.0f} "
            "tokens), and the engine admits by free KV blocks, as the simulation "
            "did (a sweep-grid point at this concurrency does not fit: kv_fits "
            "counts every sequence at its context at once)")


def bench_command(job: OptimizeJob, c: Config) -> str:
    """The ``vllm bench serve`` run that checks ``c`` on one real replica; with
    prefix caching its prompts share the cached prefix of the mean prompt at
    the candidate's hit fraction (the search's)."""
    w, slo = job.app.workload, job.app.slo
    cand = job.candidates[c.candidate]
    prompt = job.tables.mean_prompt_tokens
    return engines.bench_command(
        hf_id=cand.model.hf_id,
        request_rate_per_s=w.arrival_rate_per_s / c.replicas,
        num_prompts=job.app.search.verify_requests,
        prompt_tokens=prompt, output_tokens=job.tables.mean_output_tokens,
        ttft_p99_s=slo.ttft_p99_s, itl_p99_s=slo.itl_p99_s,
        cached_tokens=float(roofline.cached_prefix_tokens(
            prompt, _prefix_hits(job, [cand], *_stacked(job, [cand]))[0])))


def _var(dims, data, name: str, prefix: str = "", source: str = ""):
    """A variable with the attributes of ``name``'s declaration
    (``sweep.cube.contract``), its long name prefixed; ``source``: the latency
    model it comes from (the ``method`` attribute, as in a cube)."""
    attrs = contract.attrs(name)
    attrs["long_name"] = prefix + attrs["long_name"]
    if source:
        attrs["method"] = source
    return (dims, np.asarray(data), attrs)


def _candidate_vars(job: OptimizeJob, out: Outcome) -> dict:
    """Over ``candidate``: each candidate's answer of the last search (NaN
    where it meets the targets nowhere), with the simulator's numbers where
    verified."""
    cd = ("candidate",)
    ans = out.answers

    def col(get, default=np.nan):
        return np.array([get(a) if a is not None else default for a in ans])

    def sim(a, m):
        return a.simulated[m] if a.simulated is not None else np.nan

    data = {
        "usd_per_gpu_hour": _var(cd, [c.hardware.usd_per_gpu_hour
                                      for c in job.candidates], "usd_per_gpu_hour"),
        "memory_bytes": _var(cd, [c.hardware.memory_bytes for c in job.candidates],
                             "memory_bytes"),
        "weight_bytes": _var(cd, [float(roofline.weight_bytes(model_params(c.model)))
                                  for c in job.candidates], "weight_bytes"),
        "meets_targets": _var(cd, col(lambda a: True, False), "meets_targets"),
        **{name: _var(cd, col(lambda a, name=name: getattr(a, name)), name)
           for name in ("concurrency", "token_budget", "replicas",
                        "cost_per_mtok_out_usd", "cost_per_month_usd")},
        "ttft_target_s": _var(cd, out.ttft_target_s, "ttft_target_s"),
        "itl_target_s": _var(cd, out.itl_target_s, "itl_target_s"),
        "verified": _var(cd, col(lambda a: a.simulated is not None, False),
                         "verified"),
        "slo_met_simulated": _var(cd, col(lambda a: a.simulated is not None
                                          and met(job, a.simulated), False),
                                  "slo_met_simulated"),
    }
    for m in contract.LATENCY:
        data[f"surrogate_{m}"] = _var(cd, col(lambda a, m=m: a.surrogate[m]), m,
                                      "surrogate ", "surrogate")
        data[f"simulated_{m}"] = _var(cd, col(lambda a, m=m: sim(a, m)), m,
                                      "simulated ", "simulate")
    data["simulated_rejected_fraction"] = _var(
        cd, col(lambda a: sim(a, "rejected_fraction")), "rejected_fraction",
        "simulated ", "simulate")
    data["utilization"] = _var(cd, col(lambda a: a.surrogate["utilization"]),
                               "utilization")
    slo = job.app.slo
    for name, limit in (("ttft", slo.ttft_p99_s), ("itl", slo.itl_p99_s)):
        p99 = np.where(data["verified"][1], data[f"simulated_{name}_p99_s"][1],
                       data[f"surrogate_{name}_p99_s"][1])
        data[f"{name}_slack_s"] = _var(cd, limit - p99, f"{name}_slack_s")
    chosen = out.chosen.candidate if out.chosen is not None else -1
    data["chosen"] = _var(cd, np.arange(len(job.candidates)) == chosen, "chosen")
    return data


def _config_vars(job: OptimizeJob, out: Outcome) -> dict:
    """Over ``config``: every integer configuration of the last search
    (candidate x restart x neighbour) meeting the targets, and the Pareto
    fronts of cost against each SLO metric."""
    res = out.last
    n = len(job.candidates)
    idx = np.argwhere(res.feasible[:n])
    per_mtok, per_month = _costs(job, res.replicas[:n])
    pick = tuple(idx.T)
    cfg = ("config",)
    cost = per_mtok[pick]
    data = {
        "config_candidate": _var(cfg, idx[:, 0], "candidate"),
        "config_concurrency": _var(cfg, res.concurrency[:n][pick], "concurrency"),
        "config_token_budget": _var(cfg, res.token_budget[:n][pick], "token_budget"),
        "config_replicas": _var(cfg, res.replicas[:n][pick], "replicas"),
        "config_cost_per_mtok_out_usd": _var(cfg, cost, "cost_per_mtok_out_usd"),
        "config_cost_per_month_usd": _var(cfg, per_month[pick], "cost_per_month_usd"),
    }
    for m in contract.SLO:
        data[f"config_{m}"] = _var(cfg, res.metrics[m][:n][pick], m, "surrogate ",
                                   "surrogate")
    for front, m in (("pareto_itl", "itl_p99_s"), ("pareto_ttft", "ttft_p99_s")):
        data[front] = _var(cfg, pareto.front(cost, data[f"config_{m}"][1]), front)
    return data


def _verification_vars(out: Outcome) -> dict:
    """Over ``verification``: each simulation, in order."""
    v = out.verifications
    vd = ("verification",)
    data = {
        "verification_round": _var(vd, np.array([x.round for x in v], int), "round"),
        "verification_candidate": _var(
            vd, np.array([x.config.candidate for x in v], int), "candidate"),
        **{f"verification_{name}": _var(
            vd, [getattr(x.config, name) for x in v], name)
           for name in ("concurrency", "token_budget", "replicas")},
        "verification_ttft_target_s": _var(vd, [x.ttft_target_s for x in v],
                                           "ttft_target_s"),
        "verification_itl_target_s": _var(vd, [x.itl_target_s for x in v],
                                          "itl_target_s"),
        "verification_slo_met": _var(vd, np.array([x.met for x in v], bool),
                                     "slo_met_simulated"),
        # the sample each simulated p99 is over (verification_requests)
        "verification_requests": _var(
            vd, np.array([x.config.simulated["requests"] for x in v], np.int32),
            "simulated_requests"),
    }
    for m in contract.SLO:
        data[f"verification_surrogate_{m}"] = _var(
            vd, [x.config.surrogate[m] for x in v], m, "surrogate ", "surrogate")
        data[f"verification_simulated_{m}"] = _var(
            vd, [x.config.simulated[m] for x in v], m, "simulated ", "simulate")
    return data


def _candidate_coords(job: OptimizeJob) -> dict:
    cd = ("candidate",)
    cands = job.candidates
    return {
        "candidate": _var(cd, np.arange(len(cands)), "candidate"),
        "hardware": _var(cd, np.array([c.hardware.name for c in cands]), "hardware"),
        "model": _var(cd, np.array([c.model.name for c in cands]), "model"),
        "tensor_parallel": _var(cd, [c.tp for c in cands], "tensor_parallel"),
        **{d: _var(cd, np.array([getattr(c.model, d) for c in cands]), d)
           for d in ("weight_dtype", "kv_dtype")},
        "spec_tokens": _var(cd, [c.spec_tokens for c in cands], "spec_tokens"),
        "spec_proposer": _var(cd, [roofline.PROPOSERS.index(c.spec_proposer)
                                   for c in cands], "spec_proposer"),
    }


def _global_attrs(job: OptimizeJob, out: Outcome, attrs: dict) -> dict:
    """The run's attributes: the SLO, the chosen configuration (none when no
    aggregated deployment met the SLO), the search's counts and log."""
    slo, s = job.app.slo, job.app.search
    return {
        **attrs,
        "workload": job.app.workload.name,
        "arrival_rate_per_s": job.app.workload.arrival_rate_per_s,
        "slo_ttft_p99_s": slo.ttft_p99_s,
        "slo_itl_p99_s": slo.itl_p99_s,
        "spec_acceptance": (list(s.acceptance.values())
                            if isinstance(s.spec_acceptance, (list, tuple))
                            else float(s.spec_acceptance)),
        **(_chosen_attrs(job, out.chosen) if out.chosen is not None else {}),
        "rounds": out.rounds,
        "surrogate_evaluations": out.evaluations,
        "simulations": out.simulations,
        "simulated_requests_per_replica": s.verify_requests,
        "simulated_requests_max": s.verify_requests_max,
        "routing": s.routing.value,
        "search_wall_s": round(out.search_s, 3),
        "simulate_wall_s": round(out.simulate_s, 3),
        "excluded_candidates": "; ".join(job.excluded),
        "log": "\n".join(out.log),
    }


def _chosen_attrs(job: OptimizeJob, c: Config) -> dict:
    """The chosen configuration, its flags per engine and its benchmark."""
    cand = job.candidates[c.candidate]
    return {
        "chosen_hardware": cand.hardware.name,
        "chosen_model": cand.model.name,
        "chosen_weight_dtype": cand.model.weight_dtype,
        "chosen_kv_dtype": cand.model.kv_dtype,
        "chosen_tensor_parallel": cand.tp,
        "chosen_spec_tokens": cand.spec_tokens,
        "chosen_spec_proposer": cand.spec_proposer,
        "chosen_replicas": c.replicas,
        "chosen_concurrency": c.concurrency,
        "chosen_token_budget": c.token_budget,
        "chosen_cost_per_mtok_out_usd": c.cost_per_mtok_out_usd,
        "chosen_cost_per_month_usd": c.cost_per_month_usd,
        **{f"{e}_flags": serving_flags(job, c, e) for e in engines.ENGINES},
        **{f"{e}_notes": "\n".join(serving_notes(job, c, e))
           for e in engines.ENGINES if serving_notes(job, c, e)},
        "vllm_bench_command": bench_command(job, c),
    }


def to_dataset(job: OptimizeJob, out: Outcome, attrs: dict) -> xr.Dataset:
    """The result as a dataset: ``candidate``, ``config`` and ``verification`` dims.

    One builder per dim (``_candidate_vars``, ``_config_vars``,
    ``_verification_vars``); every variable's units and long name come from
    ``sweep.cube.contract``, and each latency percentile it declares appears as
    ``surrogate_<name>`` and ``simulated_<name>`` per candidate. ``config``
    marks the Pareto fronts of cost against p99 ITL / TTFT (``pareto_itl``,
    ``pareto_ttft``). The chosen configuration is in the ``chosen_*``
    attributes, its flags for each engine (``vllm_flags``,
    ``sglang_flags``, ``trtllm_flags``) and ``vllm_bench_command``.
    """
    data = {**_candidate_vars(job, out), **_config_vars(job, out),
            **_verification_vars(out)}
    return xr.Dataset(data, coords=_candidate_coords(job),
                      attrs=_global_attrs(job, out, attrs))


def write(ds: xr.Dataset, out: Path) -> None:
    """Writes the dataset to zarr under a temporary name, then moves it into
    place; an existing ``out`` is replaced only when the tool wrote it
    (``sweep.cube.outputs``; the caller holds ``out``'s lock)."""
    import zarr

    with outputs.staged(out) as tmp:
        ds.to_zarr(tmp, mode="w", consolidated=False, zarr_format=2,
                   write_empty_chunks=True)  # every chunk's file: see check_chunks
        outputs.mark(tmp, "optimize")
        zarr.consolidate_metadata(str(tmp), zarr_format=2)
        outputs.install(tmp, out, "optimize")
