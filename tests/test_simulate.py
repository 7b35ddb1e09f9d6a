"""The vectorized simulator against the step-by-step reference, and its laws.

One jitted function of fully traced arguments (fixed shapes) serves every
case, so each test module compiles it once in float64 (exact comparison with
the float64 reference) and once vmapped in float32.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sweep.arrivals import Requests, sample_requests
from sweep.params import (
    CONTINUOUS,
    REJECT,
    REQUEST,
    STATIC,
    TRUNCATE,
    HardwareParams,
    ModelParams,
)
from sweep.simulate import (
    ITL_MANTISSA_BITS,
    STATUS_SLOTS,
    itl_percentiles,
    simulate,
    simulate_requests,
    summarize,
)
from sweep.workload import WorkloadTables

sys.path.insert(0, str(Path(__file__).parent))
from reference_scheduler import simulate_reference, step_time_s  # noqa: E402

R = 40  # requests per case (one jit shape)
SLOTS = 8
KV_BYTES = 2 * 36 * 8 * 128 * 2  # Qwen3-8B: 147,456 B per token
WEIGHTS = 8.19e9 * 2


def h100(dtype, memory_bytes=80e9):
    return HardwareParams(*(dtype(x) for x in (
        3.35e12, 9.89e14, memory_bytes, 4.5e11, 4.29, 1.0, 1.0, 0.0, 1.0)))


def qwen3_8b(dtype, max_context_tokens=np.inf):
    return ModelParams(*(dtype(x) for x in (
        8.19e9, 0.0, 8.19e9, 36, 32, 8, 128, 4096, 1.0, 2, 2, max_context_tokens)))


def random_requests(seed, rate=20.0):
    rng = np.random.default_rng(seed)
    return (np.cumsum(rng.exponential(1.0 / rate, R)),
            rng.choice([30.0, 200.0, 700.0, 1500.0], R),
            rng.choice([1.0, 5.0, 40.0, 120.0, 300.0], R))


@pytest.fixture(scope="module")
def sim64():
    """The float64 simulator's per-request outcome (one compilation)."""
    @jax.jit
    def run(hw, model, conc, budget, arrival, prompt, output, batching, ttft_slo,
            itl_slo, overlong, mine):
        return simulate_requests(hw, model, 1.0, conc, budget,
                                 Requests(arrival, prompt, output), batching,
                                 ttft_slo, itl_slo, overlong, mine, max_slots=SLOTS)

    def call(arrival, prompt, output, conc=8, budget=512, batching=CONTINUOUS,
             memory_bytes=80e9, ttft_slo=np.inf, itl_slo=np.inf,
             max_context_tokens=np.inf, overlong=REJECT, mine=None):
        mine = np.ones(len(arrival), bool) if mine is None else mine
        with jax.enable_x64(True):
            out = run(h100(np.float64, memory_bytes),
                      qwen3_8b(np.float64, max_context_tokens),
                      np.float64(conc), np.float64(budget), arrival, prompt, output,
                      np.int32(batching), np.float64(ttft_slo), np.float64(itl_slo),
                      np.int32(overlong), mine)
            return jax.tree.map(np.asarray, out)
    return call


CASES = [
    # (seed, batching, concurrency, budget, memory): KV-tight memories force
    # preemptions (continuous) and batch reservations (static)
    (0, CONTINUOUS, 8, 512, 80e9),
    (1, CONTINUOUS, 3, 2048, 80e9),
    (2, CONTINUOUS, 8, 100, 80e9),
    (3, CONTINUOUS, 8, 512, WEIGHTS + KV_BYTES * 3000),
    (4, CONTINUOUS, 8, 4096, WEIGHTS + KV_BYTES * 4000),
    (5, STATIC, 8, 512, 80e9),
    (6, STATIC, 4, 1024, WEIGHTS + KV_BYTES * 5000),
    (7, REQUEST, 8, 512, 80e9),
]


