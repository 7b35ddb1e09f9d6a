"""``sweep-report CUBE [--out DIR]``: the console script of ``sweep.report.markdown``.

The report goes to ``<cube>.report/`` beside the cube, or to ``--out``; it is
staged beside its target and installed whole (``sweep.cube.outputs``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sweep.cube import outputs
from sweep.report.markdown import ReportError, write_report


def default_out(cube: Path) -> Path:
    """``<cube>.report`` beside the cube: ``c.zarr`` -> ``c.report``, ``c.nc`` ->
    ``c.nc.report``."""
    cube = cube.resolve()
    stem = cube.stem if cube.suffix == ".zarr" else cube.name
    return cube.with_name(stem + ".report")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="sweep-report",
        description="Charts (PNG) and a markdown report of a sweep result cube.")
    p.add_argument("cube", type=Path, help="the cube (a .zarr store)")
    p.add_argument("--out", type=Path, default=None,
                   help="report folder (default: <cube>.report/ beside the cube); "
                   "an existing folder must be empty or an earlier report")
    p.add_argument("--slo", default=None,
                   help="SLO option name (conf/slo/<name>.yaml) for feasibility")
    p.add_argument("--ttft-p99-s", dest="ttft_p99_s", type=float, default=None,
                   help="p99 TTFT limit in seconds")
    p.add_argument("--itl-p99-s", dest="itl_p99_s", type=float, default=None,
                   help="p99 ITL limit in seconds")
    p.add_argument("--max-rejected-fraction", dest="max_rejected_fraction", type=float,
                   default=None,
                   help="largest share of requests a point may reject (prompt + "
                   "output beyond the model's context; default: the cube's "
                   "slo.max_rejected_fraction, 0 unless set)")
    p.add_argument("--hardware", default=None,
                   help="hardware of the single-panel charts (default: cheapest)")
    p.add_argument("--model", default=None,
                   help="model of the single-panel charts (default: cheapest)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """``sweep-report CUBE [--out DIR]``: write ``report.md`` and its charts."""
    args = parse(argv)
    cube = args.cube.expanduser()
    out = (args.out.expanduser() if args.out else default_out(cube)).absolute()
    label = f"--out {args.out}" if args.out else f"report folder {out}"
    try:
        outputs.check_target(out, label, "report")
        with outputs.lock(out), outputs.staged(out) as staged:
            drawn = write_report(cube, staged, args)
            outputs.mark(staged, "report")
            outputs.install(staged, out, "report")
    except (ReportError, outputs.OutputError) as e:
        print(f"sweep-report: error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"sweep-report: {len(drawn)} chart(s) and report.md -> {out}")
