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

import contextlib
import threading

import jax
import jax.numpy as jnp
import numpy as np


def safe_div(num, den, eps=1e-30):
    """``num / den`` where ``|den| > eps``, else ``num / eps`` (sign kept).

    Forward mode stays finite: ``eps**2`` is 0 in float32, so a division by
    the floored denominator had the tangent ``0 x inf`` (NaN) wherever it
    was small; the small branch divides by a constant instead.
    """
    small = jnp.abs(den) <= eps
    sign = jnp.where(den < 0, -1.0, 1.0)
    return jnp.where(small, num / (sign * eps), num / jnp.where(small, 1.0, den))


def safe_sqrt(x, eps=1e-30):
    """``sqrt(max(x, 0))`` with a finite gradient at and below 0."""
    pos = x > eps
    return jnp.where(pos, jnp.sqrt(jnp.where(pos, x, 1.0)), 0.0)


def safe_max(x):
    """The largest element of a 1-D ``x``, differentiated through that element.

    ``jnp.max``'s gradient divides by the number of elements equal to the
    maximum; XLA may compute ``x`` twice in two fusions with different
    rounding (e.g. contracted multiply-adds), so that no element equals the
    maximum and the gradient is 0 / 0. Here the value is an element of ``x``
    (at the index of its maximum), so the gradient is one-hot and finite.
    """
    return jnp.take(x, jnp.argmax(jax.lax.stop_gradient(x)))


def _lattice_index(x, n):
    """A real index into ``n`` lattice points (clipped to them): the point
    below it (at most ``n - 2``) and the fraction of the way to the next."""
    x = jnp.clip(x, 0.0, n - 1.0)
    i0 = jnp.clip(jnp.floor(x), 0.0, n - 2.0)
    return i0.astype(jnp.int32), x - i0


def interp_rows(table, x):
    """Rows of ``table`` linear in the real index ``x`` (clipped to the table):
    a law or table read between the points of a uniform lattice."""
    i, frac = _lattice_index(x, table.shape[0])
    below = table[i]  # gathered once: XLA kept two gathers of it, 1.1-1.4x slower
    return below + frac * (table[i + 1] - below)


def interp_columns(table, x):
    """Column ``c`` of ``table`` (shape ``(n, C)``) read at the real index
    ``x[..., c]`` as ``interp_rows`` reads rows (``x`` of shape ``(..., C)``):
    one gather per end, where ``vmap`` of ``interp_rows`` over the columns
    took twice as long."""
    i, frac = _lattice_index(x, table.shape[0])
    a = jnp.take_along_axis(table, i, axis=0)
    return a + frac * (jnp.take_along_axis(table, i + 1, axis=0) - a)


def softplus(x, scale=1.0):
    """``scale * log(1 + exp(x / scale))``: a smooth ``max(x, 0)``."""
    return scale * jax.nn.softplus(x / scale)


def smooth_min(a, b, scale):
    """A smooth ``min(a, b)``, below it by at most ``scale * log 2``.

    Written as ``min(a, b) - softplus(-|a - b|)``, which equals
    ``a - softplus(a - b)`` but does not cancel when ``a >> b``.
    """
    return jnp.minimum(a, b) - softplus(-jnp.abs(a - b), scale)


def smooth_max(a, b, scale):
    """A smooth ``max(a, b)``, above it by at most ``scale * log 2``."""
    return jnp.maximum(a, b) + softplus(-jnp.abs(a - b), scale)


def straight_through(value, x):
    """``value`` with the gradient of ``x`` (straight-through).

    A chunk count is an integer, and rounding it matters to the step count
    (every step reads the weights once); the optimiser still needs the
    derivative of the continuous relaxation, which this passes through.
    """
    return x + jax.lax.stop_gradient(value - x)


def slack(one_minus_rho, scale=0.01, floor=1e-3, max_over=9.0):
    """``1 - rho`` for an unsaturated queue, smoothly kept positive beyond it.

    Below saturation it is ``softplus`` of ``1 - rho`` plus at most ``floor``
    (within ``scale * log 2 + floor`` of ``1 - rho``); at and past ``rho = 1``
    it decays like ``floor / (1 + rho - 1)``,
    so ``1 / slack`` keeps growing with the overload, finitely: an SLO simply
    fails instead of the gradient turning into NaN. The growth stops at
    ``rho = 1 + max_over`` (``1 / slack = (1 + max_over) / floor``), which keeps
    the waits that follow from it within float32 range.
    """
    over = smooth_min(softplus(-one_minus_rho, scale), max_over, scale)
    return softplus(one_minus_rho, scale) + floor / (1.0 + over)


