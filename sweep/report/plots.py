"""The report's charts: matplotlib figures of a result cube (Agg, no pyplot).

Every chart plots the cube's own variables, labelled from their ``long_name``
and ``units`` attributes (CF names, as ``xarray.plot`` uses them). A cube has
more dims than a chart has axes, so each chart first reduces the cube the same
stated way (``view``):

* scenario dims (workload, context, long prompt, traffic, arrival rate) are
  fixed at their first coordinate value;
* batching is fixed at a continuous policy (``continuous``: what vLLM /
  SGLang / TGI run; ``sweep.model.batching``) when the cube has one, else at its
  first value;
* the weight and KV precisions are fixed at their first value (a precision
  trades quality for cost, which the cube does not measure);
* the deployment choices the chart does not show (tensor parallelism, token
  budget, concurrency) are reduced to the cheapest point in USD per 1M output
  tokens among those that fit, ties going to the first coordinate value;
  except that the ITL and interference charts keep one tensor-parallel size
  per hardware x model (that of its cheapest point, ``fix_tp``), so that a
  curve does not jump between sizes.

The dataset of ``sweep-optimize`` (dims ``candidate``, ``config``) has its own
charts (``OPTIMIZE_CHARTS``): cost against surrogate p99 ITL and TTFT over the
configurations of the last search, with the Pareto fronts, and one bar per
candidate coloured by what the simulator said of it.

Figures are built on ``matplotlib.figure.Figure`` directly, so drawing touches
no global pyplot state and needs no display.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import xarray as xr
from matplotlib import colormaps
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle
from matplotlib.ticker import (
    FixedLocator,
    FuncFormatter,
    LogLocator,
    NullFormatter,
    NullLocator,
)

import sweep.cube.accessor  # noqa: F401  (registers ds.sweep)
from sweep.cube.accessor import CONFIG_DIMS, SCENARIO_DIMS
from sweep.model import batching, precision

COST = "cost_per_mtok_out_usd"
PER_GPU = "output_tokens_per_s_per_gpu"


def label(da: xr.DataArray, scale_ms: bool = False) -> str:
    """``long_name (units)`` of a variable, seconds shown as ms when asked."""
    name = da.attrs.get("long_name", da.name)
    units = "ms" if scale_ms else da.attrs.get("units", "")
    return f"{name} ({units})" if units else str(name)


PRECISION_DIMS = ("weight_dtype", "kv_dtype")
"""Fixed at their first value in the report (``scenario``)."""


def scenario(ds: xr.Dataset, keep: tuple[str, ...] = ()
             ) -> tuple[xr.Dataset, list[str]]:
    """Fixes the scenario dims (but ``keep``), batching and precision; returns
    the cube and what was fixed."""
    notes, sel = [], {}
    for d in SCENARIO_DIMS:
        if d in ds.dims and d not in keep:
            sel[d] = 0
            extra = f" (first of {ds.sizes[d]})" if ds.sizes[d] > 1 else ""
            notes.append(f"{d} = {format_value(ds[d].values[0])}{extra}")
    if "batching" in ds.dims:
        values = [str(v) for v in ds["batching"].values]
        served = [i for i, v in enumerate(values) if v in batching.CONTINUOUS_NAMES]
        sel["batching"] = served[0] if served else 0
        notes.append(f"batching = {values[sel['batching']]}")
    # a precision trades quality for cost, which the cube does not measure:
    # the report shows the first one swept rather than the cheapest
    for d in PRECISION_DIMS:
        if d in ds.dims:
            sel[d] = 0
            extra = f" (first of {ds.sizes[d]})" if ds.sizes[d] > 1 else ""
            notes.append(f"{d} = {ds[d].values[0]}{extra}")
    return ds.isel(sel), notes


def view(ds: xr.Dataset, keep: tuple[str, ...], names: tuple[str, ...]
         ) -> xr.Dataset:
    """The cube over hardware x model x ``keep``: scenario fixed, the rest cheapest.

    Holds the variables ``names`` (read into memory: the reduced cube is
    small), the ``best_<dim>`` of the dims reduced and
    ``output_tokens_per_s_per_gpu`` (replica rate / tensor-parallel GPUs).
    """
    fixed, _ = scenario(ds)
    over = [d for d in CONFIG_DIMS if d in fixed.dims and d not in keep]
    out = fixed.sweep.cheapest(over, COST) if over else fixed
    out = out[[n for n in (*names, "output_tokens_per_s",
                           *(f"best_{d}" for d in over)) if n in out]].compute()
    tp = out["best_tensor_parallel"] if "best_tensor_parallel" in out else (
        out["tensor_parallel"] if "tensor_parallel" in out.coords else 1)
    return out.assign({PER_GPU: per_gpu(out["output_tokens_per_s"], tp)})


def fix_tp(ds: xr.Dataset) -> xr.Dataset:
    """Per hardware x model, the tensor-parallel size of its cheapest point only.

    A curve over concurrency at one TP reads better than one that jumps
    between TPs; pairs that fit nowhere keep the first TP.
    """
    if "tensor_parallel" not in ds.dims:
        return ds
    fixed, _ = scenario(ds)
    over = [d for d in CONFIG_DIMS if d in fixed.dims]
    best = fixed.sweep.cheapest(over, COST)["best_tensor_parallel"]
    best = best.fillna(ds["tensor_parallel"].values[0]).astype(
        ds["tensor_parallel"].dtype)
    return ds.sel(tensor_parallel=best.reset_coords(drop=True))


def per_gpu(rate: xr.DataArray, tp) -> xr.DataArray:
    """Output tokens per second per GPU, labelled."""
    return (rate / tp).assign_attrs(long_name="output rate per GPU",
                                    units="tokens/s/GPU")


def format_value(v) -> str:
    """A coordinate or attribute value as text: floats as ``{:g}``, else ``str``."""
    if isinstance(v, (float, np.floating)):
        return f"{v:g}"
    return str(v)


def _panels(n: int, ncols: int, width: float, height: float, title: str,
            subtitle: str) -> tuple[Figure, list]:
    ncols = max(1, min(ncols, n))
    nrows = -(-n // ncols)
    fig = Figure(figsize=(width * ncols, height * nrows + 0.9), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in axes[n:]:
        ax.set_visible(False)
    _title(fig, title, subtitle)
    return fig, list(axes[:n])


def _title(fig: Figure, title: str, subtitle: str) -> None:
    """Title, and a subtitle wrapped to the figure's width."""
    lines = textwrap.wrap(subtitle, int(fig.get_figwidth() * 14))
    fig.suptitle("\n".join([title, *lines]), fontsize=10)


