"""The surrogate's percentiles: TTFT, ITL and E2E laws, and goodput.

**Co-batching.** Prompts that arrive while a prompt waits join its last step
when they fit in the budget it leaves, lengthening it: a wait ``w`` becomes
``w + c min(lam E[P] w, room)`` (``c`` the time of one more prefill token in a
step); the TTFT CDF inverts that map in closed form.

**TTFT** (``ttft_law``) per prompt band = wait + the residual of the decode step
in progress (uniform over it; Poisson arrivals see time averages, Wolff 1982,
Oper. Res. 30, 223-231) + the band's exact chunked prefill beside ``n``
decodes, with a logistic kernel for the within-band spread; p50 and p99 are
found by bisection on the mixture's CDF with one implicit Newton step for the
gradient (``_numerics.quantile``).

**ITL** (``itl_law``). Decode-only steps at ``1 + Poisson(n)`` decodes (the
M/G/infinity occupancy), capped at the slots, taken at band quantiles by the
Cornish-Fisher expansion, and those whose longest context is in each prompt
band (``_long_context_steps``: a heavy-tailed context's KV read is carried by
its longest member, not spread normally); and mixed steps: the ramps of the
prompts' chunk steps, weighted by their step counts (alone: ``ceil(P / b)``
equal chunks; under a prefill queue: ``P / b`` full-budget chunks). The share
of gaps that fall in mixed steps is prefill steps over all steps times the
decoders a chunk step carries relative to an average step: the prompts that
were ahead of it in the prefill queue have just started decoding, ``1 + (1 -
rho_p) min(sojourn, decode time) / decode time`` (sojourn: the prefill wait
and service; decode time: a request's ``(O - 1)`` gaps). It is raised by
``MIXED_SHARE_MARGIN``: p99 ITL jumps from a decode step to a chunk step where
that share crosses 1 %, and there the estimate is not that exact (the
simulator's share was 6-8 % above it in two probes, ``benchmarks/README.md``),
so it errs towards the jump. With one slot no prompt is prefilled beside a
decoding request: no gap is a mixed step.

**E2E** per (prompt band, output band), with their joint probabilities: the
band's TTFT law shifted by ``(O - 1)`` mean gaps of a decoding request
(``tagged_gap_s``: the steps it is in carry it besides the others, so at zero
load a gap is one decode of one sequence).

**Goodput** (``good_fraction``): a request is good when its TTFT is within
the TTFT SLO and none of its gaps exceeds the ITL SLO (the simulator's
definition). Per band pair, ``P(TTFT <= slo)`` times the probability of no
slow gap. A decode step is slow when many others decode beside the request,
and who decodes changes about once per mean decode time (the occupancy of
an M/G/infinity queue is correlated over a holding time): a request's decode
steps are slow together, in ``1 + (O - 1) / E[O - 1]`` independent epochs
(none where ``O`` is 1), not each on its own (held as independent per gap,
the good share of the seed scenario at an ITL SLO among its decode steps
read 0 where the simulator's is 0.27: ``benchmarks/README.md``, "Goodput: a
request's decode steps are slow together"). Slow chunk steps are counted as
episodes (a prompt whose chunk ramp exceeds the SLO slows every decoder
during its prefill), each prompt prefilled during the request's decode
being one chance of an episode: Poisson, ``lam`` x its decode time of them,
or on a trace's recorded arrivals the trace's own count within that window
(``bursts.trace_counts``), which a burst crowds.

Kernel spreads are derivatives taken in forward mode and held constant in
the gradient; the locations of all kernels carry the full gradient.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sweep.latency.surrogate.bursts import at_window, carries_trace
from sweep.latency.surrogate.chunks import Prefill, ramp_cdf, ramp_sf, uniform_cdf
from sweep.latency.surrogate.lengths import Z_EDGES, Z_MID
from sweep.latency.surrogate.state import State
from sweep.latency.surrogate.waiting import WAIT_POINTS, Wait, wait_cdf_beyond_zero
from sweep.model import roofline
from sweep.model._numerics import (
    QUANTILE_TIE,
    halvings,
    interp_columns,
    quantile,
    safe_div,
    safe_sqrt,
    smooth_min,
    softplus,
)

MIXED_SHARE_MARGIN = 1.25
"""Factor on the share of gaps in mixed steps (see "ITL")."""

_LOGISTIC_PER_STD = float(np.sqrt(3.0) / np.pi)  # logistic scale of unit std
_MIN_REL_SPREAD = 3e-3  # kernel floor, relative: keeps every CDF strictly rising
LEVELS = (0.5, 0.99)

_MAX_SLO_S = 1e6  # an infinite SLO is taken as this



def ttft_law(st: State, wait: Wait, wl, n, lam, prefill_band_s):
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
        return p0 * direct + wait_cdf_beyond_zero(wait, stretch(t - x_, room_))

    lo = 0.25 * jnp.min(x)
    hi = jnp.max(x + 40.0 * scale) + wait.dt_s * WAIT_POINTS
    return band_cdf, lo, hi


def _full_step(st: State, wl):
    """A step filled to the budget, averaged over the prompt tokens it carries."""
    return st.pre.budget_tokens * (wl.band_probs @ st.pre.fluid_s) / (
        wl.mean_prompt_tokens)


def _long_context_steps(hw, model, tp, wl, n, slots, spec_tokens, cached_tokens,
                        dec, dec_w):
    """The decode steps that carry a long context, as components of the ITL's
    decode law: ``(steps, logistic scales, probabilities)``, one per prompt
    band.

    A decode step reads every running request's KV, so one request of a
    100,000-token context slows every decoder beside it (on an A100 and
    Llama-3.1-8B, 8 ms steps become 18 ms). The decode law's kernels spread the
    KV read by its coefficient of variation, a normal tail, where a
    heavy-tailed context's sum is carried by its longest member (the Python
    reference scheduler's p99 decode steps, lognormal prompts of cv 3, held
    197,000 tokens of KV at the median where the median step held 4,500:
    ``benchmarks/README.md``, "Long contexts in the decode steps"). Per band
    ``j``, the step whose longest context is in ``j`` (``P_j`` plus the mean
    decoded tokens; with prefix caching the whole prompt, cached prefix
    ``cached_tokens`` included) beside others at the mean context of the bands
    below it. Per gap, the longest is in a band ``>= j`` when the gap's own
    request is (``A_j = P(band >= j)``) or one of ``Poisson(n)`` others is:
    ``1 - (1 - A_j) exp(-n A_j)``. (The others decode longer in such steps, so
    there are more of them and their gaps weigh more: counting them read the
    same agreement within a point, ``benchmarks/README.md``.) A band takes its
    mass from the decode kernels in proportion as its step is slower than the
    mean one, fully from 10 % slower: below that the kernels' spread holds it.
    """
    dtype = n.dtype
    w = wl.band_probs
    whole = wl.prompt_tokens + cached_tokens
    context = jnp.maximum(whole + (wl.decode_context_tokens - w @ whole), 0.0)
    # sums over the bands below, exactly 0 at the first (a running sum less
    # the band's own term left a rounding residue there, -9e-8 over a
    # probability of 0 on the code trace): its step is then the shortest,
    # never 10 % above the mean one, and takes no mass
    below_w, below_sum = (jnp.concatenate([jnp.zeros((1,), dtype), jnp.cumsum(x)[:-1]])
                          for x in (w, w * context))
    below = safe_div(below_sum, below_w)
    count = 1.0 + smooth_min(n, slots - 1.0, 0.05)
    # the mean step and the long ones in one call
    both = roofline.verify_step_s(
        hw, model, tp, count, jnp.concatenate([
            wl.decode_context_tokens[None], (context + (count - 1.0) * below) / count]),
        spec_tokens)
    mean_s, steps = both[0], both[1:]
    at_least = 1.0 - below_w  # P(band >= j)
    longest = 1.0 - jnp.exp(-n * at_least) * below_w
    p = longest - jnp.concatenate([longest[1:], jnp.zeros((1,), dtype)])
    p = p * jnp.clip(safe_div(steps - mean_s, 0.1 * mean_s), 0.0, 1.0)
    # as wide as the decode kernels' spread in the number of decodes
    scale = _LOGISTIC_PER_STD * (_MIN_REL_SPREAD * steps
                                 + safe_sqrt(dec_w @ (dec - mean_s) ** 2))
    return steps, scale, p


def itl_law(hw, model, tp, wl, st: State, d_pre: Prefill, n, slots, spec_tokens,
            cached_tokens, trace_gaps, handover=None, dealt=1.0):
    """ITL: the CDF and its complement (functions), its bracket and the
    per-gap slow probabilities.

    Args:
      d_pre: the slope of ``st.pre`` in the number of decodes (no gradient).
      cached_tokens: shape ``(J,)``, each band's cached prefix (prefix
        caching: ``wl``'s prompts are the work after it; 0 without).
      trace_gaps: ``(atoms, probs)``, a trace's wait law in mean gaps
        (``bursts.trace_wait_gaps_at``; read where ``wl`` carries a trace),
        or None: no workload of the program has one.
      handover: 1 where each request arrives from a prefill instance with
        its prompt's KV (a disaggregated decode pool), 0 where it does not;
        None: no engine of the program is such a pool.
      dealt: the Erlang order of the engine's gaps without a trace: the
        instances the stream is dealt round-robin over, 1 dealt randomly.

    Returns:
      ``(cdf, sf, lo, hi, parts)`` where ``parts`` maps an SLO to the decode steps'
      exceedance and the per-band probability that a prompt's chunk ramp
      exceeds it (for goodput).
    """
    dtype = n.dtype
    w = wl.band_probs
    z_mid = jnp.asarray(Z_MID, dtype)
    z_edges = jnp.asarray(Z_EDGES, dtype)
    root_n = safe_sqrt(n)
    skew = -jnp.expm1(-n) / 6.0

    def tagged(z):
        others = n + z * root_n + (z**2 - 1.0) * skew
        return 1.0 + smooth_min(softplus(others, 0.05), slots - 1.0, 0.05)

    def decode_s(count):
        return roofline.verify_step_s(hw, model, tp, count, wl.decode_context_tokens,
                                      spec_tokens)

    def decode_law(count, edges_s=None):
        """Per band of ``count`` decodes: the step and its logistic scale, from
        the spread between its edges (``edges_s``; None: the midpoints of its
        neighbours) and of the KV it reads."""
        dec = decode_s(count)
        if edges_s is None:
            mids = 0.5 * (dec[1:] + dec[:-1])
            edges_s = jnp.concatenate([dec[:1], mids, dec[-1:]])
        kv_part = decode_s(count * (1.0 + wl.decode_context_cv / jnp.sqrt(count))) - dec
        std = safe_sqrt(jnp.diff(edges_s) ** 2 / 12.0 + kv_part**2)
        return dec, _LOGISTIC_PER_STD * (std + _MIN_REL_SPREAD * dec)

    dec, dec_scale = decode_law(tagged(z_mid), decode_s(tagged(z_edges)))
    long_s, long_scale, long_w = _long_context_steps(
        hw, model, tp, wl, n, slots, spec_tokens, cached_tokens, dec, w)
    dec_w = w
    if trace_gaps is not None:
        # on a trace's recorded arrivals the others decoding are its own
        # crowding, far wider than Poisson(n) in its bursts: those decoding
        # beside it for a decode time of n mean gaps each (``bursts``)
        on = wl.trace_arrivals
        others, count_probs = at_window(wl.trace_overlaps, n)
        dec_tr, scale_tr = decode_law(
            1.0 + smooth_min(softplus(others, 0.05), slots - 1.0, 0.05))
        dec = jnp.concatenate([dec, dec_tr])
        dec_scale = jnp.concatenate([dec_scale, scale_tr])
        dec_w = jnp.concatenate([w * (1.0 - on), count_probs * on])
    # the goodput's decode steps are these kernels alone: a long context's
    # slow steps are mostly its own request's, every one of them at once,
    # which ``good_fraction``'s independent epochs would count as several
    # chances (the RAG workload's good share at an ITL SLO of 8 ms read
    # 0.026 low at the median with them, 0.004 without:
    # ``benchmarks/README.md``, "Long contexts in the decode steps")
    kernels = dec, dec_scale, dec_w
    dec = jnp.concatenate([dec, long_s])
    dec_scale = jnp.concatenate([dec_scale, long_scale])
    dec_w = jnp.concatenate([dec_w * (1.0 - jnp.sum(long_w)), long_w])

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
    # on a trace's recorded arrivals the prompts come in bursts: those that
    # found work ahead (``bursts``, in mean gaps) have their chunks filled
    under_queue = queued
    if trace_gaps is not None:
        gaps, probs = trace_gaps
        trace = wl.trace_arrivals > 0
        under_queue = jnp.where(trace, probs @ safe_div(gaps, gaps + 0.01), queued)
    # chunk steps per prompt: alone, or under a queue
    chunk_steps = jnp.concatenate([
        (1.0 - under_queue) * st.pre.chunks,
        under_queue * wl.prompt_tokens / st.pre.budget_tokens])
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
    # on a trace's recorded arrivals the prompts ahead are its queue's:
    # its work ahead W over the mean service, W / (rho_p x mean gap) prompts,
    # those within the last decode time still decoding, in units of n:
    # E[min(W, n_q)] / (rho_p n), W in mean gaps (``bursts``). While a queue
    # drains every step carries a full chunk, so a decode lasts its tokens
    # at that step's time: n_q = n x (full chunk step / mean step), not n (on
    # the code trace at 1 req/s and budget 8,192, 29 n: capped at n, the
    # mixed steps carried half the decoders the simulator's did)
    if trace_gaps is not None:
        n_q = n * jnp.maximum(safe_div(w @ st.pre.fluid_ramp.mean, st.step_s), 1.0)
        ahead = jnp.where(trace, safe_div(
            probs @ smooth_min(gaps, n_q, 0.01 * n_q + 1e-12), st.prefill_util * n),
            ahead)
    carried = 1.0 + (1.0 - queued) * ahead
    # another prompt is prefilled beside a decoding request only in a second
    # slot: with one, every gap is a decode step (on the code trace's bursts
    # at one slot the chunk steps read p99 ITL 40.5 ms where every step was
    # one sequence's decode, 6.4 ms)
    beside = jnp.clip(slots - 1.0, 0.0, 1.0)
    mixed = beside * jnp.minimum(
        MIXED_SHARE_MARGIN * carried * st.prefill_steps_per_s / st.steps_per_s, 1.0)
    if handover is not None:
        # a request handed over by a prefill instance waits for the step in
        # progress, when there is one, before its first step: that gap is
        # one step and a uniform share of another (the first gap of each
        # request, 1 / E[tokens] of them), with the probability that the
        # instance is decoding at the hand-over. On the code trace these
        # first gaps were every gap above the p99 (benchmarks/README.md, "The
        # first gap after a hand-over"). Without a trace, the requests before
        # it on this instance still decoding: for exponential decode times
        # of mean n gaps and Erlang-``dealt`` gaps, the k-th before it is
        # with probability q^k, q = (dealt n / (dealt n + 1))^dealt, so
        # q / (1 - q) of them (n, Poisson's, where dealt is 1; round-robin
        # dealing spaces them out: "The first gap in the goodput, and
        # round-robin hand-overs"); on a trace, the arrivals within a decode
        # time before it (``bursts.trace_counts``)
        x = dealt * n / (dealt * n + 1.0)
        q = jnp.exp(dealt * jnp.log(jnp.maximum(x, 1e-30)))
        decoding = -jnp.expm1(-safe_div(q, 1.0 - q))
        if trace_gaps is not None:
            before, before_probs = at_window(wl.trace_counts, n)
            decoding = ((1.0 - wl.trace_arrivals) * decoding
                        + wl.trace_arrivals * (before_probs @ -jnp.expm1(-before)))
        waited = handover * decoding / jnp.maximum(wl.mean_output_tokens, 1.0)

    def row(v):
        return jax.tree.map(lambda a: a[None, :], v)

    def first_gap(t, below, steps=None):
        """The first gap's law after a hand-over that waited, one step and a
        uniform share of another: its CDF (``below``) or its complement, at
        times ``t`` of shape (..., 1), over the decode ``steps`` (``(steps,
        scales, weights)``; default the law's)."""
        d, s, p = steps or (dec, dec_scale, dec_w)
        d, s = d[None, :], s[None, :]
        return (uniform_cdf(t, d, 2.0 * d, s) if below
                else uniform_cdf(-t, -2.0 * d, -d, s)) @ p

    def mixture(t, below, ramp_fn):
        """The law's CDF (``below``) or its complement summed from its own
        terms, mirrored, at times ``t``."""
        tt = t[:, None]
        z = (tt - dec[None, :]) if below else (dec[None, :] - tt)
        decode_part = jax.nn.sigmoid(z / dec_scale[None, :]) @ dec_w
        chunk_part = ramp_fn(tt, row(ramps), ramp_scale[None, :]) @ chunk_w
        law = (1.0 - mixed) * decode_part + mixed * chunk_part / total
        if handover is None:
            return law
        return (1.0 - waited) * law + waited * first_gap(tt, below)

    def cdf(t):
        return mixture(t, True, ramp_cdf)

    def sf(t):
        return mixture(t, False, ramp_sf)

    def slow(slo):
        """Exceedance of one decode gap; per band, P(a prompt slows a
        decoder); and the share of requests whose first gap after a
        hand-over exceeds ``slo`` where a decode gap would not."""
        t = slo[None]
        k_dec, k_scale, k_w = kernels
        q_dec = 1.0 - jax.nn.sigmoid((t - k_dec) / k_scale) @ k_w
        over = chunk_steps * (1.0 - ramp_cdf(t, ramps, ramp_scale))
        steps_over = over[:w.shape[0]] + over[w.shape[0]:]
        first = jnp.zeros((), dtype)
        if handover is not None:
            # once per request, not per gap: the step in progress at the
            # hand-over, a uniform share of a step before its own
            late = first_gap(t[:, None], False, kernels)[0]
            first = handover * decoding * jnp.maximum(late - q_dec, 0.0)
        return ((1.0 - mixed) * q_dec, beside * smooth_min(steps_over, 1.0, 0.05),
                first)

    hi = jnp.maximum(jnp.max(dec + 40.0 * dec_scale),
                     jnp.max(ramps.f2 + 40.0 * ramp_scale))
    if handover is not None:
        hi = jnp.maximum(hi, jnp.max(2.0 * dec + 40.0 * dec_scale))
    return cdf, sf, 0.25 * jnp.min(dec), hi, slow


def _log_none(p):
    """``log(1 - p)``, ``p`` held below 1: the log-probability that an event
    of probability ``p`` does not happen."""
    return jnp.log1p(-jnp.minimum(p, 1.0 - 1e-6))


def good_fraction(ttft_band_cdf, slow, wl, gap_s, lam, ttft_slo_s, itl_slo_s):
    """Share of requests meeting both SLOs (the simulator's goodput rule)."""
    dtype = wl.band_probs.dtype
    ttft_ok = ttft_band_cdf(jnp.minimum(ttft_slo_s, _MAX_SLO_S)[None])  # (J,)
    q_dec, episode, first = slow(jnp.minimum(itl_slo_s, _MAX_SLO_S))
    gaps = jnp.maximum(wl.output_tokens - 1.0, 0.0)  # (J,) output bands
    # decode steps slow together, in epochs of one mean decode time
    # ("Goodput"); none without a gap
    epochs = (jnp.minimum(gaps, 1.0)
              + gaps / jnp.maximum(wl.mean_output_tokens - 1.0, 1.0))
    decodes_ok = jnp.exp(epochs * _log_none(q_dec))
    # prompts prefilled while the request decodes: lam x its decode time, in
    # mean gaps, Poisson (thinned to the slow ones); on a trace, its count
    # of arrivals within that window by band, each slow or not
    exposure = lam * gaps * gap_s
    slow_prompt = wl.band_probs @ episode
    no_episode = jnp.exp(-exposure * slow_prompt)
    if carries_trace(wl):
        counts, probs = jax.vmap(at_window, in_axes=(None, 0), out_axes=(0, None))(
            wl.trace_counts, exposure)
        no_episode = ((1.0 - wl.trace_arrivals) * no_episode + wl.trace_arrivals
                      * (jnp.exp(counts * _log_none(slow_prompt)) @ probs))
    gaps_ok = decodes_ok * no_episode
    # a first gap only where the request has one
    gaps_ok = gaps_ok * jnp.where(gaps > 0, 1.0 - first, 1.0)
    return jnp.clip(jnp.asarray(ttft_ok @ wl.joint_probs @ gaps_ok, dtype), 0.0, 1.0)


E2E_GRID_POINTS = 128
"""Points of the log-time grid on which the TTFT law is read (static,
``ttft_table``). At every output band the E2E law is TTFT shifted by the
band's decode time, so it is evaluated once on the grid, by output band,
and the E2E bisection interpolates: evaluated at each halving, at every
(level, output band, prompt band), it was half of the surrogate's time.
Against that bisection (16 halvings), on the 9,072 rows of the 1,944
agreement configurations in float32: p50 E2E within 2.2e-3 relative, p99
E2E within 4.7e-3 but for 12 rows at a band edge's tie (the seed
scenario's three lengths: the p99 on a flat stretch of the CDF, up to 8.5 %
along it; ``benchmarks/README.md``, "E2E on a grid"). E2E is reported,
never held to a target. The TTFT quantiles themselves are not interpolated:
the grid only tells their bisection which cell to start from
(``ttft_quantiles``)."""


class TtftTable(NamedTuple):
    """The TTFT law on the ``E2E_GRID_POINTS`` points ``exp(log_lo + step m)``
    of a log grid over its bracket: ``bands[m, j] = P(TTFT <= points[m] |
    prompt band j)``."""

    log_lo: jax.Array
    step: jax.Array
    points: jax.Array  # shape=(E2E_GRID_POINTS,), s
    bands: jax.Array  # shape=(E2E_GRID_POINTS, J)


def ttft_table(ttft_band_cdf, lo, hi) -> TtftTable:
    """``ttft_band_cdf`` (``t`` of shape ``(..., 1)`` -> ``(..., J)``) read on
    the log grid over ``[lo, hi]``."""
    # the grid is where the law is read, not a parameter of it (as the
    # bracket is not: ``quantile``)
    lo, hi = jax.lax.stop_gradient(lo), jax.lax.stop_gradient(hi)
    log_lo = jnp.log(lo)
    step = (jnp.log(hi) - log_lo) / (E2E_GRID_POINTS - 1)
    points = jnp.exp(log_lo + step * jnp.arange(E2E_GRID_POINTS, dtype=lo.dtype))
    return TtftTable(log_lo, step, points, ttft_band_cdf(points[:, None]))


GRID_HALVINGS = int(np.floor(np.log2(E2E_GRID_POINTS - 1)))
"""Halvings of the whole bracket that one cell of the grid stands for (6:
a cell is 1/127 of it, finer than 2^-6): ``ttft_quantiles`` bisects that many
fewer times."""


def ttft_quantiles(ttft_band_cdf, table: TtftTable, band_probs):
    """p50 and p99 of the TTFT mixture (``ttft_band_cdf @ band_probs``),
    bisected from the cell of ``table``'s grid where the mixture crosses each
    level: the last grid point below it and the next (the far end of a flat
    stretch, as ``quantile`` takes ties), or the grid's first or last cell
    where every point is above or below. The cell is ``GRID_HALVINGS``
    halvings of the whole bracket and the bisection takes that many fewer,
    so it ends at least as fine as one over the whole bracket, which cost a
    quarter more (the TTFT bisection was a fifth of the surrogate's time)."""
    mixture = jax.lax.stop_gradient(table.bands @ band_probs)  # (M,)
    target = jnp.asarray(LEVELS, mixture.dtype)[:, None] + QUANTILE_TIE
    m = jnp.arange(E2E_GRID_POINTS)
    below = jnp.max(jnp.where(mixture[None, :] < target, m[None, :], -1), axis=-1)
    cell = jnp.clip(below, 0, E2E_GRID_POINTS - 2)
    return quantile(lambda t: ttft_band_cdf(t[:, None]) @ band_probs, LEVELS,
                    table.points[cell], table.points[cell + 1],
                    iters=halvings(mixture.dtype) - GRID_HALVINGS)


def e2e_quantiles(table: TtftTable, wl, gap_s):
    """p50 and p99 of TTFT + (O - 1) mean gaps over the joint bands, the TTFT
    law read on ``table``."""
    decode_time = jnp.maximum(wl.output_tokens - 1.0, 0.0) * gap_s  # (I,)
    lo, hi = table.points[0], table.points[-1]
    joint = table.bands @ wl.joint_probs  # (M, I): P(TTFT <= g, i)

    def cdf(t):
        ttft = t[:, None] - decode_time[None, :]  # (L, I)
        x = (jnp.log(jnp.maximum(ttft, lo)) - table.log_lo) / table.step  # grid index
        return jnp.sum(jnp.where(ttft > 0.0, interp_columns(joint, x), 0.0), axis=-1)

    return quantile(cdf, LEVELS, lo, hi + jnp.max(decode_time))
