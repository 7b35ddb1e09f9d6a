"""PNG charts and a markdown report of a result cube (``sweep-report``, whose
console script is ``sweep.cli.report``).

The report (``report.md`` and one PNG per chart of ``sweep.report.plots.CHARTS``)
goes to ``<cube>.report/`` beside the cube (``c.zarr`` -> ``c.report/``), so
two cubes in one folder never share one, or to ``--out``. It is written into
a temporary folder beside the target and moved into place only when
complete, so an older report is replaced whole or not at all; the folder it
replaces must be a report of this tool (its ``sweep.cube.outputs.REPORT_MARKER``) or
empty, and one ``sweep-report`` at a time writes it (``sweep.cube.outputs``). A
path that is not a cube, a damaged cube (a chunk missing or unreadable), a
cube without the variables every report needs, or an output folder the tool
must not replace is refused with one line and exit code 2; a chart whose own
variables are missing is skipped and the report says which and why.

The dataset ``sweep-optimize`` writes (``optimize.zarr``: dims ``candidate``,
``config``, ``verification``) gets its own report the same way: the chosen
deployment and its vLLM flags, the candidates, the verification rounds, the
run's log and the charts of ``sweep.report.plots.OPTIMIZE_CHARTS``.
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

import numpy as np
import xarray as xr

from sweep.cube import contract, engines
from sweep.cube.accessor import (
    CONFIG_DIMS,
    REJECTED_LIMIT,
    SLO_FIELDS,
    cube_slo,
    is_optimize,
    load_slo,
)
from sweep.cube.results import DamagedCube, check_chunks, open_cube
from sweep.report import plots

# what the summary table and every chart's reduction rely on
CORE_VARIABLES = ("cost_per_mtok_out_usd", "kv_fits", "step_s", "output_tokens_per_s",
                  "user_tokens_per_s")
CORE_DIMS = ("concurrency",)
PROVENANCE = ("sweep_version", "created_utc", "git_sha", "jax_version", "jax_backend",
              "x64", "seed", "hydra_overrides", "calibration", "calibration_engine",
              "calibration_choice")

# the optimize report's tables (``sweep.search.optimize.to_dataset``): (name, header,
# format); seconds are shown in ms
CHOSEN_COLUMNS = (
    ("chosen_hardware", "hardware", "{}"), ("chosen_model", "model", "{}"),
    ("chosen_tensor_parallel", "TP", "{:g}"), ("chosen_replicas", "replicas", "{:g}"),
    ("chosen_concurrency", "max_num_seqs", "{:g}"),
    ("chosen_token_budget", "max_num_batched_tokens", "{:g}"),
    ("chosen_cost_per_mtok_out_usd", "USD / 1M out", "{:.3f}"),
    ("chosen_cost_per_month_usd", "USD / month", "{:,.0f}"),
    ("chosen_weight_dtype", "weights", "{}"), ("chosen_kv_dtype", "KV cache", "{}"))
CANDIDATE_COLUMNS = (
    ("cost_per_mtok_out_usd", "USD / 1M out", "{:.3f}"),
    ("replicas", "replicas", "{:g}"), ("concurrency", "max_num_seqs", "{:g}"),
    ("token_budget", "max_num_batched_tokens", "{:g}"),
    ("surrogate_ttft_p99_s", "TTFT p99 surrogate (ms)", "{:.1f}"),
    ("simulated_ttft_p99_s", "TTFT p99 simulated (ms)", "{:.1f}"),
    ("surrogate_itl_p99_s", "ITL p99 surrogate (ms)", "{:.2f}"),
    ("simulated_itl_p99_s", "ITL p99 simulated (ms)", "{:.2f}"),
    ("ttft_slack_s", "TTFT slack (ms)", "{:.1f}"),
    ("itl_slack_s", "ITL slack (ms)", "{:.2f}"))
VERIFICATION_COLUMNS = (
    ("verification_replicas", "replicas", "{:g}"),
    ("verification_concurrency", "max_num_seqs", "{:g}"),
    ("verification_token_budget", "max_num_batched_tokens", "{:g}"),
    ("verification_ttft_target_s", "TTFT target (ms)", "{:.1f}"),
    ("verification_surrogate_ttft_p99_s", "TTFT p99 surrogate (ms)", "{:.1f}"),
    ("verification_simulated_ttft_p99_s", "TTFT p99 simulated (ms)", "{:.1f}"),
    ("verification_itl_target_s", "ITL target (ms)", "{:.2f}"),
    ("verification_surrogate_itl_p99_s", "ITL p99 surrogate (ms)", "{:.2f}"),
    ("verification_simulated_itl_p99_s", "ITL p99 simulated (ms)", "{:.2f}"))
# what every optimize report relies on
OPTIMIZE_VARIABLES = ("hardware", "model", "tensor_parallel", "chosen", "verified",
                      "slo_met_simulated", "config_cost_per_mtok_out_usd",
                      "verification_round", "verification_candidate",
                      "verification_slo_met",
                      *(c[0] for c in CANDIDATE_COLUMNS + VERIFICATION_COLUMNS))
OPTIMIZE_DIMS = ("candidate", "config", "verification")
OPTIMIZE_ATTRS = ("slo_ttft_p99_s", "slo_itl_p99_s")
# an aggregated choice's (absent when only a disaggregated deployment met the SLO)
CHOSEN_ATTRS = (*(c[0] for c in CHOSEN_COLUMNS), "vllm_flags")
# the disaggregated search's choice (``sweep.search.disaggregate.annotate``)
DISAGGREGATED_COLUMNS = (
    ("disaggregated_hardware", "hardware", "{}"),
    ("disaggregated_model", "model", "{}"),
    ("disaggregated_prefill_tensor_parallel", "prefill TP", "{:g}"),
    ("disaggregated_decode_tensor_parallel", "decode TP", "{:g}"),
    ("disaggregated_prefill_instances", "prefill instances", "{:g}"),
    ("disaggregated_decode_instances", "decode instances", "{:g}"),
    ("disaggregated_concurrency", "max_num_seqs", "{:g}"),
    ("disaggregated_token_budget", "max_num_batched_tokens", "{:g}"),
    ("disaggregated_cost_per_mtok_out_usd", "USD / 1M out", "{:.3f}"),
    ("disaggregated_cost_per_month_usd", "USD / month", "{:,.0f}"))
GRID_OPTIONS = ("slo", "ttft_p99_s", "itl_p99_s", "hardware", "model")


class ReportError(ValueError):
    """Bad input to the report: one line for the user."""


def load(path: Path) -> xr.Dataset:
    """Opens the cube (lazily: each chart and table reads what it reduces); a
    leading hardware/model dim is added if absent.

    The dataset of ``sweep-optimize`` (small) is loaded, checked for what its
    report needs and returned as it is.
    """
    try:
        ds = open_cube(path)
    except DamagedCube as e:
        raise ReportError(str(e)) from e
    except Exception as e:  # whatever the store's reader says, the path is no cube
        raise ReportError(f"{path} is not a result cube "
                          f"({type(e).__name__}: {str(e).splitlines()[0]})") from e
    if is_optimize(ds):
        with decoding(path):
            ds = ds.load()
        # only a disaggregated deployment met the SLO: no aggregated choice
        alone = ("chosen" in ds and not ds["chosen"].values.any()
                 and ds.attrs.get("deployment") == "disaggregated")
        require(path, ds, "optimize dataset", OPTIMIZE_VARIABLES, OPTIMIZE_DIMS,
                OPTIMIZE_ATTRS + (() if alone else CHOSEN_ATTRS))
        if not alone and not ds["chosen"].values.any():
            raise ReportError(f"{path}: no candidate of the optimize dataset is "
                              "marked chosen")
        return ds
    require(path, ds, "cube", CORE_VARIABLES, CORE_DIMS)
    for d in ("hardware", "model"):
        if d not in ds.dims:
            value = str(ds[d].values) if d in ds.coords else "-"
            ds = ds.drop_vars(d, errors="ignore").expand_dims({d: [value]})
    return ds


@contextlib.contextmanager
def decoding(path: Path):
    """Names the damaged chunk when reading the cube fails: a chunk changed in
    place (its length kept) fails only when decoded."""
    try:
        yield
    except ReportError:
        raise
    except Exception as e:
        try:
            check_chunks(path, decode=True)
        except DamagedCube as damaged:
            raise ReportError(str(damaged)) from e
        raise


def require(path: Path, ds: xr.Dataset, what: str, variables, dims,
            attrs=()) -> None:
    """Refuses ``ds`` when it lacks any of these variables, dims or attributes."""
    lacking = plots.lacking(ds, variables, dims) + [
        f"attribute {a}" for a in attrs if a not in ds.attrs]
    if lacking:
        raise ReportError(f"{path}: the {what} lacks {', '.join(lacking)} "
                          "(needed by every report)")


def slo_limits(ds: xr.Dataset, args: argparse.Namespace) -> tuple[dict, str]:
    """The limits to apply: the command line's, else the cube config's SLO
    (the rejected share the cube's where the command line sets none)."""
    limits, source = {}, "command line"
    try:
        if args.slo:
            limits = load_slo(args.slo)
        for name in (*SLO_FIELDS, REJECTED_LIMIT):
            if getattr(args, name) is not None:
                limits[name] = getattr(args, name)
        own = cube_slo(ds)
        if not limits:
            source = "the cube's config"
            limits = own
        elif REJECTED_LIMIT not in limits and REJECTED_LIMIT in own:
            # p99 limits of the command line, the rejected share of the cube's
            limits[REJECTED_LIMIT] = own[REJECTED_LIMIT]
        ds.sweep.feasible_mask(**limits)  # checks the limits against the cube
    except ValueError as e:
        raise ReportError(f"{source}: {e}") from e
    return limits, source if limits else "none"


def summary(ds: xr.Dataset, limits: dict) -> tuple[str, xr.Dataset]:
    """Markdown table of the cheapest feasible point per hardware x model."""
    # fixed first: the mask is then computed on the slice only
    fixed = plots.scenario(ds)[0].sweep.feasible(**limits)
    over = [d for d in CONFIG_DIMS if d in fixed.dims]
    best = fixed.sweep.cheapest(over) if over else fixed
    shown = ("cost_per_mtok_out_usd", "step_s", "ttft_p99_s", "itl_p99_s",
             "user_tokens_per_s", "output_tokens_per_s", "cost_per_mtok_in_usd",
             "replicas", *(f"best_{d}" for d in over),
             *(contract.sensitivity(p, of) for of in contract.SENSITIVITY_OF
               for p, _ in contract.SENSITIVITY))
    # the reduced cube only, and of it only the columns: one read of each
    best = best[[v for v in shown if v in best]].compute()
    tp = best["best_tensor_parallel"] if "best_tensor_parallel" in best else 1
    best = best.assign({plots.PER_GPU: plots.per_gpu(best["output_tokens_per_s"], tp)})
    best = best.transpose("hardware", "model", ...)
    cols = [("hardware", None, "{}"), ("model", None, "{}")]
    cols += [(f"best_{d}", d, "{}" if contract.AXIS[d].kind == contract.LABEL
              else "{:g}") for d in over]
    cols += [("step_s", "ITL (ms)", "{:.2f}")]
    cols += [(v, f"{v.split('_')[0].upper()} p99 (ms)", "{:.1f}")
             for v in ("ttft_p99_s", "itl_p99_s") if v in best]
    cols += [("user_tokens_per_s", "tokens/s/user", "{:,.0f}"),
             (plots.PER_GPU, "tokens/s/GPU", "{:,.0f}"),
             ("cost_per_mtok_out_usd", "USD / 1M out", "{:.3f}")]
    optional = (("cost_per_mtok_in_usd", "USD / 1M in", "{:.3f}"),
                ("replicas", "replicas", "{:g}"))
    cols += [(v, h, f) for v, h, f in optional if v in best]
    rows = []
    for h in best["hardware"].values:
        for m in best["model"].values:
            pt = best.sel(hardware=h, model=m)
            cost = float(pt["cost_per_mtok_out_usd"])
            cells = []
            for var, _, fmt in cols:
                if var in ("hardware", "model"):
                    cells.append(str(pt[var].values))
                    continue
                cells.append(cell(pt[var].values.item(), fmt, var))
            rows.append((np.inf if np.isnan(cost) else cost, cells))
    rows.sort(key=lambda r: r[0])
    head = [c[1] or c[0] for c in cols]
    return "\n".join(md_table(head, [cells for _, cells in rows])), best


def cell(val, fmt: str, var: str = "") -> str:
    """One table cell: NaN or empty as a dash; a time ``var`` (``*_s``) in ms."""
    scale = 1e3 if var.endswith("_s") and not var.endswith("per_s") else 1
    ok = isinstance(val, str) or np.isfinite(val)
    return fmt.format(val * scale if scale != 1 else val) if ok and val != "" else "—"


def md_table(head: list[str], rows: list[list[str]]) -> list[str]:
    """The lines of a markdown table."""
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(cells) + " |" for cells in rows)]


