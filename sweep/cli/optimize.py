"""``sweep-optimize``: the cheapest deployment within a p99 SLO, and its flags.

As every console script (``sweep.cli.commands``): the config is composed and
checked before
Hydra creates a run directory (bad input: one line, exit code 2), then
``@hydra.main`` runs the job (``sweep.search.optimize``). An SLO that nothing meets
prints one line naming the binding constraint and exits with code 3; the
dataset is not written then.

Compiled programs are kept in JAX's persistent compilation cache
(``sweep.cli.commands.enable_compilation_cache``): the search and the
simulator take tens of seconds to compile on a small CPU, and a second run
with the same shapes skips that.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

from sweep.cli.commands import CONFIG_MODULE, Command, check_output, overrides
from sweep.config.resolve import config_yaml, restore
from sweep.cube import engines, outputs
from sweep.grid import calibration
from sweep.grid.plan import optimize_plan

INFEASIBLE_EXIT = 3


def check(app: str, argv: list[str]):
    """The preflight: compose, check and prepare the job (no JAX work).

    Raises:
      ConfigError: one line naming the field, its value and what is allowed.
    """
    from sweep.search import optimize

    base, hardware, models = optimize.options(app, argv)
    return optimize.prepare(base, hardware, models)


COMMAND = Command("sweep-optimize", "optimize", check, kind="optimize",
                  default_name="optimize.zarr", resume=False)


def _ms(x: float) -> str:
    return "-" if x != x else f"{x * 1e3:,.1f}"


def _pair(metrics, name: str) -> str:
    if metrics is None:
        return "not simulated"
    return f"{_ms(metrics[name + '_p50_s'])} / {_ms(metrics[name + '_p99_s'])}"


def result_table(job, out) -> Table:
    """The chosen configuration first, then the other candidates by cost."""
    from sweep.search.optimize import met, model_label

    slo = job.app.slo
    table = Table(title=f"cheapest deployment of {job.app.workload.name} at "
                  f"{job.app.workload.arrival_rate_per_s:g} req/s within p99 TTFT "
                  f"{slo.ttft_p99_s:g} s, p99 ITL {slo.itl_p99_s * 1e3:g} ms")
    models = len({model_label(c.model) for c in job.candidates}) > 1
    cols = ["", "hardware", *(["model"] if models else []), "TP", "replicas",
            "max seqs", "max batched tok", "USD/1M out", "USD/month",
            "TTFT p50/p99 ms: surrogate | sim", "ITL p50/p99 ms: surrogate | sim",
            "slack TTFT | ITL ms"]
    for col in cols:
        left = col in ("", "hardware", "model")
        table.add_column(col, justify="left" if left else "right", no_wrap=True)
    answers = [a for a in out.answers if a is not None]
    others = sorted((a for a in answers if a.key != out.chosen.key),
                    key=lambda a: a.cost_per_mtok_out_usd)
    for rank, a in enumerate([out.chosen, *others[:5]]):
        cand = job.candidates[a.candidate]
        sur, sim = a.surrogate, a.simulated
        src = sim if sim is not None else sur
        mark = "chosen" if rank == 0 else f"#{rank + 1}"
        if sim is not None and rank > 0:
            mark += " ok" if met(job, sim) else " missed"
        table.add_row(
            mark, cand.hardware.name,
            *([model_label(cand.model)] if models else []),
            str(cand.tp), str(a.replicas), str(a.concurrency), str(a.token_budget),
            f"{a.cost_per_mtok_out_usd:.3f}", f"{a.cost_per_month_usd:,.0f}",
            f"{_pair(sur, 'ttft')} | {_pair(sim, 'ttft')}",
            f"{_pair(sur, 'itl')} | {_pair(sim, 'itl')}",
            f"{_ms(slo.ttft_p99_s - src['ttft_p99_s'])} | "
            f"{_ms(slo.itl_p99_s - src['itl_p99_s'])}",
        )
    return table


@hydra.main(config_path=f"pkg://{CONFIG_MODULE}", config_name="optimize",
            version_base="1.3")
def _optimize_app(cfg: DictConfig) -> None:
    import jax

    from sweep.cube import results
    from sweep.search import disaggregate, optimize
    job = COMMAND.prepared()
    err = Console(stderr=True)
    out = Path(job.app.out).expanduser() if job.app.out else Path(
        HydraConfig.get().runtime.output_dir) / "optimize.zarr"
    check_output(COMMAND.name, out, f"out={job.app.out}" if job.app.out else str(out),
                  "optimize")
    plan = optimize_plan(job.app, len(job.candidates), job.settings,
                         optimize.trace_rows(job))
    hardware = list({c.hardware.name: c.hardware for c in job.candidates}.values())
    models = list({c.model.name: c.model for c in job.candidates}.values())
    choices = calibration.choose(job.app.calibration, hardware, models)
    try:
        with outputs.lock(out):  # held from before the search to the write
            err.print(f"{COMMAND.name}: {job.app.workload.name} at "
                      f"{job.app.workload.arrival_rate_per_s:g} req/s; "
                      f"{len(job.excluded)} candidate(s) excluded (do not fit); "
                      f"{plan.line(jax.default_backend())}",
                      markup=False, highlight=False, soft_wrap=True)
            err.print(calibration.line(job.app.calibration, choices), markup=False,
                      highlight=False, soft_wrap=True)
            split, infeasible = None, None
            pools = True in job.app.search.disaggregated
            try:
                outcome = optimize.run(job, log=lambda line: err.print(
                    line, markup=False))
            except optimize.Infeasible as e:
                if not pools:
                    raise
                # disaggregation may meet an SLO no aggregated engine meets
                outcome, infeasible = e.outcome, e
                err.print(f"aggregated: {e}", markup=False, soft_wrap=True)
            if pools:
                split = disaggregate.run(job, log=lambda line: err.print(
                    line, markup=False))
                if infeasible is not None and split.chosen is None:
                    raise optimize.Infeasible(
                        f"{infeasible}; {disaggregate.verdict(job, None, split)}")
            attrs = results.provenance(config_yaml(cfg), job.app.seed,
                                       restore(overrides()), job.specs)
            attrs.update(calibration.attrs(job.app.calibration, choices))
            ds = optimize.to_dataset(job, outcome, attrs)
            if split is not None:
                ds = disaggregate.annotate(ds, job, outcome.chosen, split)
            optimize.write(ds, out)
    except optimize.Infeasible as e:
        print(f"{COMMAND.name}: {e}", file=sys.stderr)
        sys.exit(INFEASIBLE_EXIT)
    except outputs.OutputError as e:
        COMMAND.fail(e)
    # a table is unreadable squeezed to 80 columns when stdout is a pipe
    console = Console(width=max(Console().width, 200))
    chosen = outcome.chosen
    if chosen is not None:
        console.print(result_table(job, outcome))
    if warning := calibration.mixed(job.app.calibration, choices):
        err.print(warning, markup=False, highlight=False, soft_wrap=True)
    if line := optimize.speculation_line(job, outcome):
        console.print(line, markup=False, soft_wrap=True)
    if chosen is not None:
        for name, engine in engines.ENGINES.items():
            console.print(f"{engine.label} flags: "
                          f"{optimize.serving_flags(job, chosen, name)}", markup=False)
            for note in optimize.serving_notes(job, chosen, name):
                console.print(f"  note: {note}", markup=False, soft_wrap=True)
        if note := optimize.kv_note(job, chosen):
            console.print(f"note: {note}", markup=False, soft_wrap=True)
        console.print(f"check on one replica: {optimize.bench_command(job, chosen)}",
                      markup=False, soft_wrap=True)
    if split is not None:
        console.print(disaggregate.verdict(job, chosen, split), markup=False,
                      soft_wrap=True)
        if split.chosen is not None:
            for name, engine in engines.ENGINES.items():
                for pool, flags in disaggregate.pool_flags(job, split.chosen,
                                                           name).items():
                    console.print(f"{engine.label} {pool} pool flags: {flags}",
                                  markup=False, soft_wrap=True)
                for note in disaggregate.pool_notes(job, split.chosen, name):
                    console.print(f"  note: {note}", markup=False, soft_wrap=True)
    console.print(f"{outcome.rounds} round(s), {outcome.evaluations:,} surrogate "
                  f"evaluations ({outcome.search_s:.1f} s), {outcome.simulations} "
                  f"simulated configurations ({outcome.simulate_s:.1f} s)")
    err.print(f"dataset written to {out}")


def main() -> None:
    """``sweep-optimize [hydra overrides]``: search, verify, print, write."""
    COMMAND.main(_optimize_app)
