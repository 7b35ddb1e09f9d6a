"""The vectorized simulator against the step-by-step reference, and its laws.

One jitted function of fully traced arguments (fixed shapes) serves every
small case, so the module compiles it once in float64 (exact comparison with
the float64 reference) and once vmapped in float32. The streams users run
(1,000 requests of every shipped workload, 100k-token prompts, up to 256
running) go through one more vmapped call per precision (``big``).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_itl_percentiles,
    assert_matches_reference,
    conversation_stream,
    grid_inputs,
    h100,
    qwen3_8b,
)
from reference_scheduler import simulate_reference, step_time_s

from sweep.config.convert import hardware_params, model_params
from sweep.config.schema import ArrivalKind
from sweep.exported import jit
from sweep.latency import prefix_cache
from sweep.latency import simulate as sim
from sweep.latency.arrivals import Requests, sample_requests
from sweep.latency.simulate import (
    STATUS_SLOTS,
    itl_percentiles,
    simulate,
    simulate_requests,
    summarize,
)
from sweep.latency.workload import (
    WorkloadTables,
    context_limit,
    load_trace,
    workload_tables,
)
from sweep.model import roofline
from sweep.model.batching import CONTINUOUS, REQUEST, STATIC
from sweep.model.params import REJECT, TRUNCATE

R = 40  # requests per case (one jit shape)
SLOTS = 8
KV_BYTES = 2 * 36 * 8 * 128 * 2  # Qwen3-8B: 147,456 B per token
WEIGHTS = 8.19e9 * 2


def random_requests(seed, rate=20.0):
    rng = np.random.default_rng(seed)
    return (np.cumsum(rng.exponential(1.0 / rate, R)),
            rng.choice([30.0, 200.0, 700.0, 1500.0], R),
            rng.choice([1.0, 5.0, 40.0, 120.0, 300.0], R))


@pytest.fixture(scope="module")
def sim64():
    """The float64 simulator's per-request outcome (one compilation); every
    run's percentiles are checked against the physical floor."""
    @jit
    def run(hw, model, conc, budget, arrival, prompt, output, batching, ttft_slo,
            itl_slo, overlong, mine, spec_tokens, spec_acceptance, hit, cached):
        return simulate_requests(hw, model, 1.0, conc, budget,
                                 Requests(arrival, prompt, output), batching,
                                 ttft_slo, itl_slo, overlong, mine, spec_tokens,
                                 spec_acceptance, hit, cached, max_slots=SLOTS)

    def call(arrival, prompt, output, conc=8, budget=512, batching=CONTINUOUS,
             memory_bytes=80e9, ttft_slo=np.inf, itl_slo=np.inf,
             max_context_tokens=np.inf, overlong=REJECT, mine=None, spec_tokens=0,
             spec_acceptance=0.0, prefix_hit_fraction=0.0, cached_tokens=None):
        mine = np.ones(len(arrival), bool) if mine is None else mine
        cached = np.zeros(len(arrival)) if cached_tokens is None else cached_tokens
        with jax.enable_x64(True):
            out = run(h100(np.float64, memory_bytes),
                      qwen3_8b(np.float64, max_context_tokens),
                      np.float64(conc), np.float64(budget), arrival, prompt, output,
                      np.int32(batching), np.float64(ttft_slo), np.float64(itl_slo),
                      np.int32(overlong), mine, np.float64(spec_tokens),
                      np.float64(spec_acceptance), np.float64(prefix_hit_fraction),
                      np.asarray(cached, np.float64))
            out = jax.tree.map(np.asarray, out)
        assert_above_floor(out, h100(np.float64, memory_bytes),
                           qwen3_8b(np.float64, max_context_tokens), 1.0, prompt,
                           output, overlong)
        return out
    return call


