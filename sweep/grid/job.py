"""A grid sweep job: validated configs -> stacked inputs + coords -> a cube.

A cube is made of *parts*, each a point function evaluated over the product of
some of the cube's axes: the roofline metrics over ``point.DIMS``, and (with
``latency=simulate|surrogate``) the p99 metrics over ``p99.DIMS`` (both
``sweep.cube.contract.dims``); point functions take their inputs by axis name.
``prepare`` does everything that can fail on bad input (trace loading, the
cross-group checks) without compiling anything; ``run`` evaluates the missing
blocks of every part, writes them, and returns the finished cube.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import xarray as xr

from sweep.config.convert import hardware_params, model_params, models_params
from sweep.config.schema import (
    ConfigError,
    GridApp,
    Hardware,
    LatencyMethod,
    Model,
    check_tensor_parallel,
)
from sweep.cube import contract, outputs, results
from sweep.grid import calibration
from sweep.grid.evaluate import Part, blocking, iterate_blocks
from sweep.grid.plan import grid_plan
from sweep.grid.writer import BlockWriter
from sweep.latency import p99
from sweep.latency.arrivals import (
    recorded_arrivals,
    replay_coverage,
    replay_repeat,
)
from sweep.latency.prefix_cache import Streams, padded_curves
from sweep.latency.workload import WorkloadTables, workload_tables
from sweep.model import batching, precision
from sweep.model.cost import static_slot_utilization
from sweep.model.params import WorkloadParams, stack
from sweep.model.point import point_function
from sweep.model.roofline import weight_bytes


@dataclass
class GridJob:
    """Everything a sweep needs, checked, before any compilation."""

    app: GridApp
    coords: dict[str, np.ndarray]
    parts: list[Part]
    extra: dict[str, xr.DataArray]
    # the constants each hardware x model runs with (``sweep.grid.calibration``)
    calibration: list[list[calibration.Choice]]
    # per trace whose recorded arrivals the p99s replay only in part, a line
    # saying which part (``replay_notes``)
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def points(self) -> int:
        return math.prod(self.parts[0].plan.shape)


def _at(m: Model, name: str, value: str) -> Model:
    """``m`` at one value of a precision axis (``own``: as it is)."""
    return m if value == "own" else dataclasses.replace(m, **{name: value})


def _dtype_index(value: str, names: tuple[str, ...]) -> int:
    return precision.OWN if value == "own" else names.index(value)


def _at_dtypes(app: GridApp, m: Model) -> list[Model]:
    """``m`` at every weight x KV precision of the grid."""
    return [_at(_at(m, "weight_dtype", w), "kv_dtype", kv)
            for w in (app.grid.weight_dtype or ["own"])
            for kv in (app.grid.kv_dtype or ["own"])]


def _check_precision(app: GridApp, hardware: list[Hardware],
                     models: list[Model]) -> None:
    """Every weight precision swept runs on every hardware's tensor cores."""
    for h in hardware:
        for m in models:
            for w in app.grid.weight_dtype or [m.weight_dtype]:
                if precision.supported(h, w):
                    continue
                key = (f"grid.weight_dtype = {list(app.grid.weight_dtype)}"
                       if app.grid.weight_dtype else f"model[{m.name}].weight_dtype = "
                       f"{w}")
                raise ConfigError(
                    f"{key}: hardware[{h.name}] has no {w} tensor cores "
                    f"(hardware.{precision.rate_field(w)} = 0); allowed on "
                    f"{h.name}: {', '.join(precision.allowed(h))}")


def _check_fits(app: GridApp, hardware: list[Hardware], models: list[Model]) -> None:
    """A model that fits nowhere in the grid, even at concurrency 1 and its
    smallest precision, is an error."""
    util = app.grid.gpu_memory_utilization
    tp_max = max(app.grid.axes["tensor_parallel"])
    ctx = min(app.grid.axes["context_tokens"])
    best = max(hardware, key=lambda h: h.memory_bytes)
    for m in models:
        need = min(float(weight_bytes(model_params(v))) + ctx * 2 * v.layers
                   * v.kv_heads * v.head_dim * v.kv_dtype_bytes
                   for v in _at_dtypes(app, m))
        have = best.memory_bytes * util * tp_max
        if need > have:
            raise ConfigError(
                f"model[{m.name}]: weights + KV of one {ctx:g}-token sequence need "
                f"{need / 1e9:.1f} GB, more than any grid.tensor_parallel x hardware "
                f"offers (largest {tp_max:g} x {best.name} x {util:g} = "
                f"{have / 1e9:.1f} GB); allowed: add larger tensor_parallel values "
                "or hardware with more memory"
            )


