"""A prefix cache that emerges from a trace's block hashes (``hash_ids``):
the one-pass LRU table against a plain ``OrderedDict`` LRU, request by request."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import (
    KVB,
    chunk_keys,
    conversation_stream,
    grid_inputs,
    h100,
    optimize_inputs,
    qwen3_8b,
    run_script,
    squeeze_except,
    step,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_scheduler import LRUCache, kv_capacity_tokens, simulate_reference

import sweep
from sweep.latency import prefix_cache
from sweep.model import roofline

BLOCK = 16


def online(hashes, prompts, outputs, served, shared, capacity, block=BLOCK):
    """The reference's LRU, admitting the requests in order."""
    lru = LRUCache(hashes, block, capacity)
    hits = np.zeros(len(hashes))
    for i in range(len(hashes)):
        if served[i]:
            hits[i] = lru.admit(SimpleNamespace(
                index=i, truncated=not shared[i], prompt=int(prompts[i]),
                tokens=int(outputs[i])))
    return hits


def check_stream(hashes, prompts, outputs, served, shared, capacities):
    table = prefix_cache.lru_table(hashes, prompts, outputs, served, shared, BLOCK)
    curve = prefix_cache.hit_curve(table, prompts, served)
    for c in capacities:
        want = online(hashes, prompts, outputs, served, shared, c)
        got = prefix_cache.cached_tokens(table, c, xp=np)
        np.testing.assert_array_equal(got, want, err_msg=f"capacity {c}")
        share = roofline.lru_hit_fraction(c, *curve)
        assert np.isclose(share, want[served].sum() / prompts[served].sum(),
                          rtol=1e-6, atol=0), c
    return table


def test_lru_table_is_the_lru_cache_on_conversations():
    rng = np.random.default_rng(7)
    hashes, prompts, outputs = conversation_stream(rng, 300)
    served = rng.random(300) > 0.05
    shared = rng.random(300) > 0.05
    capacities = [0, 15, 16, 100, 400, 1000, 3000, 10_000, 1e9]
    table = check_stream(hashes, prompts, outputs, served, shared, capacities)
    hits = [prefix_cache.cached_tokens(table, c, xp=np).sum() for c in capacities]
    # a larger cache never finds less, and these capacities span none to all
    assert np.all(np.diff(hits) >= 0) and hits[0] == 0 and hits[-1] > 0
    everything = online(hashes, prompts, outputs, served, shared, 1e9)
    assert everything.sum() == hits[-1] > 0.5 * prompts[served].sum()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 6), max_size=5),
                          st.integers(1, 90), st.integers(1, 30), st.booleans(),
                          st.booleans()), min_size=1, max_size=25),
       st.lists(st.integers(0, 300), min_size=1, max_size=4))
