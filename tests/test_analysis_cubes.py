"""``sweep-report``, ``ds.sweep`` and the summary table on every cube kind.

Cubes come from the installed console scripts (``conftest``: a roofline, a
surrogate and a simulated ``sweep-grid`` cube, a ``sweep-optimize``
dataset); expectations are recomputed here with NumPy on the raw arrays.
"""

from __future__ import annotations

import io
import re

import numpy as np
import pytest
import xarray as xr
from helpers import check_png, report

import sweep
from sweep.report import plots

CONFIG = ["tensor_parallel", "concurrency", "token_budget", "batching"]
INTERACTIVE = {"ttft_p99_s": 1.0, "itl_p99_s": 0.05}  # conf/slo/interactive.yaml


@pytest.fixture(scope="module", params=["surrogate", "simulated"])
def p99(request, surrogate_run, simulated_run) -> tuple[str, xr.Dataset, object]:
    # both runs named: the tests go with the session's other readers of them
    run = {"surrogate": surrogate_run, "simulated": simulated_run}[request.param]
    return request.param, sweep.open_cube(run.path).load(), run


def expected_mask(ds: xr.Dataset, limits: dict) -> xr.DataArray:
    """KV fits, budget >= concurrency under continuous batching, p99s within the
    limits: NumPy comparisons on arrays broadcast to the cube's dims."""
    names = ["kv_fits", "token_budget", "concurrency", "batching", *limits]
    arrays = xr.broadcast(*(ds[n] for n in names))
    dims = list(ds.dims)
    v = {n: a.transpose(*dims).values for n, a in zip(names, arrays)}
    ok = v["kv_fits"] & ((v["token_budget"] >= v["concurrency"])
                         | (v["batching"] != "continuous"))
    for name, limit in limits.items():
        ok = ok & (v[name] <= limit)  # NaN compares False
    return xr.DataArray(ok, dims=dims, coords={d: ds[d].values for d in dims})


def test_feasible_on_p99_cubes(p99):
    _, ds, _ = p99
    mask = ds.sweep.feasible_mask("interactive")
    # the mask spans every dim: the KV check's context and the p99's rate
    assert list(mask.dims) == list(ds.dims)
    np.testing.assert_array_equal(mask.values, expected_mask(ds, INTERACTIVE).values)
    assert mask.values.any() and not mask.values.all()
    out = ds.sweep.feasible("interactive")
    cost = out.cost_per_mtok_out_usd
    assert "arrival_rate_per_s" in cost.dims and "context_tokens" in out.ttft_p99_s.dims
    assert np.isnan(cost.values[~mask.values]).all()
    assert np.isfinite(cost.values[mask.values]).all()
    assert out.usd_per_gpu_hour.dims == ("hardware",)


def test_cheapest_per_scenario(p99):
    _, ds, _ = p99
    best = ds.sweep.feasible("interactive").sweep.cheapest(CONFIG)
    mask = expected_mask(ds, INTERACTIVE)
    cost = xr.broadcast(ds.cost_per_mtok_out_usd, mask)[0].transpose(*ds.dims)
    values = np.where(mask.values, cost.values, np.nan)
    axes = tuple(list(ds.dims).index(d) for d in CONFIG)
    with np.errstate(all="ignore"):
        want = np.nanmin(np.where(np.isnan(values), np.inf, values), axis=axes)
    want = np.where(np.isinf(want), np.nan, want)
    got = best.cost_per_mtok_out_usd.transpose(
        *[d for d in ds.dims if d not in CONFIG]).values
    np.testing.assert_allclose(got, want, rtol=0)  # the same float32 values


def test_pareto_and_flags_on_p99_cubes(p99):
    _, ds, _ = p99
    front = ds.sweep.pareto("output_tokens_per_s", "user_tokens_per_s",
                           by="hardware")
    assert len(front) > 0
    pt = {d: ds[d].values[0] for d in ds.dims if d != "batching"}
    pt["batching"] = "continuous"
    pt["token_budget"] = 2048
    flags = ds.sweep.to_serving_flags(**pt)
    assert flags.flags["--max-num-batched-tokens"] == 2048