def _check_context(app: GridApp, models: list[Model]) -> None:
    """A grid context beyond a model's ``max_context_tokens`` cannot be served."""
    for axis in ("context_tokens", "long_prompt_tokens"):
        values = app.grid.axes[axis]
        for m in models:
            if m.max_context_tokens and max(values) > m.max_context_tokens:
                raise ConfigError(
                    f"grid.{axis} = {[int(v) for v in values]}: {max(values):,.0f} "
                    f"tokens exceed model[{m.name}].max_context_tokens = "
                    f"{m.max_context_tokens:,}; allowed: values <= "
                    f"{m.max_context_tokens:,} (or leave that model out)")


def _static_utilization(tables: list[WorkloadTables], concurrency) -> np.ndarray:
    """``E[out] / E[max of B outputs]`` per workload x concurrency (a small table)."""
    batch = jnp.asarray(concurrency, jnp.float32)
    rows = []
    for t in tables:
        values = jnp.asarray(t.output_values, jnp.float32)
        probs = jnp.asarray(t.output_probs, jnp.float32)
        rows.append(jax.vmap(lambda b, v=values, p=probs: static_slot_utilization(
            v, p, b))(batch))
    return np.asarray(jnp.stack(rows))


def _padded(tables: list[WorkloadTables], streams,
            prefill_pools: list[int]) -> list[WorkloadParams]:
    """Output-length tables padded to one length (zero-probability repeats),
    and the LRU hit curves of traces with block hashes (``streams``: the rows
    the p99 part replays), with no context limit applied: one engine's, then
    a prefill pool's of each of ``prefill_pools`` instances."""
    k = max(len(t.output_values) for t in tables)
    sizes = [0, *prefill_pools]
    capacity, share = (x.reshape(len(tables), len(sizes), -1) for x in padded_curves(
        [s and s(0.0, False, p)[1] for s in streams for p in sizes]))
    out = []
    for t, c, h in zip(tables, capacity, share):
        pad = k - len(t.output_values)
        out.append(WorkloadParams(
            t.mean_prompt_tokens, t.mean_output_tokens,
            np.concatenate([t.output_values, np.full(pad, t.output_values[-1])]),
            np.concatenate([t.output_probs, np.zeros(pad)]), t.prefix_hit_fraction,
            c, h, np.asarray(sizes, np.float64)))
    return out


def check(app: GridApp, options: dict[str, list]) -> list[WorkloadTables]:
    """Every check of a sweep's input, with no JAX work; returns the length tables.

    Tensor-parallel sizes against each model's heads and each hardware's
    node, the model fitting somewhere, distinct options, the workloads'
    traces and tables, and the plan's peak memory against the budget.

    Raises:
      ConfigError: one line naming the field, its value and what is allowed.
    """
    check_tensor_parallel("grid.tensor_parallel", app.grid.axes["tensor_parallel"],
                          options["hardware"], options["model"])
    check_tensor_parallel("grid.prefill_tensor_parallel",
                          [t for t in app.grid.axes["prefill_tensor_parallel"] if t],
                          options["hardware"], options["model"])
    _check_precision(app, options["hardware"], options["model"])
    _check_context(app, options["model"])
    _check_fits(app, options["hardware"], options["model"])
    for d, names in (("hardware", [h.name for h in options["hardware"]]),
                     ("model", [m.name for m in options["model"]]),
                     ("workload", [w.name for w in options["workload"]]),
                     ("batching", [b.value for b in app.grid.batching])):
        if len(set(names)) != len(names):
            raise ConfigError(f"grid.{d} = {names}: values must be distinct")
    tables = [workload_tables(w, app.data_dir) for w in options["workload"]]
    grid_plan(app, options).check_memory()
    return tables


