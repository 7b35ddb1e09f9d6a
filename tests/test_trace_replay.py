"""Exact trace replay and the context limit, through the installed ``sweep-grid``.

A hand-made trace of four requests, two seconds apart (each is served alone),
is replayed exactly under a 2,048-token context: rejected (two of four
exceed it) and truncated. Every p99 figure in the cube is checked against
the SPEC's roofline worked out here in float64.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import run_script

import sweep

pytestmark = pytest.mark.slow  # every test here reads a run of the console script

# recorded (timestamp ms, prompt, output); rows 1 and 3 exceed 2,048 tokens
TRACE = [(1_700_000_000_000, 1000, 4), (1_700_000_002_000, 3000, 2),
         (1_700_000_004_000, 500, 6), (1_700_000_006_000, 2040, 10)]
CONTEXT = 2048

WORKLOAD = """defaults:
  - base_workload
  - _self_
name: {name}
trace:
  path: {path}
  format: jsonl
  timestamp_column: ts_ms
  timestamp_unit: ms
  prompt_column: input_length
  output_column: output_length
prompt: {{kind: trace}}
output: {{kind: trace}}
arrival: trace
replay: exact
overlong: {overlong}
arrival_rate_per_s: 0.5   # the trace's own rate: 3 gaps in 6 s
"""


def step_s(tokens, kv_read_tokens, attention_keys):
    """A roofline step of Qwen3-8B on one H100 (SPEC), float64."""
    memory = (8.19e9 * 2 + kv_read_tokens * 2 * 36 * 8 * 128 * 2) / 3.35e12
    compute = (2 * 8.19e9 * tokens + 4 * 36 * 32 * 128 * attention_keys) / 9.89e14
    return max(memory, compute)


def alone(prompt, output):
    """TTFT, inter-token gaps and E2E of a request served alone (budget 2,048
    >= prompt: one prefill step; then one decode step per further token at
    context prompt + tokens generated)."""
    ttft = step_s(prompt, 0, prompt * (prompt + 1) / 2)
    gaps = [step_s(1, prompt + g, prompt + g) for g in range(1, output)]
    return ttft, gaps, ttft + sum(gaps)


def write_beyond(root):
    """The workload ``beyond`` (``root/conf``): every row beyond the context."""
    trace = root / "beyond.jsonl"
    trace.write_text("".join(json.dumps({"ts_ms": t, "input_length": p,
                                         "output_length": o}) + "\n"
                             for t, p, o in [(0, 3000, 4), (2_000, 2100, 2)]))
    folder = root / "conf" / "workload"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "beyond.yaml").write_text(WORKLOAD.format(name="beyond", path=trace,
                                                        overlong="reject"))


@pytest.fixture(scope="module")
def replayed_run(tmp_path_factory):
    """The console run of both workloads: what it printed, and its cube."""
    root = tmp_path_factory.mktemp("replay")
    trace = root / "tiny.jsonl"
    trace.write_text("".join(json.dumps({"ts_ms": t, "input_length": p,
                                         "output_length": o}) + "\n"
                             for t, p, o in TRACE))
    folder = root / "conf" / "workload"
    folder.mkdir(parents=True)
    for overlong in ("reject", "truncate"):
        (folder / f"tiny_{overlong}.yaml").write_text(WORKLOAD.format(
            name=f"tiny_{overlong}", path=trace, overlong=overlong))
    write_beyond(root)
    proc = run_script("sweep-grid", [
        f"hydra.searchpath=[file://{root / 'conf'}]", "hardware=h100_sxm",
        "model=qwen3_8b", f"model.max_context_tokens={CONTEXT}",
        "grid.workload=[tiny_reject,tiny_truncate,beyond]", "grid.tensor_parallel=[1]",
        "grid.concurrency=[8]", "grid.token_budget=[2048]",
        "grid.batching=[continuous]", "grid.context_tokens=[1500]",
        "grid.long_prompt_tokens=[1024]", "grid.traffic_tokens_per_day=[1e8]",
        "latency=simulate", "latency.num_requests=4",
        "calibration=roofline",  # expect() times the bound's steps
        "out=tiny.zarr"], root)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout + proc.stderr, sweep.open_cube(root / "tiny.zarr").load()


@pytest.fixture(scope="module")
def replayed(replayed_run):
    return replayed_run[1].squeeze()


def expect(requests):
    out = [alone(p, o) for p, o in requests]
    ttft = [t for t, _, _ in out]
    gaps = [g for _, gs, _ in out for g in gs]
    e2e = [e for _, _, e in out]
    return {"ttft_p50_s": np.percentile(ttft, 50),
            "ttft_p99_s": np.percentile(ttft, 99),
            "itl_p50_s": np.percentile(gaps, 50), "itl_p99_s": np.percentile(gaps, 99),
            "e2e_p99_s": np.percentile(e2e, 99)}


def assert_figures(cube, want):
    for name, value in want.items():
        # TTFT and E2E: the float32 clock at <= 6 s (5e-7 s) on >= 5 ms steps;
        # ITL: within one histogram bin (0.2 %) of the interpolated value
        rtol = 5e-3 if name.startswith("itl") else 1e-3
        np.testing.assert_allclose(float(cube[name]), value, rtol=rtol, err_msg=name)


def test_exact_replay_rejects_overlong_requests(replayed):
    cube = replayed.sel(workload="tiny_reject")
    # served: rows 0 and 2, with their recorded pairs; percentiles over them
    assert_figures(cube, expect([(1000, 4), (500, 6)]))
    assert float(cube.rejected_fraction) == 0.5
    assert replayed.rejected_fraction.attrs["units"] == "1"
    # within the latency SLO (interactive), but slo.max_rejected_fraction = 0
    assert float(cube.ttft_p99_s) < 1.0 and float(cube.itl_p99_s) < 0.05
    assert not bool(cube.slo_met)


def test_feasibility_holds_the_rejected_share(replayed_run):
    """The summary table and ``ds.sweep.feasible`` apply the SLO's rejected
    share as ``slo_met`` does: the rejecting workload meets the p99 limits
    but rejects half its requests, so no point of it is feasible, unless
    half may be rejected; ``sweep-report`` takes the cube's share beside
    limits of its command line."""
    from argparse import Namespace

    from sweep.report.markdown import slo_limits

    printed, cube = replayed_run
    rows = {w: line for line in printed.splitlines() for w in ("tiny_reject",
                                                               "tiny_truncate")
            if w in line}
    assert "none fits and meets the SLO" in rows["tiny_reject"]
    assert "none fits and meets the SLO" not in rows["tiny_truncate"]
    said = " ".join(printed.split())  # wrapped at the terminal's width
    assert "rejected <= 0)" in said and "rejected: up to 100.00% of requests" in said
    limits = {"ttft_p99_s": 1.0, "itl_p99_s": 0.05}
    mask = cube.sweep.feasible_mask(**limits).squeeze()
    assert list(mask.values) == [False, True, False]
    assert mask.attrs["feasible"].endswith("& rejected_fraction <= 0")
    assert mask.sel(workload="tiny_truncate").item()
    assert cube.sweep.feasible_mask(**limits, max_rejected_fraction=0.5).any(
        "workload").all()
    best = cube.sweep.feasible(**limits).sweep.cheapest(["concurrency"])
    assert np.isnan(best.cost_per_mtok_out_usd.sel(workload="tiny_reject")).all()
    assert np.isfinite(best.cost_per_mtok_out_usd.sel(workload="tiny_truncate")).all()
    # p99 limits of sweep-report's command line keep the cube's share
    args = Namespace(slo=None, ttft_p99_s=1.0, itl_p99_s=0.05,
                     max_rejected_fraction=None)
    assert slo_limits(cube, args)[0]["max_rejected_fraction"] == 0.0
    with pytest.raises(ValueError, match="max_rejected_fraction = 2: must be in"):
        cube.sweep.feasible_mask(**limits, max_rejected_fraction=2)


def test_exact_replay_truncates_overlong_prompts(replayed):
    cube = replayed.sel(workload="tiny_truncate")
    # the prompt keeps context - output tokens: 3000 -> 2046, 2040 -> 2038
    assert_figures(cube, expect([(1000, 4), (2046, 2), (500, 6), (2038, 10)]))
    assert float(cube.rejected_fraction) == 0.0
    assert bool(cube.slo_met)


def surrogate(root, name, rate, context=40_960):
    """The surrogate's cube of workload ``name`` (``root/conf``) at ``rate``,
    Qwen3-8B's context limited to ``context``."""
    out = root / f"{name}.zarr"
    proc = run_script("sweep-grid", [
        f"hydra.searchpath=[file://{root / 'conf'}]", "hardware=h100_sxm",
        "model=qwen3_8b", f"model.max_context_tokens={context}", f"workload={name}",
        "grid.tensor_parallel=[1]", "grid.concurrency=[8]", "grid.token_budget=[2048]",
        "grid.batching=[continuous]", "grid.context_tokens=[1500]",
        "grid.long_prompt_tokens=[1024]", "grid.traffic_tokens_per_day=[1e8]",
        f"grid.arrival_rate_per_s=[{rate!r}]", "latency=surrogate",
        "latency.num_requests=20", "calibration=roofline", f"out={out}"], root)
    assert proc.returncode == 0, proc.stderr
    return sweep.open_cube(out).load().squeeze()


