"""Analytic surrogate of the serving simulator: smooth p50/p99 TTFT, ITL and E2E.

One grid point in, scalars out, differentiable in the concurrency, the token
budget and the arrival rate (the optax search descends it in log space). It
shares the roofline of ``sweep.model.roofline`` with the simulator and replaces the
simulation by the approximations below, one function per section; their
agreement with the simulator is measured in ``benchmarks/surrogate_agreement.py``
(``benchmarks/README.md``). Where an approximation cannot be exact it is
chosen to err high (a configuration the surrogate accepts should pass the
simulator).

**Lengths** (``latency_workload``). Prompt and output lengths are summarised
by the conditional means of fixed probability bands (``BAND_EDGES``, finer in
the upper tail so that p99 is resolved), computed once per workload in NumPy,
with the joint probability of (prompt band, output band): the product of the
marginals, or, when a trace's recorded (prompt, output) pairs are given, their
empirical joint; the decode-context moments follow the same law.

**Chunk steps at their cached prefix** (``_chunk_lines``, ``_Ramp``). A chunk
of ``m`` tokens after ``c`` cached ones, beside ``n`` decodes, takes
``max(memory(c), compute(c)) + fixed``, both lines in ``c``. A prompt's chunk
steps are taken at every prefix they occur at: its prefill time alone is the
exact sum of ``roofline.chunked_prefill`` (chunks of ``b = budget - n``
tokens, decodes being scheduled first), and the step times its chunks add to
the ITL distribution are the ramp from the first chunk to the last (cached
prefix uniform on ``[0, P - m]``): two uniform pieces in time, one on each
side of the point where memory and compute cross, each smoothed by a logistic
kernel (closed form). A draft model's first pass, over the decodes and the
chunk, adds a maximum of its own (``roofline.draft_lines``): exact in the
prefill time, at the ramp's three points in the ITL distribution.

**Steady state** (``_state``, a mean-field fixed point). When prompts queue,
steps are filled to the budget and a prompt of ``P`` tokens costs ``P / b``
full steps at its ramp's mean (the fluid service); alone, its exact chunked
time. The two are blended with the prefill server's utilisation ``rho_p``,
which solves ``rho_p = lam ((1 - rho_p) E[X_alone] + rho_p E[X_fluid])``.
Steps per second are ``lam E[k] + (1 - rho_p) / t_decode(n)``, and Little's
law for decode tokens gives ``n = lam E[O - 1] / steps_per_s``, capped by the
slots; it is solved by bisection, and its gradient is the implicit-function
one (``_numerics.bisect`` / ``implicit_step``). Slots are limited by the
concurrency and the KV cache: ``capacity / (mean KV of a running request +
its spread over the running set)``, the spread being the preemption pressure
(a running set near the capacity is preempted and recomputed, which the mean
alone does not see), a smooth minimum.

**Waiting** (``_slot_queue``, ``_wait_lattice``). Admission waits for one of
``c`` = slots. The requests holding slots form a birth-death chain whose
holding time grows with their number (every step carries every running
request): a negative binomial below ``c`` (Erlang C when the holding time
does not grow), continued to real ``c`` through the incomplete beta
function, and beyond ``c`` a queue served at the slots' saturated rate (the
mean-field utilisation put the waiting probability 8x low in a probe at
concurrency 16: ``benchmarks/README.md``). Given that it waits, a request
waits as in M/G/1 with service ``S / c`` (whose mean is the Allen-Cunneen
one: Whitt 1993, Prod. Oper. Manag. 2, 114-161). The prefill server is M/G/1
with the band mixture as its service law, and its wait is the exact
Pollaczek-Khinchine law: a geometric sum of residual service times,
``P(W <= t) = (1 - rho) sum_k rho^k R^{*k}(t)`` (Kleinrock 1975, *Queueing
Systems I*, sec. 5.7), computed on a lattice of ``WAIT_POINTS`` points by
FFT, where the sum is ``(1 - rho) / (1 - rho R(z))`` (exponentially damped
against wrap-around: Abate & Whitt 1992, Queueing Systems 10, 5-88); the
residual law is a mixture of uniforms, one per band, whose span keeps the
band's second moment (its within-band spread included: on heavy tails the
top bands' spread carries much of ``E[X^2]``), discretised
mean-preservingly. The admission wait is convolved in on the same lattice.
This holds at any service variability (``benchmarks/mg1_wait_tail.py``
measured the previous two-moment tail at 0.67-0.82x the exact p99 at cv 2),
and it is smooth in every parameter. ``1 - rho`` is kept positive by
``_numerics.slack``, so past saturation waits are large but finite.

**Co-batching.** Prompts that arrive while a prompt waits join its last step
when they fit in the budget it leaves, lengthening it: a wait ``w`` becomes
``w + c min(lam E[P] w, room)`` (``c`` the time of one more prefill token in a
step); the TTFT CDF inverts that map in closed form.

**TTFT** (``_ttft``) per prompt band = wait + the residual of the decode step
in progress (uniform over it; Poisson arrivals see time averages, Wolff 1982,
Oper. Res. 30, 223-231) + the band's exact chunked prefill beside ``n``
decodes, with a logistic kernel for the within-band spread; p50 and p99 are
found by bisection on the mixture's CDF with one implicit Newton step for the
gradient (``_numerics.quantile``).

**ITL** (``_itl``). Decode-only steps at ``1 + Poisson(n)`` decodes (the
M/G/infinity occupancy), capped at the slots, taken at band quantiles by the
Cornish-Fisher expansion; and mixed steps: the ramps of the prompts' chunk
steps, weighted by their step counts (alone: ``ceil(P / b)`` equal chunks;
under a prefill queue: ``P / b`` full-budget chunks). The share of gaps that
fall in mixed steps is prefill steps over all steps times the decoders a chunk
step carries relative to an average step: the prompts that were ahead of it in
the prefill queue have just started decoding, ``1 + (1 - rho_p) min(sojourn,
decode time) / decode time`` (sojourn: the prefill wait and service; decode
time: a request's ``(O - 1)`` gaps). It is raised by ``MIXED_SHARE_MARGIN``:
p99 ITL jumps from a decode step to a chunk step where that share crosses 1 %,
and there the estimate is not that exact (the simulator's share was 6-8 %
above it in two probes, ``benchmarks/README.md``), so it errs towards the
jump.

**E2E** per (prompt band, output band), with their joint probabilities: the
band's TTFT law shifted by ``(O - 1)`` mean gaps of a decoding request
(``_tagged_gap_s``: the steps it is in carry it besides the others, so at zero
load a gap is one decode of one sequence).

**Goodput** (``_good_fraction``): a request is good when its TTFT is within
the TTFT SLO and none of its gaps exceeds the ITL SLO (the simulator's
definition). Per band pair, ``P(TTFT <= slo)`` times the probability of no
slow gap: slow decode steps independent per gap, slow chunk steps counted as
episodes (a prompt whose chunk ramp exceeds the SLO slows every decoder during
its prefill), each prompt prefilled during the request's decode being one
chance of an episode.

Kernel spreads are derivatives taken in forward mode and held constant in
the gradient; the locations of all kernels carry the full gradient.

Not modelled: the correlation between consecutive steps' batch sizes; the
finite horizon of a simulation (past saturation a simulator's p99 TTFT grows
with the number of requests; here it is a large finite number, growing with
the overload up to ``rho = 10``); a preempted request's own recompute gap.
"""

