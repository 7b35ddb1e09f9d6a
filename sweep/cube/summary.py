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
cube. Each row's cell is found on its own hardware x model x scenario slice,
so the table never loads more of a large cube than one slice at a time.
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
    if int(np.prod(list(ds.sizes.values()))) <= LOAD_POINTS:
        names = {m.name for m in columns} | set(MASK_VARIABLES)
        ds = ds[[n for n in ds.data_vars if n in names]].load()
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
            table.add_row(*head, *(_fmt(d, pt[d].values) for d in config),
                          *(c.column.format(pt[c.name]) for c in columns))
    if rows < total:
        notes.append(f"{total - rows:,} more row(s) of {total:,} are in the cube "
                     "(sweep-report CUBE, or ds.sweep.feasible().sweep.cheapest(...))")
    return table, notes
