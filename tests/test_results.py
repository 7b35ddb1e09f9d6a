"""Cube I/O: round trip, resume after an interruption, nothing half-written."""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
import sys

import numpy as np
import pytest
import xarray as xr
from helpers import assert_cube_matches_baseline, grid_job

from sweep.cube import outputs, results
from sweep.grid import job as grid

ARGS = ["grid=small", "hardware=h100_sxm", "grid.model=[qwen3_8b,llama3_1_8b]",
        "grid.chunk_points=12", "calibration=roofline"]  # the baseline is the bound

# the coordinates ARGS and conf/grid/small.yaml give, as typed there
COORDS = {
    "hardware": ["h100_sxm"], "model": ["qwen3_8b", "llama3_1_8b"],
    "workload": ["seed_chat"], "tensor_parallel": [1, 2], "concurrency": [1, 8, 64],
    "token_budget": [512, 2048], "context_tokens": [1500],
    "batching": ["static", "continuous"], "long_prompt_tokens": [8192],
    "traffic_tokens_per_day": [1e8],
}


class Interrupt(Exception):
    pass


def stop_at(block: int, seen: list | None = None):
    """A progress callback that interrupts the sweep once ``block`` blocks
    are written (recording each count in ``seen``)."""
    def progress(done, total):
        if seen is not None:
            seen.append(done)
        if done == block:
            raise Interrupt
    return progress


@pytest.fixture(scope="module")
def job():
    """48 points in blocks of at most 12."""
    return grid_job(ARGS)


def content(ds: xr.Dataset) -> xr.Dataset:
    """A cube's values and attributes, less its mark (each store has its own)."""
    ds = ds.load()
    ds.attrs.pop(outputs.MARKER)
    return ds


def test_interrupted_sweep_resumes_without_recomputing(job, tmp_path):
    out = tmp_path / "cube.zarr"
    attrs = {"config_yaml": "x"}
    assert len(job.parts[0].plan) > 2
    seen = []

    with pytest.raises(Interrupt):
        grid.run(job, out, attrs, "x", progress=stop_at(2, seen))
    assert not out.exists(), "an unfinished cube must not appear under its name"
    with pytest.raises(FileNotFoundError, match="interrupted; rerun it to resume"):
        results.open_cube(out)
    resumed = []
    ds = grid.run(job, out, attrs, "x", progress=lambda d, t: resumed.append(d))
    assert resumed[0] == 2  # the two finished blocks are kept, not recomputed
    assert len(resumed) == len(job.parts[0].plan) - 2 + 1
    assert_cube_matches_baseline(ds, job)
    fresh = grid.run(job, tmp_path / "fresh.zarr", attrs, "x")
    xr.testing.assert_identical(content(ds), content(fresh))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cube.zarr", "fresh.zarr"]


def test_a_changed_config_starts_over(job, tmp_path):
    out = tmp_path / "cube.zarr"

    with pytest.raises(Interrupt):
        grid.run(job, out, {}, "config A", progress=stop_at(1))
    seen = []
    grid.run(job, out, {}, "config B", progress=lambda d, t: seen.append(d))
    assert seen[0] == 0


def test_an_axis_typed_out_of_order_resumes_into_sorted_coordinates(tmp_path):
    job = grid_job([*ARGS, "grid.concurrency=[64,1,8]"])
    out = tmp_path / "c.zarr"

    with pytest.raises(Interrupt):
        grid.run(job, out, {}, "x", progress=stop_at(2))
    ds = grid.run(job, out, {}, "x").load()
    assert ds.concurrency.values.tolist() == [1, 8, 64]
    assert ds.sel(concurrency=slice(1, 16)).sizes["concurrency"] == 2
    assert_cube_matches_baseline(ds, job)


def test_a_store_of_other_coordinates_is_not_resumed(job):
    # the same config text may give other coordinates (an older version kept
    # the order typed; a search path's options change): resuming would mix
    # blocks of two cubes
    other = dataclasses.replace(job, coords={
        **job.coords, "model": job.coords["model"][::-1]})
    assert grid.fingerprint("x", other) != grid.fingerprint("x", job)