def assert_above_floor(outcome, hw, model, tp, prompt, output, overlong=REJECT):
    """TTFT and ITL percentiles of a ``SimOutcome``'s served requests at or
    above ``floors_s`` of the prompts as served."""
    q = np.array([0.0, 50.0, 90.0, 99.0])
    served = outcome.served
    if not served.any():
        return
    prompt, _, _ = context_limit(np.maximum(np.round(prompt), 1.0),
                                 np.maximum(np.round(output), 1.0),
                                 float(model.max_context_tokens), overlong == TRUNCATE)
    ttft_floor, itl_floor = floors_s(hw, model, tp, prompt[served])
    assert np.all(np.percentile(outcome.ttft_s[served], q) >= ttft_floor)
    gaps = outcome.gaps[served].sum()
    if gaps:
        with jax.enable_x64(True):
            itl = np.asarray(itl_percentiles(
                jnp.asarray(outcome.itl_hist), gaps, q,
                jnp.asarray(outcome.itl_min_s), jnp.asarray(outcome.itl_max_s)))
        assert np.all(itl >= itl_floor), (itl, itl_floor)


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
    assert_matches_reference(got, ref, ttft_slo, itl_slo, budget)


SPEC_CASES = [
    # (seed, batching, concurrency, budget, memory, k, acceptance): gains of
    # 1.75 and 1.9375 tokens per step (exact in binary), and k > 0 with
    # nothing accepted; a KV-tight memory forces preemptions
    (10, CONTINUOUS, 8, 512, 80e9, 2, 0.5),
    (11, CONTINUOUS, 8, 100, 80e9, 4, 0.5),
    (12, CONTINUOUS, 8, 512, WEIGHTS + KV_BYTES * 3000, 2, 0.5),
    (13, CONTINUOUS, 3, 2048, 80e9, 3, 0.0),
    (14, STATIC, 4, 1024, WEIGHTS + KV_BYTES * 5000, 4, 0.5),
]


@pytest.mark.parametrize("seed,batching,conc,budget,memory,k,a", SPEC_CASES)
def test_speculation_matches_reference(sim64, seed, batching, conc, budget, memory,
                                       k, a):
    arrival, prompt, output = random_requests(seed)
    ttft_slo, itl_slo = 0.3, 0.02
    got = sim64(arrival, prompt, output, conc, budget, batching, memory, ttft_slo,
                itl_slo, spec_tokens=k, spec_acceptance=a)
    ref = simulate_reference(h100(np.float64, memory), qwen3_8b(np.float64), 1.0,
                             conc, budget, arrival, prompt, output, batching,
                             spec_tokens=k, spec_acceptance=a)
    # a verification step computes k + 1 tokens of each sequence
    assert_matches_reference(got, ref, ttft_slo, itl_slo, budget * (k + 1))
    if seed == 12:
        assert ref.preemptions > 0
    # one ITL sample per delivery gap: 1 + ceil((L - 1) / gain) deliveries
    gain = sum(a**j for j in range(k + 1))
    np.testing.assert_array_equal(got.gaps, np.ceil((output - 1) / gain))


