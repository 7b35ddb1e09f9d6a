"""Analytic surrogate of the serving simulator: smooth p50/p99 TTFT, ITL and E2E.

One grid point in, scalars out, differentiable in the concurrency, the token
budget and the arrival rate (the optax search descends it in log space). It
shares the roofline of ``sweep.roofline`` with the simulator and replaces the
simulation by the following approximations; every one is chosen to be a
smooth closed form, and their agreement with the simulator is measured in
``benchmarks/surrogate_agreement.py`` (``benchmarks/README.md``).

**Lengths.** Prompt and output lengths are independent (as the simulator
samples them). Each is summarised by the conditional means of fixed
probability bands (``BAND_EDGES``, finer in the upper tail so that p99 is
resolved), computed once per workload in NumPy (``latency_workload``).

**Steady state** (a mean-field fixed point). With ``n`` decoding requests on
average, a prompt of ``P`` tokens prefilled alone takes
``k = ceil(P / b)`` chunks of ``P / k`` tokens (``b = budget - n``: decodes
are scheduled first), each a roofline mixed step beside the ``n`` decodes
(``ceil`` keeps its value, with the gradient of ``P / b``:
``_numerics.ste_ceil``). When prompts queue, steps are filled to the budget
instead, so a prompt costs ``P / b`` full steps; the two are blended with the
prefill server's utilisation ``rho_p``, which solves
``rho_p = lam ((1 - rho_p) E[X_alone] + rho_p E[X_full])`` in closed form
(an M/G/1 server of prefill work, Kleinrock 1975, *Queueing Systems I*, ch. 5).
Steps per second are ``lam E[k] + (1 - rho_p) / t_decode(n)``, and Little's
law for decode tokens gives ``n = lam E[O - 1] / steps_per_s``, capped by the
slots; it is solved by bisection, and its gradient is the implicit-function one
(``_numerics.bisect`` / ``implicit_step``, the slope taken in forward mode
only), carried to the rest of the state by evaluating it once at the root.
Slots are limited by the concurrency and the KV cache (``capacity / mean KV
tokens per running request``, a smooth minimum). The slot utilisation is
``lam * residence / slots`` (Little), the reported ``utilization`` the larger
of it and ``rho_p``; the achieved rate is the offered one up to
``slots / (prefill + decode time)`` and the prefill server's full-step rate.

**Waiting.** Before admission, an M/G/c queue with ``c`` = slots: the
probability of waiting is Erlang C, continued to real ``c`` through the
incomplete gamma function (Jagerman 1974, Bell Syst. Tech. J. 53, 525-551),
and the wait beyond is exponential with the Allen-Cunneen mean
``(1 + cs^2) / 2 * residence / (c (1 - rho))`` (Allen 1990, *Probability,
Statistics and Queueing Theory*; Whitt 1993, "Approximations for the GI/G/m
queue", Prod. Oper. Manag. 2, 114-161). For the prefill server, the
Pollaczek-Khinchine mean ``lam E[X^2] / (2 (1 - rho_p))``: an arrival finds it
busy with probability ``rho_p``, then waits the residual of the prompt in
service (density ``P(X > x) / E[X]``, exact in light traffic) plus an
exponential carrying the rest of the P-K mean (the exponential tail of the
M/G/1 wait, Tijms 2003, *A First Course in Stochastic Models*, sec. 2.5). The
two waits are merged into one atom at zero plus that shape, with the summed
mean. ``1 - rho`` is kept positive by ``_numerics.slack``, so past saturation
waits are large but finite and still grow with the load.

**Co-batching.** The prefill server is not work-conserving at token
granularity: prompts that arrive while a prompt waits are in the queue when
its last step starts, and join that step (lengthening it) as far as the
budget it leaves allows. A wait ``w`` therefore becomes
``w + c min(lam E[P] w, room)``, with ``c`` the time of one more prefill token
in a step (full step minus decode step, per budget token) and ``room`` the
budget left beside the prompt's last chunk; the TTFT CDF inverts that map in
closed form.

**TTFT** = wait + the residual of the decode step in progress (uniform over
it; Poisson arrivals see time averages, Wolff 1982, Oper. Res. 30, 223-231),
both stretched by co-batching, + the prompt's own prefill beside ``n``
decodes. Its CDF is a mixture over
prompt bands of a logistic kernel (the within-band spread and the residual)
and of the wait's CDF shifted by the prefill, in closed form; p50 and p99 are
found by bisection on that CDF with one implicit Newton step for the gradient
(``_numerics.quantile``).

**ITL.** A decoding request sees the other decodes as Poisson with mean
``n`` (the M/G/infinity occupancy, insensitive to the service law), capped at
the slots, taken at band quantiles by the Cornish-Fisher expansion
``n + z sqrt(n) + (z^2 - 1) / 6``; the per-request context spread widens each
node. A fraction ``f = prefill steps / all steps`` of its gaps are mixed
steps: a chunk of a prompt of each band (weighted by its chunk count) or,
under a prefill queue, a full-budget step. p50/p99 as for TTFT.

**E2E** = TTFT + (O - 1) mean ITL, mixed over output bands (the sum of many
gaps is close to its mean), with TTFT taken as the lognormal through its p50
and p99.

The spreads of the kernels (within-band prompt spread, decode-count spread)
are derivatives taken in forward mode and held constant in the gradient: the
reverse pass never runs through a ``jvp``, which keeps the compiled gradient
small; the locations of all kernels carry the full gradient.

Not modelled: preemption on KV overflow (the mean KV footprint is kept under
the capacity instead), the correlation between consecutive steps' batch sizes,
chunk boundaries inside the budget (a prompt behind another is taken as a
whole plus the co-batched tokens, not split at the step edge), and the finite
horizon of a
simulation (past saturation a simulator's p99 TTFT grows with the number of
requests; here it is a large finite number, growing with the overload up to
``rho = 10``).
"""