@jax.custom_jvp
def betainc(a, b, x):
    """The regularized incomplete beta function ``I_x(a, b)``, differentiable
    in all three arguments.

    ``jax.scipy.special.betainc`` has no derivative in ``a`` and ``b``; here
    it is a central difference of relative step ``BETAINC_STEP`` (the
    function is smooth in both; its float32 value is good to about 1e-6, so
    the slope to about 1e-3 of itself), and the exact density in ``x``.
    """
    return jax.scipy.special.betainc(a, b, x)


BETAINC_STEP = 1e-3


@betainc.defjvp
def _betainc_jvp(primals, tangents):
    a, b, x = jnp.broadcast_arrays(*primals)
    da, db, dx = tangents
    ha, hb = BETAINC_STEP * a, BETAINC_STEP * b
    # the value and the four shifted points in one call: one continued-fraction
    # loop, not five
    value, pa, ma, pb, mb = jax.scipy.special.betainc(
        jnp.stack([a, a + ha, a - ha, a, a]), jnp.stack([b, b, b, b + hb, b - hb]),
        jnp.stack([x] * 5))
    d_a = (pa - ma) / (2.0 * ha)
    d_b = (pb - mb) / (2.0 * hb)
    d_x = jnp.exp((a - 1.0) * jnp.log(x) + (b - 1.0) * jnp.log1p(-x)
                  - jax.scipy.special.betaln(a, b))
    return value, d_a * da + d_b * db + d_x * dx


def bisect(g, lo, hi, iters):
    """Where an increasing ``g`` crosses zero in ``[lo, hi]`` (``hi`` if it does not).

    Forward only: everything is under ``stop_gradient``; differentiate the
    result with ``implicit_step``.
    """
    lo, hi = jax.lax.stop_gradient(lo), jax.lax.stop_gradient(hi)

    def body(_, bounds):
        a, b = bounds
        mid = 0.5 * (a + b)
        up = jax.lax.stop_gradient(g(mid)) > 0
        return jnp.where(up, a, mid), jnp.where(up, mid, b)

    a, b = jax.lax.fori_loop(0, iters, body, (lo, hi))
    return jax.lax.stop_gradient(0.5 * (a + b))


def implicit_step(value, slope):
    """Zero in value; in gradient, the implicit-function term ``-dg / g'``.

    For a root ``x0`` of ``g(x; theta)`` found without gradients, ``x0 +
    implicit_step(g(x0; theta), g'(x0))`` has the value ``x0`` and the
    derivative ``-(dg/dtheta) / g'``: one Newton step whose value part (zero at
    a converged root) is dropped.
    """
    step = safe_div(value, jax.lax.stop_gradient(slope), 1e-20)
    return -(step - jax.lax.stop_gradient(step))


QUANTILE_TIE = 1e-6
"""Probability above a level at which ``quantile`` places it: a flat stretch
of a CDF within float32's rounding of the level (6e-8 near 1) resolves to
its far end, at either precision; elsewhere the quantile moves by about
``1e-6 / density``."""


def halvings(dtype) -> int:
    """Bisection steps that take a bracket of ``log t`` down to the precision's
    resolution: 24 in float32, whose mantissa holds 24 bits (the midpoint of
    a bracket of ``e^16`` is then within 16 / 2^25 = 5e-7 of the root, an
    ulp of ``log t`` at ``|log t|`` of 4; further halvings change nothing),
    and 32 in float64 (within 2e-9 for a bracket of ``e^14``: past what
    every test compares)."""
    return min(32, jnp.finfo(dtype).nmant + 1)