def _hw_colors(ds: xr.Dataset) -> dict[str, tuple]:
    cmap = colormaps["tab10"]
    return {str(h): cmap(i % 10) for i, h in enumerate(ds["hardware"].values)}


def _log2_ticks(ax, values, axis: str = "x") -> None:
    """Log axis with a tick at every coordinate value, written plainly."""
    values = np.asarray(values)
    getattr(ax, f"set_{axis}scale")("log", base=2)
    target = ax.xaxis if axis == "x" else ax.yaxis
    step = max(1, len(values) // 8)
    target.set_major_locator(FixedLocator(values[::step]))
    target.set_minor_locator(NullLocator())
    getattr(ax, f"set_{axis}ticklabels")([f"{v:g}" for v in values[::step]])


def _log(ax, axis: str = "y") -> None:
    """Log axis with plain-number ticks, denser when the range is short."""
    getattr(ax, f"set_{axis}scale")("log")
    _plain_log_ticks(ax.yaxis if axis == "y" else ax.xaxis,
                     *getattr(ax, f"get_{axis}lim")())


def _plain_log_ticks(target, lo: float, hi: float) -> None:
    decades = np.log10(hi / lo)
    subs = (1.0,) if decades > 2.5 else (1.0, 2.0, 5.0) if decades > 0.7 else (
        np.arange(1.0, 10.0))
    target.set_major_locator(LogLocator(10, subs=subs))
    target.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    target.set_minor_formatter(NullFormatter())


def _empty(ax, text: str = "no point fits") -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes,
            color="0.4")


def _hw_legend(fig: Figure, colors: dict[str, tuple], extra=()) -> None:
    handles = [Line2D([], [], color=c, marker="o", label=h) for h, c in colors.items()]
    fig.legend(handles=[*handles, *extra], loc="outside lower center",
               ncols=min(len(handles) + len(extra), 7), frameon=False)


def cost_vs_concurrency(ds: xr.Dataset) -> Figure:
    """USD per 1M output tokens vs concurrency: a line per hardware, panel per model."""
    v = view(ds, ("concurrency",), (COST,))
    colors = _hw_colors(v)
    models = [str(m) for m in v["model"].values]
    fig, axes = _panels(len(models), 3, 4.6, 3.4,
                        "USD per 1M output tokens vs concurrency",
                        "cheapest tensor-parallel size that fits; " + _notes(ds))
    for ax, m in zip(axes, models):
        ax.set_title(m, fontsize=10)
        cost = v[COST].sel(model=m)
        if not np.isfinite(cost.values).any():
            _empty(ax)
            continue
        for h, c in colors.items():
            y = cost.sel(hardware=h).values.ravel()
            ax.plot(v["concurrency"].values, y, marker="o", ms=3, color=c)
        _log2_ticks(ax, v["concurrency"].values)
        _log(ax)
        ax.grid(True, which="both", alpha=0.3)
        ax.set_xlabel(label(ds["concurrency"]))
        ax.set_ylabel(label(ds[COST]))
    _hw_legend(fig, colors)
    return fig


def itl_throughput_vs_concurrency(ds: xr.Dataset) -> Figure:
    """ITL (decode step; p99 dashed when the cube has it) and tokens/s/GPU."""
    v = view(fix_tp(ds), ("concurrency",), ("step_s", "itl_p99_s"))
    colors = _hw_colors(v)
    models = [str(m) for m in v["model"].values]
    has_p99 = "itl_p99_s" in v
    fig, axes = _panels(2 * len(models), 2, 4.8, 3.0,
                        "ITL and throughput vs concurrency",
                        "per hardware x model, the tensor-parallel size of its "
                        "cheapest point; " + _notes(ds))
    extra = [Line2D([], [], color="0.3", ls="--", label="p99 ITL")] if has_p99 else []
    for i, m in enumerate(models):
        ax_itl, ax_tput = axes[2 * i], axes[2 * i + 1]
        pt = v.sel(model=m)
        for ax, name, ms in ((ax_itl, "step_s", True), (ax_tput, PER_GPU, False)):
            ax.set_title(f"{m}: {pt[name].attrs['long_name']}", fontsize=10)
            if not np.isfinite(pt[name].values).any():
                _empty(ax)
                continue
            for h, c in colors.items():
                y = pt[name].sel(hardware=h).values.ravel() * (1e3 if ms else 1)
                ax.plot(pt["concurrency"].values, y, marker="o", ms=3, color=c)
                if ms and has_p99:
                    p99 = pt["itl_p99_s"].sel(hardware=h).values.ravel() * 1e3
                    ax.plot(pt["concurrency"].values, p99, ls="--", color=c)
            _log2_ticks(ax, pt["concurrency"].values)
            _log(ax)
            ax.grid(True, which="both", alpha=0.3)
            ax.set_xlabel(label(ds["concurrency"]))
            ax.set_ylabel(label(pt[name], scale_ms=ms))
    _hw_legend(fig, colors, extra)
    return fig


