"""Chunk steps along a prompt, and a prompt band's prefill work.

**Chunk steps at their cached prefix** (``chunk_lines``, ``Ramp``). A chunk
of ``m`` tokens after ``c`` cached ones, beside ``n`` decodes, takes
``max(memory(c), compute(c)) + fixed``, both lines in ``c``. A prompt's chunk
steps are taken at every prefix they occur at: its prefill time alone is the
exact sum of ``roofline.chunked_prefill`` (chunks of ``b = budget - n``
tokens, decodes being scheduled first), and the step times its chunks add to
the ITL distribution are the ramp from the first chunk to the last (cached
prefix uniform on ``[0, P - m]``): two uniform pieces in time, one on each
side of the point where memory and compute cross, each smoothed by a logistic
kernel (closed form). A draft model's first pass, over the decodes and the
chunk, adds a maximum of its own (``roofline.draft_lines``): exact in the
prefill time, at the ramp's three points in the ITL distribution.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from sweep.model import roofline
from sweep.model._numerics import (
    smooth_max,
    softplus,
    straight_through,
)


class Ramp(NamedTuple):
    """Step time ``f(c) = max(mem0 + mem1 c, comp0 + comp1 c) + fixed`` of a
    chunk after ``c`` cached tokens, for ``c`` uniform on ``[0, span]``: two
    uniform pieces in time, ``[f0, f1]`` (weight ``w_low``) and ``[f1, f2]``."""

    f0: jax.Array
    f1: jax.Array
    f2: jax.Array
    w_low: jax.Array

    @property
    def mean(self):
        return self.w_low * (self.f0 + self.f1) / 2 + (1 - self.w_low) * (
            self.f1 + self.f2) / 2


def chunk_lines(hw, model, tp, decodes, context_tokens, chunk_tokens, spec_tokens):
    """A chunk's step time as lines in its cached prefix ``c``
    (``roofline.step_s`` with ``kv = n ctx + c`` and
    ``keys = n ctx + m c + m (m + 1) / 2``; the decodes verify ``spec_tokens``
    proposals each, ``roofline.verified_decodes``).

    Written out rather than ``roofline.step_lines``, for the reason given in
    ``roofline.chunked_prefill``: the terms keep the order the surrogate's
    figures and gradients are bitwise tied to.

    Returns ``(lines, draft)``: with a draft model, ``lines`` holds its passes
    over the decodes alone in ``fixed_s`` and ``draft`` its first pass, over
    the decodes and the chunk, as lines of its own (its own maximum,
    ``roofline.draft_lines``); ``draft`` is ``None`` without one.
    """
    ctx = decodes * context_tokens
    dec_new, dec_keys = roofline.verified_decodes(decodes, ctx, spec_tokens)
    new = dec_new + chunk_tokens
    bw = tp * roofline.effective_bandwidth_bytes_per_s(hw)
    peak = tp * roofline.effective_flops_per_s(hw)
    kvb = roofline.kv_read_bytes_per_token(hw, model)
    fpk = roofline.attention_flops_per_key(model)
    mem0 = (roofline.weight_bytes_read(model, new) + ctx * kvb) / bw
    comp0 = (roofline.linear_flops_per_token(hw, model) * new
             + fpk * (dec_keys + chunk_tokens * (chunk_tokens + 1.0) / 2.0)) / peak
    fixed = roofline.fixed_s(hw, model, tp, new, decodes + 1.0)
    draft = None
    if model.draft_params is not None:
        # the draft's passes over the decodes alone are the same in every
        # chunk's step; its first pass takes the chunk, at the same prefix
        draft, rest = roofline.draft_lines(
            hw, model, tp, decodes, ctx, 0.0, spec_tokens, chunk_tokens, 0.0, 1.0,
            chunk_tokens * (chunk_tokens + 1.0) / 2.0, chunk_tokens)
        fixed = fixed + rest.at(0.0)
    return roofline.StepLines(mem0, kvb / bw, comp0, fpk * chunk_tokens / peak,
                              fixed), draft


def chunk_ramp(hw, model, tp, decodes, context_tokens, chunk_tokens, span_tokens,
          spec_tokens, cached_tokens=0.0):
    """The ramp of chunk steps with prefixes uniform on ``[c, c + span]``,
    ``c`` the prompt's prefix in the prefix cache. Its three points are
    exact; with a draft model, whose first pass adds a maximum with a
    crossing of its own, the step times between them are taken as linear
    past that crossing too (a chord of a convex function of the prefix:
    never below it)."""
    lines, draft = chunk_lines(hw, model, tp, decodes, context_tokens, chunk_tokens,
                                spec_tokens)
    ds = lines.memory_slope_s - lines.compute_slope_s
    cross = jnp.where(ds == 0.0, 0.0, roofline.crossing(lines))
    split = jnp.clip(cross - cached_tokens, 0.0, span_tokens)
    some = span_tokens > 1e-6
    w_low = jnp.where(some, split / jnp.where(some, span_tokens, 1.0), 0.0)

    def at(x):
        return lines.at(x) if draft is None else lines.at(x) + draft.at(x)

    return Ramp(at(jnp.zeros_like(span_tokens) + cached_tokens),
                 at(split + cached_tokens), at(span_tokens + cached_tokens), w_low)


def uniform_cdf(t, lo, hi, scale):
    """CDF of ``U(lo, hi)`` plus a logistic of ``scale``, stable at any width."""
    a = (t - lo) / scale
    width = (hi - lo) / scale
    wide = width > 0.05
    safe_w = jnp.where(wide, width, 1.0)

    def tail(x):  # log1p(exp(-|x|)): softplus minus its ramp
        return jnp.log1p(jnp.exp(-jnp.abs(x)))

    spread = (jnp.clip(a, 0.0, safe_w) + tail(a) - tail(a - safe_w)) / safe_w
    return jnp.where(wide, spread, jax.nn.sigmoid(a - width / 2.0))


def ramp_cdf(t, ramp: Ramp, scale):
    return (ramp.w_low * uniform_cdf(t, ramp.f0, ramp.f1, scale)
            + (1.0 - ramp.w_low) * uniform_cdf(t, ramp.f1, ramp.f2, scale))


def ramp_sf(t, ramp: Ramp, scale):
    """``1 - ramp_cdf``, summed from its own terms (a uniform plus a
    symmetric logistic mirrored): in float32 the complement of a CDF near 1
    keeps only its rounding, 6e-8."""
    return (ramp.w_low * uniform_cdf(-t, -ramp.f1, -ramp.f0, scale)
            + (1.0 - ramp.w_low) * uniform_cdf(-t, -ramp.f2, -ramp.f1, scale))


class Prefill(NamedTuple):
    """Prefill work per prompt band beside ``n`` decodes (arrays of shape (J,))."""

    alone_s: jax.Array  # prefilled alone: the exact chunked sum
    chunks: jax.Array  # ceil(P / b) (chunked_prefill's steps), slope of P / b
    alone_ramp: Ramp  # its ceil(P / b) equal chunks
    fluid_s: jax.Array  # under a queue: P / b full-budget chunks
    fluid_ramp: Ramp
    budget_tokens: jax.Array  # b = prefill tokens one step can take (scalar)


def prefill_work(hw, model, tp, wl, decodes, token_budget, prompt_tokens, spec_tokens,
             cached_tokens=0.0):
    """``prompt_tokens``: the tokens each band's prefill computes, after its
    ``cached_tokens`` (``cached_workload``)."""
    ctx = wl.decode_context_tokens
    # a decode's proposals take budget too
    b = smooth_max(token_budget - roofline.verified_decodes(decodes, 0.0,
                                                            spec_tokens)[0], 1.0, 1.0)
    alone, steps, _ = roofline.chunked_prefill(hw, model, tp, decodes, ctx,
                                               prompt_tokens + cached_tokens, b,
                                               spec_tokens, cached_tokens)
    # the chunks of the prefill just summed: a count of its own (``ceil`` of
    # the ratio) read 1,500 tokens at a budget of exactly 500 as 4 chunks in a
    # float32 program where the sum had 3 (benchmarks/README.md, "The
    # surrogate in float32 against float64")
    k = straight_through(steps, prompt_tokens / b)
    m = prompt_tokens / k
    alone_ramp = chunk_ramp(hw, model, tp, decodes, ctx, m, prompt_tokens - m,
                            spec_tokens, cached_tokens)
    fluid_ramp = chunk_ramp(hw, model, tp, decodes, ctx, b,
                            softplus(prompt_tokens - b, 1.0), spec_tokens,
                            cached_tokens)
    fluid = prompt_tokens / b * fluid_ramp.mean
    return Prefill(alone, k, alone_ramp, fluid, fluid_ramp, b)
