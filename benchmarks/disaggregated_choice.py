"""sweep-optimize choosing between aggregated and disaggregated deployments.

Fourteen scenarios (hardware x model x workload x arrival rate x SLO, from the
shipped configs and the public traces under ``SWEEP_DATA_DIR``). Each runs
``sweep-optimize``'s two searches in process, as the console script does
with ``search.disaggregated=[false,true]``: the aggregated search
(``sweep.search.optimize.run``: surrogate descent, the cheapest answers
simulated, targets tightened) and the disaggregated one
(``sweep.search.disaggregate.run``: P:D ratios from the roofline, the
cheapest simulated until one meets the SLO; here it runs also when the
aggregated search finds the SLO infeasible, where the console script
stops). Both answers are verified by the simulator; the table prints each
one's price, GPUs and simulated p99s, and which wins.

Settings (``search=quick`` and the overrides in ``COMMON``) keep the run to
minutes per scenario on a 2-core CPU; they are the same for every scenario.

Usage: ``SWEEP_DATA_DIR=... python benchmarks/disaggregated_choice.py
[--only N ...]``
"""

from __future__ import annotations

import argparse
import platform
import time

from hydra import initialize_config_module
from hydra.core.global_hydra import GlobalHydra

from sweep.config.store import register_configs
from sweep.search import disaggregate, optimize

COMMON = ["search=quick", "search.verify_requests=100",
          "search.verify_requests_max=1024",
          "search.verify_top=2", "search.rounds=2", "search.disaggregated=[false,true]",
          "search.disaggregated_max_instances=8"]
TIGHT = ["slo.ttft_p99_s=2.0", "slo.itl_p99_s=0.02"]
SCENARIOS = [
    # (label, overrides)
    ("h100 qwen3-8b chat 20/s", ["hardware=h100_sxm", "model=qwen3_8b",
                                 "workload=seed_chat", "workload.arrival_rate_per_s=20",
                                 "search.tensor_parallel=[1]"]),
    ("h100 qwen3-8b chat 20/s ITL 20ms", ["hardware=h100_sxm", "model=qwen3_8b",
                                          "workload=seed_chat",
                                          "workload.arrival_rate_per_s=20",
                                          "search.tensor_parallel=[1]", *TIGHT]),
    ("h100 qwen3-8b RAG 4/s", ["hardware=h100_sxm", "model=qwen3_8b",
                               "workload=rag_long_prompt",
                               "workload.arrival_rate_per_s=4",
                               "search.tensor_parallel=[1]"]),
    ("h100 qwen3-8b RAG 4/s ITL 20ms", ["hardware=h100_sxm", "model=qwen3_8b",
                                        "workload=rag_long_prompt",
                                        "workload.arrival_rate_per_s=4",
                                        "search.tensor_parallel=[1]", *TIGHT]),
    ("h100 qwen3-8b azure conv 20/s ITL 20ms", [
        "hardware=h100_sxm", "model=qwen3_8b", "workload=azure_conv_2023",
        "workload.arrival_rate_per_s=20", "search.tensor_parallel=[1]", *TIGHT]),
    ("l40s qwen3-8b chat 10/s", ["hardware=l40s", "model=qwen3_8b",
                                 "workload=seed_chat", "workload.arrival_rate_per_s=10",
                                 "search.tensor_parallel=[1]"]),
    ("l40s mistral-7b azure conv 5.5/s", ["hardware=l40s", "model=mistral_7b",
                                          "workload=azure_conv_2023",
                                          "search.tensor_parallel=[1]"]),
    ("a100 qwen3-8b azure code 10/s", ["hardware=a100_80gb_sxm", "model=qwen3_8b",
                                       "workload=azure_code_2023",
                                       "workload.arrival_rate_per_s=10",
                                       "search.tensor_parallel=[1]"]),
    ("h200 qwen3-32b chat 10/s", ["hardware=h200_sxm", "model=qwen3_32b",
                                  "workload=seed_chat",
                                  "workload.arrival_rate_per_s=10",
                                  "search.tensor_parallel=[1]"]),
    ("b200 llama3.1-8b RAG 4/s ITL 20ms", ["hardware=b200", "model=llama3_1_8b",
                                           "workload=rag_long_prompt",
                                           "workload.arrival_rate_per_s=4",
                                           "search.tensor_parallel=[1]", *TIGHT]),
    ("mi300x llama3.1-70b chat 5/s", ["hardware=mi300x", "model=llama3_1_70b",
                                      "workload=seed_chat",
                                      "workload.arrival_rate_per_s=5",
                                      "search.tensor_parallel=[1]"]),
    ("h100 qwen3-8b RAG 4/s TTFT 1.5s ITL 12ms", [
        "hardware=h100_sxm", "model=qwen3_8b", "workload=rag_long_prompt",
        "workload.arrival_rate_per_s=4", "search.tensor_parallel=[1]",
        "slo.ttft_p99_s=1.5", "slo.itl_p99_s=0.012"]),
    ("h100 qwen3-8b chat 40/s ITL 15ms", ["hardware=h100_sxm", "model=qwen3_8b",
                                          "workload=seed_chat",
                                          "workload.arrival_rate_per_s=40",
                                          "search.tensor_parallel=[1]",
                                          "slo.itl_p99_s=0.015"]),
    ("h100 llama3.1-70b chat 5/s TP4", ["hardware=h100_sxm", "model=llama3_1_70b",
                                        "workload=seed_chat",
                                        "workload.arrival_rate_per_s=5",
                                        "search.tensor_parallel=[4]"]),
]


