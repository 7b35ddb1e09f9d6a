"""Weight and KV-cache precision: bytes per value and the tensor-core rate used.

A model's weights are stored in ``bf16``, ``fp8``, ``int4`` or ``fp4``, its
KV cache in ``bf16`` or ``fp8`` (vLLM's ``--quantization`` and
``--kv-cache-dtype``). What each costs, stated once here:

* **bytes per weight**, group scales included: ``fp8`` is 1 byte with one
  scale per tensor or per output channel (negligible against the weights);
  ``int4`` (GPTQ / AWQ, W4A16) is half a byte plus one bf16 scale per group
  of 128 weights, ``0.5 + 2 / 128``; ``fp4`` (NVFP4, W4A4) is half a byte
  plus one FP8 (E4M3) scale per block of 16 weights, ``0.5 + 1 / 16`` (its
  one FP32 scale per tensor is negligible). Zero points of asymmetric int4
  schemes are not counted.
* **bytes per KV value**: ``bf16`` 2, ``fp8`` 1 (one scale per tensor).
* **the rate of the linear layers** (``2 * active_params`` FLOPs a token):
  ``fp8`` weights run W8A8 on FP8 tensor cores, ``fp4`` W4A4 on FP4 tensor
  cores, ``int4`` is weight-only (dequantised, multiplied at the BF16 rate),
  ``bf16`` at the BF16 rate. Attention runs at the BF16 rate whatever the KV
  cache's dtype (an FP8 cache is dequantised for the attention kernel), so
  an FP8 KV cache needs no FP8 tensor cores.

A hardware's rate for each tensor-core dtype is a field of it
(``peak_flops_per_s`` for BF16, ``fp8_flops_per_s``, ``fp4_flops_per_s``; 0:
the GPU has none). A weight dtype whose rate is 0 on a hardware is refused
before any compilation (``sweep.grid.job``, ``sweep.search.optimize``).

In the parameter pytrees a dtype is an index (``WEIGHT_DTYPES``,
``KV_DTYPES``); on a grid axis the index ``OWN`` keeps each model's own.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

WEIGHT_DTYPES = ("bf16", "fp8", "int4", "fp4")
"""Weight dtypes (``model.weight_dtype``, ``grid.weight_dtype``)."""
KV_DTYPES = ("bf16", "fp8")
"""KV-cache dtypes (``model.kv_dtype``, ``grid.kv_dtype``)."""
OWN = -1
"""A grid axis's index for "each model's own dtype" (an empty axis list)."""

INT4_GROUP = 128
"""int4 weights per bf16 scale (GPTQ / AWQ's usual group size)."""
FP4_BLOCK = 16
"""fp4 weights per FP8 scale (NVFP4's block)."""
WEIGHT_BYTES = {"bf16": 2.0, "fp8": 1.0, "int4": 0.5 + 2.0 / INT4_GROUP,
                "fp4": 0.5 + 1.0 / FP4_BLOCK}
"""Bytes per weight, group scales included."""
KV_BYTES = {"bf16": 2.0, "fp8": 1.0}
"""Bytes per KV-cache value."""

BF16, FP8, FP4 = 0, 1, 2
"""Tensor-core rates, indices into ``RATE_FIELDS``."""
RATE_FIELDS = ("peak_flops_per_s", "fp8_flops_per_s", "fp4_flops_per_s")
"""The hardware field holding each rate (``peak_flops_per_s``: BF16)."""
WEIGHT_COMPUTE = {"bf16": BF16, "fp8": FP8, "int4": BF16, "fp4": FP4}
"""The rate each weight dtype's linear layers run at."""

_WEIGHT_BYTES = np.array([WEIGHT_BYTES[d] for d in WEIGHT_DTYPES], np.float32)
_WEIGHT_COMPUTE = np.array([WEIGHT_COMPUTE[d] for d in WEIGHT_DTYPES], np.float32)
_KV_BYTES = np.array([KV_BYTES[d] for d in KV_DTYPES], np.float32)


def rate_field(weight_dtype: str) -> str:
    """The hardware field of the rate ``weight_dtype``'s linear layers need."""
    return RATE_FIELDS[WEIGHT_COMPUTE[weight_dtype]]


def supported(hardware, weight_dtype: str) -> bool:
    """Whether ``hardware`` (a config) has the tensor cores ``weight_dtype`` needs."""
    return float(getattr(hardware, rate_field(weight_dtype))) > 0


def allowed(hardware) -> list[str]:
    """The weight dtypes ``hardware`` (a config) can run."""
    return [d for d in WEIGHT_DTYPES if supported(hardware, d)]


def apply(model, weight_dtype, kv_dtype):
    """``model`` (``ModelParams``) stored at the dtypes of two axis indices;
    ``OWN`` keeps the model's own (traced indices: no Python branching)."""
    w = jnp.maximum(weight_dtype, 0)
    kv = jnp.maximum(kv_dtype, 0)
    own_w, own_kv = weight_dtype == OWN, kv_dtype == OWN
    dt = jnp.result_type(model.weight_dtype_bytes)
    return model._replace(
        weight_dtype_bytes=jnp.where(own_w, model.weight_dtype_bytes,
                                     jnp.asarray(_WEIGHT_BYTES, dt)[w]),
        weight_compute=jnp.where(own_w, model.weight_compute,
                                 jnp.asarray(_WEIGHT_COMPUTE, dt)[w]),
        kv_dtype_bytes=jnp.where(own_kv, model.kv_dtype_bytes,
                                 jnp.asarray(_KV_BYTES, dt)[kv]))


def label(model: str, weight_dtype: str, kv_dtype: str) -> str:
    """A model's name with its precision, unless it is bf16 throughout
    (how ``sweep-optimize`` and its report name a candidate's model)."""
    if (weight_dtype, kv_dtype) == (WEIGHT_DTYPES[0], KV_DTYPES[0]):
        return model
    return f"{model} ({weight_dtype} weights, {kv_dtype} KV)"
