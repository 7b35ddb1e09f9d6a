"""``ds.sweep`` on a real cube: feasibility, cheapest, Pareto, serving flags.

The cube comes from ``sweep-grid`` itself (run as a subprocess, once per
session); every expectation is recomputed here with plain NumPy on the raw
arrays, or by hand. Each test runs on the cube in memory and on the cube
opened lazily in several dask blocks along kept and reduced dims alike, as a
cube too large for memory is read (``sweep.cube.reduce``).
"""

from __future__ import annotations

import importlib.resources

import numpy as np
import pandas as pd
import pytest
import xarray as xr

import sweep

COST = "cost_per_mtok_out_usd"


BLOCKS = {"hardware": 1, "tensor_parallel": 1, "concurrency": 3, "token_budget": 1}
"""Dask blocks of the session cube (64 points, one chunk file): uneven along
concurrency, and the token budget, on which the cost ties, split."""


@pytest.fixture(scope="module", params=["memory", "blocks"])
def ds(cube_path, request) -> xr.Dataset:
    cube = sweep.open_cube(cube_path)
    return cube.load() if request.param == "memory" else cube.chunk(BLOCKS)


def test_open_cube_has_accessor(cube_path):
    assert hasattr(sweep.open_cube(cube_path), "sweep")


def test_feasible_mask_by_hand(ds):
    # KV: (80e9 - 2 * 8.19e9) / (147,456 B * 1,500 tokens) = 287.6 sequences on
    # one H100; 48 GB L40S: 143.0 per GPU-worth of memory at TP 1, 360.8 at TP 2
    mask = ds.sweep.feasible_mask()
    pt = mask.sel(batching="static", token_budget=2048).squeeze()
    assert bool(pt.sel(hardware="h100_sxm", tensor_parallel=1, concurrency=64))
    assert not bool(pt.sel(hardware="h100_sxm", tensor_parallel=1, concurrency=512))
    assert bool(pt.sel(hardware="h100_sxm", tensor_parallel=2, concurrency=512))
    assert not bool(pt.sel(hardware="l40s", tensor_parallel=2, concurrency=512))
    # vLLM's max_num_batched_tokens >= max_num_seqs, continuous batching only
    cont = mask.sel(batching="continuous", hardware="h100_sxm",
                    tensor_parallel=2, concurrency=512).squeeze()
    assert list(cont.values) == [False, True]  # token budgets 256, 2048
    assert mask.attrs["feasible"] == "kv_fits & token_budget >= concurrency"


def test_feasible_itl_proxy_and_p99(ds):
    limit = 0.01
    out = ds.sweep.feasible(itl_p99_s=limit)
    budget_ok = ((ds.token_budget >= ds.concurrency) | (ds.batching != "continuous")
                 ).broadcast_like(ds.kv_fits).transpose(*ds.kv_fits.dims).values
    expect = ds.kv_fits.values & (ds.step_s.values <= limit) & budget_ok
    np.testing.assert_array_equal(out["feasible"].values, expect)
    assert "step_s (decode step as ITL proxy: no itl_p99_s) <= 0.01 s" in out.attrs[
        "feasible"]
    kept = out["step_s"].values
    assert np.all(np.isnan(kept[~expect])) and np.all(np.isfinite(kept[expect]))
    assert out["step_s"].attrs["units"] == "s"
    assert out["usd_per_gpu_hour"].dims == ("hardware",)  # not broadcast
    # with p99 variables in the cube they are used, no proxy
    p99 = ds.assign(itl_p99_s=ds.step_s * 2.0, ttft_p99_s=ds.step_s * 40.0)
    mask = p99.sweep.feasible_mask(itl_p99_s=limit, ttft_p99_s=0.3)
    expect = ds.kv_fits.values & (2 * ds.step_s.values <= limit) & (
        40 * ds.step_s.values <= 0.3) & budget_ok
    np.testing.assert_array_equal(mask.values, expect)
    assert "proxy" not in mask.attrs["feasible"]


