"""Several processes, one store: ``sweep-grid shard=K/N``.

The shards of a sweep write disjoint blocks of one partial store, each block
followed by its marker; the last to finish installs the cube, equal bit for
bit to a one-process run. A writer of anything else is refused while they
hold the store.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import xarray as xr
from helpers import grid_job, run_script, script

from sweep import exported
from sweep.cube import outputs, results
from sweep.errors import ConfigError
from sweep.grid import job as grid
from sweep.grid.evaluate import evaluate_regions

ARGS = ["grid=small", "hardware=h100_sxm", "model=qwen3_8b", "latency=surrogate",
        "grid.chunk_points=12"]


@pytest.fixture(scope="module")
def job():
    """24 roofline points in 2 blocks, 24 surrogate configurations in 1."""
    job = grid_job(ARGS)
    assert [len(p.plan) for p in job.parts] == [2, 1]
    return job


@pytest.fixture(scope="module")
def reference(job, tmp_path_factory):
    """The cube of one process, loaded."""
    out = tmp_path_factory.mktemp("one") / "c.zarr"
    return _values(grid.run(job, out, {"run": "x"}, "x"))


def _values(ds: xr.Dataset) -> xr.Dataset:
    """A cube's coordinates and variables with their attributes, without the
    global attributes (each run has its own time and mark)."""
    ds = ds.load()
    ds.attrs = {}
    return ds


@pytest.mark.parametrize("args, allowed", [
    (["shard=3/2", "out=c.zarr"], "must be K/N with whole numbers 1 <= K <= N, "
     "e.g. shard=2/3"),
    (["shard=1"], "must be K/N with whole numbers 1 <= K <= N, e.g. shard=2/3"),
    (["shard=1/2"], "needs out=PATH, the store the shards share"),
])
def test_a_bad_shard_is_refused_in_one_line(args, allowed):
    value = args[0].split("=")[1]
    with pytest.raises(ConfigError) as e:
        grid_job([*ARGS, *args])
    assert str(e.value) == f"shard = {value!r}: {allowed}"


def test_shard_blocks_are_disjoint_and_cover_the_sweep(job):
    every = grid.shard_blocks(job, None)
    parts = [grid.shard_blocks(job, (k, 2)) for k in (1, 2)]
    assert parts[0] | parts[1] == every and not parts[0] & parts[1]
    assert every == {"roofline.0", "roofline.1", "p99.0"}


def test_shards_in_turn_give_the_one_process_cube(job, reference, tmp_path):
    out = tmp_path / "c.zarr"
    seen = []
    assert grid.run(job, out, {"run": "x"}, "x", shard=(2, 2),
                    progress=lambda d, t: seen.append((d, t))) is None
    assert seen == [(0, 1), (1, 1)]  # one block of three: roofline.1
    assert not out.exists(), "no cube before every shard is in"
    assert results.Progress.read(out).done() == {"roofline.1"}
    ds = grid.run(job, out, {"run": "x"}, "x", shard=(1, 2))
    xr.testing.assert_identical(_values(ds), reference)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.zarr"]


def test_a_run_without_shard_finishes_what_the_shards_left(job, reference, tmp_path):
    out = tmp_path / "c.zarr"
    assert grid.run(job, out, {"run": "x"}, "x", shard=(1, 3)) is None
    seen = []
    ds = grid.run(job, out, {"run": "x"}, "x", progress=lambda d, t: seen.append(d))
    assert seen == [1, 2, 3]  # shard 1's block kept, the two others evaluated
    xr.testing.assert_identical(_values(ds), reference)


HOLD = """
import sys, time
from pathlib import Path
from sweep.cube import outputs
with outputs.lock(Path(sys.argv[1]), "abc", shared=True):
    print("held", flush=True)
    time.sleep(300)