def test_report_on_p99_cubes(p99, tmp_path):
    kind, ds, run = p99
    out = tmp_path / "rep"
    report([run.path, "--out", out])
    for chart in plots.CHARTS:
        if plots.applies(ds, chart):
            check_png(out / chart.file)
    md = (out / "report.md").read_text()
    assert ("ttft_p99_s <= 1 s & itl_p99_s <= 0.05 s & not saturated & "
            "rejected_fraction <= 0 (p99 "
            "limits from the cube's config)") in md
    assert "Skipped charts" not in md
    # the simulated cube replays part of its trace, and the report says so
    assert ("- workload azure_conv_2023: the p99s replay the trace's first 300 of "
            in md) == (kind == "simulated")
    # the summary row: the cheapest feasible point at the first scenario values
    first = {d: 0 for d in ("workload", "context_tokens", "long_prompt_tokens",
                            "traffic_tokens_per_day", "arrival_rate_per_s")}
    mask = expected_mask(ds, INTERACTIVE).isel(first)
    sub = ds.isel({d: 0 for d in first if d in ds.dims})
    met = 0
    for h in ds.hardware.values:
        cost = xr.broadcast(sub.cost_per_mtok_out_usd, mask)[0].sel(
            hardware=h, batching="continuous")
        ok = mask.sel(hardware=h, batching="continuous")
        row = next(ln for ln in md.splitlines() if ln.startswith(f"| {h} |"))
        if not ok.values.any():  # e.g. the measured L40S at 3 req/s: a row of dashes
            assert set(row.strip("|").split("|")[2:]) == {" — "}, (kind, row)
            continue
        want = np.nanmin(np.where(ok.values, cost.transpose(*ok.dims).values, np.nan))
        assert f"| {want:.3f} |" in row, (kind, row, want)
        met += 1
    assert met > 0


def table_rows(stdout: str) -> list[dict[str, str]]:
    """The rows of the rich table sweep-grid prints, by column header."""
    lines = stdout.splitlines()
    head = next(ln for ln in lines if ln.startswith("┃"))
    cols = [c.strip() for c in head.strip("┃").split("┃")]
    return [dict(zip(cols, (c.strip() for c in ln.strip("│").split("│"))))
            for ln in lines if ln.startswith("│")]


def test_summary_rows_per_scenario(p99):
    _, ds, run = p99
    rows = table_rows(run.proc.stdout)
    scen = [d for d in ("context_tokens", "arrival_rate_per_s") if d in ds.dims]
    # one row per hardware x scenario: context and rate are given, not chosen
    n = ds.sizes["hardware"] * ds.sizes["model"] * int(
        np.prod([ds.sizes[d] for d in scen]))
    assert len(rows) == n
    assert "meeting the p99 SLO (TTFT <= 1 s, ITL <= 50 ms)" in run.proc.stdout
    mask = expected_mask(ds, INTERACTIVE)
    cost = xr.broadcast(ds.cost_per_mtok_out_usd, mask)[0]
    cost = cost.where(mask).isel(long_prompt_tokens=0, traffic_tokens_per_day=0,
                                 workload=0)
    seen = set()
    for row in rows:
        sel = {"hardware": row["hardware"], "model": row["model"],
               "context_tokens": int(row["context tok"].replace(",", "")),
               "arrival_rate_per_s": float(row["req/s"])}
        seen.add(tuple(sel.values()))
        cell = cost.sel(sel).values
        if np.isnan(cell).all():
            assert row["max conc."] == "none fits and meets the SLO", row
            continue
        assert row["USD/1M out"] == f"{np.nanmin(cell):.3f}", row
        # the row's p99s meet the cube's SLO
        assert float(row["p99 TTFT s"]) <= 1.0 and float(row["p99 ITL ms"]) <= 50
    assert len(seen) == n


