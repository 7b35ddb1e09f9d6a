"""The wait before a prompt's prefill: for a slot, then for the prefill server.

**Waiting** (``slot_queue``, ``_wait_lattice``). Admission waits for one of
``c`` = slots. The requests holding slots form a birth-death chain whose
holding time grows with their number (every step carries every running
request): a negative binomial below ``c`` (Erlang C when the holding time
does not grow), continued to real ``c`` through the incomplete beta
function, and beyond ``c`` a queue served at the slots' saturated rate, or
decaying as the chain does at ``c`` where that is slower (the
mean-field utilisation put the waiting probability 8x low in a probe at
concurrency 16: ``benchmarks/README.md``). A long prompt's busy period of
the prefill server stalls the releases while arrivals take the slots
(``storm_share``). The chain's wait for a slot adds to the prefill wait;
what the storms add beyond the chain's probability overlaps the prefill
wait behind the same prompt, and there the wait is the larger of the two.
Given that it waits, a request waits as in M/G/1 whose service is the interval
between releases, of mean ``S / c`` (the Allen-Cunneen mean: Whitt 1993,
Prod. Oper. Manag. 2, 114-161), each carrying the prefill of the prompt its
release admits (``_release_intervals``). The prefill server is M/G/1
with the band mixture as its service law, and its wait is the exact
Pollaczek-Khinchine law: a geometric sum of residual service times,
``P(W <= t) = (1 - rho) sum_k rho^k R^{*k}(t)`` (Kleinrock 1975, *Queueing
Systems I*, sec. 5.7), computed on a lattice of ``WAIT_POINTS`` points by
FFT, where the sum is ``(1 - rho) / (1 - rho R(z))`` (exponentially damped
against wrap-around: Abate & Whitt 1992, Queueing Systems 10, 5-88); the
residual law is a mixture of uniforms, one per band, whose span keeps the
band's second moment (its within-band spread included: on heavy tails the
top bands' spread carries much of ``E[X^2]``), discretised
mean-preservingly. The admission wait is convolved in on the same lattice,
and so is a disaggregated prefill instance's wait for its KV link
(``Link``). A stream dealt round-robin over engines (Erlang gaps) waits
less often than M/G/1's ``rho``: its prefill wait (and its link's) is
Kingman's scaling of Pollaczek-Khinchine's taken two steps of Lindley's
recursion on the same lattice (``_lindley``). The Pollaczek-Khinchine law
holds at any service variability (``benchmarks/mg1_wait_tail.py``
measured the previous two-moment tail at 0.67-0.82x the exact p99 at cv 2),
and it is smooth in every parameter. ``1 - rho`` is kept positive by
``_numerics.slack``, so past saturation waits are large but finite.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from sweep.latency.surrogate.bursts import trace_slot_atoms
from sweep.latency.surrogate.state import State
from sweep.model._numerics import (
    betainc,
    interp_rows,
    safe_div,
    safe_max,
    safe_sqrt,
    slack,
    softplus,
)

WAIT_POINTS = 1024
"""Lattice points of the wait distribution (static)."""
_DAMPING = 6.0  # e^-6 of the mass beyond the lattice wraps around
RESIDUAL_NODES = 3
"""Uniforms per band in the residual service law (``_residual_bands``; static)."""
LINDLEY_STEPS = 2
"""Steps of Lindley's recursion that take a dealt stream's prefill wait from
its Kingman-scaled law to the GI/G/1 one (``_lindley``; static)."""


class Link(NamedTuple):
    """A disaggregated prefill instance's KV link (``disaggregated.pools``):
    after its prefill, a request's KV waits for the link, which carries one
    transfer at a time, first come first served."""

    load: jax.Array  # the link's utilisation
    transfer_s: jax.Array  # shape=(J,), each band's transfer (the link held)
    spread_s: jax.Array  # shape=(J,), its std within the band
    exposed_s: jax.Array  # shape=(J,), its part after the prefill, link free
    arrival_scv: jax.Array  # the squared coefficient of variation of its gaps


class Wait(NamedTuple):
    """The wait before a prompt's own prefill, on a lattice (``WAIT_POINTS``)."""

    dt_s: jax.Array  # lattice spacing
    cdf: jax.Array  # shape=(WAIT_POINTS,), P(W <= k dt)