def prepare(app: GridApp, options: dict[str, list]) -> GridJob:
    """Builds stacked inputs and coordinates; raises ``ConfigError`` on bad input."""
    hardware: list[Hardware] = options["hardware"]
    models: list[Model] = options["model"]
    workloads = options["workload"]
    tables = check(app, options)
    # each hashed trace's LRU tables, shared by the roofline and the p99 part
    streams = [Streams(t, app.latency.num_requests) if t.pair_hashes is not None
               else None for t in tables]
    axes = app.grid.axes
    policies = [b.value for b in app.grid.batching]
    dtypes = {d: app.grid.precision(d, models) for d in ("weight_dtype", "kv_dtype")}
    labels = {"hardware": [h.name for h in hardware], "model": [m.name for m in models],
              "workload": [w.name for w in workloads], "batching": policies,
              **dtypes}
    roofline_dims = contract.dims(contract.ROOFLINE)
    coords = {}
    for d in roofline_dims:
        kind = contract.AXIS[d].kind
        coords[d] = np.array(labels[d]) if kind == contract.LABEL else (
            np.asarray(axes[d]).astype(np.int64) if kind == contract.INTEGER
            else np.asarray(axes[d]))
    # what the point functions receive along each axis, by name
    inputs = {
        "hardware": stack([hardware_params(h, app.grid.gpu_memory_utilization)
                           for h in hardware]),
        "model": models_params(models),
        "workload": stack(_padded(tables, streams, app.grid.prefill_pools)),
        "batching": np.array([batching.index(b) for b in policies], np.int32),
        "weight_dtype": np.array([_dtype_index(v, precision.WEIGHT_DTYPES)
                                  for v in dtypes["weight_dtype"]], np.int32),
        "kv_dtype": np.array([_dtype_index(v, precision.KV_DTYPES)
                              for v in dtypes["kv_dtype"]], np.int32),
        **{d: np.asarray(axes[d], np.float32) for d in roofline_dims
           if d not in labels},
    }
    util = _static_utilization(tables, axes["concurrency"])
    shape = tuple(len(coords[d]) for d in roofline_dims)
    parts = [Part(contract.ROOFLINE,
                  point_function(app.grid.optional_variables),
                  {d: inputs[d] for d in roofline_dims},
                  blocking(shape, app.grid.chunk_points),
                  lookups={"static_utilization": (util, ("workload", "concurrency"))},
                  options=app.grid.optional_variables)]
    if app.latency.method != LatencyMethod.none:
        part, rate_coord = p99.part(app, workloads, tables, streams, models, inputs,
                                    coords)
        coords["arrival_rate_per_s"] = rate_coord
        parts.append(part)
    choices = calibration.choose(app.calibration, hardware, models)
    calibration.attach(parts, choices)
    per_value = {
        "usd_per_gpu_hour": [h.usd_per_gpu_hour for h in hardware],
        "memory_bytes": [h.memory_bytes for h in hardware],
        "weight_bytes": [[float(weight_bytes(model_params(_at(m, "weight_dtype", w))))
                          for w in dtypes["weight_dtype"]] for m in models],
        "kv_bytes_per_token": [[2.0 * m.layers * m.kv_heads * m.head_dim
                                * _at(m, "kv_dtype", kv).kv_dtype_bytes
                                for kv in dtypes["kv_dtype"]] for m in models],
        "mean_prompt_tokens": [t.mean_prompt_tokens for t in tables],
        "mean_output_tokens": [t.mean_output_tokens for t in tables],
    }
    extra = {}
    for name, values in per_value.items():
        m = contract.METRIC[name]
        extra[name] = xr.DataArray(np.asarray(values, m.dtype), dims=m.over,
                                   attrs=m.attrs())
    return GridJob(app, coords, parts, extra, choices,
                   replay_notes(app, workloads, tables))


def replay_notes(app: GridApp, workloads: list, tables: list[WorkloadTables]
                 ) -> list[str]:
    """A line per workload whose p99s replay only part of its trace's recorded
    arrivals (``arrivals.replay_coverage``: both backends read the first
    ``latency.num_requests``), naming the setting that replays all of it, or
    end inside a repeat of it (``arrivals.replay_repeat``), at a pace of its
    own."""
    if app.latency.method == LatencyMethod.none:
        return []
    n = app.latency.num_requests
    notes = []
    for w, t in zip(workloads, tables):
        part, repeat = replay_coverage(w, t, n), replay_repeat(w, t, n)
        if part is None and repeat is None:
            continue
        rows = len(recorded_arrivals(w, t))
        if part is not None:
            notes.append(f"workload {w.name}: the p99s replay {part}, and its bursts "
                         f"outside them are not in them; latency.num_requests={rows} "
                         "replays all of it")
        else:
            notes.append(f"workload {w.name}: the p99s replay {repeat}; a "
                         f"latency.num_requests that is a multiple of {rows} "
                         "replays it at the target rate")
    return notes