def focus(best: xr.Dataset, args: argparse.Namespace) -> tuple[str, str]:
    """The hardware x model the single-panel charts show."""
    cost = best["cost_per_mtok_out_usd"].transpose("hardware", "model").values
    if np.isfinite(cost).any():
        i, j = np.unravel_index(np.nanargmin(cost), cost.shape)
    else:
        i, j = 0, 0
    h = args.hardware or str(best["hardware"].values[i])
    m = args.model or str(best["model"].values[j])
    for name, value in (("hardware", h), ("model", m)):
        if value not in best[name].values:
            raise ReportError(f"--{name} {value}: not in the cube; one of "
                              f"{', '.join(map(str, best[name].values))}")
    return h, m


def why_focus(best: xr.Dataset, args: argparse.Namespace) -> str:
    """Why ``focus`` chose its pair, in words."""
    if args.hardware and args.model:
        return "as asked"
    if not np.isfinite(best["cost_per_mtok_out_usd"].values).any():
        return "the first pair: no point is feasible"
    asked = ", as asked" if args.hardware or args.model else ""
    return f"the cheapest feasible pair{asked}"


def serving_line(ds: xr.Dataset, best: xr.Dataset, h: str, m: str) -> str:
    """vLLM flags of the best point of ``h`` x ``m`` (a markdown line)."""
    pt = best.sel(hardware=h, model=m)
    if not np.isfinite(float(pt["cost_per_mtok_out_usd"])):
        return f"No point of {h} x {m} is feasible."
    sel = {"hardware": h, "model": m}
    for d in ds.dims:
        if f"best_{d}" in pt:
            sel[d] = pt[f"best_{d}"].values.item()
        elif d not in sel and d in pt.coords:
            sel[d] = pt[d].values.item()
    try:
        flags = ds.sweep.to_serving_flags(**sel)
    except ValueError as e:
        return f"No vLLM flags for the best point of {h} x {m}: {e}."
    replicas = f", x {flags.replicas} replica(s)" if flags.replicas else ""
    notes = "".join(f"; {note}" for note in flags.notes)
    return (f"vLLM flags for the cheapest point of {h} x {m}: `{flags.cli}`"
            f"{replicas}{notes}")


