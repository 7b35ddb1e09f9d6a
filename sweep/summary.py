"""The table ``sweep-grid`` prints: the cheapest feasible point of each scenario.

Scenario axes (workload, context, arrival rate, traffic) describe the
situation, not a choice (``sweep.accessor.SCENARIO_DIMS``): every combination
of their values gets its own rows, one per hardware x model. The deployment
choices (tensor parallelism, concurrency, token budget, batching) are
optimised: a row is the point of least ``cost_per_mtok_out_usd`` among the
feasible ones, as ``sweep-report`` decides feasibility
(``ds.sweep.feasible_mask``: the KV cache fits, the token budget is at least
the concurrency, and on a cube with p99 variables the SLO of the cube's own
config). ``long_prompt_tokens`` changes only the interference variables,
which the table does not show: it is fixed at its first value.

Rows go scenario by scenario, so a long table cut at ``MAX_ROWS`` still
compares every hardware x model on its first scenarios; the rest are in the
cube. Each row's cell is found on its own hardware x model x scenario slice,
so the table never loads more of a large cube than one slice at a time.
"""

from __future__ import annotations

import itertools

import numpy as np
import xarray as xr
from rich.table import Table

import sweep.accessor  # noqa: F401  (registers ds.sweep)
from sweep.accessor import CONFIG_DIMS, cube_slo
from sweep.plan import LOAD_POINTS

MAX_ROWS = 60
ROW_DIMS = ("workload", "context_tokens", "arrival_rate_per_s",
            "traffic_tokens_per_day")
"""Scenario dims that get rows (long_prompt_tokens is fixed: see above)."""

_SCENARIO_COLUMNS = {"workload": "workload", "context_tokens": "context tok",
                     "arrival_rate_per_s": "req/s",
                     "traffic_tokens_per_day": "tok/day"}


def _fmt(dim: str, v) -> str:
    if dim == "workload":
        return str(v)
    if dim == "context_tokens":
        return f"{int(v):,}"
    return f"{float(v):g}"


def _cheapest(sl: xr.Dataset, limits: dict) -> xr.Dataset | None:
    """The feasible point of least cost in one hardware x model x scenario slice."""
    mask = sl.sweep.feasible_mask(**limits)
    cost = sl["cost_per_mtok_out_usd"].where(mask)
    dims = [d for d in cost.dims if d in CONFIG_DIMS]
    values = np.asarray(cost.transpose(*dims).values, dtype=np.float64)
    if values.size == 0 or np.isnan(values).all():
        return None
    pos = np.unravel_index(np.nanargmin(values), values.shape)
    return sl.isel(dict(zip(dims, pos)))


def summary_table(ds: xr.Dataset) -> tuple[Table, list[str]]:
    """The table, and the notes to print under it (what was fixed or left out)."""
    p99 = "ttft_p99_s" in ds and "itl_p99_s" in ds
    limits = cube_slo(ds) if p99 else {}
    notes = []
    if "long_prompt_tokens" in ds.dims:
        if ds.sizes["long_prompt_tokens"] > 1:
            notes.append(f"long_prompt_tokens fixed at "
                         f"{int(ds.long_prompt_tokens[0]):,} (first of "
                         f"{ds.sizes['long_prompt_tokens']}): it changes only the "
                         "long-prompt interference variables")
        ds = ds.isel(long_prompt_tokens=0)
    if int(np.prod(list(ds.sizes.values()))) <= LOAD_POINTS:
        names = ["cost_per_mtok_out_usd", "kv_fits", "step_s", "user_tokens_per_s",
                 "max_concurrency_fit", "replicas", "ttft_p99_s", "itl_p99_s",
                 "prefill_tokens_per_s", "mean_prompt_tokens"]
        ds = ds[[n for n in names if n in ds]].load()
    row_dims = [d for d in ROW_DIMS if d in ds.dims]
    shown = [d for d in row_dims if d != "workload" or ds.sizes[d] > 1]
    if limits:
        title = (f"cheapest point meeting the p99 SLO (TTFT <= "
                 f"{limits['ttft_p99_s']:g} s, ITL <= {limits['itl_p99_s'] * 1e3:g} "
                 "ms)")
    else:
        title = "cheapest point that fits"
    table = Table(title=f"{title}, per scenario and hardware x model")
    cols = ["hardware", "model", *(_SCENARIO_COLUMNS[d] for d in shown),
            "TP", "conc.", "budget tok", "batching", "ITL ms", "tok/s/user"]
    if p99:
        cols += ["p99 TTFT s", "p99 ITL ms"]
    cols += ["USD/1M out", "replicas", "max conc."]
    for col in cols:
        left = col in ("hardware", "model", "workload", "batching")
        table.add_column(col, justify="left" if left else "right", no_wrap=True)
    scenarios = list(itertools.product(*(range(ds.sizes[d]) for d in row_dims)))
    total = len(scenarios) * ds.sizes["hardware"] * ds.sizes["model"]
    rows = 0
    for scenario in scenarios:
        sel = dict(zip(row_dims, scenario))
        for h, m in itertools.product(ds.hardware.values, ds.model.values):
            if rows == MAX_ROWS:
                break
            rows += 1
            sl = ds.isel(sel).sel(hardware=h, model=m)
            head = [str(h), str(m), *(_fmt(d, sl[d].values) for d in shown)]
            pt = _cheapest(sl, limits)
            if pt is None:
                table.add_row(*head, *[""] * (len(cols) - len(head) - 1),
                              "meets no SLO" if limits else "does not fit")
                continue
            row = [*head, str(int(pt.tensor_parallel)), str(int(pt.concurrency)),
                   f"{int(pt.token_budget):,}", str(pt.batching.values),
                   f"{float(pt.step_s) * 1e3:.2f}",
                   f"{float(pt.user_tokens_per_s):,.0f}"]
            if p99:
                row += [f"{float(pt.ttft_p99_s):.3f}",
                        f"{float(pt.itl_p99_s) * 1e3:.2f}"]
            row += [f"{float(pt.cost_per_mtok_out_usd):.3f}",
                    f"{float(pt.replicas):,.0f}", f"{int(pt.max_concurrency_fit):,}"]
            table.add_row(*row)
    if rows < total:
        notes.append(f"{total - rows:,} more row(s) of {total:,} are in the cube "
                     "(sweep-report CUBE, or ds.sweep.feasible().sweep.cheapest(...))")
    return table, notes