@pytest.mark.parametrize("seed,batching,conc,budget,memory", CASES)
def test_matches_reference(sim64, seed, batching, conc, budget, memory):
    arrival, prompt, output = random_requests(seed)
    ttft_slo, itl_slo = 0.3, 0.02
    got = sim64(arrival, prompt, output, conc, budget, batching, memory, ttft_slo,
                itl_slo)
    ref = simulate_reference(h100(np.float64, memory), qwen3_8b(np.float64), 1.0,
                             conc, budget, arrival, prompt, output, batching)
    assert got.status == 0
    assert got.steps == ref.steps
    assert got.preemptions == ref.preemptions
    # float64 on both sides; the closed-form sums differ from step-by-step
    # accumulation only by rounding
    np.testing.assert_allclose(got.ttft_s, ref.ttft_s, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(got.e2e_s, ref.e2e_s, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(got.duration_s, ref.duration_s, rtol=1e-12)
    good = (ref.ttft_s <= ttft_slo) & (ref.max_gap_s <= itl_slo)
    np.testing.assert_array_equal(got.good, good)
    # the ITL histogram holds every gap exactly once
    np.testing.assert_allclose(got.itl_hist.sum(), len(ref.itl_s), rtol=1e-9)
    assert_itl_percentiles(got.itl_hist, ref.itl_s)


def assert_itl_percentiles(hist, gaps):
    """Within one bin of the interval NumPy interpolates in (module docstring)."""
    q = np.array([50.0, 90.0, 99.0])
    with jax.enable_x64(True):
        got = np.asarray(itl_percentiles(jnp.asarray(hist), len(gaps), q))
    want = np.percentile(gaps, q)
    srt = np.sort(gaps)
    pos = q / 100 * (len(gaps) - 1)
    lo, hi = srt[np.floor(pos).astype(int)], srt[np.ceil(pos).astype(int)]
    bin_width = 2.0**-ITL_MANTISSA_BITS * hi
    assert np.all(got >= lo - bin_width) and np.all(got <= hi + bin_width), (got, want)


def test_preemptions_happen_and_match(sim64):
    """The KV-tight continuous case really exercises recompute."""
    arrival, prompt, output = random_requests(3)
    got = sim64(arrival, prompt, output, 8, 512, CONTINUOUS, WEIGHTS + KV_BYTES * 3000)
    assert got.preemptions > 0


# (seed, batching, concurrency, budget, memory, overlong): prompts up to 1,500
# and outputs up to 300 tokens against a 1,000-token context
OVERLONG_CASES = [
    (30, CONTINUOUS, 8, 512, 80e9, REJECT),
    (31, CONTINUOUS, 8, 512, WEIGHTS + KV_BYTES * 2500, REJECT),
    (32, STATIC, 4, 1024, 80e9, REJECT),
    (33, CONTINUOUS, 8, 512, WEIGHTS + KV_BYTES * 2500, TRUNCATE),
    (34, REQUEST, 8, 256, 80e9, TRUNCATE),
]


@pytest.mark.parametrize("seed,batching,conc,budget,memory,overlong", OVERLONG_CASES)
def test_overlong_requests_match_reference(sim64, seed, batching, conc, budget, memory,
                                           overlong):
    """Requests beyond the context are rejected (or cut) as in the reference."""
    arrival, prompt, output = random_requests(seed)
    context = 1000
    got = sim64(arrival, prompt, output, conc, budget, batching, memory, 0.3, 0.02,
                context, overlong)
    ref = simulate_reference(h100(np.float64, memory), qwen3_8b(np.float64), 1.0,
                             conc, budget, arrival, prompt, output, batching,
                             max_context_tokens=context,
                             truncate=overlong == TRUNCATE)
    beyond = prompt + output > context
    assert 0 < beyond.sum() < R
    np.testing.assert_array_equal(got.rejected, ref.rejected)
    np.testing.assert_array_equal(got.rejected, beyond & (overlong == REJECT))
    np.testing.assert_array_equal(got.served, ~ref.rejected)
    assert got.status == 0 and got.steps == ref.steps
    assert got.preemptions == ref.preemptions
    np.testing.assert_allclose(got.ttft_s, ref.ttft_s, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(got.e2e_s, ref.e2e_s, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(got.duration_s, ref.duration_s, rtol=1e-12)
    # the histogram holds exactly the served requests' gaps
    np.testing.assert_allclose(got.itl_hist.sum(), len(ref.itl_s), rtol=1e-9)
    with jax.enable_x64(True):
        res = jax.tree.map(np.asarray, summarize(jax.tree.map(jnp.asarray, got)))
    served = ~ref.rejected
    np.testing.assert_allclose(res.rejected_fraction, ref.rejected.mean(), rtol=1e-12)
    # percentiles over the served requests only
    np.testing.assert_allclose(
        [res.ttft_p50_s, res.ttft_p99_s, res.e2e_p99_s],
        [*np.percentile(ref.ttft_s[served], [50, 99]),
         np.percentile(ref.e2e_s[served], 99)], rtol=1e-9)
    # the histogram's own accuracy is tested above; here: the served gaps
    np.testing.assert_allclose(res.itl_p99_s, np.percentile(ref.itl_s, 99), rtol=0.01)
    kept_output = np.where(
        overlong == TRUNCATE, np.minimum(output, context - np.maximum(
            context - output, 1)), output)
    np.testing.assert_allclose(res.output_tokens_per_s,
                               kept_output[served].sum() / ref.duration_s, rtol=1e-9)


def test_requests_not_mine_are_as_if_absent(sim64):
    """A replica's share of a stream (``mine``) runs as that sub-stream alone."""
    arrival, prompt, output = random_requests(40, rate=60.0)
    mine = np.arange(R) % 3 == 1
    got = sim64(arrival, prompt, output, 4, 512, mine=mine)
    ref = simulate_reference(h100(np.float64), qwen3_8b(np.float64), 1.0, 4, 512,
                             arrival[mine], prompt[mine], output[mine])
    np.testing.assert_allclose(got.ttft_s[mine], ref.ttft_s, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(got.e2e_s[mine], ref.e2e_s, rtol=1e-9, atol=1e-12)
    assert np.isnan(got.ttft_s[~mine]).all()
    assert not got.served[~mine].any() and not got.rejected.any()
    assert got.steps == ref.steps
    np.testing.assert_allclose(got.duration_s, ref.duration_s, rtol=1e-12)
    np.testing.assert_allclose(got.itl_hist.sum(), len(ref.itl_s), rtol=1e-9)


def test_one_request_alone(sim64):
    """TTFT = the prefill step; every ITL = the decode step at its context."""
    hw, m = h100(np.float64), qwen3_8b(np.float64)
    arrival = np.concatenate([[0.5], 1e6 + np.arange(R - 1)])  # the rest much later
    prompt = np.full(R, 1000.0)
    output = np.full(R, 4.0)
    got = sim64(arrival, prompt, output, 8, 2048)
    prefill = step_time_s(hw, m, 1.0, 1000, 0, 1000 * 1001 / 2)
    np.testing.assert_allclose(got.ttft_s[0], prefill, rtol=1e-12)
    decodes = [step_time_s(hw, m, 1.0, 1, c, c) for c in (1001, 1002, 1003)]
    np.testing.assert_allclose(got.e2e_s[0], prefill + sum(decodes), rtol=1e-12)
    # by hand: the prefill is compute-bound, a decode memory-bound
    flops = 2 * 8.19e9 * 1000 + 4 * 36 * 32 * 128 * 500500
    np.testing.assert_allclose(prefill, flops / 9.89e14, rtol=1e-12)
    np.testing.assert_allclose(decodes[0], (WEIGHTS + 1001 * KV_BYTES) / 3.35e12,
                               rtol=1e-12)


def test_higher_rate_never_lowers_p99_ttft(sim64):
    _, prompt, output = random_requests(11)
    gaps = np.random.default_rng(11).exponential(1.0, R)
    p99 = [np.percentile(sim64(np.cumsum(gaps) / rate, prompt, output, 4, 512).ttft_s,
                         99) for rate in (2.0, 8.0, 32.0)]
    assert p99[0] <= p99[1] <= p99[2]


def test_smaller_budget_never_raises_worst_itl(sim64):
    """A long prompt arriving beside decodes: smaller chunks, smaller stalls."""
    arrival = np.concatenate([np.zeros(4), [0.2], 1e6 + np.arange(R - 5)])
    prompt = np.concatenate([np.full(4, 100.0), [8000.0], np.full(R - 5, 10.0)])
    output = np.concatenate([np.full(4, 300.0), [2.0], np.full(R - 5, 2.0)])
    worst = []
    for budget in (256, 1024, 4096):
        ref = simulate_reference(h100(np.float64), qwen3_8b(np.float64), 1.0, 8, budget,
                                 arrival, prompt, output)
        got = sim64(arrival, prompt, output, 8, budget)
        np.testing.assert_allclose(got.e2e_s, ref.e2e_s, rtol=1e-9)
        worst.append(ref.max_gap_s[:4].max())
    assert worst[0] <= worst[1] <= worst[2]


def test_vmap_equals_loop_and_float32_close_to_float64(sim64):
    """A float32 vmapped grid equals a loop of float64 single runs (to float32)."""
    arrival, prompt, output = random_requests(21)
    req = Requests(*(jnp.asarray(x, jnp.float32) for x in (arrival, prompt, output)))
    conc = np.array([2.0, 4.0, 8.0, 16.0], np.float32)  # 16 > slots: flagged
    budget = np.array([128.0, 512.0, 2048.0, 512.0], np.float32)
    batching = np.array([CONTINUOUS, STATIC, CONTINUOUS, CONTINUOUS], np.int32)
    f = jax.jit(jax.vmap(partial(simulate, max_slots=SLOTS),
                         in_axes=(None, None, None, 0, 0, None, 0)))
    grid = jax.tree.map(np.asarray, f(h100(np.float32), qwen3_8b(np.float32), 1.0,
                                      conc, budget, req, batching))
    for leaf in grid:
        assert leaf.shape == (4,)
    assert grid.status[3] & STATUS_SLOTS and np.isnan(grid.ttft_p99_s[3])
    for i in range(3):
        exact = sim64(arrival, prompt, output, conc[i], budget[i], batching[i])
        assert grid.steps[i] == exact.steps and grid.status[i] == 0
        # float32 clock: ~1e-7 relative at the run's end
        np.testing.assert_allclose(
            [grid.ttft_p50_s[i], grid.ttft_p90_s[i], grid.ttft_p99_s[i]],
            np.percentile(exact.ttft_s, [50, 90, 99]), rtol=1e-4)
        np.testing.assert_allclose([grid.e2e_p50_s[i], grid.e2e_p99_s[i]],
                                   np.percentile(exact.e2e_s, [50, 99]), rtol=1e-4)
        np.testing.assert_allclose(grid.output_tokens_per_s[i],
                                   output.sum() / exact.duration_s, rtol=1e-5)
        assert grid.ttft_p50_s[i] <= grid.ttft_p90_s[i] <= grid.ttft_p99_s[i]
        assert grid.itl_p50_s[i] <= grid.itl_p90_s[i] <= grid.itl_p99_s[i]
        assert grid.e2e_p50_s[i] <= grid.e2e_p99_s[i]


def test_sample_requests_vmaps_over_keys_and_rates():
    tables = WorkloadTables("t", np.array([100.0, 1500.0]), np.array([0.25, 0.75]),
                            np.array([10.0, 300.0]), np.array([0.5, 0.5]))
    keys = jax.random.split(jax.random.key(0), 3)
    rates = jnp.array([1.0, 4.0, 16.0])
    req = jax.jit(jax.vmap(lambda k, r: sample_requests(k, tables, 4000, r)))(keys,
                                                                               rates)
    assert req.arrival_s.shape == (3, 4000) and req.arrival_s.dtype == jnp.float32
    assert np.all(np.diff(np.asarray(req.arrival_s), axis=1) >= 0)
    # mean gap 1/rate (4,000 samples: 5 standard errors ~ 8 %)
    np.testing.assert_allclose(np.asarray(req.arrival_s[:, -1]) / 4000,
                               1.0 / np.asarray(rates), rtol=0.08)
    np.testing.assert_allclose(np.mean(np.asarray(req.prompt_tokens) == 1500.0), 0.75,
                               atol=0.02)
    assert set(np.unique(np.asarray(req.output_tokens))) == {10.0, 300.0}
    trace = np.array([0.0, 1.0, 1.5, 4.0])  # mean rate 3 / 4 req/s, gap 4/3 s
    t = np.asarray(sample_requests(jax.random.key(1), tables, 6, 2.0, trace).arrival_s)
    # offsets (repeated one mean gap after the end) plus one mean gap, scaled
    # by (3/4) / 2
    offsets = np.array([0.0, 1.0, 1.5, 4.0, 4.0 + 4.0 / 3.0, 5.0 + 4.0 / 3.0])
    np.testing.assert_allclose(t, (offsets + 4.0 / 3.0) * 0.375, rtol=1e-6)