SHORT = {"memory_bandwidth_bytes_per_s": "memory bandwidth",
         "peak_flops_per_s": "peak FLOP/s", "interconnect_bytes_per_s": "interconnect",
         "step_overhead_s": "step overhead", "sequence_overhead_s": "sequence overhead"}
"""How the sensitivity line names each constant of ``contract.SENSITIVITY``."""


def _ten_percent_more(e: float, what: str = "cost") -> str:
    """What 10 % more of a constant of elasticity ``e`` does to a figure:
    ``1.1^e - 1`` (exact where the figure is a power of it, first-order
    otherwise)."""
    change = (1.1**e - 1.0) * 100.0
    if abs(change) < 0.05:
        return f"leaves its {what} unchanged"
    return f"{'lowers' if change < 0 else 'raises'} its {what} by {abs(change):.1f} %"


def _p99_effects(pt: xr.Dataset) -> str:
    """The sentence on the p99s' elasticities of a point (``grid.sensitivity``
    under the surrogate), or empty."""
    said = []
    for of, what in (("ttft_p99_s", "p99 TTFT"), ("itl_p99_s", "p99 ITL")):
        names = [contract.sensitivity(p, of) for p in ("memory_bandwidth_bytes_per_s",
                                                       "peak_flops_per_s")]
        e = [float(pt[n]) if n in pt else np.nan for n in names]
        if np.isfinite(e).all():
            said.append(f"10 % more memory bandwidth {_ten_percent_more(e[0], what)}"
                        f" and 10 % more peak FLOP/s {_ten_percent_more(e[1], what)}"
                        f" (`{names[0]}` {e[0]:+.3f}, `{names[1]}` {e[1]:+.3f})")
    return (" At its arrival rate, by the surrogate: " + "; ".join(said) + "."
            if said else "")