from __future__ import annotations

from statistics import NormalDist
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sweep.cube import status as flags
from sweep.latency.workload import WorkloadTables
from sweep.model import roofline
from sweep.model._numerics import (
    betainc,
    bisect,
    implicit_step,
    quantile,
    safe_div,
    safe_max,
    safe_sqrt,
    slack,
    smooth_max,
    smooth_min,
    softplus,
    ste_ceil,
)

BAND_EDGES = np.array([0.0, 0.05, 0.15, 0.25, 0.35, 0.45, 0.55, 0.65, 0.75, 0.85,
                       0.9, 0.95, 0.97, 0.98, 0.99, 0.995, 0.998, 1.0])
"""Probability bands of the length summaries: finer where p99 lives."""

_Z_EDGES = np.array([NormalDist().inv_cdf(min(max(u, 1e-4), 1 - 1e-4))
                     for u in BAND_EDGES])
_Z_MID = np.array([NormalDist().inv_cdf(0.5 * (a + b))
                   for a, b in zip(BAND_EDGES[:-1], BAND_EDGES[1:])])

WAIT_POINTS = 1024
"""Lattice points of the wait distribution (static)."""
_DAMPING = 6.0  # e^-6 of the mass beyond the lattice wraps around
MIXED_SHARE_MARGIN = 1.25
"""Factor on the share of gaps in mixed steps (see "ITL")."""
PREEMPTION_SPREAD = 2.0
"""KV slots = capacity / (mean + this many std of the running set's KV per slot)."""

_LOGISTIC_PER_STD = float(np.sqrt(3.0) / np.pi)  # logistic scale of unit std
_MIN_REL_SPREAD = 3e-3  # kernel floor, relative: keeps every CDF strictly rising
_LEVELS = (0.5, 0.99)
_ROOT_ITERS = 24  # bisection halvings of the steady-state roots (2^-30 relative)
_MAX_SLO_S = 1e6  # an infinite SLO is taken as this


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