def test_feasible_ttft_proxy(ds):
    ttft = (ds.mean_prompt_tokens / ds.prefill_tokens_per_s).transpose(
        *ds.kv_fits.dims)
    limit = float(np.nanmedian(ttft.values))
    mask = ds.sweep.feasible_mask(ttft_p99_s=limit)
    assert mask.values.any() and not mask.values[ds.kv_fits.values].all()
    np.testing.assert_array_equal(mask.values & ~(ttft.values <= limit),
                                  np.zeros_like(mask.values))
    assert "one-step prefill as TTFT proxy" in mask.attrs["feasible"]


def _shipped_slos() -> list[str]:
    base = importlib.resources.files("sweep.conf").joinpath("slo")
    if not base.is_dir():
        return []
    return sorted(p.name.removesuffix(".yaml") for p in base.iterdir()
                  if p.name.endswith(".yaml"))


@pytest.mark.parametrize("name", _shipped_slos())
def test_feasible_named_slo_equals_its_limits(ds, name):
    limits = sweep.cube.accessor.load_slo(name)
    np.testing.assert_array_equal(ds.sweep.feasible_mask(name).values,
                                  ds.sweep.feasible_mask(**limits).values)


def test_feasible_bad_input(ds):
    with pytest.raises(ValueError, match=r"no conf/slo/no_such_slo\.yaml"):
        ds.sweep.feasible("no_such_slo")
    with pytest.raises(ValueError, match=r"itl_p99_s = -1: must be"):
        ds.sweep.feasible(itl_p99_s=-1)
    with pytest.raises(ValueError, match="the cube has no kv_fits"):
        ds.drop_vars("kv_fits").sweep.feasible()


def test_cheapest_over_concurrency_is_nanmin(ds):
    best = ds.sweep.cheapest("concurrency")
    axis = ds[COST].dims.index("concurrency")
    raw = ds[COST].values.astype(np.float64)
    got = best[COST].transpose(*[d for d in ds[COST].dims if d != "concurrency"])
    np.testing.assert_array_equal(got.values, np.nanmin(raw, axis=axis))
    conc = ds.concurrency.values[np.nanargmin(raw, axis=axis)]
    np.testing.assert_array_equal(
        best["best_concurrency"].transpose(*got.dims).values, conc)
    assert best["best_concurrency"].attrs["units"] == "sequence"
    assert "concurrency" not in best.dims


def test_cheapest_ties_go_to_the_first_point(ds):
    # the cost does not depend on the token budget: a cell's least cost is
    # there at both budgets where both are feasible, and the first in cube
    # order is kept; at ITL <= 6 ms no L40S point is left
    over = ["tensor_parallel", "concurrency", "token_budget"]
    masked = ds.sweep.feasible(itl_p99_s=0.006)
    best = masked.sweep.cheapest(over)
    keep = [d for d in masked[COST].dims if d not in over]
    raw = masked[COST].transpose(*keep, *over).values.astype(np.float64)
    flat = raw.reshape(*raw.shape[:len(keep)], -1)
    has = ~np.isnan(flat).all(axis=-1)
    assert has.any() and not has.all()
    least = np.nanmin(np.where(has[..., None], flat, 0.0), axis=-1)
    assert ((flat == least[..., None]).sum(axis=-1)[has] == 2).all()
    first = np.nanargmin(np.where(has[..., None], flat, 0.0), axis=-1)
    for d, i in zip(over, np.unravel_index(first, [ds.sizes[d] for d in over])):
        got = best[f"best_{d}"].transpose(*keep).values
        np.testing.assert_array_equal(got[has], ds[d].values[i][has])
        assert np.isnan(got[~has]).all()
    assert (best["best_token_budget"].values[has] == 256).all()