def sensitivity_line(best: xr.Dataset, h: str, m: str) -> str:
    """What 10 % more memory bandwidth and FLOP/s would do to the cost (and,
    where the cube has them, the p99s) of the cheapest feasible point of
    ``h`` x ``m``, from its elasticities (a markdown line; empty for a cube
    without them)."""
    pt = best.sel(hardware=h, model=m)
    names = {p: contract.sensitivity(p) for p, _ in contract.SENSITIVITY}
    if any(n not in pt for n in names.values()) or not np.isfinite(
            float(pt["cost_per_mtok_out_usd"])):
        return ""
    e = {p: float(pt[n]) for p, n in names.items()}
    listed = ", ".join(f"{SHORT.get(p, p)} {v:+.3f}" for p, v in e.items())
    return (f"Sensitivity of the cheapest feasible point of {h} x {m} "
            f"({float(pt['cost_per_mtok_out_usd']):.3f} USD / 1M output tokens): "
            f"10 % more memory bandwidth "
            f"{_ten_percent_more(e['memory_bandwidth_bytes_per_s'])}, 10 % more peak "
            f"FLOP/s {_ten_percent_more(e['peak_flops_per_s'])}. Elasticities "
            f"d ln cost / d ln x (`d_cost_d_*`): {listed}; 10 % more of x changes "
            "the cost by "
            "1.1^e - 1 (exact where the cost is a power of x, first-order "
            "otherwise)." + _p99_effects(pt))