def feasible_region(ds: xr.Dataset, limits: dict[str, float]) -> tuple[xr.DataArray,
                                                                         str]:
    """The mask a heatmap's boundary is drawn around, and what it means.

    ``ds.sweep.feasible_mask`` with the given limits; with none, the cube's
    own ``slo_met`` is added when it has one.
    """
    mask = ds.sweep.feasible_mask(**limits)
    what = mask.attrs["feasible"]
    if not limits and "slo_met" in ds:
        mask, what = mask & ds["slo_met"].astype(bool), f"{what} & slo_met"
    return mask, what


def cost_heatmap(ds: xr.Dataset, hardware: str, model: str,
                 limits: dict[str, float]) -> Figure:
    """Cost over concurrency x token budget for one hardware x model, boundary drawn."""
    fixed, notes = scenario(ds.sel(hardware=[hardware], model=[model]))
    mask, what = feasible_region(fixed, limits)
    over = [d for d in CONFIG_DIMS if d in fixed.dims
            and d not in ("concurrency", "token_budget")]
    best = fixed.sweep.cheapest(over, COST) if over else fixed
    flat = ["hardware", "model"]
    cost = best[COST].squeeze(flat, drop=True).transpose("token_budget", "concurrency")
    region = mask.any(over) if over else mask
    region = region.squeeze(flat, drop=True).transpose("token_budget", "concurrency")
    fig = Figure(figsize=(7.5, 5.2), layout="constrained")
    ax = fig.subplots()
    c = cost.values.astype(np.float64)
    finite = np.isfinite(c)
    cmap = colormaps["viridis"].with_extremes(bad="0.88")
    if finite.any():
        norm = LogNorm(np.nanmin(c), max(np.nanmax(c), np.nanmin(c) * 1.01))
        im = ax.imshow(np.ma.masked_invalid(c), origin="lower", aspect="auto",
                       cmap=cmap, norm=norm)
        bar = fig.colorbar(im, ax=ax, label=label(ds[COST]))
        _plain_log_ticks(bar.ax.yaxis, norm.vmin, norm.vmax)
    else:
        ax.imshow(np.zeros_like(c), origin="lower", aspect="auto", cmap="Greys",
                  vmin=0, vmax=4)
        _empty(ax)
    if c.size <= 200:
        for (i, j), val in np.ndenumerate(c):
            if np.isfinite(val):
                ax.text(j, i, f"{val:.3g}", ha="center", va="center", fontsize=7,
                        color="white" if norm(val) < 0.5 else "black")
    inside = region.values.astype(bool)
    for (i, j), ok in np.ndenumerate(inside):
        if not ok:
            ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="//",
                                   edgecolor="0.55", lw=0))
    _boundary(ax, inside)
    ax.set_xticks(range(cost.sizes["concurrency"]),
                  [format_value(v) for v in cost["concurrency"].values])
    ax.set_yticks(range(cost.sizes["token_budget"]),
                  [format_value(v) for v in cost["token_budget"].values])
    ax.set_xlabel(label(ds["concurrency"]))
    ax.set_ylabel(label(ds["token_budget"]))
    text = (f"boundary of {what}" if inside.any() and not inside.all()
            else f"{'every' if inside.all() else 'no'} cell: {what}")
    handles = [Line2D([], [], color="red", lw=2.5,
                      label="\n".join(textwrap.wrap(text, 100))),
               Rectangle((0, 0), 1, 1, fill=False, hatch="//", edgecolor="0.55",
                         lw=0, label="hatched: not feasible")]
    fig.legend(handles=handles, loc="outside lower center", frameon=False,
               fontsize=7)
    _title(fig, f"USD per 1M output tokens: {hardware}, {model}",
           "cheapest tensor-parallel size per cell; grey = does not fit; "
           + "; ".join(notes))
    return fig


def _boundary(ax, region: np.ndarray) -> None:
    """Red lines between cells on opposite sides of ``region`` (rows = y)."""
    ny, nx = region.shape
    for i in range(ny):
        for j in range(nx):
            if j + 1 < nx and region[i, j] != region[i, j + 1]:
                ax.plot([j + 0.5, j + 0.5], [i - 0.5, i + 0.5], color="red", lw=2.5)
            if i + 1 < ny and region[i, j] != region[i + 1, j]:
                ax.plot([j - 0.5, j + 0.5], [i + 0.5, i + 0.5], color="red", lw=2.5)


def pareto_front(ds: xr.Dataset) -> Figure:
    """Tokens/s/GPU vs tokens/s/user: every fitting point, the front per hardware."""
    fixed, notes = scenario(ds)
    tp = fixed["tensor_parallel"] if "tensor_parallel" in fixed.coords else 1
    fixed = fixed.assign({PER_GPU: per_gpu(fixed["output_tokens_per_s"], tp)})
    x, y = PER_GPU, "user_tokens_per_s"
    front = fixed.sweep.pareto(x, y, by=["hardware", "model"])
    colors = _hw_colors(fixed)
    models = [str(m) for m in fixed["model"].values]
    fig, axes = _panels(len(models), 3, 4.6, 3.6,
                        "Throughput per GPU vs per-user speed (Pareto front)",
                        "dots: every configuration that fits; lines: the "
                        "non-dominated ones; " + "; ".join(notes))
    for ax, m in zip(axes, models):
        ax.set_title(m, fontsize=10)
        fm = front[front["model"] == m]
        if fm.empty:
            _empty(ax)
            continue
        panel = fixed.sel(model=m)[[x, y]].compute()  # one model's points at a time
        for h, c in colors.items():
            pts = panel.sel(hardware=h)
            ax.scatter(pts[x].values.ravel(), pts[y].values.ravel(), s=5, alpha=0.25,
                       color=c, linewidths=0)
            fh = fm[fm["hardware"] == h]
            ax.plot(fh[x], fh[y], marker="o", ms=3, color=c)
        _log(ax, "x")
        _log(ax)
        ax.grid(True, which="both", alpha=0.3)
        ax.set_xlabel(label(fixed[x]))
        ax.set_ylabel(label(fixed[y]))
    _hw_legend(fig, colors)
    return fig


