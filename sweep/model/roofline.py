"""The roofline execution model: how long one scheduler step takes.

Every function here is written for one grid point (scalar leaves) and is
``vmap``-ped from outside. The rules are the SPEC's "execution model":

* a step moves ``weights + KV already cached that the step attends to`` bytes
  and does ``2 * active_params * tokens + attention`` FLOPs, where one new
  token attending to ``k`` keys costs ``4 * layers * q_heads * head_dim * k``
  (QK^T and PV, 2 FLOP per multiply-add);
* its time is ``max(bytes / (bandwidth * mbu), flops / (peak * mfu))`` plus a
  fixed overhead. Calibrated to measured engines (``sweep.grid.calibration``),
  the KV cache streams at its own ``kv_mbu`` and every sequence in the step
  adds ``sequence_overhead_s``: the step's effective ``mbu`` is then a smooth
  function of its batch and context (1 and 0 by default: the bound).

Tensor parallelism over ``tp`` GPUs splits weights, KV cache and FLOPs evenly
and adds two ring all-reduces of the step's activations per layer (after
attention and after the MLP, as in Megatron-LM, Shoeybi et al. 2019,
arXiv:1909.08053), each moving ``2 (tp - 1) / tp`` times the activation bytes
over the interconnect. Communication is not overlapped with compute.

A mixture of experts reads its shared weights every step and each routed
expert when at least one token of the step is sent to it; with ``k`` of ``E``
experts per token chosen uniformly, ``t`` tokens touch a fraction
``1 - (1 - k/E)^t`` of the experts (the standard balls-into-bins estimate).

Speculative decoding (``speculative_step_s``, ``verified_decodes``,
``tokens_per_step``): a decode that verifies ``k`` proposals computes
``k + 1`` tokens over its cached context (FLOPs grow, the weight and KV
reads do not) and gains ``(1 - a^(k+1)) / (1 - a)`` tokens on average
(Leviathan et al. 2023). Every function is exactly the plain decode at
``k = 0``. Two proposers (``PROPOSERS``):

* ``ngram``: a lookup in the sequence's own tokens (vLLM's
  ``--speculative-config '{"method": "ngram", ...}'``), no GPU time;
* ``draft``: a small model of the same tokenizer (``draft_model``), loaded
  beside the target at the target's tensor parallelism (vLLM's default and,
  for its V1 draft-model proposer, the only choice). Before each verification
  step it runs ``k`` sequential decode steps over the ``B`` decoding
  sequences, each modelled at their current context ``C`` (summed over the
  sequences; the ``j < k`` tokens a draft step adds are left out): with the
  draft's weights ``W_d`` bytes, KV ``q_d`` bytes per token (the target's KV
  dtype), ``2 N_d`` linear FLOPs per token and ``f_d = 4 L_d H_d d_d``
  attention FLOPs per key,

      draft_s = k [max((W_d + q_d C) / (tp bw mbu),
                       (2 N_d B + f_d C) / (tp peak mfu)) + allreduce_d(B)]

  (``draft_lines``; the KV term at ``kv_mbu`` as the target's). The engine's
  step and per-sequence overheads are counted once per engine step, not per
  draft step. The draft keeps its KV in step with the target's, as vLLM's
  V1 draft-model proposer does: in a step that also carries prompt chunks
  (``c`` new tokens after ``h`` cached ones), the draft's first pass covers
  every new token of the step, the ``B`` decodes and the ``c`` chunk
  tokens, and only its other ``k - 1`` passes are over the decodes alone:

      draft_s = first_d + (k - 1) [max((W_d + q_d C) / (tp bw mbu),
                                       (2 N_d B + f_d C) / (tp peak mfu))
                                   + allreduce_d(B)]
      first_d = max((W_d + q_d (C + h)) / (tp bw mbu),
                    (2 N_d (B + c) + f_d (C + c h + c (c + 1) / 2))
                    / (tp peak mfu)) + allreduce_d(B + c)

  One pass, one ``max``: the chunk's tokens go through the draft's layers
  with the decodes, so the draft's weights are read once for both and the
  pass is memory- or compute-bound as a whole, as the target's step is.
  Without decodes the step still takes that one pass, for the chunk alone
  (the draft's prefill: about ``N_d / N`` of the target's FLOPs); without
  a chunk ``draft_s`` is the ``k`` equal passes above. A prompt prefilled
  on a disaggregated prefill instance is prefilled by the target alone
  (the draft's prefill is not modelled there). A verification step with
  ``B`` decodes takes ``speculative_step_s + draft_s`` and the KV capacity
  shrinks to ``(M - W - W_d) / (q + q_d)`` tokens
  (``kv_capacity_tokens``): both models keep KV for every context token.
  Where no draft model can be loaded (``ModelParams.draft_*`` ``None``: no
  point of the program lists the draft proposer) these terms are left out
  of the traced functions, not computed as zeros (``plus_draft_s``).

* ``eagle3``: an EAGLE-3 head (Li et al. 2025, arXiv:2503.01840; vLLM's
  ``"method": "eagle3"``, SGLang's ``EAGLE3``), counted as a draft model
  of its own, one layer deep, by the same formulas: a decoder layer of the
  target's width, heads and MLP whose query, key and value projections
  read ``2 H`` inputs (the token's embedding beside the fused features), an
  ``fc`` of ``3 H x H`` that fuses three of the target's layers' hidden
  states, and an LM head over a draft vocabulary of ``V_d = 32,000`` tokens
  (its embedding is the target's, a lookup):

      N_d = 2 H (q_heads d) + 2 (2 H) (kv_heads d) + (q_heads d) H
            + 3 H I + 3 H^2 + V_d H

  (``eagle3_head_params``; ``I`` the target's ``intermediate_size``, its
  layer's gated MLP ``3 H I``), its weights at bf16 (as the heads are
  published) and its one layer's KV at the target's KV dtype. A MoE
  target's head has a dense MLP of its own width (the head's config.json
  ``intermediate_size``, e.g. 17,280 for gpt-oss-120B's of hidden size
  2,880), given as the model's ``eagle3_intermediate_size``; its attention
  is the target's. Llama-3.1-8B: ``N_d`` = 424.7M, 0.85 GB in bf16,
  against the target's 16.1 GB.

Prefix caching (vLLM's automatic prefix caching, SGLang's RadixAttention):
a prompt whose first ``c`` tokens are cached (``cached_prefix_tokens``)
prefills only its last ``P - c`` tokens, as chunks that start after the
cached prefix: the cached tokens' KV is read and attended to, their linear
and attention FLOPs are not spent again (``prefill_step_s``,
``chunked_prefill``). Exactly the uncached prefill at ``c = 0``.

Disaggregated prefill/decode (DistServe, Zhong et al. 2024, arXiv:2401.09670;
Splitwise, Patel et al. 2024, arXiv:2311.18677; vLLM's disaggregated
prefilling): a prompt's KV, ``P x kv_bytes_per_token``, goes from the prefill
to the decode instance once its prefill ends; each of the ``tp`` GPUs sends
its shard (``1 / tp`` of the KV heads) over its own link, so the transfer
takes ``P kv_bytes_per_token / (tp kv_link_bytes_per_s)``
(``kv_transfer_s``), after the prefill, or, with a connector that sends
each layer's KV as it is computed (``hw.kv_layerwise``), overlapping it:
all but ``max(T - S (L - 1) / L, T / L)`` of it during the prefill of ``S``
(``kv_transfer_overlap``, ``kv_transfer_exposed_s``).

A run of steps whose KV read and attention keys grow linearly with the step
(a long prompt's chunks; the simulator's runs between scheduling events) has
its memory and compute times on two lines (``step_lines``); the larger of
the two changes at most once, at their crossing (``split_at_crossing``), so
the run's duration is two arithmetic series (``run_s``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from sweep.model.params import HardwareParams, ModelParams

PROPOSERS = ("ngram", "draft", "eagle3")
"""Speculative proposers (``GridPoint.spec_proposer`` indexes them)."""
NGRAM, DRAFT, EAGLE3 = range(3)

EAGLE3_DRAFT_VOCAB = 32_000
"""Tokens an EAGLE-3 head's LM head scores (its ``draft_vocab_size``: the
published heads map them to the target's vocabulary)."""

