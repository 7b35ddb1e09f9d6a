"""``sweep-optimize``'s disaggregated deployments: enumerated, then simulated.

With ``search.disaggregated=[false,true]`` the optimizer also prices
deployments of ``p`` prefill and ``d`` decode instances (DistServe,
Splitwise, vLLM's disaggregated prefilling) against the aggregated answer
of ``sweep.search.optimize.run``. The analytic surrogate models one
aggregated engine, so these candidates get their figures from the roofline
and the simulator instead:

1. **Enumeration** (roofline, per candidate hardware x model x TP, the
   decode pool's, and per TP of the prefill pool among the candidates' on
   that hardware and model): for each
   ``max_num_seqs`` N and ``max_num_batched_tokens`` B of the search's
   powers of two, one decode instance serves ``N gain / step(N) / (E[out] -
   1)`` requests a second (the decode-only step at the mean context, ``E[out]
   - 1`` tokens after the prefill's first) and one prefill instance ``1 /
   E[prefill(prompt, cached, B)]`` (prefill-only chunks at the budget, the
   mean over the prompts the pool serves, each after its own cached prefix:
   ``pool_prompts``). A setting whose decode step exceeds the ITL SLO, or
   whose mean zero-load TTFT (prefill + KV transfer) exceeds the TTFT SLO,
   is dropped. Each instance's link
   carries one transfer at a time (``sweep.latency.disaggregated``), so an
   instance's capacity is also one request per transfer time: a prefill
   instance is busy ``max(prefill, transfer)`` per request, a decode
   instance ``max(1 / its rate, transfer)``. The fewest instances that
   keep each pool below ``UTILIZATION_MAX`` of its capacity, ``p0`` and
   ``d0``, and the two next counts of each give nine P:D ratios; per
   candidate x prefill TP x ratio the setting with the most headroom is
   kept. A transfer runs over the smaller TP group's links.
2. **Verification**: in order of cost (GPUs of both pools; ties: headroom),
   ``verify_top`` deployments at a time run through the simulator
   (``sweep.latency.disaggregated``) on the aggregated verification's
   stream (common random numbers): ``verify_requests`` per instance of the
   batch's largest deployment, rounded up to a power of two, at most
   ``verify_requests_max``. The first batch with a deployment whose p99s
   meet the SLO gives the answer, its cheapest such; at most
   ``search.rounds`` batches.

The answer is compared with the aggregated one by USD per 1M output tokens
at the workload's rate (both pools' GPUs for the disaggregated one). When no
aggregated deployment meets the SLO (``optimize.Infeasible``), the
disaggregated answer stands alone (``winner``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import jax
import jax.numpy as jnp
import numpy as np
import xarray as xr

from sweep import exported, shapes
from sweep.config.convert import hardware_params, model_params
from sweep.cube import engines
from sweep.latency import prefix_cache
from sweep.latency.arrivals import Requests
from sweep.latency.disaggregated import simulate_disaggregated
from sweep.latency.p99 import served_requests
from sweep.latency.surrogate.lengths import hit_rows
from sweep.model import roofline
from sweep.model.cost import HOURS_PER_MONTH, cost_per_mtok_usd
from sweep.search.optimize import (
    count_text,
    engine_flags,
    engine_notes,
    lru,
    met,
    simulation_inputs,
    trace_rows,
    truncates,
    verification_hits,
    verification_stream,
)

UTILIZATION_MAX = 0.95
"""The highest share of a pool's roofline capacity a deployment may load."""
EXTRA_INSTANCES = 3
"""Instance counts per pool tried from the fewest up (p0, p0 + 1, p0 + 2)."""

