"""Request streams for the serving simulator: arrival times and lengths.

Arrivals are a Poisson process at ``arrival_rate_per_s`` (independent
exponential gaps, the usual open-loop load model of serving benchmarks such as
vLLM's ``benchmark_serving.py --request-rate``), or a trace's own timestamps
stretched so that their mean rate equals the target rate (its burstiness is
kept). Prompt and output lengths are drawn independently from the workload's
tables (``sweep.workload.WorkloadTables``), so a discrete mixture, a binned
lognormal and a trace's empirical distribution are sampled alike.

``sample_requests`` is jittable and vmappable over keys and rates; the tables
and the number of requests are constants.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sweep.workload import WorkloadTables


class Requests(NamedTuple):
    """A request stream sorted by arrival (every leaf shape ``(R,)``, float32)."""

    arrival_s: jax.Array  # arrival time, seconds from the start of the run
    prompt_tokens: jax.Array  # prompt length, tokens (>= 1)
    output_tokens: jax.Array  # output length, tokens, first token included (>= 1)


def _trace_arrivals_s(trace_arrival_s: np.ndarray, num_requests: int) -> np.ndarray:
    """``num_requests`` offsets from a trace, repeating it when it is shorter.

    A repeat starts one mean gap after the previous copy ends, so the mean rate
    of the result is the trace's mean rate.
    """
    t = np.asarray(trace_arrival_s, dtype=np.float64)
    t = t - t[0]
    if len(t) < 2 or t[-1] <= 0.0:
        raise ValueError("trace_arrival_s needs >= 2 increasing timestamps")
    period = t[-1] * len(t) / (len(t) - 1)
    copies = -(-num_requests // len(t))
    out = (t[None, :] + period * np.arange(copies)[:, None]).ravel()
    return out[:num_requests]


def sample_requests(key, workload_tables: WorkloadTables, num_requests: int,
                    arrival_rate_per_s, trace_arrival_s=None) -> Requests:
    """Samples ``num_requests`` requests (the first one arrives after one gap).

    Args:
      key: PRNG key.
      workload_tables: length tables (constants).
      num_requests: static.
      arrival_rate_per_s: mean arrival rate (traced scalar).
      trace_arrival_s: optional trace timestamps (host array, seconds); when
        given, arrivals are the trace's offsets (repeated if the trace is
        shorter) scaled by ``trace_rate / arrival_rate_per_s``, where
        ``trace_rate = (n - 1) / span`` is the trace's own mean rate.

    Returns:
      ``Requests`` with float32 leaves of shape ``(num_requests,)``.
    """
    k_gap, k_prompt, k_output = jax.random.split(key, 3)
    rate = jnp.asarray(arrival_rate_per_s, jnp.float32)
    if trace_arrival_s is None:
        gaps = jax.random.exponential(k_gap, (num_requests,), jnp.float32)
        arrival = jnp.cumsum(gaps) / rate
    else:
        offsets = _trace_arrivals_s(trace_arrival_s, num_requests)
        t = np.asarray(trace_arrival_s, dtype=np.float64)
        trace_rate = (len(t) - 1) / (t[-1] - t[0])
        # the first request arrives one mean gap after the start, as with Poisson
        arrival = jnp.asarray(offsets + 1.0 / trace_rate, jnp.float32) * (
            trace_rate / rate)

    def draw(k, values, probs):
        v = jnp.asarray(values, jnp.float32)
        p = jnp.asarray(probs, jnp.float32)
        return jnp.maximum(jax.random.choice(k, v, (num_requests,), p=p), 1.0)

    return Requests(
        arrival_s=arrival,
        prompt_tokens=draw(k_prompt, workload_tables.prompt_values,
                           workload_tables.prompt_probs),
        output_tokens=draw(k_output, workload_tables.output_values,
                           workload_tables.output_probs),
    )