def prefill_interference(ds: xr.Dataset, hardware: str, model: str) -> Figure:
    """Long-prompt prefill time and worst ITL vs token budget, per concurrency."""
    pair = fix_tp(ds.sel(hardware=[hardware], model=[model]))
    tp_note = ""
    if "tensor_parallel" in pair.coords:
        tp = pair["tensor_parallel"].values.item()
        tp_note = f"tensor_parallel = {tp:g} (the cheapest point's); "
    v = view(pair, ("concurrency", "token_budget"),
             ("long_prefill_s", "long_prefill_worst_itl_s", "step_s")).squeeze(
        ["hardware", "model"], drop=True)
    prompt = ds["long_prompt_tokens"].values[0] if "long_prompt_tokens" in ds else ""
    fig = Figure(figsize=(10, 4.2), layout="constrained")
    axes = fig.subplots(1, 2)
    conc = v["concurrency"].values
    cmap = colormaps["viridis"]
    budgets = v["token_budget"].values
    for ax, name in zip(axes, ("long_prefill_s", "long_prefill_worst_itl_s")):
        ms = name.endswith("itl_s")
        ax.set_title(ds[name].attrs.get("long_name", name), fontsize=10)
        lines = 0
        for k, n in enumerate(conc):
            color = cmap(k / max(1, len(conc) - 1))
            y = v[name].sel(concurrency=n).values * (1e3 if ms else 1)
            if not np.isfinite(y).any():
                continue
            lines += 1
            ax.plot(budgets, y, marker="o", ms=3, color=color, label=f"{n:g}")
            if ms:
                ax.axhline(float(np.nanmax(v["step_s"].sel(concurrency=n))) * 1e3,
                           color=color, ls=":", lw=1)
        if not lines:  # chunked prefill is continuous batching's
            _empty(ax, "no point prefills in chunks (continuous batching)")
            continue
        _log2_ticks(ax, budgets)
        _log(ax)
        ax.grid(True, which="both", alpha=0.3)
        ax.set_xlabel(label(ds["token_budget"]))
        ax.set_ylabel(label(ds[name], scale_ms=ms))
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(title=ds["concurrency"].attrs.get("long_name", "concurrency"),
                       fontsize=7, title_fontsize=7)
    _title(fig, f"Chunked-prefill interference: a {format_value(prompt)}-token prompt "
           f"arrives while the others decode ({hardware}, {model})",
           "dotted: ITL without the long prompt; " + tp_note + _notes(ds))
    return fig


SPEC_PANELS = 4
"""Concurrencies the speculative-decoding chart shows, lowest to highest."""


PROPOSER_STYLES = {0: ("-", "o", "n-gram"), 1: (":", "s", "draft model"),
                   2: ("-.", "^", "EAGLE-3 head")}
"""Line style, marker and name of each ``spec_proposer`` in the speculation chart."""


def speculative_decoding(ds: xr.Dataset, hardware: str, model: str) -> Figure:
    """Time per output token and cost against the proposal length k, a line
    per acceptance rate (solid: n-gram proposals; dotted: the draft model's,
    dash-dotted: the EAGLE-3 head's, where the cube has them), one column
    per concurrency (up to ``SPEC_PANELS``, the lowest to the highest), for
    one hardware x model at the tensor-parallel size of its cheapest point:
    where the dashed k = 0 level is beaten, speculation pays."""
    fixed, _ = scenario(fix_tp(ds).sel(hardware=hardware, model=model))
    keep = ("concurrency", "spec_tokens", "spec_acceptance", "spec_proposer")
    over = [d for d in CONFIG_DIMS if d in fixed.dims and d not in keep]
    v = fixed.sweep.cheapest(over, COST) if over else fixed
    v = v[[COST, "tpot_s"]].compute()
    if "spec_proposer" not in v.dims:
        v = v.expand_dims(spec_proposer=[0])
    conc = v["concurrency"].values
    pick = sorted({int(round(i)) for i in np.linspace(0, len(conc) - 1,
                                                       min(SPEC_PANELS, len(conc)))})
    ks, accepts = v["spec_tokens"].values, v["spec_acceptance"].values
    proposers = [int(p) for p in v["spec_proposer"].values]
    fig, axes = _panels(2 * len(pick), len(pick), 3.4, 3.0,
                        f"Speculative decoding: {hardware} x {model}",
                        " and ".join(PROPOSER_STYLES[p][2] for p in proposers)
                        + " proposals; dashed: k = 0 (plain decoding); a "
                        "step's tokens arrive together, so the ITL between "
                        "deliveries is the whole step; " + _notes(ds))
    colors = [colormaps["viridis"](i / max(len(accepts) - 1, 1))
              for i in range(len(accepts))]
    for col, i in enumerate(pick):
        pt = v.isel(concurrency=i)
        for row, (var, scale, name) in enumerate((
                ("tpot_s", 1e3, "time per output token (ms)"),
                (COST, 1.0, f"USD per 1M output tokens ({ds[COST].attrs['units']})"))):
            ax = axes[row * len(pick) + col]
            for a, color in zip(accepts, colors):
                for p in proposers:
                    ls, marker, _ = PROPOSER_STYLES[p]
                    ax.plot(ks, pt[var].sel(spec_acceptance=a, spec_proposer=p)
                            .values.ravel() * scale, marker=marker, ms=3, ls=ls,
                            color=color)
            if 0 in ks:
                ax.axhline(float(pt[var].sel(spec_tokens=0).isel(
                    spec_acceptance=0, spec_proposer=0)) * scale, color="0.2",
                    ls="--", lw=1)
            if row == 1:
                _log(ax)
            ax.grid(True, which="both", alpha=0.3)
            if row == 1:
                ax.set_xlabel("k: tokens proposed per step")
            if col == 0:
                ax.set_ylabel(name)
            if row == 0:
                ax.set_title(f"concurrency {int(conc[i])}", fontsize=10)
    handles = [Line2D([], [], marker="o", ms=3, color=c, label=f"acceptance {a:g}")
               for a, c in zip(accepts, colors)]
    if len(proposers) > 1:
        handles += [Line2D([], [], marker=PROPOSER_STYLES[p][1], ms=3, ls=
                           PROPOSER_STYLES[p][0], color="0.3",
                           label=PROPOSER_STYLES[p][2]) for p in proposers]
    fig.legend(handles=handles, loc="outside lower center",
               ncols=min(len(handles), 4), fontsize=8, frameon=False)
    return fig


