"""The roofline and cost rules against the SPEC's seed table and hand calculations."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    FLOPS,
    KVB,
    MEM,
    SEED_TABLE,
    USD,
    W,
    chunked,
    compose_app,
    cost_per_mtok,
    decode,
    expected_max_enumerated,
    step,
)

from sweep.config.convert import hardware_params, model_params
from sweep.model import cost, roofline
from sweep.model.batching import CONTINUOUS, REQUEST, STATIC
from sweep.model.params import GridPoint, WorkloadParams
from sweep.model.point import evaluate_point

# float32 model vs float64 hand numbers: 1e-5 covers float32 rounding of
# sums of ~1e10-sized terms with margin
RTOL = 1e-5

@pytest.fixture
def seed():
    app = compose_app("grid", ["hardware=h100_sxm", "model=qwen3_8b"])
    hw = hardware_params(app.hardware, 1.0)
    model = model_params(app.model)
    return (jax.tree.map(jnp.float32, hw), jax.tree.map(jnp.float32, model))


def test_seed_constants(seed):
    hw, model = seed
    assert float(roofline.kv_bytes_per_token(model)) == 147_456
    np.testing.assert_allclose(float(roofline.weight_bytes(model)), 16.38e9, rtol=RTOL)
    assert float(hw.memory_bandwidth_bytes_per_s) == pytest.approx(3.35e12)


@pytest.mark.parametrize("n, itl_ms, user, gpu, usd", SEED_TABLE)
def test_seed_table_to_printed_digits(seed, n, itl_ms, user, gpu, usd):
    hw, model = seed
    step_s = float(roofline.decode_step_s(hw, model, 1.0, float(n), 1500.0))
    out = n / step_s
    assert round(step_s * 1e3, 2) == itl_ms
    assert round(1 / step_s) == user
    assert round(out) == gpu
    assert round(float(cost.cost_per_mtok_usd(hw.usd_per_gpu_hour, 1.0, out)), 2) == usd


@pytest.mark.parametrize("n, c", [(1, 1500), (64, 1500), (256, 1500), (4, 32_000),
                                  (16, 128_000)])
def test_decode_step_and_long_context_match_hand(seed, n, c):
    hw, model = seed
    got = float(roofline.decode_step_s(hw, model, 1.0, float(n), float(c)))
    np.testing.assert_allclose(got, decode(n, c), rtol=RTOL)


def test_long_context_hand_number(seed):
    # one sequence at 128k context: (16.38e9 + 128000 * 147456 B) / 3.35e12 B/s
    hw, model = seed
    got = float(roofline.decode_step_s(hw, model, 1.0, 1.0, 128_000.0))
    np.testing.assert_allclose(got, (16.38e9 + 128_000 * 147_456) / 3.35e12, rtol=RTOL)


def test_prefill_cost_matches_hand(seed):
    # a 1,500-token prompt in one step is compute-bound on H100
    hw, model = seed
    t = float(roofline.prefill_step_s(hw, model, 1.0, 1500.0))
    flops = 2 * 8.19e9 * 1500 + 4 * 36 * 32 * 128 * (1500 * 1501 / 2)
    np.testing.assert_allclose(t, flops / FLOPS, rtol=RTOL)
    np.testing.assert_allclose(
        float(cost.cost_per_mtok_usd(USD, 1.0, 1500 / t)),
        cost_per_mtok(1500 / (flops / FLOPS)), rtol=RTOL)


@pytest.mark.parametrize("n, c, prompt, budget", [
    (32, 1500, 8192, 512), (32, 1500, 8192, 2048), (1, 1500, 1000, 4096),
    (128, 4000, 30_000, 256), (8, 1500, 8192, 8192), (64, 1500, 5000, 1536),
])
def test_chunked_prefill_matches_chunk_loop(seed, n, c, prompt, budget):
    hw, model = seed
    total, steps, worst = roofline.chunked_prefill(
        hw, model, 1.0, float(n), float(c), float(prompt), float(budget))
    want = chunked(n, c, prompt, budget)
    np.testing.assert_allclose(float(total), want[0], rtol=RTOL)
    assert float(steps) == want[1]
    np.testing.assert_allclose(float(worst), want[2], rtol=RTOL)


def test_mixed_step_counts_prefix_reads_and_causal_keys(seed):
    hw, model = seed
    got = float(roofline.mixed_step_s(hw, model, 1.0, 10.0, 10 * 2000.0, 512.0, 1024.0))
    keys = 10 * 2000 + 512 * 1024 + 512 * 513 / 2
    np.testing.assert_allclose(got, step(10 + 512, 10 * 2000 + 1024, keys), rtol=RTOL)


SEED_OUT = ([100.0, 300.0, 800.0, 2000.0], [0.5, 0.3, 0.15, 0.05])


@pytest.mark.parametrize("batch", [1, 2, 3, 8])
def test_static_batching_expected_max_is_exact(batch):
    values, probs = SEED_OUT
    got = float(cost.expected_max(jnp.array(values), jnp.array(probs), float(batch)))
    np.testing.assert_allclose(got, expected_max_enumerated(values, probs, batch),
                               rtol=RTOL)


def test_static_batching_cost_is_continuous_over_utilization(seed):
    hw, model = seed
    values, probs = SEED_OUT
    b = 8
    util = 360.0 / expected_max_enumerated(values, probs, b)
    got = float(cost.static_slot_utilization(jnp.array(values), jnp.array(probs),
                                             float(b)))
    np.testing.assert_allclose(got, util, rtol=RTOL)
    wl = WorkloadParams(jnp.float32(1500), jnp.float32(360), jnp.array(values),
                        jnp.array(probs))

    def cost_at(batching):
        pt = GridPoint(*map(jnp.float32, (1, b, 512, 1500)), jnp.int32(batching),
                       jnp.float32(8192), jnp.float32(1e8))
        return float(evaluate_point(hw, model, wl, pt, jnp.float32(got))[
            "cost_per_mtok_out_usd"])

    # static batching pays the continuous price over the slot utilisation
    continuous = cost_per_mtok(b / decode(b, 1500))
    np.testing.assert_allclose(cost_at(CONTINUOUS), continuous, rtol=RTOL)
    np.testing.assert_allclose(cost_at(STATIC), continuous / util, rtol=RTOL)
    # request-at-a-time is one sequence at a time, whatever the concurrency
    np.testing.assert_allclose(cost_at(REQUEST), cost_per_mtok(1 / decode(1, 1500)),
                               rtol=RTOL)


def test_kv_capacity_and_fit(seed):
    hw, model = seed
    capacity = (MEM - W) / KVB
    np.testing.assert_allclose(float(roofline.kv_capacity_tokens(hw, model, 1.0)),
                               capacity, rtol=RTOL)
    fit = float(roofline.max_concurrency_fit(hw, model, 1.0, 1500.0))
    assert fit == capacity // 1500 == 287
    assert bool(roofline.kv_fits(hw, model, 1.0, 287.0, 1500.0))
    assert not bool(roofline.kv_fits(hw, model, 1.0, 288.0, 1500.0))


@pytest.mark.parametrize("tokens_per_day, replicas", [(1e6, 1), (1e8, 1), (5e9, 5)])
def test_low_traffic_pays_for_idle_capacity(tokens_per_day, replicas):
    # seed at concurrency 256: 11,747 tok/s = 1.015e9 tokens/day per replica
    capacity = 256 / decode(256, 1500)
    got = float(cost.replicas_for_traffic(capacity, tokens_per_day))
    assert got == replicas
    eff = float(cost.effective_cost_per_mtok_usd(USD, 1.0, got, tokens_per_day))
    # monthly GPU cost over monthly tokens: 4.29 USD/h * 730 h / (T * 730 / 24)
    np.testing.assert_allclose(eff, replicas * USD * 730 / (tokens_per_day * 730 / 24)
                               * 1e6, rtol=RTOL)
    if tokens_per_day == 1e6:
        assert round(eff, 2) == 102.96  # 4.29 * 24 USD a day for 1M tokens


def test_tensor_parallel_splits_work_and_adds_allreduce():
    app = compose_app("grid", ["hardware=h100_sxm", "model=llama3_1_70b"])
    hw, model = hardware_params(app.hardware, 1.0), model_params(app.model)
    n, c, tp = 16.0, 2000.0, 4.0
    got = float(roofline.decode_step_s(hw, model, tp, n, c))
    m = app.model
    kvb = 2 * m.layers * m.kv_heads * m.head_dim * 2
    mem = (m.params * 2 + n * c * kvb) / tp / app.hardware.memory_bandwidth_bytes_per_s
    comp = (2 * m.params * n + 4 * m.layers * m.q_heads * m.head_dim * n * c) / tp / (
        app.hardware.peak_flops_per_s)
    # two ring all-reduces per layer of n x hidden bf16 activations
    comm = 2 * m.layers * 2 * (tp - 1) / tp * n * m.hidden_size * 2 / (
        app.hardware.interconnect_bytes_per_s)
    np.testing.assert_allclose(got, max(mem, comp) + comm, rtol=RTOL)


def test_moe_reads_only_touched_experts():
    app = compose_app("grid", ["model=mixtral_8x7b"])
    m = model_params(app.model)
    e, k = 8, 2
    expert = (46.7e9 - 12.9e9) * e / (e - k)
    shared = 46.7e9 - expert
    for t in (1.0, 4.0, 64.0):
        want = (shared + expert * (1 - (1 - k / e) ** t)) * 2
        np.testing.assert_allclose(float(roofline.weight_bytes_read(m, t)), want,
                                   rtol=RTOL)
    # one token multiplies through the active parameters only
    np.testing.assert_allclose(shared + expert * k / e, 12.9e9, rtol=1e-9)