def write_report(path: Path, out: Path, args: argparse.Namespace) -> list[str]:
    """Writes charts and ``report.md`` into ``out`` (which must be new and empty).

    Returns:
      The file names of the charts drawn.
    """
    ds = load(path)
    if is_optimize(ds):
        return write_optimize_report(ds, path, out, args)
    with decoding(path):
        return write_cube_report(ds, path, out, args)


def write_cube_report(ds: xr.Dataset, path: Path, out: Path,
                      args: argparse.Namespace) -> list[str]:
    """``write_report`` for a grid cube."""
    limits, limits_from = slo_limits(ds, args)
    table, best = summary(ds, limits)
    h, m = focus(best, args)
    drawn, skipped, sections = draw_charts(plots.CHARTS, "cube", out, ds, h, m,
                                           limits)
    _, notes = plots.scenario(ds)
    criterion = ds.sweep.feasible_mask(**limits).attrs["feasible"]
    sensitivity = sensitivity_line(best, h, m)
    dims = []
    for d in ds.dims:
        values = [plots.format_value(v) for v in ds[d].values]
        shown = ", ".join(values if len(values) <= 8 else values[:3] + ["…"]
                          + values[-2:])
        dims.append([d, shown])
    md = [f"# Sweep report: {path.name}", "",
          f"Cube `{path}`: {int(np.prod(list(ds.sizes.values()))):,} points.", "",
          *md_table(["dim", "values"], dims), "", *provenance(ds)]
    md += ["", "## How the cube is reduced", "",
           f"- fixed: {'; '.join(notes) or 'nothing'}",
           "- deployment choices not on a chart's axes: the cheapest point (USD per "
           "1M output tokens) among those that fit; ties go to the first value",
           f"- feasible means: {criterion}"
           + (f" (p99 limits from {limits_from})" if limits else ""),
           f"- single-panel charts show {h} x {m} ({why_focus(best, args)})",
           *(f"- {line}" for line in ds.attrs.get("trace_replay", "").splitlines()),
           "",
           "## Cheapest feasible configuration per hardware x model", "", table, "",
           serving_line(ds, best, h, m), "",
           *([sensitivity, ""] if sensitivity else []),
           "## Charts", "", *sections]
    if skipped:
        md += ["## Skipped charts", "", *skipped, ""]
    (out / "report.md").write_text("\n".join(md) + "\n")
    return drawn