"""


def test_shards_of_one_sweep_share_the_lock_and_others_are_refused(job, tmp_path):
    out = tmp_path / "c.zarr"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with outputs.lock(out, "abc", shared=True):  # another shard of the sweep
            pass
        assert outputs.lock_path(out).exists(), "the holder still holds it"
        with pytest.raises(outputs.OutputError) as e:
            grid.run(job, out, {}, "another config", shard=(1, 2))
        assert str(e.value).startswith(
            f"{out}: being written by the shards of another sweep (pid {holder.pid} "
            "and other shards on ")
        with pytest.raises(outputs.OutputError) as e:
            grid.run(job, out, {}, "x")
        assert str(e.value).startswith(f"{out}: being written by pid {holder.pid} "
                                       "and other shards on ")
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    assert not results.partial_path(out).exists(), "refused before any write"
    # and while a writer of the whole output holds it, a shard is refused
    with outputs.lock(out, "abc"):
        code = ("import sys; from pathlib import Path; from sweep.cube import outputs\n"
                "with outputs.lock(Path(sys.argv[1]), 'abc', shared=True): pass")
        proc = subprocess.run([sys.executable, "-c", code, str(out)],
                              capture_output=True, text=True)
    assert proc.returncode != 0
    assert f"being written by pid {os.getpid()} on " in proc.stderr


def _joblib() -> bool:
    return importlib.util.find_spec("hydra_plugins.hydra_joblib_launcher") is not None


def test_three_shards_at_once_equal_one_process(reference, tmp_path):
    """Through Hydra's joblib launcher when it is installed (else three
    processes started together); the jobs compile into one persistent cache
    folder, with the tool's own minimum compile time."""
    cache = tmp_path / "jax"
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_COMPILATION_CACHE_DIR",
                        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")}
    env["SWEEP_COMPILATION_CACHE"] = str(cache)
    if _joblib():
        proc = run_script("sweep-grid", [
            "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=3",
            "shard=1/3,2/3,3/3", *ARGS, "out=s.zarr"], tmp_path, env=env)
        assert proc.returncode == 0, proc.stderr
        codes = [proc.returncode]
    else:
        procs = [subprocess.Popen([script("sweep-grid"), *ARGS, f"shard={k}/3",
                                   "out=s.zarr"], cwd=tmp_path, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for k in (1, 2, 3)]
        codes = [p.wait(timeout=900) for p in procs]
        for p in procs:
            p.stdout.close()
            p.stderr.close()
    assert codes == [0] * len(codes)
    ds = results.open_cube(tmp_path / "s.zarr")
    attrs = dict(ds.attrs)
    xr.testing.assert_identical(_values(ds), reference)
    assert "shard" not in attrs["hydra_overrides"]
    assert "shard: null" in attrs["config_yaml"]
    # the block program, kept traced (``sweep.exported``) and compiled
    assert any((cache / "exported").glob(
        f"{exported.name(evaluate_regions)}-*.bin"))
    assert any(p.name.startswith("jit_evaluate_regions-") for p in cache.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()
                  if p.name not in ("outputs", "jax")) == ["s.zarr"]


def test_a_claim_is_whole_when_another_job_reads_it(tmp_path):
    """A multirun job's claim: shards of one sweep share the output, another
    sweep's job is refused naming the claiming job, and no temporary file
    stays (``test_a_claim_is_whole_the_moment_it_appears`` pins the race)."""
    out, folder = tmp_path / "s.zarr", tmp_path / "multirun"
    outputs.claim(out, folder, 0, "out=s.zarr", "sweep-a")
    outputs.claim(out, folder, 1, "out=s.zarr", "sweep-a")
    outputs.claim(out, folder, 0, "out=s.zarr")
    with pytest.raises(outputs.OutputError, match=r"^out=s.zarr: job 0 of this "
                       r"multirun writes it already"):
        outputs.claim(out, folder, 2, "out=s.zarr", "sweep-b")
    (claim,) = folder.iterdir()
    assert claim.name.startswith(".claim-") and claim.suffix == ".json"
    # six processes of one sweep claiming at once: every one succeeds
    code = ("import sys; from pathlib import Path; from sweep.cube import outputs\n"
            "outputs.claim(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), "
            "'out', 'sweep-c')")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "t.zarr"),
                               str(folder), str(k)], stderr=subprocess.PIPE,
                              text=True) for k in range(6)]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * 6, errors
    assert len(list(folder.iterdir())) == 2


def test_a_claim_is_whole_the_moment_it_appears(tmp_path, monkeypatch):
    """Another shard of the same sweep claiming the output the instant the
    first job's claim file appears (before the first job's next statement)
    reads a whole claim and shares the output; a claim created empty and
    written after was read as another job's, refusing that shard."""
    out, folder = tmp_path / "s.zarr", tmp_path / "multirun"
    real_open, real_link, seen = os.open, os.link, []

    def appears(path):
        path = Path(path)
        if path.name.startswith(".claim-") and path.suffix == ".json" and not seen:
            seen.append(path)
            outputs.claim(out, folder, 1, "out=s.zarr", "sweep-a")

    def open_now(path, flags, *args, **kwargs):
        fd = real_open(path, flags, *args, **kwargs)
        appears(path)
        return fd

    def link_now(src, dst, **kwargs):
        real_link(src, dst, **kwargs)
        appears(dst)

    monkeypatch.setattr(os, "open", open_now)
    monkeypatch.setattr(os, "link", link_now)
    outputs.claim(out, folder, 0, "out=s.zarr", "sweep-a")
    assert len(seen) == 1