ACTIVATION_BYTES = 2.0
"""Bytes per activation element in all-reduces (bf16 activations)."""
ALLREDUCES_PER_LAYER = 2.0


def weight_bytes(model: ModelParams):
    """All weights resident on the replica, bytes."""
    return (model.shared_params + model.expert_params) * model.weight_dtype_bytes


def kv_bytes_per_token(model: ModelParams):
    """K and V for every layer and KV head, bytes per cached token."""
    return 2.0 * model.layers * model.kv_heads * model.head_dim * model.kv_dtype_bytes


def draft_model(model: ModelParams) -> ModelParams | None:
    """The target's draft model (``ModelParams.draft_*``) as a dense model of
    its own, its KV at the target's KV dtype; every size 0 when none is
    loaded at this point, ``None`` when none can be in the program."""
    if model.draft_params is None:
        return None
    zero = jnp.zeros_like(jnp.asarray(model.draft_params))
    return ModelParams(
        shared_params=model.draft_params, expert_params=zero,
        active_params=model.draft_params, layers=model.draft_layers,
        q_heads=model.draft_q_heads, kv_heads=model.draft_kv_heads,
        head_dim=model.draft_head_dim, hidden_size=model.draft_hidden_size,
        experts_per_token_fraction=zero + 1.0,
        weight_dtype_bytes=model.draft_weight_dtype_bytes,
        kv_dtype_bytes=model.kv_dtype_bytes, weight_compute=zero)