def test_surrogate_reads_the_stretch_the_simulator_replays(tmp_path):
    """A trace whose first 20 rows (short prompts, 2 s apart) differ from the
    rest (long prompts, 0.5 s apart): with ``latency.num_requests=20`` the
    surrogate describes those 20 rows at their own pace, the pace the
    simulator replays them at. So it equals the surrogate of a trace of those
    20 rows alone at the target rate times that pace, worked out here:
    (19 gaps / 38 s) over the whole trace's (39 gaps / 48 s)."""
    rows = ([(2_000 * i, 200, 20) for i in range(20)]
            + [(38_000 + 500 * (i + 1), 6000, 20) for i in range(20)])
    pace = (19 / 38) / (39 / 48)
    folder = tmp_path / "conf" / "workload"
    folder.mkdir(parents=True)
    for name, kept in (("whole", rows), ("first", rows[:20])):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"ts_ms": t, "input_length": p,
                                            "output_length": o}) + "\n"
                                for t, p, o in kept))
        (folder / f"{name}.yaml").write_text(WORKLOAD.format(
            name=name, path=path, overlong="reject"))

    whole = surrogate(tmp_path, "whole", 2.0)
    first = surrogate(tmp_path, "first", 2.0 * pace)
    for name in ("ttft_p50_s", "ttft_p99_s", "itl_p99_s", "e2e_p99_s",
                 "goodput_req_per_s"):
        np.testing.assert_allclose(float(whole[name]), float(first[name]),
                                   rtol=1e-5, err_msg=name)
    # the 6,000-token prompts beyond the stretch are not in it
    assert float(whole.ttft_p99_s) < 2 * alone(200, 20)[0] < alone(6000, 20)[0]