def _residual_bands(service_s, span_s, probs):
    """The residual of a band law as uniforms from 0 (``_residual_hat``'s
    terms): ``(service, span, probs)``, ``RESIDUAL_NODES`` entries a band.

    A band of mean service ``x_j`` (probability ``w_j``) is uniform on ``[a_j,
    b_j]``, ``x_j`` +- sqrt(3) its std (``a_j`` cut at 0), its std from ``y_j
    = E[X_j^2] / x_j`` (``span_s``). Its residual, of weight ``w_j x_j /
    E[X]``, has the density ``P(X_j > u) / x_j``: flat to ``a_j``, then
    falling to 0 at ``b_j``, which is a mixture of uniforms on ``[0, t]``
    with ``t`` of density ``t / (x_j (b_j - a_j))`` on ``[a_j, b_j]``
    (Khintchine: a non-increasing density is a mixture of uniforms from 0).
    That mixture is taken at ``RESIDUAL_NODES`` points, the means of as many
    equal parts of ``[a_j, b_j]``, scaled so that their mean is ``y_j`` (the
    residual's mean stays ``E[X^2] / 2 E[X]``). One uniform on ``[0, y_j]``
    (the mean alone) cut the residual's tail at ``y_j``: behind a
    heavy-tailed band law the p99 wait read 0.87-0.97x of
    Pollaczek-Khinchine's at utilisation 0.2-0.45 (``benchmarks/README.md``,
    "The residual service's tail").
    """
    dtype = service_s.dtype
    half = 3.0**0.5 * safe_sqrt(jnp.maximum(span_s - service_s, 0.0) * service_s)
    lo = jnp.maximum(service_s - half, 0.0)
    edges = lo[:, None] + (service_s + half - lo)[:, None] * (
        jnp.arange(RESIDUAL_NODES + 1, dtype=dtype) / RESIDUAL_NODES)[None]
    e1, e2 = edges[:, :-1], edges[:, 1:]
    # each part's share of the mixture (its integral of t: the parts are of
    # equal width) and its mean, (2/3)(e2^3 - e1^3) / (e2^2 - e1^2) without
    # the differences
    share = safe_div(e1 + e2, jnp.sum(e1 + e2, axis=1, keepdims=True))
    node = (2.0 / 3.0) * safe_div(e2 * e2 + e1 * e2 + e1 * e1, e1 + e2)
    node = node * safe_div(span_s, jnp.sum(share * node, axis=1))[:, None]
    return (jnp.repeat(service_s, RESIDUAL_NODES), node.ravel(),
            (probs[:, None] * share).ravel())


def _residual_hat(service_s, span_s, probs, dt, damp):
    """Damped DFT of the lattice law of the residual of a service time (real
    DFT: the ``WAIT_POINTS // 2 + 1`` frequencies of a real law; what the
    lattice does with the transforms, products and Pollaczek-Khinchine's
    ``(1 - rho) / (1 - rho R)``, keeps a real law's conjugate symmetry).

    Entry ``j`` (mean service ``x_j``, probability ``w_j``) is a uniform on
    ``[0, y_j]`` of weight ``w_j x_j / E[X]`` (``_residual_bands`` gives a
    band law's residual in these terms); each lattice bin's mass is split
    between its two ends (mean-preserving).
    """
    dtype = service_s.dtype
    k = jnp.arange(WAIT_POINTS + 1, dtype=dtype)
    v = safe_div(probs * service_s, probs @ service_s)
    # the CDF at lattice edge k is sum_j v_j min(1, k s_j), s_j = dt / y_j:
    # the bands whose uniform ends at or before k (from m_j = ceil(1 / s_j),
    # at least 1: the edge at 0 holds nothing) count whole, the others k s_j.
    # Both are running sums over edges, each band entering once (the rising
    # ones summed from the far end: a total less a running sum, times k,
    # lost float32's precision); the surrogate's costliest step was this sum
    # taken over every (edge, band) (benchmarks/README.md, "The wait
    # lattice's band sum")
    s = safe_div(dt, span_s)  # an empty entry (padding: no weight) ends at once
    m = jnp.clip(jnp.ceil(1.0 / s), 1.0, WAIT_POINTS + 1.0).astype(jnp.int32)
    ended = jnp.zeros(WAIT_POINTS + 2, dtype).at[m].add(v)
    rising = jnp.zeros(WAIT_POINTS + 2, dtype).at[m].add(v * s)
    edge_cdf = (jnp.cumsum(ended[:-1])
                + k * jnp.cumsum(rising[::-1])[::-1][1:])
    mass = jnp.diff(edge_cdf)
    r = 0.5 * (mass + jnp.concatenate([jnp.zeros((1,), dtype), mass[:-1]]))
    return jnp.fft.rfft(r * damp)


