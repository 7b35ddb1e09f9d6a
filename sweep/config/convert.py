"""Validated configs to the parameter pytrees the models receive.

The one place where a Hydra schema (``sweep.config.schema``) becomes a
``sweep.model.params`` pytree of float leaves in SI units, so that the physics layer
(``sweep.model.params``, ``sweep.model.roofline``, ...) never imports the config layer.
"""

from __future__ import annotations

import math

from sweep.config.schema import Hardware, Model
from sweep.model import precision
from sweep.model.params import HardwareParams, ModelParams, stack


def hardware_params(hw: Hardware, gpu_memory_utilization: float) -> HardwareParams:
    """Converts a validated hardware config to float leaves."""
    return HardwareParams(
        memory_bandwidth_bytes_per_s=hw.memory_bandwidth_bytes_per_s,
        peak_flops_per_s=hw.peak_flops_per_s,
        memory_bytes=hw.memory_bytes,
        interconnect_bytes_per_s=hw.interconnect_bytes_per_s,
        usd_per_gpu_hour=hw.usd_per_gpu_hour,
        mbu=hw.mbu,
        mfu=hw.mfu,
        step_overhead_s=hw.step_overhead_s,
        gpu_memory_utilization=gpu_memory_utilization,
        kv_mbu=hw.kv_mbu or hw.mbu,
        sequence_overhead_s=hw.sequence_overhead_s,
        fp8_flops_per_s=hw.fp8_flops_per_s,
        fp4_flops_per_s=hw.fp4_flops_per_s,
        kv_link_bytes_per_s=hw.kv_link_bytes_per_s,
        kv_layerwise=float(hw.kv_transfer_layerwise),
    )


def model_params(m: Model) -> ModelParams:
    """Splits a model's parameters into always-read and routed-expert weights.

    For a mixture of experts with ``E`` experts of which ``k`` serve a token,
    ``active = shared + expert * k / E`` and ``params = shared + expert``, so
    ``expert = (params - active) * E / (E - k)``.

    The ``draft_*`` leaves are ``m.draft``'s, which ``sweep.config.resolve``
    sets only where a sweep lists the draft proposer; without one they are
    ``None``: no draft terms are compiled.
    """
    if m.num_experts > m.experts_per_token:
        expert = (m.params - m.active_params) * m.num_experts / (
            m.num_experts - m.experts_per_token
        )
    else:
        expert = 0.0
    return ModelParams(
        shared_params=m.params - expert,
        expert_params=expert,
        active_params=m.active_params,
        layers=float(m.layers),
        q_heads=float(m.q_heads),
        kv_heads=float(m.kv_heads),
        head_dim=float(m.head_dim),
        hidden_size=float(m.hidden_size),
        experts_per_token_fraction=m.experts_per_token / m.num_experts,
        weight_dtype_bytes=float(m.weight_dtype_bytes),
        kv_dtype_bytes=float(m.kv_dtype_bytes),
        max_context_tokens=float(m.max_context_tokens or math.inf),
        weight_compute=float(precision.WEIGHT_COMPUTE[m.weight_dtype]),
        **draft_fields(m.draft),
    )


_DRAFT_FIELDS = tuple(f for f in ModelParams._fields if f.startswith("draft_"))


def models_params(models: list[Model]) -> ModelParams:
    """``model_params`` of each model, stacked. Beside a model with a draft
    model, one without has zeros for its draft (every draft term exactly 0)."""
    params = [model_params(m) for m in models]
    if any(m.draft is not None for m in models):
        zeros = dict.fromkeys(_DRAFT_FIELDS, 0.0)
        params = [p if m.draft is not None else p._replace(**zeros)
                  for m, p in zip(models, params)]
    return stack(params)


def draft_fields(d: Model | None) -> dict[str, float]:
    """``ModelParams``'s ``draft_*`` leaves of a draft model's config (dense,
    ``sweep.config.resolve``); none (the defaults, ``None``) without one."""
    if d is None:
        return {}
    return {"draft_params": d.params, "draft_layers": float(d.layers),
            "draft_q_heads": float(d.q_heads), "draft_kv_heads": float(d.kv_heads),
            "draft_head_dim": float(d.head_dim),
            "draft_hidden_size": float(d.hidden_size),
            "draft_weight_dtype_bytes": float(d.weight_dtype_bytes)}