PREFIX_KEEP = ("workload", "arrival_rate_per_s", "prefix_caching")
"""What the prefix-caching chart compares: each workload (its own hit
fraction) at each arrival rate, caching off and on."""


def prefix_caching(ds: xr.Dataset, hardware: str, model: str,
                   limits: dict[str, float]) -> Figure:
    """Cost of input tokens and the p99s against the share of each prompt
    cached, a line per workload (and arrival rate) from caching off (hollow,
    hit fraction 0) to on (filled, the workload's hit fraction), each at its
    cheapest point meeting ``limits``, for one hardware x model at the
    tensor-parallel size of its cheapest point. Without a p99 part the
    second panel is the prefill rate per GPU."""
    fixed, notes = scenario(fix_tp(ds).sel(hardware=hardware, model=model),
                            keep=PREFIX_KEEP)
    fixed = fixed.sweep.feasible(**limits)
    over = [d for d in CONFIG_DIMS if d in fixed.dims and d not in PREFIX_KEEP]
    p99 = [v for v in ("ttft_p99_s", "itl_p99_s") if v in fixed]
    names = ["prefix_hit_fraction", "cost_per_mtok_in_usd", "prefill_tokens_per_s",
             *p99]
    best = fixed.sweep.cheapest(over, COST) if over else fixed
    best = best[names].compute()
    # fix_tp leaves one size per hardware x model: a scalar coordinate here
    tp = float(fixed["tensor_parallel"]) if "tensor_parallel" in fixed.coords else 1.0
    panels = [("cost_per_mtok_in_usd", 1.0, label(ds["cost_per_mtok_in_usd"]))]
    if p99:
        panels += [(v, 1e3, f"p99 {v.split('_')[0].upper()} (ms)") for v in p99]
    else:
        panels += [("prefill_tokens_per_s", 1.0 / tp,
                    "prefill rate per GPU (tokens/s/GPU)")]
    fig, axes = _panels(len(panels), len(panels), 3.6, 3.2,
                        f"Prefix caching: {hardware} x {model}",
                        "hollow: caching off; filled: on at the workload's hit "
                        "fraction; each at its cheapest point that meets the SLO; "
                        + "; ".join(notes))
    workloads = [str(w) for w in best["workload"].values] if "workload" in best.dims \
        else [None]
    rates = best["arrival_rate_per_s"].values if "arrival_rate_per_s" in best.dims \
        else [None]
    cmap = colormaps["tab10"]
    handles = []
    for wi, w in enumerate(workloads):
        pw = best.sel(workload=w) if w is not None else best
        for ri, r in enumerate(rates):
            color = cmap((wi * len(rates) + ri) % 10)
            text = " at ".join(x for x in (w, None if r is None else f"{r:g} req/s")
                               if x)
            handles.append(Line2D([], [], color=color, marker="o", label=text))
            for ax, (var, scale, _) in zip(axes, panels):
                pt = pw[var].sel(arrival_rate_per_s=r) if (
                    r is not None and "arrival_rate_per_s" in pw[var].dims) else pw[var]
                hit = pw["prefix_hit_fraction"].values
                y = np.asarray(pt.values, dtype=np.float64) * scale
                ax.plot(hit, y, color=color, lw=1)
                for h, v, on in zip(hit, y, pw["prefix_caching"].values):
                    ax.plot([h], [v], "o", color=color,
                            mfc=color if on else "white")
    for ax, (_, _, name) in zip(axes, panels):
        ax.set_xlabel("share of the prompt cached")
        ax.set_ylabel(name)
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
    fig.legend(handles=handles, loc="outside lower center",
               ncols=min(len(handles), 4), fontsize=8, frameon=False)
    return fig


DISAGG_DIMS = ("disaggregated", "prefill_instances", "decode_instances",
               "prefill_tensor_parallel")