@pytest.mark.parametrize("store", ["directory", "netcdf"])
def test_round_trip(job, tmp_path, store):
    # what is read back is checked against values computed without the tool
    # (the plain-Python baseline, point by point), so a block written to the
    # wrong region, a dropped chunk or a cast shows
    path = tmp_path / "c.zarr"
    grid.run(job, path, {"config_yaml": "x"}, "x")
    if store == "netcdf":
        pytest.importorskip("scipy")
        path = tmp_path / "c.nc"
        results.open_cube(tmp_path / "c.zarr").load().to_netcdf(path, engine="scipy")
    back = results.open_cube(path).load()
    assert {d: back[d].values.tolist() for d in COORDS} == COORDS
    assert_cube_matches_baseline(back, job)
    assert back.attrs["config_yaml"] == "x"
    assert back.step_s.attrs["units"] == "s"
    if store == "directory":  # netCDF 3 has no boolean type
        assert back.kv_fits.dtype == bool and back.step_s.dtype == np.float32
    np.testing.assert_array_equal(back.usd_per_gpu_hour, [4.29])
    np.testing.assert_allclose(back.kv_bytes_per_token.sel(model="qwen3_8b"),
                               2 * 36 * 8 * 128 * 2)


# --- a kill at any step: the old cube or the new, and a rerun that works ---

def _stop_when_all_written(done, total):
    if done == total:
        raise Interrupt  # every block recorded, finish_store not begun


def _state(folder, out) -> tuple[str, ...]:
    """What a reader finds: the cube at ``out`` (its run), else what is aside."""
    if out.exists():
        return ("cube", results.open_cube(out).attrs["run"])
    aside = out.with_name(out.name + ".old")
    return ("aside", results.open_cube(aside).attrs["run"],
            results.Progress.read(out).resumable())


@pytest.fixture(scope="module")
def one_block(tmp_path_factory):
    """A one-block job (each write is cheap) and its cube, written uninterrupted."""
    job = grid_job([*ARGS, "grid.chunk_points=48"])
    assert len(job.parts[0].plan) == 1
    out = tmp_path_factory.mktemp("reference") / "c.zarr"
    reference = content(grid.run(job, out, {"run": "new"}, "new"))
    assert_cube_matches_baseline(reference, job)
    return job, reference


@pytest.fixture
def rerun(one_block):
    """``check(folder, out)``: a rerun of the new sweep finishes the new cube,
    equal to one written without interruption, and leaves nothing else."""
    job, reference = one_block

    def check(folder, out):
        ds = grid.run(job, out, {"run": "new"}, "new")
        xr.testing.assert_identical(content(ds), reference)
        assert sorted(p.name for p in folder.iterdir()) == [out.name]

    return job, check


def test_a_kill_while_finishing_leaves_old_or_new(rerun, tmp_path):
    job, check = rerun
    states = []
    for k in range(len(results.finish_steps(tmp_path / "x")) + 1):
        folder = tmp_path / f"kill{k}"
        out = folder / "c.zarr"
        grid.run(job, out, {"run": "old"}, "old")
        with pytest.raises(Interrupt):
            grid.run(job, out, {"run": "new"}, "new", progress=_stop_when_all_written)
        for step in results.finish_steps(out)[:k]:
            step()
        states.append(_state(folder, out))
        check(folder, out)
    # mark, consolidate, clear a leftover .old: old; old aside; new in place
    assert states == [("cube", "old")] * 4 + [("aside", "old", True)] + [
        ("cube", "new")] * 4


def test_a_kill_while_starting_leaves_the_old_cube(rerun, tmp_path):
    job, check = rerun
    fp = grid.fingerprint("new", job)
    steps = results.create_steps(results.Progress(tmp_path / "x", fp), None)
    for k in range(len(steps) + 1):
        folder = tmp_path / f"kill{k}"
        out = folder / "c.zarr"
        grid.run(job, out, {"run": "old"}, "old")

        # an interrupted sweep of another config left its partial store
        with pytest.raises(Interrupt):
            grid.run(job, out, {"run": "other"}, "other", progress=stop_at(1))
        state = results.Progress(out, fp, grid.config_digest("new"), 1)
        ds = results.template(job.coords, job.parts, {"run": "new"}, job.extra)
        for step in results.create_steps(state, ds)[:k]:
            step()
        assert _state(folder, out) == ("cube", "old")
        check(folder, out)


