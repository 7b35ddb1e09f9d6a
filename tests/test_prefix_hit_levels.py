"""A distribution of prefix hits (``workload.prefix_hit_levels`` with
``prefix_hit_probs``): each request finds its own share of its prompt in the
cache. Against hand calculations: the bands of the prefill work, the
surrogate at zero load, the simulator against the step-by-step reference on
a hard stream, the console script in float32 (simulator and surrogate), the
optimizer's verification streams, and the refusals of bad input.

The seed scenario's 1,500-token prompts at shares 0 (30 %) and 0.9 (70 %):
a request finds nothing, or 1,344 tokens (84 blocks of 16), mean share 0.63
(944 tokens of the mean prompt for the roofline: its mean-value model).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import (
    assert_matches_reference,
    compose_app,
    h100,
    jit_once,
    qwen3_8b,
    run_script,
    step,
)
from reference_scheduler import simulate_reference

import sweep
from sweep.config.schema import ConfigError
from sweep.exported import jit
from sweep.latency.arrivals import Requests, request_hits
from sweep.latency.simulate import simulate_requests
from sweep.latency.surrogate import latency_workload
from sweep.latency.surrogate.bands import band_stats, membership
from sweep.latency.surrogate.lengths import cached_workload, hit_bands
from sweep.latency.workload import WorkloadTables
from sweep.model.batching import CONTINUOUS

LEVELS, PROBS, PROMPT = (0.0, 0.9), (0.3, 0.7), 1500
DISTRIBUTION = [f"workload.prefix_hit_levels=[{LEVELS[0]},{LEVELS[1]}]",
                f"workload.prefix_hit_probs=[{PROBS[0]},{PROBS[1]}]"]


def prefill_by_hand(prompt, cached):
    """The new tokens after the cached prefix in one step (budget 2,048)."""
    m = prompt - cached
    return step(m, cached, m * cached + m * (m + 1) / 2)


def tables(prompts=(float(PROMPT),), probs=(1.0,)) -> WorkloadTables:
    return WorkloadTables(
        "levels", np.array(prompts), np.array(probs), np.array([200.0]),
        np.array([1.0]), prefix_hit_fraction=0.63, hit_levels=np.array(LEVELS),
        hit_probs=np.array(PROBS))


@pytest.mark.parametrize("overrides, message", [
    (["workload.prefix_hit_levels=[0,0.9]"],
     "workload[seed_chat].prefix_hit_levels = [0.0, 0.9]: must list 1 to 16 shares, "
     "as many as prefix_hit_probs"),
    (["workload.prefix_hit_levels=[0,1.0]", "workload.prefix_hit_probs=[0.5,0.5]"],
     "workload[seed_chat].prefix_hit_levels = [0.0, 1.0]: every share must be in "
     "[0, 1)"),
    (["workload.prefix_hit_levels=[0,0.5]", "workload.prefix_hit_probs=[0.5,0.6]"],
     "workload[seed_chat].prefix_hit_probs = [0.5, 0.6]: must be > 0 and sum to 1"),
    (["workload.prefix_hit_levels=[0,0.5]", "workload.prefix_hit_probs=[1,0]"],
     "workload[seed_chat].prefix_hit_probs = [1.0, 0.0]: must be > 0 and sum to 1"),
    (["workload.prefix_hit_fraction=0.5", *DISTRIBUTION],
     "workload[seed_chat].prefix_hit_fraction = 0.5: prefix_hit_levels gives the "
     "shares: leave prefix_hit_fraction at 0"),
])
def test_bad_levels_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as e:
        compose_app("grid", ["experiment=seed", *overrides])
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_mean_share():
    app = compose_app("grid", ["experiment=seed", *DISTRIBUTION])
    assert app.workload.mean_prefix_hit == pytest.approx(0.63, abs=1e-12)
    assert app.workload.prefix_hit_fraction == 0


def test_request_hits_follow_the_distribution():
    """20,000 draws: only the levels, 0.9 at 70 % (within 3 standard
    deviations, 0.0097), the same for the same key; one share for all
    without a distribution."""
    t = tables()
    hits = request_hits(jax.random.key(3), t, 20_000)
    assert set(np.unique(hits).tolist()) == {0.0, np.float32(0.9)}
    assert abs((hits > 0).mean() - 0.7) < 0.0097
    np.testing.assert_array_equal(hits, request_hits(jax.random.key(3), t, 20_000))
    assert (hits != request_hits(jax.random.key(4), t, 20_000)).any()
    one = request_hits(jax.random.key(3), WorkloadTables(
        "one", np.array([1500.0]), np.array([1.0]), np.array([200.0]),
        np.array([1.0]), prefix_hit_fraction=0.6), 5)
    np.testing.assert_array_equal(one, np.full(5, 0.6, np.float32))


def test_work_bands_by_hand():
    """Prompts of 1,000 and 3,000 tokens (half each) at shares 0 and 0.8
    (half each): works of 200 (800 cached), 600 (2,400 cached), 1,000 and
    3,000 tokens, a quarter each, in the probability bands; the band from
    0.45 to 0.55 holds 600 and 1,000 half and half. Lognormal prompts at
    one share: the spread of the work is the prompts' within each band."""
    work, spread, cached, joint, mean, mean_sq = hit_bands(
        np.array([1000.0, 3000.0]), np.array([0.5, 0.5]), np.ones((2, 1)),
        np.array([0.0, 0.8]), np.array([0.5, 0.5]))
    np.testing.assert_allclose(work, [200] * 3 + [600] * 2 + [800] + [1000] * 2
                               + [3000] * 9)
    np.testing.assert_allclose(cached, [800] * 3 + [2400] * 2 + [1200] + [0] * 11)
    # within each share's works, every band holds one value: no spread (the
    # band from 0.45 to 0.55 straddles two of them at its mean)
    np.testing.assert_allclose(spread, 0, atol=1e-9)
    assert mean == pytest.approx(1200) and mean_sq == pytest.approx(2.6e6)
    edges = [0.0, 0.05, 0.15, 0.25, 0.35, 0.45, 0.55, 0.65, 0.75, 0.85, 0.9, 0.95,
             0.97, 0.98, 0.99, 0.995, 0.998, 1.0]
    np.testing.assert_allclose(joint[:, 0], np.diff(edges), atol=1e-15)
    prompts = np.exp(np.linspace(5, 10, 400))
    probs = np.full(400, 1 / 400)
    work, spread, *_ = hit_bands(prompts, probs, np.ones((400, 1)), np.array([0.0]),
                                 np.array([1.0]))
    _, want = band_stats(prompts, membership(probs, np.array(edges)))
    np.testing.assert_allclose(spread, want, rtol=1e-9)