def disaggregation(ds: xr.Dataset, hardware: str, model: str) -> Figure:
    """Cost and zero-load TTFT against the P:D ratio of the disaggregated
    points (each labelled ``p:d``; a colour per prefill TP size where the
    cube has several), for one hardware x model at the tensor-parallel size
    of its cheapest point, each at its cheapest other settings; dashed: the
    aggregated engine's."""
    fixed, _ = scenario(fix_tp(ds).sel(hardware=hardware, model=model))
    over = [d for d in CONFIG_DIMS if d in fixed.dims and d not in DISAGG_DIMS]
    v = fixed.sweep.cheapest(over, COST) if over else fixed
    v = v[[COST, "zero_load_ttft_s"]].compute()
    dis = v.sel(disaggregated=1).expand_dims(
        [d for d in DISAGG_DIMS[1:] if d not in v.dims])
    agg = v.sel(disaggregated=0).isel(
        {d: 0 for d in DISAGG_DIMS[1:] if d in v.dims})
    tps = dis["prefill_tensor_parallel"].values
    tp = int(fixed["tensor_parallel"])
    fig, axes = _panels(2, 2, 4.6, 3.4,
                        f"Disaggregated prefill/decode: {hardware} x {model}",
                        "dots: p prefill + d decode instances (labelled p:d) at the "
                        "rate the smaller pool sustains; dashed: one aggregated "
                        "engine; " + _notes(ds))
    for ax, (var, scale, name) in zip(axes, (
            (COST, 1.0, f"USD per 1M output tokens ({ds[COST].attrs['units']})"),
            ("zero_load_ttft_s", 1e3, "TTFT at zero load (ms): prefill + KV "
             "transfer"))):
        for i, t in enumerate(tps):
            for p in dis["prefill_instances"].values:
                for d in dis["decode_instances"].values:
                    y = float(dis[var].sel(prefill_instances=p, decode_instances=d,
                                           prefill_tensor_parallel=t))
                    if np.isfinite(y):
                        ax.plot(p / d, y * scale, "o", ms=4, color=f"C{i}",
                                label=f"prefill TP {int(t) or tp}")
                        ax.annotate(f"{int(p)}:{int(d)}", (p / d, y * scale),
                                    fontsize=7, xytext=(3, 3),
                                    textcoords="offset points")
        if len(tps) > 1:
            unique = dict(zip(*ax.get_legend_handles_labels()[::-1]))
            ax.legend(list(unique.values()), list(unique), fontsize=7)
        level = float(agg[var])
        if np.isfinite(level):
            ax.axhline(level * scale, color="0.2", ls="--", lw=1)
        ax.set_xscale("log")
        ratios = [p / d for p in dis["prefill_instances"].values
                  for d in dis["decode_instances"].values]
        _plain_log_ticks(ax.xaxis, min(ratios), max(ratios))
        ax.grid(True, which="both", alpha=0.3)
        ax.set_xlabel("P:D ratio (prefill / decode instances)")
        ax.set_ylabel(name)
    return fig


def _notes(ds: xr.Dataset) -> str:
    return "; ".join(scenario(ds)[1])


NO_TARGET = "meets no target"
STATUS_COLORS = {  # a candidate's status (``candidate_status``) -> bar colour
    "chosen": "tab:blue",
    "simulated: met the SLO": "tab:green",
    "simulated: missed the SLO": "tab:red",
    "not simulated": "0.7",
}


def candidate_labels(ds: xr.Dataset) -> list[str]:
    """``hardware x model x TP n`` per candidate, as ``sweep-optimize`` names them
    (a model's precision after it unless bf16 throughout)."""
    n = ds.sizes["candidate"]
    weights, kv = (ds[d].values if d in ds else ["bf16"] * n  # older datasets
                   for d in ("weight_dtype", "kv_dtype"))
    return [f"{h} x {precision.label(m, w, k)} x TP {format_value(tp)}"
            for h, m, w, k, tp in zip(ds["hardware"].values, ds["model"].values,
                                       weights, kv, ds["tensor_parallel"].values)]


def candidate_status(ds: xr.Dataset) -> list[str]:
    """Per candidate: chosen, simulated and met / missed the SLO, not simulated,
    or ``NO_TARGET`` (no configuration meets its surrogate targets)."""
    out = []
    for cost, chosen, verified, met in zip(ds[COST].values, ds["chosen"].values,
                                           ds["verified"].values,
                                           ds["slo_met_simulated"].values):
        out.append("chosen" if chosen else NO_TARGET if not np.isfinite(cost)
                   else "not simulated" if not verified
                   else f"simulated: {'met' if met else 'missed'} the SLO")
    return out


def chosen_index(ds: xr.Dataset) -> int | None:
    """The chosen candidate; None when no aggregated deployment met the SLO
    (a disaggregated one did: ``deployment`` attribute)."""
    hit = np.flatnonzero(ds["chosen"].values)
    return int(hit[0]) if hit.size else None


def candidate_order(ds: xr.Dataset) -> np.ndarray:
    """Candidate indices, cheapest first (the chosen first among equals)."""
    cost = ds[COST].values.astype(float)
    return np.lexsort((~ds["chosen"].values.astype(bool),
                       np.where(np.isfinite(cost), cost, np.inf)))


def slo_note(ds: xr.Dataset) -> str:
    """The workload, its rate and the SLO of an optimize dataset, in words."""
    a = ds.attrs
    return (f"{a.get('workload', 'workload')} at "
            f"{format_value(a.get('arrival_rate_per_s', '?'))} req/s; SLO p99 TTFT "
            f"{a['slo_ttft_p99_s']:g} s, p99 ITL {a['slo_itl_p99_s'] * 1e3:g} ms")


