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
from dataclasses import dataclass

import numpy as np
import xarray as xr
from rich.table import Table

import sweep.cube.accessor  # noqa: F401  (registers ds.sweep)
from sweep.cube import contract
from sweep.cube.accessor import CONFIG_DIMS, MASK_VARIABLES, REJECTED_LIMIT, cube_slo
from sweep.cube.reduce import least_in, position
from sweep.grid.plan import LOAD_POINTS

MAX_ROWS = 60
NONE_MEETS = "none fits and meets the SLO"
"""A row without a feasible point: a point must both fit (``kv_fits``: its
concurrency at ``context_tokens`` beside the weights) and meet the SLO, so a
point the p99s alone would pass can still be left out."""
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


@dataclass
class Frame:
    """Everything of the table but its rows' values: the cube narrowed to
    what the rows read (``ds``: lazy on a lazy cube), the columns and notes."""

    ds: xr.Dataset  # fixed dims dropped, the shown scenarios, the variables read
    limits: dict[str, float]
    notes: list[str]
    title: str
    row_dims: list[str]
    shown: list[str]  # the row dims named in the rows
    config: list[str]  # the choices with more than one value
    columns: list[contract.Metric]
    cols: list[str]  # the table's headers
    names: set[str]  # the variables read
    total: int  # rows in the whole cube
    select: dict[str, int | slice]  # ``ds`` as a selection of the cube (isel)

    @classmethod
    def of(cls, ds: xr.Dataset) -> Frame:
        p99 = all(name in ds for name in contract.SLO)
        limits = cube_slo(ds) if p99 else {}
        notes, select = [], {}
        for d in FIXED_DIMS:
            if d not in ds.dims:
                continue
            select[d] = 0
            if ds.sizes[d] > 1:
                axis = contract.AXIS[d]
                notes.append(f"{d} fixed at {_fmt(d, ds[d].values[0])} (first of "
                             f"{ds.sizes[d]}): it changes only "
                             f"{', '.join(axis.affects)}")
            ds = ds.isel({d: 0})
        columns = [m for m in COLUMNS if m.name in ds]
        names = {"cost_per_mtok_out_usd", *(m.name for m in columns), *MASK_VARIABLES}
        ds = ds[[n for n in ds.data_vars if n in names]]
        row_dims = [d for d in ROW_DIMS if d in ds.dims]
        shown = [d for d in row_dims if d != "workload" or ds.sizes[d] > 1]
        if limits:
            # the rejected share named where some point rejects requests
            worst = (float(ds["rejected_fraction"].max())
                     if "rejected_fraction" in ds else 0.0)
            rejected = worst > 0
            most = limits.get(REJECTED_LIMIT, 0.0)
            title = (f"cheapest point meeting the p99 SLO (TTFT <= "
                     f"{limits['ttft_p99_s']:g} s, ITL <= "
                     f"{limits['itl_p99_s'] * 1e3:g} ms"
                     + (f", rejected <= {most:.4g}" if rejected else "") + ")")
            if rejected:
                notes.append(
                    f"rejected: up to {worst:.2%} of "
                    "requests (prompt + output beyond the model's "
                    f"max_context_tokens); slo.max_rejected_fraction = {most:g} "
                    "(workload.overlong=truncate serves them cut)")
        else:
            title = "cheapest point that fits"
        # a choice with one value is the same in every row: said once, below
        config = [d for d in CONFIG_DIMS if d in ds.coords and ds[d].size > 1]
        single = [d for d in CONFIG_DIMS if d in ds.coords and ds[d].size == 1]
        if single:
            notes.append("every row: " + ", ".join(
                f"{d} = {_fmt(d, ds[d].values.ravel()[0])}" for d in single))
        cols = ["hardware", "model", *(contract.AXIS[d].header for d in shown),
                *(contract.AXIS[d].header for d in config),
                *(m.column.header for m in columns)]
        total = int(np.prod([ds.sizes[d] for d in row_dims])) * ds.sizes[
            "hardware"] * ds.sizes["model"]
        box = _shown(ds, row_dims)
        return cls(ds.isel(box), limits, notes, title, row_dims, shown, config,
                   columns, cols, names, total, select | box)

    def over(self, feasible: xr.Dataset) -> list[str]:
        """The choices a row is the cheapest over."""
        return [d for d in feasible["cost_per_mtok_out_usd"].dims if d in CONFIG_DIMS]

    def best(self) -> xr.Dataset:
        """The rows' points, read from the cube (``ds.sweep.cheapest``, block by
        block on a lazy cube): the variables read and ``best_<choice>``."""
        ds = self.ds
        if int(np.prod(list(ds.sizes.values()))) <= LOAD_POINTS:
            ds = ds.load()
        feasible = ds.sweep.feasible(**self.limits)
        over = self.over(feasible)
        best = feasible.sweep.cheapest(over) if over else feasible
        # the rows' points only, and of them only the columns: one read of each
        return best[[*self.names & set(best), *(f"best_{d}" for d in over)]].compute()

    def table(self, best: xr.Dataset) -> tuple[Table, list[str]]:
        """The table of the rows' points ``best``, and the notes under it."""
        table = Table(title=f"{self.title}, per scenario and hardware x model")
        for col in self.cols:
            left = col in ("hardware", "model", "workload", "batching")
            table.add_column(col, justify="left" if left else "right", no_wrap=True)
        ds, notes, rows = self.ds, list(self.notes), 0
        for scenario in itertools.product(*(range(ds.sizes[d]) for d in self.row_dims)):
            sel = dict(zip(self.row_dims, scenario))
            for h, m in itertools.product(ds.hardware.values, ds.model.values):
                if rows == MAX_ROWS:
                    break
                rows += 1
                pt = best.isel(sel).sel(hardware=h, model=m)
                head = [str(h), str(m), *(_fmt(d, pt[d].values) for d in self.shown)]
                if np.isnan(pt["cost_per_mtok_out_usd"]):
                    table.add_row(*head, *[""] * (len(self.cols) - len(head) - 1),
                                  NONE_MEETS if self.limits else "does not fit")
                    continue
                table.add_row(*head,
                              *(_fmt(d, pt[f"best_{d}"].values) for d in self.config),
                              *(c.column.format(pt[c.name]) for c in self.columns))
        if rows < self.total:
            notes.append(f"{self.total - rows:,} more row(s) of {self.total:,} are in "
                         "the cube (sweep-report CUBE, or "
                         "ds.sweep.feasible().sweep.cheapest(...))")
        return table, notes


