"""The cube contract (``sweep.cube.contract``): SPEC.md's names, units pint parses,
axes by name end to end, and the attributes of the cubes users build."""

from __future__ import annotations

import inspect
import math
import re
import subprocess
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml
from helpers import hydra_context

import sweep
from sweep.config.resolve import grid_options
from sweep.cube import contract
from sweep.grid import job as grid
from sweep.grid.evaluate import Named, iterate_blocks
from sweep.model import batching as policies
from sweep.model import precision
from sweep.model.params import GridPoint
from sweep.model.point import evaluate_point

REPO = Path(__file__).resolve().parents[1]

# SPEC.md, "The cube (xarray) contract": the dimensions in order, the core
# variables (written out here, not taken from the code under test)
SPEC_DIMS = ("hardware", "model", "workload", "tensor_parallel", "concurrency",
             "token_budget", "context_tokens", "batching", "long_prompt_tokens",
             "traffic_tokens_per_day", "arrival_rate_per_s")
# the axes the project adds (precision; speculative decoding; prefix
# caching; disaggregated prefill/decode), before the p99-only rate
OWN_DIMS = ("weight_dtype", "kv_dtype", "spec_tokens", "spec_acceptance",
            "spec_proposer", "prefix_caching", "disaggregated", "prefill_instances",
            "decode_instances", "prefill_tensor_parallel")
SPEC_VARIABLES = (
    "step_s", "user_tokens_per_s", "output_tokens_per_s", "slot_utilization",
    "cost_per_mtok_out_usd", "prefill_tokens_per_s", "cost_per_mtok_in_usd",
    "kv_fits", "max_concurrency_fit", "long_prefill_s", "long_prefill_steps",
    "long_prefill_worst_itl_s", "effective_cost_per_mtok_out_usd", "replicas",
    "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "e2e_p99_s",
    "goodput_req_per_s", "slo_met")
# p99 latency depends on neither the context, the long prompt nor the traffic
P99_DIMS = ("hardware", "model", "workload", "tensor_parallel", "concurrency",
            "token_budget", "batching", "weight_dtype", "kv_dtype", "spec_tokens",
            "spec_acceptance", "spec_proposer", "prefix_caching", "disaggregated",
            "prefill_instances", "decode_instances", "prefill_tensor_parallel",
            "arrival_rate_per_s")

# unit words a reader's pint knows without ``UNIT_DEFINITIONS``
SI_WORDS = {"s", "hour", "day", "byte"}


def test_axes_and_variables_are_spec_names():
    assert contract.names(contract.AXES) == (*SPEC_DIMS[:-1], *OWN_DIMS,
                                             SPEC_DIMS[-1])
    assert set(SPEC_VARIABLES) <= set(contract.METRIC)
    assert contract.dims(contract.P99) == P99_DIMS
    assert contract.dims(contract.ROOFLINE) == (*SPEC_DIMS[:-1], *OWN_DIMS)
    every = [*contract.names(contract.AXES + contract.OPTIMIZE_AXES),
             *contract.names(contract.METRICS)]
    assert len(every) == len(set(every)), "a name declared twice"


def test_grid_point_fields_are_the_settings_axes_in_cube_order():
    """Tests and benchmarks build ``GridPoint`` from ``Part.axes`` by position."""
    settings = [d for d in contract.dims(contract.ROOFLINE)
                if d not in ("hardware", "model", "workload")]
    assert list(GridPoint._fields) == settings


def _words(units: str) -> set[str]:
    return set(re.findall(r"[A-Za-z_]+", units))


def test_unit_strings_use_si_and_declared_units_only():
    """Without pint: every word of every ``units`` is an SI unit or one that
    ``UNIT_DEFINITIONS`` defines (``Mtoken``: the mega prefix on ``token``)."""
    defined = {line.split("=")[0].strip() for line in contract.UNIT_DEFINITIONS}
    allowed = SI_WORDS | defined | {"Mtoken"}
    for item in contract.AXES + contract.METRICS:
        assert _words(item.units) <= allowed, (item.name, item.units)
        assert not re.search(r"[A-Za-z]s\b", item.units), (item.name, "plural")