def optimize_pareto(ds: xr.Dataset) -> Figure:
    """Cost vs surrogate p99 ITL and TTFT: every evaluated configuration, the
    Pareto front (step line), the SLO and the chosen deployment."""
    fig, axes = _panels(2, 2, 5.2, 4.2, "USD per 1M output tokens vs p99 latency",
                        "dots: every configuration of the last search meeting its "
                        "surrogate targets; " + slo_note(ds))
    i = chosen_index(ds)
    for ax, name, scale in zip(axes, ("itl", "ttft"), (1e3, 1.0)):
        _front_panel(ax, ds, None if i is None else ds.isel(candidate=i), name, scale)
    handles = [Line2D([], [], color="tab:blue", marker="o", ls="", alpha=0.35,
                      label="evaluated configuration"),
               Line2D([], [], color="tab:blue", marker="o", ms=4,
                      label="Pareto front"),
               Line2D([], [], color="red", ls="--", label="SLO limit")]
    if i is not None:
        handles.append(Line2D([], [], color="gold", marker="*", ms=13, ls="",
                              markeredgecolor="black",
                              label=f"chosen: {candidate_labels(ds)[i]}"))
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles),
               frameon=False)
    return fig


def _front_panel(ax, ds: xr.Dataset, chosen: xr.Dataset | None, name: str,
                 scale: float) -> None:
    """One panel of ``optimize_pareto``: ``name`` is ``itl`` or ``ttft``;
    ``chosen`` (None: no aggregated choice) is starred."""
    x = ds[f"config_{name}_p99_s"].values.astype(float) * scale
    y = ds[f"config_{COST}"].values.astype(float)
    front = ds[f"pareto_{name}"].values.astype(bool)
    slo = float(ds.attrs[f"slo_{name}_p99_s"]) * scale
    ax.set_title(f"cost vs p99 {name.upper()}", fontsize=10)
    ax.axvline(slo, color="red", ls="--", lw=1.2)
    if not front.any():
        _empty(ax, "no configuration meets its targets")
        return
    ax.scatter(x, y, s=12, alpha=0.3, color="tab:blue", linewidths=0)
    order = np.argsort(x[front])
    fx, fy = x[front][order], y[front][order]
    # the cheapest cost reachable at each p99: flat up to the SLO past the last
    ax.step(np.r_[fx, max(slo, fx[-1])], np.r_[fy, fy[-1]], where="post",
            color="tab:blue", lw=1.5)
    ax.plot(fx, fy, "o", ms=4, color="tab:blue")
    if chosen is not None:
        at = float(chosen[f"surrogate_{name}_p99_s"]) * scale, float(chosen[COST])
        ax.scatter(*at, marker="*", s=220, color="gold", edgecolors="black",
                   zorder=5)
        ax.annotate(f"{at[1]:.3f}", at, xytext=(7, 7), textcoords="offset points",
                    fontsize=8)
    _log(ax, "x")
    _log(ax)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_xlabel(label(ds[f"config_{name}_p99_s"], scale_ms=scale != 1))
    ax.set_ylabel(label(ds[f"config_{COST}"]))


def optimize_candidates(ds: xr.Dataset) -> Figure:
    """One bar per candidate: its cost, coloured by what the simulator said."""
    cost = ds[COST].values.astype(float)
    order = candidate_order(ds)
    labels, status = candidate_labels(ds), candidate_status(ds)
    fig = Figure(figsize=(8.5, 1.9 + 0.36 * len(order)), layout="constrained")
    ax = fig.subplots()
    width = np.nanmax(cost) if np.isfinite(cost).any() else 1.0
    for y, c in enumerate(order):
        _candidate_bar(ax, y, cost[c], status[c], width, ds["replicas"].values[c])
    ax.set_yticks(range(len(order)), [labels[c] for c in order], fontsize=8)
    for tick, c in zip(ax.get_yticklabels(), order):
        tick.set_fontweight("bold" if status[c] == "chosen" else "normal")
    ax.invert_yaxis()  # cheapest on top
    ax.set_xlim(0, width * 1.4)
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_xlabel(label(ds[COST]))
    _status_legend(fig, status)
    _title(fig, "USD per 1M output tokens per candidate",
           "each candidate's cheapest configuration meeting its surrogate targets "
           "in the last search; " + slo_note(ds))
    return fig


def _status_legend(fig: Figure, status: list[str]) -> None:
    """A legend entry per candidate status present."""
    handles = [Rectangle((0, 0), 1, 1, color=c, label=s)
               for s, c in STATUS_COLORS.items() if s in status]
    if NO_TARGET in status:
        handles.append(Rectangle((0, 0), 1, 1, fill=False, hatch="//",
                                 edgecolor="0.6", label=NO_TARGET))
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles),
               frameon=False, fontsize=8)


def _candidate_bar(ax, y: int, cost: float, status: str, width: float,
                   replicas: float) -> None:
    if status == NO_TARGET:
        ax.barh(y, width, fill=False, hatch="//", edgecolor="0.6", lw=0)
        ax.text(width * 0.02, y, "no configuration meets its surrogate targets",
                va="center", fontsize=7, color="0.3",
                bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})
        return
    chosen = status == "chosen"
    ax.barh(y, cost, color=STATUS_COLORS[status], edgecolor="black",
            lw=1.5 if chosen else 0)
    plural = "s" if replicas != 1 else ""
    ax.text(cost, y, f" {cost:.3f} (x {replicas:g} replica{plural})"
            + (" chosen" if chosen else ""), va="center", fontsize=7,
            fontweight="bold" if chosen else "normal")


@dataclass(frozen=True)
class Chart:
    """A chart of the report: what it draws, from which variables and dims."""

    file: str
    title: str
    needs: tuple[str, ...]  # variables
    dims: tuple[str, ...]  # dims that must exist
    draw: Callable[..., Figure]  # grid cube: (ds, hardware, model, limits);
    # optimize dataset: (ds) -> Figure
    caption: str
    varies: tuple[str, ...] = ()  # drawn only where these dims hold several values