def eagle3_head_params(hidden_size, intermediate_size, q_heads, kv_heads, head_dim):
    """Parameters of an EAGLE-3 head whose MLP is ``intermediate_size``
    wide (module docstring)."""
    h, q, kv = hidden_size, q_heads * head_dim, kv_heads * head_dim
    return (2 * h * q + 2 * (2 * h) * kv + q * h + 3 * h * intermediate_size
            + 3 * h * h + EAGLE3_DRAFT_VOCAB * h)


def with_proposer(model: ModelParams, proposer, spec_tokens) -> ModelParams:
    """``model`` as an engine serves it: its draft leaves (a draft model's,
    or an EAGLE-3 head's: a program holds one of them per model) loaded only
    under a proposer other than n-gram with ``k > 0`` (otherwise every draft
    size is 0, and so is every draft term below); ``model`` itself when it
    has none."""
    if model.draft_params is None:
        return model
    on = (jnp.asarray(proposer) != NGRAM) & (jnp.asarray(spec_tokens) > 0)
    return model._replace(draft_params=jnp.where(on, model.draft_params, 0.0),
                          draft_layers=jnp.where(on, model.draft_layers, 0.0))


def kv_read_bytes_per_token(hw: HardwareParams, model: ModelParams):
    """KV bytes a step's memory time counts per cached token read: the cache
    streams at ``kv_mbu``, the weights at ``mbu``."""
    return kv_bytes_per_token(model) * hw.mbu / hw.kv_mbu


def linear_flops_per_token(hw: HardwareParams, model: ModelParams):
    """FLOPs of one token through the linear layers, counted at the BF16 rate.

    ``2 * active_params``, scaled by ``peak_flops_per_s`` over the rate of the
    model's weight dtype (``sweep.model.precision``: FP8 or FP4 tensor cores for
    fp8 or fp4 weights), so that one division by the BF16 rate times them
    all; the scale is exactly 1 for BF16 compute.
    """
    rate = jnp.where(model.weight_compute == 1.0, hw.fp8_flops_per_s,
                     jnp.where(model.weight_compute == 2.0, hw.fp4_flops_per_s,
                               hw.peak_flops_per_s))
    return 2.0 * model.active_params * (hw.peak_flops_per_s / rate)


def attention_flops_per_key(model: ModelParams):
    """FLOPs for one new token attending to one key (QK^T and PV)."""
    return 4.0 * model.layers * model.q_heads * model.head_dim


def weight_bytes_read(model: ModelParams, new_tokens):
    """Weight bytes a step with ``new_tokens`` tokens reads from memory."""
    f = model.experts_per_token_fraction
    # double where: a dense model (f = 1) must not put log(0) in the gradient
    routed = f < 1.0
    safe_f = jnp.where(routed, f, 0.5)
    touched = jnp.where(routed, -jnp.expm1(new_tokens * jnp.log1p(-safe_f)), 1.0)
    return (model.shared_params + model.expert_params * touched) * (
        model.weight_dtype_bytes
    )


def allreduce_s(hw: HardwareParams, model: ModelParams, tp, new_tokens):
    """Time of the step's tensor-parallel all-reduces; 0 at ``tp = 1``."""
    moved = (
        2.0 * (tp - 1.0) / tp * new_tokens * model.hidden_size * ACTIVATION_BYTES
    )
    return ALLREDUCES_PER_LAYER * model.layers * moved / hw.interconnect_bytes_per_s


def fixed_s(hw: HardwareParams, model: ModelParams, tp, new_tokens, sequences):
    """The part of a step that neither bandwidth nor FLOPs bound: all-reduces,
    the step's overhead and each sequence's (``sequence_overhead_s``)."""
    return (allreduce_s(hw, model, tp, new_tokens) + hw.step_overhead_s
            + hw.sequence_overhead_s * sequences)


def effective_bandwidth_bytes_per_s(hw: HardwareParams):
    """Memory bandwidth one GPU achieves: peak x ``mbu`` (a TP group: ``tp`` x)."""
    return hw.memory_bandwidth_bytes_per_s * hw.mbu


