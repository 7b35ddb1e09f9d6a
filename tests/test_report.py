"""``sweep-report``: every chart drawn from a real cube, bad input refused cleanly."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
from helpers import check_png, report

import sweep
from sweep.report import plots


def fail(argv, capsys) -> str:
    """Runs the report expecting exit code 2; returns its one stderr line."""
    with pytest.raises(SystemExit) as e:
        report(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("sweep-report: error: ")
    return err


def save(ds: xr.Dataset, path: Path) -> Path:
    ds = ds.copy()
    for v in ds.variables.values():
        v.encoding = {}
    ds.to_zarr(path, mode="w", zarr_format=2, consolidated=True)
    return path


@pytest.fixture(scope="module")
def default_report(cube_path) -> Path:  # noqa: F811
    """The report written where it goes by default: c.report/ beside c.zarr."""
    report([cube_path])
    return cube_path.parent / "c.report"


def test_every_chart_drawn(default_report, cube_path):  # noqa: F811
    # the cube sweeps neither speculation, prefix caching nor disaggregation:
    # their charts alone are left out
    charts = [c for c in plots.CHARTS if not c.varies]
    assert [c.file for c in plots.CHARTS if c.varies] == [
        "speculative_decoding.png", "prefix_caching.png", "disaggregation.png"]
    for chart in charts:
        check_png(default_report / chart.file)
    md = (default_report / "report.md").read_text()
    for chart in charts:
        assert f"]({chart.file})" in md
    assert not (default_report / "speculative_decoding.png").exists()
    assert not (default_report / "prefix_caching.png").exists()
    assert "Skipped charts" not in md
    ds = sweep.open_cube(cube_path)
    assert f"`{ds.attrs['sweep_version']}`" in md
    assert ds.attrs["hydra_overrides"] in md
    # the summary row of each hardware, cheapest first; flags of the best point
    rows = [ln for ln in md.splitlines() if ln.startswith("| h100_sxm | qwen3_8b")
            or ln.startswith("| l40s | qwen3_8b")]
    assert len(rows) == 2
    assert "vLLM flags for the cheapest point" in md and "--max-num-seqs" in md
    # the cube's own SLO (interactive) applies, through the documented proxies
    assert "step_s (decode step as ITL proxy" in md
    leftovers = [p.name for p in default_report.parent.iterdir()
                 if p.name.startswith(".") or p.suffix in (".lock", ".old")]
    assert leftovers == []


def test_summary_row_is_the_cheapest_feasible_point(default_report, cube_path):  # noqa: F811
    ds = sweep.open_cube(cube_path).load()
    limits = sweep.cube.accessor.cube_slo(ds)
    fixed = ds.sweep.feasible(**limits).sel(batching="continuous")
    cost = fixed["cost_per_mtok_out_usd"].sel(hardware="l40s").values
    md = (default_report / "report.md").read_text()
    row = next(ln for ln in md.splitlines() if ln.startswith("| l40s |"))
    assert f"| {np.nanmin(cost):.3f} |" in row


def test_p99_cube_missing_variables_and_replacement(cube_path, tmp_path):  # noqa: F811
    ds = sweep.open_cube(cube_path).load()
    attrs = {"units": "s", "long_name": "p99 ITL"}
    p99 = ds.assign(itl_p99_s=(ds.step_s * 1.5).assign_attrs(attrs),
                    slo_met=ds.step_s < 0.01)
    p99 = p99.drop_vars(["long_prefill_s", "long_prefill_worst_itl_s"])
    path = save(p99, tmp_path / "p99.zarr")
    out = tmp_path / "rep"
    report([path, "--out", out])  # an earlier report, then a stray file in it
    (out / "stale.txt").write_text("old")
    report([path, "--out", out, "--itl-p99-s", "0.03", "--hardware", "l40s"])
    assert not (out / "stale.txt").exists()  # the old report is replaced whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p99.zarr", "rep"]
    md = (out / "report.md").read_text()
    assert "- Chunked-prefill interference: the cube lacks long_prefill_s, " \
           "long_prefill_worst_itl_s" in md
    assert not (out / "prefill_interference.png").exists()
    for chart in plots.CHARTS[:4]:
        check_png(out / chart.file)
    assert "ITL p99 (ms)" in md and "proxy" not in md
    assert "itl_p99_s <= 0.03 s (p99 limits from command line)" in md
    assert "show l40s x qwen3_8b" in md
    # without limits the heatmap's boundary is the cube's own slo_met
    mask, what = plots.feasible_region(p99, {})
    assert what == "kv_fits & token_budget >= concurrency & slo_met"
    assert not mask.values[~p99.slo_met.values].any()


def test_a_cube_without_a_feasible_point(cube_path, tmp_path):  # noqa: F811
    """Static batching of 512 sequences of 1,500 tokens on one GPU: no point
    fits (an H100 holds 251 of them). The report says why its single-panel
    charts show the first pair, and the interference chart, with no chunked
    prefill to draw, says so instead of a legend of nothing (matplotlib's
    warning, an error here)."""
    ds = sweep.open_cube(cube_path).load().sel(
        batching=["static"], concurrency=[512], tensor_parallel=[1])
    assert not ds.kv_fits.any()
    out = tmp_path / "rep"
    report([save(ds, tmp_path / "none.zarr"), "--out", out])
    md = (out / "report.md").read_text()
    assert ("single-panel charts show h100_sxm x qwen3_8b (the first pair: no "
            "point is feasible)") in md
    check_png(out / "prefill_interference.png")


def test_heatmap_boundary_is_drawn():
    # a 2 x 3 region: the boundary has one vertical and one horizontal segment
    from matplotlib.figure import Figure

    ax = Figure().subplots()
    plots._boundary(ax, np.array([[True, True, False], [True, True, True]]))
    segments = sorted(tuple(map(tuple, ln.get_xydata())) for ln in ax.lines)
    assert segments == [((1.5, -0.5), (1.5, 0.5)), ((1.5, 0.5), (2.5, 0.5))]


def test_not_a_cube(tmp_path, capsys):
    err = fail([tmp_path / "missing.zarr"], capsys)
    assert "is not a result cube" in err and "missing.zarr" in err
    (tmp_path / "empty.zarr").mkdir()
    assert "is not a result cube" in fail([tmp_path / "empty.zarr"], capsys)
    assert not list(tmp_path.glob("*.report"))
    assert [p.name for p in tmp_path.iterdir()] == ["empty.zarr"]


def test_bad_input_keeps_the_old_report(cube_path, tmp_path, capsys):  # noqa: F811
    ds = sweep.open_cube(cube_path).load()
    path = save(ds.drop_vars(["cost_per_mtok_out_usd", "kv_fits"]),
                tmp_path / "thin.zarr")
    out = tmp_path / "rep"
    report([cube_path, "--out", out])
    old = (out / "report.md").read_text()
    err = fail([path, "--out", out], capsys)
    assert "lacks cost_per_mtok_out_usd, kv_fits" in err
    assert (out / "report.md").read_text() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rep", "thin.zarr"]
    assert "no conf/slo/nope.yaml" in fail([cube_path, "--out", out, "--slo", "nope"],
                                           capsys)
    assert "--hardware a100: not in the cube" in fail(
        [cube_path, "--out", out, "--hardware", "a100"], capsys)
    assert "must be a finite number > 0" in fail(
        [cube_path, "--out", out, "--ttft-p99-s", "0"], capsys)
    shutil.rmtree(out)


@pytest.fixture(scope="module")
def optimize_report(optimize_run) -> Path:
    """The report of the session's ``sweep-optimize`` dataset, where it goes."""
    assert optimize_run.proc.returncode == 0, optimize_run.proc.stderr
    report([optimize_run.path])
    return optimize_run.path.parent / "opt.report"