def summary_table(ds: xr.Dataset) -> tuple[Table, list[str]]:
    """The table, and the notes to print under it (what was fixed or left out)."""
    frame = Frame.of(ds)
    return frame.table(frame.best())


def blank(values: np.ndarray, found: np.ndarray) -> np.ndarray:
    """``values`` where ``found``, else NaN / False / "" (``accessor._pick``:
    integers become float64)."""
    kind = values.dtype.kind
    if kind == "b":
        return values & found
    if kind in "US":
        return np.where(found, values, "")
    if kind in "iu":
        values = values.astype(np.float64)
    return np.where(found, values, np.array(np.nan, values.dtype))


class Rows:
    """The table's rows reduced from a sweep's blocks while they are in memory.

    ``add`` takes each block of the sweep's one part (``sweep.grid.job.run``'s
    ``observe``, while the block before is written), keeps of it only what
    the rows read (the shown scenarios), masks the cost as
    ``ds.sweep.feasible`` does and finds per row its least cost and that
    point's flat position over the choices (``sweep.cube.reduce.least_in``:
    NaN skipped, ties to the first); across blocks a row keeps the least
    cost, ties to the first position, as ``ds.sweep.cheapest`` does over the
    blocks of a lazy cube. So ``table`` gives the table ``summary_table``
    reads from the written cube without reading it, but for the blocks this
    process did not evaluate (a resumed sweep, the other shards): those are
    read back from the cube.

    Only for a cube of one part (``latency=none``): with p99 variables a
    point's feasibility needs both parts' blocks (``Rows.of`` gives None).
    """

    def __init__(self, frame: Frame, part):
        self.frame, self.part = frame, part
        self.seen: set[int] = set()
        feasible = frame.ds.sweep.feasible(**frame.limits)
        self.over = frame.over(feasible)
        cost = feasible["cost_per_mtok_out_usd"]
        self.keep = [d for d in cost.dims if d not in self.over]
        self.keep_shape = tuple(frame.ds.sizes[d] for d in self.keep)
        self.over_shape = tuple(frame.ds.sizes[d] for d in self.over)
        self.least = np.full(self.keep_shape, np.inf)
        self.pos = np.full(self.keep_shape, np.iinfo(np.int64).max)
        self.has = np.zeros(self.keep_shape, bool)
        self.values: dict[str, np.ndarray] = {}
        variables = {m.name for m in part.variables}
        ds = frame.ds
        # what a block's rows read of it: the variables shown and the mask's
        self.shown = ["cost_per_mtok_out_usd",
                      *(m.name for m in frame.columns
                        if m.name != "cost_per_mtok_out_usd")]
        self.read = [k for k in MASK_VARIABLES if k in variables and k in ds]
        # the rest, small and in memory: coordinates, per-value variables
        self.coords = {d: ds[d].variable.to_base_variable() for d in ds.dims}
        self.extra = ds[[k for k in frame.names & set(ds.data_vars)
                         if k not in variables]].load()

    @classmethod
    def of(cls, template: xr.Dataset, parts) -> Rows | None:
        """Rows for the sweep of ``parts`` whose cube ``template`` is
        (``sweep.cube.results.template``), or None where they cannot be
        reduced block by block."""
        if len(parts) != 1:
            return None
        rows = cls(Frame.of(template), parts[0])
        return rows if rows.over else None

    def _local(self, region: tuple[slice, ...]):
        """The block's part that the rows read: per part dim, the index or
        slice into the block, and the offset of that slice in ``frame.ds``
        (None: the dim is fixed); None when the rows read none of it."""
        local = {}
        for d, r in zip(self.part.dims, region):
            pick = self.frame.select.get(d, slice(None))
            if isinstance(pick, int):
                if not r.start <= pick < r.stop:
                    return None
                local[d] = (pick - r.start, None)
                continue
            stop = r.stop if pick.stop is None else min(r.stop, pick.stop)
            if stop <= r.start:
                return None
            local[d] = (slice(0, stop - r.start), r.start)
        return local

    def add(self, part, block: int, region: tuple[slice, ...], values: dict) -> None:
        """Reduces one evaluated block of the part (its variables in memory)."""
        local = self._local(region)
        self.seen.add(block)
        if local is None:
            return
        index = tuple(i for i, _ in local.values())
        at = {d: slice(o, o + i.stop) for d, (i, o) in local.items() if o is not None}
        dims = [d for d in part.dims if d in at]
        # what the mask reads, as a dataset for ``feasible_mask``
        sub = xr.Dataset({k: (dims, values[k][index]) for k in self.read},
                         coords={d: self.coords[d][at[d]] for d in dims})
        if self.frame.limits:
            sub = sub.assign(self.extra.isel({d: at[d] for d in self.extra.dims}))
        mask = sub.sweep.feasible_mask(**self.frame.limits)
        if set(mask.dims) != set(dims):
            mask = mask.broadcast_like(sub["cost_per_mtok_out_usd"])
        # the rest in numpy (xarray's overhead per block would cost more than
        # the reduction): the cost as (rows' cells, choices flattened)
        order = [dims.index(d) for d in (*self.keep, *self.over)]
        shape = [at[d].stop - at[d].start for d in self.keep]
        over = tuple(at[d].stop - at[d].start for d in self.over)

        def flat(a: np.ndarray) -> np.ndarray:
            return np.transpose(a, order).reshape(*shape, -1)

        # only the cost is masked: at a row's point the mask holds, and a row
        # without one is blanked, as ``feasible`` then ``cheapest`` give it
        cost = flat(values["cost_per_mtok_out_usd"][index])
        cost = np.where(flat(mask.transpose(*dims).values), cost, np.nan)
        least, first, has = least_in(cost, len(self.keep))
        pos = position(first, over, [at[d].start for d in self.over],
                       self.over_shape)
        # each row's point, as indices into the block's part the rows read
        point = dict(zip(self.keep, np.indices(shape, sparse=True))) | dict(
            zip(self.over, np.unravel_index(first, over)))
        where = tuple(point[d] for d in dims)
        best = {k: blank(values[k][index][where], has) for k in self.shown}
        for d in self.over:
            best[f"best_{d}"] = blank(self.coords[d].values[at[d]][point[d]], has)
        cells = tuple(at[d] for d in self.keep)
        better = (least < self.least[cells]) | (
            (least == self.least[cells]) & (pos < self.pos[cells]))
        self.least[cells] = np.where(better, least, self.least[cells])
        self.pos[cells] = np.where(better, pos, self.pos[cells])
        self.has[cells] |= has
        for name, v in best.items():
            if name not in self.values:
                self.values[name] = np.empty(
                    self.keep_shape, object if v.dtype.kind in "US" else v.dtype)
            self.values[name][cells] = np.where(better, v,
                                                self.values[name][cells])

    def table(self, ds: xr.Dataset) -> tuple[Table, list[str]]:
        """The table; the blocks not seen are read from the finished cube ``ds``."""
        plan = self.part.plan
        names = [m.name for m in self.part.variables if m.name in self.frame.names]
        for b in range(len(plan)):
            if b in self.seen:
                continue
            region = plan.region(b)
            if self._local(region) is None:
                continue
            sel = dict(zip(self.part.dims, region))
            self.add(self.part, b, region, {k: ds[k].isel(sel).values for k in names})
        frame = self.frame
        coords = {d: frame.ds[d] for d in self.keep}
        best = xr.Dataset(
            {k: (self.keep, v.astype(str) if v.dtype == object else v)
             for k, v in self.values.items()}, coords=coords)
        return frame.table(best)
