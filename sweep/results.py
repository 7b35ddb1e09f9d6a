"""The cube: an ``xarray.Dataset`` written to zarr, block by block, resumably.

A sweep writes into ``<out>.partial``: first a template with every
coordinate, attribute and (unwritten) variable, then one ``region=`` write per
evaluated block, each followed by an atomic update of the list of finished
blocks. A rerun of the same config finds the partial store and evaluates only
the missing blocks. When every block is in, the metadata is consolidated and
the store is renamed to ``<out>``: a reader never sees a half-written cube
under the final name.
"""

from __future__ import annotations

import json
import os
import shutil
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import xarray as xr

from sweep import status

ROOFLINE_VARIABLES: dict[str, tuple[str, str]] = {
    # name: (units, long_name)
    "step_s": ("s", "decode step time (ITL)"),
    "user_tokens_per_s": ("tokens/s", "per-user decode rate"),
    "output_tokens_per_s": ("tokens/s", "replica output rate"),
    "slot_utilization": ("1", "batch slot utilisation"),
    "cost_per_mtok_out_usd": ("USD/Mtoken", "cost per 1M output tokens"),
    "prefill_tokens_per_s": ("tokens/s", "prefill rate"),
    "cost_per_mtok_in_usd": ("USD/Mtoken", "cost per 1M input tokens"),
    "long_prefill_s": ("s", "long-prompt prefill time"),
    "long_prefill_steps": ("steps", "long-prompt prefill steps"),
    "long_prefill_worst_itl_s": ("s", "worst ITL during long prefill"),
    "replicas": ("replicas", "replicas for the traffic"),
    "effective_cost_per_mtok_out_usd": ("USD/Mtoken",
                                        "cost per 1M output tokens at the traffic"),
    "kv_fits": ("1", "KV cache fits in memory"),
    "max_concurrency_fit": ("sequences", "largest concurrency that fits"),
}

P99_VARIABLES: dict[str, tuple[str, str]] = {
    "ttft_p50_s": ("s", "p50 time to first token"),
    "ttft_p99_s": ("s", "p99 time to first token"),
    "itl_p50_s": ("s", "p50 inter-token latency"),
    "itl_p99_s": ("s", "p99 inter-token latency"),
    "e2e_p99_s": ("s", "p99 end-to-end latency"),
    "achieved_output_tokens_per_s": ("tokens/s", "achieved output rate"),
    "goodput_req_per_s": ("requests/s", "requests meeting the SLO per second"),
    "slo_met": ("1", "p99 TTFT and ITL within the SLO"),
    "latency_status": ("", "latency model status flags (0 = ok)"),
}

VARIABLES = {**ROOFLINE_VARIABLES, **P99_VARIABLES}
"""Every data variable a cube may hold: ``(units, long_name)``."""

BOOLEAN = ("kv_fits", "slo_met")
INTEGER = ("latency_status",)
FLAG_ATTRS = {"latency_status": status.cf_attrs()}
"""CF flag attributes of the bit-mask variables (``sweep.status``)."""

COORDS: dict[str, tuple[str, str]] = {
    "hardware": ("", "hardware"),
    "model": ("", "model"),
    "workload": ("", "workload"),
    "tensor_parallel": ("GPUs", "tensor-parallel GPUs"),
    "concurrency": ("sequences", "concurrency (max_num_seqs)"),
    "token_budget": ("tokens", "token budget (max_num_batched_tokens)"),
    "context_tokens": ("tokens", "mean context"),
    "batching": ("", "batching"),
    "long_prompt_tokens": ("tokens", "long prompt length"),
    "traffic_tokens_per_day": ("tokens/day", "output traffic"),
    "arrival_rate_per_s": ("requests/s", "arrival rate"),
}


def _attrs(name: str, table: dict[str, tuple[str, str]]) -> dict[str, str]:
    units, long_name = table[name]
    attrs = {"units": units} if units else {}
    return {**attrs, "long_name": long_name}


def provenance(config_yaml: str, seed: int, overrides: list[str]
               ) -> dict[str, str | int]:
    """Global attributes every cube carries (strings and numbers only)."""
    import jax

    from sweep import __version__

    return {
        "sweep_version": __version__,
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "jax_version": jax.__version__,
        "jax_backend": jax.default_backend(),
        "x64": int(bool(jax.config.jax_enable_x64)),
        "seed": seed,
        "hydra_overrides": " ".join(overrides),
        "config_yaml": config_yaml,
    }


