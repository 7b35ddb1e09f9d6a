"""Cube I/O: round trip, resume after an interruption, nothing half-written."""

from __future__ import annotations

import pytest
import xarray as xr

from sweep import grid, results
from sweep.config.resolve import grid_options

ARGS = ["grid=small", "hardware=h100_sxm", "grid.model=[qwen3_8b,llama3_1_8b]",
        "grid.chunk_points=12"]


class Interrupt(Exception):
    pass


def _job(hydra_ctx_unused=None):
    app, options = grid_options("grid", ARGS)
    return grid.prepare(app, options)


def test_interrupted_sweep_resumes_without_recomputing(hydra_ctx, tmp_path):
    job = _job()
    out = tmp_path / "cube.zarr"
    attrs = {"config_yaml": "x"}
    assert len(job.parts[0].plan) > 2
    seen = []

    def stop_after_two(done, total):
        seen.append(done)
        if done == 2:
            raise Interrupt

    with pytest.raises(Interrupt):
        grid.run(job, out, attrs, "x", progress=stop_after_two)
    assert not out.exists(), "an unfinished cube must not appear under its name"
    with pytest.raises(FileNotFoundError, match="interrupted; rerun it to resume"):
        results.open_cube(out)
    resumed = []
    ds = grid.run(job, out, attrs, "x", progress=lambda d, t: resumed.append(d))
    assert resumed[0] == 2  # the two finished blocks are kept, not recomputed
    assert len(resumed) == len(job.parts[0].plan) - 2 + 1
    fresh = grid.run(job, tmp_path / "fresh.zarr", attrs, "x")
    xr.testing.assert_identical(ds.load(), fresh.load())
    assert not results.partial_path(out).exists()
    assert not results.progress_path(out).exists()


def test_a_changed_config_starts_over(hydra_ctx, tmp_path):
    job = _job()
    out = tmp_path / "cube.zarr"

    def stop(done, total):
        if done == 1:
            raise Interrupt

    with pytest.raises(Interrupt):
        grid.run(job, out, {}, "config A", progress=stop)
    seen = []
    grid.run(job, out, {}, "config B", progress=lambda d, t: seen.append(d))
    assert seen[0] == 0


@pytest.mark.parametrize("store", ["directory", "netcdf"])
def test_round_trip(hydra_ctx, tmp_path, store):
    job = _job()
    ds = grid.run(job, tmp_path / "c.zarr", {"config_yaml": "x"}, "x").load()
    if store == "netcdf":
        pytest.importorskip("scipy")
        path = tmp_path / "c.nc"
        ds.to_netcdf(path, engine="scipy")
        back = results.open_cube(path).load()
        xr.testing.assert_allclose(back.drop_vars("kv_fits"), ds.drop_vars("kv_fits"))
    else:
        back = results.open_cube(tmp_path / "c.zarr").load()
        xr.testing.assert_identical(back, ds)