def _atoms_hat(atoms_s, probs, dt, damp):
    """Damped real DFT of point masses on the lattice, each split between its two
    neighbouring lattice points (mean-preserving)."""
    k = jnp.arange(WAIT_POINTS, dtype=atoms_s.dtype)
    pmf = jnp.maximum(0.0, 1.0 - jnp.abs(k[:, None] - (atoms_s / dt)[None, :])) @ probs
    return jnp.fft.rfft(pmf * damp)


def _lindley(pmf, service_s, spread_s, probs, rate, shape, dt):
    """``LINDLEY_STEPS`` steps of Lindley's recursion ``W' = max(W + S - A,
    0)`` from the lattice law ``pmf`` of a wait (Lindley 1952, Proc. Camb.
    Phil. Soc. 48, 277-289), for Erlang gaps ``A`` of shape ``shape`` and
    mean ``1 / rate`` (a Poisson stream dealt round-robin over ``shape``
    engines) and the band mixture ``S`` (band ``j`` uniform with mean
    ``service_s[j]`` and std ``spread_s[j]``, over at least one lattice bin,
    cut at 0).

    Started from the Kingman-scaled Pollaczek-Khinchine law, which keeps
    M/G/1's probability of waiting ``rho`` where round-robin gaps rarely
    wait (at ``rho`` 0.1 over 2 engines 0.10 against 0.02-0.04), two steps
    give the GI/G/1 wait's p99 within 0.97-1.12x for deterministic and
    exponential service over 2 to 8 engines, 0.82-1.21x for lognormal cv 2
    (whose rows move with the sample its bands come from; at ``rho`` 0.6-0.85
    they read low, as before), and its probability of waiting within 0.035
    (``benchmarks/README.md``, "The round-robin wait's law against
    Lindley"). Each step is a
    convolution with ``S`` and a correlation with ``A`` (``P(W' > x) =
    sum_m P(A = m) P(W + S > x + m)``), both linear (zero-padded to twice
    the lattice): the gaps' mass beyond the lattice meets no wait there.
    """
    n = WAIT_POINTS
    dtype = pmf.dtype
    edges = jnp.arange(-1, n, dtype=dtype) + 0.5  # bin b is [b - 1/2, b + 1/2)
    # each band uniform over its mean +- sqrt(3) std (at least a bin), cut at 0
    half = jnp.maximum(3.0**0.5 * spread_s / dt, 0.5)
    lo = jnp.maximum(service_s / dt - half, -0.5)
    width = service_s / dt + half - lo
    service = jnp.clip((edges[:, None] - lo[None]) / width[None], 0.0, 1.0) @ probs
    # the gaps' Erlang density at each bin's middle (the first bin's half
    # above 0), in units of a stage: the incomplete gamma function's series
    # took about as long as the two steps
    scale = dt * jnp.maximum(rate, 0.0) * shape
    mid = jnp.arange(n, dtype=dtype).at[0].set(0.25) * scale
    safe = jnp.where(mid > 0.0, mid, 1.0)
    log_f = ((shape - 1.0) * jnp.log(safe) - safe + jnp.log(jnp.maximum(scale, 1e-30))
             - jax.scipy.special.gammaln(shape))
    gaps = jnp.where(mid > 0.0, jnp.exp(log_f), 0.0).at[0].multiply(0.5)
    service_hat = jnp.fft.rfft(jnp.diff(service), 2 * n)
    gaps_hat = jnp.conj(jnp.fft.rfft(gaps, 2 * n))
    for _ in range(LINDLEY_STEPS):
        after = jnp.fft.irfft(jnp.fft.rfft(pmf, 2 * n) * service_hat, 2 * n)
        # P(W + S > y), summed from the top (small tails keep their digits)
        beyond = jnp.concatenate([jnp.cumsum(after[::-1])[::-1][1:],
                                  jnp.zeros((1,), dtype)])
        waits = jnp.clip(jnp.fft.irfft(jnp.fft.rfft(beyond) * gaps_hat, 2 * n)[:n],
                         0.0, 1.0)  # P(W' > x)
        pmf = -jnp.diff(waits, prepend=1.0, append=0.0)[:n].at[n - 1].add(waits[n - 1])
    return pmf


