"""``ds.sweep``: feasibility, cheapest points, Pareto fronts and serving flags.

An ``xarray`` accessor (registered on import of ``sweep``) for the cubes the
sweep entry points write. It never recomputes a metric: it masks, reduces and
reads the cube's own variables.

* ``feasible`` keeps the points whose KV cache fits (``kv_fits``), whose token
  budget is at least the concurrency (vLLM refuses
  ``max_num_batched_tokens < max_num_seqs``, vllm/config/scheduler.py
  ``SchedulerConfig._verify_args``; continuous batching only) and, when
  limits are given, whose p99 TTFT and ITL meet them. A cube of the roofline
  sweep has no p99 variables; there the decode step time ``step_s`` stands in
  for the p99 ITL and the time of one whole-prompt prefill step
  (``mean_prompt_tokens / prefill_tokens_per_s``) for the p99 TTFT. Both are
  lower bounds (no queueing, no prefill interference), so the proxy is
  optimistic; the criterion actually applied, proxies named, is returned in
  the mask's and the dataset's ``feasible`` attribute.
* ``cheapest`` is an argmin that skips NaN (points that do not fit or are
  masked); ``pareto`` is the usual non-dominated filter (``sweep.search.pareto``;
  both axes maximised unless told otherwise);
  ``to_serving_flags`` maps one point to a serving engine's arguments
  (vLLM, SGLang or TensorRT-LLM: ``sweep.cube.engines``).
* On a cube opened lazily (``open_cube``: dask, one block per chunk file)
  nothing loads the cube whole: masks are lazy, ``cheapest`` and ``pareto``
  read it block by block (``sweep.cube.reduce``) and give what they give on
  the cube in memory, ties included; ``cheapest``'s variables stay lazy
  until read (``.compute()`` the ones wanted: the chunks holding the best
  points are read then).
* On a p99 cube (``latency=simulate|surrogate``) the latency variables live
  on the latency axes (with ``arrival_rate_per_s``, without the context,
  long-prompt and traffic axes); the mask spans the union of both, so a
  point's feasibility depends on every axis either depends on.
* On the dataset of ``sweep-optimize`` (dims ``candidate``, ``config``) the
  points are the candidates: ``feasible`` keeps those with an answer meeting
  their targets and applies limits to their p99s (simulated where verified,
  surrogate otherwise); ``cheapest("candidate")`` and ``pareto`` work as on
  a cube; ``to_serving_flags(candidate=i)`` gives a candidate's flags.
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import pandas as pd
import xarray as xr
import yaml

from sweep.cube import contract, engines, reduce
from sweep.cube.status import SATURATED
from sweep.model import batching
from sweep.search import pareto

SLO_FIELDS = contract.SLO
"""The limits an SLO option sets (``conf/slo``), each bounding the metric of its
name."""

SCENARIO_DIMS = contract.role(contract.SCENARIO)
"""Axes that describe the situation (what the traffic looks like) rather than
a choice of the deployment: analyses fix them instead of optimising over them."""
CONFIG_DIMS = contract.role(contract.CONFIG)
"""Axes an operator chooses for one hardware x model."""
REJECTED_LIMIT = "max_rejected_fraction"
"""The SLO's limit on ``rejected_fraction`` (``slo.max_rejected_fraction``):
what an SLO bounds besides its p99s."""
REJECTED_DEFAULT = 0.0
"""That limit where an SLO does not set it (the config's default)."""
MASK_VARIABLES = ("kv_fits", *SLO_FIELDS, "rejected_fraction", "latency_status",
                  "step_s", "prefill_tokens_per_s", "mean_prompt_tokens")
"""What ``feasible_mask`` reads: the KV check, the SLO metrics or their
proxies, the rejected share, the latency status."""


def is_optimize(ds: xr.Dataset) -> bool:
    """Whether ``ds`` is the dataset of ``sweep-optimize`` (not a grid cube)."""
    return "candidate" in ds.dims or "config" in ds.dims


class ServingFlags(NamedTuple):
    """A serving engine's arguments for one cube point."""

    engine: str  # vllm, sglang or trtllm
    flags: dict[str, int | float | str]  # flag -> value, e.g. {"--max-num-seqs": 64}
    cli: str  # the same flags as one command-line string
    replicas: int | None  # replicas the cube's traffic needs, when it has them
    # what no flag says: the pre-quantised checkpoint a weight dtype needs
    notes: tuple[str, ...] = ()

    def __str__(self) -> str:
        return self.cli


def load_slo(name: str) -> dict[str, float]:
    """The p99 limits of the shipped SLO option ``conf/slo/<name>.yaml``.

    Returns:
      ``{"ttft_p99_s": ..., "itl_p99_s": ...}`` and ``max_rejected_fraction``
      (the fields the file sets).

    Raises:
      ValueError: no such option (the message lists the shipped ones).
    """
    base = importlib.resources.files("sweep.conf").joinpath("slo")
    path = base.joinpath(f"{name}.yaml")
    if not path.is_file():
        shipped = sorted(p.name.removesuffix(".yaml") for p in base.iterdir()
                         if p.name.endswith(".yaml")) if base.is_dir() else []
        raise ValueError(f"slo={name!r}: no conf/slo/{name}.yaml; shipped options: "
                         f"{', '.join(shipped) or 'none'}")
    return _limits(yaml.safe_load(path.read_text()))


def config_value(ds: xr.Dataset, key: str):
    """The first value of ``key`` found (depth first) in the cube's ``config_yaml``."""
    def find(node):
        if isinstance(node, dict):
            if key in node:
                return node[key]
            for v in node.values():
                found = find(v)
                if found is not None:
                    return found
        return None

    text = ds.attrs.get("config_yaml")
    return find(yaml.safe_load(text)) if text else None


def point_dtype(ds: xr.Dataset, pt: xr.Dataset, name: str) -> str:
    """A point's ``weight_dtype`` or ``kv_dtype``: its coordinate (or
    variable), else, where that says ``own``, its model's (``model_specs``)."""
    if name in pt.variables and str(pt[name].values) != "own":
        return str(pt[name].values)
    specs = yaml.safe_load(ds.attrs.get("model_specs") or "{}") or {}
    model = str(pt["model"].values) if "model" in pt.variables else ""
    return str(specs.get(model, {}).get(name, engines.PLAIN))


def cube_slo(ds: xr.Dataset) -> dict[str, float]:
    """The limits of the SLO the cube was swept with (its config's ``slo``),
    as ``load_slo`` gives a shipped one's."""
    text = ds.attrs.get("config_yaml")
    return _limits((yaml.safe_load(text) or {}).get("slo") if text else None)


def _limits(slo) -> dict[str, float]:
    """The limits an SLO's node sets (p99s, and the rejected share where
    they are set)."""
    if not isinstance(slo, dict):
        return {}
    out = {k: float(slo[k]) for k in SLO_FIELDS if slo.get(k) is not None}
    if out and slo.get(REJECTED_LIMIT) is not None:
        out[REJECTED_LIMIT] = float(slo[REJECTED_LIMIT])
    return out


def _pick(ds: xr.Dataset, dims: Sequence[str], pos: np.ndarray, has: np.ndarray,
          keep: list[str]) -> xr.Dataset:
    """The points at flat positions ``pos`` (over ``dims``) of every ``keep`` cell.

    Cells without a point (``has`` False) get NaN / False / "" everywhere.
    """
    idx = np.unravel_index(pos, [ds.sizes[d] for d in dims])
    out = ds.isel({d: xr.DataArray(i, dims=keep) for d, i in zip(dims, idx)})
    found = xr.DataArray(has, dims=keep)
    for name, var in ds.data_vars.items():
        if set(var.dims) & set(dims):
            out[name] = _blank(out[name], found).assign_attrs(var.attrs)
    for d in dims:
        coord = out[d].variable.to_base_variable()
        out = out.drop_vars(d)
        out[f"best_{d}"] = _blank(xr.DataArray(coord), found).assign_attrs(
            {**ds[d].attrs, "long_name": f"best {ds[d].attrs.get('long_name', d)}"})
    return out


def _blank(da: xr.DataArray, found: xr.DataArray) -> xr.DataArray:
    kind = da.dtype.kind
    if kind == "b":
        return da & found
    if kind in "US":
        return da.where(found, "")
    return da.astype(np.float64 if kind in "iu" else da.dtype).where(found)


@xr.register_dataset_accessor("sweep")
class SweepAccessor:
    """Analysis helpers on a result cube: ``ds.sweep.<method>``."""

    def __init__(self, ds: xr.Dataset):
        self._ds = ds

    def _require(self, *names: str) -> None:
        missing = [n for n in names if n not in self._ds.variables]
        if missing:
            raise ValueError(f"the cube has no {', '.join(missing)}")

    def _latency(self, name: str) -> tuple[xr.DataArray, str]:
        """The cube's p99 variable ``name``, or its documented lower-bound proxy."""
        ds = self._ds
        if name in ds:
            return ds[name], name
        if name == "itl_p99_s" and "step_s" in ds:
            return ds["step_s"], "step_s (decode step as ITL proxy: no itl_p99_s)"
        if name == "ttft_p99_s" and {"prefill_tokens_per_s",
                                     "mean_prompt_tokens"} <= set(ds.variables):
            return (ds["mean_prompt_tokens"] / ds["prefill_tokens_per_s"],
                    "mean_prompt_tokens / prefill_tokens_per_s (one-step prefill "
                    "as TTFT proxy: no ttft_p99_s)")
        raise ValueError(f"the cube has no {name} and nothing to bound it with")

    def feasible_mask(self, slo: str | None = None, *, ttft_p99_s: float | None = None,
                      itl_p99_s: float | None = None,
                      max_rejected_fraction: float | None = None) -> xr.DataArray:
        """Boolean mask of the points that fit and meet the limits.

        Args:
          slo: name of a shipped SLO option (``conf/slo/<slo>.yaml``).
          ttft_p99_s: p99 time-to-first-token limit in seconds (overrides ``slo``).
          itl_p99_s: p99 inter-token latency limit in seconds (overrides ``slo``).
          max_rejected_fraction: the largest share of requests a point may
            reject (its ``rejected_fraction``: prompt + output beyond the
            model's context; overrides ``slo``). Where a cube has that share
            and any limit is given, it applies, at 0 unless given, as
            ``slo.max_rejected_fraction`` does for ``slo_met``: a p99 over the
            served requests alone says nothing of the rejected ones.

        Returns:
          A bool DataArray over the cube's dims; its ``feasible`` attribute
          states the criterion applied, naming any proxy used.
        """
        limits = load_slo(slo) if slo is not None else {}
        rejected = limits.pop(REJECTED_LIMIT, None)
        for name, value in (("ttft_p99_s", ttft_p99_s), ("itl_p99_s", itl_p99_s)):
            if value is not None:
                limits[name] = float(value)
        for name, limit in limits.items():
            if not (np.isfinite(limit) and limit > 0):
                raise ValueError(f"{name} = {limit:g}: must be a finite number > 0")
        if max_rejected_fraction is not None:
            rejected = float(max_rejected_fraction)
        if rejected is not None and not 0.0 <= rejected <= 1.0:
            raise ValueError(f"{REJECTED_LIMIT} = {rejected:g}: must be in [0, 1]")
        if rejected is None and limits:
            rejected = REJECTED_DEFAULT
        if is_optimize(self._ds):
            return self._candidate_mask(limits, rejected)
        self._require("kv_fits")
        ds = self._ds
        mask = ds["kv_fits"].astype(bool)
        criteria = ["kv_fits"]
        if {"token_budget", "concurrency"} <= set(ds.dims):
            # vLLM refuses max_num_batched_tokens < max_num_seqs: every running
            # sequence needs one token of each step's budget
            ok = ds["token_budget"] >= ds["concurrency"]
            if "batching" in ds.dims:
                ok = ok | ~ds["batching"].isin(batching.CONTINUOUS_NAMES)
            mask = mask & ok
            criteria.append("token_budget >= concurrency")
        for name, limit in limits.items():
            value, what = self._latency(name)
            mask = mask & (value <= limit)
            criteria.append(f"{what} <= {limit:g} s")
        if limits and "latency_status" in ds:
            # past its capacity a point's queue grows without bound: no p99
            # limit holds in steady state, whatever its figures read
            mask = mask & ((ds["latency_status"] & SATURATED) == 0)
            criteria.append("not saturated")
        if rejected is not None and "rejected_fraction" in ds:
            mask = mask & (ds["rejected_fraction"] <= rejected)
            criteria.append(f"rejected_fraction <= {rejected:g}")
        # over the union of the criteria's dims (a p99 cube's latency variables
        # add arrival_rate_per_s, its KV check context_tokens), in cube order
        mask = mask.transpose(*[d for d in ds.dims if d in mask.dims])
        return mask.rename("feasible").assign_attrs(
            feasible=" & ".join(criteria), long_name="feasible", units="1")

    def _candidate_mask(self, limits: dict[str, float],
                        rejected: float | None) -> xr.DataArray:
        """``feasible_mask`` of a ``sweep-optimize`` dataset, over its candidates.

        A candidate is feasible when the search found it an answer meeting its
        surrogate targets, and each limit holds for its p99, simulated where
        the candidate was verified and from the surrogate otherwise, and its
        simulated rejected share within ``rejected`` where it was verified.
        """
        ds = self._ds
        self._require("meets_targets", "verified")
        mask = ds["meets_targets"].astype(bool)
        criteria = ["meets_targets"]
        for name, limit in limits.items():
            self._require(f"simulated_{name}", f"surrogate_{name}")
            value = xr.where(ds["verified"], ds[f"simulated_{name}"],
                             ds[f"surrogate_{name}"])
            mask = mask & (value <= limit)
            criteria.append(f"{name} (simulated where verified, else surrogate) <= "
                            f"{limit:g} s")
        if rejected is not None and "simulated_rejected_fraction" in ds:
            mask = mask & xr.where(ds["verified"],
                                   ds["simulated_rejected_fraction"] <= rejected, True)
            criteria.append(f"rejected_fraction (simulated, where verified) <= "
                            f"{rejected:g}")
        return mask.rename("feasible").assign_attrs(
            feasible=" & ".join(criteria), long_name="feasible", units="1")

    def feasible(self, slo: str | None = None, *, ttft_p99_s: float | None = None,
                 itl_p99_s: float | None = None,
                 max_rejected_fraction: float | None = None) -> xr.Dataset:
        """The cube with every point that fails the limits masked out.

        Float variables of a deployment point (those over any of
        ``CONFIG_DIMS``) become NaN at infeasible points (so that ``cheapest``
        and ``pareto`` skip them), spread over the mask's dims where they lack
        some: on a p99 cube the cost gains ``arrival_rate_per_s``, since
        whether a point meets the SLO depends on the rate. The mask itself is
        added as the bool variable ``feasible``. Arguments as in
        ``feasible_mask``; with none, only ``kv_fits`` is applied.
        """
        mask = self.feasible_mask(slo, ttft_p99_s=ttft_p99_s, itl_p99_s=itl_p99_s,
                                  max_rejected_fraction=max_rejected_fraction)
        out = self._ds.copy()
        point_dims = {"candidate"} if is_optimize(self._ds) else set(CONFIG_DIMS)
        for name, var in self._ds.data_vars.items():
            if var.dtype.kind == "f" and set(var.dims) & point_dims:
                masked = var.where(mask)
                dims = [d for d in self._ds.dims if d in masked.dims]
                out[name] = masked.transpose(*dims).assign_attrs(var.attrs)
        out["feasible"] = mask
        out.attrs["feasible"] = mask.attrs["feasible"]
        return out

    def cheapest(self, over: str | Sequence[str],
                 metric: str = "cost_per_mtok_out_usd") -> xr.Dataset:
        """The point of least ``metric`` over the dims ``over``, per remaining dims.

        NaN points (not fitting, or masked by ``feasible``) are skipped; a cell
        with no point left is NaN (``best_<dim>`` NaN, or "" for names).

        Args:
          over: the dims to optimise over, e.g. ``["tensor_parallel", "concurrency"]``.
          metric: the variable to minimise.

        Returns:
          A Dataset over the remaining dims holding every variable at the best
          point, and ``best_<dim>`` (the argmin coordinate) for each dim of
          ``over``. On a lazy cube the argmin is computed (one pass over the
          metric's blocks); the variables are lazy selections of the best points.
        """
        ds = self._ds
        over = [over] if isinstance(over, str) else list(over)
        self._require(metric)
        m = ds[metric]
        unknown = [d for d in over if d not in m.dims]
        if unknown:
            raise ValueError(f"cheapest: {metric} has no dim {', '.join(unknown)}; "
                             f"dims: {', '.join(m.dims)}")
        keep = [d for d in m.dims if d not in over]
        pos, has = reduce.first_least(m.transpose(*keep, *over), len(keep))
        out = _pick(ds, over, pos, has, keep)
        out.attrs["cheapest"] = f"least {metric} over {', '.join(over)}"
        return out

    def pareto(self, x: str, y: str, *, by: str | Sequence[str] | None = None,
               maximize: tuple[bool, bool] = (True, True)) -> pd.DataFrame:
        """Non-dominated points of ``x`` and ``y`` (``sweep.search.pareto.front``).

        A point is dropped when another is at least as good on both and better
        on one; by default larger is better on both (throughputs). Points with
        identical ``(x, y)`` are kept once (the first in cube order); NaN
        points are skipped.

        Args:
          x, y: variable names, e.g. ``"output_tokens_per_s"``, ``"user_tokens_per_s"``.
          by: dims to compute a separate front for (e.g. ``"hardware"``).
          maximize: per variable, whether larger is better; ``(False, False)``
            for cost against latency.

        Returns:
          One row per front point: the point's coordinates and ``x``, ``y``,
          sorted by ``by`` then ``x``.
        """
        self._require(x, y)
        by = [] if by is None else [by] if isinstance(by, str) else list(by)
        pair = self._ds[[x, y]].reset_coords(drop=True)
        dims = list(pair.dims)  # the order of ``to_dataframe``'s columns
        unknown = [d for d in by if d not in dims]
        if unknown:
            raise ValueError(f"pareto: by {', '.join(unknown)}: not a dim of {x} or "
                             f"{y}; dims: {', '.join(dims)}")
        xa, ya = (pair[v].broadcast_like(pair).transpose(*dims) for v in (x, y))
        if xa.chunks is not None or ya.chunks is not None:
            xa, ya = xr.unify_chunks(xa.chunk(), ya.chunk())
        groups = reduce.group_fronts(xa, ya, [dims.index(d) for d in by], maximize)
        kept = [pareto.front_of_fronts(parts, maximize=maximize)
                for parts in groups.values()]
        pos, fx, fy = ((np.concatenate(c) for c in zip(*kept)) if kept else
                       (np.zeros(0, np.int64), np.zeros(0, xa.dtype),
                        np.zeros(0, ya.dtype)))
        order = np.argsort(pos, kind="stable")  # cube order, as ``front`` sees it
        idx = np.unravel_index(pos[order], xa.shape)
        front = pd.DataFrame({d: pair.get_index(d).take(i) for d, i in zip(dims, idx)})
        front[x], front[y] = np.asarray(fx)[order], np.asarray(fy)[order]
        return front.sort_values([*by, x], kind="stable").reset_index(drop=True)

    def to_serving_flags(self, engine: str = "vllm", **sel) -> ServingFlags:
        """Engine arguments for the one point ``sel`` selects.

        Args:
          engine: ``vllm``, ``sglang`` or ``trtllm`` (``sweep.cube.engines``).
          **sel: coordinate values (as for ``Dataset.sel``); every dim of more
            than one value must be selected.

        Returns:
          ``ServingFlags``: tensor parallelism, concurrency and token budget
          (when the cube has those dims) and the memory share (from the run's
          ``gpu_memory_utilization``; TensorRT-LLM's from it, the GPU's memory
          and the weights) in the engine's names, with the replicas the
          traffic needs when the cube has them; where the point's
          ``weight_dtype`` or ``kv_dtype`` is not bf16, the engine's
          quantisation and KV-cache dtype flags, and in ``notes`` the
          pre-quantised checkpoint a weight dtype needs where no flag exists;
          at a ``spec_tokens`` k > 0, the engine's n-gram speculation flags
          (TensorRT-LLM's, in ``notes``); at ``prefix_caching`` 1, vLLM's
          ``--enable-prefix-caching`` (SGLang's and TensorRT-LLM's caches are
          on by default: ``notes``); at ``disaggregated`` 1, in ``notes``
          the instance counts of both pools (the prefill instances' own flags
          where their ``prefill_tensor_parallel`` differs), the engine's pool
          flags and the front that routes requests to them
          (``engines.pool_note``).
        """
        engines.engine(engine)  # an unknown name fails before any reading
        ds = self._ds
        if is_optimize(ds):  # one candidate's answer: its variables only
            ds = ds[[v for v in ds.data_vars if ds[v].dims == ("candidate",)]]
        if "arrival_rate_per_s" in ds.dims and "arrival_rate_per_s" not in sel:
            # the p99 figures vary with the rate, an engine's settings do not
            ds = ds.drop_dims("arrival_rate_per_s")
        pt = ds.sel(sel)
        open_dims = [d for d, n in pt.sizes.items() if n > 1]
        if open_dims:
            raise ValueError("to_serving_flags needs one point; also select "
                             + ", ".join(f"{d} (one of {list(pt[d].values)})"
                                         for d in open_dims))
        pt = pt.squeeze(drop=False).compute()
        if "batching" in pt.coords and not batching.policy(
                str(pt["batching"].values)).continuous:
            raise ValueError(f"batching={pt['batching'].values}: the serving "
                             "engines use continuous batching; select "
                             "batching='continuous'")
        if "meets_targets" in pt and not bool(pt["meets_targets"]):
            raise ValueError(f"the candidate {sel} has no configuration meeting its "
                             "targets (meets_targets False)")
        if "kv_fits" in pt and not bool(pt["kv_fits"]):
            raise ValueError(f"the point {sel} does not fit in memory (kv_fits False)")
        if {"token_budget", "concurrency"} <= set(pt.variables) and float(
                pt["token_budget"]) < float(pt["concurrency"]):
            raise ValueError(f"token_budget {int(pt['token_budget'])} < concurrency "
                             f"{int(pt['concurrency'])}: vLLM needs "
                             "max_num_batched_tokens >= max_num_seqs")

        def value(name):
            return (float(pt[name]) if name in pt.variables
                    and np.isfinite(float(pt[name])) else None)

        util = config_value(self._ds, "gpu_memory_utilization")
        weights, kv = (point_dtype(self._ds, pt, d) for d in ("weight_dtype",
                                                              "kv_dtype"))
        spec = int(value("spec_tokens") or 0)
        cache = bool(value("prefix_caching") or 0)
        # the cube does not record the draft model's or the EAGLE-3 head's
        # Hugging Face id: its speculation is said in a note (sweep-optimize
        # prints the flags)
        proposer = int(value("spec_proposer") or 0)
        drafted = spec > 0 and proposer > 0
        spec = 0 if drafted else spec
        def flags_at(tp: int) -> dict:
            return engines.flags(
                engine, tensor_parallel=tp,
                concurrency=value("concurrency"), token_budget=value("token_budget"),
                gpu_memory_utilization=None if util is None else float(util),
                memory_bytes=value("memory_bytes"), weight_bytes=value("weight_bytes"),
                weight_dtype=weights, kv_dtype=kv, spec_tokens=spec,
                prefix_caching=cache)

        tp = int(pt["tensor_parallel"])
        flags = flags_at(tp)
        replicas = value("replicas")
        notes = engines.notes(engine, weights, spec, cache)
        if drafted:
            what, key, name, option = (
                ("draft-model", "draft model's", "draft_model", "draft"),
                ("EAGLE-3", "EAGLE-3 head's", "eagle3_head", "eagle3"))[proposer - 1]
            notes.append(
                f"{what} speculation, {int(value('spec_tokens'))} tokens per "
                f"step: the flags need the {key} Hugging Face id (the model "
                f"config's {name}); sweep-optimize "
                f"'search.spec_proposer=[{option}]' prints them")
        if value("disaggregated"):
            p, d = int(value("prefill_instances")), int(value("decode_instances"))
            layerwise = bool(config_value(self._ds, "kv_transfer_layerwise"))
            pre_tp = int(value("prefill_tensor_parallel") or tp)
            own = ("" if pre_tp == tp else f" (the prefill instances at TP {pre_tp}: "
                   f"{engines.command_line(flags_at(pre_tp))})")
            pools = "; ".join(f"{pool}: {engines.command_line(f)}"
                              for pool in ("prefill", "decode")
                              if (f := engines.pool_flags(engine, pool, layerwise)))
            notes.append(f"disaggregated: {p} prefill and {d} decode instances with "
                         f"these flags{own}" + (f", plus {pools}" if pools else "")
                         + "; " + engines.pool_note(engine, p, d, None, layerwise))
        return ServingFlags(engine, flags, engines.command_line(flags),
                            None if replicas is None else int(replicas),
                            tuple(notes))

