"""Numerical helpers whose values and gradients stay finite everywhere.

Queueing formulas divide by ``1 - utilisation`` and take square roots of
quantities that may be zero; a plain ``jnp.where`` around them still puts the
NaN of the unused branch into the gradient. The helpers here use the
double-``where`` trick of optax's ``safe_norm`` (``optax/_src/numerics.py``):
the argument itself is replaced by a harmless value before the singular
operation, so both branches are finite.

The smooth minimum / maximum are the ``softplus`` relaxations
``min(a, b) ~ a - s * softplus((a - b) / s)``, exact to within ``s * log 2``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def safe_div(num, den, eps=1e-30):
    """``num / den`` where ``|den| > eps``, else ``num / eps`` (sign kept)."""
    small = jnp.abs(den) <= eps
    sign = jnp.where(den < 0, -1.0, 1.0)
    safe_den = jnp.where(small, sign * eps, den)
    return num / safe_den


def safe_sqrt(x, eps=1e-30):
    """``sqrt(max(x, 0))`` with a finite gradient at and below 0."""
    pos = x > eps
    return jnp.where(pos, jnp.sqrt(jnp.where(pos, x, 1.0)), 0.0)


def softplus(x, scale=1.0):
    """``scale * log(1 + exp(x / scale))``: a smooth ``max(x, 0)``."""
    return scale * jax.nn.softplus(x / scale)


def smooth_min(a, b, scale):
    """A smooth ``min(a, b)``, below it by at most ``scale * log 2``."""
    return a - softplus(a - b, scale)


def smooth_max(a, b, scale):
    """A smooth ``max(a, b)``, above it by at most ``scale * log 2``."""
    return a + softplus(b - a, scale)


def ste_ceil(x):
    """``ceil(x)`` in value with the gradient of ``x`` (straight-through).

    A chunk count is an integer, and rounding it matters to the step count
    (every step reads the weights once); the optimiser still needs the
    derivative of the continuous relaxation, which this passes through.
    """
    return x + jax.lax.stop_gradient(jnp.ceil(x) - x)


def slack(one_minus_rho, scale=0.01, floor=1e-3):
    """``1 - rho`` for an unsaturated queue, smoothly kept positive beyond it.

    Below saturation it is ``softplus`` of ``1 - rho`` (within ``scale * log 2``
    of it); at and past ``rho = 1`` it decays like ``floor / (1 + rho - 1)``,
    so ``1 / slack`` keeps growing with the overload, finitely: an SLO simply
    fails instead of the gradient turning into NaN or zero.
    """
    over = softplus(-one_minus_rho, scale)
    return softplus(one_minus_rho, scale) + floor / (1.0 + over)


def monotone_root(g, lo, hi, iters=40):
    """The root of a function that crosses zero once, upward, on ``[lo, hi]``.

    Bisection (under ``stop_gradient``) finds it; one Newton step from there
    carries the implicit-function gradient ``-dg/dtheta / dg/dx`` to whatever
    ``g`` closes over. Returns ``hi`` when ``g(hi) <= 0`` (no crossing).

    Args:
      g: scalar -> scalar, increasing through its root.
      lo, hi: scalars bracketing the root.
      iters: bisection halvings (static).
    """
    lo_sg, hi_sg = jax.lax.stop_gradient(lo), jax.lax.stop_gradient(hi)

    def body(_, bounds):
        a, b = bounds
        mid = 0.5 * (a + b)
        up = jax.lax.stop_gradient(g(mid)) > 0
        return jnp.where(up, a, mid), jnp.where(up, mid, b)

    a, b = jax.lax.fori_loop(0, iters, body, (lo_sg, hi_sg))
    x0 = jax.lax.stop_gradient(0.5 * (a + b))
    value, slope = jax.jvp(g, (x0,), (jnp.ones_like(x0),))
    step = safe_div(value, jax.lax.stop_gradient(slope))
    root = x0 - (step - jax.lax.stop_gradient(step))
    crossed = jax.lax.stop_gradient(g(hi_sg)) > 0
    return jnp.where(crossed, root, hi)


def quantile(cdf, level, lo, hi, iters=48):
    """The ``level`` quantile of a smooth CDF on ``[lo, hi]`` (``0 < lo``).

    Bisection in ``log t`` under ``stop_gradient``, then one implicit Newton
    step, ``q - (F(q) - level) / F'(q)``, so that the gradient is the implicit
    one, ``-dF/dtheta / f(q)``, with no gradient through the iterations.
    """
    log_lo = jnp.log(jax.lax.stop_gradient(lo))
    log_hi = jnp.log(jax.lax.stop_gradient(hi))

    def body(_, bounds):
        a, b = bounds
        mid = 0.5 * (a + b)
        up = jax.lax.stop_gradient(cdf(jnp.exp(mid))) >= level
        return jnp.where(up, a, mid), jnp.where(up, mid, b)

    a, b = jax.lax.fori_loop(0, iters, body, (log_lo, log_hi))
    q0 = jax.lax.stop_gradient(jnp.exp(0.5 * (a + b)))
    value, density = jax.jvp(cdf, (q0,), (jnp.ones_like(q0),))
    # the value part of the Newton step is dropped (bisection is already
    # converged); only its derivative, the implicit gradient, is kept
    step = safe_div(value - level, jax.lax.stop_gradient(density), 1e-20)
    return q0 - (step - jax.lax.stop_gradient(step))
