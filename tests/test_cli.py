"""``sweep-grid`` as a user runs it: the installed console script, real files."""

from __future__ import annotations

import os
import re
import socket
import subprocess
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
import yaml
from helpers import (
    CUBE_GRID,
    REPO,
    SEED_TABLE,
    assert_cube_matches_baseline,
    config_yaml,
    grid_job,
    run_script,
    script,
)

import sweep
from sweep.cli import commands
from sweep.cube import outputs
from sweep.grid import job as grid

pytestmark = pytest.mark.slow  # every test here runs the console script

SEED_ARGS = [
    "hardware=h100_sxm", "model=qwen3_8b", "workload=seed_chat",
    "grid.concurrency=[1,8,32,64,128,256]", "grid.context_tokens=[1500]",
    "calibration=roofline",  # the seed's table is the theoretical bound
]


run = partial(run_script, "sweep-grid")


@pytest.fixture(scope="module")
def seed_run(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("seed")
    proc = run([*SEED_ARGS, "out=seed.zarr"], cwd)
    assert proc.returncode == 0, proc.stderr
    return cwd, proc


def test_seed_table_through_cli_and_cube(seed_run):
    cwd, proc = seed_run
    ds = sweep.open_cube(cwd / "seed.zarr")
    pt = ds.sel(hardware="h100_sxm", model="qwen3_8b", workload="seed_chat",
                tensor_parallel=1, context_tokens=1500, batching="continuous",
                weight_dtype="bf16", kv_dtype="bf16").isel(
        token_budget=0, long_prompt_tokens=0, traffic_tokens_per_day=0,
        spec_tokens=0, spec_acceptance=0, spec_proposer=0, prefix_caching=0,
        disaggregated=0, prefill_instances=0, decode_instances=0,
        prefill_tensor_parallel=0)
    for n, itl_ms, user, gpu, usd in SEED_TABLE:
        p = pt.sel(concurrency=n)
        assert round(float(p.step_s) * 1e3, 2) == itl_ms
        assert round(float(p.user_tokens_per_s)) == user
        assert round(float(p.output_tokens_per_s)) == gpu
        assert round(float(p.cost_per_mtok_out_usd), 2) == usd
    # the summary names the cheapest fitting point: concurrency 256 on one GPU
    assert "21.79" in proc.stdout and "0.101" in proc.stdout


def test_cube_contract(seed_run):
    cwd, _ = seed_run
    ds = sweep.open_cube(cwd / "seed.zarr")
    assert list(ds.dims) == [
        "hardware", "model", "workload", "tensor_parallel", "concurrency",
        "token_budget", "context_tokens", "batching", "long_prompt_tokens",
        "traffic_tokens_per_day", "weight_dtype", "kv_dtype", "spec_tokens",
        "spec_acceptance", "spec_proposer", "prefix_caching", "disaggregated",
        "prefill_instances",
        "decode_instances", "prefill_tensor_parallel"]
    for name in ("step_s", "user_tokens_per_s", "output_tokens_per_s",
                 "slot_utilization", "cost_per_mtok_out_usd", "prefill_tokens_per_s",
                 "cost_per_mtok_in_usd", "kv_fits", "max_concurrency_fit",
                 "long_prefill_s", "long_prefill_steps", "long_prefill_worst_itl_s",
                 "effective_cost_per_mtok_out_usd", "replicas"):
        assert "units" in ds[name].attrs and "long_name" in ds[name].attrs, name
    for key in ("sweep_version", "config_yaml", "created_utc", "seed"):
        assert key in ds.attrs
    assert "qwen3_8b" in ds.attrs["config_yaml"]
    # every point of the cube the script wrote, against the plain-Python
    # baseline evaluated here on the same command line's config
    assert_cube_matches_baseline(ds.load(), grid_job(SEED_ARGS))


def test_default_run_writes_under_outputs(tmp_path):
    proc = run(["grid=small"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    cubes = list((tmp_path / "outputs").glob("*/*/cube.zarr"))
    assert len(cubes) == 1
    ds = sweep.open_cube(cubes[0])
    # every shipped hardware x model when the command line names neither
    assert ds.sizes["hardware"] == 6 and ds.sizes["model"] == 9
    assert "cheapest point that fits" in proc.stdout


# one refusal of Hydra's composition, one of the checks after it; the others
# go the same way (test_inputs checks their messages in this process)
@pytest.mark.parametrize("args, pattern", [
    (["hardware=nope"], r"hardware=nope: unknown option; allowed: a100_80gb_sxm"),
    (["hardware=l40s", "model=llama3_1_70b", "grid.tensor_parallel=[1]"],
     r"model\[llama3_1_70b\]: .* more than any grid.tensor_parallel x hardware"),
])
def test_bad_input_gets_one_line_and_exit_2(tmp_path, args, pattern):
    proc = run([*args, "out=cube.zarr"], tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert re.search(pattern, lines[0]), lines[0]
    assert not any(tmp_path.iterdir()), "bad input must leave nothing behind"


def test_malformed_trace_is_refused(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                   "2023-11-16 18:00:01,100,10\n2023-11-16 18:00:00,100,10\n")
    proc = run(["workload=azure_conv_2023", f"workload.trace.path={bad}",
                "grid=small", "hardware=h100_sxm", "model=qwen3_8b"], tmp_path)
    assert proc.returncode == 2
    assert "timestamps decrease at line 3" in proc.stderr
    missing = tmp_path / "missing.csv"
    missing.write_text("a,b\n1,2\n")
    proc = run(["workload=azure_conv_2023", f"workload.trace.path={missing}",
                "grid=small", "hardware=h100_sxm", "model=qwen3_8b"], tmp_path)
    assert proc.returncode == 2
    assert "missing column(s)" in proc.stderr
    assert not (tmp_path / "outputs").exists()


def test_own_trace_with_every_hardware(tmp_path):
    # the hardware axis lists every option, composed apart from the workload
    # choice: the trace override must still reach the chosen workload
    mine = tmp_path / "mine.csv"
    mine.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:00:00,1000,10\n2023-11-16 18:00:02,3000,30\n")
    proc = run(["workload=azure_conv_2023", f"workload.trace.path={mine}",
                "grid=small", "model=qwen3_8b", "out=c.zarr"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    ds = sweep.open_cube(tmp_path / "c.zarr")
    assert ds.sizes["hardware"] > 1
    assert str(mine) in ds.attrs["config_yaml"]


def test_a_users_gpu_beside_a_shipped_one_in_one_run(tmp_path):
    # a user's config through Hydra's search path, listed with a shipped one
    folder = tmp_path / "my_conf" / "hardware"
    folder.mkdir(parents=True)
    (folder / "my_gpu.yaml").write_text(
        "defaults:\n  - base_hardware\n  - _self_\nname: my_gpu\n"
        "memory_bandwidth_bytes_per_s: 6.7e+12\npeak_flops_per_s: 1.978e+15\n"
        "memory_bytes: 8.0e+10\ninterconnect_bytes_per_s: 4.5e+11\n"
        "usd_per_gpu_hour: 4.29\n")
    searchpath = f"hydra.searchpath=[file://{tmp_path / 'my_conf'}]"
    proc = run([searchpath, "grid.hardware=[h100_sxm,my_gpu]", "model=qwen3_8b",
                "grid=small", "calibration=roofline", "out=two.zarr"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    ds = sweep.open_cube(tmp_path / "two.zarr")
    assert list(ds.hardware.values) == ["h100_sxm", "my_gpu"]
    step = ds.step_s.sel(batching="continuous", tensor_parallel=1)
    assert np.isfinite(step.values).all()
    # a memory-bound decode step: weights + KV of 1,500 tokens over the bandwidth
    one = step.sel(concurrency=1).isel(token_budget=0).squeeze()
    for hw, bandwidth in (("h100_sxm", 3.35e12), ("my_gpu", 6.7e12)):
        np.testing.assert_allclose(float(one.sel(hardware=hw)),
                                   (16.38e9 + 1500 * 147_456) / bandwidth, rtol=1e-5)
    # twice the bandwidth: every memory-bound step at concurrency 8 is faster
    assert (step.sel(concurrency=8, hardware="my_gpu")
            < step.sel(concurrency=8, hardware="h100_sxm")).all()


# --- outputs: never replace what the tool did not write; one writer; resume ---

def one_line_exit_2(proc) -> str:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("sweep-grid: error: ")
    return lines[0]


SMALL = ["grid=small", "hardware=h100_sxm", "model=qwen3_8b"]


def _unwritable(tmp_path):
    """A folder this process cannot write in (root ignores permissions)."""
    if os.geteuid() == 0:
        return Path("/sys/sweep-test"), "/sys"
    folder = tmp_path / "ro"
    folder.mkdir(mode=0o555)
    return folder / "sub", str(folder)


@pytest.mark.parametrize("case", ["foreign", "file", "here", "unwritable"])
def test_out_the_tool_must_not_write_is_refused_before_compute(tmp_path, case):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "k.txt").write_text("keep")
    (tmp_path / "f.txt").write_text("keep")
    out, pattern = {
        "foreign": ("d", "out=d: exists and is not a sweep-grid cube (it does not "
                         "carry the tool's mark); it is left as it is; allowed: a new "
                         "path, an empty folder or an earlier sweep-grid cube"),
        "file": ("f.txt", "out=f.txt: exists and is not a folder"),
        "here": (".", "out=.: is the current folder or holds it"),
        "unwritable": (None, None),
    }[case]
    if case == "unwritable":
        target, folder = _unwritable(tmp_path)
        out, pattern = f"{target}/c.zarr", f"cannot write in {folder} "
    line = one_line_exit_2(run([*SMALL, f"out={out}"], tmp_path))
    assert pattern in line, line
    assert (tmp_path / "d" / "k.txt").read_text() == "keep"
    assert (tmp_path / "f.txt").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "ro") == [
        "d", "f.txt"], "nothing written, no run directory"


def test_a_failed_block_write_is_one_line_and_a_rerun_resumes(tmp_path):
    # 196,608 points in one block: every chunk file is over 96 KiB, the
    # store's metadata (written first) under it
    args = ["experiment=seed", "grid.tensor_parallel=[1,2,4,8]",
            f"grid.concurrency=[{','.join(str(n) for n in range(1, 257, 4))}]",
            f"grid.token_budget=[{','.join(str(256 * i) for i in range(1, 33))}]",
            "grid.context_tokens=[1000,2000,4000,8000]", "out=c.zarr"]
    # writes past 96 KiB per file fail with EFBIG (Python ignores SIGXFSZ), as
    # a full disk's fail with ENOSPC; set by the shell, not a preexec_fn (a
    # fork of this process, which runs JAX); the compilation cache off: its
    # entries would hit the limit first
    proc = subprocess.run(["bash", "-c", 'ulimit -f 96 && exec "$0" "$@"',
                           script("sweep-grid"), *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, commands.CACHE_ENV: "off"})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "sweep-grid: error: c.zarr.partial: writing block roofline.0 failed: File "
        "too large; rerun to resume from the blocks written")
    assert not (tmp_path / "c.zarr").exists()
    assert (tmp_path / "c.zarr.partial").is_dir()
    proc = run(args, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "c.zarr.partial").exists()
    cube = sweep.open_cube(tmp_path / "c.zarr").load()
    assert cube.sizes["concurrency"] == 64
    # every block written: a step time wherever the point fits (NaN, the
    # fill value, would mark a block never written)
    fits = cube["kv_fits"].astype(bool)
    assert bool(fits.any())
    assert bool((np.isfinite(cube["step_s"]) == fits).all())


def test_a_second_writer_is_refused_then_the_cube_replaced(seed_run):
    cwd, _ = seed_run
    out = cwd / "seed.zarr"
    before = os.stat(out).st_ino
    with outputs.lock(out):
        line = one_line_exit_2(run([*SEED_ARGS, "out=seed.zarr"], cwd))
    assert f"being written by pid {os.getpid()} on {socket.gethostname()}" in line
    assert os.stat(out).st_ino == before
    # the writer gone, a rerun replaces its own cube (a new store); Hydra
    # writes nothing
    proc = run([*SEED_ARGS, "out=seed.zarr"], cwd)
    assert proc.returncode == 0, proc.stderr
    assert os.stat(out).st_ino != before
    assert outputs.kind_of(out) == "cube"
    assert sorted(p.name for p in cwd.iterdir()) == ["seed.zarr"]


def test_multirun_jobs_sharing_one_out_second_is_refused(tmp_path):
    proc = run(["-m", *SMALL, "grid.concurrency=[1],[8]", "out=m.zarr"], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "sweep-grid: error: out=m.zarr: job 0 of this multirun writes it already; "
        "give each job its own output, e.g. out='cube_${hydra:job.num}.zarr', or "
        "split one sweep over the jobs with shard=K/N")
    assert list(sweep.open_cube(tmp_path / "m.zarr").concurrency.values) == [1]


def test_app_config_is_the_one_a_rerun_looks_for(cube_path):
    # a rerun without out= finds an unfinished cube by the digest of the config
    # it composes; the job wrote the digest of Hydra's own composition
    out = f"out={cube_path}"
    written = sweep.open_cube(cube_path).attrs["config_yaml"]
    assert config_yaml("grid", [*CUBE_GRID, out]) == written
    assert not (cube_path.parent / "outputs").exists()


def test_a_rerun_without_out_resumes_the_unfinished_run(tmp_path):
    args = [*SMALL, "grid.chunk_points=12", "calibration=roofline"]
    text = config_yaml("grid", args)
    job = grid_job(args)
    assert len(job.parts[0].plan) == 2
    folder = tmp_path / "outputs" / "2026-01-01" / "00-00-00"

    def stop(done, total):
        if done == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        grid.run(job, folder / "cube.zarr", {"run": "first"}, text,
                 progress=stop)
    # a run of another config is not resumed
    other = tmp_path / "outputs" / "2026-01-01" / "00-00-01"
    with pytest.raises(KeyboardInterrupt):
        grid.run(job, other / "cube.zarr", {}, "another config", progress=stop)
    proc = run(args, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert ("sweep-grid: resuming the unfinished sweep in outputs/2026-01-01/"
            "00-00-00/cube.zarr (1 of 2 blocks done)") in proc.stderr
    assert sorted(p.name for p in (tmp_path / "outputs").glob("*/*")) == [
        "00-00-00", "00-00-01"], "no new run directory"
    assert sorted(p.name for p in folder.iterdir()) == [".hydra", "cube.zarr",
                                                         "sweep-grid.log"]
    ds = sweep.open_cube(folder / "cube.zarr").load()
    assert ds.attrs["run"] == "first"  # its store was continued, not started over
    assert_cube_matches_baseline(ds, job)
    fresh = grid.run(job, tmp_path / "fresh.zarr", {"run": "first"}, text)
    xr.testing.assert_equal(ds, fresh.load())


# --- Hydra's own flags: --cfg, --help, tab completion ---

@pytest.mark.parametrize("command", ["sweep-grid", "sweep-optimize"])
def test_cfg_job_resolve_prints_the_resolved_config(tmp_path, command):
    # the shipped grid's axes are ${range:...}; a 100-value list is parsed
    # outside Hydra (stash_lists); both resolve to lists
    extra = [f"grid.token_budget=[{','.join(map(str, range(1, 101)))}]"] if (
        command == "sweep-grid") else []
    proc = run_script(command, ["--cfg", "job", "--resolve", *extra], tmp_path)
    assert proc.returncode == 0, proc.stderr
    cfg = yaml.safe_load(proc.stdout)
    if command == "sweep-grid":
        assert cfg["grid"]["concurrency"] == [2.0**i for i in range(11)]
        assert cfg["grid"]["token_budget"] == list(range(1, 101))
    else:
        assert cfg["search"]["tensor_parallel"] == [1, 2, 4, 8]
    assert "${" not in proc.stdout
    assert list(tmp_path.iterdir()) == [], "printing a config writes nothing"


SHIPPED_HARDWARE = sorted(p.stem for p in (REPO / "conf" / "hardware").glob("*.yaml"))


@pytest.mark.parametrize("command", ["sweep-grid", "sweep-optimize", "sweep-calibrate"])
def test_help_names_the_command_and_lists_configs_not_schemas(tmp_path, command):
    proc = run_script(command, ["--help"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"{command}: ")
    assert "cli" not in proc.stdout.split("== Config ==")[0]
    assert f"hardware: {', '.join(SHIPPED_HARDWARE)}\n" in proc.stdout
    assert "base_" not in proc.stdout


def test_tab_completion_offers_configs_not_schemas(tmp_path):
    # what bash's completion function asks: the options of "hardware="
    env = {**os.environ, "COMP_LINE": "sweep-grid hardware="}
    proc = run("-sc query=bash".split(), tmp_path, env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [f"hardware={h}" for h in SHIPPED_HARDWARE]


# --- numeric axes: sorted, integer axes deduplicated ---

def test_axes_are_sorted_and_a_log_range_of_integers_deduplicated(tmp_path):
    args = ["grid=small", "hardware=h100_sxm", "model=qwen3_8b",
            "grid.concurrency=${range:1,1024,64,log}", "grid.token_budget=[2048,512]",
            "grid.tensor_parallel=[2,1]", "calibration=roofline", "out=c.zarr"]
    proc = run(args, tmp_path)
    assert proc.returncode == 0, proc.stderr
    ds = sweep.open_cube(tmp_path / "c.zarr").load()
    # 64 log-spaced values from 1 to 1024, each rounded to an integer: the
    # small ones repeat (1, 1.12, 1.25, 1.39 -> 1)
    conc = sorted({round(1024 ** (i / 63)) for i in range(64)})
    assert 40 < len(conc) < 64
    assert ds.concurrency.values.tolist() == conc
    assert ds.token_budget.values.tolist() == [512, 2048]
    assert ds.tensor_parallel.values.tolist() == [1, 2]
    assert ds.sel(concurrency=slice(1, 16)).concurrency.values.tolist() == [
        c for c in conc if c <= 16]
    assert_cube_matches_baseline(ds, grid_job(args[:-1]))


@pytest.mark.parametrize("env, folder", [
    ({}, "HOME/.cache/llm-serving-sweep/jax"),
    ({"XDG_CACHE_HOME": "/x"}, "/x/llm-serving-sweep/jax"),
    ({"XDG_CACHE_HOME": "/x", "JAX_COMPILATION_CACHE_DIR": "/j"}, "/j"),
    ({"JAX_COMPILATION_CACHE_DIR": "/j", "SWEEP_COMPILATION_CACHE": "/s"}, "/s"),
    ({"JAX_COMPILATION_CACHE_DIR": "/j", "SWEEP_COMPILATION_CACHE": "off"}, None),
    ({"SWEEP_COMPILATION_CACHE": "0"}, None),
])
def test_compilation_cache_folder(monkeypatch, env, folder):
    for name in ("XDG_CACHE_HOME", "JAX_COMPILATION_CACHE_DIR",
                 "SWEEP_COMPILATION_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", "/home/u")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    want = folder and folder.replace("HOME", "/home/u")
    assert commands.compilation_cache_dir() == want