def test_surrogate_at_zero_load_by_hand():
    """No traffic: the median TTFT is the prefill after 1,344 cached tokens
    (70 % of the requests), the p99 the whole prompt's (the top 30 %; a
    0.3 %-wide kernel at its 97 % point: within 1 %); caching off, both the
    whole prompt's. The decodes keep the whole prompt as context."""
    import jax.numpy as jnp

    from sweep.config.convert import hardware_params, model_params
    from sweep.latency.surrogate import surrogate

    app = compose_app("grid", ["experiment=seed"])
    hw, model = hardware_params(app.hardware, 1.0), model_params(app.model)
    wl = latency_workload(tables())
    out = jit_once(jax.vmap(lambda h: surrogate(
        hw, model, wl, 1.0, 64.0, 2048.0, 1e-6, prefix_hit_fraction=h)))(
        jnp.array([0.0, 0.63], jnp.float32))
    p50, p99 = (np.asarray(out[f"ttft_{q}_s"]) for q in ("p50", "p99"))
    whole, hit = prefill_by_hand(PROMPT, 0), prefill_by_hand(PROMPT, 1344)
    np.testing.assert_allclose([p50[0], p50[1]], [whole, hit], rtol=2e-3)
    np.testing.assert_allclose(p99[1], whole, rtol=1e-2)
    assert p99[1] >= whole
    np.testing.assert_allclose(*np.asarray(out["itl_p50_s"]), rtol=1e-6)
    # the mean work the slot and prefill loads see: 0.3 x 1,500 + 0.7 x 156
    w_on, cached = cached_workload(wl, jnp.float32(0.63))
    np.testing.assert_allclose(float(w_on.mean_prompt_tokens), 559.2, rtol=1e-6)
    assert float(cached.max()) == 1344.0


ARRIVAL = np.concatenate([np.zeros(8), np.full(8, 0.5), 0.6 + np.arange(8) * 0.05])
PROMPTS = np.array([20000, 30, 700, 1500, 200, 20000, 64, 3000] * 3, float)
OUTPUTS = np.array([1, 300, 40, 120, 5, 200, 250, 17] * 3, float)
SHARES = np.array([0.0, 0.9, 0.5, 0.9, 0.0, 0.95, 0.9, 0.3] * 3)


