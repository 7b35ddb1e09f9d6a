"""Fuzzing ``sweep-grid``'s numeric fields and axes: each draw runs or is refused
with one line and exit code 2, never a traceback, never a partial output.

Most draws go through the preflight in-process (``sweep.cli.grid.check``,
the function the console script calls before compiling anything); a few go
through the installed console script end to end.
"""

from __future__ import annotations

import subprocess

import pytest
from helpers import script
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import sweep
from sweep.cli.grid import check as grid_check
from sweep.config.schema import ConfigError
from sweep.cube import contract

TINY = ["hardware=h100_sxm", "model=qwen3_8b", "workload=seed_chat",
        "grid.tensor_parallel=[1]", "grid.concurrency=[8]", "grid.token_budget=[512]",
        "grid.context_tokens=[1500]", "grid.batching=[continuous]",
        "grid.long_prompt_tokens=[8192]", "grid.traffic_tokens_per_day=[1e8]"]

SCALARS = [f"hardware.{f}" for f in (
    "memory_bandwidth_bytes_per_s", "peak_flops_per_s", "memory_bytes",
    "interconnect_bytes_per_s", "usd_per_gpu_hour", "mbu", "mfu", "step_overhead_s",
    "max_gpus_per_node", "fp8_flops_per_s", "fp4_flops_per_s")] + [
    f"model.{f}" for f in (
        "params", "active_params", "layers", "q_heads", "kv_heads", "head_dim",
        "hidden_size", "num_experts", "experts_per_token", "max_context_tokens")] + [
    "workload.arrival_rate_per_s", "workload.prompt.mean_tokens",
    "workload.prompt.sigma", "workload.prompt.max_tokens",
    "workload.output.max_tokens", "grid.gpu_memory_utilization", "grid.chunk_points",
    "slo.ttft_p99_s", "slo.itl_p99_s", "latency.num_requests",
    "latency.chunk_configs", "seed", "max_memory_gb"]
LISTS = [f"grid.{a}" for a in (
    "tensor_parallel", "concurrency", "token_budget", "context_tokens",
    "long_prompt_tokens", "traffic_tokens_per_day", "arrival_rate_per_s")] + [
    "workload.output.values", "workload.output.probs", "workload.prompt.values",
    "workload.prompt.probs"]

# edges of every range the schema states, and what lies just past them
EDGES = [0, 1, -1, 2, 3, 7, 8, 16, 64, 1024, 1e-300, 1e-12, 1e-9, 1e-3, 0.5, 0.999,
         1.5, 1e6, 1e9, 1e12, 1e14, 1e15, 1e18, 1e30, 1e300, 2**24, 2**24 + 1, 2**31,
         2**63]
WORDS = ["inf", "-inf", "nan", "null", "abc", "''", "[]", "{}", "true"]

number = st.one_of(st.sampled_from(EDGES), st.integers(-10**6, 10**6),
                   st.floats(allow_nan=True, allow_infinity=True, width=32))


def text(v) -> str:
    return v if isinstance(v, str) else repr(v)


scalar_value = st.one_of(number.map(text), st.sampled_from(WORDS))
list_value = st.one_of(
    st.lists(number.map(text), min_size=0, max_size=3).map(
        lambda xs: "[" + ",".join(xs) + "]"),
    scalar_value)
override = st.one_of(
    st.tuples(st.sampled_from(SCALARS), scalar_value),
    st.tuples(st.sampled_from(LISTS), list_value),
    st.tuples(st.just("latency"), st.sampled_from(["none", "surrogate", "simulate"])),
).map(lambda kv: f"{kv[0]}={kv[1]}")
overrides = st.lists(override, min_size=1, max_size=3,
                     unique_by=lambda o: o.split("=")[0])


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(drawn=overrides)
def test_preflight_runs_or_refuses_with_one_line(hydra_ctx, drawn):
    try:
        grid_check("grid", [*TINY, *drawn])
    except ConfigError as e:
        msg = str(e)
        assert msg and "\n" not in msg and len(msg) < 1000, msg
        # any other exception fails the test: a traceback for the user


@settings(max_examples=3, deadline=None, derandomize=True)
@given(drawn=overrides)
@example(drawn=["hardware.mbu=0.5", "grid.concurrency=[8,64]"])  # one that runs
@pytest.mark.slow
def test_console_runs_or_refuses_with_one_line(tmp_path_factory, drawn):
    cwd = tmp_path_factory.mktemp("fuzz")
    proc = subprocess.run([script("sweep-grid"), *TINY, *drawn, "out=c.zarr"],
                          cwd=cwd, capture_output=True, text=True, timeout=600)
    assert "Traceback" not in proc.stderr, proc.stderr
    if proc.returncode == 2:
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("sweep-grid: error: "), lines
        assert list(cwd.iterdir()) == [], "a refused run leaves nothing"
        return
    assert proc.returncode == 0, proc.stderr
    ds = sweep.open_cube(cwd / "c.zarr")
    roofline = contract.names(contract.metrics(contract.ROOFLINE))
    assert set(roofline) <= set(ds.data_vars)
    leftovers = [p.name for p in cwd.iterdir() if p.name not in ("c.zarr", "outputs")]
    assert leftovers == [], leftovers