def test_cheapest_carries_every_variable_of_the_point(ds):
    best = ds.sweep.cheapest(["tensor_parallel", "concurrency", "token_budget"])
    for h in ds.hardware.values:
        for b in ds.batching.values:
            pt = best.sel(hardware=h, batching=b).squeeze()
            sub = ds[COST].sel(hardware=h, batching=b).values
            assert float(pt[COST]) == np.nanmin(sub)
            at = ds.sel(hardware=h, batching=b,
                        tensor_parallel=int(pt.best_tensor_parallel),
                        concurrency=int(pt.best_concurrency),
                        token_budget=int(pt.best_token_budget)).squeeze()
            for name in ("step_s", "output_tokens_per_s", "replicas", "kv_fits"):
                assert at[name].values == pt[name].values
            assert float(pt.usd_per_gpu_hour) == float(ds.usd_per_gpu_hour.sel(
                hardware=h))


def test_cheapest_cell_without_point_is_blank(ds):
    masked = ds.sweep.feasible(itl_p99_s=0.006)  # only the fastest points remain
    best = masked.sweep.cheapest("concurrency")
    raw = masked[COST].values
    axis = masked[COST].dims.index("concurrency")
    empty = np.all(np.isnan(raw), axis=axis)
    assert empty.any() and not empty.all()
    dims = [d for d in masked[COST].dims if d != "concurrency"]
    assert np.isnan(best["best_concurrency"].transpose(*dims).values[empty]).all()
    assert np.isnan(best["step_s"].transpose(*dims).values[empty]).all()
    assert not best["kv_fits"].transpose(*dims).values[empty].any()
    with pytest.raises(ValueError, match="has no dim nope"):
        ds.sweep.cheapest(["nope"])


def _dominated(px, py, x, y) -> np.ndarray:
    return (x >= px) & (y >= py) & ((x > px) | (y > py))


def test_pareto_hand_checked():
    # (x, y): the front is (1, 5), (2, 4), (3, 1); (2, 4) twice is kept once
    x = np.array([1.0, 2.0, 2.0, 3.0, 1.0, 2.0, np.nan])
    y = np.array([5.0, 4.0, 4.0, 1.0, 1.0, 3.0, 9.0])
    toy = xr.Dataset({"a": ("p", x), "b": ("p", y)}, coords={"p": np.arange(7)})
    front = toy.sweep.pareto("a", "b")
    assert list(front["p"]) == [0, 1, 3]
    assert list(front["a"]) == [1.0, 2.0, 3.0]


def test_pareto_on_cube(ds):
    x, y = "output_tokens_per_s", "user_tokens_per_s"
    front = ds.sweep.pareto(x, y, by="hardware")
    points = ds[[x, y]].to_dataframe().reset_index().dropna(subset=[x, y])
    for h, group in points.groupby("hardware"):
        f = front[front.hardware == h]
        assert f[x].is_monotonic_increasing
        gx, gy = group[x].to_numpy(), group[y].to_numpy()
        for px, py in zip(f[x], f[y]):  # nothing dominates a front point
            assert not _dominated(px, py, gx, gy).any()
        for px, py in zip(gx, gy):  # everything else is dominated or a duplicate
            on = (f[x].to_numpy() == px) & (f[y].to_numpy() == py)
            assert on.any() or _dominated(px, py, f[x].to_numpy(),
                                          f[y].to_numpy()).any()
    assert set(front.hardware) == {"h100_sxm", "l40s"}
    assert isinstance(front, pd.DataFrame) and "concurrency" in front.columns
    # of identical points the first in cube order is kept: the token budget
    # changes neither rate, so each front point is at the first budget
    dup = points.duplicated(subset=["hardware", x, y])
    assert dup.any()
    first = points[~dup].set_index(["hardware", x, y])
    at = first.loc[list(zip(front.hardware, front[x], front[y]))]
    np.testing.assert_array_equal(at["token_budget"], front["token_budget"])
    assert (front["token_budget"] == 256).all()