def effective_flops_per_s(hw: HardwareParams):
    """FLOP rate one GPU achieves: peak x ``mfu`` (a TP group: ``tp`` x)."""
    return hw.peak_flops_per_s * hw.mfu


def step_s(hw: HardwareParams, model: ModelParams, tp, new_tokens, kv_read_tokens,
           attention_keys, sequences=0.0):
    """One step's wall time, seconds.

    Args:
      tp: GPUs in the tensor-parallel group.
      new_tokens: tokens the step computes (decodes plus prefill chunk tokens).
      kv_read_tokens: cached tokens whose KV the step reads (summed over sequences).
      attention_keys: keys attended to, summed over all new tokens.
      sequences: sequences in the step (decodes plus prompts chunked).
    """
    bytes_moved = weight_bytes_read(model, new_tokens) + kv_read_tokens * (
        kv_read_bytes_per_token(hw, model)
    )
    flops = (
        linear_flops_per_token(hw, model) * new_tokens
        + attention_flops_per_key(model) * attention_keys
    )
    memory_s = bytes_moved / tp / effective_bandwidth_bytes_per_s(hw)
    compute_s = flops / tp / effective_flops_per_s(hw)
    return (
        jnp.maximum(memory_s, compute_s)
        + allreduce_s(hw, model, tp, new_tokens)
        + hw.step_overhead_s
        + hw.sequence_overhead_s * sequences
    )


def decode_step_s(hw, model, tp, sequences, context_tokens):
    """Decode-only step of ``sequences`` running sequences at mean context."""
    cached = sequences * context_tokens
    return step_s(hw, model, tp, sequences, cached, cached, sequences)


def _draft_pass_lines(hw: HardwareParams, draft: ModelParams, tp, passes, new_tokens,
                      kv_read_tokens, kv_read_slope, attention_keys,
                      attention_keys_slope) -> StepLines:
    """``passes`` equal forward passes of the ``draft`` model over
    ``new_tokens`` tokens that read ``kv_read_tokens + kv_read_slope x``
    cached tokens and attend to ``attention_keys + attention_keys_slope x``
    keys at ``x``: the draft's weights, its KV and its FLOPs at the
    target's rates, its all-reduces, no step overheads."""
    kvb = kv_read_bytes_per_token(hw, draft)
    fpk = attention_flops_per_key(draft)
    bandwidth = tp * effective_bandwidth_bytes_per_s(hw)
    flop_rate = tp * effective_flops_per_s(hw)
    return StepLines(
        passes * (weight_bytes(draft) + kvb * kv_read_tokens) / bandwidth,
        passes * kvb * kv_read_slope / bandwidth,
        passes * (linear_flops_per_token(hw, draft) * new_tokens
                  + fpk * attention_keys) / flop_rate,
        passes * fpk * attention_keys_slope / flop_rate,
        passes * allreduce_s(hw, draft, tp, new_tokens),
    )


def draft_lines(hw: HardwareParams, model: ModelParams, tp, decodes, context_tokens,
                context_slope, spec_tokens, chunk_tokens=0.0, chunk_kv_tokens=0.0,
                chunk_kv_slope=0.0, chunk_keys=0.0, chunk_keys_slope=0.0):
    """The draft model's ``k`` passes in a step of ``decodes`` decodes whose
    summed context is ``context_tokens + context_slope x`` at ``x`` (a step
    of a run, or a chunk's cached prefix), and ``chunk_tokens`` new prompt
    tokens that read ``chunk_kv_tokens + chunk_kv_slope x`` cached tokens and
    attend to ``chunk_keys + chunk_keys_slope x`` keys (module docstring:
    ``draft_s`` and ``first_d``).

    Returns ``(first, rest)`` as ``StepLines``: the first pass, over the
    decodes and the chunk, and the other ``k - 1``, over the decodes. Both
    exactly 0 without a draft model or at ``k = 0``; ``first`` is the
    chunk's pass alone without decodes, and 0 without a chunk either.
    """
    d = draft_model(model)
    first = jnp.where((spec_tokens > 0) & ((decodes > 0) | (chunk_tokens > 0)),
                      1.0, 0.0)
    rest = jnp.where(decodes > 0, jnp.maximum(spec_tokens - 1.0, 0.0), 0.0)
    return (
        _draft_pass_lines(hw, d, tp, first, decodes + chunk_tokens,
                          context_tokens + chunk_kv_tokens,
                          context_slope + chunk_kv_slope, context_tokens + chunk_keys,
                          context_slope + chunk_keys_slope),
        _draft_pass_lines(hw, d, tp, rest, decodes, context_tokens, context_slope,
                          context_tokens, context_slope),
    )


