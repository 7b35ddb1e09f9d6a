"""Elasticities of a figure to the hardware and calibration constants.

``d ln f / d ln c`` for each constant ``c`` of ``contract.SENSITIVITY``, with
respect to log scales of the constants' leaves (``SCALED``) at 1: an
elasticity, finite where a constant is 0 (then 0). The grid's roofline part
takes the cost's (``sweep.model.point``) by forward-mode differentiation
(``elasticities``: exact, one tangent per constant); its surrogate p99 part
the p99 TTFT's and ITL's (``sweep.latency.p99``) by central differences
(``differences``: the surrogate's own gradient in the constants is not its
function's). Both inside each part's one ``jit``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sweep.cube import contract

SCALED: dict[str, tuple[str, ...]] = {
    "memory_bandwidth_bytes_per_s": ("memory_bandwidth_bytes_per_s",),
    "peak_flops_per_s": ("peak_flops_per_s", "fp8_flops_per_s", "fp4_flops_per_s"),
    "interconnect_bytes_per_s": ("interconnect_bytes_per_s",),
    "mbu": ("mbu",),
    "kv_mbu": ("kv_mbu",),
    "mfu": ("mfu",),
    "step_overhead_s": ("step_overhead_s",),
    "sequence_overhead_s": ("sequence_overhead_s",),
}
"""The ``HardwareParams`` leaves each constant of ``contract.SENSITIVITY``
scales (together: a GPU with 10 % more FLOP/s has every tensor-core rate
10 % higher)."""


def _scaled(hw, log_scale):
    """``hw`` with each constant's leaves times ``exp(log_scale[i])``."""
    return hw._replace(**{leaf: getattr(hw, leaf) * jnp.exp(log_scale[i])
                          for i, n in enumerate(SCALED) for leaf in SCALED[n]})


def _named(rows, of: tuple[str, ...]) -> dict:
    """``{contract.sensitivity(p, f): rows[j, i]}`` for figure ``j``, constant ``i``."""
    return {contract.sensitivity(p, of=f): rows[j, i]
            for j, f in enumerate(of) for i, p in enumerate(SCALED)}


def elasticities(figures, hw, of: tuple[str, ...]) -> dict:
    """The figures' elasticities to every constant, by forward-mode
    differentiation: ``contract.sensitivity(p, of=name)`` -> scalar.

    Args:
      figures: ``hw -> dict of positive scalars``; its entries named in
        ``of`` are differentiated.
      hw: ``HardwareParams``.
      of: the figures' names, as ``contract.sensitivity`` takes them.
    """
    def logs(log_scale):
        values = figures(_scaled(hw, log_scale))
        return jnp.stack([jnp.log(values[f]) for f in of])

    zero = jnp.zeros(len(SCALED), jnp.result_type(hw.mbu))
    return _named(jax.jacfwd(logs)(zero), of)


STEP = 0.01
"""The log-scale step of ``differences``: +-1 %, wide enough that float32
rounding in the figures (about 1e-6 relative) moves an elasticity by < 1e-4,
narrow enough that its second-order error is too (the figures are smooth)."""


def differences(figures, hw, of: tuple[str, ...]):
    """Elasticities by central differences in log scale (``STEP``): the
    figures at ``hw`` and at each constant scaled by ``exp(+-STEP)``, in one
    vmapped call (``2 * len(SCALED) + 1`` evaluations).

    Args:
      figures: ``hw -> (dict of positive scalars, aux)``.

    Returns:
      ``(values, aux, elasticities)`` at ``hw``: the evaluation at the
      unscaled constants is the point's own, not repeated.

    For figures whose derivative is not their function's: the surrogate's
    p99s come from bisections on lattice CDFs with implicit gradients that
    hold second-order terms constant (right for the search in concurrency
    and budget, off by up to 4x against differences for the constants).
    """
    k = len(SCALED)
    eye = jnp.eye(k, dtype=jnp.result_type(hw.mbu)) * STEP
    scales = jnp.concatenate([jnp.zeros((1, k), eye.dtype), eye, -eye])
    values, aux = jax.vmap(lambda s: figures(_scaled(hw, s)))(scales)
    logs = jnp.stack([jnp.log(values[f]) for f in of])  # (len(of), 2k + 1)
    rows = (logs[:, 1:k + 1] - logs[:, k + 1:]) / (2.0 * STEP)
    first = lambda tree: jax.tree.map(lambda x: x[0], tree)  # noqa: E731
    return first(values), first(aux), _named(rows, of)