def test_blocks_give_what_memory_gives(cube_path):
    # cheapest and pareto of the cube read block by block, NaN and ties
    # included, equal those of the cube in memory (same rows, same order)
    memory = sweep.open_cube(cube_path).load()
    blocks = sweep.open_cube(cube_path).chunk(BLOCKS)
    for masked in (False, True):
        m, b = ((d.sweep.feasible(itl_p99_s=0.02) if masked else d)
                for d in (memory, blocks))
        for over in (["concurrency"], ["hardware", "token_budget"],
                     ["tensor_parallel", "concurrency", "token_budget", "batching"]):
            best = b.sweep.cheapest(over)
            assert best[COST].chunks is not None  # the picked points stay lazy
            xr.testing.assert_identical(best.compute(), m.sweep.cheapest(over))
    for x, y, maximize in (("output_tokens_per_s", "user_tokens_per_s", (True, True)),
                           (COST, "step_s", (False, False))):
        for by in (None, "hardware", ["batching", "hardware"]):
            pd.testing.assert_frame_equal(
                blocks.sweep.pareto(x, y, by=by, maximize=maximize),
                memory.sweep.pareto(x, y, by=by, maximize=maximize))
    with pytest.raises(ValueError, match="by nope: not a dim"):
        blocks.sweep.pareto(COST, "step_s", by="nope")


def test_to_serving_flags(ds):
    sel = dict(hardware="h100_sxm", tensor_parallel=2, concurrency=64,
               token_budget=2048, batching="continuous")
    flags = ds.sweep.to_serving_flags(**sel)
    assert flags.flags == {"--tensor-parallel-size": 2, "--max-num-seqs": 64,
                           "--max-num-batched-tokens": 2048,
                           "--gpu-memory-utilization": 1.0}
    assert str(flags) == flags.cli == (
        "--tensor-parallel-size 2 --max-num-seqs 64 --max-num-batched-tokens 2048 "
        "--gpu-memory-utilization 1")
    # 1e8 tokens/day is 1,157 tokens/s: one replica
    assert flags.replicas == 1 == int(ds.replicas.sel(sel).squeeze())
    assert flags.engine == "vllm"
    sglang = ds.sweep.to_serving_flags(engine="sglang", **sel)
    assert sglang.cli == ("--tp-size 2 --max-running-requests 64 "
                          "--chunked-prefill-size 2048 --mem-fraction-static 1")
    # the cube's GPU memory and weights give TensorRT-LLM's share of what the
    # weights leave: at utilisation 1 the KV cache takes all of it
    assert float(ds.memory_bytes.sel(hardware="h100_sxm")) == 80e9
    trt = ds.sweep.to_serving_flags(engine="trtllm", **sel)
    assert trt.flags == {"--tp_size": 2, "--max_batch_size": 64,
                         "--max_num_tokens": 2048,
                         "--kv_cache_free_gpu_memory_fraction": 1.0}
    with pytest.raises(ValueError, match="unknown engine; allowed: vllm, sglang"):
        ds.sweep.to_serving_flags(engine="tgi", **sel)


def test_to_serving_flags_refuses(ds):
    with pytest.raises(ValueError, match=r"also select .*concurrency"):
        ds.sweep.to_serving_flags(hardware="h100_sxm", tensor_parallel=1,
                                  token_budget=2048, batching="continuous")
    one = dict(hardware="h100_sxm", tensor_parallel=1, token_budget=2048)
    with pytest.raises(ValueError, match="continuous batching"):
        ds.sweep.to_serving_flags(**one, concurrency=8, batching="static")
    with pytest.raises(ValueError, match="does not fit"):
        ds.sweep.to_serving_flags(**one, concurrency=512, batching="continuous")
    with pytest.raises(ValueError, match="max_num_batched_tokens >= max_num_seqs"):
        ds.sweep.to_serving_flags(hardware="h100_sxm", tensor_parallel=2,
                                  token_budget=256, concurrency=512,
                                  batching="continuous")
