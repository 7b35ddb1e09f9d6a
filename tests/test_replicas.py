"""Replicas behind a load balancer: one stream split over R schedulers.

``sweep-optimize`` verifies R replicas by routing one full-rate stream over R
simulated schedulers in one vmapped call and pooling every request's
latency; here that is compared with simulating each replica's sub-stream on
its own and pooling by hand.
"""

from __future__ import annotations

import csv
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import optimize_inputs

from sweep.config.convert import hardware_params, model_params
from sweep.config.schema import Routing
from sweep.exported import jit
from sweep.latency.arrivals import Requests, route, split
from sweep.latency.simulate import itl_percentiles, simulate_requests
from sweep.latency.workload import resolve_trace_path
from sweep.model.batching import CONTINUOUS
from sweep.search import optimize

OVERRIDES = ["hardware=h100_sxm", "model=qwen3_8b", "workload=azure_conv_2023",
             "workload.arrival=poisson", "workload.arrival_rate_per_s=12",
             "search.tensor_parallel=[1]", "search.verify_requests=60"]
"""The trace's lengths at Poisson arrivals: ``verify_requests`` per replica
(on its recorded arrivals the verification replays the whole trace, below)."""


def test_round_robin_sends_request_i_to_replica_i_mod_r():
    np.testing.assert_array_equal(route(7, 3, Routing.round_robin, None),
                                  [0, 1, 2, 0, 1, 2, 0])
    stream = Requests(np.arange(7.0), np.arange(7.0) + 100, np.ones(7))
    sub, mine = split(stream, route(7, 3, Routing.round_robin, None), 3, 4)
    np.testing.assert_array_equal(mine.sum(1), [3, 2, 2])
    for r in range(3):
        np.testing.assert_array_equal(sub.arrival_s[r][mine[r]], np.arange(r, 7, 3))
        np.testing.assert_array_equal(sub.prompt_tokens[r][mine[r]],
                                      np.arange(r, 7, 3) + 100)


def test_random_routing_is_reproducible_and_complete():
    key = jax.random.key(3)
    a = route(10_000, 8, Routing.random, key)
    np.testing.assert_array_equal(a, route(10_000, 8, Routing.random, key))
    counts = np.bincount(a, minlength=8)
    assert counts.sum() == 10_000 and counts.min() > 1_100  # 1,250 expected
    with pytest.raises(ValueError):
        split(Requests(*(np.zeros(10_000),) * 3), a, 8, counts.max() - 1)


@pytest.fixture(scope="module")
def job():
    return optimize.prepare(*optimize_inputs(OVERRIDES))


def test_split_replicas_pool_every_request(job):
    """3 replicas in one batch with a 1-replica configuration: each replica's
    share simulated alone, pooled by hand, gives the same p99s."""
    key = jax.random.key(5)
    configs = [optimize.Config(0, 16, 1024, 3, {}, 0.0, 0.0),
               optimize.Config(0, 16, 1024, 1, {}, 0.0, 0.0)]
    got = optimize.simulate_configs(job, configs, key, 2)
    assert [g["requests"] for g in got] == [180, 60]

    stream = optimize.verification_stream(job, key)
    cand = job.candidates[0]
    alone = jit(partial(simulate_requests, max_slots=64))
    hw = hardware_params(cand.hardware, job.app.search.gpu_memory_utilization)
    model = model_params(cand.model)
    slo = job.app.slo
    for cfg, sim in zip(configs, got):
        outs = [alone(hw, model, 1.0, 16.0, 1024.0,
                      jax.tree.map(lambda x, r=r, n=cfg.replicas: jnp.asarray(
                          x[r:60 * n:n]), stream),
                      CONTINUOUS, slo.ttft_p99_s, slo.itl_p99_s)
                for r in range(cfg.replicas)]
        ttft = np.concatenate([np.asarray(o.ttft_s) for o in outs])
        e2e = np.concatenate([np.asarray(o.e2e_s) for o in outs])
        assert ttft.shape == (cfg.replicas * 60,) and np.isfinite(ttft).all()
        # float32 on both sides, batched vs alone: rounding only
        np.testing.assert_allclose(
            [sim["ttft_p50_s"], sim["ttft_p99_s"], sim["e2e_p99_s"]],
            [*np.percentile(ttft, [50, 99]), np.percentile(e2e, 99)], rtol=1e-5)
        hist = sum(o.itl_hist for o in outs)
        gaps = sum(float((np.round(np.asarray(o.output_tokens)) - 1).sum())
                   for o in outs)
        itl = np.asarray(itl_percentiles(
            hist, gaps, jnp.array([50.0, 99.0]), min(o.itl_min_s for o in outs),
            max(o.itl_max_s for o in outs)))
        np.testing.assert_allclose([sim["itl_p50_s"], sim["itl_p99_s"]], itl,
                                   rtol=1e-5)
        duration = max(float(o.duration_s) for o in outs)
        good = sum(int(o.good.sum()) for o in outs)
        np.testing.assert_allclose(sim["goodput_req_per_s"], good / duration,
                                   rtol=1e-5)
        assert sim["rejected_fraction"] == 0.0 and sim["status"] == 0


@pytest.mark.parametrize("replay", ["sampled", "exact"])
def test_verification_replays_a_whole_trace(replay):
    """On a trace's recorded arrivals a configuration of R replicas is
    verified over at least the whole trace (its bursts set the p99), or
    ``verify_requests`` per replica where that is more, at most
    ``verify_requests_max``; the note on a partial replay names the setting
    that replays all of it. Poisson arrivals: ``verify_requests`` per
    replica."""
    with open(resolve_trace_path("azure_llm_2023_conv.csv"), newline="") as f:
        rows = sum(1 for _ in csv.DictReader(f))
    trace = ["hardware=h100_sxm", "model=qwen3_8b", "workload=azure_conv_2023",
             f"workload.replay={replay}", "search.tensor_parallel=[1]",
             "search.verify_requests=60"]
    job = optimize.prepare(*optimize_inputs(trace))
    assert optimize.trace_rows(job) == rows
    many = -(-rows // 60) + 1  # replicas whose 60 each exceed the trace
    assert [optimize.verification_requests(job, r) for r in (1, 3, many)] == [
        rows, rows, 60 * many]
    assert optimize.trace_coverage(job, optimize.verification_requests(job, 1)) is None
    capped = optimize.prepare(*optimize_inputs([*trace,
                                                "search.verify_requests_max=5000"]))
    assert optimize.verification_requests(capped, 1) == 5000
    note = optimize.trace_coverage(capped, 5000)
    assert f"first 5,000 of {rows:,} arrivals" in note
    assert note.endswith(f"search.verify_requests_max={rows} replays all of it")
    poisson = optimize.prepare(*optimize_inputs([*trace, "workload.arrival=poisson"]))
    assert optimize.trace_rows(poisson) == 0
    assert [optimize.verification_requests(poisson, r) for r in (1, 3)] == [60, 180]
