"""Cube I/O: round trip, resume after an interruption, nothing half-written."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import numpy as np
import pytest
import xarray as xr
from hydra import initialize_config_module
from hydra.core.global_hydra import GlobalHydra

from sweep import grid, outputs, results
from sweep.config.resolve import grid_options

ARGS = ["grid=small", "hardware=h100_sxm", "grid.model=[qwen3_8b,llama3_1_8b]",
        "grid.chunk_points=12"]


class Interrupt(Exception):
    pass


def _job(hydra_ctx_unused=None):
    app, options = grid_options("grid", ARGS)
    return grid.prepare(app, options)


def content(ds: xr.Dataset) -> xr.Dataset:
    """A cube's values and attributes, less its mark (each store has its own)."""
    ds = ds.load()
    ds.attrs.pop(outputs.MARKER)
    return ds


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
    xr.testing.assert_identical(content(ds), content(fresh))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cube.zarr", "fresh.zarr"]


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
    GlobalHydra.instance().clear()
    with initialize_config_module("sweep.conf", version_base="1.3"):
        job = grid.prepare(*grid_options("grid", [*ARGS, "grid.chunk_points=48"]))
    GlobalHydra.instance().clear()
    assert len(job.parts[0].plan) == 1
    out = tmp_path_factory.mktemp("reference") / "c.zarr"
    return job, content(grid.run(job, out, {"run": "new"}, "new"))


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
        ("cube", "new")] * 3


def test_a_kill_while_starting_leaves_the_old_cube(rerun, tmp_path):
    job, check = rerun
    fp = grid.fingerprint("new", job)
    steps = results.create_steps(results.Progress(tmp_path / "x", fp), None)
    for k in range(len(steps) + 1):
        folder = tmp_path / f"kill{k}"
        out = folder / "c.zarr"
        grid.run(job, out, {"run": "old"}, "old")

        def stop_at_one(done, total):
            if done == 1:
                raise Interrupt

        # an interrupted sweep of another config left its partial store
        with pytest.raises(Interrupt):
            grid.run(job, out, {"run": "other"}, "other", progress=stop_at_one)
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
    results.Progress(out, grid.fingerprint("new", job), "", 1, {"roofline:0"}).save()
    check(tmp_path, out)


def test_a_partial_store_the_tool_did_not_write_is_refused(hydra_ctx, tmp_path):
    job = _job()
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
from sweep import outputs
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


def test_a_users_copy_without_fill_chunks_is_not_damaged(hydra_ctx, tmp_path):
    # xarray (zarr 3) leaves out chunks of fill values only: a user's copy of a
    # cube may lack them, and is not the tool's store
    job = _job()
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