def _release_intervals(holding_s, holding_probs, prefill_s, prefill_probs):
    """The law of the interval between slot releases when every slot is taken
    (``(intervals, probs)``, flat over holding band x prefill band).

    Every release admits a prompt, whose chunk steps stall every running
    request's decode: an interval is the decode steps of a holding time over
    the slots less the mean prefill (at least 0, on the high side), plus the
    prefill of the prompt admitted, drawn from the bands on its own. A
    100,000-token prompt at budget 2,048 stalls the slots for seconds, and
    the queue for them builds behind it as behind one long service.
    """
    decode = jnp.maximum(holding_s - prefill_probs @ prefill_s, 0.0)
    return ((decode[:, None] + prefill_s[None, :]).ravel(),
            (holding_probs[:, None] * prefill_probs[None, :]).ravel())


def _wait_lattice(rho, service_s, spread_s, probs, p_slot, p_storm, slot_util,
                  slot_service_s, slot_probs, arrival_scv=None, trace=None,
                  link=None) -> Wait:
    """Admission wait + the exact M/G/1 prefill wait (+ the wait for a KV
    link), on one lattice.

    Args:
      rho: prefill server utilisation (any value; kept below 1 by ``slack``).
      service_s, probs: the prefill service law, shape ``(J,)``, by band
        means; spread_s: the service's std within each band.
      p_slot: probability of waiting for a slot (``slot_queue``), added to
        the prefill wait.
      p_storm: probability of waiting for a slot that a long prompt's busy
        period filled (``storm_share``): the same busy period holds the
        prefill server, so this wait overlaps the prefill wait, and the
        wait is the larger of the two (independent: on the high side).
      slot_util: the slots' utilisation when all are taken; slot_service_s,
        slot_probs: the law of a slot's holding time then, over the slots.
        Given that it waits, a request waits as in an M/G/1 queue whose
        service is the interval between releases (the heavy-traffic form of
        M/G/c, whose mean is the Allen-Cunneen one), which keeps the holding
        time's variability in the tail, and the admitted prompts' prefills
        (``_release_intervals``).
      arrival_scv: squared coefficient of variation of the times between
        arrivals, or None: Poisson. Given (a stream dealt round-robin over
        ``n`` servers: ``1 / n``, Erlang-n gaps; 1 where dealt at random),
        the prefill wait is the M/G/1 wait scaled by ``(c_a^2 + c_s^2) / (1
        + c_s^2)`` (Kingman's heavy-traffic law, whose tail is the mean's;
        Kingman 1961, Proc. Camb. Phil. Soc. 57, 902-904), which keeps
        M/G/1's probability of waiting, then, below 1, taken
        ``LINDLEY_STEPS`` steps of Lindley's recursion towards the GI/G/1
        wait (``_lindley``).
      trace: ``(atoms_s, probs, slot_atoms_s, slot_atom_probs, on)``: a
        trace's recorded arrivals, whose prefill wait law
        (``bursts.trace_wait_gaps_at``) replaces the Pollaczek-Khinchine one
        and whose slot wait law (``bursts.trace_slot_atoms``: its bursts) is
        added to the admission queue's (its saturation), where ``on`` is 1;
        None: no workload of the program has recorded arrivals.
      link: a ``Link`` whose wait is added, on the prefill pool of a
        disaggregated deployment; or None. The link is a GI/G/1 queue of its
        load with the bands' transfers as its service law
        (Pollaczek-Khinchine, scaled and stepped as the prefill's for its
        arrivals' variability). Its wait is added to the wait before the prefill, so
        it errs high twice: it counts as stretched by co-batching
        (``percentiles.ttft_law``; by at most that room, a part of one
        step), and the link's backlog is not drained by the prompt's own
        prefill (a prefill instance's link does drain while the instance
        computes the next prompt: taking that slack off made the p99 TTFT
        2-10 % low where a decode instance receives from two prefill
        instances, ``benchmarks/README.md``).
    """
    dtype = service_s.dtype
    cdtype = jnp.complex128 if dtype == jnp.float64 else jnp.complex64
    rho = 1.0 - slack(1.0 - rho)
    rho_s = 1.0 - slack(1.0 - slot_util)

    def law(service_s, spread_s, scv, rho):
        """The service's band spans, Kingman's factor on it, and the span of
        the lattice its M/G/1 wait needs."""
        # heavy tails: the top bands' spread carries much of E[X^2]
        span = service_s + safe_div(spread_s**2, service_s)
        mean_s, second_s2 = probs @ service_s, probs @ (service_s * span)
        # E[X]^2 / E[X^2] = 1 / (1 + c_s^2); the factor is exactly 1 at Poisson
        kingman = 1.0 + (scv - 1.0) * safe_div(mean_s**2, second_s2)
        residual_mean = safe_div(second_s2, 2.0 * mean_s)
        return span, kingman, 16.0 * residual_mean / (1.0 - rho)

    service_span, kingman, queue_span = law(
        service_s, spread_s, 1.0 if arrival_scv is None else arrival_scv, rho)
    release_s, release_probs = _release_intervals(slot_service_s, slot_probs,
                                                  service_s, probs)
    slot_residual = safe_div(release_probs @ release_s**2,
                             2.0 * (release_probs @ release_s))
    slot_span = jnp.maximum(p_slot, p_storm) * (16.0 * slot_residual / (1.0 - rho_s)
                                                + 2.0 * safe_max(release_s))
    if trace is not None:
        atoms_s, atom_probs, slot_atoms_s, slot_atom_probs, on = trace
        queue_span = jnp.where(on > 0, 1.25 * safe_max(atoms_s), queue_span)
        slot_span = slot_span + jnp.where(on > 0, 1.25 * safe_max(slot_atoms_s), 0.0)
    span = queue_span + 2.0 * safe_max(service_span) + slot_span + 1e-9

    size = max(release_s.shape[0], RESIDUAL_NODES * service_s.shape[0])

    def flat(x):  # the laws padded to one length
        return jnp.pad(x, (0, size - x.shape[0]))

    def residual(service, span, scale):
        return tuple(map(flat, _residual_bands(service * scale, span * scale, probs)))

    laws = [(*residual(service_s, service_span, kingman), rho),
            (flat(release_s), flat(release_s), flat(release_probs), rho_s)]
    if link is not None:
        # a link that carries nothing (``disaggregated.no_link``) has no
        # residual law (no mass), so the Pollaczek-Khinchine transform is 1
        # only at rho 0 exactly; slack keeps 1e-3 more than 1 - rho, which
        # made it -0.001 and scaled the lattice by 1.001
        rho_l = jnp.maximum(1.0 - slack(1.0 - link.load), 0.0)
        link_span, link_kingman, link_queue = law(link.transfer_s, link.spread_s,
                                                  link.arrival_scv, rho_l)
        span = span + link_queue + 2.0 * safe_max(link_span)
        laws.append((*residual(link.transfer_s, link_span, link_kingman), rho_l))
    dt = span / WAIT_POINTS
    k = jnp.arange(WAIT_POINTS, dtype=dtype)
    damp = jnp.exp(-_DAMPING / WAIT_POINTS * k)

    def pk(service, service_span, w, util):
        """Pollaczek-Khinchine: (1 - rho) / (1 - rho R(z))."""
        u = util.astype(cdtype)
        return (1.0 - u) / (1.0 - u * _residual_hat(service, service_span, w, dt,
                                                     damp))

    # the laws through one batched transform (one copy of the code to compile)
    hats = list(jax.vmap(pk)(*(jnp.stack(x) for x in zip(*laws))))

    def dealt(hat, service, spread, util, scv):
        """Lindley's steps from the Kingman-scaled law, where arrivals are
        dealt round-robin; Poisson ones (dealt at random) keep
        Pollaczek-Khinchine's, exact."""
        start = jnp.fft.irfft(hat, WAIT_POINTS) / damp
        # the gradient is the Kingman-scaled law's: through the steps a
        # warm default search took 3.4x as long, stopped 1.5x
        # (benchmarks/README.md, "Lindley's steps for a dealt stream")
        pmf = start + jax.lax.stop_gradient(
            _lindley(start, service, spread, probs, safe_div(util, probs @ service),
                     1.0 / scv, dt) - start)
        return jnp.where(scv < 1.0, jnp.fft.rfft(pmf * damp), hat)

    # (which law, its service, spread, utilisation, arrivals' scv)
    queues = [] if arrival_scv is None else [(0, service_s, spread_s, rho, arrival_scv)]
    if link is not None:
        queues.append((2, link.transfer_s, link.spread_s, rho_l, link.arrival_scv))
    if queues:
        which, *args = zip(*queues)
        refined = jax.vmap(dealt)(jnp.stack([hats[i] for i in which]),
                                  *(jnp.stack(jnp.broadcast_arrays(*x)) for x in args))
        for j, i in enumerate(which):
            hats[i] = refined[j]
    prefill_hat, slot_hat, *link_hat = hats
    if trace is not None:
        prefill_hat = jnp.where(on > 0, _atoms_hat(atoms_s, atom_probs, dt, damp),
                                prefill_hat)
    p_c, rs_c = p_slot.astype(cdtype), rho_s.astype(cdtype)
    queued = (slot_hat - (1.0 - rs_c)) / rs_c
    slot = (1.0 - p_c) + p_c * queued
    if trace is not None:
        # added to the Poisson one, which holds the slots' saturation
        slot = slot * jnp.where(on > 0, _atoms_hat(slot_atoms_s, slot_atom_probs,
                                                   dt, damp), 1.0)
    if link_hat:
        slot = slot * link_hat[0]
    density = jnp.fft.irfft(jnp.stack([prefill_hat * slot, queued]),
                            WAIT_POINTS) / damp[None]
    cdf = jnp.clip(jnp.cumsum(jnp.maximum(density, 0.0), axis=-1), 0.0, 1.0)
    return Wait(dt, cdf[0] * ((1.0 - p_storm) + p_storm * cdf[1]))