def config_digest(config_yaml: str) -> str:
    """Identifies a config alone: how a rerun without ``out=`` finds its cube."""
    return hashlib.sha256(config_yaml.encode()).hexdigest()[:16]


def fingerprint(config_yaml: str, job: GridJob) -> str:
    """Identifies a sweep for resuming: same config, coordinates and blocking,
    same blocks. (The config's text alone does not fix the coordinates: the
    numeric axes are sorted, a search path's options may change.)"""
    h = hashlib.sha256((config_yaml + repr([(p.name, p.plan) for p in job.parts]))
                       .encode())
    for name, values in job.coords.items():
        h.update(f"{name}:{values.dtype}:".encode())
        h.update(np.ascontiguousarray(values).tobytes())
    return h.hexdigest()[:16]


def shard_blocks(job: GridJob, shard: tuple[int, int] | None) -> set[str]:
    """The blocks (``results.block_key``) shard ``(k, n)`` evaluates: every
    ``n``-th of the job's blocks from the ``k``-th (1-based), over its parts in
    order; every block when ``shard`` is None."""
    keys = [results.block_key(p.name, b) for p in job.parts for b in range(len(p.plan))]
    if shard is None:
        return set(keys)
    k, n = shard
    return set(keys[k - 1::n])


def run(job: GridJob, out, attrs: dict, config_yaml: str,
        progress=None, shard: tuple[int, int] | None = None,
        devices=None, observe=None) -> xr.Dataset | None:
    """Evaluates and writes every missing block; returns the opened cube.

    Args:
      out: the cube's path; an existing cube there is replaced at the end.
      progress: optional callable ``(done_blocks, total_blocks)`` (of this
        shard's blocks, with ``shard``), called as each block is written,
        from the thread that writes them (``sweep.grid.writer``); an error
        it raises stops the sweep there.
      observe: optional callable ``(part, block, region, values)``, called
        in this thread with each block this process evaluates, before it is
        handed to the writer, e.g. to reduce it while it is in memory.
      shard: ``(k, n)``: evaluate only the ``k``-th of ``n`` disjoint block
        sets (``shard_blocks``) into the store that the ``n`` shards of the
        sweep share; ``config_yaml`` must be the same for all of them.

    Returns:
      The cube, or None when a shard ends with blocks of other shards
      missing (the last shard to finish, or a rerun without ``shard``,
      installs the cube).

    Raises:
      OutputError: ``out`` is not the tool's to write, or a writer of
        anything but this sweep's shards is writing it; raised before any
        evaluation.
    """
    out = Path(out)
    outputs.check_target(out, str(out))
    fp = fingerprint(config_yaml, job)
    total = sum(len(p.plan) for p in job.parts)
    mine = shard_blocks(job, shard)
    with outputs.lock(out, fp, shared=shard is not None):
        ds = results.template(job.coords, job.parts, attrs, job.extra)
        with outputs.serial(out):
            state = results.start_store(out, ds, fp, config_digest(config_yaml), total)
        done = state.done()
        written = len(mine & done)
        if progress:
            progress(written, len(mine))

        def write(part: Part, b: int, region: tuple[slice, ...], values: dict) -> None:
            nonlocal written
            key = results.block_key(part.name, b)
            try:
                results.write_block(out, part.dims, region, values, key)
            except OSError as e:  # a full disk, a lost mount: one line
                raise outputs.OutputError(
                    f"{results.partial_path(out)}: writing block {key} failed: "
                    f"{e.strerror or e}; rerun to resume from the blocks "
                    "written") from e
            written += 1
            if progress:
                progress(written, len(mine))

        # each block is written while the next one evaluates
        with BlockWriter(write) as writer:
            for part in job.parts:
                skip = {b for b in range(len(part.plan))
                        if results.block_key(part.name, b) in done
                        or results.block_key(part.name, b) not in mine}
                for b, region, values in iterate_blocks(
                        part.fn, part.axes, part.plan, part.tables, part.table_dims,
                        skip, part.batch, devices, part.flat, part.points,
                        part.xla_defaults):
                    if observe:  # here, while the writer (the slower side) writes
                        observe(part, b, region, values)
                    writer.put(part, b, region, values)
        with outputs.serial(out):  # the shards finish one at a time
            if state.complete():
                results.finish_store(out)
            elif not out.exists() or results.partial_path(out).exists():
                return None
    return results.open_cube(out)