@dataclass
class Deployment:
    """One disaggregated deployment of one candidate (hardware x model x TP:
    the decode pool's), its prefill pool at ``prefill_tp``."""

    candidate: int
    prefill_tp: int
    prefill_instances: int
    decode_instances: int
    concurrency: int  # max_num_seqs of every instance
    token_budget: int  # max_num_batched_tokens of every instance
    # offered / the pool's roofline capacity, its links' included
    prefill_utilization: float
    decode_utilization: float
    zero_load_ttft_s: float  # roofline: mean prefill (pool_prompts) + transfer
    itl_s: float  # roofline: the decode-only step at N
    cost_per_mtok_out_usd: float
    cost_per_month_usd: float
    simulated: dict[str, float] | None = None

    @property
    def ratio(self) -> str:
        """``"P:D"``."""
        return f"{self.prefill_instances}:{self.decode_instances}"

    @property
    def instances(self) -> int:
        return self.prefill_instances + self.decode_instances

    def gpus(self, job) -> int:
        """Both pools' GPUs (``job``: the ``OptimizeJob``, for the decode TP)."""
        return pool_gpus(self.prefill_tp, self.prefill_instances,
                         job.candidates[self.candidate].tp, self.decode_instances)


def pool_gpus(prefill_tp: int, p: int, decode_tp: int, d: int) -> int:
    """GPUs of ``p`` prefill instances and ``d`` decode instances."""
    return prefill_tp * p + decode_tp * d


@dataclass
class Result:
    """What ``run`` found: the cheapest verified deployment (None: none met
    the SLO), every simulated one in order, and the counts."""

    chosen: Deployment | None
    simulated: list[Deployment]
    enumerated: int
    simulate_s: float
    log: list[str] = field(default_factory=list)


def _powers_of_two(lo: int, hi: int) -> np.ndarray:
    out = [1 << i for i in range(31) if lo <= (1 << i) <= hi]
    return np.array(out or [lo], float)


def _engine(c) -> tuple:
    """What a prefill instance of candidate ``c`` runs, but its TP: the
    hardware, the model at its precision, the draft model it loads."""
    return (c.hardware.name, c.model.name, c.model.weight_dtype, c.model.kv_dtype,
            getattr(c.model.draft, "name", None))


def prefill_tps(job, cand) -> list[int]:
    """The TP sizes a prefill pool of ``cand`` may take: those of the
    candidates on its hardware with its model at its precision."""
    same = _engine(cand)[:4]
    return sorted({c.tp for c in job.candidates if _engine(c)[:4] == same})