def one(overrides: list[str]) -> dict:
    base, hardware, models = optimize.options("optimize", [*overrides, *COMMON])
    job = optimize.prepare(base, hardware, models)
    t0 = time.perf_counter()
    try:
        a = optimize.run(job, log=lambda line: None).chosen
    except optimize.Infeasible:
        a = None  # the disaggregated search still runs (sweep-optimize stops here)
    split = disaggregate.run(job, log=lambda line: None)
    wall = time.perf_counter() - t0
    d = split.chosen
    row = {"wall_s": wall, "simulated": len(split.simulated)}
    if a is not None:
        row.update(agg_usd=a.cost_per_mtok_out_usd,
                   agg_gpus=a.replicas * job.candidates[a.candidate].tp,
                   agg_ttft=a.simulated["ttft_p99_s"], agg_itl=a.simulated["itl_p99_s"],
                   agg_conf=f"{a.replicas}x N{a.concurrency} B{a.token_budget}")
    if d is not None:
        row.update(dis_usd=d.cost_per_mtok_out_usd,
                   dis_gpus=d.gpus(job),
                   dis_ttft=d.simulated["ttft_p99_s"], dis_itl=d.simulated["itl_p99_s"],
                   dis_conf=f"{d.ratio} N{d.concurrency} B{d.token_budget}")
    row["winner"] = ("neither" if a is None and d is None else "disaggregated"
                     if d is not None and (a is None or d.cost_per_mtok_out_usd
                                           < a.cost_per_mtok_out_usd)
                     else "aggregated")
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", type=int, nargs="*", default=None,
                    help="run these scenarios only (indices)")
    args = ap.parse_args()
    register_configs()
    print(f"# {platform.node()} {platform.processor() or platform.machine()}, "
          f"{time.strftime('%Y-%m-%d')}; settings: {' '.join(COMMON)}")
    print("| scenario | aggregated: replicas x N B | GPUs | USD/1M out | "
          "sim p99 TTFT s "
          "| sim p99 ITL ms | disaggregated: P:D N B | GPUs | USD/1M out | sim p99 "
          "TTFT s | sim p99 ITL ms | winner | wall s |")
    print("|" + " --- |" * 13)
    rows = SCENARIOS if args.only is None else [SCENARIOS[i] for i in args.only]
    for label, overrides in rows:
        GlobalHydra.instance().clear()
        with initialize_config_module("sweep.conf", version_base="1.3"):
            r = one(overrides)
        agg = (f"{r['agg_conf']} | {r['agg_gpus']} | {r['agg_usd']:.3f} | "
               f"{r['agg_ttft']:.3f} | {r['agg_itl'] * 1e3:.1f}" if "agg_usd" in r
               else "infeasible | - | - | - | -")
        dis = (f"{r['dis_conf']} | {r['dis_gpus']} | {r['dis_usd']:.3f} | "
               f"{r['dis_ttft']:.3f} | {r['dis_itl'] * 1e3:.1f}" if "dis_usd" in r
               else "none met the SLO | - | - | - | -")
        print(f"| {label} | {agg} | {dis} | {r['winner']} | {r['wall_s']:.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