def test_every_unit_parses_with_pint_as_the_quantity_it_is():
    pytest.importorskip("pint")
    ureg = contract.unit_registry()
    for item in contract.AXES + contract.OPTIMIZE_AXES + contract.METRICS:
        if item.units:
            ureg.parse_units(item.units)  # raises on a unit pint cannot read

    def q(name):
        item = contract.AXIS[name] if name in contract.AXIS else contract.METRIC[name]
        return ureg.Quantity(1.0, item.units)

    assert q("step_s").check("[time]")
    # USD per 1M tokens: 1e-6 USD per token
    assert q("cost_per_mtok_out_usd").to("USD / token").magnitude == pytest.approx(
        1e-6)
    # a GPU-hour's price x GPUs x hours is money; a month is 730 h (SPEC)
    money = q("usd_per_gpu_hour") * q("tensor_parallel") * ureg.Quantity(1, "hour")
    assert money.to("USD").magnitude == pytest.approx(1.0)
    assert (q("cost_per_month_usd") * ureg.Quantity(730, "hour")).to(
        "USD").magnitude == pytest.approx(1.0)
    # Little's law: running sequences / arrival rate is a time
    assert (q("concurrency") / q("arrival_rate_per_s")).check("[time]")
    assert (q("traffic_tokens_per_day") / q("output_tokens_per_s")).to(
        "dimensionless").magnitude == pytest.approx(1 / 86400)
    assert (q("kv_bytes_per_token") * q("context_tokens")).to("byte").magnitude == 1
    # a running sequence is a request (Little's law above needs it)
    assert ureg.Quantity(1, "sequence").to("request").magnitude == 1


def test_named_passes_arguments_by_name_and_refuses_a_wrong_count():
    def point(*, concurrency, token_budget):
        return concurrency - token_budget

    named = Named(point, ("token_budget", "concurrency"))
    assert named(256, 8) == 8 - 256
    with pytest.raises(ValueError):
        named(256)
    assert named == Named(point, ("token_budget", "concurrency"))  # one jit entry


@pytest.fixture(scope="module")
def square_job():
    """Concurrency and token budget of the same length (2 x 2), two long
    prompts, prefix caching off and on."""
    with hydra_context():
        app, options = grid_options("grid", [
            "grid=small", "hardware=h100_sxm", "model=qwen3_8b",
            "grid.tensor_parallel=[1,2]", "grid.concurrency=[8,64]",
            "grid.token_budget=[256,2048]", "grid.context_tokens=[1500]",
            "grid.long_prompt_tokens=[2048,8192]",
            "grid.batching=[static,continuous]", "latency=surrogate",
            "workload=seed_chat", "workload.prefix_hit_fraction=0.5",
            "grid.prefix_caching=[false,true]", "calibration=roofline"])
    job = grid.prepare(app, options)
    part = job.parts[0]
    cube = {}
    for _, region, values in iterate_blocks(part.fn, part.axes, part.plan,
                                            part.tables, part.table_dims):
        for k, v in values.items():
            cube.setdefault(k, np.zeros(part.plan.shape, v.dtype))[region] = v
    return job, cube


def test_point_functions_take_every_input_by_name(square_job):
    from sweep.latency.p99 import SimulatePoint

    job, _ = square_job
    assert [p.name for p in job.parts] == [contract.ROOFLINE, contract.P99]
    for part in job.parts:
        assert set(part.inputs) == set(part.dims)
        assert part.fn.names == (*part.dims, *part.lookups)
        params = inspect.signature(part.point).parameters
        named = {n for n, p in params.items() if p.kind == p.KEYWORD_ONLY}
        if any(p.kind == p.VAR_KEYWORD for p in params.values()):
            named |= set(GridPoint._fields)  # grid_point's serving settings
        assert named == set(part.fn.names), part.name
    params = inspect.signature(SimulatePoint.__call__).parameters
    assert [n for n, p in params.items() if p.kind == p.KEYWORD_ONLY] == [
        *P99_DIMS, "requests", "prefix_hit", "prefix_cache", "pool_cache", "slo"]