from __future__ import annotations

from statistics import NormalDist
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sweep import roofline
from sweep._numerics import (
    bisect,
    implicit_step,
    quantile,
    safe_div,
    safe_sqrt,
    slack,
    smooth_max,
    smooth_min,
    softplus,
    ste_ceil,
)
from sweep.workload import WorkloadTables

BAND_EDGES = np.array([0.0, 0.05, 0.15, 0.25, 0.35, 0.45, 0.55, 0.65, 0.75, 0.85,
                       0.9, 0.95, 0.97, 0.98, 0.99, 0.995, 0.998, 1.0])
"""Probability bands of the length summaries: finer where p99 lives."""

_Z_EDGES = np.array([NormalDist().inv_cdf(min(max(u, 1e-4), 1 - 1e-4))
                     for u in BAND_EDGES])
_Z_MID = np.array([NormalDist().inv_cdf(0.5 * (a + b))
                   for a, b in zip(BAND_EDGES[:-1], BAND_EDGES[1:])])

STATUS = ("ok", "saturated", "kv_infeasible")
"""Meaning of the ``status`` output: index -> name."""
OK, SATURATED, KV_INFEASIBLE = range(3)

_LOGISTIC_PER_STD = float(np.sqrt(3.0) / np.pi)  # logistic scale of unit std
_MIN_REL_SPREAD = 3e-3  # kernel floor, relative: keeps every CDF strictly rising
_LEVELS = (0.5, 0.99)
_Z99 = NormalDist().inv_cdf(0.99)
_ROOT_ITERS = 24  # bisection halvings of the steady-state roots (2^-30 relative)


