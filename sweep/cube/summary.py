"""The table ``sweep-grid`` prints: the cheapest feasible point of each scenario.

Scenario axes (workload, context, arrival rate, traffic) describe the
situation, not a choice (``sweep.cube.accessor.SCENARIO_DIMS``): every combination
of their values gets its own rows, one per hardware x model. The deployment
choices (tensor parallelism, concurrency, token budget, batching) are
optimised: a row is the point of least ``cost_per_mtok_out_usd`` among the
feasible ones, as ``sweep-report`` decides feasibility
(``ds.sweep.feasible_mask``: the KV cache fits, the token budget is at least
the concurrency, and on a cube with p99 variables the SLO of the cube's own
config). A scenario axis that changes only a few metrics
(``sweep.cube.contract.Axis.affects``: ``long_prompt_tokens``, the interference
variables), none of them shown, is fixed at its first value. The columns
are the deployment choices the cube sweeps (one holding a single value is
named once under the table) and the metrics declared with a ``column``
(``sweep.cube.contract``).

Rows go scenario by scenario, so a long table cut at ``MAX_ROWS`` still
compares every hardware x model on its first scenarios; the rest are in the
cube. The rows shown are found in one pass over the scenarios they need
(``ds.sweep.cheapest``, block by block on a cube opened lazily), so the table
never holds more of a large cube than a few of its chunks.
"""

from __future__ import annotations

import itertools

import numpy as np
import xarray as xr
from rich.table import Table

import sweep.cube.accessor  # noqa: F401  (registers ds.sweep)
from sweep.cube import contract
from sweep.cube.accessor import CONFIG_DIMS, MASK_VARIABLES, cube_slo
from sweep.grid.plan import LOAD_POINTS

MAX_ROWS = 60
COLUMNS = tuple(sorted((m for m in contract.METRICS if m.column),
                       key=lambda m: (contract.SPEED, contract.COST).index(
                           m.column.section)))
"""The metrics shown (those a cube has): speed, then cost, each in
declaration order."""
FIXED_DIMS = tuple(a.name for a in contract.AXES if a.role == contract.SCENARIO
                   and a.affects and not set(a.affects) & {m.name for m in COLUMNS})
"""Scenario dims that change only metrics the table does not show: fixed at
their first value."""
ROW_DIMS = tuple(a.name for a in contract.AXES
                 if a.role == contract.SCENARIO and a.name not in FIXED_DIMS)
"""Scenario dims that get rows."""


def _fmt(dim: str, v) -> str:
    kind = contract.AXIS[dim].kind
    if kind == contract.LABEL:
        return str(v)
    if kind == contract.INTEGER:
        return f"{int(v):,}"
    return f"{float(v):g}"


def _shown(ds: xr.Dataset, row_dims: list[str]) -> dict[str, slice]:
    """The first values of the row dims that the first ``MAX_ROWS`` rows use
    (rows go scenario by scenario in the order of ``row_dims``)."""
    scenarios = -(-MAX_ROWS // (ds.sizes["hardware"] * ds.sizes["model"]))
    box = {}
    for i, d in enumerate(row_dims):
        later = int(np.prod([ds.sizes[e] for e in row_dims[i + 1:]]))
        box[d] = slice(0, -(-scenarios // later))
        if -(-scenarios // later) > 1:  # then every value of the later dims
            break
    return box


def summary_table(ds: xr.Dataset) -> tuple[Table, list[str]]:
    """The table, and the notes to print under it (what was fixed or left out)."""
    p99 = all(name in ds for name in contract.SLO)
    limits = cube_slo(ds) if p99 else {}
    notes = []
    for d in FIXED_DIMS:
        if d not in ds.dims:
            continue
        if ds.sizes[d] > 1:
            axis = contract.AXIS[d]
            notes.append(f"{d} fixed at {_fmt(d, ds[d].values[0])} (first of "
                         f"{ds.sizes[d]}): it changes only "
                         f"{', '.join(axis.affects)}")
        ds = ds.isel({d: 0})
    columns = [m for m in COLUMNS if m.name in ds]
    names = {"cost_per_mtok_out_usd", *(m.name for m in columns), *MASK_VARIABLES}
    ds = ds[[n for n in ds.data_vars if n in names]]
    if int(np.prod(list(ds.sizes.values()))) <= LOAD_POINTS:
        ds = ds.load()
    row_dims = [d for d in ROW_DIMS if d in ds.dims]
    shown = [d for d in row_dims if d != "workload" or ds.sizes[d] > 1]
    if limits:
        title = (f"cheapest point meeting the p99 SLO (TTFT <= "
                 f"{limits['ttft_p99_s']:g} s, ITL <= {limits['itl_p99_s'] * 1e3:g} "
                 "ms)")
    else:
        title = "cheapest point that fits"
    table = Table(title=f"{title}, per scenario and hardware x model")
    # a choice with one value is the same in every row: said once, below
    config = [d for d in CONFIG_DIMS if d in ds.coords and ds[d].size > 1]
    single = [d for d in CONFIG_DIMS if d in ds.coords and ds[d].size == 1]
    if single:
        notes.append("every row: " + ", ".join(
            f"{d} = {_fmt(d, ds[d].values.ravel()[0])}" for d in single))
    cols = ["hardware", "model", *(contract.AXIS[d].header for d in shown),
            *(contract.AXIS[d].header for d in config),
            *(m.column.header for m in columns)]
    for col in cols:
        left = col in ("hardware", "model", "workload", "batching")
        table.add_column(col, justify="left" if left else "right", no_wrap=True)
    total = int(np.prod([ds.sizes[d] for d in row_dims])) * ds.sizes[
        "hardware"] * ds.sizes["model"]
    ds = ds.isel(_shown(ds, row_dims))
    feasible = ds.sweep.feasible(**limits)
    over = [d for d in feasible["cost_per_mtok_out_usd"].dims if d in CONFIG_DIMS]
    best = feasible.sweep.cheapest(over) if over else feasible
    # the rows' points only, and of them only the columns: one read of each
    best = best[[*names & set(best), *(f"best_{d}" for d in over)]].compute()
    rows = 0
    for scenario in itertools.product(*(range(ds.sizes[d]) for d in row_dims)):
        sel = dict(zip(row_dims, scenario))
        for h, m in itertools.product(ds.hardware.values, ds.model.values):
            if rows == MAX_ROWS:
                break
            rows += 1
            pt = best.isel(sel).sel(hardware=h, model=m)
            head = [str(h), str(m), *(_fmt(d, pt[d].values) for d in shown)]
            if np.isnan(pt["cost_per_mtok_out_usd"]):
                table.add_row(*head, *[""] * (len(cols) - len(head) - 1),
                              "meets no SLO" if limits else "does not fit")
                continue
            table.add_row(*head, *(_fmt(d, pt[f"best_{d}"].values) for d in config),
                          *(c.column.format(pt[c.name]) for c in columns))
    if rows < total:
        notes.append(f"{total - rows:,} more row(s) of {total:,} are in the cube "
                     "(sweep-report CUBE, or ds.sweep.feasible().sweep.cheapest(...))")
    return table, notes