@pytest.mark.parametrize("max_rows", [1, 2, 3])
def test_summary_of_a_lazy_cube_block_by_block(p99, monkeypatch, max_rows):
    # a cube too large to load is summarised from its blocks, reading only the
    # scenarios of the rows shown: they are the first rows of the table that
    # sweep-grid printed from the cube in memory (checked above)
    from rich.console import Console

    from sweep.cube import summary

    _, _, run = p99
    monkeypatch.setattr(summary, "LOAD_POINTS", 0)
    monkeypatch.setattr(summary, "MAX_ROWS", max_rows)
    lazy = sweep.open_cube(run.path).chunk(
        {"concurrency": 1, "token_budget": 1, "arrival_rate_per_s": 1})
    table, notes = summary.summary_table(lazy)
    console = Console(file=io.StringIO(), width=200)
    console.print(table)
    full = table_rows(run.proc.stdout)
    assert len(full) == 4 and table_rows(console.file.getvalue()) == full[:max_rows]
    assert notes[-1].startswith(f"{4 - max_rows:,} more row(s) of 4 are in the cube")


def test_summary_of_a_roofline_cube(cube_path):
    # the session's roofline cube is summarised in-process from the same function
    from sweep.cube.summary import summary_table

    ds = sweep.open_cube(cube_path)
    table, notes = summary_table(ds)
    assert table.row_count == ds.sizes["hardware"] * ds.sizes["model"]
    assert "cheapest point that fits" in table.title
    # the choices the cube does not sweep are named once, not as columns
    assert notes == ["every row: weight_dtype = bf16, kv_dtype = bf16, "
                     "spec_tokens = 0, spec_acceptance = 0.7, spec_proposer = 0, "
                     "prefix_caching = 0, "
                     "disaggregated = 0, prefill_instances = 1, decode_instances = 1, "
                     "prefill_tensor_parallel = 0"]
    assert "spec k" not in [c.header for c in table.columns]


@pytest.fixture(scope="module")
def optimized(optimize_run) -> xr.Dataset:
    assert optimize_run.proc.returncode == 0, optimize_run.proc.stderr
    return sweep.open_cube(optimize_run.path).load()


def test_accessor_on_the_optimize_dataset(optimized):
    ds = optimized
    mask = ds.sweep.feasible_mask("interactive")
    assert mask.dims == ("candidate",)
    ttft = np.where(ds.verified, ds.simulated_ttft_p99_s, ds.surrogate_ttft_p99_s)
    itl = np.where(ds.verified, ds.simulated_itl_p99_s, ds.surrogate_itl_p99_s)
    want = ds.meets_targets.values & (ttft <= 1.0) & (itl <= 0.05)
    np.testing.assert_array_equal(mask.values, want)
    best = ds.sweep.feasible("interactive").sweep.cheapest("candidate")
    cost = np.where(want, ds.cost_per_mtok_out_usd.values, np.nan)
    assert int(best.best_candidate) == int(np.nanargmin(cost))
    chosen = int(np.flatnonzero(ds.chosen.values)[0])
    flags = ds.sweep.to_serving_flags(candidate=chosen)
    assert ds.attrs["vllm_flags"].startswith(flags.cli)
    # TensorRT-LLM's memory share by hand from the candidate's GPU and weights
    util = float(re.search(r"--gpu-memory-utilization (\S+)", flags.cli).group(1))
    tp = int(ds.tensor_parallel[chosen])
    m, w = float(ds.memory_bytes[chosen]), float(ds.weight_bytes[chosen]) / tp
    trt = ds.sweep.to_serving_flags(engine="trtllm", candidate=chosen)
    assert trt.flags["--kv_cache_free_gpu_memory_fraction"] == round(
        (util * m - w) / (m - w), 4)
    assert ds.attrs["trtllm_flags"].startswith(trt.cli)
    assert ds.attrs["sglang_flags"].startswith(
        ds.sweep.to_serving_flags(engine="sglang", candidate=chosen).cli)
    assert flags.replicas == ds.attrs["chosen_replicas"]
    front = ds.sweep.pareto("surrogate_itl_p99_s", "cost_per_mtok_out_usd")
    assert len(front) >= 1
