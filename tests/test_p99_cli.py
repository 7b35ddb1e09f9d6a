"""p99 latency in the cube, through the installed ``sweep-grid``."""

from __future__ import annotations

import csv

import helpers
import numpy as np
import pytest

import sweep
from sweep.cube import status
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


def test_serving_flags_of_a_p99_cube_need_no_rate(simulated):
    """An engine's flags are the same at every arrival rate: a point of a p99
    cube selected without one gets them (it was refused: 'also select
    arrival_rate_per_s')."""
    ds, _ = simulated
    flags = ds.sweep.to_serving_flags(
        hardware="h100_sxm", tensor_parallel=1, concurrency=16, token_budget=512,
        batching="continuous", context_tokens=1500)
    assert flags.cli.startswith("--tensor-parallel-size 1 --max-num-seqs 16 "
                                "--max-num-batched-tokens 512 "), flags.cli
    assert flags.cli == ds.sweep.to_serving_flags(
        hardware="h100_sxm", tensor_parallel=1, concurrency=16, token_budget=512,
        batching="continuous", context_tokens=1500, arrival_rate_per_s=4.0).cli


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
    # closed forms cover continuous batching only, and the status says so
    static = ds.sel(batching="static")
    assert np.isnan(static.ttft_p99_s.values).all()
    assert (static.latency_status & status.UNMODELLED == status.UNMODELLED).all()
    assert (cont.latency_status & status.UNMODELLED == 0).all()


def test_one_slot_decodes_alone_on_a_traces_bursts(tmp_path):
    """``max_num_seqs=1`` on the code trace's recorded arrivals: one request
    in the engine at a time, so every gap between its tokens is one decode
    step of one sequence, no longer than that step at the trace's longest
    context (7,841 tokens, below the grid's 8,192) and no shorter than at one
    token: the cube's own roofline ``step_s`` at those contexts (4.89 and
    5.25 ms). The surrogate read p99 ITL 33.0 ms, a chunk step of another
    prompt that one slot never admits beside a decode."""
    proc = helpers.run_script("sweep-grid", [
        "hardware=h100_sxm", "model=qwen3_8b", "workload=azure_code_2023",
        "grid.tensor_parallel=[1]", "grid.concurrency=[1]", "grid.token_budget=[8192]",
        "grid.batching=[continuous]", "grid.context_tokens=[1,8192]",
        "grid.traffic_tokens_per_day=[1e8]", "grid.arrival_rate_per_s=[0.5]",
        "latency=surrogate", "calibration=roofline", "out=one.zarr"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    ds = sweep.open_cube(tmp_path / "one.zarr").load().squeeze()
    floor, top = (float(ds.step_s.sel(context_tokens=c)) for c in (1, 8192))
    assert floor <= float(ds.itl_p50_s) <= float(ds.itl_p99_s) <= top * 1.01, (
        floor, float(ds.itl_p99_s), top)