class LatencyWorkload(NamedTuple):
    """Length statistics the surrogate needs (built by ``latency_workload``)."""

    band_probs: jax.Array  # shape=(J,), probability of each band
    prompt_tokens: jax.Array  # shape=(J,), mean prompt length in each band
    prompt_spread_tokens: jax.Array  # shape=(J,), std of the prompt within it
    output_tokens: jax.Array  # shape=(J,), mean output length in each band
    mean_prompt_tokens: jax.Array
    mean_prompt_sq_tokens: jax.Array  # E[P^2], tokens^2
    mean_output_tokens: jax.Array
    output_cv2: jax.Array  # Var(O) / E[O]^2
    decode_context_tokens: jax.Array  # mean context over all decode steps
    decode_context_cv: jax.Array  # its coefficient of variation
    slot_kv_tokens: jax.Array  # mean KV tokens a running request holds


def _bands(values: np.ndarray, probs: np.ndarray) -> tuple[np.ndarray, ...]:
    """Band probability, conditional mean and std of a discrete table."""
    hi = np.cumsum(probs)
    lo = hi - probs
    mean, std = [], []
    for a, b in zip(BAND_EDGES[:-1], BAND_EDGES[1:]):
        w = np.clip(np.minimum(hi, b) - np.maximum(lo, a), 0.0, None)
        m = w @ values / w.sum()
        mean.append(m)
        std.append(np.sqrt(max(w @ (values - m) ** 2 / w.sum(), 0.0)))
    return np.diff(BAND_EDGES), np.array(mean), np.array(std)


def latency_workload(tables: WorkloadTables, dtype=jnp.float32) -> LatencyWorkload:
    """Summarises a workload's length tables once, in float64 NumPy.

    Decode step ``g = 1 .. O - 1`` of a request runs at context ``P + g``;
    its moments over all decode steps follow from ``E[P]``, ``E[P^2]`` and the
    power sums of ``O - 1`` (prompt and output independent).
    """
    pv, pp = tables.prompt_values, tables.prompt_probs
    ov, op = tables.output_values, tables.output_probs
    probs, p_mean, p_std = _bands(pv, pp)
    _, o_mean, _ = _bands(ov, op)
    ep, ep2 = pv @ pp, pv**2 @ pp
    eo = ov @ op
    d = np.maximum(ov - 1.0, 0.0)
    s1 = d @ op  # E[D]
    s_g = (d * (d + 1) / 2) @ op  # E[sum g]
    s_g2 = (d * (d + 1) * (2 * d + 1) / 6) @ op  # E[sum g^2]
    if s1 > 0:
        ctx = (ep * s1 + s_g) / s1
        ctx2 = (ep2 * s1 + 2 * ep * s_g + s_g2) / s1
    else:  # single-token outputs: no decode step
        ctx, ctx2 = ep, ep2
    ctx_cv = np.sqrt(max(ctx2 - ctx**2, 0.0)) / ctx
    slot_kv = (ep * (s1 + 1.0) + s_g) / (s1 + 1.0)
    return LatencyWorkload(
        *(jnp.asarray(x, dtype) for x in (
            probs, p_mean, p_std, o_mean, ep, ep2, eo, (ov**2 @ op - eo**2) / eo**2,
            ctx, ctx_cv, slot_kv))
    )


class _Prefill(NamedTuple):
    """Prefill work per prompt band beside ``n`` decodes (arrays of shape (J,))."""

    alone_s: jax.Array  # prefilled alone: k chunk steps
    chunks: jax.Array  # k = ceil(P / b)
    chunk_s: jax.Array  # one chunk step
    full_step_s: jax.Array  # a step filled to the budget (scalar)
    budget_tokens: jax.Array  # b = prefill tokens one step can take (scalar)


def _prefill(hw, model, tp, wl, decodes, token_budget, prompt_tokens):
    ctx = wl.decode_context_tokens
    b = smooth_max(token_budget - decodes, 1.0, 1.0)
    k = ste_ceil(prompt_tokens / b)
    m = prompt_tokens / k
    cached = (prompt_tokens - m) / 2.0  # mean prefix over the k chunks
    chunk = roofline.step_s(hw, model, tp, decodes + m, decodes * ctx + cached,
                            decodes * ctx + roofline.chunk_attention_keys(m, cached))
    # a full step mixes prompts: per token, the prefix KV it reads
    # (P / (2 b) - 1/2 for fluid chunks of b) and the keys it attends to
    p = wl.prompt_tokens
    kv_per_token = safe_div(wl.band_probs @ (p * softplus(p / (2.0 * b) - 0.5, 0.05)),
                            wl.mean_prompt_tokens)
    keys_per_token = (wl.mean_prompt_sq_tokens + wl.mean_prompt_tokens) / (
        2.0 * wl.mean_prompt_tokens)
    full = roofline.step_s(hw, model, tp, decodes + b,
                           decodes * ctx + b * kv_per_token,
                           decodes * ctx + b * keys_per_token)
    return _Prefill(k * chunk, k, chunk, full, b)