def draw_charts(charts, what: str, out: Path, ds: xr.Dataset, *args
                ) -> tuple[list[str], list[str], list[str]]:
    """Draws into ``out`` each chart whose variables ``ds`` has (a chart that
    compares values of an axis the cube does not sweep is left out silently).

    Args:
      what: the dataset, as the skipped charts' lines name it.
      args: the charts' arguments after ``ds``.

    Returns:
      The files drawn, a line per chart skipped, a report section per chart drawn.
    """
    drawn, skipped, sections = [], [], []
    for chart in (c for c in charts if plots.applies(ds, c)):
        lacking = plots.missing(ds, chart)
        if lacking:
            skipped.append(f"- {chart.title}: the {what} lacks {', '.join(lacking)}")
            continue
        fig = chart.draw(ds, *args)
        fig.savefig(out / chart.file, dpi=130)
        drawn.append(chart.file)
        sections.append(f"### {chart.title}\n\n![{chart.title}]({chart.file})\n\n"
                        f"{chart.caption}\n")
    return drawn, skipped, sections


def provenance(ds: xr.Dataset) -> list[str]:
    """The report's provenance section: the run's attributes and its config."""
    md = ["## Provenance", "", *md_table(
        ["attribute", "value"],
        [[k, f"`{ds.attrs[k]}`"] for k in PROVENANCE if k in ds.attrs])]
    if "config_yaml" in ds.attrs:
        md += ["", "<details><summary>resolved config</summary>", "", "```yaml",
               ds.attrs["config_yaml"].rstrip(), "```", "", "</details>"]
    return md


def write_optimize_report(ds: xr.Dataset, path: Path, out: Path,
                          args: argparse.Namespace) -> list[str]:
    """Writes the charts and ``report.md`` of a ``sweep-optimize`` dataset."""
    grid_only = [f"--{n.replace('_', '-')}" for n in GRID_OPTIONS
                 if getattr(args, n) is not None]
    if grid_only:
        raise ReportError(f"{path} is an optimize dataset; {', '.join(grid_only)}: "
                          "for grid cubes only")
    drawn, skipped, sections = draw_charts(plots.OPTIMIZE_CHARTS, "dataset", out, ds)
    a = ds.attrs
    excluded = a.get("excluded_candidates", "")
    md = [f"# Optimize report: {path.name}", "",
          f"Dataset `{path}` of `sweep-optimize`: {ds.sizes['candidate']} "
          f"candidate(s), {ds.sizes['config']:,} configuration(s) of the last "
          f"search meeting their targets, {ds.sizes['verification']} simulated; "
          f"{plots.slo_note(ds)}.", "",
          "## Chosen deployment", "", *chosen_table(ds), "",
          *((*engine_lines(a), "") if "vllm_flags" in a else ()),
          *disaggregated_section(a),
          "## Candidates", "",
          "Each candidate's cheapest configuration meeting its surrogate targets "
          "in the last search (the chosen candidate's: the chosen deployment); "
          "slack = SLO - p99, simulated where simulated, else surrogate.", "",
          *candidate_table(ds), "",
          *([f"Excluded (do not fit): {excluded}.", ""] if excluded else []),
          "## Verification rounds", "", *verification_table(ds), "",
          "## Run log", "", "```", a.get("log", "").rstrip(), "```", "",
          *provenance(ds), "", "## Charts", "", *sections]
    if skipped:
        md += ["## Skipped charts", "", *skipped, ""]
    (out / "report.md").write_text("\n".join(md) + "\n")
    return drawn