def draft_s(hw, model, tp, decodes, decode_context_tokens, spec_tokens,
            chunk_tokens=0.0, chunk_kv_tokens=0.0, chunk_keys=0.0):
    """The draft model's ``k`` passes in a step of ``decodes`` decodes of
    summed context ``decode_context_tokens`` and a prompt chunk of
    ``chunk_tokens`` tokens that reads ``chunk_kv_tokens`` cached tokens and
    attends to ``chunk_keys`` keys (``draft_lines`` at ``x = 0``), seconds."""
    first, rest = draft_lines(hw, model, tp, decodes, decode_context_tokens, 0.0,
                              spec_tokens, chunk_tokens, chunk_kv_tokens, 0.0,
                              chunk_keys, 0.0)
    return first.at(0.0) + rest.at(0.0)


def plus_draft_s(step, hw, model, tp, decodes, decode_context_tokens, spec_tokens,
                 chunk_tokens=0.0, chunk_kv_tokens=0.0, chunk_keys=0.0):
    """``step`` (seconds) plus ``draft_s``; ``step`` itself, with no draft
    arithmetic traced, for a model without draft leaves (``draft_model``)."""
    if model.draft_params is None:
        return step
    return step + draft_s(hw, model, tp, decodes, decode_context_tokens, spec_tokens,
                          chunk_tokens, chunk_kv_tokens, chunk_keys)


def speculative_step_s(hw, model, tp, sequences, context_tokens, spec_tokens):
    """A decode step that also verifies ``k`` proposed tokens per sequence.

    Each sequence computes ``k + 1`` tokens over its cached context, token
    ``j`` attending to ``context + j`` keys: the weights and the cached KV are
    read once, the FLOPs grow ``k + 1`` times. With the draft proposer the
    draft's ``k`` decode steps come first (``draft_s``); an n-gram lookup
    costs nothing. At ``k = 0`` this is ``decode_step_s``.
    """
    new = spec_tokens + 1.0
    keys = new * context_tokens + new * spec_tokens / 2.0
    return plus_draft_s(
        step_s(hw, model, tp, sequences * new, sequences * context_tokens,
               sequences * keys, sequences),
        hw, model, tp, sequences, sequences * context_tokens, spec_tokens)


def verify_step_s(hw, model, tp, sequences, context_tokens, spec_tokens):
    """``speculative_step_s``, and exactly ``decode_step_s`` (value and
    gradient) at ``k = 0``."""
    return jnp.where(spec_tokens > 0,
                     speculative_step_s(hw, model, tp, sequences, context_tokens,
                                        spec_tokens),
                     decode_step_s(hw, model, tp, sequences, context_tokens))


def verified_decodes(decodes, decode_context_tokens, spec_tokens):
    """``(new tokens, attention keys)`` of ``decodes`` decodes (their context
    summed) that each verify ``k`` proposals: ``k + 1`` tokens each, token
    ``j`` attending to its context + ``j`` keys. ``(decodes, context)``
    exactly at ``k = 0``."""
    new = spec_tokens + 1.0
    spec = spec_tokens > 0
    return (jnp.where(spec, decodes * new, decodes),
            jnp.where(spec, new * decode_context_tokens
                      + decodes * new * spec_tokens / 2.0, decode_context_tokens))


def tokens_per_step(spec_tokens, acceptance):
    """Tokens a sequence gains per verification step: the proposals are
    accepted one by one, each with probability ``a``, up to the first
    rejection, and the step adds the target model's own token, so
    ``E = (1 - a^(k+1)) / (1 - a)`` (Leviathan et al., "Fast Inference from
    Transformers via Speculative Decoding", 2023); ``k + 1`` at ``a = 1``.
    """
    at_one = acceptance >= 1.0
    a = jnp.where(at_one, 0.5, acceptance)  # no 0/0 in the value or gradient
    gained = jnp.where(at_one, spec_tokens + 1.0,
                       (1.0 - a ** (spec_tokens + 1.0)) / (1.0 - a))
    return jnp.where(spec_tokens > 0, gained, 1.0)  # exactly 1 without speculation


PREFIX_BLOCK_TOKENS = 16.0
"""Tokens per cached block: a prompt's prefix is reused in whole KV blocks
(vLLM's default ``--block-size`` on GPUs; SGLang's radix cache matches
single tokens, so this rounds its hits down by under a block)."""