def enumerate_deployments(job) -> list[Deployment]:
    """Step 1 of the module docstring, cheapest first (``job``: an
    ``OptimizeJob``)."""
    app, s = job.app, job.app.search
    tables = job.tables
    prompt, out_mean = tables.mean_prompt_tokens, tables.mean_output_tokens
    after_first = max(out_mean - 1.0, 1e-9)
    n_grid = _powers_of_two(s.concurrency_min, s.concurrency_max)
    b_grid = _powers_of_two(s.token_budget_min, s.token_budget_max)
    N, B = (x.ravel() for x in np.meshgrid(n_grid, b_grid, indexing="ij"))
    hashed = tables.pair_hashes is not None
    best: dict[tuple[int, int, int, int], Deployment] = {}
    computing: dict[tuple, np.ndarray] = {}

    def prefill_s(cand, hw, model, pre_tp: int, p: int) -> np.ndarray:
        """Per budget, a prefill instance's mean time per request among ``p``
        of TP ``pre_tp`` (``pool_prompts``); once per engine, not per decode
        candidate it may feed, and without block hashes once for every
        ``p``."""
        key = (_engine(cand), pre_tp, p if hashed else 0)
        if key not in computing:
            prompts, cached, weight = pool_prompts(job, cand, hw, model, pre_tp, p)
            f32 = np.float32
            computing[key] = np.asarray(roofline.chunked_prefill(
                hw, model, f32(pre_tp), 0.0, 0.0, prompts[None, :].astype(f32),
                B[:, None].astype(f32), 0.0, cached[None, :].astype(f32))[0],
                np.float64) @ weight
        return computing[key]

    for ci, cand in enumerate(job.candidates):
        rate = app.workload.arrival_rate_per_s * (1.0 - job.served[cand.model.name][1])
        hw = hardware_params(cand.hardware, s.gpu_memory_utilization)
        model = model_params(cand.model)
        tp, k = float(cand.tp), float(cand.spec_tokens)
        step = np.asarray(roofline.verify_step_s(hw, model, tp, N,
                                                 prompt + out_mean / 2, k), float)
        gain = float(roofline.tokens_per_step(k, cand.spec_acceptance))
        decode_rps = N * gain / step / after_first
        fits = np.asarray(roofline.kv_fits(hw, model, tp, N, prompt + out_mean + k))
        usd = cand.hardware.usd_per_gpu_hour
        for pre_tp in prefill_tps(job, cand):
            transfer = float(roofline.kv_transfer_s(hw, model, min(tp, pre_tp), prompt))

            busy_by_p: dict[int, np.ndarray] = {}

            def pre_busy(p):
                """Per budget, computing or sending, whichever is longer (an
                instance's link carries one transfer at a time); once per
                pool size, not per budget and decode pool it is read for."""
                if p not in busy_by_p:
                    busy_by_p[p] = np.maximum(prefill_s(cand, hw, model, pre_tp, p),
                                              transfer)
                return busy_by_p[p]

            # zero-load TTFT: the prefill and the transfer's part after it
            alone = prefill_s(cand, hw, model, pre_tp, 1)
            ttft0 = alone + np.asarray(
                roofline.kv_transfer_exposed_s(hw, model, transfer, alone), np.float64)
            # likewise a decode instance decoding or receiving
            dec_busy = np.maximum(1.0 / decode_rps, transfer)
            ok = (fits & (step <= app.slo.itl_p99_s) & (ttft0 <= app.slo.ttft_p99_s)
                  & (B >= N * (k + 1.0)))
            for i in np.flatnonzero(ok):
                # one instance's cache finds the most: the fewest instances
                p0 = max(math.ceil(rate * pre_busy(1)[i] / UTILIZATION_MAX), 1)
                d0 = max(math.ceil(rate * dec_busy[i] / UTILIZATION_MAX), 1)
                for p in range(p0, p0 + EXTRA_INSTANCES):
                    if p > s.disaggregated_max_instances:
                        continue
                    busy = pre_busy(p if hashed else 1)[i]
                    if hashed and rate * busy / p > UTILIZATION_MAX:
                        continue  # more instances, each cache finding less
                    for d in range(d0, d0 + EXTRA_INSTANCES):
                        if max(p, d) > s.disaggregated_max_instances:
                            continue
                        gpus = pool_gpus(pre_tp, p, cand.tp, d)
                        dep = Deployment(
                            ci, pre_tp, p, d, int(N[i]), int(B[i]), rate * busy / p,
                            rate * dec_busy[i] / d, float(ttft0[i]), float(step[i]),
                            float(cost_per_mtok_usd(usd, gpus, rate * out_mean)),
                            usd * gpus * HOURS_PER_MONTH)
                        key = (ci, pre_tp, p, d)
                        if key not in best or _headroom(dep) > _headroom(best[key]):
                            best[key] = dep
    return sorted(best.values(), key=lambda x: (x.cost_per_mtok_out_usd, -_headroom(x)))


