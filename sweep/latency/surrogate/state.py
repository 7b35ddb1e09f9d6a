"""The surrogate's steady state: decodes, steps and slots.

**Steady state** (``steady_state``, a mean-field fixed point). When prompts queue,
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
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from sweep.latency.surrogate.chunks import Prefill, prefill_work
from sweep.model import roofline
from sweep.model._numerics import (
    bisect,
    implicit_step,
    materialize,
    safe_sqrt,
    slack,
    smooth_min,
    softplus,
)

PREEMPTION_SPREAD = 2.0
"""KV slots = capacity / (mean + this many std of the running set's KV per slot)."""

_ROOT_ITERS = 24  # bisection halvings of the steady-state roots (2^-30 relative)



class State(NamedTuple):
    decode_s: jax.Array  # decode-only step with n decodes
    prefill_util: jax.Array  # rho_p
    step_s: jax.Array  # mean step (= mean ITL)
    steps_per_s: jax.Array
    prefill_steps_per_s: jax.Array
    service_s: jax.Array  # shape=(J,), blended prefill work per band
    mean_wait_s: jax.Array  # Pollaczek-Khinchine mean of the prefill wait
    pre: Prefill
    residence_s: jax.Array  # mean time holding a slot


def steady_state(hw, model, tp, wl, decodes, token_budget, lam, spec_tokens,
           cached_tokens=0.0):
    """Everything that follows from ``n`` decodes and an admitted rate."""
    pre = prefill_work(hw, model, tp, wl, decodes, token_budget, wl.prompt_tokens,
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
    # computed once, not in each of the many places that read it
    return materialize(State(decode, rho, step, steps, prefill_steps, service,
                             wait, pre, residence))


def slot_count(hw, model, tp, wl, concurrency):
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


def solve_decodes(state, lam, mean_decodes, slots):
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


def tagged_gap_s(st: State, d_st: State, n, slots):
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


def throughput(st: State, wl, lam, mean_decodes, slots):
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