def quantile(cdf, levels, lo, hi, iters=None, sf=None):
    """Quantiles of a smooth CDF on ``[lo, hi]`` (``0 < lo``), several at once.

    Bisection in ``log t`` without gradients, then ``implicit_step`` so that
    the gradient is ``-dF/dtheta / f(q)``.

    Args:
      cdf: maps times of shape ``levels.shape`` to probabilities, elementwise.
      levels: probabilities, shape ``(L,)`` (static values).
      iters: halvings of the bracket (static; default ``halvings`` of the
        bracket's precision).
      sf: ``1 - cdf`` computed from its own terms, or None. Given, the
        bisection compares it with ``1 - level``: near 1 a float32 CDF
        keeps only its rounding (6e-8), its complement near 0.01 about 1e-9,
        and on a CDF's almost flat stretch that rounding moves a quantile
        far (a p99 ITL 2.5 % from float64's, ``benchmarks/README.md``).
    """
    if iters is None:
        iters = halvings(jnp.result_type(lo, hi))
    static_levels = np.asarray(levels, np.float64)
    levels = jnp.asarray(levels)
    log_lo = jnp.log(jax.lax.stop_gradient(lo)) + jnp.zeros_like(levels)
    log_hi = jnp.log(jax.lax.stop_gradient(hi)) + jnp.zeros_like(levels)
    # a CDF of band mixtures is flat at a level that is a band edge (p99 is
    # one): rounding alone put it above or below the level along the flat,
    # and float32 and float64 chose opposite ends (E2E p99 12 % apart on a
    # public trace); the far end is taken in both
    target = levels + QUANTILE_TIE
    # from the static levels in float64: 1 - target in float32 would keep
    # target's rounding (3e-8)
    tail = jnp.asarray(1.0 - static_levels - QUANTILE_TIE, levels.dtype)

    def above(t):
        if sf is None:
            return cdf(t) >= target
        return sf(t) <= tail

    def body(_, bounds):
        a, b = bounds
        mid = 0.5 * (a + b)
        up = jax.lax.stop_gradient(above(jnp.exp(mid)))
        return jnp.where(up, a, mid), jnp.where(up, mid, b)

    a, b = jax.lax.fori_loop(0, iters, body, (log_lo, log_hi))
    q0 = jax.lax.stop_gradient(jnp.exp(0.5 * (a + b)))
    value, density = jax.jvp(cdf, (q0,), (jnp.ones_like(q0),))
    # a CDF built on a lattice can be flat at the quantile: floor its density
    # (relative to the quantile) so that the implicit gradient stays finite
    density = jnp.maximum(density, 1e-3 * levels / q0)
    return q0 + implicit_step(value - levels, density)


def value_and_grad_fwd(fun, has_aux=False):
    """``jax.value_and_grad`` of ``fun(x, *args)`` (``x`` a small vector), by
    forward mode: one ``jvp`` per entry of ``x``, batched.

    The calibration's fit differentiates the surrogate in its five constants
    this way: one trace with a batched tangent instead of a forward pass, its
    residuals and a transposed pass, which XLA compiles in about a quarter
    less time, for a fit that runs no slower (benchmarks/README.md,
    "Forward-mode gradients"). The value is the same; the gradient agrees
    with reverse mode to rounding. The optax search keeps reverse mode: its
    step ran 1.5x slower in forward mode, which ate the compile time saved.
    """
    def wrapped(x, *args):
        value, aux = fun(x, *args) if has_aux else (fun(x, *args), None)
        return value, (value, aux)

    def value_and_grad(x, *args):
        grad, (value, aux) = jax.jacfwd(wrapped, has_aux=True)(x, *args)
        return ((value, aux) if has_aux else value), grad

    return value_and_grad


_ONCE = threading.local()


@contextlib.contextmanager
def computed_once(index):
    """While tracing the block within, ``materialize`` keeps what it is given
    from being recomputed by each consumer (``index``: its default).

    ``index`` is a traced integer scalar that is never negative when the
    program runs (a block's or a loop's index), so ``index >= 0`` is true
    but XLA cannot fold it, and that no ``vmap`` inside the block batches (a
    batched predicate turns the conditional into a ``select``, which
    fuses). The jobs that compile
    the surrogate set it: a grid block (``sweep.grid.evaluate``), the
    search's loop step, the calibration's fit step and its predictions; the
    tests through ``helpers.jit_once``. Outside such a block ``materialize``
    passes its values through: a direct call (``jit(vmap(surrogate))``)
    compiles as it did before.
    """
    before = getattr(_ONCE, "index", None)
    _ONCE.index = index
    try:
        yield
    finally:
        _ONCE.index = before


def materialize(xs, index=None):
    """``xs``, computed once: passed through a conditional on ``index >= 0``,
    always taken (``index``: never negative when the program runs; default
    ``computed_once``'s; none: ``xs`` as is).

    XLA fuses a cheap producer into each of its consumers, so a long chain of
    elementwise arithmetic used by many others is recomputed in every one of
    them: the surrogate's grid program held 32,502 operations after XLA's
    optimisation, 28,000 of them copies (benchmarks/README.md, "Computed
    once"). It cannot fuse across a conditional, so the values are computed
    once, into buffers. (``optimization_barrier`` is removed before fusion
    on CPU; a conditional whose branches are both the identity is removed
    too, hence zeros in the branch never taken.)
    """
    index = getattr(_ONCE, "index", None) if index is None else index
    if index is None:
        return xs
    return jax.lax.cond(index >= 0, lambda x: x,
                        lambda x: jax.tree.map(jnp.zeros_like, x), xs)
