"""p99 latency in the cube, through the installed ``sweep-grid``."""

from __future__ import annotations

import csv

import helpers
import numpy as np
import pytest

import sweep
from sweep.latency.workload import resolve_trace_path

P99 = ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "e2e_p50_s",
       "e2e_p99_s", "achieved_output_tokens_per_s", "goodput_req_per_s", "slo_met")


@pytest.fixture(scope="module")
def simulated(simulated_run):
    return sweep.open_cube(simulated_run.path).load(), simulated_run.proc


def test_simulated_cube_has_p99_on_latency_axes(simulated):
    ds, proc = simulated
    for name in P99:
        assert name in ds and ds[name].attrs["method"] == "simulate", name
        assert "units" in ds[name].attrs
        assert ds[name].dims == ("hardware", "model", "workload", "tensor_parallel",
                                 "concurrency", "token_budget", "batching",
                                 "weight_dtype", "kv_dtype", "spec_tokens",
                                 "spec_acceptance", "spec_proposer",
                                 "prefix_caching", "disaggregated",
                                 "prefill_instances", "decode_instances",
                                 "prefill_tensor_parallel",
                                 "arrival_rate_per_s")
    assert list(ds.arrival_rate_per_s.values) == [1.0, 4.0]
    assert (ds.ttft_p99_s >= ds.ttft_p50_s).all()
    assert (ds.itl_p99_s >= ds.itl_p50_s).all()
    assert (ds.latency_status == 0).all()
    # one status enumeration for both backends, as CF flag attributes
    attrs = ds.latency_status.attrs
    assert list(attrs["flag_masks"]) == [1, 2, 4, 8, 16, 32]
    assert attrs["flag_meanings"].split() == ["ran_out", "oversize", "slots_short",
                                              "saturated", "kv_infeasible",
                                              "unmodelled"]
    assert "cheapest point meeting the p99 SLO" in proc.stdout


def test_simulated_slo_met_matches_the_slo_group(simulated):
    ds, _ = simulated
    # slo=interactive: p99 TTFT <= 1 s and p99 ITL <= 50 ms
    want = (ds.ttft_p99_s <= 1.0) & (ds.itl_p99_s <= 0.05)
    assert (ds.slo_met == want).all()


def test_a_partial_replay_of_a_trace_is_said(simulated, surrogate_run):
    """The simulated cube replays the conversation trace's first 300 arrivals
    (``latency.num_requests=300``): ``sweep-grid`` says which stretch, at what
    pace, and what replays all of it, and the cube keeps the line; a
    Poisson workload's cube has none. Share and pace by hand from the
    trace's timestamps."""
    ds, proc = simulated
    with open(resolve_trace_path("azure_llm_2023_conv.csv"), newline="") as f:
        t = np.array([np.datetime64(row["TIMESTAMP"].replace(" ", "T"), "ns")
                      for row in csv.DictReader(f)])
    s = (t - t[0]) / np.timedelta64(1, "s")
    n, rows = 300, len(s)
    share = s[n - 1] / s[-1]
    pace = ((n - 1) / s[n - 1]) / ((rows - 1) / s[-1])
    line = (f"workload azure_conv_2023: the p99s replay the trace's first {n} of "
            f"{rows:,} arrivals ({share:.1%} of its span) at {pace:.2f}x the target "
            "rate, and its bursts outside them are not in them; "
            f"latency.num_requests={rows} replays all of it")
    assert line in proc.stderr.replace("\n", " ")
    assert ds.attrs["trace_replay"] == line
    assert "trace_replay" not in sweep.open_cube(surrogate_run.path).attrs


def test_simulated_percentiles_never_below_one_decode_step(simulated):
    """No p50/p99 below one step of one sequence (H100 SXM, Qwen3-8B, TP 1;
    the SPEC's hand formulas): a first token needs a step that reads the
    weights, every gap a step decoding at least the trace's shortest prompt."""
    ds, _ = simulated
    with open(resolve_trace_path("azure_llm_2023_conv.csv"), newline="") as f:
        shortest = min(int(row["ContextTokens"]) for row in csv.DictReader(f))
    for name in ("ttft_p50_s", "ttft_p99_s", "e2e_p50_s", "e2e_p99_s"):
        assert (ds[name] >= helpers.step(1, 0, 0)).all(), name
    for name in ("itl_p50_s", "itl_p99_s"):
        assert (ds[name] >= helpers.decode(1, max(shortest, 1))).all(), name


def test_higher_rate_never_lowers_p99_ttft(simulated):
    ds, _ = simulated
    ttft = ds.ttft_p99_s.sel(batching="continuous")
    assert (ttft.sel(arrival_rate_per_s=4.0) >= ttft.sel(arrival_rate_per_s=1.0)).all()


def test_surrogate_cube(surrogate_run):
    ds = sweep.open_cube(surrogate_run.path).load()
    # the workload's own rate (workload.arrival_rate_per_s=3) is the one rate
    assert list(ds.arrival_rate_per_s.values) == [3.0]
    assert ds.ttft_p99_s.attrs["method"] == "surrogate"
    cont = ds.sel(batching="continuous")
    assert np.isfinite(cont.ttft_p99_s.sel(hardware="h100_sxm").values).all()
    assert ds.latency_status.attrs["flag_meanings"].split()[3] == "saturated"
    # goodput counts requests meeting the SLO: at most the offered rate
    assert (cont.goodput_req_per_s <= 3.0 * (1 + 1e-5)).all()
    # closed forms cover continuous batching only
    assert np.isnan(ds.ttft_p99_s.sel(batching="static").values).all()