def test_optimize_report(optimize_report, optimize_run):
    for chart in plots.OPTIMIZE_CHARTS:
        check_png(optimize_report / chart.file)
    md = (optimize_report / "report.md").read_text()
    for name in ("pareto.png", "candidates.png"):
        assert f"]({name})" in md
    a = xr.open_zarr(optimize_run.path).attrs
    assert f"| {a['chosen_hardware']} | {a['chosen_model']} | " \
           f"{a['chosen_tensor_parallel']} | {a['chosen_replicas']} | " in md
    assert f"`{a['vllm_flags']}`" in md
    assert a["log"] in md and f"`{a['sweep_version']}`" in md
    assert "| h100_sxm x qwen3_8b x TP 1 |" in md and "Skipped charts" not in md
    assert "| h100_sxm x qwen3_8b (bf16 weights, fp8 KV) x TP 1 |" in md
    assert md.count(f"| {a['chosen_weight_dtype']} | {a['chosen_kv_dtype']} |") == 1
    assert "## Verification rounds" in md


def test_optimize_report_refuses_grid_options(optimize_run, tmp_path, capsys):
    err = fail([optimize_run.path, "--out", tmp_path / "rep", "--hardware", "l40s"],
               capsys)
    assert "is an optimize dataset; --hardware: for grid cubes only" in err
    assert list(tmp_path.iterdir()) == []


