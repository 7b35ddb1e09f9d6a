"""What a replica's throughput costs: USD per token, batching losses, traffic.

Rules from the SPEC's execution model: a replica of ``tp`` GPUs costs
``usd_per_gpu_hour * tp`` per hour; USD per 1M tokens is that hourly price over
the tokens produced in an hour. Static batching pays for slots that idle while
the longest output of each batch finishes (``E[out] / E[max of B outputs]``,
exact for a discrete length distribution since ``P(max <= x) = F(x)^B``).
A traffic level of ``T`` output tokens a day needs ``ceil(T / capacity)``
replicas and pays for all of them whether they are busy or not.
"""

from __future__ import annotations

import jax.numpy as jnp

HOURS_PER_MONTH = 730.0
SECONDS_PER_DAY = 86_400.0


def cost_per_mtok_usd(usd_per_gpu_hour, gpus, tokens_per_s):
    """USD per 1M tokens at a steady ``tokens_per_s``."""
    return usd_per_gpu_hour * gpus / (tokens_per_s * 3600.0) * 1e6


def expected_max(values, probs, batch):
    """``E[max of batch i.i.d. draws]`` from a discrete distribution.

    Args:
      values: support, ascending, shape ``(K,)``; padding repeats the last value
        with probability 0.
      probs: probabilities, shape ``(K,)``.
      batch: number of draws (traced, >= 1).
    """
    cdf = jnp.cumsum(probs)
    cdf = jnp.clip(cdf / cdf[-1], 0.0, 1.0)
    below = jnp.concatenate([jnp.zeros((1,), cdf.dtype), cdf[:-1]])
    return jnp.sum(values * (cdf**batch - below**batch))


def static_slot_utilization(values, probs, batch):
    """Share of a static batch's slot-steps that emit a token."""
    mean = jnp.sum(values * probs) / jnp.sum(probs)
    return mean / expected_max(values, probs, batch)


def replicas_for_traffic(output_tokens_per_s, tokens_per_day):
    """Replicas needed to serve ``tokens_per_day`` (at least one)."""
    capacity_per_day = output_tokens_per_s * SECONDS_PER_DAY
    return jnp.maximum(jnp.ceil(tokens_per_day / capacity_per_day), 1.0)


def effective_cost_per_mtok_usd(usd_per_gpu_hour, gpus, replicas, tokens_per_day):
    """USD per 1M output tokens actually served, idle capacity included.

    Monthly GPU cost over monthly tokens; the month's length cancels.
    """
    monthly_usd = replicas * usd_per_gpu_hour * gpus * HOURS_PER_MONTH
    monthly_tokens = tokens_per_day * HOURS_PER_MONTH / 24.0
    return monthly_usd / monthly_tokens * 1e6
