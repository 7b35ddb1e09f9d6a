"""A grid sweep job: validated configs -> stacked inputs + coords -> a cube.

``prepare`` does everything that can fail on bad input (trace loading, the
cross-group checks) without compiling anything; ``run`` evaluates the blocks,
writes them, and returns the finished cube.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xarray as xr

from sweep import results
from sweep.config.schema import ConfigError, GridApp, Hardware, Model, Workload
from sweep.evaluate import DIMS, Blocking, GridInputs, blocking, iterate_blocks
from sweep.params import (
    BATCHING,
    GridPoint,
    WorkloadParams,
    hardware_params,
    model_params,
    stack,
)
from sweep.roofline import weight_bytes
from sweep.workload import workload_tables


@dataclass
class GridJob:
    """Everything a sweep needs, checked, before any compilation."""

    app: GridApp
    coords: dict[str, np.ndarray]
    inputs: GridInputs
    plan: Blocking
    extra: dict[str, xr.DataArray]

    @property
    def points(self) -> int:
        return math.prod(self.plan.shape)


def _check_fits(app: GridApp, hardware: list[Hardware], models: list[Model]) -> None:
    """A model that fits nowhere in the grid, even at concurrency 1, is an error."""
    util = app.grid.gpu_memory_utilization
    tp_max = max(app.grid.axes["tensor_parallel"])
    ctx = min(app.grid.axes["context_tokens"])
    best = max(hardware, key=lambda h: h.memory_bytes)
    for m in models:
        mp = model_params(m)
        need = (mp.shared_params + mp.expert_params) * m.weight_dtype_bytes + ctx * (
            2 * m.layers * m.kv_heads * m.head_dim * m.kv_dtype_bytes
        )
        have = best.memory_bytes * util * tp_max
        if need > have:
            raise ConfigError(
                f"model[{m.name}]: weights + KV of one {ctx:g}-token sequence need "
                f"{need / 1e9:.1f} GB, more than any grid.tensor_parallel x hardware "
                f"offers (largest {tp_max:g} x {best.name} x {util:g} = "
                f"{have / 1e9:.1f} GB); allowed: add larger tensor_parallel values "
                "or hardware with more memory"
            )


def prepare(app: GridApp, options: dict[str, list]) -> GridJob:
    """Builds stacked inputs and coordinates; raises ``ConfigError`` on bad input."""
    hardware: list[Hardware] = options["hardware"]
    models: list[Model] = options["model"]
    workloads: list[Workload] = options["workload"]
    _check_fits(app, hardware, models)
    tables = [workload_tables(w) for w in workloads]
    k = max(len(t.output_values) for t in tables)

    def padded(v, p):
        pad = k - len(v)
        return np.concatenate([v, np.full(pad, v[-1])]), np.concatenate(
            [p, np.zeros(pad)])

    wl = []
    for t in tables:
        ov, op = padded(t.output_values, t.output_probs)
        wl.append(WorkloadParams(t.mean_prompt_tokens, t.mean_output_tokens, ov, op))
    axes = app.grid.axes
    batching = [b.value for b in app.grid.batching]
    if len(set(batching)) != len(batching):
        raise ConfigError(f"grid.batching = {batching}: values must be distinct")
    point_axes = GridPoint(
        tensor_parallel=np.array(axes["tensor_parallel"]),
        concurrency=np.array(axes["concurrency"]),
        token_budget=np.array(axes["token_budget"]),
        context_tokens=np.array(axes["context_tokens"]),
        batching=np.array([BATCHING.index(b) for b in batching]),
        long_prompt_tokens=np.array(axes["long_prompt_tokens"]),
        traffic_tokens_per_day=np.array(axes["traffic_tokens_per_day"]),
    )
    import jax.numpy as jnp

    inputs = GridInputs(
        hardware=stack([hardware_params(h, app.grid.gpu_memory_utilization)
                        for h in hardware]),
        model=stack([model_params(m) for m in models]),
        workload=stack(wl),
        axes=GridPoint(*(jnp.asarray(a, jnp.int32 if n == "batching" else jnp.float32)
                         for n, a in zip(GridPoint._fields, point_axes))),
    )
    coords = {
        "hardware": np.array([h.name for h in hardware]),
        "model": np.array([m.name for m in models]),
        "workload": np.array([w.name for w in workloads]),
        **{n: np.asarray(axes[n]) for n in GridPoint._fields if n != "batching"},
        "batching": np.array(batching),
    }
    coords = {d: coords[d] for d in DIMS}
    for d in ("tensor_parallel", "concurrency", "token_budget", "context_tokens",
              "long_prompt_tokens"):
        coords[d] = coords[d].astype(np.int64)
    for d in ("hardware", "model", "workload"):
        if len(set(coords[d])) != len(coords[d]):
            raise ConfigError(f"grid.{d} = {list(coords[d])}: names must be distinct")
    shape = tuple(len(v) for v in coords.values())
    extra = {
        "usd_per_gpu_hour": xr.DataArray(
            [h.usd_per_gpu_hour for h in hardware], dims="hardware",
            attrs={"units": "USD/h", "long_name": "price per GPU-hour"}),
        "weight_bytes": xr.DataArray(
            [float(weight_bytes(model_params(m))) for m in models], dims="model",
            attrs={"units": "bytes", "long_name": "weights"}),
        "kv_bytes_per_token": xr.DataArray(
            [2.0 * m.layers * m.kv_heads * m.head_dim * m.kv_dtype_bytes
             for m in models], dims="model",
            attrs={"units": "bytes/token", "long_name": "KV cache per token"}),
        "mean_prompt_tokens": xr.DataArray(
            [t.mean_prompt_tokens for t in tables], dims="workload",
            attrs={"units": "tokens", "long_name": "mean prompt length"}),
        "mean_output_tokens": xr.DataArray(
            [t.mean_output_tokens for t in tables], dims="workload",
            attrs={"units": "tokens", "long_name": "mean output length"}),
    }
    return GridJob(app, coords, inputs, blocking(shape, app.grid.chunk_points), extra)


def fingerprint(config_yaml: str, job: GridJob) -> str:
    """Identifies a sweep for resuming: same config and blocking, same blocks."""
    text = config_yaml + repr(job.plan)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def run(job: GridJob, out: Path, attrs: dict, config_yaml: str,
        progress=None) -> xr.Dataset:
    """Evaluates and writes every missing block; returns the opened cube.

    Args:
      progress: optional callable ``(done_blocks, total_blocks)``.
    """
    fp = fingerprint(config_yaml, job)
    ds = results.template(job.coords, job.plan.chunks, attrs, job.extra)
    done = results.start_store(out, ds, fp)
    total = len(job.plan)
    if progress:
        progress(len(done), total)
    dims = tuple(job.coords)
    for b, region, values in iterate_blocks(job.inputs, job.plan, skip=set(done)):
        results.write_block(out, dims, region, values, fp, done, b)
        if progress:
            progress(len(done), total)
    results.finish_store(out)
    return results.open_cube(out)
