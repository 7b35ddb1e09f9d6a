"""Pytrees of physical parameters that every model function receives.

The Hydra schemas (``sweep.config.schema``) describe what a user writes; these
NamedTuples are what the JAX code sees: plain float leaves in SI units, so one
function of one grid point can be ``vmap``-ped over stacked parameters. They
are NamedTuples rather than ``eqx.Module`` because that is all they need to be:
immutable pytrees with named fields and no extra dependency.

Configs become these pytrees in ``sweep.config.convert`` and only there: this
module, and the physics built on it, import neither Hydra nor omegaconf.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

OVERLONG = ("reject", "truncate")
"""``workload.overlong`` values; the simulator receives their index."""
REJECT, TRUNCATE = range(2)


class HardwareParams(NamedTuple):
    """One GPU type (all leaves float; shape ``()`` per point)."""

    memory_bandwidth_bytes_per_s: jax.Array
    peak_flops_per_s: jax.Array
    memory_bytes: jax.Array
    interconnect_bytes_per_s: jax.Array
    usd_per_gpu_hour: jax.Array
    mbu: jax.Array
    mfu: jax.Array
    step_overhead_s: jax.Array
    gpu_memory_utilization: jax.Array
    # measured step shape (sweep.grid.calibration): KV-cache reads stream at their
    # own utilisation, and each sequence in a step adds a fixed time
    kv_mbu: jax.Array = 1.0
    sequence_overhead_s: jax.Array = 0.0
    # dense tensor-core rates of the quantised dtypes (sweep.model.precision); 0: none
    fp8_flops_per_s: jax.Array = 0.0
    fp4_flops_per_s: jax.Array = 0.0
    # one GPU's link to another instance (disaggregated prefill/decode's KV transfer)
    kv_link_bytes_per_s: jax.Array = 5.0e10
    # 1: the KV leaves layer by layer as the prefill computes it
    # (``roofline.kv_transfer_overlap``); 0: once the prefill has ended
    kv_layerwise: jax.Array = 0.0


class ModelParams(NamedTuple):
    """One model's roofline-relevant architecture (all leaves float)."""

    shared_params: jax.Array  # read every step (attention, embeddings, dense MLP)
    expert_params: jax.Array  # routed-expert weights; 0 for a dense model
    active_params: jax.Array  # parameters one token multiplies through
    layers: jax.Array
    q_heads: jax.Array
    kv_heads: jax.Array
    head_dim: jax.Array
    hidden_size: jax.Array
    experts_per_token_fraction: jax.Array  # k / E; 1 for a dense model
    weight_dtype_bytes: jax.Array
    kv_dtype_bytes: jax.Array
    # longest prompt + output served (vLLM's max_model_len); inf: no limit
    max_context_tokens: jax.Array = math.inf
    # the tensor-core rate the linear layers run at (sweep.model.precision: BF16 0,
    # FP8 1, FP4 2)
    weight_compute: jax.Array = 0.0
    # the draft model of speculative decoding with the draft proposer, dense, at
    # the target's tensor parallelism (sweep.model.roofline.draft_model); its KV
    # is kept at the target's KV dtype. draft_params 0: none loaded at this
    # point; None (an empty pytree, static): none in the program, whose step
    # functions then have no draft terms at all
    draft_params: jax.Array | None = None
    draft_layers: jax.Array | None = None
    draft_q_heads: jax.Array | None = None
    draft_kv_heads: jax.Array | None = None
    draft_head_dim: jax.Array | None = None
    draft_hidden_size: jax.Array | None = None
    draft_weight_dtype_bytes: jax.Array | None = None


def stack(trees: list, dtype=jnp.float32):
    """Stacks a list of same-structure pytrees of numbers along a new axis 0."""
    return jax.tree.map(
        lambda *xs: jnp.asarray(np.array(xs, dtype=np.float64), dtype), *trees
    )


class WorkloadParams(NamedTuple):
    """The length statistics the roofline needs from a workload."""

    mean_prompt_tokens: jax.Array
    mean_output_tokens: jax.Array
    output_values: jax.Array  # shape=(K,), ascending support of output lengths
    output_probs: jax.Array  # shape=(K,), their probabilities
    # share of each prompt found in the prefix cache when caching is on
    prefix_hit_fraction: jax.Array = 0.0
    # shape=(1 + P, J) each: the share an LRU cache of the trace's block
    # hashes finds as a step function of its capacity
    # (``roofline.lru_hit_fraction``), row 0 one engine's, the others a
    # disaggregated prefill pool's of ``lru_pools`` instances; a workload
    # without hashes finds none (((-inf,),), ((0,),))
    lru_capacity_tokens: jax.Array = ((-float("inf"),),)
    lru_share: jax.Array = ((0.0,),)
    # shape=(1 + P,): each row's prefill instances (0: one engine)
    lru_pools: jax.Array = (0.0,)


class GridPoint(NamedTuple):
    """The serving settings of one grid point (each a scalar)."""

    tensor_parallel: jax.Array
    concurrency: jax.Array
    token_budget: jax.Array
    context_tokens: jax.Array
    batching: jax.Array  # index into sweep.model.batching.POLICIES, int32
    long_prompt_tokens: jax.Array
    traffic_tokens_per_day: jax.Array
    # indices into sweep.model.precision's WEIGHT_DTYPES and KV_DTYPES, int32;
    # OWN (-1): the model's own
    weight_dtype: jax.Array = -1
    kv_dtype: jax.Array = -1
    # speculative decoding: tokens proposed per step (0: off), and the
    # chance each proposed token is accepted
    spec_tokens: jax.Array = 0.0
    spec_acceptance: jax.Array = 0.0
    # who proposes them (sweep.model.roofline.PROPOSERS): 0 an n-gram lookup,
    # 1 the model's draft model
    spec_proposer: jax.Array = 0.0
    # automatic prefix caching: 1 on (the workload's hit fraction), 0 off
    prefix_caching: jax.Array = 0.0
    # disaggregated prefill/decode: 1 on (p prefill-only instances of
    # prefill_tensor_parallel GPUs, 0 meaning the point's TP, and d
    # decode-only instances of the point's TP), 0 one aggregated engine
    disaggregated: jax.Array = 0.0
    prefill_instances: jax.Array = 1.0
    decode_instances: jax.Array = 1.0
    prefill_tensor_parallel: jax.Array = 0.0

    @property
    def prefill_tp(self) -> jax.Array:
        """The TP of the GPUs that prefill: a disaggregated point's prefill
        instances', an aggregated engine's own."""
        return jnp.where(jnp.asarray(self.disaggregated) > 0,
                         prefill_tp(self.prefill_tensor_parallel, self.tensor_parallel),
                         self.tensor_parallel)


def prefill_tp(prefill_tensor_parallel, tensor_parallel):
    """A disaggregated point's prefill instances' tensor parallelism: the
    ``prefill_tensor_parallel`` axis's value, 0 there meaning the point's."""
    return jnp.where(jnp.asarray(prefill_tensor_parallel) > 0,
                     prefill_tensor_parallel, tensor_parallel)