@pytest.mark.parametrize("memory", [80e9, 16.38e9 + 147456 * 20500])
def test_simulator_matches_reference_with_each_requests_share(memory):
    """Each request's own share through the simulator, against the reference
    given each request's cached prefix by hand (whole blocks), on bursts with
    20,000-token prompts; with KV for 20,500 tokens, preemptions, after
    which a request finds its prefix again."""
    run = jit(lambda hw, model, hits: simulate_requests(
        hw, model, 1.0, 8.0, 1024.0, Requests(ARRIVAL, PROMPTS, OUTPUTS), CONTINUOUS,
        np.inf, np.inf, 0, None, 0, 0.0, hits, max_slots=8))
    cached = [int(h * p // 16) * 16 for h, p in zip(SHARES, PROMPTS)]
    with jax.enable_x64(True):
        hw, model = h100(memory_bytes=memory), qwen3_8b(np.float64)
        got = jax.tree.map(np.asarray, run(hw, model, SHARES))
    ref = simulate_reference(hw, model, 1.0, 8, 1024, ARRIVAL, PROMPTS, OUTPUTS,
                             CONTINUOUS, cached_tokens=cached)
    assert_matches_reference(got, ref, np.inf, np.inf, 1024)
    assert (ref.preemptions > 0) == (memory < 80e9)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["simulate", "surrogate"])
def test_p99_with_a_distribution_of_hits(tmp_path, method):
    """``sweep-grid`` over ``grid.prefix_caching`` in float32 as users run it,
    at 2 req/s: caching cuts the median TTFT below the whole prompt's
    prefill, never below the prefill after 1,344 cached tokens, while the p99
    stays at least the whole
    prompt's prefill (30 % of the requests find nothing); the roofline reads
    the mean share, 944 of the 1,500 tokens."""
    out = tmp_path / "p99.zarr"
    proc = run_script("sweep-grid", [
        "experiment=seed", "grid.prefix_caching=[false,true]", *DISTRIBUTION,
        "grid.concurrency=[64]", "grid.token_budget=[2048]",
        "grid.batching=[continuous]", "grid.traffic_tokens_per_day=[1e8]",
        f"latency={method}", "latency.num_requests=200",
        "grid.arrival_rate_per_s=[2]", f"out={out}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    ds = sweep.open_cube(out).load().squeeze()
    on, off = ds.sel(prefix_caching=1), ds.sel(prefix_caching=0)
    assert (int(on.latency_status), int(off.latency_status)) == (0, 0)
    whole, hit = prefill_by_hand(PROMPT, 0), prefill_by_hand(PROMPT, 1344)
    assert hit * (1 - 2e-3) <= float(on.ttft_p50_s) < whole
    assert float(on.ttft_p99_s) >= whole * (1 - 2e-3)
    assert float(off.ttft_p50_s) >= whole * (1 - 2e-3)
    assert float(on.prefix_hit_fraction) == pytest.approx(944 / 1500, rel=1e-6)


def test_optimizer_verifies_each_requests_share():
    """``sweep-optimize``'s verification stream carries each request's share
    (the distribution's, drawn with the stream's key); its surrogate reads
    the mean share; without caching every share is 0."""
    from helpers import optimize_inputs

    from sweep.search import optimize

    args = ["hardware=h100_sxm", "model=qwen3_8b", "workload=seed_chat",
            "calibration=roofline", "search=quick", "search.tensor_parallel=[1]",
            "search.verify_requests_max=4000"]
    job = optimize.prepare(*optimize_inputs([*args, *DISTRIBUTION]))
    assert optimize.caching(job)
    hits = optimize.verification_hits(job, jax.random.key(1))
    assert hits.shape == (4000,) and set(np.unique(hits).tolist()) == {
        0.0, np.float32(0.9)}
    assert abs((hits > 0).mean() - 0.7) < 0.022  # 3 standard deviations
    hw, model, tp = optimize._stacked(job, job.candidates[:1])
    assert optimize._prefix_hits(job, job.candidates[:1], hw, model, tp)[0] == (
        pytest.approx(0.63))
    plain = optimize.prepare(*optimize_inputs(args))
    assert not optimize.caching(plain)
    assert not optimize.verification_hits(plain, jax.random.key(1)).any()
