"""``sweep-grid`` as a user runs it: the installed console script, real files."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
import xarray as xr
from test_roofline import SEED_TABLE

import sweep

SEED_ARGS = [
    "hardware=h100_sxm", "model=qwen3_8b", "workload=seed_chat",
    "grid.concurrency=[1,8,32,64,128,256]", "grid.context_tokens=[1500]",
]


def run(args, cwd):
    exe = shutil.which("sweep-grid")
    assert exe, "sweep-grid is not installed (pip install -e .)"
    return subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


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
                tensor_parallel=1, context_tokens=1500, batching="continuous").isel(
        token_budget=0, long_prompt_tokens=0, traffic_tokens_per_day=0)
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
        "traffic_tokens_per_day"]
    for name in ("step_s", "user_tokens_per_s", "output_tokens_per_s",
                 "slot_utilization", "cost_per_mtok_out_usd", "prefill_tokens_per_s",
                 "cost_per_mtok_in_usd", "kv_fits", "max_concurrency_fit",
                 "long_prefill_s", "long_prefill_steps", "long_prefill_worst_itl_s",
                 "effective_cost_per_mtok_out_usd", "replicas"):
        assert "units" in ds[name].attrs and "long_name" in ds[name].attrs, name
    for key in ("sweep_version", "config_yaml", "created_utc", "seed"):
        assert key in ds.attrs
    assert "qwen3_8b" in ds.attrs["config_yaml"]
    plain = xr.open_zarr(cwd / "seed.zarr")
    xr.testing.assert_identical(plain.load(), ds.load())


def test_default_run_writes_under_outputs(tmp_path):
    proc = run(["grid=small"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    cubes = list((tmp_path / "outputs").glob("*/*/cube.zarr"))
    assert len(cubes) == 1
    ds = sweep.open_cube(cubes[0])
    # every shipped hardware x model when the command line names neither
    assert ds.sizes["hardware"] == 6 and ds.sizes["model"] == 7
    assert "cheapest point that fits" in proc.stdout


@pytest.mark.parametrize("args, pattern", [
    (["hardware=nope"], r"hardware=nope: unknown option; allowed: a100_80gb_sxm"),
    (["hardware.memory_bandwidth_bytes_per_s=-1"],
     r"memory_bandwidth_bytes_per_s = -1.0: must be a finite number in "
     r"\[1e\+06, 1e\+15\]"),
    (["grid.concurrency=[0,8]"],
     r"grid.concurrency = 0.0: every value must be in \[1, 16777216\]"),
    (["grid.concurrency=[]"], r"grid.concurrency = \[\]: must list at least one"),
    (["hardware.mbu=fast"], r"hardware.mbu"),
    (["hardware=l40s", "model=llama3_1_70b", "grid.tensor_parallel=[1]"],
     r"model\[llama3_1_70b\]: .* more than any grid.tensor_parallel x hardware"),
    (["grid.hardware=[h100_sxm,nope]"], r"grid.hardware entry hardware=nope"),
])
def test_bad_input_gets_one_line_and_exit_2(tmp_path, args, pattern):
    proc = run([*args, "out=cube.zarr"], tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert __import__("re").search(pattern, lines[0]), lines[0]
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


def test_grid_lists_several_hardware_in_one_run(tmp_path):
    proc = run(["grid=small", "grid.hardware=[h100_sxm,h200_sxm]", "model=qwen3_8b",
                "out=two.zarr"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    ds = sweep.open_cube(tmp_path / "two.zarr")
    assert list(ds.hardware.values) == ["h100_sxm", "h200_sxm"]
    step = ds.step_s.sel(batching="continuous", concurrency=8, tensor_parallel=1)
    # H200's 4.8 TB/s beats H100's 3.35 TB/s on a memory-bound decode
    assert float(step.sel(hardware="h200_sxm").min()) < float(
        step.sel(hardware="h100_sxm").min())
    assert np.isfinite(step.values).all()


def test_user_configs_through_hydra_searchpath(tmp_path):
    folder = tmp_path / "my_conf" / "hardware"
    folder.mkdir(parents=True)
    (folder / "my_gpu.yaml").write_text(
        "defaults:\n  - base_hardware\n  - _self_\nname: my_gpu\n"
        "memory_bandwidth_bytes_per_s: 6.7e+12\npeak_flops_per_s: 1.978e+15\n"
        "memory_bytes: 8.0e+10\ninterconnect_bytes_per_s: 4.5e+11\n"
        "usd_per_gpu_hour: 4.29\n")
    searchpath = f"hydra.searchpath=[file://{tmp_path / 'my_conf'}]"
    proc = run([searchpath, "hardware=my_gpu", "model=qwen3_8b", "grid=small",
                "out=mine.zarr"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    ds = sweep.open_cube(tmp_path / "mine.zarr")
    assert list(ds.hardware.values) == ["my_gpu"]
    # twice the H100's bandwidth: a memory-bound decode step takes half the time
    one = ds.step_s.sel(batching="continuous", concurrency=1, tensor_parallel=1)
    np.testing.assert_allclose(float(one.isel(token_budget=0).squeeze()),
                               (16.38e9 + 1500 * 147_456) / 6.7e12, rtol=1e-5)