def cached_prefix_tokens(prompt_tokens, hit_fraction, xp=jnp):
    """Tokens of a ``prompt_tokens`` prompt found in the prefix cache: its
    first ``h P`` tokens at hit fraction ``h < 1``, rounded down to whole
    blocks of ``PREFIX_BLOCK_TOKENS``; always fewer than the prompt (the
    last token is computed, as vLLM recomputes it on a full hit). 0 at h = 0.
    ``xp``: the array module (``numpy`` for host tables in float64)."""
    blocks = xp.floor(hit_fraction * prompt_tokens / PREFIX_BLOCK_TOKENS)
    return blocks * PREFIX_BLOCK_TOKENS


def lru_hit_fraction(capacity_tokens, curve_capacity_tokens, curve_share):
    """The share of prompt tokens an LRU prefix cache of ``capacity_tokens``
    finds: the step function ``(curve_capacity_tokens, curve_share)``
    (``sweep.latency.prefix_cache.hit_curve``) at it."""
    k = jnp.searchsorted(jnp.asarray(curve_capacity_tokens), capacity_tokens,
                         side="right")
    return jnp.asarray(curve_share)[jnp.maximum(k - 1, 0)]


def chunk_attention_keys(chunk_tokens, cached_tokens):
    """Keys a causal chunk of ``m`` new tokens after ``p`` cached ones attends to."""
    return chunk_tokens * cached_tokens + chunk_tokens * (chunk_tokens + 1.0) / 2.0


def mixed_step_s(hw, model, tp, decodes, decode_context_tokens, chunk_tokens,
                 chunk_cached_tokens, spec_tokens=0.0):
    """A step of ``decodes`` decodes (summed context) plus one prefill chunk.

    Args:
      decode_context_tokens: context summed over the decoding sequences.
      chunk_tokens: new prompt tokens in the chunk.
      chunk_cached_tokens: prompt tokens of that request prefilled before.
      spec_tokens: proposals each decode verifies (``verified_decodes``).
    """
    new, keys = verified_decodes(decodes, decode_context_tokens, spec_tokens)
    chunk_keys = chunk_attention_keys(chunk_tokens, chunk_cached_tokens)
    step = step_s(
        hw,
        model,
        tp,
        new + chunk_tokens,
        decode_context_tokens + chunk_cached_tokens,
        keys + chunk_keys,
        decodes + jnp.where(chunk_tokens > 0, 1.0, 0.0),
    )
    return plus_draft_s(step, hw, model, tp, decodes, decode_context_tokens,
                        spec_tokens, chunk_tokens, chunk_cached_tokens, chunk_keys)


def prefill_step_s(hw, model, tp, prompt_tokens, cached_tokens=0.0, spec_tokens=0.0):
    """A whole prompt prefilled in one step: its ``prompt - cached`` new
    tokens after the ``cached_tokens`` the prefix cache holds (read and
    attended to, not computed); under speculation with a draft model
    (``spec_tokens > 0``), the draft's pass over them too."""
    return mixed_step_s(hw, model, tp, 0.0, 0.0, prompt_tokens - cached_tokens,
                        cached_tokens, spec_tokens)


class StepLines(NamedTuple):
    """Step times along a run: ``max(memory_s + memory_slope_s x, compute_s +
    compute_slope_s x) + fixed_s`` at ``x`` (a step index, or a cached prefix)."""

    memory_s: jax.Array
    memory_slope_s: jax.Array
    compute_s: jax.Array
    compute_slope_s: jax.Array
    fixed_s: jax.Array

    def at(self, x):
        """The step time at ``x``."""
        return jnp.maximum(self.memory_s + self.memory_slope_s * x,
                           self.compute_s + self.compute_slope_s * x) + self.fixed_s


def step_lines(hw: HardwareParams, model: ModelParams, tp, new_tokens, kv_read_tokens,
               kv_read_slope, attention_keys, attention_keys_slope,
               sequences=0.0) -> StepLines:
    """``step_s`` of steps with ``new_tokens`` each (of ``sequences``
    sequences) whose KV read and attention keys grow linearly in ``x``:
    ``kv_read_tokens + kv_read_slope x`` and ``attention_keys +
    attention_keys_slope x``."""
    kvb = kv_read_bytes_per_token(hw, model)
    fpk = attention_flops_per_key(model)
    bandwidth = effective_bandwidth_bytes_per_s(hw)
    flop_rate = effective_flops_per_s(hw)
    return StepLines(
        (weight_bytes_read(model, new_tokens) + kv_read_tokens * kvb) / tp / bandwidth,
        kv_read_slope * kvb / tp / bandwidth,
        (linear_flops_per_token(hw, model) * new_tokens + fpk * attention_keys) / tp
        / flop_rate,
        fpk * attention_keys_slope / tp / flop_rate,
        fixed_s(hw, model, tp, new_tokens, sequences),
    )