def test_lru_table_is_the_lru_cache(rows, capacities):
    """Any hashes (repeats and shared blocks of other sizes included)."""
    hashes = [np.array(h[: -(-p // BLOCK)], np.int64) for h, p, *_ in rows]
    prompts = np.array([r[1] for r in rows], float)
    outputs = np.array([r[2] for r in rows], float)
    served = np.array([r[3] or i == 0 for i, r in enumerate(rows)])
    shared = np.array([r[4] for r in rows])
    check_stream(hashes, prompts, outputs, served, shared, capacities)


def test_streams_build_one_table_per_distinct_context_limit():
    """A model whose limit no request reaches serves the stream as no limit
    does: one table for both; a limit that rejects (or truncates) builds its
    own, ``stream_table``'s through that limit."""
    rng = np.random.default_rng(3)
    hashes, prompts, outputs = conversation_stream(rng, 120)
    tables = SimpleNamespace(pairs=np.stack([prompts, outputs], 1).astype(float),
                             pair_hashes=tuple(hashes), hash_block_tokens=BLOCK)
    streams = prefix_cache.Streams(tables, 150)  # the trace repeats, as replayed
    longest = float((prompts + outputs).max())
    none = streams(0.0, False)
    assert streams(longest, True) is none and streams(1e9, False) is none
    limit = float(np.quantile(prompts + outputs, 0.8))
    for truncate in (False, True):
        got = streams(limit, truncate)
        assert got is streams(limit, truncate) and got is not none
        want = prefix_cache.stream_table(tables, 150, limit, truncate)
        for a, b in zip((*got[0], *got[1]), (*want[0], *want[1])):
            np.testing.assert_array_equal(a, b)
    rejected = streams(limit, False)[0].cached_tokens.sum()
    assert 0 < rejected < none[0].cached_tokens.sum()


def test_padded_tables_and_curves_find_what_each_finds_alone():
    """Stacked to one width, each table gives its own hits at every capacity
    and a workload without hashes (None) none."""
    rng = np.random.default_rng(4)
    tables, curves = [], []
    for n in (3, 6):
        hashes, p, o = conversation_stream(rng, 40, BLOCK * n)
        served = np.ones(40, bool)
        t = prefix_cache.lru_table(hashes, p, o, served, served, BLOCK * n)
        tables.append(t)
        curves.append(prefix_cache.hit_curve(t, p, served))
    table = prefix_cache.padded_tables([tables[0], None, tables[1]], 40)
    capacity, share = prefix_cache.padded_curves([curves[0], None, curves[1]])
    assert table.need_tokens.shape[:2] == (3, 40) and capacity.shape[0] == 3
    for c in (0.0, 500.0, 5e3, 5e4, np.inf):
        for i, j in ((0, 0), (2, 1)):
            np.testing.assert_allclose(
                prefix_cache.cached_tokens(workload_row(table, i), c, xp=np),
                prefix_cache.cached_tokens(tables[j], c, xp=np), rtol=1e-6)
            assert np.isclose(roofline.lru_hit_fraction(c, capacity[i], share[i]),
                              roofline.lru_hit_fraction(c, *curves[j]), rtol=1e-6)
        assert prefix_cache.cached_tokens(workload_row(table, 1), c, xp=np).sum() == 0
        assert roofline.lru_hit_fraction(c, capacity[1], share[1]) == 0


def workload_row(table, i):
    """Workload ``i`` of a padded table, as one ``CacheTable``."""
    return prefix_cache.CacheTable(table.need_tokens[i], table.cached_tokens[i])


# --- through the console script ----------------------------------------------

ROWS, TRACE_BLOCK, UTILIZATION = 200, 512, 0.25
"""A conversation trace of 200 requests hashed in 512-token blocks, on an
H100 using a quarter of its memory: TP 1 holds ~24.5k KV tokens, TP 2 ~160k."""


def prefill_after(prompt, cached, budget):
    """A prefill-only instance's chunks of ``budget`` after ``cached``
    tokens, one by one (float64)."""
    total, done = 0.0, cached
    while done < prompt:
        m = min(budget, prompt - done)
        total, done = total + step(m, done, chunk_keys(m, done)), done + m
    return total


def write_trace(path, seed=5):
    """A JSON-lines trace as some public traces publish one: millisecond
    timestamps, lengths, and each prompt's block hashes (``hash_ids``)."""
    rng = np.random.default_rng(seed)
    hashes, prompts, outputs = conversation_stream(rng, ROWS, TRACE_BLOCK)
    t = np.cumsum(rng.exponential(400.0, ROWS)).astype(int)
    with path.open("w") as f:
        for row in zip(t, prompts, outputs, hashes):
            f.write(json.dumps({"timestamp": int(row[0]), "input_length": int(row[1]),
                                "output_length": int(row[2]),
                                "hash_ids": [int(h) for h in row[3]]}) + "\n")
    return hashes, prompts, outputs


TRACE_WORKLOAD = [
    "workload=azure_conv_2023", "workload.name=conversations",
    "workload.trace.format=jsonl", "workload.trace.timestamp_column=timestamp",
    "workload.trace.timestamp_unit=ms", "workload.trace.prompt_column=input_length",
    "workload.trace.output_column=output_length",
    "workload.trace.hash_column=hash_ids",
    f"workload.trace.hash_block_tokens={TRACE_BLOCK}", "workload.replay=exact",
    "workload.arrival=trace"]


def grid_cube(tmp_path, trace, method, *axes):
    """``sweep-grid`` of the trace at 2 req/s with caching off and on (one
    serving setting: concurrency 8, budget 2,048) and ``axes``; its cube."""
    out = tmp_path / "lru.zarr"
    proc = run_script("sweep-grid", [
        "experiment=seed", *TRACE_WORKLOAD, f"workload.trace.path={trace}",
        f"grid.gpu_memory_utilization={UTILIZATION}",
        "grid.prefix_caching=[false,true]", "grid.concurrency=[8]",
        "grid.token_budget=[2048]", "grid.batching=[continuous]",
        "grid.context_tokens=[1500]", "grid.traffic_tokens_per_day=[1e8]",
        f"latency={method}", f"latency.num_requests={ROWS}",
        "grid.arrival_rate_per_s=[2]", *axes, f"out={out}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    return sweep.open_cube(out).load()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["simulate", "surrogate"])
def test_sweep_grid_hit_rate_emerges_from_the_trace_and_the_cache(tmp_path, method):
    """``sweep-grid`` on a trace with block hashes: the hit fraction is the
    reference LRU cache's at each TP's KV capacity (more memory, more
    hits), the simulated p99s with caching are the reference scheduler's
    run of the same stream with its own LRU cache, and the surrogate's p99
    TTFT falls with caching, the more where the cache finds more."""
    trace = tmp_path / "conversations.jsonl"
    hashes, prompts, outputs = write_trace(trace)
    ds = squeeze_except(
        grid_cube(tmp_path, trace, method, "grid.tensor_parallel=[1,2]"),
        "tensor_parallel", "prefix_caching")
    mean_prompt = prompts.mean()
    shares, drops = [], []
    for tp in (1, 2):
        hw = h100(memory_bytes=80e9 * UTILIZATION)
        capacity = kv_capacity_tokens(hw, qwen3_8b(np.float64), tp)
        hits = online(hashes, prompts, outputs, np.ones(ROWS, bool),
                      np.ones(ROWS, bool), capacity, TRACE_BLOCK)
        share = hits.sum() / prompts.sum()
        shares.append(share)
        at = ds.sel(tensor_parallel=tp)
        # the roofline's share is the mean prompt's, in whole 16-token blocks
        got = float(at.prefix_hit_fraction.sel(prefix_caching=1))
        assert share - 16 / mean_prompt <= got <= share, (tp, got, share)
        assert float(at.prefix_hit_fraction.sel(prefix_caching=0)) == 0.0
        assert int(at.latency_status.sel(prefix_caching=1)) == 0
        ttft = at.ttft_p99_s.sel(prefix_caching=1) / at.ttft_p99_s.sel(prefix_caching=0)
        drops.append(float(ttft))
        if method == "surrogate":
            continue
        ref = simulate_reference(
            hw, qwen3_8b(np.float64), tp, 8, 2048, replayed_arrivals(trace),
            prompts, outputs, prefix_cache=(hashes, TRACE_BLOCK))
        np.testing.assert_allclose(
            [float(at[f"ttft_p{q}_s"].sel(prefix_caching=1)) for q in (50, 99)],
            np.percentile(ref.ttft_s, [50, 99]), rtol=1e-3)
        assert float(at.itl_p99_s.sel(prefix_caching=1)) == pytest.approx(
            np.percentile(ref.itl_s, 99), rel=5e-3)
    # TP 1's 24.5k tokens evict blocks TP 2's 160k keep
    assert 0.2 < shares[0] < shares[1] - 0.05
    assert drops[1] < drops[0] < 1.0


@pytest.mark.slow
@pytest.mark.parametrize("method", ["simulate", "surrogate"])
def test_sweep_grid_prefill_instances_cache_their_own_prompts(tmp_path, method):
    """Disaggregated points of ``sweep-grid`` on a trace with block hashes:
    each prefill instance is an LRU cache of the prompts dealt to it, so the
    hit fraction at 1 and 2 instances is the reference caches' (two find
    less than one), the simulated p50/p99 TTFT are the reference
    disaggregated scheduler's with those caches, and caching lowers the
    p50 TTFT by a fifth or more (at 1 instance the p99 is a long prompt that
    finds nothing, in the reference too)."""
    from reference_scheduler import simulate_disaggregated_reference

    trace = tmp_path / "conversations.jsonl"
    hashes, prompts, outputs = write_trace(trace)
    ds = squeeze_except(grid_cube(tmp_path, trace, method, "grid.tensor_parallel=[1]",
                                  "grid.disaggregated=[true]",
                                  "grid.prefill_instances=[1,2]",
                                  "grid.decode_instances=[1]"),
                        "prefill_instances", "prefix_caching")
    hw = h100(memory_bytes=80e9 * UTILIZATION)._replace(kv_link_bytes_per_s=5e10)
    capacity = kv_capacity_tokens(hw, qwen3_8b(np.float64), 1)
    shares = []
    for p in (1, 2):
        found = 0.0
        for r in range(p):  # round-robin in arrival order, one output token each
            mine = np.arange(r, ROWS, p)
            found += online([hashes[i] for i in mine], prompts[mine],
                            np.ones(len(mine)), np.ones(len(mine), bool),
                            np.ones(len(mine), bool), capacity, TRACE_BLOCK).sum()
        shares.append(found / prompts.sum())
        at = ds.sel(prefill_instances=p)
        got = float(at.prefix_hit_fraction.sel(prefix_caching=1))
        assert shares[-1] - 16 / prompts.mean() <= got <= shares[-1], (p, got)
        assert int(at.latency_status.sel(prefix_caching=1)) == 0
        on, off = (float(at.ttft_p50_s.sel(prefix_caching=c)) for c in (1, 0))
        assert on < 0.8 * off
        if method == "surrogate":
            continue
        ref = simulate_disaggregated_reference(
            hw, qwen3_8b(np.float64), 1, 8, 2048, replayed_arrivals(trace), prompts,
            outputs, p, 1, prefix_cache=(hashes, TRACE_BLOCK))
        np.testing.assert_allclose(
            [float(at[f"ttft_p{q}_s"].sel(prefix_caching=1)) for q in (50, 99)],
            np.percentile(ref.ttft_s, [50, 99]), rtol=1e-3)
    assert 0.2 < shares[1] < shares[0] - 0.02


def replayed_arrivals(trace):
    """The stream's arrival times as ``replay_requests`` builds them (the
    trace's offsets at 2 req/s), float32 as the simulator takes them."""
    rows = trace.read_text().splitlines()
    t = np.array([json.loads(line)["timestamp"] for line in rows]) / 1e3
    t -= t[0]
    return (t * ((len(t) - 1) / t[-1]) / 2.0).astype(np.float32).astype(np.float64)


BAD = [
    # (override(s), the trace's hash_ids of row 2, the start of the one line)
    ([], None, None),
    (["workload.trace.hash_block_tokens=0"], None,
     "workload[conversations].trace.hash_block_tokens = 0: hash_column needs"),
    (["workload.replay=sampled"], None,
     "workload[conversations].replay = 'sampled': block hashes belong"),
    (["workload.prefix_hit_fraction=0.5"], None,
     "workload[conversations].prefix_hit_fraction = 0.5: the hits come from"),
    ([], "[1, 2.5]", "workload.trace[t.jsonl].hash_ids: not a list of integer "
     "hashes at line 2"),
    ([], list(range(40)), "workload.trace[t.jsonl].hash_ids: more hashes than the "
     "prompt's blocks of 512 tokens (input_length) at line 2"),
]


@pytest.mark.parametrize("overrides,row2,line", BAD)
def test_bad_hash_input_is_one_line(tmp_path, overrides, row2, line):
    from sweep.config.schema import ConfigError
    from sweep.grid import job as grid

    trace = tmp_path / "t.jsonl"
    write_trace(trace)
    if row2 is not None:
        rows = trace.read_text().splitlines()
        rows[1] = rows[1].split('"hash_ids"')[0] + f'"hash_ids": {row2}}}'
        trace.write_text("\n".join(rows) + "\n")
    args = ["experiment=seed", *TRACE_WORKLOAD, f"workload.trace.path={trace}",
            "grid.concurrency=[8]", *overrides]
    if line is None:
        assert grid.check(*grid_inputs(args))[0].pair_hashes is not None
        return
    with pytest.raises(ConfigError) as e:
        grid.check(*grid_inputs(args))
    assert str(e.value).startswith(line), str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_sweep_optimize_gives_each_prefill_instance_its_own_cache(tmp_path):
    """``sweep-optimize``'s disaggregated deployments on a trace with block
    hashes: the enumeration prices a pool of ``p`` prefill instances at the
    share their caches find (the reference caches' of ``verify_requests``
    prompts each, fewer with more instances), the verification gives each
    prefill instance an LRU cache of the prompts dealt to it (p50/p99 TTFT
    the reference disaggregated scheduler's with those caches), and the
    prefill pool's flags enable prefix caching."""
    import jax
    from reference_scheduler import simulate_disaggregated_reference

    from sweep.config.convert import hardware_params, model_params
    from sweep.search import disaggregate, optimize

    trace = tmp_path / "conversations.jsonl"
    hashes, prompts, outputs = write_trace(trace)
    each = 60
    job = optimize.prepare(*optimize_inputs([
        "hardware=h100_sxm", "model=qwen3_8b", "calibration=roofline",
        *TRACE_WORKLOAD, f"workload.trace.path={trace}",
        "workload.arrival_rate_per_s=2", "search.tensor_parallel=[1]",
        "search.disaggregated=[false,true]",
        f"search.gpu_memory_utilization={UTILIZATION}",
        f"search.verify_requests={each}"]))
    hw = h100(memory_bytes=80e9 * UTILIZATION)._replace(kv_link_bytes_per_s=5e10)
    capacity = kv_capacity_tokens(hw, qwen3_8b(np.float64), 1)
    cand = job.candidates[0]
    cand_hw = hardware_params(cand.hardware, UTILIZATION)
    deps = disaggregate.enumerate_deployments(job)
    budgets = {d.token_budget for d in deps}
    shares, mean_prefill = {}, {}
    for p in {1, 2} | {d.prefill_instances for d in deps}:
        n = each * p
        rows = np.arange(n) % ROWS  # the trace repeats, as replayed
        found = np.zeros(n)
        for r in range(p):
            mine = rows[r::p]
            found[r::p] = online([hashes[i] for i in mine], prompts[mine],
                                 np.ones(len(mine)), np.ones(len(mine), bool),
                                 np.ones(len(mine), bool), capacity, TRACE_BLOCK)
        shares[p] = found.sum() / prompts[rows].sum()
        # each request of the pool at its own cached prefix, as simulated
        got = disaggregate.pool_prompts(job, cand, cand_hw, model_params(cand.model),
                                        1, p)
        cached = np.minimum(found, prompts[rows] - 1)
        np.testing.assert_array_equal(got[0], prompts[rows])
        np.testing.assert_array_equal(got[1], cached)
        np.testing.assert_allclose(got[2], 1 / n)
        mean_prefill[p] = {b: np.mean([prefill_after(x, c, b) for x, c in
                                       zip(prompts[rows], cached)]) for b in budgets}
    assert 0 < shares[2] < shares[1]
    # the enumeration prices each pool at the mean of its requests' prefills
    # (by hand in float64), not at the mean prompt's at the mean share
    transfer = prompts.mean() * KVB / 5e10
    for d in deps:
        b, p = d.token_budget, d.prefill_instances
        assert d.zero_load_ttft_s == pytest.approx(mean_prefill[1][b] + transfer,
                                                   rel=1e-4)
        assert d.prefill_utilization == pytest.approx(
            2.0 * max(mean_prefill[p][b], transfer) / p, rel=1e-4)

    deps = [disaggregate.Deployment(0, 1, p, 1, 8, 2048, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
            for p in (1, 2)]
    stream = optimize.verification_stream(job, jax.random.key(0))
    hits = optimize.verification_hits(job, jax.random.key(0))
    sims = disaggregate.simulate_deployments(job, deps, stream, hits, 2)
    n = sims[0]["requests"]
    rows = np.arange(n) % ROWS  # the trace repeats, as replayed
    arrival = np.asarray(stream.arrival_s[:n], np.float64)
    for dep, sim in zip(deps, sims):
        ref = simulate_disaggregated_reference(
            hw, qwen3_8b(np.float64), 1, 8, 2048, arrival, prompts[rows], outputs[rows],
            dep.prefill_instances, 1,
            prefix_cache=([hashes[i] for i in rows], TRACE_BLOCK))
        np.testing.assert_allclose([sim["ttft_p50_s"], sim["ttft_p99_s"]],
                                   np.percentile(ref.ttft_s, [50, 99]), rtol=1e-3)
    flags = disaggregate.pool_flags(job, deps[0])
    assert "--enable-prefix-caching" in flags["prefill"]
    assert "--enable-prefix-caching" not in flags["decode"]


@pytest.mark.slow
def test_sweep_optimize_gives_each_replica_its_own_cache(tmp_path):
    """``sweep-optimize`` on a trace with block hashes: each candidate's
    searched hit fraction is the reference cache's at its KV capacity over
    one replica's verification stream; the verification gives every replica
    an LRU cache of the requests routed to it (two replicas find fewer hits
    than one cache of the same requests would), and its p99s are the
    reference scheduler's, replica by replica, pooled."""
    import jax

    from sweep.search import optimize

    trace = tmp_path / "conversations.jsonl"
    hashes, prompts, outputs = write_trace(trace)
    half = ROWS // 2
    job = optimize.prepare(*optimize_inputs([
        "hardware=h100_sxm", "model=qwen3_8b", "calibration=roofline",
        *TRACE_WORKLOAD, f"workload.trace.path={trace}",
        "workload.arrival_rate_per_s=2", "search.tensor_parallel=[1,2]",
        f"search.gpu_memory_utilization={UTILIZATION}",
        f"search.verify_requests={half}"]))
    assert [c.tp for c in job.candidates] == [1, 2]
    hw = h100(memory_bytes=80e9 * UTILIZATION)
    capacity = [kv_capacity_tokens(hw, qwen3_8b(np.float64), tp) for tp in (1, 2)]
    every = np.ones(ROWS, bool)
    shares = [online(hashes[:half], prompts[:half], outputs[:half], every, every, c,
                     TRACE_BLOCK).sum() / prompts[:half].sum() for c in capacity]
    searched = optimize._candidates(job, 1.0, 0.05).prefix_hit_fraction
    np.testing.assert_allclose(np.asarray(searched)[:2], shares, rtol=1e-6)
    assert 0 < shares[0] < shares[1]
    # the verification replays the trace's first rows, and says so
    rows = trace.read_text().splitlines()
    t = np.array([json.loads(line)["timestamp"] for line in rows], np.float64)
    share = (t[half - 1] - t[0]) / (t[-1] - t[0])
    # at those rows' own pace: their mean rate over the whole trace's
    pace = ((half - 1) / (t[half - 1] - t[0])) / ((ROWS - 1) / (t[-1] - t[0]))
    assert (f"first {half:,} of {ROWS:,} arrivals ({share:.1%} of its span) at "
            f"{pace:.2f}x the target rate" in optimize.trace_coverage(job, half))
    assert optimize.trace_coverage(job, ROWS) is None

    key = jax.random.key(0)
    configs = [optimize.Config(0, 8, 2048, 1, {}, 0.0, 0.0),
               optimize.Config(0, 8, 2048, 2, {}, 0.0, 0.0)]
    got = optimize.simulate_configs(job, configs, key, 2)
    arrival = np.asarray(optimize.verification_stream(job, key).arrival_s, np.float64)
    split_hits, one_cache = 0.0, 0.0
    for cfg, sim in zip(configs, got):
        n = max(half * cfg.replicas, ROWS)  # the whole trace at least
        ttft = []
        for r in range(cfg.replicas):
            mine = np.arange(r, n, cfg.replicas)
            ref = simulate_reference(
                hw, qwen3_8b(np.float64), 1, 8, 2048, arrival[mine], prompts[mine],
                outputs[mine], prefix_cache=([hashes[i] for i in mine], TRACE_BLOCK))
            ttft.append(ref.ttft_s)
            if cfg.replicas == 2:
                split_hits += online([hashes[i] for i in mine], prompts[mine],
                                     outputs[mine], every, every, capacity[0],
                                     TRACE_BLOCK).sum()
        np.testing.assert_allclose(
            [sim["ttft_p50_s"], sim["ttft_p99_s"]],
            np.percentile(np.concatenate(ttft), [50, 99]), rtol=1e-3)
        assert sim["status"] == 0 and sim["requests"] == n
    one_cache = online(hashes, prompts, outputs, every, every, capacity[0],
                       TRACE_BLOCK).sum()
    assert split_hits < 0.8 * one_cache
    assert "--enable-prefix-caching" in optimize.serving_flags(job, configs[0])
    # the check command's prompts share TP 1's cached share of the mean prompt
    shared = int(shares[0] * prompts.mean() // 16 * 16)
    assert (f"--random-prefix-len {shared} --random-input-len "
            f"{round(prompts.mean()) - shared} ") in optimize.bench_command(
                job, configs[0])


def test_surrogate_bands_follow_the_lru_cache():
    """The surrogate's bands of an LRU cache (``lru_bands``), at each of its
    capacity rows, hold the reference LRU's hits there: the mean work is the
    prompts less their hits, the bands' cached prefixes average to the
    hits, and the share is the hit curve's; a capacity between two rows
    reads the smaller one's bands, and no caching none."""
    import jax.numpy as jnp

    from sweep.latency.surrogate.lengths import (
        BAND_EDGES,
        HIT_ROWS,
        cached_workload,
        latency_workload,
        lru_bands,
    )
    from sweep.latency.workload import WorkloadTables

    rng = np.random.default_rng(11)
    hashes, prompts, outputs = conversation_stream(rng, 300)
    everyone = np.ones(300, bool)
    table = prefix_cache.lru_table(hashes, prompts, outputs, everyone, everyone, BLOCK)
    curve = prefix_cache.hit_curve(table, prompts, everyone)
    cap, work, _, cached, joint, mean, _ = lru_bands(table, curve, prompts, outputs,
                                                     everyone)
    assert cap[0] == -np.inf and (np.diff(cap) > 0).all()
    assert len(cap) == HIT_ROWS < len(curve[0])
    band = np.diff(BAND_EDGES)
    for m in range(len(cap)):
        hits = online(hashes, prompts, outputs, everyone, everyone, max(cap[m], 0))
        assert mean[m] == pytest.approx((prompts - hits).mean(), rel=1e-12)
        assert band @ cached[m] == pytest.approx(hits.mean(), rel=1e-9, abs=1e-9)
        share = roofline.lru_hit_fraction(max(cap[m], 0), *curve)
        assert float(share) == pytest.approx(hits.sum() / prompts.sum(), rel=1e-6)
        np.testing.assert_allclose(joint[m].sum(axis=1), band, atol=1e-12)
    wl = latency_workload(
        WorkloadTables("lru", np.unique(prompts), np.full(len(np.unique(prompts)),
                       1 / len(np.unique(prompts))), np.array([20.0]), np.array([1.0])),
        lru=(table, curve, prompts, outputs, everyone))
    m = len(cap) // 2
    between = 0.5 * (cap[m] + cap[m + 1])
    on, got = cached_workload(wl, jnp.float32(0.3), jnp.float32(between))
    np.testing.assert_allclose(float(on.mean_prompt_tokens), mean[m], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(got), cached[m], rtol=1e-6)
    off, none = cached_workload(wl, jnp.float32(0.0), jnp.float32(between))
    assert not np.asarray(none).any()
    assert float(off.mean_prompt_tokens) == float(wl.mean_prompt_tokens)



def test_prefill_pools_read_their_own_caches_bands(tmp_path):
    """``sweep-grid``'s pools' summaries per prefill pool size: a pool of
    ``p`` instances reads the bands of its instances' LRU caches (each of
    its own prompts, ``pool_table``), at each capacity row the prompts less
    their hits there; the decode pool's summary has no cache."""
    import jax.numpy as jnp

    from sweep.latency import p99
    from sweep.latency.surrogate.lengths import cached_workload, lru_bands
    from sweep.latency.workload import workload_tables

    trace = tmp_path / "conversations.jsonl"
    write_trace(trace)
    app, options = grid_inputs(["experiment=seed", *TRACE_WORKLOAD,
                                f"workload.trace.path={trace}"])
    (model,), (workload,) = options["model"], options["workload"]
    tables = workload_tables(workload, app.data_dir)
    streams = prefix_cache.Streams(tables, ROWS)
    served = [[p99.served_requests(tables, workload, model)]]
    pooled, dims = p99._pooled(served, [model], [workload], [streams], True, [1, 2])
    assert dims == ("model", "workload", "prefill_instances")
    prompts, _, everyone, _ = streams.stream_requests(0.0, False)
    for i, size in enumerate((1, 2)):
        table, curve = streams(0.0, False, size)
        pre = jax_tree_at(pooled.prefill, (0, 0, i))
        assert float(pre.hit_distribution) == 1.0
        cap, *_, mean, _ = lru_bands(table, curve, prompts, np.ones(ROWS), everyone)
        np.testing.assert_allclose(np.asarray(pre.hit_capacity_tokens)[:len(cap)], cap,
                                   rtol=1e-6)
        for m in range(1, len(cap), 7):
            hits = prefix_cache.cached_tokens(table, cap[m], xp=np)[everyone]
            assert mean[m] == pytest.approx((prompts[everyone] - hits).mean())
            on, _ = cached_workload(pre, jnp.float32(0.5),
                                    jnp.float32(np.nextafter(cap[m], np.inf)))
            np.testing.assert_allclose(float(on.mean_prompt_tokens), mean[m],
                                       rtol=1e-6)
        assert float(jax_tree_at(pooled.decode, (0, 0, i)).hit_distribution) == 0.0


def jax_tree_at(tree, index):
    import jax

    return jax.tree.map(lambda x: x[index], tree)
