"""Bad input refused with one line before any work; the plan line; progress lines;
long axes parsed quickly.

Refusals are checked in-process through the preflight the console scripts
run (``sweep.cli.grid.check``, ``sweep.cli.optimize.check``) and, for the
issue's own examples, through the installed scripts.
"""

from __future__ import annotations

import os
import re
from functools import partial

import numpy as np
import pytest
import yaml
from helpers import OPTIMIZE_QUICK, compose_app, grid_inputs, run_script

import sweep
from sweep.cli.grid import check as grid_check
from sweep.cli.optimize import check as optimize_check
from sweep.config.resolve import grid_options, restore, stash_lists
from sweep.config.schema import ConfigError
from sweep.grid import plan

TINY = ["hardware=h100_sxm", "model=qwen3_8b", "workload=seed_chat",
        "grid.tensor_parallel=[1]", "grid.concurrency=[8]", "grid.token_budget=[512]",
        "grid.context_tokens=[1500]", "grid.batching=[continuous]",
        "grid.traffic_tokens_per_day=[1e8]"]


def refused(check, app: str, overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as e:
        check(app, overrides)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize("args, pattern", [
    # vLLM: q_heads % tp == 0, and kv_heads % tp == 0 or tp % kv_heads == 0
    (["grid.tensor_parallel=[3]"], r"^grid.tensor_parallel = 3: model\[qwen3_8b\] "
     r"has 32 query and 8 KV heads, .*allowed: 1, 2, 4, 8$"),
    (["grid.tensor_parallel=[1000000]"], r"^grid.tensor_parallel = 1000000: more "
     r"than hardware\[h100_sxm\].max_gpus_per_node = 8 .*allowed: <= 8$"),
    # 16 GPUs split 32 query heads and replicate 8 KV heads: allowed; 64 do not
    (["grid.tensor_parallel=[16,64]", "hardware.max_gpus_per_node=64"],
     r"= 64: model\[qwen3_8b\] has 32 query and 8 KV heads.*allowed: 1, 2, 4, 8, "
     r"16, 32$"),
    (["hardware.max_gpus_per_node=0"],
     r"hardware\[h100_sxm\].max_gpus_per_node = 0: must be a finite number in "
     r"\[1, 1024\]"),
    (["model.kv_heads=5"], r"model\[qwen3_8b\].kv_heads = 5: must divide q_heads"),
    (["hardware.memory_bytes=1e300"], r"memory_bytes = 1e\+300: .* \[1e\+06, 1e\+14\]"),
    (["hardware.mbu=1e-300"], r"hardware\[h100_sxm\].mbu = 1e-300"),
    (["hardware.mbu=fast"], r"hardware.mbu"),
    (["hardware.memory_bandwidth_bytes_per_s=-1"],
     r"memory_bandwidth_bytes_per_s = -1.0: must be a finite number in "
     r"\[1e\+06, 1e\+15\]"),
    (["hardware=nope"], r"^hardware=nope: unknown option; allowed: a100_80gb_sxm, "
     r"b200, h100_sxm, h200_sxm, l40s, mi300x$"),
    (["grid.hardware=[h100_sxm,nope]"], r"^grid.hardware entry hardware=nope"),
    (["grid.concurrency=[0,8]"],
     r"grid.concurrency = 0.0: every value must be in \[1, 16777216\]"),
    (["grid.concurrency=[]"], r"grid.concurrency = \[\]: must list at least one"),
    (["grid.concurrency=[8,8]"], r"^grid.concurrency: 8 appears more than once"),
    (["grid.concurrency=${range:1,8,0}"], r"num must be an integer in \[1, "),
    (["grid.concurrency=[1e9]"], r"grid.concurrency = 1000000000.0: every value "
     r"must be in \[1, 16777216\]"),
    (["grid.chunk_points=0"], r"grid.chunk_points = 0"),
    (["workload.output.values=[1e12,10]", "workload.output.probs=[1,1]"],
     r"workload\[seed_chat\].output.values = .*every length must be in \[1, "),
    (["slo.ttft_p99_s=0"], r"slo\[interactive\].ttft_p99_s = 0"),
    (["seed=-1"], r"^seed = -1: must be a finite number in \[0, "),
    (["max_memory_gb=-1"], r"^max_memory_gb = -1"),
    (["latency=simulate", "latency.num_requests=10000000"],
     r"^latency.num_requests = 10000000 with latency.chunk_configs = 256 and 8 "
     r"slots \(the largest grid.concurrency\): the run "
     r"needs an estimated [\d.]+ GB of memory, above the budget of 1 GB "
     r"\(max_memory_gb=1\); allowed: a smaller setting, or max_memory_gb=\d+ to "
     r"run anyway$"),
])
def test_grid_preflight_refuses(hydra_ctx, args, pattern):
    overrides = [*TINY, *args]
    if any("num_requests" in a for a in args):
        overrides.append("max_memory_gb=1")
    msg = refused(grid_check, "grid", overrides)
    assert re.search(pattern, msg), msg


def test_memory_budget_names_the_override_that_permits(hydra_ctx):
    base = [*TINY, "latency=simulate", "latency.num_requests=10000000"]
    msg = refused(grid_check, "grid", [*base, "max_memory_gb=1"])
    need = int(re.search(r"max_memory_gb=(\d+) to run anyway", msg)[1])
    # one block of 1 configuration x 1e7 requests x 8 slots, one stream of 1e7
    expect = (plan.BASE_BYTES + plan.SIM_FIXED_BYTES
              + 1e7 * plan.SIM_BYTES_PER_CONFIG_REQUEST
              + 8 * plan.SIM_BYTES_PER_CONFIG_SLOT + plan.SIM_BYTES_PER_CONFIG
              + 1e7 * plan.STREAM_BYTES_PER_REQUEST)
    assert need == np.ceil(expect / 1e9 * 1.1)
    grid_check("grid", [*base, f"max_memory_gb={need}"])  # passes now


def test_default_budget_is_the_machines(hydra_ctx):
    # the example: 1e7 requests on the default grid of one GPU x model
    # (924 configurations, blocks of 256): 256 x 1e7 x 20 B is over 51 GB
    args = ["hardware=h100_sxm", "model=qwen3_8b", "latency=simulate",
            "latency.num_requests=10000000"]
    if plan.BUDGET_SHARE * plan.machine_memory_bytes() > 51e9:
        pytest.skip("this machine has the memory for it")
    msg = refused(grid_check, "grid", args)
    assert re.search(r"above the budget of [\d.]+ GB \(80% of this machine's "
                     r"[\d.]+ GB; set max_memory_gb to change it\); allowed: a "
                     r"smaller setting, or max_memory_gb=\d+ to run anyway$", msg), msg


def test_optimize_preflight_refuses(hydra_ctx):
    msg = refused(optimize_check, "optimize", ["hardware=h100_sxm",
                                               "search.tensor_parallel=[1,3]"])
    assert msg.startswith("search.tensor_parallel = 3: model[qwen3_8b] has 32 query")
    msg = refused(optimize_check, "optimize", ["hardware=h100_sxm",
                                               "search.verify_requests=16000000",
                                               "search.verify_requests_max=16000000",
                                               "max_memory_gb=2"])
    assert msg.startswith("search.verify_requests = 16000000 with search.verify_top")


run = partial(run_script, "sweep-grid")


@pytest.mark.slow
@pytest.mark.parametrize("args, pattern", [
    (["grid.tensor_parallel=[3]"], r"grid.tensor_parallel = 3: model\[qwen3_8b\]"),
    (["latency=simulate", "latency.num_requests=10000000", "max_memory_gb=2",
      "grid.concurrency=[8,16,32,64]", "grid.token_budget=[512,1024,2048,4096]"],
     r"latency.num_requests = 10000000 .*: the run needs an estimated [\d.]+ GB of "
     r"memory, above the budget of 2 GB \(max_memory_gb=2\); allowed: a smaller "
     r"setting, or max_memory_gb=\d+ to run anyway"),
])
def test_console_refuses_before_any_work(tmp_path, args, pattern):
    proc = run([*TINY, *args, "grid.chunk_points=1", "out=c.zarr"], tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sweep-grid: error: "), lines
    assert re.search(pattern, lines[0]), lines[0]
    assert list(tmp_path.iterdir()) == []


def test_long_axis_is_parsed_without_hydra(hydra_ctx):
    values = list(range(1, 100_001))
    overrides = [*TINY[:3], "grid.concurrency=[" + ",".join(map(str, values)) + "]"]
    swapped = stash_lists(overrides)
    # Hydra's grammar (quadratic in a list's length) sees a placeholder only
    assert swapped[-1] == "grid.concurrency=${axis_values:grid.concurrency}"
    assert restore(swapped) == overrides
    base, _ = grid_options("grid", overrides)
    assert base.grid.axes["concurrency"] == [float(v) for v in values]


def test_numeric_axes_ascend_and_integer_axes_merge_what_rounds_alike():
    app, _ = grid_inputs([*TINY[:3], "grid.concurrency=${range:1,1024,64,log}",
                          "grid.token_budget=[2048,512,511.8]",
                          "grid.traffic_tokens_per_day=[1e9,1e7]"])
    conc = app.grid.axes["concurrency"]
    assert conc == sorted({float(round(1024 ** (i / 63))) for i in range(64)})
    assert conc[:3] == [1.0, 2.0, 3.0] and conc[-1] == 1024.0
    assert app.grid.axes["token_budget"] == [512.0, 2048.0]
    assert app.grid.axes["traffic_tokens_per_day"] == [1e7, 1e9]
    search = compose_app("optimize", ["search.tensor_parallel=[8,1,2]"]).search
    assert search.tp_values == [1.0, 2.0, 8.0]


@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    """sweep-grid with a 2,000-value axis in blocks of 500 points, progress
    lines every 0.05 s, and JAX left to probe for accelerators."""
    cwd = tmp_path_factory.mktemp("long")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["SWEEP_PROGRESS_S"] = "0.05"
    conc = list(range(1, 2001))
    args = [*TINY[:3], "grid.tensor_parallel=[1]",
            "grid.concurrency=[" + ",".join(map(str, conc)) + "]",
            *TINY[5:], "grid.chunk_points=500", "out=long.zarr"]
    proc = run(args, cwd, env)
    assert proc.returncode == 0, proc.stderr
    return cwd, proc, conc, args


@pytest.mark.slow
def test_plan_line_comes_first(long_run):
    _, proc, _, _ = long_run
    first = proc.stderr.splitlines()[0]
    assert re.fullmatch(
        r"sweep-grid: 2,000 points in 4 block\(s\); estimated [\d.]+ \w+-[\d.]+ \w+ "
        r"on a 2-core CPU \(quiet to loaded\)(?: \(this run uses the \w+\))?, peak "
        r"memory ~[\d.]+ [kMG]B \(budget [\d.]+ [kMGT]B\), disk <= [\d.]+ kB -> "
        r"long.zarr", first), first


@pytest.mark.slow
def test_progress_lines_when_stderr_is_not_a_terminal(long_run):
    _, proc, _, _ = long_run
    lines = [ln for ln in proc.stderr.splitlines()
             if re.match(r"sweep-grid: \d+/4 blocks", ln)]
    assert lines, proc.stderr
    assert lines[-1].startswith("sweep-grid: 4/4 blocks in ")


@pytest.mark.slow
def test_no_backend_probe_noise(long_run):
    _, proc, _, _ = long_run
    assert "Unable to initialize backend" not in proc.stdout + proc.stderr


@pytest.mark.slow
def test_long_axis_through_the_console(long_run):
    cwd, _, conc, args = long_run
    ds = sweep.open_cube(cwd / "long.zarr")
    assert list(ds.concurrency.values) == conc
    # the record of the run has the values, not the placeholder
    recorded = yaml.safe_load(ds.attrs["config_yaml"])["grid"]["concurrency"]
    assert recorded == conc
    assert ds.attrs["hydra_overrides"] == " ".join(args)


@pytest.mark.slow
def test_optimize_says_replicas_max_binds(optimize_run, tmp_path):
    # the session's sweep-optimize run compiled the same search (cache reused)
    proc = run_script("sweep-optimize", [*OPTIMIZE_QUICK,
                                         "workload.arrival_rate_per_s=1e9",
                                         "out=o.zarr"], tmp_path)
    assert proc.returncode == 3, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert re.match(r"sweep-optimize: infeasible at search.replicas_max = 256: each "
                    r"of 256 replicas would receive 3\.906e\+06 req/s, .*allowed: "
                    r"search.replicas_max >= [\d,]+ ", last), last
    assert "slo.ttft_p99_s >=" not in proc.stderr
    first = proc.stderr.splitlines()[0]
    assert re.match(r"sweep-optimize: seed_chat at 1e\+09 req/s; 0 candidate\(s\) "
                    r"excluded \(do not fit\); 4 candidate\(s\) x 2 restarts: ", first)
    assert "Unable to initialize backend" not in proc.stdout + proc.stderr