class SlotQueue(NamedTuple):
    """The admission queue: who waits for a slot, and how busy the slots are then."""

    p_wait: jax.Array  # P(every slot taken) by the slots' holding (the chain)
    storm: jax.Array  # what a long prompt's busy period adds (``storm_share``)
    full_util: jax.Array  # offered rate / the rate the slots serve when all taken
    full_residence_s: jax.Array  # a slot's mean holding time when all are taken
    dispersion: jax.Array  # the occupancy's variance over its mean, below the slots


def slot_queue(state_at, st: State, d_st: State, lam, mean_decodes,
               slots, band_probs) -> SlotQueue:
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
    ``R' = 0``). ``R`` grows with ``k`` two ways: a request more holds
    ``decode_share`` decodes more, each step carrying them; and ``k`` above
    ``k*`` means the arrivals of the last holding time came faster (``k /
    R`` a second), whose prefills' chunk steps stall every decode: the
    decode time's elasticity in the rate, over ``R``. Each amplifies the
    count's variance, ``1 - theta = (1 - lam R'_decodes) (1 - elasticity)``.
    Without the second the chain's variance was 1.2-1.7x its mean where the
    Python reference scheduler's occupancy varied 1.5-2.9x (ShareGPT
    lengths, H100 + Llama-3.1-8B, 3-7 req/s); with it 1.3-2.5x (summed
    instead of compounded, 1.4-4.0x: ``benchmarks/README.md``, "The slot
    queue's dispersion"). Once every slot is taken, requests queue and the
    slots serve at their saturated rate ``lam_sat`` (where ``lam R_full(lam)
    = slots``, ``R_full`` the holding time with every slot taken, linear in
    ``lam``; its prefill wait the mean state's: a budget shared with every
    slot's decodes can saturate the prefill server, whose wait, minutes long
    at ``n_full`` on long prompts at budget 512, the slots relieve by
    decoding fewer), so the queue's states decay by ``q = lam / lam_sat``
    each, or by the chain's own ratio at ``c`` where that is larger
    (``p_wait``):
    ``P(wait) = (pi(c) / (1 - q)) / (P(N < c) + pi(c) / (1 - q))``.
    The mean-field utilisation ``lam R / c`` would put ``q`` lower (the prompts
    that queue behind a burst slow every running request's steps), and
    ``q`` multiplies the waiting probability by ``1 / (1 - q)``. The
    ``p_wait`` returned is this, a wait added to the prefill wait; ``storm``
    is what ``storm_share`` (the slots a long prompt's busy period fills;
    ``band_probs``, the bands' weights) adds to it, a wait that overlaps the
    prefill wait behind the same busy period (``_wait_lattice``).
    """
    occupancy = lam * st.residence_s
    # the share of a slot's holding time spent decoding (n / occupancy, by
    # Little's law; defined at zero load too)
    decode_share = safe_div(mean_decodes * st.step_s, st.residence_s)
    n_full = slots * decode_share

    # the decode time's elasticity in the rate at the same decodes, from the
    # state's own terms: each arrival a second more takes its prefill's
    # ``alone`` seconds (``rho / lam`` of them) from the decode steps of
    # ``decode_s`` and adds its chunk steps, ``lam d step / d lam = step^2
    # (rho / decode_s - prefill_steps)`` (the blend of chunk sizes and the
    # slack held fixed)
    elasticity = safe_div(
        mean_decodes * st.step_s**2 * jnp.maximum(
            safe_div(st.prefill_util, st.decode_s) - st.prefill_steps_per_s, 0.0),
        st.residence_s)
    # the two amplify the count's variance in turn: 1 - theta = (1 - lam R'
    # decode_share) (1 - elasticity); at least 0.02 (a little above Erlang C:
    # on the high side), at most 0.9
    by_decodes = jnp.clip(lam * d_st.residence_s * decode_share, 0.0, 0.9)
    theta = jnp.clip(by_decodes + elasticity * (1.0 - by_decodes), 0.02, 0.9)

    def holding(rate):  # without the prefill wait (the mean state's, below)
        s = state_at(n_full, rate)
        return s.residence_s - s.mean_wait_s

    full, d_full = jax.jvp(holding, (lam,), (jnp.ones_like(lam),))
    full = full + st.mean_wait_s
    d_full = jnp.maximum(jax.lax.stop_gradient(d_full), 0.0)
    # lam_sat R_full(lam_sat) = slots, R_full linear in the rate around lam
    b = full - d_full * lam
    lam_sat = 2.0 * slots / (b + safe_sqrt(b * b + 4.0 * d_full * slots))
    full_util = lam / lam_sat
    chain = p_wait(occupancy, theta, slots, full_util)
    storms = storm_share(st.service_s, band_probs, st.prefill_util, lam, occupancy,
                         slots, full_util, decode_share)
    return SlotQueue(chain, jnp.maximum(storms - chain, 0.0), full_util, full,
                     1.0 / (1.0 - theta))


STORM_SLOTS = 16.0
"""Slots from which ``storm_share``'s smooth excess is one arrival wide
(``c / STORM_SLOTS`` below): one arrival is a large share of fewer slots.
One wide, arrivals at 0.01 req/s with 1.8 % of a slot's time busy read 23 %
of them in storms at one slot, 11 % at two and 1.8 % at four, where none
fills them: seed_chat's p99 TTFT read 11.2 s at one slot and 4.56 s at two,
where the simulator reads 3.25 s and 36 ms (``benchmarks/README.md``,
"Storms at a few slots")."""


def storm_share(service_s, band_probs, prefill_util, lam, occupancy, slots,
                full_util, decode_share):
    """The share of arrivals that find every slot taken after a long prompt.

    A prompt of band ``j`` (prefill ``service_s[j]`` = ``S_j``) starts a busy
    period of the prefill server of ``B_j = S_j / (1 - rho_p)`` (M/G/1's mean
    busy period from a work of ``S_j``), whose chunk steps stall every
    running request's decode: the slots hardly release, and the ``lam B_j``
    arrivals meanwhile take them, from the mean ``occupancy`` ``k*`` on. Past
    the ``c`` slots, ``lam B_j - (c - k*)`` queue, and the slots take them
    back at their saturated rate net of the arrivals, ``lam (1 - q)`` a
    second (``q`` = ``full_util``): all taken for ``(lam B_j - (c - k*)) /
    (lam (1 - q))`` s. Per arrival, ``x = d sum_j w_j softplus(lam B_j - (c
    - k*)) / (1 - q)``, ``d`` the decode share of a slot's holding time (a
    slot held waiting for the prefill server is released by it: the chain's
    part), mapped to a probability by ``x / (1 + x)`` (``x`` where small).
    It is 0 where no busy period brings as many arrivals as the slots left
    free (light tails, spare slots): the softplus that smooths the excess
    is one arrival wide from ``STORM_SLOTS`` slots on, narrower below.

    On lognormal prompts of cv 2 (H100 + Llama-3.1-8B, concurrency 64,
    budget 8,192, 6.15 req/s) the Python reference scheduler's slots were
    all taken 14.2 % of the time, and the slowest 1 % spent 92 % of their
    TTFT waiting for one, where the chain gave P(wait) 3.3 %; this gives
    13.1 % (``benchmarks/README.md``, "Storms").
    """
    busy_s = safe_div(service_s, slack(1.0 - prefill_util))
    excess = softplus(lam * busy_s - (slots - occupancy),
                      jnp.minimum(slots / STORM_SLOTS, 1.0))
    x = decode_share * safe_div(band_probs @ excess, slack(1.0 - full_util))
    return x / (1.0 + x)


def p_wait(occupancy, theta, slots, full_util):
    """P(every slot taken): occupancy negative binomial of mean ``occupancy``
    and variance ``occupancy / (1 - theta)`` below the slots, geometric from
    them on (``slot_queue``); continuous in the slots.

    The geometric ratio is ``full_util``, the offered rate over the slots'
    saturated rate, or the chain's own ratio at the slots, ``pi(c + 1) /
    pi(c) = theta (c + r) / (c + 1)``, where that is larger: the count's
    dispersion comes from stalls that slow every running request together
    (``slot_queue``), and they slow the queue beyond the slots as much. With
    ``full_util`` alone the queue decayed faster than the occupancy below
    it: on ShareGPT lengths at concurrency 64 (A100 + Llama-3.1-8B, load
    0.8) P(wait) read 0.76 % where the Python reference scheduler's slots
    were all taken 1.61 % of the time; now 1.15 % (``benchmarks/README.md``,
    "A release interval carries the prompt it admits").
    """
    r = jnp.maximum(occupancy * (1.0 - theta) / theta, 1e-6)
    below = betainc(r, slots, 1.0 - theta)  # P(N <= c - 1)
    log_at = (jax.scipy.special.gammaln(slots + r) - jax.scipy.special.gammaln(r)
              - jax.scipy.special.gammaln(slots + 1.0) + r * jnp.log1p(-theta)
              + slots * jnp.log(theta))
    ratio = jnp.maximum(full_util, theta * (slots + r) / (slots + 1.0))
    queued = jnp.exp(log_at) / slack(1.0 - ratio)
    # both underflow only when the mean occupancy is far beyond the slots
    total = below + queued
    some = total > 1e-30
    return jnp.where(some, queued / jnp.where(some, total, 1.0), 1.0)


def prefill_wait(st: State, wl, slots, sq: SlotQueue, gap_s, per_token_s, lam,
                 trace_gaps, arrival_scv=None, link=None) -> Wait:
    """The wait for a slot and then for the prefill server. Given that it
    waits, a request waits as in an M/G/1 queue whose service is the
    interval between releases, ``S / c`` (the heavy-traffic form of M/G/c)
    with the admitted prompt's prefill in it, ``S`` a slot's holding time
    when every slot is taken.

    Args:
      per_token_s: ``d service / d P`` per band (the within-band spread).
      lam: the arrival rate (a trace's waits are in mean gaps).
      trace_gaps: ``(atoms, probs)``, the trace's wait law in mean gaps
        (``bursts.trace_wait_gaps_at``; read where ``wl`` carries a trace),
        or None: no workload of the program has one.
      arrival_scv: the arrivals' squared coefficient of variation, or None
        (``_wait_lattice``).
      link: a disaggregated prefill instance's KV ``Link``, its wait added
        (``_wait_lattice``), or None.
    """
    w = wl.band_probs
    holding = (w @ st.service_s + st.mean_wait_s
               + jnp.maximum(wl.output_tokens - 1.0, 0.0) * gap_s)  # (J,)
    full = safe_div(sq.full_residence_s, st.residence_s)
    holding_full = holding * full
    # on a trace's recorded arrivals: its own prefill queue, and the
    # requests holding slots are those that arrived within a holding time
    # that waits in that queue (``bursts``)
    trace = None
    if trace_gaps is not None:
        # at zero load the table's rows are zero: no wait, and a finite gradient
        atoms_s, atom_probs = safe_div(trace_gaps[0], lam), trace_gaps[1]
        traced = atom_probs @ atoms_s - st.mean_wait_s
        slot_atoms = trace_slot_atoms(wl.trace_counts, lam * (w @ holding + traced),
                                      slots, w @ holding_full + traced * full)
        trace = (atoms_s, atom_probs, *slot_atoms, wl.trace_arrivals)
    return _wait_lattice(st.prefill_util, st.service_s,
                         per_token_s * wl.prompt_spread_tokens, w, sq.p_wait, sq.storm,
                         sq.full_util, holding_full / slots, w, arrival_scv, trace,
                         link)


def wait_cdf_beyond_zero(wait: Wait, s):
    """``P(0 < W <= s)`` (0 for ``s <= 0``), linear between lattice points."""
    return interp_rows(wait.cdf, s / wait.dt_s) - wait.cdf[0]