def template(coords: dict[str, np.ndarray], parts, attrs: dict,
             extra: dict[str, xr.DataArray] | None = None) -> xr.Dataset:
    """An unwritten cube: coordinates, attributes and lazily-zero variables.

    Args:
      parts: the job's parts; each contributes its variables on its dims,
        chunked like its blocks.
    """
    import dask.array as da  # only writers need dask; keep `import sweep` light

    data_vars = {}
    for part in parts:
        shape = tuple(len(coords[d]) for d in part.dims)
        for name in part.variables:
            dtype = bool if name in BOOLEAN else (
                np.int32 if name in INTEGER else np.float32)
            data_vars[name] = (part.dims,
                               da.zeros(shape, dtype=dtype, chunks=part.plan.chunks),
                               {**_attrs(name, VARIABLES), **FLAG_ATTRS.get(name, {}),
                                **part.attrs})
    ds = xr.Dataset(
        data_vars,
        coords={d: (d, v, _attrs(d, COORDS)) for d, v in coords.items()},
        attrs=attrs,
    )
    if extra:
        ds = ds.assign(extra)
    return ds


def partial_path(out: Path) -> Path:
    """Where an unfinished cube is written."""
    return out.with_name(out.name + ".partial")


def progress_path(out: Path) -> Path:
    """The list of finished blocks of an unfinished cube (beside the store)."""
    return out.with_name(out.name + ".progress.json")


def start_store(out: Path, ds: xr.Dataset, fingerprint: str) -> set[str]:
    """Creates (or reopens, for the same config) the partial store.

    Returns:
      The keys of the blocks already written (``"<part>:<block>"``).
    """
    tmp = partial_path(out)
    progress = progress_path(out)
    if progress.exists():
        state = json.loads(progress.read_text())
        if state.get("fingerprint") == fingerprint:
            return set(state["done"])
    if tmp.exists():
        shutil.rmtree(tmp)
    ds.to_zarr(tmp, compute=False, mode="w", consolidated=False, zarr_format=2)
    _write_progress(out, fingerprint, set())
    return set()


def _write_progress(out: Path, fingerprint: str, done: set[str]) -> None:
    staged = progress_path(out).with_suffix(".new")
    staged.write_text(json.dumps({"fingerprint": fingerprint, "done": sorted(done)}))
    os.replace(staged, progress_path(out))


def write_block(out: Path, dims: tuple[str, ...], region: tuple[slice, ...],
                values: dict[str, np.ndarray], fingerprint: str, done: set[str],
                block_key: str) -> None:
    """Writes one evaluated block and records it as finished."""
    tmp = partial_path(out)
    ds = xr.Dataset({k: (dims, v) for k, v in values.items()})
    ds.to_zarr(tmp, region=dict(zip(dims, region)), consolidated=False,
              zarr_format=2)
    done.add(block_key)
    _write_progress(out, fingerprint, done)


def finish_store(out: Path) -> None:
    """Consolidates metadata and moves the finished cube to its final name."""
    import zarr

    tmp = partial_path(out)
    zarr.consolidate_metadata(str(tmp), zarr_format=2)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    progress_path(out).unlink()


def open_cube(path: str | os.PathLike, *, chunks: str | dict | None = "auto"
              ) -> xr.Dataset:
    """Opens a result cube written by any sweep entry point.

    Args:
      path: a ``.zarr`` store (or a netCDF file saved from a cube).
      chunks: dask chunks; ``None`` loads eagerly.

    Returns:
      The cube as an ``xarray.Dataset``, lazily loaded by default.
    """
    p = Path(path)
    if not p.exists():
        hint = (": the sweep was interrupted; rerun it to resume"
                if partial_path(p).exists() else "")
        raise FileNotFoundError(f"no cube at {p}{hint}")
    if p.suffix in (".nc", ".nc4", ".netcdf"):
        return xr.open_dataset(p, chunks=chunks)
    try:
        return xr.open_zarr(p, chunks=chunks)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{p} is not a result cube: no readable zarr store there "
                         f"({type(e).__name__})") from None