def crossing(lines: StepLines):
    """Where the memory and compute lines meet (``0 / 1`` when parallel)."""
    d0 = lines.memory_s - lines.compute_s
    ds = lines.memory_slope_s - lines.compute_slope_s
    return -d0 / jnp.where(ds == 0.0, 1.0, ds)


def split_at_crossing(lines: StepLines, steps):
    """Splits steps ``0 .. steps - 1`` where the larger of the two lines changes.

    Returns ``(j, (a, s), (b, r))``: step ``i < j`` lasts ``a + s i``, a later
    one ``b + r i`` (plus ``fixed_s``); ``j`` is a float in ``[0, steps]``.
    """
    d0 = lines.memory_s - lines.compute_s
    ds = lines.memory_slope_s - lines.compute_slope_s
    x = crossing(lines)
    h = jnp.asarray(steps, x.dtype)
    # memory is the larger from ceil(x) on (ds > 0) or up to floor(x) (ds < 0)
    j = jnp.where(ds > 0, jnp.clip(jnp.ceil(x), 0.0, h),
                  jnp.where(ds < 0, jnp.clip(jnp.floor(x) + 1.0, 0.0, h), 0.0))
    def line(memory):
        return (jnp.where(memory, lines.memory_s, lines.compute_s),
                jnp.where(memory, lines.memory_slope_s, lines.compute_slope_s))

    return j, line(ds < 0), line((ds > 0) | ((ds == 0) & (d0 >= 0)))


def sum_linear(lo, hi, a, s):
    """``sum_{i=lo}^{hi-1} (a + s i)`` for ``lo <= hi`` (float)."""
    n = hi - lo
    return n * a + s * n * (hi + lo - 1.0) / 2.0


def run_s(lines: StepLines, split, steps):
    """Duration of the first ``steps`` steps (float) of a run, in closed form;
    ``split`` is ``split_at_crossing(lines, ...)``."""
    j, (a, s), (b, r) = split
    k = jnp.minimum(j, steps)
    return sum_linear(0.0, k, a, s) + sum_linear(k, steps, b, r) + steps * lines.fixed_s


def chunked_prefill(hw, model, tp, decodes, context_tokens, prompt_tokens,
                    token_budget, spec_tokens=0.0, cached_tokens=0.0):
    """A long prompt prefilled in ``token_budget`` chunks beside running decodes.

    The prompt's first ``c = cached_tokens`` tokens are in the prefix cache;
    chunk ``i`` (``i < k = floor((P - c) / b)``) has ``b`` tokens after
    ``c + i b`` cached ones; a last chunk of ``P - c - k b`` tokens follows
    when that is non-zero. Both
    the memory and the compute time of full chunks grow linearly in ``i``, so
    the sum of their maximum splits at one crossing index and is summed in
    closed form, with no loop over chunks.

    The decodes verify ``spec_tokens`` proposals each (``verified_decodes``).

    Returns:
      ``(total_s, steps, worst_step_s)``: the prompt's prefill time, the number
      of steps, and the longest of those steps (the worst ITL the decoding
      users see).
    """
    b = token_budget
    left = prompt_tokens - cached_tokens
    full = jnp.floor(left / b)
    rest = left - full * b
    ctx = decodes * context_tokens
    kvb = kv_read_bytes_per_token(hw, model)
    dec_new, dec_keys = verified_decodes(decodes, ctx, spec_tokens)
    new = dec_new + b
    mem_bw = tp * effective_bandwidth_bytes_per_s(hw)
    flop_rate = tp * effective_flops_per_s(hw)
    fpk = attention_flops_per_key(model)
    # step i of the full chunks: step_lines(.., ctx + c, b, ctx + b c
    # + b (b + 1) / 2, b b), written out: it divides by the group's rates
    # once and takes the compute slope as (fpk b) b, and the grid's and the
    # surrogate's figures and gradients are bitwise tied to this order (XLA
    # turns a division by a broadcast into a reciprocal multiply and fuses
    # multiply-adds within a fusion, so the same formula rounds differently
    # in another order)
    lines = StepLines(
        (weight_bytes_read(model, new) + (ctx + cached_tokens) * kvb) / mem_bw,
        b * kvb / mem_bw,
        (linear_flops_per_token(hw, model) * new
         + fpk * (dec_keys + b * cached_tokens + b * (b + 1.0) / 2.0)) / flop_rate,
        fpk * b * b / flop_rate,
        fixed_s(hw, model, tp, new, decodes + 1.0),
    )
    full_sum = run_s(lines, split_at_crossing(lines, full), full)
    last_full = lines.at(full - 1.0)
    if model.draft_params is not None:
        # the draft's first pass takes chunk i too (its own maximum, summed
        # as the target's); its other passes, over the decodes, are the
        # same in every chunk's step
        first, others = draft_lines(hw, model, tp, decodes, ctx, 0.0, spec_tokens, b,
                                    cached_tokens, b,
                                    chunk_attention_keys(b, cached_tokens), b * b)
        full_sum = (full_sum + run_s(first, split_at_crossing(first, full), full)
                    + full * others.at(0.0))
        last_full = last_full + first.at(full - 1.0) + others.at(0.0)
    last_full = jnp.where(full > 0, last_full, 0.0)
    partial = mixed_step_s(hw, model, tp, decodes, ctx, rest, cached_tokens + full * b,
                           spec_tokens)
    partial = jnp.where(rest > 0, partial, 0.0)
    # the same count whichever way the division rounds: at a ratio within
    # rounding of an integer k, rounded up it is k full chunks and no rest,
    # rounded down k - 1 and a full-size rest (``ceil`` of the ratio is not:
    # XLA divides by a reciprocal multiply in some fusions)
    steps = full + jnp.where(rest > 0, 1.0, 0.0)
    return full_sum + partial, steps, jnp.maximum(last_full, partial)


