"""Independent float64 hand calculations of the SPEC's roofline rules.

Nothing here imports the package's model code: these are the numbers the
model is checked against.
"""

from __future__ import annotations

import math

# the SPEC's seed: H100 SXM, Qwen3-8B bf16
BW, FLOPS, MEM, USD = 3.35e12, 989e12, 80e9, 4.29
PARAMS, LAYERS, QH, KVH, HD = 8.19e9, 36, 32, 8, 128
W = PARAMS * 2
KVB = 2 * LAYERS * KVH * HD * 2
FPK = 4 * LAYERS * QH * HD


def step(new_tokens, kv_read_tokens, keys, bw=BW, flops=FLOPS):
    return max((W + kv_read_tokens * KVB) / bw,
               (2 * PARAMS * new_tokens + FPK * keys) / flops)


def decode(n, c, **kw):
    return step(n, n * c, n * c, **kw)


def chunk_keys(m, p):
    return m * p + m * (m + 1) / 2


def chunked(n, c, prompt, budget):
    """Loop over chunks one by one: (total_s, steps, worst_s)."""
    total, steps, worst, done = 0.0, 0, 0.0, 0
    while done < prompt:
        m = min(budget, prompt - done)
        t = step(n + m, n * c + done, n * c + chunk_keys(m, done))
        total, steps, worst, done = total + t, steps + 1, max(worst, t), done + m
    return total, steps, worst


def cost_per_mtok(tokens_per_s, gpus=1, usd=USD):
    return usd * gpus / (tokens_per_s * 3600) * 1e6


def expected_max_enumerated(values, probs, batch):
    """E[max of batch draws] by enumerating every outcome (small batch only)."""
    import itertools

    total = 0.0
    for combo in itertools.product(range(len(values)), repeat=batch):
        p = math.prod(probs[i] for i in combo)
        total += p * max(values[i] for i in combo)
    return total