def engine_lines(a: dict) -> list[str]:
    """The chosen deployment's flags per engine and the benchmark that checks
    it (datasets written before these attributes existed show vLLM's only)."""
    lines = [f"* {e.label} flags: `{a[f'{name}_flags']}`"
             + "".join(f"; {note}" for note in a.get(f"{name}_notes", "").split("\n")
                       if note)
             for name, e in engines.ENGINES.items() if f"{name}_flags" in a]
    if "vllm_bench_command" in a:
        lines += ["", "Check it on one replica (p50/p99 TTFT, TPOT and ITL, and the "
                  "share of requests meeting the SLO as goodput):", "",
                  "```", a["vllm_bench_command"], "```"]
    return lines


def attrs_table(attrs: dict, columns) -> list[str]:
    """A one-row table of the attributes ``columns`` names (``(attribute,
    heading, format)``); a missing one (a dataset written before it existed)
    shows a dash."""
    return md_table([c[1] for c in columns],
                    [[cell(attrs.get(k, ""), fmt) for k, _, fmt in columns]])


def chosen_table(ds: xr.Dataset) -> list[str]:
    """The chosen aggregated deployment (the dataset's ``chosen_*`` attributes)."""
    if not ds["chosen"].values.any():
        return ["No aggregated deployment met the SLO in the simulator; a "
                "disaggregated one did (below)."]
    return attrs_table(ds.attrs, CHOSEN_COLUMNS)


def disaggregated_section(a: dict) -> list[str]:
    """The disaggregated search's verdict, its deployment and both pools'
    flags (empty when the run did not search disaggregated deployments)."""
    if "deployment_verdict" not in a:
        return []
    lines = ["## Disaggregated prefill/decode", "", a["deployment_verdict"] + ".", ""]
    if "disaggregated_hardware" in a:
        lines += [*attrs_table(a, DISAGGREGATED_COLUMNS),
                  "", *(line for name, engine in engines.ENGINES.items()
                        for line in _pool_lines(a, name, engine.label)), ""]
    return lines


def _pool_lines(a: dict, name: str, label: str) -> list[str]:
    """One engine's flags for both pools and what they leave out (datasets
    written before the other engines' pool flags existed show vLLM's only)."""
    notes = [n for n in a.get(f"disaggregated_{name}_notes", "").split("\n") if n]
    return [*(f"* {label} {pool} pool flags: `{a[key]}`"
              for pool in ("prefill", "decode")
              if (key := f"disaggregated_{pool}_{name}_flags") in a),
            *(f"  * {note}" for note in notes)]


def _cells(ds: xr.Dataset, cols, i: int) -> list[str]:
    return [cell(ds[v].values[i], fmt, v) for v, _, fmt in cols]


def candidate_table(ds: xr.Dataset) -> list[str]:
    """The candidates, cheapest first, each with its status."""
    labels, status = plots.candidate_labels(ds), plots.candidate_status(ds)
    return md_table(["candidate", "status", *(c[1] for c in CANDIDATE_COLUMNS)],
                    [[labels[i], status[i], *_cells(ds, CANDIDATE_COLUMNS, i)]
                     for i in plots.candidate_order(ds)])


def verification_table(ds: xr.Dataset) -> list[str]:
    """Each simulation in order: round, configuration, targets, p99s, verdict."""
    labels = plots.candidate_labels(ds)
    rows = [[f"{ds['verification_round'].values[i]:g}",
             labels[int(ds["verification_candidate"].values[i])],
             *_cells(ds, VERIFICATION_COLUMNS, i),
             "yes" if ds["verification_slo_met"].values[i] else "no"]
            for i in range(ds.sizes["verification"])]
    return md_table(["round", "candidate", *(c[1] for c in VERIFICATION_COLUMNS),
                     "SLO met"], rows)