def kv_transfer_s(hw: HardwareParams, model: ModelParams, tp, prompt_tokens):
    """Time to send a prompt's KV from a prefill to a decode instance: ``P
    kv_bytes_per_token / (tp kv_link_bytes_per_s)`` (each GPU of the TP group
    sends its shard over its own link)."""
    return prompt_tokens * kv_bytes_per_token(model) / (tp * hw.kv_link_bytes_per_s)


def kv_transfer_overlap(hw: HardwareParams, model: ModelParams, transfer_s, prefill_s):
    """How a KV transfer of ``transfer_s`` overlaps its prefill of
    ``prefill_s`` (the prompt's own steps, alone): ``(lead, tail)``, the
    transfer starting ``lead`` before the prefill ends and ending at least
    ``tail`` after it, its link busy for all of ``transfer_s``.

    Sent once the prefill has ended: ``(0, T)``. Layer by layer
    (``hw.kv_layerwise``): the ``L`` layers' KV, ``T / L`` each, ready at
    ``l S / L`` as the layers compute, the link sending them in order, so
    the first may leave ``S (L - 1) / L`` before the end and the last
    leaves at the end: ``(S (L - 1) / L, T / L)``, and on a free link the
    part after the prefill is ``max(T - lead, tail)``
    (``kv_transfer_exposed_s``). A prompt of several chunks counts as one
    step of their total time: its earlier chunks' KV could leave sooner,
    so this errs long.
    """
    layers = model.layers
    on = hw.kv_layerwise > 0
    return (jnp.where(on, prefill_s * (layers - 1.0) / layers, 0.0),
            jnp.where(on, transfer_s / layers, transfer_s))


def kv_transfer_exposed_s(hw: HardwareParams, model: ModelParams, transfer_s,
                          prefill_s):
    """The part of a KV transfer after its prefill ends, on a free link
    (``kv_transfer_overlap``): ``T`` sent after the prefill, ``max(T - S (L -
    1) / L, T / L)`` layer by layer."""
    lead, tail = kv_transfer_overlap(hw, model, transfer_s, prefill_s)
    return jnp.maximum(transfer_s - lead, tail)


def kv_capacity_tokens(hw, model, tp):
    """Tokens of KV cache that fit beside the weights on the TP group; with a
    draft model, beside both models' weights, each token holding both
    models' KV."""
    usable = hw.memory_bytes * hw.gpu_memory_utilization * tp
    free, kv = usable - weight_bytes(model), kv_bytes_per_token(model)
    d = draft_model(model)
    if d is not None:
        free, kv = free - weight_bytes(d), kv + kv_bytes_per_token(d)
    return free / kv


def kv_fits(hw, model, tp, sequences, context_tokens):
    """Whether ``sequences`` sequences at ``context_tokens`` fit in memory."""
    return sequences * context_tokens <= kv_capacity_tokens(hw, model, tp)


def max_concurrency_fit(hw, model, tp, context_tokens):
    """Largest number of sequences at ``context_tokens`` that fit (0 if none)."""
    fit = jnp.floor(kv_capacity_tokens(hw, model, tp) / context_tokens)
    return jnp.maximum(fit, 0.0)