def test_bookkeeping_without_its_store_is_started_over(rerun, tmp_path):
    # a kill after the final rename, before the bookkeeping is dropped: every
    # rerun used to fail until the user deleted the file
    job, check = rerun
    out = tmp_path / "c.zarr"
    grid.run(job, out, {"run": "new"}, "new")
    results.Progress(out, grid.fingerprint("new", job), "", 1, True).save()
    check(tmp_path, out)


def test_a_partial_store_the_tool_did_not_write_is_refused(job, tmp_path):
    out = tmp_path / "c.zarr"
    partial = results.partial_path(out)
    partial.mkdir()
    (partial / "notes.txt").write_text("mine")
    with pytest.raises(outputs.OutputError, match="c.zarr.partial: exists and is not"):
        grid.run(job, out, {}, "x")
    assert (partial / "notes.txt").read_text() == "mine"


# --- one writer per output ---

HOLD = """
import sys, time
from pathlib import Path
from sweep.cube import outputs
with outputs.lock(Path(sys.argv[1]), "abc"):
    print("held", flush=True)
    time.sleep(300)
"""


def test_a_second_writer_is_refused_and_a_killed_ones_lock_taken_over(
        one_block, tmp_path):
    job, _ = one_block
    out = tmp_path / "c.zarr"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        info = json.loads(outputs.lock_path(out).read_text())
        assert info["pid"] == holder.pid and info["fingerprint"] == "abc"
        with pytest.raises(outputs.OutputError) as e:
            grid.run(job, out, {}, "x")
        assert str(e.value).startswith(
            f"{out}: being written by pid {holder.pid} on {socket.gethostname()} "
            "since ")
    finally:
        holder.kill()  # SIGKILL: its lock file stays behind
        holder.wait()
        holder.stdout.close()
    assert not out.exists() and outputs.lock_path(out).exists()
    grid.run(job, out, {}, "x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.zarr"]


# --- damaged cubes ---

def _chunk(out, name):
    return next(p for p in (out / name).iterdir() if not p.name.startswith("."))


@pytest.mark.parametrize("damage, why", [
    ("delete", "the chunk file is missing"),
    ("garbage", "does not decode (its size is not the one its header states)"),
    ("truncate", "does not decode (its size is not the one its header states)"),
])
def test_a_damaged_cube_is_refused_naming_the_chunk(one_block, tmp_path_factory,
                                                    damage, why):
    job, _ = one_block
    out = tmp_path_factory.getbasetemp() / "damaged" / "c.zarr"
    if not out.exists():  # one cube for the three damages, repaired after each
        grid.run(job, out, {}, "x")
    chunk = _chunk(out, "step_s")
    good = chunk.read_bytes()
    try:
        if damage == "delete":
            chunk.unlink()
        elif damage == "garbage":
            chunk.write_bytes(b"not a chunk" * 10)
        else:
            chunk.write_bytes(good[:20])
        with pytest.raises(results.DamagedCube) as e:
            results.open_cube(out)
    finally:
        chunk.write_bytes(good)
    assert str(e.value) == (f"{out} is damaged: variable step_s, chunk {chunk.name}: "
                            f"{why}; rerun the command that wrote it")
    results.open_cube(out)  # repaired


def test_a_users_copy_without_fill_chunks_is_not_damaged(job, tmp_path):
    # xarray (zarr 3) leaves out chunks of fill values only: a user's copy of a
    # cube may lack them, and is not the tool's store
    ds = grid.run(job, tmp_path / "c.zarr", {}, "x").load()
    nan = ds.assign(step_s=ds.step_s * np.nan)
    for v in nan.variables.values():
        v.encoding = {}
    nan.chunk({"model": 1}).to_zarr(tmp_path / "mine.zarr", zarr_format=2)
    assert outputs.MARKER in nan.attrs
    assert not any((tmp_path / "mine.zarr" / "step_s").glob("0.*"))
    assert np.isnan(results.open_cube(tmp_path / "mine.zarr").step_s).all()
    # nor is it the tool's to replace
    with pytest.raises(outputs.OutputError, match="exists and is not a sweep-grid"):
        grid.run(job, tmp_path / "mine.zarr", {}, "x")