def _membership(values: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """``(V, J)``: the probability of each value that falls in each band."""
    hi = np.cumsum(probs)
    lo = hi - probs
    return np.clip(np.minimum(hi[:, None], BAND_EDGES[None, 1:])
                   - np.maximum(lo[:, None], BAND_EDGES[None, :-1]), 0.0, None)


def _band_stats(values: np.ndarray, member: np.ndarray) -> tuple[np.ndarray, ...]:
    """Conditional mean and std of each band."""
    mass = member.sum(axis=0)
    mean = values @ member / mass
    var = ((values[:, None] - mean[None]) ** 2 * member).sum(axis=0) / mass
    return mean, np.sqrt(np.maximum(var, 0.0))


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


def latency_workload(tables: WorkloadTables, dtype=jnp.float32,
                     pairs: np.ndarray | None = None) -> LatencyWorkload:
    """Summarises a workload's lengths once, in float64 NumPy.

    Args:
      tables: the marginal length tables (used when ``pairs`` is None: prompt
        and output independent).
      dtype: of the summaries.
      pairs: optional ``(N, 2)`` recorded (prompt, output) pairs of a trace;
        when given, every summary comes from them, with the empirical joint
        of prompt and output bands instead of independence.
    """
    if pairs is None:
        pv, pp = tables.prompt_values, tables.prompt_probs
        ov, op = tables.output_values, tables.output_probs
        mp, mo = _membership(pv, pp), _membership(ov, op)
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
        mp, mo = _membership(pv, pp), _membership(ov, op)
        # each pair carries its values' band memberships (a value spanning
        # several bands splits its mass)
        joint = (mp[ip] / pp[ip, None]).T @ (mo[io] / op[io, None]) / len(pairs)
        p = pairs[:, 0]
        sums = _sums(pairs[:, 1] - 1.0)
        e = {k: v.mean() for k, v in sums.items()}
        e.update(P=p.mean(), P2=(p * p).mean(), PD=(p * sums["D"]).mean(),
                 PG1=(p * sums["G1"]).mean(), P2D=(p * p * sums["D"]).mean())
    ctx, ctx_cv, kv, kv_cv = _context_moments(e)
    p_mean, p_std = _band_stats(pv, mp)
    o_mean, _ = _band_stats(ov, mo)
    ep, ep2, eo = pv @ pp, pv**2 @ pp, ov @ op
    return LatencyWorkload(
        *(jnp.asarray(x, dtype) for x in (
            np.diff(BAND_EDGES), p_mean, p_std, o_mean, joint, ep, ep2, eo,
            (ov**2 @ op - eo**2) / eo**2, ctx, ctx_cv, kv, kv_cv))
    )


# --- chunk steps along a prompt --------------------------------------------


class _Ramp(NamedTuple):
    """Step time ``f(c) = max(mem0 + mem1 c, comp0 + comp1 c) + fixed`` of a
    chunk after ``c`` cached tokens, for ``c`` uniform on ``[0, span]``: two
    uniform pieces in time, ``[f0, f1]`` (weight ``w_low``) and ``[f1, f2]``."""

    f0: jax.Array
    f1: jax.Array
    f2: jax.Array
    w_low: jax.Array

    @property
    def mean(self):
        return self.w_low * (self.f0 + self.f1) / 2 + (1 - self.w_low) * (
            self.f1 + self.f2) / 2


def _chunk_lines(hw, model, tp, decodes, context_tokens, chunk_tokens, spec_tokens):
    """A chunk's step time as lines in its cached prefix ``c``
    (``roofline.step_s`` with ``kv = n ctx + c`` and
    ``keys = n ctx + m c + m (m + 1) / 2``; the decodes verify ``spec_tokens``
    proposals each, ``roofline.verified_decodes``).

    Written out rather than ``roofline.step_lines``, for the reason given in
    ``roofline.chunked_prefill``: the terms keep the order the surrogate's
    figures and gradients are bitwise tied to.

    Returns ``(lines, draft)``: with a draft model, ``lines`` holds its passes
    over the decodes alone in ``fixed_s`` and ``draft`` its first pass, over
    the decodes and the chunk, as lines of its own (its own maximum,
    ``roofline.draft_lines``); ``draft`` is ``None`` without one.
    """
    ctx = decodes * context_tokens
    dec_new, dec_keys = roofline.verified_decodes(decodes, ctx, spec_tokens)
    new = dec_new + chunk_tokens
    bw = tp * roofline.effective_bandwidth_bytes_per_s(hw)
    peak = tp * roofline.effective_flops_per_s(hw)
    kvb = roofline.kv_read_bytes_per_token(hw, model)
    fpk = roofline.attention_flops_per_key(model)
    mem0 = (roofline.weight_bytes_read(model, new) + ctx * kvb) / bw
    comp0 = (roofline.linear_flops_per_token(hw, model) * new
             + fpk * (dec_keys + chunk_tokens * (chunk_tokens + 1.0) / 2.0)) / peak
    fixed = roofline.fixed_s(hw, model, tp, new, decodes + 1.0)
    draft = None
    if model.draft_params is not None:
        # the draft's passes over the decodes alone are the same in every
        # chunk's step; its first pass takes the chunk, at the same prefix
        draft, rest = roofline.draft_lines(
            hw, model, tp, decodes, ctx, 0.0, spec_tokens, chunk_tokens, 0.0, 1.0,
            chunk_tokens * (chunk_tokens + 1.0) / 2.0, chunk_tokens)
        fixed = fixed + rest.at(0.0)
    return roofline.StepLines(mem0, kvb / bw, comp0, fpk * chunk_tokens / peak,
                              fixed), draft


def _ramp(hw, model, tp, decodes, context_tokens, chunk_tokens, span_tokens,
          spec_tokens, cached_tokens=0.0):
    """The ramp of chunk steps with prefixes uniform on ``[c, c + span]``,
    ``c`` the prompt's prefix in the prefix cache. Its three points are
    exact; with a draft model, whose first pass adds a maximum with a
    crossing of its own, the step times between them are taken as linear
    past that crossing too (a chord of a convex function of the prefix:
    never below it)."""
    lines, draft = _chunk_lines(hw, model, tp, decodes, context_tokens, chunk_tokens,
                                spec_tokens)
    ds = lines.memory_slope_s - lines.compute_slope_s
    cross = jnp.where(ds == 0.0, 0.0, roofline.crossing(lines))
    split = jnp.clip(cross - cached_tokens, 0.0, span_tokens)
    some = span_tokens > 1e-6
    w_low = jnp.where(some, split / jnp.where(some, span_tokens, 1.0), 0.0)

    def at(x):
        return lines.at(x) if draft is None else lines.at(x) + draft.at(x)

    return _Ramp(at(jnp.zeros_like(span_tokens) + cached_tokens),
                 at(split + cached_tokens), at(span_tokens + cached_tokens), w_low)


def _uniform_cdf(t, lo, hi, scale):
    """CDF of ``U(lo, hi)`` plus a logistic of ``scale``, stable at any width."""
    a = (t - lo) / scale
    width = (hi - lo) / scale
    wide = width > 0.05
    safe_w = jnp.where(wide, width, 1.0)

    def tail(x):  # log1p(exp(-|x|)): softplus minus its ramp
        return jnp.log1p(jnp.exp(-jnp.abs(x)))

    spread = (jnp.clip(a, 0.0, safe_w) + tail(a) - tail(a - safe_w)) / safe_w
    return jnp.where(wide, spread, jax.nn.sigmoid(a - width / 2.0))


def _ramp_cdf(t, ramp: _Ramp, scale):
    return (ramp.w_low * _uniform_cdf(t, ramp.f0, ramp.f1, scale)
            + (1.0 - ramp.w_low) * _uniform_cdf(t, ramp.f1, ramp.f2, scale))


class _Prefill(NamedTuple):
    """Prefill work per prompt band beside ``n`` decodes (arrays of shape (J,))."""

    alone_s: jax.Array  # prefilled alone: the exact chunked sum
    chunks: jax.Array  # ceil(P / b), value of ceil, slope of P / b
    alone_ramp: _Ramp  # its ceil(P / b) equal chunks
    fluid_s: jax.Array  # under a queue: P / b full-budget chunks
    fluid_ramp: _Ramp
    budget_tokens: jax.Array  # b = prefill tokens one step can take (scalar)


def _prefill(hw, model, tp, wl, decodes, token_budget, prompt_tokens, spec_tokens,
             cached_tokens=0.0):
    """``prompt_tokens``: the tokens each band's prefill computes, after its
    ``cached_tokens`` (``cached_workload``)."""
    ctx = wl.decode_context_tokens
    # a decode's proposals take budget too
    b = smooth_max(token_budget - roofline.verified_decodes(decodes, 0.0,
                                                            spec_tokens)[0], 1.0, 1.0)
    alone, _, _ = roofline.chunked_prefill(hw, model, tp, decodes, ctx,
                                           prompt_tokens + cached_tokens, b,
                                           spec_tokens, cached_tokens)
    k = ste_ceil(prompt_tokens / b)
    m = prompt_tokens / k
    alone_ramp = _ramp(hw, model, tp, decodes, ctx, m, prompt_tokens - m, spec_tokens,
                       cached_tokens)
    fluid_ramp = _ramp(hw, model, tp, decodes, ctx, b, softplus(prompt_tokens - b,
                                                                1.0), spec_tokens,
                       cached_tokens)
    fluid = prompt_tokens / b * fluid_ramp.mean
    return _Prefill(alone, k, alone_ramp, fluid, fluid_ramp, b)


# --- steady state -----------------------------------------------------------


class _State(NamedTuple):
    decode_s: jax.Array  # decode-only step with n decodes
    prefill_util: jax.Array  # rho_p
    step_s: jax.Array  # mean step (= mean ITL)
    steps_per_s: jax.Array
    prefill_steps_per_s: jax.Array
    service_s: jax.Array  # shape=(J,), blended prefill work per band
    mean_wait_s: jax.Array  # Pollaczek-Khinchine mean of the prefill wait
    pre: _Prefill
    residence_s: jax.Array  # mean time holding a slot


def _state(hw, model, tp, wl, decodes, token_budget, lam, spec_tokens,
           cached_tokens=0.0):
    """Everything that follows from ``n`` decodes and an admitted rate."""
    pre = _prefill(hw, model, tp, wl, decodes, token_budget, wl.prompt_tokens,
                   spec_tokens, cached_tokens)
    w = wl.band_probs
    alone, fluid = w @ pre.alone_s, w @ pre.fluid_s
    rho = lam * alone / (1.0 + lam * softplus(alone - fluid, 1e-3 * alone + 1e-12))
    busy = smooth_min(rho, 1.0, 0.02)
    service = (1.0 - busy) * pre.alone_s + busy * pre.fluid_s
    chunks = (1.0 - busy) * (w @ pre.chunks) + busy * (
        wl.mean_prompt_tokens / pre.budget_tokens)
    free = slack(1.0 - rho)
    wait = lam * (w @ service**2) / (2.0 * free)
    decode = roofline.verify_step_s(hw, model, tp, decodes, wl.decode_context_tokens,
                                    spec_tokens)
    prefill_steps = lam * chunks
    steps = prefill_steps + free / decode
    step = 1.0 / steps
    residence = wait + w @ service + (wl.mean_output_tokens - 1.0) * step
    return _State(decode, rho, step, steps, prefill_steps, service, wait, pre,
                  residence)


def _slots(hw, model, tp, wl, concurrency):
    """Slots: the concurrency, or fewer where the KV cache binds.

    A running set of ``s`` requests holds ``s`` mean KV footprints plus a
    spread of ``sqrt(s)`` standard deviations; admission and preemption keep
    it under the capacity, so the KV allows ``s`` with
    ``s mu + PREEMPTION_SPREAD sqrt(s) sigma = capacity``.
    """
    cap = roofline.kv_capacity_tokens(hw, model, tp)
    mu = wl.slot_kv_tokens
    sigma = PREEMPTION_SPREAD * wl.slot_kv_cv * mu
    # s mu + sigma sqrt(s) = cap, a quadratic in sqrt(s)
    root = (-sigma + safe_sqrt(sigma**2 + 4.0 * mu * jnp.maximum(cap, 0.0))) / (
        2.0 * mu)
    kv_slots = root**2
    slots = jnp.exp(smooth_min(jnp.log(concurrency),
                               jnp.log(jnp.maximum(kv_slots, 1e-3)), 0.02))
    return slots, cap / mu


def _solve_decodes(state, lam, mean_decodes, slots):
    """Mean decodes ``n``: Little's law for decode tokens, capped by the slots.

    Bisection, then the implicit gradient. The state is evaluated once at the
    root, in forward mode along ``n``: its value, and its slope in ``n``
    (held constant in the gradient), which gives both the root's implicit
    derivative and the state's first-order dependence on it.

    Returns:
      ``(n, state(n), d state / d n)`` (the slope without gradient).
    """
    n0 = bisect(lambda n: n - lam * mean_decodes * state(n).step_s, 0.0, slots,
                _ROOT_ITERS)
    full = n0 >= jax.lax.stop_gradient(slots) * (1.0 - 1e-5)
    st0, d_st = jax.jvp(state, (n0,), (jnp.ones_like(n0),))
    d_st = jax.lax.stop_gradient(d_st)
    slope = jnp.where(full, 1.0, 1.0 - lam * mean_decodes * d_st.step_s)
    value = jnp.where(full, n0 - slots, n0 - lam * mean_decodes * st0.step_s)
    dn = implicit_step(value, slope)  # 0 in value, dn/dtheta in gradient
    return n0 + dn, jax.tree.map(lambda x, dx: x + dx * dn, st0, d_st), d_st


def _tagged_gap_s(st: _State, d_st: _State, n, slots):
    """The mean gap between two tokens of one decoding request.

    ``st.step_s`` is the mean over time, whose steps carry ``n`` decodes on
    average; the steps a decoding request sees carry it and the others, which
    are again ``Poisson(n)`` (the M/G/infinity occupancy seen by one of its
    customers), so ``1 + n`` decodes up to the slots: at zero load one decode
    of one sequence, not a step of no sequence. First order in the decodes
    (a step is linear in them).
    """
    extra = 1.0 + smooth_min(n, slots - 1.0, 0.05) - n
    return st.step_s + d_st.step_s * extra


def _throughput(st: _State, wl, lam, mean_decodes, slots):
    """Utilisations and the achieved rate: the offered one up to the capacity
    of the slots and of the prefill server.

    Returns:
      ``(slot_utilization, utilization, achieved_req_per_s)``; the
      utilization is the larger of the two (>= 1: saturated).
    """
    w = wl.band_probs
    slot_util = lam * st.residence_s / slots
    utilization = jnp.maximum(slot_util, st.prefill_util)
    slot_capacity = slots / (w @ st.service_s + mean_decodes * st.step_s)
    prefill_capacity = 1.0 / (w @ st.pre.fluid_s)
    capacity = smooth_min(slot_capacity, prefill_capacity, 1e-3 * slot_capacity)
    return slot_util, utilization, smooth_min(lam, capacity, 1e-3 * capacity)


# --- waiting ------------------------------------------------------------------


class _Wait(NamedTuple):
    """The wait before a prompt's own prefill, on a lattice (``WAIT_POINTS``)."""

    dt_s: jax.Array  # lattice spacing
    cdf: jax.Array  # shape=(WAIT_POINTS,), P(W <= k dt)


def _residual_hat(service_s, span_s, probs, dt, damp, cdtype):
    """Damped DFT of the lattice law of the residual of a service time.

    The residual of a band of mean service ``x_j`` (probability ``w_j``) is
    uniform on ``[0, y_j]`` with weight ``w_j x_j / E[X]``, where ``y_j =
    E[X_j^2] / x_j`` keeps the band's second moment (so the residual's mean is
    ``E[X^2] / 2 E[X]``, the band's spread included); each lattice bin's mass
    is split between its two ends (mean-preserving).
    """
    dtype = service_s.dtype
    k = jnp.arange(WAIT_POINTS + 1, dtype=dtype)
    v = safe_div(probs * service_s, probs @ service_s)
    edge_cdf = (v[None, :] * jnp.clip(k[:, None] * dt / jnp.maximum(
        span_s[None, :], 1e-30), 0.0, 1.0)).sum(-1)
    mass = jnp.diff(edge_cdf)
    r = 0.5 * (mass + jnp.concatenate([jnp.zeros((1,), dtype), mass[:-1]]))
    return jnp.fft.fft((r * damp).astype(cdtype))


def _wait_lattice(rho, service_s, spread_s, probs, p_slot, slot_util, slot_service_s,
                  slot_probs) -> _Wait:
    """Admission wait + the exact M/G/1 prefill wait, on one lattice.

    Args:
      rho: prefill server utilisation (any value; kept below 1 by ``slack``).
      service_s, probs: the prefill service law, shape ``(J,)``, by band
        means; spread_s: the service's std within each band.
      p_slot: probability of waiting for a slot (``_slot_queue``).
      slot_util: the slots' utilisation when all are taken; slot_service_s,
        slot_probs: the law of a slot's holding time then. Given that it
        waits, a request waits as in an M/G/1 queue of service ``S / c`` (the
        heavy-traffic form of M/G/c, whose mean is the Allen-Cunneen one),
        which keeps the holding time's variability in the tail.
    """
    dtype = service_s.dtype
    cdtype = jnp.complex128 if dtype == jnp.float64 else jnp.complex64
    rho = 1.0 - slack(1.0 - rho)
    rho_s = 1.0 - slack(1.0 - slot_util)
    # heavy tails: the top bands' spread carries much of E[X^2]
    service_span = service_s + safe_div(spread_s**2, service_s)
    residual_mean = safe_div(probs @ (service_s * service_span),
                             2.0 * (probs @ service_s))
    slot_residual = safe_div(slot_probs @ slot_service_s**2,
                             2.0 * (slot_probs @ slot_service_s))
    span = (16.0 * residual_mean / (1.0 - rho) + 2.0 * safe_max(service_span)
            + p_slot * (16.0 * slot_residual / (1.0 - rho_s)
                        + 2.0 * safe_max(slot_service_s)) + 1e-9)
    dt = span / WAIT_POINTS
    k = jnp.arange(WAIT_POINTS, dtype=dtype)
    damp = jnp.exp(-_DAMPING / WAIT_POINTS * k)

    def pk(service, service_span, w, util):
        """Pollaczek-Khinchine: (1 - rho) / (1 - rho R(z))."""
        u = util.astype(cdtype)
        return (1.0 - u) / (1.0 - u * _residual_hat(service, service_span, w, dt,
                                                     damp, cdtype))

    # both laws through one batched transform (one copy of the code to compile)
    prefill_hat, slot_hat = jax.vmap(pk)(
        jnp.stack([service_s, slot_service_s]),
        jnp.stack([service_span, slot_service_s]), jnp.stack([probs, slot_probs]),
        jnp.stack([rho, rho_s]))
    p_c, rs_c = p_slot.astype(cdtype), rho_s.astype(cdtype)
    queued = (slot_hat - (1.0 - rs_c)) / rs_c
    slot = (1.0 - p_c) + p_c * queued
    density = jnp.fft.ifft(prefill_hat * slot).real.astype(dtype) / damp
    cdf = jnp.clip(jnp.cumsum(jnp.maximum(density, 0.0)), 0.0, 1.0)
    return _Wait(dt, cdf)


class _SlotQueue(NamedTuple):
    """The admission queue: who waits for a slot, and how busy the slots are then."""

    p_wait: jax.Array  # probability that an arrival finds every slot taken
    full_util: jax.Array  # offered rate / the rate the slots serve when all taken
    full_residence_s: jax.Array  # a slot's mean holding time when all are taken


def _slot_queue(state_at, st: _State, d_st: _State, lam, mean_decodes,
                slots) -> _SlotQueue:
    """Requests holding a slot: a birth-death chain whose holding time grows
    with the occupancy, and the queue beyond the slots.

    With ``k`` requests holding slots, each holds one for ``R(k)`` (every
    step carries every running request, so a step, and ``R``, grow with
    ``k``: linear, ``R(k) = R + R' (k - k*)`` around the mean occupancy
    ``k* = lam R``). Every running request advances one token per step, so
    the chain is a symmetric (processor-sharing) queue, insensitive to the
    holding-time law (Kelly 1979, *Reversibility and Stochastic Networks*,
    ch. 3): ``pi(k) ~ prod_j lam R(j) / j``, a negative binomial of mean
    ``k*`` and variance ``k* / (1 - lam R' )`` (Poisson, hence Erlang C, when
    ``R' = 0``). Once every slot is taken, requests queue and the slots serve
    at their saturated rate ``lam_sat`` (where ``lam R_full(lam) = slots``,
    ``R_full`` the holding time with every slot taken, linear in ``lam``), so
    the queue's states decay by ``q = lam / lam_sat`` each:
    ``P(wait) = (pi(c) / (1 - q)) / (P(N < c) + pi(c) / (1 - q))``.
    The mean-field utilisation ``lam R / c`` would put ``q`` lower (the prompts
    that queue behind a burst slow every running request's steps), and
    ``q`` multiplies the waiting probability by ``1 / (1 - q)``.
    """
    occupancy = lam * st.residence_s
    # the share of a slot's holding time spent decoding (n / occupancy, by
    # Little's law; defined at zero load too)
    decode_share = safe_div(mean_decodes * st.step_s, st.residence_s)
    # theta = lam R', each request more holding decode_share decodes more; at
    # least 0.02 (a little above Erlang C: on the high side), at most 0.9
    theta = jnp.clip(lam * d_st.residence_s * decode_share, 0.02, 0.9)
    n_full = slots * decode_share
    full, d_full = jax.jvp(lambda rate: state_at(n_full, rate).residence_s, (lam,),
                           (jnp.ones_like(lam),))
    d_full = jnp.maximum(jax.lax.stop_gradient(d_full), 0.0)
    # lam_sat R_full(lam_sat) = slots, R_full linear in the rate around lam
    b = full - d_full * lam
    lam_sat = 2.0 * slots / (b + safe_sqrt(b * b + 4.0 * d_full * slots))
    full_util = lam / lam_sat
    return _SlotQueue(_p_wait(occupancy, theta, slots, full_util), full_util, full)


def _p_wait(occupancy, theta, slots, full_util):
    """P(every slot taken): occupancy negative binomial of mean ``occupancy``
    and variance ``occupancy / (1 - theta)`` below the slots, geometric of
    ratio ``full_util`` from them on (``_slot_queue``); continuous in the slots.
    """
    r = jnp.maximum(occupancy * (1.0 - theta) / theta, 1e-6)
    below = betainc(r, slots, 1.0 - theta)  # P(N <= c - 1)
    log_at = (jax.scipy.special.gammaln(slots + r) - jax.scipy.special.gammaln(r)
              - jax.scipy.special.gammaln(slots + 1.0) + r * jnp.log1p(-theta)
              + slots * jnp.log(theta))
    queued = jnp.exp(log_at) / slack(1.0 - full_util)
    # both underflow only when the mean occupancy is far beyond the slots
    total = below + queued
    some = total > 1e-30
    return jnp.where(some, queued / jnp.where(some, total, 1.0), 1.0)


def _wait(st: _State, wl, slots, sq: _SlotQueue, gap_s, per_token_s) -> _Wait:
    """The wait for a slot and then for the prefill server. Given that it
    waits, a request waits as in an M/G/1 queue of service ``S / c`` (the
    heavy-traffic form of M/G/c), ``S`` a slot's holding time when every slot
    is taken.

    Args:
      per_token_s: ``d service / d P`` per band (the within-band spread).
    """
    w = wl.band_probs
    holding = (w @ st.service_s + st.mean_wait_s
               + jnp.maximum(wl.output_tokens - 1.0, 0.0) * gap_s)  # (J,)
    holding_full = holding * safe_div(sq.full_residence_s, st.residence_s)
    return _wait_lattice(st.prefill_util, st.service_s,
                         per_token_s * wl.prompt_spread_tokens, w, sq.p_wait,
                         sq.full_util, holding_full / slots, w)


def _wait_cdf_beyond_zero(wait: _Wait, s):
    """``P(0 < W <= s)`` (0 for ``s <= 0``), linear between lattice points."""
    x = jnp.clip(s / wait.dt_s, 0.0, WAIT_POINTS - 1.0)
    x0 = jnp.clip(jnp.floor(x), 0.0, WAIT_POINTS - 2.0)
    i = x0.astype(jnp.int32)
    frac = x - x0
    lo, hi = wait.cdf[i], wait.cdf[i + 1]
    return lo + frac * (hi - lo) - wait.cdf[0]


# --- TTFT, ITL, E2E, goodput -----------------------------------------------------


def _ttft(st: _State, wait: _Wait, wl, n, lam, prefill_band_s):
    """Per-band TTFT CDF (a function) and the bisection bracket.

    Args:
      prefill_band_s: ``d alone / d P`` per band (for the within-band kernel).
    """
    p0 = wait.cdf[0]  # no wait at all
    # co-batching: prompts arriving while a prompt waits join its last step
    per_prefill_token_s = softplus(_full_step(st, wl) - st.decode_s,
                                   1e-3 * st.decode_s) / st.pre.budget_tokens
    cobatch = lam * wl.mean_prompt_tokens * per_prefill_token_s
    room_s = per_prefill_token_s * softplus(
        st.pre.budget_tokens - wl.prompt_tokens / st.pre.chunks, 1.0)

    def stretch(t, room):
        """The wait whose co-batched total is ``t``, per prompt band."""
        return t - smooth_min(t * cobatch / (1.0 + cobatch), room, 1e-2 * room + 1e-9)

    busy = -jnp.expm1(-n)
    residual = busy * p0 * st.decode_s / 2.0 * (1.0 + cobatch)
    x = st.pre.alone_s + residual
    band_s = prefill_band_s * wl.prompt_spread_tokens
    spread = safe_sqrt(band_s**2 + (2.0 * residual) ** 2 / 12.0) + _MIN_REL_SPREAD * x
    scale = _LOGISTIC_PER_STD * spread

    def band_cdf(t):
        """``P(TTFT <= t | prompt band)``; ``t`` of shape ``(..., 1)`` -> (..., J)."""
        lift = (1,) * (t.ndim - 1) + (-1,)
        x_, scale_, room_ = (v.reshape(lift) for v in (x, scale, room_s))
        direct = jax.nn.sigmoid((t - x_) / scale_)
        return p0 * direct + _wait_cdf_beyond_zero(wait, stretch(t - x_, room_))

    lo = 0.25 * jnp.min(x)
    hi = jnp.max(x + 40.0 * scale) + wait.dt_s * WAIT_POINTS
    return band_cdf, lo, hi


def _full_step(st: _State, wl):
    """A step filled to the budget, averaged over the prompt tokens it carries."""
    return st.pre.budget_tokens * (wl.band_probs @ st.pre.fluid_s) / (
        wl.mean_prompt_tokens)


def _itl(hw, model, tp, wl, st: _State, d_pre: _Prefill, n, slots, spec_tokens):
    """ITL: the CDF (a function), its bracket and the per-gap slow probabilities.

    Args:
      d_pre: the slope of ``st.pre`` in the number of decodes (no gradient).

    Returns:
      ``(cdf, lo, hi, parts)`` where ``parts`` maps an SLO to the decode steps'
      exceedance and the per-band probability that a prompt's chunk ramp
      exceeds it (for goodput).
    """
    dtype = n.dtype
    w = wl.band_probs
    z_mid = jnp.asarray(_Z_MID, dtype)
    z_edges = jnp.asarray(_Z_EDGES, dtype)
    root_n = safe_sqrt(n)
    skew = -jnp.expm1(-n) / 6.0

    def tagged(z):
        others = n + z * root_n + (z**2 - 1.0) * skew
        return 1.0 + smooth_min(softplus(others, 0.05), slots - 1.0, 0.05)

    def decode_s(count):
        return roofline.verify_step_s(hw, model, tp, count, wl.decode_context_tokens,
                                      spec_tokens)

    count = tagged(z_mid)
    dec = decode_s(count)
    edges_s = decode_s(tagged(z_edges))
    kv_part = decode_s(count * (1.0 + wl.decode_context_cv / jnp.sqrt(count))) - dec
    dec_std = safe_sqrt((edges_s[1:] - edges_s[:-1]) ** 2 / 12.0 + kv_part**2)
    dec_scale = _LOGISTIC_PER_STD * (dec_std + _MIN_REL_SPREAD * dec)

    # mixed steps beside the tagged request and Poisson(n) others: the ramps
    # at n + 1 decodes, to first order in the decodes (the lines of a chunk
    # step are linear in them), spread by sqrt(n) decodes
    def tagged_ramp(ramp, d_ramp):
        r = jax.tree.map(lambda x, dx: x + dx, ramp, d_ramp)
        return r._replace(w_low=jnp.clip(r.w_low, 0.0, 1.0))

    # the alone ramps and the fluid ones side by side, shape (2J,)
    ramps = jax.tree.map(lambda *r: jnp.concatenate(r), tagged_ramp(
        st.pre.alone_ramp, d_pre.alone_ramp), tagged_ramp(st.pre.fluid_ramp,
                                                          d_pre.fluid_ramp))
    d_ramps = root_n * jnp.concatenate([d_pre.alone_ramp.f0, d_pre.fluid_ramp.f0])
    ramp_scale = _LOGISTIC_PER_STD * (jnp.abs(d_ramps) + _MIN_REL_SPREAD * ramps.f0)
    queued = smooth_min(st.prefill_util, 1.0, 0.01)
    # chunk steps per prompt: alone, or under a queue
    chunk_steps = jnp.concatenate([(1.0 - queued) * st.pre.chunks,
                                   queued * wl.prompt_tokens / st.pre.budget_tokens])
    chunk_w = jnp.concatenate([w, w]) * chunk_steps
    total = jnp.sum(chunk_w)
    # a share of gaps, not of steps: a chunk step carries the decoders of an
    # average step and the prompts that were ahead of its own in the prefill
    # queue, which have all just started decoding: lam x its sojourn (PASTA,
    # Little's law), less those more than one decode time ahead, which have
    # finished again; relative to the n = lam x decode time of an average step.
    # Averaged over all steps, chunk steps (a share rho_p of the time) already
    # hold them, so they carry (1 - rho_p) of them more than the mean
    decode_time = jnp.maximum(wl.mean_output_tokens - 1.0, 0.0) * st.step_s
    sojourn = st.mean_wait_s + w @ st.service_s
    ahead = safe_div(smooth_min(sojourn, decode_time, 0.01 * decode_time + 1e-12),
                     decode_time)
    carried = 1.0 + (1.0 - queued) * ahead
    mixed = jnp.minimum(
        MIXED_SHARE_MARGIN * carried * st.prefill_steps_per_s / st.steps_per_s, 1.0)

    def row(v):
        return jax.tree.map(lambda a: a[None, :], v)

    def cdf(t):
        tt = t[:, None]
        decode_part = jax.nn.sigmoid((tt - dec[None, :]) / dec_scale[None, :]) @ w
        chunk_part = _ramp_cdf(tt, row(ramps), ramp_scale[None, :]) @ chunk_w
        return (1.0 - mixed) * decode_part + mixed * chunk_part / total

    def slow(slo):
        """Exceedance of one decode gap; per band, P(a prompt slows a decoder)."""
        t = slo[None]
        q_dec = 1.0 - jax.nn.sigmoid((t - dec) / dec_scale) @ w
        over = chunk_steps * (1.0 - _ramp_cdf(t, ramps, ramp_scale))
        steps_over = over[:w.shape[0]] + over[w.shape[0]:]
        return (1.0 - mixed) * q_dec, smooth_min(steps_over, 1.0, 0.05)

    hi = jnp.maximum(jnp.max(dec + 40.0 * dec_scale),
                     jnp.max(ramps.f2 + 40.0 * ramp_scale))
    return cdf, 0.25 * jnp.min(dec), hi, slow


def _good_fraction(ttft_band_cdf, slow, wl, gap_s, lam, ttft_slo_s, itl_slo_s):
    """Share of requests meeting both SLOs (the simulator's goodput rule)."""
    dtype = wl.band_probs.dtype
    ttft_ok = ttft_band_cdf(jnp.minimum(ttft_slo_s, _MAX_SLO_S)[None])  # (J,)
    q_dec, episode = slow(jnp.minimum(itl_slo_s, _MAX_SLO_S))
    gaps = jnp.maximum(wl.output_tokens - 1.0, 0.0)  # (J,) output bands
    # prompts prefilled while the request decodes: lam x its decode time
    exposure = lam * gaps * gap_s
    gaps_ok = jnp.exp(-gaps * q_dec - exposure * (wl.band_probs @ episode))
    return jnp.clip(jnp.asarray(ttft_ok @ wl.joint_probs @ gaps_ok, dtype), 0.0, 1.0)


def _e2e(ttft_band_cdf, wl, gap_s, lo, hi):
    """p50 and p99 of TTFT + (O - 1) mean gaps over the joint bands."""
    decode_time = jnp.maximum(wl.output_tokens - 1.0, 0.0) * gap_s  # (I,)

    def cdf(t):
        per = ttft_band_cdf(t[:, None, None] - decode_time[None, :, None])  # (L, I, J)
        return jnp.einsum("lij,ji->l", per, wl.joint_probs)

    return quantile(cdf, _LEVELS, lo, hi + jnp.max(decode_time))


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


def cached_workload(wl: LatencyWorkload, hit_fraction):
    """The workload's prefill work with prefix caching at hit fraction ``h``:
    each band's prompt less its cached prefix (``roofline.cached_prefix_tokens``
    of the band's mean prompt), the spread of the work ``(1 - h)`` times the
    prompts' and its second moment ``(1 - h)^2`` times theirs. The KV a
    request holds and the decode contexts keep the whole prompt.

    Returns ``(workload, cached tokens per band)``; exactly ``wl`` at h = 0.
    """
    on = hit_fraction > 0
    cached = roofline.cached_prefix_tokens(wl.prompt_tokens, hit_fraction)
    work = wl.prompt_tokens - cached
    keep = 1.0 - hit_fraction
    return wl._replace(
        prompt_tokens=jnp.where(on, work, wl.prompt_tokens),
        prompt_spread_tokens=jnp.where(on, keep * wl.prompt_spread_tokens,
                                       wl.prompt_spread_tokens),
        mean_prompt_tokens=jnp.where(on, wl.band_probs @ work, wl.mean_prompt_tokens),
        mean_prompt_sq_tokens=jnp.where(on, keep**2 * wl.mean_prompt_sq_tokens,
                                        wl.mean_prompt_sq_tokens)), cached


def surrogate(hw, model, wl: LatencyWorkload, tp, concurrency, token_budget,
              arrival_rate_per_s, ttft_slo_s=jnp.inf, itl_slo_s=jnp.inf,
              spec_tokens=0.0, spec_acceptance=0.0, prefix_hit_fraction=0.0,
              ttft_delay_s=0.0):
    """p50/p99 TTFT, ITL and E2E, throughput and goodput of one point.

    Args:
      hw, model: ``HardwareParams`` / ``ModelParams`` of the point.
      wl: the workload's ``LatencyWorkload``.
      tp: tensor-parallel GPUs.
      concurrency: most sequences running at once (real-valued: relaxed).
      token_budget: tokens per step (real-valued: relaxed).
      arrival_rate_per_s: Poisson arrival rate offered, requests per second.
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
      ttft_delay_s: added to every TTFT after the engine's first token, per
        prompt band (``(J,)``) or one for all: a disaggregated prefill
        instance's KV transfer (``sweep.latency.disaggregated.pools``). 0: none.

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
    wl = speculative_workload(wl, k, roofline.tokens_per_step(k, a))
    wl, cached = cached_workload(wl, h)
    w = wl.band_probs
    mean_decodes = wl.mean_output_tokens - 1.0
    slots, kv_mean_slots = _slots(hw, model, tp, wl, conc)

    def state(n):
        return _state(hw, model, tp, wl, n, budget, lam, k, cached)

    n, st, d_st = _solve_decodes(state, lam, mean_decodes, slots)
    slot_util, utilization, rate = _throughput(st, wl, lam, mean_decodes, slots)
    gap_s = _tagged_gap_s(st, d_st, n, slots)
    queue = _slot_queue(
        lambda d, rate: _state(hw, model, tp, wl, d, budget, rate, k, cached),
        st, d_st, lam, mean_decodes, slots)
    _, per_token = jax.jvp(
        lambda p: _prefill(hw, model, tp, wl, n, budget, p, k, cached).fluid_s,
        (wl.prompt_tokens,), (jnp.ones_like(wl.prompt_tokens),))
    per_token = jax.lax.stop_gradient(jnp.abs(per_token))
    wait = _wait(st, wl, slots, queue, gap_s, per_token)
    engine_ttft_band, ttft_lo, ttft_hi = _ttft(st, wait, wl, n, lam, per_token)
    delay = jnp.broadcast_to(jnp.asarray(ttft_delay_s, dtype), w.shape)

    def ttft_band(t):  # as engine_ttft_band: t of shape (..., 1) -> (..., J)
        return engine_ttft_band(t - delay.reshape((1,) * (t.ndim - 1) + (-1,)))

    ttft_hi = ttft_hi + jnp.max(delay)
    ttft_p50, ttft_p99 = quantile(lambda t: ttft_band(t[:, None]) @ w, _LEVELS,
                                  ttft_lo, ttft_hi)

    itl_cdf, itl_lo, itl_hi, slow = _itl(hw, model, tp, wl, st, d_st.pre, n, slots, k)
    itl_p50, itl_p99 = quantile(itl_cdf, _LEVELS, itl_lo, itl_hi)
    e2e_p50, e2e_p99 = _e2e(ttft_band, wl, gap_s, ttft_lo, ttft_hi)
    good = _good_fraction(ttft_band, slow, wl, gap_s, lam, ttft_slo_s, itl_slo_s)

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