def hard_requests(seed):
    """Bursts of 8 requests arriving together; a tenth of the prompts 100k
    tokens long."""
    rng = np.random.default_rng(seed)
    arrival = np.repeat(np.cumsum(rng.exponential(0.5, R // 8)), 8)
    prompt = rng.choice([17.0, 300.0, 4000.0, 100_000.0], R, p=[0.3, 0.3, 0.3, 0.1])
    return arrival, prompt, rng.choice([1.0, 20.0, 200.0], R)


PREFIX_CASES = [
    # (seed, batching, concurrency, budget, memory, hit fraction): a memory
    # for 101k KV tokens forces preemptions (readmissions find their prefix)
    (20, CONTINUOUS, 8, 2048, 80e9, 0.5),
    (26, CONTINUOUS, 8, 512, WEIGHTS + KV_BYTES * 101_000, 0.7),
    (22, STATIC, 4, 1024, 80e9, 0.5),
]


@pytest.mark.parametrize("seed,batching,conc,budget,memory,hit", PREFIX_CASES)
def test_prefix_caching_matches_reference(sim64, seed, batching, conc, budget, memory,
                                          hit):
    arrival, prompt, output = hard_requests(seed)
    ttft_slo, itl_slo = 2.0, 0.05
    got = sim64(arrival, prompt, output, conc, budget, batching, memory, ttft_slo,
                itl_slo, prefix_hit_fraction=hit)
    ref = simulate_reference(h100(np.float64, memory), qwen3_8b(np.float64), 1.0,
                             conc, budget, arrival, prompt, output, batching,
                             prefix_hit_fraction=hit)
    assert_matches_reference(got, ref, ttft_slo, itl_slo, budget)
    if seed == 26:
        assert ref.preemptions > 0
    # the cache removes prefill work: the p99 TTFT drops
    off = simulate_reference(h100(np.float64, memory), qwen3_8b(np.float64), 1.0,
                             conc, budget, arrival, prompt, output, batching)
    assert np.percentile(ref.ttft_s, 99) < np.percentile(off.ttft_s, 99)


LRU_CASES = [
    # (seed, concurrency, budget, KV tokens, context limit, overlong): caches
    # of 500-900 tokens evict blocks a larger one would find (not seed 42);
    # a 150-token context rejects or truncates
    (40, 8, 512, 500, np.inf, REJECT),
    (41, 4, 128, 900, np.inf, REJECT),
    (42, 8, 256, 700, 150.0, REJECT),
    (43, 8, 256, 700, 150.0, TRUNCATE),
]


@pytest.mark.parametrize("seed,conc,budget,kv_tokens,context,overlong", LRU_CASES)
def test_lru_prefix_cache_matches_reference(sim64, seed, conc, budget, kv_tokens,
                                            context, overlong):
    """A trace's block hashes through an LRU cache of the KV capacity: the
    one-pass table's hits fed to the simulator, against the reference, whose
    ``OrderedDict`` cache finds them at each admission."""
    rng = np.random.default_rng(seed)
    hashes, prompt, output = conversation_stream(rng, R)
    arrival = np.cumsum(rng.exponential(1.0 / 20.0, R))
    memory = WEIGHTS + KV_BYTES * kv_tokens
    p, o, served = context_limit(prompt, output, context, overlong == TRUNCATE)
    table = prefix_cache.lru_table(hashes, p, o, served, p == prompt, 16)
    with jax.enable_x64(True):
        capacity = float(roofline.kv_capacity_tokens(
            h100(np.float64, memory), qwen3_8b(np.float64), 1.0))
    assert capacity == kv_tokens
    cached = prefix_cache.cached_tokens(table, capacity, xp=np)
    ttft_slo, itl_slo = 1.0, 0.05
    got = sim64(arrival, prompt, output, conc, budget, CONTINUOUS, memory, ttft_slo,
                itl_slo, context, overlong, cached_tokens=cached)
    ref = simulate_reference(h100(np.float64, memory), qwen3_8b(np.float64, context),
                             1.0, conc, budget, arrival, prompt, output, CONTINUOUS,
                             context, overlong == TRUNCATE,
                             prefix_cache=(hashes, 16))
    assert_matches_reference(got, ref, ttft_slo, itl_slo, budget)
    unbounded = prefix_cache.cached_tokens(table, np.inf, xp=np)
    assert 0 < cached.sum() <= unbounded.sum()
    assert (cached.sum() < unbounded.sum()) == (seed != 42)


def test_prefix_caching_by_hand(sim64):
    """One request alone (prompt 1,000, hit fraction 0.5, budget 512): 31
    blocks of 16 = 496 tokens cached, the other 504 in one chunk that reads
    and attends to the 496; output 3: two decodes at contexts 1,001 and 1,002
    (the prompt and the tokens generated so far)."""
    kvb, fpk, w = KV_BYTES, 4 * 36 * 32 * 128, WEIGHTS

    def step(new, read, keys):
        return max((w + read * kvb) / 3.35e12,
                   (2 * 8.19e9 * new + fpk * keys) / 9.89e14)

    prefill = step(504, 496, 504 * 496 + 504 * 505 / 2)
    arrival = np.concatenate([[0.0], 1e6 + np.arange(R - 1)])  # the rest much later
    got = sim64(arrival, np.full(R, 1000.0), np.full(R, 3.0), prefix_hit_fraction=0.5)
    assert got.ttft_s[0] == pytest.approx(prefill, rel=1e-12)
    assert got.e2e_s[0] == pytest.approx(
        prefill + step(1, 1001, 1001) + step(1, 1002, 1002), rel=1e-12)


def test_speculation_by_hand(sim64):
    """One request alone (prompt 1,000, output 8, k = 2, a = 0.5, gain 1.75):
    the prefill step, then ceil(7 / 1.75) = 4 verification steps over
    contexts 1,001, 1,002.75, 1,004.5, 1,006.25, each memory-bound, float64 by
    hand."""
    kvb, bw = KV_BYTES, 3.35e12
    prefill = max(WEIGHTS / bw,
                  (2 * 8.19e9 * 1000 + 4 * 36 * 32 * 128 * 1000 * 1001 / 2) / 9.89e14)
    steps = [(WEIGHTS + c * kvb) / bw for c in (1001.0, 1002.75, 1004.5, 1006.25)]
    # compute of 3 tokens is far below the memory time at batch 1
    assert all((2 * 8.19e9 * 3 + 4 * 36 * 32 * 128 * (3 * c + 3)) / 9.89e14 < t
               for c, t in zip((1001.0, 1002.75, 1004.5, 1006.25), steps))
    got = sim64(np.array([0.0]), np.array([1000.0]), np.array([8.0]), 1, 2048,
                spec_tokens=2, spec_acceptance=0.5)
    assert float(got.ttft_s[0]) == pytest.approx(prefill, rel=1e-12)
    assert float(got.e2e_s[0]) == pytest.approx(prefill + sum(steps), rel=1e-12)
    assert int(got.steps) == 5 and float(got.gaps[0]) == 4.0


def floors_s(hw, model, tp, prompts):
    """(TTFT floor, ITL floor) of a stream, from the reference's own roofline.

    One step of one sequence (``roofline.decode_step_s`` at batch 1): a
    prompt's last step reads at least the weights; every gap is at least one
    step that decodes a context of at least the shortest prompt.
    """
    shortest = float(np.min(np.maximum(np.round(prompts), 1.0)))
    return (step_time_s(hw, model, tp, 1, 0.0, 0.0),
            step_time_s(hw, model, tp, 1, shortest, shortest))


# (memory_s, memory_slope_s, compute_s, compute_slope_s, fixed_s) of a run:
# memory overtakes compute within it (between steps, and at a step where the
# two are equal), compute overtakes memory (likewise), parallel lines with
# memory above and below, equal lines, a crossing beyond the run
RUN_LINES = [
    (1.0, 0.5, 3.1, 0.1, 0.2),
    (1.0, 0.5, 3.0, 0.1, 0.2),
    (3.1, 0.1, 1.0, 0.5, 0.2),
    (3.0, 0.1, 1.0, 0.5, 0.2),
    (2.0, 0.3, 1.0, 0.3, 0.0),
    (1.0, 0.3, 2.0, 0.3, 0.01),
    (1.0, 0.0, 1.0, 0.0, 0.1),
    (0.5, 0.01, 9.0, 0.0, 0.0),
]


@pytest.mark.parametrize("lines", RUN_LINES)
def test_a_run_in_closed_form_is_the_sum_of_its_steps(lines):
    """A run's duration (``roofline.run_s`` at ``split_at_crossing``, which
    the simulator's turns and ``chunked_prefill`` use) against its steps
    summed one by one in float64, and every step on the piece it is given."""
    m0, m, c0, c, fixed = lines
    with jax.enable_x64(True):
        run = roofline.StepLines(*(jnp.float64(x) for x in lines))
        for n in (0, 1, 5, 40):
            step = [max(m0 + m * j, c0 + c * j) + fixed for j in range(n)]
            split = roofline.split_at_crossing(run, np.float64(n))
            got = float(roofline.run_s(run, split, np.float64(n)))
            assert got == pytest.approx(sum(step), rel=1e-12, abs=1e-15)
            j_cross, (a, s), (b, r) = jax.tree.map(float, split)
            assert 0 <= j_cross <= n and j_cross == int(j_cross)
            on_piece = [(a + s * j if j < j_cross else b + r * j) + fixed
                        for j in range(n)]
            np.testing.assert_allclose(on_piece, step, rtol=1e-12)


def test_step_lines_are_the_step_time_along_the_run():
    """``roofline.step_lines(...).at(x)`` is ``step_s`` with the KV read and
    the attention keys moved ``x`` steps along their lines."""
    hw, model = h100(np.float64), qwen3_8b(np.float64)
    # compute-bound at x = 0, memory-bound by x = 5000
    new, kv0, kv1, keys0, keys1 = 300.0, 5e4, 40.0, 8e6, 100.0
    with jax.enable_x64(True):
        for tp in (1.0, 2.0, 3.0):
            lines = roofline.step_lines(hw, model, tp, new, kv0, kv1, keys0, keys1)
            for x in (0.0, 1.0, 17.0, 5000.0):
                want = roofline.step_s(hw, model, tp, new, kv0 + kv1 * x,
                                       keys0 + keys1 * x)
                assert float(lines.at(x)) == pytest.approx(float(want), rel=1e-12)


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
    f = jit(jax.vmap(partial(simulate, max_slots=SLOTS),
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
        ttft_floor, itl_floor = floors_s(h100(np.float64), qwen3_8b(np.float64), 1.0,
                                         prompt)
        assert grid.ttft_p50_s[i] >= ttft_floor and grid.itl_p50_s[i] >= itl_floor
        assert grid.ttft_p50_s[i] <= grid.ttft_p90_s[i] <= grid.ttft_p99_s[i]
        assert grid.itl_p50_s[i] <= grid.itl_p90_s[i] <= grid.itl_p99_s[i]
        assert grid.e2e_p50_s[i] <= grid.e2e_p99_s[i]


def test_sample_requests_vmaps_over_keys_and_rates():
    tables = WorkloadTables("t", np.array([100.0, 1500.0]), np.array([0.25, 0.75]),
                            np.array([10.0, 300.0]), np.array([0.5, 0.5]))
    keys = jax.random.split(jax.random.key(0), 3)
    rates = jnp.array([1.0, 4.0, 16.0])
    req = jit(jax.vmap(lambda k, r: sample_requests(k, tables, 4000, r)))(keys,
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


# --- the streams users run: float32 against x64, the floor, the reference ----

BIG_R = 1000  # latency.num_requests' default
BIG_SLOTS = 256
SHIPPED = ("seed_chat", "rag_long_prompt", "offline_batch", "azure_conv_2023",
           "azure_code_2023")


def composed():
    """The grid app over the shipped workloads, H100 SXM and MI300X, Qwen3-8B."""
    return grid_inputs([f"grid.workload=[{','.join(SHIPPED)}]",
                        "grid.hardware=[h100_sxm,mi300x]", "model=qwen3_8b"])


def shipped_stream(w, rate_factor, seed):
    """``BIG_R`` requests of workload ``w`` as the CLI samples them (float64)."""
    trace = load_trace(w.trace).arrival_s if w.arrival == ArrivalKind.trace else None
    req = sample_requests(jax.random.key(seed), workload_tables(w), BIG_R,
                          w.arrival_rate_per_s * rate_factor, trace)
    return tuple(np.asarray(x, np.float64) for x in req)


def long_prompt_stream(seed):
    """Bursts (30 % of gaps 100x shorter), 5 % 100k-token prompts, the rest
    lognormal chat prompts, heavy-tailed outputs."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(2.0, BIG_R)
    gaps[rng.random(BIG_R) < 0.3] *= 0.01
    prompt = np.where(rng.random(BIG_R) < 0.05, 100_000.0,
                      np.minimum(rng.lognormal(np.log(1500), 1.0, BIG_R), 30_000))
    output = np.minimum(rng.lognormal(np.log(200), 1.0, BIG_R), 4000)
    return np.cumsum(gaps), np.round(prompt), np.round(output) + 1


def lognormal_stream(seed):
    """Lognormal prompts with cv 3, up to 128k tokens, Poisson at 0.3 req/s."""
    rng = np.random.default_rng(seed)
    sigma = np.sqrt(np.log1p(3.0**2))
    prompt = np.clip(rng.lognormal(np.log(4000), sigma, BIG_R), 1, 128_000)
    output = np.clip(rng.lognormal(np.log(150), 0.8, BIG_R), 1, 2000)
    return (np.cumsum(rng.exponential(1 / 0.3, BIG_R)), np.round(prompt),
            np.round(output))


# (stream, hardware, tp, concurrency, token budget); the MI300X rows are the
# configurations whose ITL percentiles once came out at the histogram's floor
BIG_ROWS = [
    ("seed_chat", "h100_sxm", 1, 64, 2048),
    ("seed_chat", "mi300x", 8, 2, 512),
    ("seed_chat", "mi300x", 8, 16, 16384),
    ("seed_chat", "mi300x", 8, 128, 512),
    ("rag_long_prompt", "h100_sxm", 1, 16, 512),
    ("rag_long_prompt", "h100_sxm", 1, 256, 8192),
    ("offline_batch", "h100_sxm", 1, 256, 2048),
    ("azure_conv_2023", "h100_sxm", 1, 64, 8192),
    ("azure_conv_2023", "h100_sxm", 1, 16, 512),
    ("azure_code_2023", "h100_sxm", 1, 128, 4096),
    ("long_prompts", "h100_sxm", 1, 16, 2048),
    ("long_prompts", "h100_sxm", 1, 256, 8192),
    ("lognormal_cv3", "h100_sxm", 1, 64, 512),
]
HEAVY_ROW = 10  # long_prompts at budget 2048: checked against the reference
LONG_CONTEXT_TOKENS = 131_072  # Qwen3-8B's context with YaRN (its model card)


@pytest.fixture(scope="module")
def big():
    return run_big_rows()


def run_big_rows():
    """Every ``BIG_ROWS`` configuration in one vmapped call per precision.

    Returns ``(streams, params, {"float32": ..., "float64": ...})``: per row
    the float64 stream, the float64 (hardware, model) and the ``SimOutcome``
    and ``SimResult`` of each precision (numpy).
    """
    app, options = composed()
    streams = {"long_prompts": long_prompt_stream(0),
               "lognormal_cv3": lognormal_stream(1)}
    for i, w in enumerate(options["workload"]):
        # above the recorded pace, so queues form
        streams[w.name] = shipped_stream(w, 1.0 if w.name == "seed_chat" else 2.0, i)
    # with YaRN rope scaling, as its model card serves 100k-token prompts
    model = model_params(options["model"][0])._replace(
        max_context_tokens=LONG_CONTEXT_TOKENS)
    params = {h.name: (hardware_params(h, app.grid.gpu_memory_utilization), model)
              for h in options["hardware"]}
    rows_streams = [streams[row[0]] for row in BIG_ROWS]
    rows_params = [params[row[1]] for row in BIG_ROWS]

    def one(hw, model, tp, conc, budget, arrival, prompt, output):
        req = Requests(arrival, prompt, output)
        out = simulate_requests(hw, model, tp, conc, budget, req, CONTINUOUS,
                                max_slots=BIG_SLOTS)
        return out, summarize(out)

    run = jit(jax.vmap(one))
    results = {}
    for dt, x64 in ((np.float32, False), (np.float64, True)):
        with jax.enable_x64(x64):
            cast = partial(jnp.asarray, dtype=dt)
            hw = jax.tree.map(lambda *x: cast(np.array(x, np.float64)),
                              *[p[0] for p in rows_params])
            model = jax.tree.map(lambda *x: cast(np.array(x, np.float64)),
                                 *[p[1] for p in rows_params])
            knobs = [cast(np.array([row[i] for row in BIG_ROWS], np.float64))
                     for i in (2, 3, 4)]
            req = [cast(np.stack([st[i] for st in rows_streams])) for i in range(3)]
            results[dt.__name__] = jax.tree.map(np.asarray,
                                                run(hw, model, *knobs, *req))
    return rows_streams, rows_params, results


def test_big_rows_cover_what_users_run(big):
    streams, _, results = big
    assert {row[0] for row in BIG_ROWS} >= set(SHIPPED)
    assert max(st[1].max() for st in streams) >= 100_000
    budgets = [row[4] for row in BIG_ROWS]
    concs = [row[3] for row in BIG_ROWS]
    assert min(budgets) <= 512 and max(budgets) >= 8192
    assert min(concs) <= 16 and max(concs) >= 256
    for res in results.values():
        assert np.all(res[1].status == 0)


def test_float32_equals_x64(big):
    """The float32 path users run gives the x64 p99s within 0.5 %."""
    _, _, results = big
    f32, x64 = results["float32"][1], results["float64"][1]
    for name in ("ttft_p99_s", "itl_p99_s", "e2e_p99_s", "itl_p50_s"):
        np.testing.assert_allclose(getattr(f32, name), getattr(x64, name), rtol=5e-3,
                                   err_msg=name)


def test_itl_histogram_holds_every_gap_in_float32(big):
    _, _, results = big
    for dt, rtol in (("float32", 1e-4), ("float64", 1e-9)):
        out = results[dt][0]
        gaps = np.where(out.served, out.output_tokens - 1, 0).sum(axis=1)
        hist = out.itl_hist
        np.testing.assert_allclose(hist.sum(axis=1), gaps, rtol=rtol, err_msg=dt)
        # rounding leaves no bin negative beyond a sliver of a gap
        assert hist.min() > -1e-2, dt


def test_percentiles_never_below_one_decode_step(big):
    streams, params, results = big
    for i, (row, st, (hw, model)) in enumerate(zip(BIG_ROWS, streams, params)):
        ttft_floor, itl_floor = floors_s(hw, model, row[2], st[1])
        for dt, (out, res) in results.items():
            itl = [getattr(res, f"itl_p{q}_s")[i] for q in (50, 90, 99)]
            ttft = [getattr(res, f"ttft_p{q}_s")[i] for q in (50, 90, 99)]
            assert min(itl) >= itl_floor and out.itl_min_s[i] >= itl_floor, (row, dt)
            assert min(ttft) >= ttft_floor, (row, dt)
            assert res.e2e_p50_s[i] >= ttft_floor, (row, dt)


def test_mi300x_tp8_itl_is_a_decode_step(big):
    """Qwen3-8B at TP 8 on MI300X: decode steps of ~0.39 ms grow by ~3.5 ns a
    token, so a run's samples crowd into a few bins (the case whose ITLs once
    read the histogram's 7.6 us floor)."""
    streams, _, results = big
    step = (2 * 8.19e9) / (8 * 5.3e12)  # the weights read once, by hand
    gaps = (np.maximum(np.round(streams[1][2]), 1) - 1).sum()
    for dt, (out, res) in results.items():
        for i in (1, 2, 3):
            assert step <= res.itl_p50_s[i] <= res.itl_p99_s[i] < 1.2 * step, dt
            np.testing.assert_allclose(out.itl_hist[i].sum(), gaps, rtol=1e-5)


def test_float32_itl_against_the_reference_on_long_prompts(big):
    """100k-token prompts in bursts: x64 equals the step-by-step reference
    (steps, every TTFT); float32's ITL percentiles lie within the histogram's
    bound of the reference's exact ones, and its p99 TTFT within 0.5 %."""
    streams, params, results = big
    _, _, tp, conc, budget = BIG_ROWS[HEAVY_ROW]
    hw, model = params[HEAVY_ROW]
    arrival, prompt, output = streams[HEAVY_ROW]
    ref = simulate_reference(hw, model, tp, conc, budget, arrival, prompt, output,
                             max_context_tokens=LONG_CONTEXT_TOKENS)
    assert not ref.rejected.any()
    exact, exact_res = jax.tree.map(lambda x: x[HEAVY_ROW], results["float64"])
    assert exact_res.steps == ref.steps and exact_res.preemptions == ref.preemptions
    np.testing.assert_allclose(exact.ttft_s, ref.ttft_s, rtol=1e-9, atol=1e-12)
    out, res = jax.tree.map(lambda x: x[HEAVY_ROW], results["float32"])
    assert_itl_percentiles(out, ref.itl_s, budget, hw, model, tp)
    np.testing.assert_allclose(res.ttft_p99_s, np.percentile(ref.ttft_s, 99),
                               rtol=5e-3)


def test_itl_histogram_places_ramps_exactly():
    """Uniform mass over ``[x0, x1]`` lands in each bin in proportion to its
    overlap (float64, computed here from the bin edges), across octaves."""
    ramps = np.array([  # x0, x1, mass spread, mass at each end
        [1e-4, 3e-1, 1000.0, 0.5],  # 11 octaves
        [4.0e-4, 4.1e-4, 50.0, 2.0],  # a few bins
        [2.0**-10, 2.0**-9, 7.0, 0.0],  # exactly one octave
        [5e-3, 5e-3, 0.0, 3.0],  # a point
        [1e-6, 2e-5, 10.0, 0.0],  # starts below the histogram
    ])
    with jax.enable_x64(True):
        h = sim._itl_add(sim._itl_empty(np.float64),
                         tuple(jnp.asarray(c) for c in ramps.T),
                         (jnp.zeros(1), jnp.zeros(1)))
        hist = np.asarray(sim._itl_hist(h))
        lo_hi = float(h.lo_s), float(h.hi_s)
        edges = np.array(sim._edge(jnp.arange(sim.ITL_BINS + 1), np.float64))
    edges[0] = 0.0  # the first bin takes everything below it
    want = np.zeros(sim.ITL_BINS)
    for x0, x1, mid, end in ramps:
        if x1 > x0:
            overlap = np.minimum(edges[1:], x1) - np.maximum(edges[:-1], x0)
            want += mid * np.clip(overlap, 0.0, None) / (x1 - x0)
        else:
            want[np.searchsorted(edges, x0, side="right") - 1] += mid
        for x in (x0, x1):
            want[np.searchsorted(edges, x, side="right") - 1] += end
    np.testing.assert_allclose(hist, want, rtol=1e-9, atol=1e-9)
    assert lo_hi == (1e-6, 3e-1)


def test_itl_histogram_float32_rounding_stays_small():
    """3,000 turns of random runs, narrow ones (a 0.4 ms step growing by
    nanoseconds) among wide ones, into the float32 and float64 histograms:
    cumulative counts agree to 1e-5 of all samples at every bin edge."""
    rng = np.random.default_rng(0)
    turns, per = 3000, 2
    x0 = np.exp(rng.uniform(np.log(2e-4), np.log(0.5), (turns, per)))
    rel = np.exp(rng.uniform(np.log(1e-8), np.log(3.0), (turns, per)))
    mid = rng.integers(0, 256, (turns, per)) * rng.integers(0, 2000, (turns, per))
    ramps = (x0, x0 * (1 + rel), mid.astype(float), rng.integers(0, 128, (turns, per))
             / 2.0)
    points = (rng.uniform(1e-3, 1.0, (turns, 3)), rng.integers(0, 64, (turns, 3)) * 1.0)

    def fill(dt):
        def turn(h, xs):
            return sim._itl_add(h, xs[:4], xs[4:]), None
        xs = tuple(jnp.asarray(v, dt) for v in (*ramps, *points))
        h, _ = jax.lax.scan(turn, sim._itl_empty(dt), xs)
        return sim._itl_hist(h)

    got = np.cumsum(np.asarray(jit(fill, static_argnums=0)(np.float32), np.float64))
    with jax.enable_x64(True):
        want = np.cumsum(np.asarray(jit(fill, static_argnums=0)(np.float64)))
    total = mid.sum() + 2 * ramps[3].sum() + points[1].sum()
    np.testing.assert_allclose(want[-1], total, rtol=1e-12)
    assert np.abs(got - want).max() <= 1e-5 * total


def test_clock_pair_keeps_float64_time_in_float32():
    """100,000 step durations added to a float32 clock pair: the float64 sum
    to ~1e-12 s (a plain float32 sum is off by milliseconds)."""
    steps = np.random.default_rng(0).uniform(1e-3, 5e-2, 100_000).astype(np.float32)

    @jit
    def clock(xs):
        def add(c, x):
            return sim._clock_add(*c, x), None
        (hi, lo), _ = jax.lax.scan(add, (jnp.float32(0), jnp.float32(0)), xs)
        return hi, lo

    hi, lo = clock(jnp.asarray(steps))
    exact = steps.astype(np.float64).sum()
    assert abs(float(hi) + float(lo) - exact) < 1e-9
    assert abs(float(np.cumsum(steps)[-1]) - exact) > 1e-4  # what the pair avoids