class _State(NamedTuple):
    decode_s: jax.Array  # decode-only step with n decodes
    prefill_util: jax.Array  # rho_p
    prefill_wait_s: jax.Array  # mean wait for the prefill server
    step_s: jax.Array  # mean step (= mean ITL)
    steps_per_s: jax.Array
    prefill_steps_per_s: jax.Array
    service_s: jax.Array  # shape=(J,), blended prefill work per band
    pre: _Prefill
    residence_s: jax.Array  # mean time holding a slot


def _state(hw, model, tp, wl, decodes, token_budget, lam):
    """Everything that follows from ``n`` decodes and an admitted rate."""
    pre = _prefill(hw, model, tp, wl, decodes, token_budget, wl.prompt_tokens)
    w = wl.band_probs
    alone = w @ pre.alone_s
    fluid_s = pre.full_step_s * wl.prompt_tokens / pre.budget_tokens
    fluid = w @ fluid_s
    rho = lam * alone / (1.0 + lam * softplus(alone - fluid, 1e-3 * alone + 1e-12))
    busy = smooth_min(rho, 1.0, 0.02)
    service = (1.0 - busy) * pre.alone_s + busy * fluid_s
    chunks = (1.0 - busy) * (w @ pre.chunks) + busy * (
        wl.mean_prompt_tokens / pre.budget_tokens)
    free = slack(1.0 - rho)
    wait = lam * (w @ service**2) / (2.0 * free)
    decode = roofline.decode_step_s(hw, model, tp, decodes, wl.decode_context_tokens)
    prefill_steps = lam * chunks
    steps = prefill_steps + free / decode
    step = 1.0 / steps
    residence = wait + w @ service + (wl.mean_output_tokens - 1.0) * step
    return _State(decode, rho, wait, step, steps, prefill_steps, service, pre,
                  residence)


def _erlang_c(servers, offered):
    """Probability of waiting in M/M/c, continuous in ``c`` (``offered < c``).

    Erlang B is ``a^c e^-a / Gamma(c + 1, a)`` with the upper incomplete gamma
    function, which extends it to real ``c`` (Jagerman 1974, "Some properties of
    the Erlang loss function", Bell Syst. Tech. J. 53, 525-551); Erlang C is
    ``c B / (c - a (1 - B))``.
    """
    a = jnp.maximum(offered, 1e-30)
    log_b = (servers * jnp.log(a) - a - jax.scipy.special.gammaln(servers + 1.0)
             - jnp.log(jax.scipy.special.gammaincc(servers + 1.0, a)))
    b = jnp.exp(jnp.minimum(log_b, 0.0))
    return servers * b / (servers - a * (1.0 - b))


def _logistic_cdf(t, loc, scale):
    return jax.nn.sigmoid((t - loc) / scale)


