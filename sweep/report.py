"""``sweep-report CUBE``: PNG charts and a markdown report of a result cube.

The report (``report.md`` and one PNG per chart of ``sweep.plots.CHARTS``) is
written into a temporary folder beside the target and moved into place only
when complete, so an older report is replaced whole or not at all. A path
that is not a cube, or a cube without the variables every report needs, is
refused with one line and exit code 2; a chart whose own variables are
missing is skipped and the report says which and why.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import xarray as xr

from sweep import plots
from sweep.accessor import CONFIG_DIMS, SLO_FIELDS, cube_slo, load_slo
from sweep.results import open_cube

# what the summary table and every chart's reduction rely on
CORE_VARIABLES = ("cost_per_mtok_out_usd", "kv_fits", "step_s", "output_tokens_per_s",
                  "user_tokens_per_s")
CORE_DIMS = ("concurrency",)
PROVENANCE = ("sweep_version", "created_utc", "git_sha", "jax_version", "jax_backend",
              "x64", "seed", "hydra_overrides")


class ReportError(ValueError):
    """Bad input to the report: one line for the user."""


def load(path: Path) -> xr.Dataset:
    """Opens and loads the cube; a leading hardware/model dim is added if absent."""
    try:
        ds = open_cube(path)
    except Exception as e:  # whatever the store's reader says, the path is no cube
        raise ReportError(f"{path} is not a result cube "
                          f"({type(e).__name__}: {str(e).splitlines()[0]})") from e
    lacking = [v for v in CORE_VARIABLES if v not in ds.data_vars] + [
        f"dim {d}" for d in CORE_DIMS if d not in ds.dims]
    if lacking:
        raise ReportError(f"{path}: the cube lacks {', '.join(lacking)} "
                          "(needed by every report)")
    for d in ("hardware", "model"):
        if d not in ds.dims:
            value = str(ds[d].values) if d in ds.coords else "-"
            ds = ds.drop_vars(d, errors="ignore").expand_dims({d: [value]})
    return ds.load()


def slo_limits(ds: xr.Dataset, args: argparse.Namespace) -> tuple[dict, str]:
    """The p99 limits to apply: the command line's, else the cube config's SLO."""
    limits, source = {}, "command line"
    try:
        if args.slo:
            limits = load_slo(args.slo)
        for name in SLO_FIELDS:
            if getattr(args, name) is not None:
                limits[name] = getattr(args, name)
        if not limits:
            source = "the cube's config"
            limits = cube_slo(ds)
        ds.sweep.feasible_mask(**limits)  # checks the limits against the cube
    except ValueError as e:
        raise ReportError(f"{source}: {e}") from e
    return limits, source if limits else "none"


def summary(ds: xr.Dataset, limits: dict) -> tuple[str, xr.Dataset]:
    """Markdown table of the cheapest feasible point per hardware x model."""
    fixed, _ = plots.scenario(ds.sweep.feasible(**limits))
    over = [d for d in CONFIG_DIMS if d in fixed.dims]
    best = fixed.sweep.cheapest(over) if over else fixed
    tp = best["best_tensor_parallel"] if "best_tensor_parallel" in best else 1
    best = best.assign({plots.PER_GPU: plots.per_gpu(best["output_tokens_per_s"], tp)})
    best = best.transpose("hardware", "model", ...)
    cols = [("hardware", None, "{}"), ("model", None, "{}")]
    cols += [(f"best_{d}", d, "{:g}" if d != "batching" else "{}") for d in over]
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
                val = pt[var].values.item()
                scale = 1e3 if var.endswith("_s") and not var.endswith("per_s") else 1
                ok = isinstance(val, str) or np.isfinite(val)
                cells.append(fmt.format(val * scale if scale != 1 else val)
                             if ok and val != "" else "—")
            rows.append((np.inf if np.isnan(cost) else cost, cells))
    rows.sort(key=lambda r: r[0])
    head = [c[1] or c[0] for c in cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cells) + " |" for _, cells in rows]
    return "\n".join(lines), best


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
    return f"vLLM flags for the cheapest point of {h} x {m}: `{flags.cli}`{replicas}"


def write_report(path: Path, out: Path, args: argparse.Namespace) -> list[str]:
    """Writes charts and ``report.md`` into ``out`` (which must be new and empty).

    Returns:
      The file names of the charts drawn.
    """
    ds = load(path)
    limits, limits_from = slo_limits(ds, args)
    table, best = summary(ds, limits)
    h, m = focus(best, args)
    drawn, skipped, sections = [], [], []
    for chart in plots.CHARTS:
        lacking = plots.missing(ds, chart)
        if lacking:
            skipped.append(f"- {chart.title}: the cube lacks {', '.join(lacking)}")
            continue
        fig = chart.draw(ds, h, m, limits)
        fig.savefig(out / chart.file, dpi=130)
        drawn.append(chart.file)
        sections.append(f"### {chart.title}\n\n![{chart.title}]({chart.file})\n\n"
                        f"{chart.caption}\n")
    _, notes = plots.scenario(ds)
    criterion = ds.sweep.feasible_mask(**limits).attrs["feasible"]
    md = [f"# Sweep report: {path.name}", "",
          f"Cube `{path}`: {int(np.prod(list(ds.sizes.values()))):,} points.", "",
          "| dim | values |", "|---|---|"]
    for d in ds.dims:
        values = [plots._fmt(v) for v in ds[d].values]
        shown = ", ".join(values if len(values) <= 8 else values[:3] + ["…"]
                          + values[-2:])
        md.append(f"| {d} | {shown} |")
    md += ["", "## Provenance", "", "| attribute | value |", "|---|---|"]
    md += [f"| {k} | `{ds.attrs[k]}` |" for k in PROVENANCE if k in ds.attrs]
    if "config_yaml" in ds.attrs:
        md += ["", "<details><summary>resolved config</summary>", "", "```yaml",
               ds.attrs["config_yaml"].rstrip(), "```", "", "</details>"]
    md += ["", "## How the cube is reduced", "",
           f"- fixed: {'; '.join(notes) or 'nothing'}",
           "- deployment choices not on a chart's axes: the cheapest point (USD per "
           "1M output tokens) among those that fit; ties go to the first value",
           f"- feasible means: {criterion}"
           + (f" (p99 limits from {limits_from})" if limits else ""),
           f"- single-panel charts show {h} x {m} (the cheapest feasible pair"
           f"{', as asked' if args.hardware or args.model else ''})", "",
           "## Cheapest feasible configuration per hardware x model", "", table, "",
           serving_line(ds, best, h, m), "", "## Charts", "", *sections]
    if skipped:
        md += ["## Skipped charts", "", *skipped, ""]
    (out / "report.md").write_text("\n".join(md) + "\n")
    return drawn


def replace_dir(staged: Path, target: Path) -> None:
    """Moves ``staged`` to ``target``, replacing an older folder whole."""
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
    os.replace(staged, target)
    if old is not None:
        shutil.rmtree(old)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="sweep-report",
        description="Charts (PNG) and a markdown report of a sweep result cube.")
    p.add_argument("cube", type=Path, help="the cube (a .zarr store)")
    p.add_argument("--out", type=Path, default=None,
                   help="report folder (default: report/ beside the cube)")
    p.add_argument("--slo", default=None,
                   help="SLO option name (conf/slo/<name>.yaml) for feasibility")
    p.add_argument("--ttft-p99-s", dest="ttft_p99_s", type=float, default=None,
                   help="p99 TTFT limit in seconds")
    p.add_argument("--itl-p99-s", dest="itl_p99_s", type=float, default=None,
                   help="p99 ITL limit in seconds")
    p.add_argument("--hardware", default=None,
                   help="hardware of the single-panel charts (default: cheapest)")
    p.add_argument("--model", default=None,
                   help="model of the single-panel charts (default: cheapest)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """``sweep-report CUBE [--out DIR]``: write ``report.md`` and its charts."""
    args = parse(argv)
    cube = args.cube.expanduser()
    out = (args.out or cube.resolve().parent / "report").expanduser().resolve()
    if out.exists() and not out.is_dir():
        print(f"sweep-report: error: --out {out} exists and is not a folder",
              file=sys.stderr)
        sys.exit(2)
    out.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        drawn = write_report(cube, staged, args)
        replace_dir(staged, out)
    except ReportError as e:
        print(f"sweep-report: error: {e}", file=sys.stderr)
        sys.exit(2)
    finally:
        if staged.exists():
            shutil.rmtree(staged)
    print(f"sweep-report: {len(drawn)} chart(s) and report.md -> {out}")