def test_a_repeat_that_ends_inside_the_trace_is_said(tmp_path):
    """Six rows, a burst of five one second apart and one 6 s later, replayed
    as 20 requests: three copies and the first two rows again. A repeat
    starts one mean gap (2 s) after a copy ends, so the stream's last offset
    is 3 x 12 + 1 = 37 s: 19 gaps in 37 s against the trace's 5 in 10 s,
    1.027x the target rate. The cube and the output say so."""
    rows = [(1_000 * t, 100, 10) for t in (0, 1, 2, 3, 4, 10)]
    folder = tmp_path / "conf" / "workload"
    folder.mkdir(parents=True)
    path = tmp_path / "six.jsonl"
    path.write_text("".join(json.dumps({"ts_ms": t, "input_length": p,
                                        "output_length": o}) + "\n"
                            for t, p, o in rows))
    (folder / "six.yaml").write_text(WORKLOAD.format(name="six", path=path,
                                                     overlong="reject"))
    pace = (19 / 37) / (5 / 10)
    ds = surrogate(tmp_path, "six", 1.0)
    note = (f"workload six: the p99s replay the trace's 6 arrivals 3 times, then "
            f"its first 2 again, at {pace:.3f}x the target rate; a "
            "latency.num_requests that is a multiple of 6 replays it at the "
            "target rate")
    assert ds.attrs["trace_replay"] == note


def test_every_request_beyond_the_context(replayed, tmp_path):
    """Every request beyond the model's context: both models read the
    rejected share as 1 (the surrogate read NaN), and no p99."""
    write_beyond(tmp_path)
    for cube in (replayed.sel(workload="beyond"), surrogate(tmp_path, "beyond", 0.5,
                                                                   CONTEXT)):
        assert float(cube.rejected_fraction) == 1.0
        assert np.isnan(float(cube.ttft_p99_s)) and not bool(cube.slo_met)