def surrogate(hw, model, wl: LatencyWorkload, tp, concurrency, token_budget,
              arrival_rate_per_s):
    """p50/p99 TTFT and ITL, p99 E2E and throughput of one point (scalars).

    Args:
      hw, model: ``HardwareParams`` / ``ModelParams`` of the point.
      wl: the workload's ``LatencyWorkload``.
      tp: tensor-parallel GPUs.
      concurrency: most sequences running at once (real-valued: relaxed).
      token_budget: tokens per step (real-valued: relaxed).
      arrival_rate_per_s: Poisson arrival rate offered, requests per second.

    Returns:
      A dict of scalars: ``ttft_p50_s``, ``ttft_p99_s``, ``itl_p50_s``,
      ``itl_p99_s``, ``e2e_p99_s``, ``output_tokens_per_s`` and
      ``goodput_req_per_s`` (achieved: the offered rate up to the capacity of
      the slots and of the prefill server), ``utilization`` (the larger of the slot
      and prefill-server utilisations; >= 1 is saturated), ``slot_utilization``,
      ``prefill_utilization``, ``mean_itl_s``, ``mean_running`` and ``status``
      (int32 index into ``STATUS``).
    """
    dtype = wl.band_probs.dtype
    tp, conc, budget, lam = (jnp.asarray(x, dtype) for x in (
        tp, concurrency, token_budget, arrival_rate_per_s))
    w = wl.band_probs
    mean_decodes = wl.mean_output_tokens - 1.0
    kv_slots = roofline.kv_capacity_tokens(hw, model, tp) / wl.slot_kv_tokens
    slots = jnp.exp(smooth_min(jnp.log(conc), jnp.log(jnp.maximum(kv_slots, 1e-3)),
                               0.02))

    def state(n):
        return _state(hw, model, tp, wl, n, budget, lam)

    # mean decodes n: Little's law for decode tokens, n = lam E[O - 1] mean step,
    # capped by the slots; bisection, then the implicit gradient, carried to
    # the whole state by its first-order expansion around the root
    n0 = bisect(lambda n: n - lam * mean_decodes * state(n).step_s, 0.0, slots,
                _ROOT_ITERS)
    full = n0 >= jax.lax.stop_gradient(slots) * (1.0 - 1e-5)
    # the slope of the root's equation, forward-mode only: the gradient flows
    # through ``implicit_step`` and one evaluation of the state at the root
    step0, dstep0 = jax.jvp(lambda v: state(v).step_s, (jax.lax.stop_gradient(n0),),
                            (jnp.ones_like(n0),))
    slope = jax.lax.stop_gradient(
        jnp.where(full, 1.0, 1.0 - lam * mean_decodes * dstep0))
    value = jnp.where(full, n0 - slots, n0 - lam * mean_decodes * step0)
    n = n0 + implicit_step(value, slope)
    st = state(n)

    slot_util = lam * st.residence_s / slots
    utilization = jnp.maximum(slot_util, st.prefill_util)
    # achieved rate: the offered one, up to what the slots (without waiting)
    # and the prefill server (filled steps) sustain
    slot_capacity = slots / (w @ st.service_s + mean_decodes * st.step_s)
    prefill_capacity = st.pre.budget_tokens / (
        wl.mean_prompt_tokens * st.pre.full_step_s)
    capacity = smooth_min(slot_capacity, prefill_capacity, 1e-3 * slot_capacity)
    rate = smooth_min(lam, capacity, 1e-3 * capacity)
    running = lam * st.residence_s

    # admission queue: M/G/c with the Erlang-C waiting probability (continuous
    # in c) and the Allen-Cunneen factor on its exponential tail
    cs2 = wl.output_cv2 * (mean_decodes * st.step_s / st.residence_s) ** 2
    rho_s = smooth_min(slot_util, 1.0, 0.01)
    p_slot = _erlang_c(slots, rho_s * slots)
    slot_tail_s = st.residence_s * (1.0 + cs2) / (2.0 * slots * slack(1.0 - slot_util))
    # prefill server: busy with probability rho_p; then the residual of the
    # prompt in service, then an exponential with the rest of the P-K mean
    p_pre = smooth_min(st.prefill_util, 1.0, 0.01)
    mean_service = w @ st.service_s
    residual_mean = safe_div(w @ st.service_s**2, 2.0 * mean_service)
    p_wait = 1.0 - (1.0 - p_slot) * (1.0 - p_pre)
    in_service = safe_div(p_pre, p_wait)
    mean_wait = p_slot * slot_tail_s + st.prefill_wait_s
    tail_s = softplus(safe_div(mean_wait, p_wait) - in_service * residual_mean,
                      1e-3 * residual_mean + 1e-9) + 1e-9

    def wait_cdf(s):
        """``P(W <= s | W > 0)``: residual of the prompt in service + exponential."""
        s = softplus(s, 1e-3 * residual_mean + 1e-9)  # shape=(L, J)
        service = st.service_s[None, None, :]
        u = smooth_min(s[..., None], service, 1e-3 * service + 1e-12)
        # u - tail (e^-(s-u)/tail - e^-s/tail), written without cancellation
        # when the tail is long
        left = -jnp.expm1(-(s[..., None] - u) / tail_s)
        conv = u * left + tail_s * (1.0 - left) * (jnp.expm1(-u / tail_s) + u / tail_s)
        residual_then_tail = safe_div(conv @ w, mean_service)
        tail_only = -jnp.expm1(-s / tail_s)
        return in_service * residual_then_tail + (1.0 - in_service) * tail_only

    # TTFT: prompt bands, each prefilled alone beside n decodes, after the
    # residual of the decode step in progress
    # co-batching: prompts arriving while a prompt waits join its last step
    # when they fit in the budget it leaves, and lengthen that step: a wait w
    # becomes w + c min(lam E[P] w, room), c the time of one more prefill
    # token in a step (``stretch`` inverts that map in closed form)
    per_prefill_token_s = softplus(st.pre.full_step_s - st.decode_s,
                                   1e-3 * st.decode_s) / st.pre.budget_tokens
    cobatch = lam * wl.mean_prompt_tokens * per_prefill_token_s
    room_s = per_prefill_token_s * softplus(
        st.pre.budget_tokens - wl.prompt_tokens / st.pre.chunks, 1.0)

    def stretch(t):
        """The wait whose co-batched total is ``t``, per prompt band."""
        cap = room_s[None, :]
        return t - smooth_min(t * cobatch / (1.0 + cobatch), cap,
                              1e-2 * cap + 1e-9)

    busy = -jnp.expm1(-n)
    residual = busy * (1.0 - p_pre) * st.decode_s / 2.0 * (1.0 + cobatch)
    x = st.pre.alone_s + residual
    _, per_token = jax.jvp(
        lambda p: _prefill(hw, model, tp, wl, n, budget, p).alone_s,
        (wl.prompt_tokens,), (jnp.ones_like(wl.prompt_tokens),))
    # spreads are forward-mode only: no reverse pass through a jvp
    band_s = jax.lax.stop_gradient(jnp.abs(per_token)) * wl.prompt_spread_tokens
    spread = safe_sqrt(band_s**2 + (2.0 * residual) ** 2 / 12.0) + _MIN_REL_SPREAD * x
    scale = _LOGISTIC_PER_STD * spread

    def ttft_cdf(t):
        t = t[:, None]
        direct = _logistic_cdf(t, x[None, :], scale[None, :])
        queued = wait_cdf(stretch(t - x[None, :]))
        return ((1.0 - p_wait) * direct + p_wait * queued) @ w

    ttft_lo = 0.25 * jnp.min(x)
    ttft_hi = jnp.max(x + 40.0 * scale) + jnp.max(st.service_s) + 30.0 * tail_s
    ttft_p50, ttft_p99 = quantile(ttft_cdf, _LEVELS, ttft_lo, ttft_hi)

    # ITL: decode-only steps at 1 + Poisson(n) decodes, and mixed steps
    z_mid = jnp.asarray(_Z_MID, dtype)
    z_edges = jnp.asarray(_Z_EDGES, dtype)
    root_n = safe_sqrt(n)
    skew = -jnp.expm1(-n) / 6.0

    def tagged(z):
        others = n + z * root_n + (z**2 - 1.0) * skew
        return 1.0 + smooth_min(softplus(others, 0.05), slots - 1.0, 0.05)

    def decode_s(count):
        return roofline.decode_step_s(hw, model, tp, count, wl.decode_context_tokens)

    count = tagged(z_mid)
    dec = decode_s(count)
    edges_s = decode_s(tagged(z_edges))
    kv_part = decode_s(count * (1.0 + wl.decode_context_cv / jnp.sqrt(count))) - dec
    dec_std = safe_sqrt((edges_s[1:] - edges_s[:-1]) ** 2 / 12.0 + kv_part**2)
    dec_scale = _LOGISTIC_PER_STD * (dec_std + _MIN_REL_SPREAD * dec)

    def mixed_steps(d_decodes, d_prompt):
        pre = _prefill(hw, model, tp, wl, n + 1.0 + d_decodes, budget,
                       wl.prompt_tokens + d_prompt)
        return pre.chunk_s, pre.full_step_s

    (chunk_s, full_s), (d_chunk, d_full) = jax.jvp(
        mixed_steps, (0.0, jnp.zeros_like(wl.prompt_tokens)),
        (root_n, wl.prompt_spread_tokens))
    d_chunk, d_full = jax.lax.stop_gradient((d_chunk, d_full))
    mix_scale = _LOGISTIC_PER_STD * (jnp.abs(d_chunk) + _MIN_REL_SPREAD * chunk_s)
    full_scale = _LOGISTIC_PER_STD * (jnp.abs(d_full) + _MIN_REL_SPREAD * full_s)
    queued = p_pre
    alone_steps = (1.0 - queued) * w * st.pre.chunks
    full_steps = queued * wl.mean_prompt_tokens / st.pre.budget_tokens
    total = jnp.sum(alone_steps) + full_steps
    mixed = st.prefill_steps_per_s / st.steps_per_s

    def itl_cdf(t):
        tt = t[:, None]
        decode_part = _logistic_cdf(tt, dec[None, :], dec_scale[None, :]) @ w
        chunk_part = _logistic_cdf(tt, chunk_s[None, :], mix_scale[None, :]) @ (
            alone_steps)
        full_part = _logistic_cdf(t, full_s, full_scale) * full_steps
        return (1.0 - mixed) * decode_part + mixed * (chunk_part + full_part) / total

    itl_hi = jnp.maximum(jnp.max(dec + 40.0 * dec_scale),
                         jnp.maximum(jnp.max(chunk_s + 40.0 * mix_scale),
                                     full_s + 40.0 * full_scale))
    itl_p50, itl_p99 = quantile(itl_cdf, _LEVELS, 0.25 * jnp.min(dec), itl_hi)

    # E2E: TTFT as a lognormal through its p50 and p99, plus each output band's
    # decode time at the mean ITL
    decode_time = jnp.maximum(wl.output_tokens - 1.0, 0.0) * st.step_s
    log_p50 = jnp.log(ttft_p50)
    sigma = (jnp.log(ttft_p99) - log_p50) / _Z99 + 1e-3

    def e2e_cdf(t):
        first = jnp.maximum(
            softplus(t[:, None] - decode_time[None, :], 1e-3 * ttft_p50), 1e-12)
        return jax.scipy.special.ndtr((jnp.log(first) - log_p50) / sigma) @ w

    (e2e_p99,) = quantile(e2e_cdf, (0.99,), ttft_lo, ttft_hi + jnp.max(decode_time))

    status = jnp.where(kv_slots < 1.0, KV_INFEASIBLE,
                       jnp.where(utilization >= 1.0, SATURATED, OK)).astype(jnp.int32)
    return {
        "ttft_p50_s": ttft_p50,
        "ttft_p99_s": ttft_p99,
        "itl_p50_s": itl_p50,
        "itl_p99_s": itl_p99,
        "e2e_p99_s": e2e_p99,
        "output_tokens_per_s": rate * wl.mean_output_tokens,
        "goodput_req_per_s": rate,
        "utilization": utilization,
        "slot_utilization": slot_util,
        "prefill_utilization": st.prefill_util,
        "mean_itl_s": st.step_s,
        "mean_running": running,
        "status": status,
    }