def test_optimize_dataset_without_configs_is_refused(tmp_path, capsys):
    # the candidates of an optimize dataset, without its configurations
    ds = xr.Dataset({"cost_per_mtok_out_usd": ("candidate", [1.0, np.nan]),
                     "chosen": ("candidate", [True, False])},
                    coords={"candidate": [0, 1], "hardware": ("candidate", ["a", "b"])})
    path = save(ds, tmp_path / "opt.zarr")
    err = fail([path], capsys)
    assert "opt.zarr: the optimize dataset lacks model, tensor_parallel" in err
    assert "config_cost_per_mtok_out_usd" in err and "dim config" in err
    assert "attribute vllm_flags" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["opt.zarr"]


def test_reports_of_two_cubes_in_one_folder_are_apart(cube_path, default_report,
                                                     tmp_path):
    for name in ("a", "b"):
        shutil.copytree(cube_path, tmp_path / f"{name}.zarr")
    shutil.copytree(default_report, tmp_path / "a.report")
    before = (tmp_path / "a.report" / "report.md").read_text()
    report([tmp_path / "b.zarr"])
    assert (tmp_path / "b.report" / "report.md").read_text().startswith(
        "# Sweep report: b.zarr")
    assert (tmp_path / "a.report" / "report.md").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "a.report", "a.zarr", "b.report", "b.zarr"]


@pytest.mark.parametrize("case", ["foreign", "file", "cube"])
def test_out_the_tool_must_not_replace_is_refused(cube_path, tmp_path, capsys,
                                                  case):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    (tmp_path / "notes.txt").write_text("keep")
    target, why = {
        "foreign": (tmp_path / "mine", "exists and is not a sweep-report report"),
        "file": (tmp_path / "notes.txt", "exists and is not a folder"),
        "cube": (cube_path, "exists and is not a sweep-report report (it is a "
                            "sweep-grid cube)"),
    }[case]
    err = fail([cube_path, "--out", target], capsys)
    assert err.startswith(f"sweep-report: error: --out {target}: {why}"), err
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    assert (tmp_path / "notes.txt").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "notes.txt"]
    sweep.open_cube(cube_path)  # intact


@pytest.mark.parametrize("damage, why", [
    ("delete", "the chunk file is missing"),
    ("truncate", "does not decode (its size is not the one its header states)"),
    ("scramble", "does not decode (RuntimeError)")])
def test_a_damaged_cube_is_refused(cube_path, tmp_path, capsys, damage, why):
    # the report used to show a missing chunk as rows of dashes, exit code 0,
    # and a corrupt one as blosc's traceback; scrambled, a compressed chunk
    # (blosc header flag 0x02 unset: not stored as is) fails to decode
    chunk = next(p for p in sorted(cube_path.glob("*/[0-9]*"))
                 if p.read_bytes()[2] & 0x02 == 0)
    var = chunk.parent.name
    good = chunk.read_bytes()
    try:
        if damage == "delete":
            chunk.unlink()
        elif damage == "truncate":
            chunk.write_bytes(good[: len(good) // 2])
        else:  # same length, header kept: found only by decoding
            chunk.write_bytes(good[:16] + b"\xff" * (len(good) - 16))
        err = fail([cube_path, "--out", tmp_path / "rep"], capsys)
    finally:
        chunk.write_bytes(good)
    assert err == (f"sweep-report: error: {cube_path} is damaged: variable {var}, "
                   f"chunk {chunk.name}: {why}; rerun the command that wrote it\n")
    assert list(tmp_path.iterdir()) == []
