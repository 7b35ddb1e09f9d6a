"""Composing a grid whose axis is a long list given on the command line.

Hydra's override grammar looks up a list's elements from its start each time
(quadratic in the list's length); ``sweep.config.resolve.stash_lists`` parses
plain-number lists itself and hands Hydra a placeholder. This times, in one
process, ``hydra.compose`` on the raw override (the baseline: what every
composition of the config cost before) against ``grid_options`` (the whole
preflight composition, stash included), for lists of ``--sizes`` values.

    python benchmarks/config_parse.py [--sizes 1000 5000 10000 100000]

The baseline is skipped above ``--baseline-max`` values (it takes minutes).
"""

from __future__ import annotations

import argparse
import time

from hydra import compose, initialize_config_module

from sweep.config.resolve import grid_options
from sweep.config.store import register_configs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1000, 5000, 10000, 100000])
    p.add_argument("--baseline-max", type=int, default=10000)
    args = p.parse_args()
    register_configs()
    fixed = ["hardware=h100_sxm", "model=qwen3_8b"]
    with initialize_config_module("sweep.conf", version_base="1.3"):
        for n in args.sizes:
            axis = "grid.concurrency=[" + ",".join(str(i + 1) for i in range(n)) + "]"
            t0 = time.perf_counter()
            base, _ = grid_options("grid", [*fixed, axis])
            ours = time.perf_counter() - t0
            assert len(base.grid.axes["concurrency"]) == n
            line = f"{n:>7,} values: grid_options {ours:6.2f} s"
            if n <= args.baseline_max:
                t0 = time.perf_counter()
                compose(config_name="grid", overrides=[*fixed, axis])
                hydra_s = time.perf_counter() - t0
                line += (f"; one hydra.compose of the raw override {hydra_s:6.2f} s "
                         f"({hydra_s / ours:.1f}x grid_options)")
            print(line, flush=True)


if __name__ == "__main__":
    main()