def pool_prompts(job, cand, hw, model, tp: int, prefill_instances: int,
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The prompts a prefill pool of ``prefill_instances`` at TP ``tp``
    serves, each with its cached prefix, as ``(prompt_tokens, cached_tokens,
    weight)`` (weights summing to 1).

    With a trace's block hashes: each served request of the verification
    stream's first ``verify_requests`` per instance, at what its instance's
    LRU cache of its own prompts holds in its KV capacity
    (``prefix_cache.pool_table``), as the verification simulates it.
    Otherwise: every prompt length the model serves at every hit share of
    the workload (its levels, or its one fraction), in whole blocks
    (``roofline.cached_prefix_tokens``), weighted by both probabilities.
    """
    if job.tables.pair_hashes is None:
        served = served_requests(job.tables, job.app.workload, cand.model)[0]
        levels = ((served.hit_levels, served.hit_probs) if served.hit_levels is not None
                  else (np.array([served.prefix_hit_fraction]), np.ones(1)))
        prompts, cached, mass, _ = hit_rows(served.prompt_values, served.prompt_probs,
                                            *levels)
        return prompts, cached, mass / mass.sum()
    n = job.app.search.verify_requests * prefill_instances
    table, _ = lru(job, n, cand.model, prefill_instances)
    prompts, _, served, _ = job.streams[n].stream_requests(
        float(cand.model.max_context_tokens), truncates(job))
    # the table's prefixes are whole blocks, short of the prompt by a token
    cached = prefix_cache.cached_tokens(
        table, float(roofline.kv_capacity_tokens(hw, model, float(tp))), xp=np)
    return (prompts[served], cached[served],
            np.full(served.sum(), 1.0 / max(served.sum(), 1)))


def _headroom(d: Deployment) -> float:
    return -max(d.prefill_utilization, d.decode_utilization)


def _simulate(rows, shared, pre_tp, p, d, requests, hits, cached, *, max_prefill: int,
              max_decode: int, max_slots: int):
    """Every deployment (``rows``, ``pre_tp``, ``p``, ``d``, ``cached``:
    leading axis) over one stream; ``hits``: each request's share of its
    prompt in the prefix cache (``optimize.verification_hits``); ``cached``:
    each request's prefix in its prefill instance's LRU cache (0 without a
    trace's block hashes).
    ``SimResult``'s fields as a dict (a result ``sweep.exported`` can keep)."""
    def one(e, pre_tp, p, d, cached):
        return simulate_disaggregated(
            e.hw, e.model, e.tp, e.concurrency, e.token_budget, requests, p, d,
            shared.ttft_slo_s, shared.itl_slo_s, shared.overlong, e.spec_tokens,
            e.spec_acceptance, hits, cached, pre_tp,
            max_prefill_instances=max_prefill, max_decode_instances=max_decode,
            max_slots=max_slots)._asdict()

    return jax.vmap(one)(rows, pre_tp, p, d, cached)


def simulate_deployments(job, deps: list[Deployment], stream: Requests,
                         hits: np.ndarray, width: int) -> list[dict[str, float]]:
    """Each deployment over the first ``verify_requests x (p + d)`` requests
    of ``stream`` (each with its share in the prefix cache, ``hits``)
    rounded up to a power of two, on a trace's recorded arrivals at least
    the whole trace (``optimize.verification_requests``), at most
    ``verify_requests_max`` (one length per call, that of the largest), as
    ``SimResult`` fields with ``requests`` added."""
    s = job.app.search
    n = min(max(shapes.power_of_two(s.verify_requests * max(d.instances for d in deps)),
                trace_rows(job)),
            s.verify_requests_max, len(stream.arrival_s))
    rows = deps + [deps[0]] * (width - len(deps))
    engines, shared = simulation_inputs(
        job, [job.candidates[d.candidate] for d in rows],
        [d.concurrency for d in rows], [d.token_budget for d in rows])
    f32 = jnp.float32
    pre_tp = jnp.asarray([d.prefill_tp for d in rows], f32)
    cached = np.zeros((len(rows), n), np.float32)
    if job.tables.pair_hashes is not None:
        capacity = np.asarray(jax.vmap(roofline.kv_capacity_tokens)(
            engines.hw, engines.model, pre_tp))
        for i, dep in enumerate(rows):
            table, _ = lru(job, n, job.candidates[dep.candidate].model,
                           dep.prefill_instances)
            cached[i] = prefix_cache.cached_tokens(table, capacity[i], xp=np)
    sizes = {"max_prefill": shapes.power_of_two(max(d.prefill_instances for d in deps)),
             "max_decode": shapes.power_of_two(max(d.decode_instances for d in deps)),
             "max_slots": shapes.slots(max(d.concurrency for d in deps))}
    out = exported.call(
        _simulate, sizes, engines, shared, pre_tp,
        jnp.asarray([d.prefill_instances for d in rows], f32),
        jnp.asarray([d.decode_instances for d in rows], f32),
        jax.tree.map(lambda x: jnp.asarray(x[:n]), stream), jnp.asarray(hits[:n]),
        jnp.asarray(cached))
    out = jax.tree.map(np.asarray, out)
    return [{**{k: float(v[i]) for k, v in out.items()}, "requests": n}
            for i in range(len(deps))]


def run(job, log=print) -> Result:
    """Enumerate, then verify in order of cost (module docstring), on the
    aggregated verification's stream (``optimize.verification_stream`` with
    the key ``optimize.run`` simulates with).

    Args:
      job: the ``OptimizeJob``.
    """
    s = job.app.search
    key = jax.random.split(jax.random.key(job.app.seed))[1]
    stream, hits = verification_stream(job, key), verification_hits(job, key)
    lines: list[str] = []

    def say(line: str) -> None:
        lines.append(line)
        log(line)

    deps = enumerate_deployments(job)
    say(f"disaggregated: {len(deps)} deployments enumerated from the roofline "
        f"(P:D ratios of {len(job.candidates)} candidates)")
    tried: list[Deployment] = []
    chosen, simulate_s = None, 0.0
    for batch in range(s.rounds):
        todo = deps[batch * s.verify_top:(batch + 1) * s.verify_top]
        if not todo:
            break
        t0 = time.perf_counter()
        sims = simulate_deployments(job, todo, stream, hits, s.verify_top)
        simulate_s += time.perf_counter() - t0
        for dep, sim in zip(todo, sims):
            dep.simulated = sim
            tried.append(dep)
            ok = met(job, sim)
            say(f"  simulated {describe(job, dep)}: p99 TTFT "
                f"{sim['ttft_p99_s']:.4g} s, p99 ITL {sim['itl_p99_s']:.4g} s over "
                f"{sim['requests']:,} requests -> {'confirmed' if ok else 'missed'}")
        confirmed = [x for x in todo if met(job, x.simulated)]
        if confirmed:
            chosen = min(confirmed, key=lambda x: x.cost_per_mtok_out_usd)
            break
    return Result(chosen, tried, len(deps), simulate_s, lines)


def describe(job, d: Deployment) -> str:
    cand = job.candidates[d.candidate]
    return (f"{cand.label_at('')}, P:D {d.ratio} ({d.prefill_instances} prefill at "
            f"TP {d.prefill_tp} + {d.decode_instances} decode at TP {cand.tp}), "
            f"max_num_seqs {d.concurrency}, max_num_batched_tokens {d.token_budget}")


def pool_flags(job, d: Deployment, engine: str = "vllm") -> dict[str, str]:
    """``engine``'s arguments for each pool, ``{"prefill": ..., "decode": ...}``:
    the candidate's (prefix caching on prefill, speculation on decode) and
    the pool's own (``sweep.cube.engines.pool_flags``)."""
    cand = job.candidates[d.candidate]
    out = {}
    for pool, count, tp in (("prefill", d.prefill_instances, d.prefill_tp),
                            ("decode", d.decode_instances, cand.tp)):
        values = {**engine_flags(job, replace(cand, tp=tp), engine, d.concurrency,
                                 d.token_budget, prefill=pool == "prefill",
                                 decode=pool == "decode"),
                  **engines.pool_flags(engine, pool,
                                       cand.hardware.kv_transfer_layerwise)}
        out[pool] = (f"{engines.command_line(values)}  "
                     f"(x {count_text(count, 'instance')})")
    return out


def pool_notes(job, d: Deployment, engine: str = "vllm") -> list[str]:
    """What ``pool_flags`` cannot say: the candidate's notes and the front
    that routes requests to the pools, the longest prompt it serves sizing
    TensorRT-LLM's transfer buffer."""
    cand = job.candidates[d.candidate]
    longest = int(job.tables.prompt_values.max())
    if cand.model.max_context_tokens:
        longest = min(longest, int(cand.model.max_context_tokens))
    return [*engine_notes(job, cand, engine),
            engines.pool_note(engine, d.prefill_instances, d.decode_instances,
                              longest, cand.hardware.kv_transfer_layerwise)]


def winner(aggregated, result: Result) -> str | None:
    """``"aggregated"``, ``"disaggregated"`` (the cheaper confirmed one; a tie
    stays aggregated) or None when neither met the SLO."""
    d = result.chosen
    if d is None:
        return None if aggregated is None else "aggregated"
    if aggregated is None or d.cost_per_mtok_out_usd < aggregated.cost_per_mtok_out_usd:
        return "disaggregated"
    return "aggregated"


def verdict(job, aggregated, result: Result) -> str:
    """Which deployment wins, in one line (``aggregated``: the aggregated
    search's choice, None when no aggregated deployment met the SLO)."""
    d = result.chosen
    tail = (f"({result.enumerated} enumerated, {len(result.simulated)} simulated in "
            f"{result.simulate_s:.1f} s)")
    if d is None:
        if aggregated is None:
            return (f"neither wins: no aggregated and no disaggregated deployment met "
                    f"the SLO in the simulator {tail}")
        return (f"aggregated wins: no disaggregated deployment met the SLO in the "
                f"simulator {tail}; aggregated USD "
                f"{aggregated.cost_per_mtok_out_usd:.4g} / 1M output tokens")
    dis = d.cost_per_mtok_out_usd
    if aggregated is None:
        return (f"disaggregated wins: {describe(job, d)}: USD {dis:.4g} / 1M output "
                f"tokens; no aggregated deployment met the SLO {tail}")
    agg = aggregated.cost_per_mtok_out_usd
    if winner(aggregated, result) == "disaggregated":
        return (f"disaggregated wins: {describe(job, d)}: USD {dis:.4g} / 1M output "
                f"tokens vs aggregated USD {agg:.4g} ({dis / agg:.2f}x) {tail}")
    return (f"aggregated wins: USD {agg:.4g} / 1M output tokens vs the cheapest "
            f"disaggregated, {describe(job, d)}: USD {dis:.4g} ({dis / agg:.2f}x) "
            f"{tail}")


def annotate(ds: xr.Dataset, job, aggregated, result: Result) -> xr.Dataset:
    """The optimizer's dataset with the disaggregated search: every simulated
    deployment over ``disaggregated_verification``, and the choice in the
    attributes (``deployment``: which wins; ``disaggregated_*``: the
    cheapest verified disaggregated deployment, and each pool's flags for
    each engine with what they leave out, ``disaggregated_<pool>_<engine>_flags``
    and ``disaggregated_<engine>_notes``)."""
    from sweep.cube import contract

    dim = ("disaggregated_verification",)
    tried = result.simulated

    def var(name, values, prefix=""):
        attrs = contract.attrs(name)
        attrs["long_name"] = prefix + attrs["long_name"]
        return (dim, np.asarray(values), attrs)

    data = {
        "disaggregated_candidate": var("candidate", [d.candidate for d in tried]),
        **{f"disaggregated_{n}": var(n, [getattr(d, n) for d in tried])
           for n in ("prefill_instances", "decode_instances", "concurrency",
                     "token_budget", "cost_per_mtok_out_usd", "cost_per_month_usd")},
        "disaggregated_prefill_tensor_parallel": var(
            "tensor_parallel", [d.prefill_tp for d in tried], "prefill pool's "),
        **{f"disaggregated_simulated_{m}": var(
            m, [d.simulated[m] for d in tried], "simulated ") for m in contract.SLO},
        "disaggregated_slo_met": var("slo_met_simulated",
                                     [met(job, d.simulated) for d in tried]),
    }
    d = result.chosen
    # a dataset is written only when one of the two met the SLO
    attrs = {"deployment": winner(aggregated, result),
             "deployment_verdict": verdict(job, aggregated, result),
             "disaggregated_enumerated": result.enumerated,
             "disaggregated_simulate_wall_s": round(result.simulate_s, 3),
             "disaggregated_log": "\n".join(result.log)}
    if d is not None:
        cand = job.candidates[d.candidate]
        attrs.update({
            "disaggregated_hardware": cand.hardware.name,
            "disaggregated_model": cand.model.name,
            "disaggregated_prefill_tensor_parallel": d.prefill_tp,
            "disaggregated_decode_tensor_parallel": cand.tp,
            "disaggregated_prefill_instances": d.prefill_instances,
            "disaggregated_decode_instances": d.decode_instances,
            "disaggregated_concurrency": d.concurrency,
            "disaggregated_token_budget": d.token_budget,
            "disaggregated_cost_per_mtok_out_usd": d.cost_per_mtok_out_usd,
            "disaggregated_cost_per_month_usd": d.cost_per_month_usd,
            **{f"disaggregated_{pool}_{engine}_flags": flags
               for engine in engines.ENGINES
               for pool, flags in pool_flags(job, d, engine).items()},
            **{f"disaggregated_{engine}_notes": "\n".join(pool_notes(job, d, engine))
               for engine in engines.ENGINES},
        })
    return ds.assign(data).assign_attrs(attrs)