def test_cube_values_sit_at_their_coordinates(square_job):
    """The value at ``concurrency=c, token_budget=b`` is the model's at ``c``
    and ``b``, found by coordinate name alone: two axes of equal length cannot
    be swapped without this failing."""
    job, cube = square_job
    dims = contract.dims(contract.ROOFLINE)
    part = job.parts[0]
    take = lambda tree, i: jax.tree.map(lambda x: x[i], tree)  # noqa: E731
    for flat in range(0, math.prod(part.plan.shape), 5):
        idx = dict(zip(dims, np.unravel_index(flat, part.plan.shape)))
        at = {d: job.coords[d][i] for d, i in idx.items()}
        labels = {"batching": policies.index,
                  "weight_dtype": precision.WEIGHT_DTYPES.index,
                  "kv_dtype": precision.KV_DTYPES.index}
        pt = GridPoint(**{
            d: np.int32(labels[d](str(at[d]))) if d in labels
            else np.float32(at[d]) for d in GridPoint._fields})
        util, _ = part.lookups["static_utilization"]
        one = evaluate_point(take(part.inputs["hardware"], idx["hardware"]),
                             take(part.inputs["model"], idx["model"]),
                             take(part.inputs["workload"], idx["workload"]), pt,
                             util[idx["workload"], idx["concurrency"]])
        for k in ("step_s", "long_prefill_s", "max_concurrency_fit"):
            np.testing.assert_allclose(cube[k][tuple(idx.values())], one[k],
                                       rtol=2e-6, equal_nan=True, err_msg=k)


def test_an_axis_changes_only_the_metrics_it_declares(square_job):
    job, cube = square_job
    dims = contract.dims(contract.ROOFLINE)
    for axis in contract.AXES:
        if not axis.affects or axis.name not in dims:
            continue
        d = dims.index(axis.name)
        assert cube["step_s"].shape[d] > 1
        for name, values in cube.items():
            first = np.take(values, [0], axis=d)
            same = np.array_equal(np.broadcast_to(first, values.shape), values,
                                  equal_nan=values.dtype.kind == "f")
            assert same == (name not in axis.affects), (axis.name, name)


def test_user_cube_carries_the_contract(surrogate_run):
    ds = sweep.open_cube(surrogate_run.path)
    assert ds.attrs["Conventions"] == contract.CONVENTIONS
    for name, var in ds.data_vars.items():
        m = contract.METRIC[name]
        assert var.dtype == np.dtype(m.dtype), name
        assert m.attrs().items() <= var.attrs.items(), name
    for d in ds.dims:
        assert ds[d].attrs == contract.AXIS[d].attrs(), d
        if contract.AXIS[d].kind != contract.LABEL:
            assert ds[d].attrs["units"], d
    assert ds.e2e_p50_s.attrs["method"] == "surrogate"
    finite = np.isfinite(ds.e2e_p99_s.values)
    assert finite.any()
    assert (ds.e2e_p50_s.values[finite] <= ds.e2e_p99_s.values[finite]).all()
    # what a reader does: a pint registry from the cube's own definitions
    pint = pytest.importorskip("pint")
    ureg = pint.UnitRegistry()
    for line in ds.attrs["unit_definitions"].splitlines():
        ureg.define(line)
    for name in ds.variables:
        if ds[name].attrs.get("units"):
            ureg.parse_units(ds[name].attrs["units"])


def test_user_cube_records_every_swept_spec_and_the_commit(surrogate_run):
    ds = sweep.open_cube(surrogate_run.path)
    hardware = yaml.safe_load(ds.attrs["hardware_specs"])
    assert list(hardware) == list(ds.hardware.values) == ["h100_sxm", "l40s"]
    for name, spec in hardware.items():
        shipped = yaml.safe_load((REPO / "conf" / "hardware" / f"{name}.yaml")
                                 .read_text())
        for key in ("memory_bandwidth_bytes_per_s", "peak_flops_per_s",
                    "memory_bytes", "usd_per_gpu_hour"):
            assert spec[key] == pytest.approx(float(shipped[key])), (name, key)
    model = yaml.safe_load(ds.attrs["model_specs"])
    assert list(model) == ["qwen3_8b"] and model["qwen3_8b"]["layers"] == 36
    workload = yaml.safe_load(ds.attrs["workload_specs"])
    assert workload["seed_chat"]["arrival_rate_per_s"] == 3.0  # the override
    if (REPO / ".git").exists():
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"],
                              capture_output=True, text=True, check=True)
        assert ds.attrs["git_sha"].removesuffix("-dirty") == head.stdout.strip()