CHARTS = (
    Chart("cost_vs_concurrency.png", "Cost vs concurrency",
          (COST, "kv_fits"), ("hardware", "model", "concurrency"),
          lambda ds, h, m, lim: cost_vs_concurrency(ds),
          "USD per 1M output tokens at full load, per hardware (log-log)."),
    Chart("itl_throughput_vs_concurrency.png", "ITL and throughput vs concurrency",
          (COST, "step_s", "output_tokens_per_s"), ("hardware", "model",
                                                     "concurrency"),
          lambda ds, h, m, lim: itl_throughput_vs_concurrency(ds),
          "Decode step time (= ITL under continuous batching) and output "
          "tokens/s per GPU."),
    Chart("cost_heatmap.png", "Cost over concurrency x token budget",
          (COST, "kv_fits"), ("hardware", "model", "concurrency", "token_budget"),
          lambda ds, h, m, lim: cost_heatmap(ds, h, m, lim),
          "The red line separates the feasible cells from the others."),
    Chart("pareto_front.png", "Pareto front: tokens/s/GPU vs tokens/s/user",
          ("output_tokens_per_s", "user_tokens_per_s"), ("hardware", "model"),
          lambda ds, h, m, lim: pareto_front(ds),
          "Faster users cost throughput; the front is the best trade-off each "
          "hardware offers."),
    Chart("speculative_decoding.png", "Speculative decoding",
          (COST, "tpot_s"),
          ("hardware", "model", "concurrency", "spec_tokens", "spec_acceptance"),
          lambda ds, h, m, lim: speculative_decoding(ds, h, m),
          "Time per output token and cost against the proposals per step k, a "
          "line per acceptance rate a, a column per concurrency. Verifying k "
          "proposals per sequence multiplies a step's FLOPs by k + 1 and its "
          "tokens by (1 - a^(k+1)) / (1 - a): it pays while the step is "
          "memory-bound (low concurrency) and costs once it is compute-bound. "
          "With grid.spec_proposer=[ngram,draft] dotted lines add the draft "
          "model's proposals: its k decode steps per verification step and its "
          "weights and KV make it dearer than n-gram at every point, and it "
          "stops paying at a lower concurrency. With [ngram,eagle3] dash-dotted "
          "lines add an EAGLE-3 head's: one layer, its passes cheaper than a "
          "draft model's.",
          varies=("spec_tokens",)),
    Chart("prefix_caching.png", "Prefix caching",
          ("prefix_hit_fraction", "cost_per_mtok_in_usd", "prefill_tokens_per_s",
           COST, "kv_fits"),
          ("hardware", "model", "prefix_caching"),
          prefix_caching,
          "Cost per 1M input tokens and the p99 TTFT and ITL (or, without a "
          "p99 part, the prefill rate) against the share of each prompt read "
          "from the prefix cache: a hit skips the cached tokens' prefill "
          "compute but not their KV reads, so TTFT and the input cost fall "
          "almost in proportion while the decode cost stays.",
          varies=("prefix_caching",)),
    Chart("disaggregation.png", "Disaggregated prefill/decode",
          (COST, "zero_load_ttft_s"), ("hardware", "model", *DISAGG_DIMS),
          lambda ds, h, m, lim: disaggregation(ds, h, m),
          "Cost and zero-load TTFT against the ratio of prefill to decode "
          "instances: too few decode instances leave prefill capacity idle, too "
          "few prefill ones decode capacity; the KV transfer adds to every "
          "TTFT. The roofline's aggregated engine prefills for free, so the "
          "dashed cost is a floor the simulator-verified comparison "
          "(sweep-optimize search.disaggregated=[false,true]) corrects.",
          varies=("disaggregated",)),
    Chart("prefill_interference.png", "Chunked-prefill interference",
          ("long_prefill_s", "long_prefill_worst_itl_s", "step_s", COST),
          ("hardware", "model", "concurrency", "token_budget"),
          lambda ds, h, m, lim: prefill_interference(ds, h, m),
          "A larger token budget prefills the long prompt in fewer, longer "
          "steps: faster TTFT for it, a worse ITL spike for everyone else."),
)


OPTIMIZE_CHARTS = (
    Chart("pareto.png", "Cost vs p99 latency: the Pareto fronts",
          (f"config_{COST}", "config_itl_p99_s", "config_ttft_p99_s", "pareto_itl",
           "pareto_ttft", COST, "chosen", "surrogate_itl_p99_s",
           "surrogate_ttft_p99_s"), ("candidate", "config"), optimize_pareto,
          "The step line is the cheapest cost the search found at each surrogate "
          "p99; the star is the chosen deployment (log-log)."),
    Chart("candidates.png", "Cost per candidate",
          (COST, "replicas", "chosen", "verified", "slo_met_simulated"),
          ("candidate",), optimize_candidates,
          "Each hardware x model x TP candidate's cheapest answer; the colour "
          "says whether the simulator confirmed it."),
)


def lacking(ds: xr.Dataset, variables, dims) -> list[str]:
    """The variables (coordinates count) and dims of these that ``ds`` lacks."""
    return ([n for n in variables if n not in ds]
            + [f"dim {d}" for d in dims if d not in ds.dims])


def missing(ds: xr.Dataset, chart: Chart) -> list[str]:
    """The variables and dims ``chart`` needs that the cube lacks."""
    return lacking(ds, chart.needs, chart.dims)


def applies(ds: xr.Dataset, chart: Chart) -> bool:
    """Whether the cube sweeps what ``chart`` compares (its ``varies`` dims)."""
    return all(ds.sizes.get(d, 1) > 1 for d in chart.varies)
