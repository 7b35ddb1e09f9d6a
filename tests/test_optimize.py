"""``sweep-optimize`` as a user runs it, and the job's pure-Python parts.

The console-script runs share one JAX compilation cache (a temporary folder,
``conftest.jax_cache``), so a later run reuses the first one's compiled search; the
successful run is the session's ``optimize_run``, which ``sweep-report``'s
tests read too.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import xarray as xr
import yaml
from helpers import OPTIMIZE_QUICK, run_script

import sweep
from sweep.cube import outputs
from sweep.search import pareto

run = partial(run_script, "sweep-optimize")


def test_pareto_front():
    cost = np.array([1.0, 2.0, 2.0, 3.0, np.nan, 0.5])
    latency = np.array([5.0, 4.0, 6.0, 1.0, 0.1, 9.0])
    # 0.5/9 and 1/5 and 2/4 and 3/1 are non-dominated; 2/6 is beaten; NaN is off
    np.testing.assert_array_equal(pareto.front(cost, latency),
                                  [True, True, False, True, False, True])


@pytest.mark.slow
def test_bad_input_is_one_line_exit_2(tmp_path):
    proc = run(["search.tensor_parallel=[0]"], tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "sweep-optimize: error: search.tensor_parallel = 0.0: every value must be "
        "in [1, 16777216]"]
    assert not (tmp_path / "outputs").exists()


@pytest.mark.slow
def test_out_the_tool_must_not_replace_is_refused(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "k.txt").write_text("keep")
    proc = run(["out=d"], tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "sweep-optimize: error: out=d: exists and is not a sweep-optimize dataset "
        "(it does not carry the tool's mark); it is left as it is; allowed: a new "
        "path, an empty folder or an earlier sweep-optimize dataset"]
    assert (tmp_path / "d" / "k.txt").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_run_writes_dataset_and_flags(optimize_run):
    proc = optimize_run.proc
    assert proc.returncode == 0, proc.stderr
    # with out=, Hydra writes no run directory; the dataset is the tool's
    assert not (optimize_run.path.parent / "outputs").exists()
    assert outputs.kind_of(optimize_run.path) == "optimize"
    ds = sweep.open_cube(optimize_run.path).load()
    xr.testing.assert_identical(xr.open_zarr(optimize_run.path).load(), ds)
    a = ds.attrs
    flags = (f"--tensor-parallel-size {a['chosen_tensor_parallel']} --max-num-seqs "
             f"{a['chosen_concurrency']} --max-num-batched-tokens "
             f"{a['chosen_token_budget']}")
    assert flags in proc.stdout and flags in a["vllm_flags"]
    n = a["chosen_replicas"]
    assert f"x {n} replica{'' if n == 1 else 's'}" in proc.stdout
    for label, key in (("SGLang", "sglang_flags"), ("TensorRT-LLM", "trtllm_flags")):
        assert f"{label} flags: {a[key]}" in proc.stdout
    assert a["sglang_flags"].startswith(
        f"--tp-size {a['chosen_tensor_parallel']} --max-running-requests "
        f"{a['chosen_concurrency']} --chunked-prefill-size {a['chosen_token_budget']}")
    # the check on one replica: its share of 3 req/s, the SLO in milliseconds
    bench = a["vllm_bench_command"]
    assert bench in proc.stdout.replace("\n", "")
    assert bench.startswith("vllm bench serve --model Qwen/Qwen3-8B ")
    assert f"--request-rate {3.0 / n:.4g} " in bench
    assert "--num-prompts 200 " in bench and "--goodput ttft:1000 tpot:50 " in bench
    for key in ("sweep_version", "config_yaml", "created_utc", "seed", "log"):
        assert key in a
    # max_num_seqs above the KV's requests of the mean context (1,500 + 360
    # tokens) is said: by hand, TP x 0.9 x 80 GB less Qwen3-8B's bf16 weights
    # over 36 layers x 8 KV heads x 128 x (K, V) at the KV dtype's bytes
    kv_token = 36 * 8 * 128 * 2 * (1 if a["chosen_kv_dtype"] == "fp8" else 2)
    held = int((a["chosen_tensor_parallel"] * 0.9 * 80e9 - 2 * 8.19e9)
               / kv_token // 1860)
    assert ("note: max_num_seqs" in proc.stdout) == (a["chosen_concurrency"] > held)
    if a["chosen_concurrency"] > held:
        assert f"the KV cache holds about {held:,} requests" in proc.stdout
    # cost by hand: replicas x TP x USD 4.29/h over 3 req/s x 360 tokens
    gpus = a["chosen_replicas"] * a["chosen_tensor_parallel"]
    assert a["chosen_cost_per_mtok_out_usd"] == pytest.approx(
        gpus * 4.29 / (3.0 * 360.0 * 3600.0) * 1e6, rel=1e-6)
    assert a["chosen_cost_per_month_usd"] == pytest.approx(gpus * 4.29 * 730, rel=1e-6)
    chosen = ds.isel(candidate=int(np.flatnonzero(ds.chosen.values)[0]))
    # the chosen configuration was simulated and met the SLO there
    assert bool(chosen.verified) and bool(chosen.slo_met_simulated)
    assert float(chosen.simulated_ttft_p99_s) <= 1.0
    assert float(chosen.simulated_itl_p99_s) <= 0.05
    assert float(chosen.ttft_slack_s) == pytest.approx(
        1.0 - float(chosen.simulated_ttft_p99_s), abs=1e-9)
    assert int(chosen.concurrency) == a["chosen_concurrency"]
    # no candidate meeting the targets is cheaper
    assert float(chosen.cost_per_mtok_out_usd) <= np.nanmin(
        ds.cost_per_mtok_out_usd.values) + 1e-12
    # the Pareto fronts are non-empty subsets of the evaluated configurations
    for front in ("pareto_itl", "pareto_ttft"):
        assert 0 < int(ds[front].sum()) <= ds.sizes["config"]
    for name in ("cost_per_mtok_out_usd", "surrogate_ttft_p99_s",
                 "simulated_itl_p99_s", "config_itl_p99_s", "replicas",
                 "surrogate_e2e_p50_s", "simulated_e2e_p50_s"):
        assert "units" in ds[name].attrs and "long_name" in ds[name].attrs
    # every latency percentile of both models: the E2E median below its p99
    assert float(chosen.simulated_e2e_p50_s) <= float(chosen.simulated_e2e_p99_s)
    assert float(chosen.surrogate_e2e_p50_s) <= float(chosen.surrogate_e2e_p99_s)
    # search.kv_dtype=[bf16,fp8]: both caches at TP 1 and 2; the chosen one's in
    # its attributes and flags
    assert sorted(zip(ds.tensor_parallel.values.tolist(), ds.kv_dtype.values)) == [
        (1, "bf16"), (1, "fp8"), (2, "bf16"), (2, "fp8")]
    assert (ds.weight_dtype == "bf16").all()
    assert str(chosen.kv_dtype.values) == a["chosen_kv_dtype"]
    fp8 = "--kv-cache-dtype fp8 " in a["vllm_flags"]
    assert fp8 == (a["chosen_kv_dtype"] == "fp8")
    assert ("--kv_cache_dtype fp8 " in a["trtllm_flags"]) == fp8
    # the searched specs (hardware=h100_sxm model=qwen3_8b) and the units' meaning
    assert yaml.safe_load(a["hardware_specs"])["h100_sxm"]["memory_bytes"] == 8e10
    assert list(yaml.safe_load(a["model_specs"])) == ["qwen3_8b"]
    assert a["Conventions"].startswith("CF-") and "USD = " in a["unit_definitions"]


@pytest.mark.slow
def test_infeasible_slo_names_the_constraint_exit_3(tmp_path):
    # 0.5 ms p99 ITL is below one decode step of Qwen3-8B on any H100 split
    proc = run([*OPTIMIZE_QUICK, "slo.itl_p99_s=0.0005", "out=opt.zarr"], tmp_path)
    assert proc.returncode == 3, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("sweep-optimize: infeasible SLO: binding constraint "
                           "slo.itl_p99_s = 0.0005 s; the best p99 ITL reached")
    assert "allowed: slo.itl_p99_s >=" in line
    assert not (tmp_path / "opt.zarr").exists()


@pytest.mark.slow
def test_searches_speculative_proposal_lengths(tmp_path):
    """``search.spec_tokens=[0,4]``: each k is a candidate; the run says which
    wins, and the chosen one's flags carry its speculation (vLLM's
    ``--speculative-config``, SGLang's NGRAM with k + 1 draft tokens,
    TensorRT-LLM's YAML in a note)."""
    proc = run([*OPTIMIZE_QUICK[:3], "search.tensor_parallel=[1]",
                "search.verify_requests=200", "search.spec_tokens=[0,4]",
                "search.spec_acceptance=0.8", "out=opt.zarr"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    ds = sweep.open_cube(tmp_path / "opt.zarr").load()
    a = ds.attrs
    assert sorted(ds.spec_tokens.values.tolist()) == [0, 4]
    assert ds.spec_tokens.attrs["units"] == "token"
    k = a["chosen_spec_tokens"]
    line = next(s for s in proc.stdout.splitlines() if s.startswith("speculative"))
    assert line.startswith(f"speculative decoding (n-gram, acceptance 0.8): k={k} "
                           "wins; cheapest USD / 1M output tokens per k")
    chosen = ds.isel(candidate=int(np.flatnonzero(ds.chosen.values)[0]))
    assert int(chosen.spec_tokens) == k and bool(chosen.slo_met_simulated)
    vllm = ("--speculative-config '{\"method\": \"ngram\", "
            f"\"num_speculative_tokens\": {k}}}'")
    assert (vllm in a["vllm_flags"]) == (k > 0)
    assert (f"--speculative-algorithm NGRAM --speculative-num-draft-tokens {k + 1}"
            in a["sglang_flags"]) == (k > 0)
    assert ("max_draft_len: 4" in a.get("trtllm_notes", "")) == (k > 0)
    # no answer at another k is cheaper than the chosen one
    assert float(chosen.cost_per_mtok_out_usd) <= np.nanmin(
        ds.cost_per_mtok_out_usd.values) + 1e-12


@pytest.mark.slow
def test_a_cheaper_answer_after_the_simulator_reads_below_the_surrogate(tmp_path):
    """RAG prompts (mean 12,000 tokens) at 4 req/s on TP-1 H100s, p99 TTFT
    2 s and ITL 20 ms: the first round's answer, three replicas, is
    confirmed with both p99s below the surrogate's. The surrogate's best on
    two replicas (it reads p99 TTFT past 2 s there) is simulated at once,
    confirmed and chosen, at no loosening margin (the first version of the
    search stopped at three, 1.5x the price); one replica has no steady
    state. The targets rise too, by the simulator's ratio, for round 2."""
    out = tmp_path / "opt.zarr"
    proc = run(["hardware=h100_sxm", "model=qwen3_8b", "workload=rag_long_prompt",
                "workload.arrival_rate_per_s=4", "search=quick",
                "search.tensor_parallel=[1]", "slo.ttft_p99_s=2", "slo.itl_p99_s=0.02",
                "search.verify_requests=100", "search.loosen_margin=1",
                "search.rounds=2", f"out={out}"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    said = " ".join(proc.stderr.split())  # wrapped at the terminal's width
    assert "-> confirmed (fewer replicas)" in said
    assert "the simulator reads below the surrogate, looking for a cheaper" in said
    ds = xr.open_zarr(out)
    rounds, replicas = ds.verification_round.values, ds.verification_replicas.values
    met = ds.verification_slo_met.values
    assert list(zip(rounds[:2], replicas[:2], met[:2])) == [(1, 3, True), (1, 2, True)]
    assert ds.attrs["chosen_replicas"] == 2
    # Poisson arrivals: search.verify_requests per replica
    np.testing.assert_array_equal(ds.verification_requests.values, 100 * replicas)
    assert ds.verification_requests.attrs["units"] == "request"
    chosen = replicas == 2
    assert (ds.verification_simulated_ttft_p99_s.values[chosen] <= 2.0).all()
    assert (ds.verification_simulated_itl_p99_s.values[chosen] <= 0.02).all()
    # what the simulator confirmed, the surrogate put past the SLO
    assert (ds.verification_surrogate_ttft_p99_s.values[chosen] > 2.0).all()


@pytest.mark.slow
def test_no_round_after_an_answer_at_the_least_cost(tmp_path):
    """seed_chat at 3 req/s on TP-1 L40S: the first round's answer, two
    replicas, is confirmed below the surrogate's p99s, then one replica
    (fewer replicas), the least any configuration can cost: no round
    follows to look for a cheaper answer (the search had raised the
    targets and run a second round for nothing)."""
    out = tmp_path / "opt.zarr"
    proc = run(["hardware=l40s", "model=qwen3_8b", "search=quick",
                "search.tensor_parallel=[1]", "search.verify_requests=200",
                "search.rounds=2", f"out={out}"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    said = " ".join(proc.stderr.split())  # wrapped at the terminal's width
    assert "-> confirmed (fewer replicas)" in said
    assert "looking for a cheaper" not in said
    ds = xr.open_zarr(out)
    assert ds.attrs["rounds"] == 1
    assert ds.attrs["chosen_replicas"] == 1
    assert list(ds.verification_replicas.values) == [2, 1]
    assert ds.verification_slo_met.values.all()


@pytest.mark.slow
def test_fewer_replicas_stay_below_the_capacity(tmp_path):
    """seed_chat at 500 req/s on TP-1 H100s: fewer replicas are probed only
    where the surrogate finds a steady state. Past the capacity the queue
    grows without bound, yet a short simulated stream read 18 replicas
    (2.7x their capacity) within the SLO, and they were chosen."""
    out = tmp_path / "opt.zarr"
    proc = run(["hardware=h100_sxm", "model=qwen3_8b", "search=quick",
                "search.tensor_parallel=[1]", "workload.arrival_rate_per_s=500",
                "search.rounds=1", f"out={out}"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "-> confirmed (fewer replicas)" in " ".join(proc.stderr.split())
    ds = xr.open_zarr(out)
    assert ds.utilization.values[0] < 1.0
    assert ds.attrs["chosen_replicas"] >= 20


def test_fewer_replicas_are_probed_one_fewer_then_halfway():
    """``probe_count`` by hand against a simulator that confirms 9 or more
    replicas: from 34 confirmed, 33, 16 (both confirmed), 8 (missed), 12,
    10, 9 (confirmed), then none: six simulations, and 9 is found."""
    from sweep.search.optimize import probe_count

    fewest, missed, probed = 34, None, []
    while (r := probe_count(fewest, missed)) is not None:
        probed.append(r)
        if r >= 9:
            fewest = r
        else:
            missed = max(missed or 0, r)
        missed = missed or 0
    assert probed == [33, 16, 8, 12, 10, 9] and fewest == 9
    # two confirmed, one missed: nothing between them
    assert probe_count(2, None) == 1 and probe_count(2, 1) is None
    assert probe_count(1, None) is None


def test_confirmed_answers_raise_their_targets_by_the_simulators_ratio():
    """The converse of tightening, by hand: an answer the simulator confirms
    below the surrogate's p99 raises its candidate's target to the
    surrogate's p99 that maps to the SLO under the same ratio, times
    ``search.loosen_margin``; a metric the
    surrogate reads below the simulator, or a target already that high,
    stays; nothing rises where the simulated requests replay only part of
    a trace's arrivals."""
    from types import SimpleNamespace

    from sweep.config.schema import ArrivalKind, Replay
    from sweep.search.optimize import _loosen

    def job(arrival, trace_rows):
        workload = SimpleNamespace(arrival=arrival, replay=Replay.sampled)
        return SimpleNamespace(
            app=SimpleNamespace(slo=SimpleNamespace(ttft_p99_s=1.0, itl_p99_s=0.05),
                                workload=workload,
                                search=SimpleNamespace(loosen_margin=1.05)),
            tables=SimpleNamespace(trace_arrival_s=np.arange(float(trace_rows))),
            candidates=[SimpleNamespace(label="a"),
                        SimpleNamespace(label="h100 x qwen3 x TP 1")])

    answer = SimpleNamespace(candidate=1, simulated={
        "ttft_p99_s": 0.2522, "itl_p99_s": 0.01202, "requests": 24_000},
        surrogate={"ttft_p99_s": 0.2791, "itl_p99_s": 0.0116})
    ttft, itl = np.array([1.0, 1.0]), np.array([0.05, 0.05])
    assert _loosen(job(ArrivalKind.trace, 30_000), answer, ttft, itl) == ""
    assert (ttft == 1.0).all()
    for arrival, rows in ((ArrivalKind.trace, 8_819), (ArrivalKind.poisson, 30_000)):
        ttft[:] = 1.0
        line = _loosen(job(arrival, rows), answer, ttft, itl)
        # the ratio's 1.107 s, times the margin
        assert ttft[1] == pytest.approx(0.2791 / 0.2522 * 1.05)
        assert ttft[0] == 1.0 and (itl == 0.05).all()
        assert line.startswith("h100 x qwen3 x TP 1: ")
        assert "TTFT target -> 1.162 s" in line
        assert _loosen(job(arrival, rows), answer, ttft, itl) == ""


@pytest.mark.parametrize("value", ["0.9", "2.5"])
def test_loosen_margin_out_of_range_is_one_line(value):
    """A raised target's margin below 1 would lower it, above 2 would chase
    answers the simulator is unlikely to confirm: refused before any
    compilation, naming the field and what is allowed."""
    from helpers import compose_app

    from sweep.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        compose_app("optimize", [f"search.loosen_margin={value}"])
    line = str(e.value)
    assert line.startswith(f"search.loosen_margin = {value}") and "[1, 2]" in line
    assert "\n" not in line
