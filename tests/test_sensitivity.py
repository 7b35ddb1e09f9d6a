"""The cost elasticities ``d_cost_d_<constant>`` of a cube that ``sweep-grid
grid.sensitivity=true`` wrote, against float64 central finite differences of
an independent hand calculation of the cost (the SPEC's roofline with the
calibrated step: weights at bandwidth x mbu, the KV cache at bandwidth x
kv_mbu, FLOP/s x mfu, two all-reduces per layer, the step's and each
sequence's overhead), and the line ``sweep-report`` writes from them.

H100 takes a calibration of the user's (every constant away from the bound,
through ``hydra.searchpath``), L40S has no profile there and keeps its own
constants (the bound): both paths of ``sweep.grid.calibration``.
"""

from __future__ import annotations

import json
import math
import re

import helpers as h
import numpy as np
import pytest
from omegaconf import OmegaConf

import sweep
from sweep.cube import contract
from sweep.model import sensitivity

PROFILE = {"mbu": 0.8, "kv_mbu": 0.9, "mfu": 0.7, "step_overhead_s": 1e-3,
           "sequence_overhead_s": 1e-5}
ARGS = ["grid.hardware=[h100_sxm,l40s]", "model=qwen3_8b", "workload=seed_chat",
        "grid.tensor_parallel=[1,2]", "grid.concurrency=[1,64,1024]",
        "grid.token_budget=[2048]", "grid.context_tokens=[100,1500]",
        "grid.batching=[static,continuous]", "grid.long_prompt_tokens=[8192]",
        "grid.traffic_tokens_per_day=[1e8]", "grid.sensitivity=true"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("sensitivity")
    (root / "conf" / "calibration").mkdir(parents=True)
    (root / "conf" / "calibration" / "mine.yaml").write_text(
        "defaults:\n  - base_calibration\n  - _self_\nname: mine\nprofiles:\n"
        "  - hardware: h100_sxm\n    model: qwen3_8b\n"
        + "".join(f"    {k}: {v}\n" for k, v in PROFILE.items()))
    proc = h.run_script("sweep-grid", [f"hydra.searchpath=[file://{root / 'conf'}]",
                                       "calibration=mine", *ARGS, "out=c.zarr"], root)
    assert proc.returncode == 0, proc.stderr
    return root, sweep.open_cube(root / "c.zarr").load()


def constants(hardware: str) -> dict:
    """Every constant the cost depends on, from the shipped config and the
    user's profile (L40S: its own, the bound)."""
    cfg = OmegaConf.load(h.REPO / "conf" / "hardware" / f"{hardware}.yaml")
    c = {k: float(cfg[k]) for k in ("memory_bandwidth_bytes_per_s", "peak_flops_per_s",
                                    "interconnect_bytes_per_s", "usd_per_gpu_hour")}
    c.update(PROFILE if hardware == "h100_sxm" else {
        "mbu": 1.0, "kv_mbu": 1.0, "mfu": 1.0, "step_overhead_s": 0.0,
        "sequence_overhead_s": 0.0})
    return c


def cost(c: dict, n: float, ctx: float, tp: float, utilization: float) -> float:
    """USD per 1M output tokens of ``n`` sequences decoding at context ``ctx``
    on ``tp`` GPUs (Qwen3-8B bf16, no speculation), float64 by hand."""
    bw, flops = c["memory_bandwidth_bytes_per_s"], c["peak_flops_per_s"]
    memory = (h.W / c["mbu"] + n * ctx * h.KVB / c["kv_mbu"]) / tp / bw
    compute = (2 * h.PARAMS * n + h.FPK * n * ctx) / tp / (flops * c["mfu"])
    allreduce = (2 * h.LAYERS * 2 * (tp - 1) / tp * n * 4096 * 2
                 / c["interconnect_bytes_per_s"])
    step = (max(memory, compute) + allreduce + c["step_overhead_s"]
            + c["sequence_overhead_s"] * n)
    return c["usd_per_gpu_hour"] * tp / (n / step * utilization * 3600) * 1e6


def elasticity(c: dict, name: str, *args, rel: float = 1e-4) -> float:
    """d ln cost / d ln c[name] by central differences in float64 (0 where
    the constant is 0: scaling it changes nothing)."""
    up, down = dict(c), dict(c)
    up[name] *= 1 + rel
    down[name] *= 1 - rel
    if c[name] == 0:
        return 0.0
    return (math.log(cost(up, *args)) - math.log(cost(down, *args))) / (
        math.log1p(rel) - math.log1p(-rel))


def test_every_constant_has_its_variable_when_asked_for(hydra_ctx):
    from sweep.config.resolve import grid_options
    from sweep.grid.plan import grid_plan

    asked = contract.metrics(contract.ROOFLINE, frozenset({"sensitivity"}))
    declared = [m.name for m in asked if m.name.startswith("d_cost_d_")]
    assert declared == [contract.sensitivity(p) for p in sensitivity.SCALED]
    for name in declared:
        assert contract.METRIC[name].units == "1"
    assert not any(m.name.startswith("d_cost_d_")
                   for m in contract.metrics(contract.ROOFLINE))
    # the plan counts their bytes: 8 float32 more on 65 bytes a point
    small = ["grid=small", "hardware=h100_sxm", "model=qwen3_8b"]
    off, on = (grid_plan(*grid_options("grid", [*small, *extra]))
               for extra in ([], ["grid.sensitivity=true"]))
    assert on.disk_bytes / off.disk_bytes == pytest.approx((65 + 32) / 65)


POINTS = [  # hardware, TP, concurrency, context, batching
    ("h100_sxm", 1, 1, 1500, "continuous"),    # memory-bound, overheads ~15 %
    ("h100_sxm", 1, 64, 1500, "static"),       # KV reads as large as weights'
    ("h100_sxm", 1, 1024, 100, "continuous"),  # compute-bound
    ("h100_sxm", 2, 64, 1500, "continuous"),   # all-reduces over NVLink
    ("l40s", 2, 64, 100, "continuous"),        # the bound, all-reduces over PCIe
    ("l40s", 1, 1024, 100, "static"),          # the bound, compute-bound
]


@pytest.mark.slow
@pytest.mark.parametrize("hardware, tp, n, ctx, batching", POINTS)
def test_elasticities_match_central_differences(run, hardware, tp, n, ctx, batching):
    _, ds = run
    pt = ds.sel(hardware=hardware, model="qwen3_8b", workload="seed_chat",
                tensor_parallel=tp, concurrency=n, context_tokens=ctx,
                batching=batching).squeeze()
    c = constants(hardware)
    util = float(pt.slot_utilization)
    # the cube's cost is the hand calculation's (float32 against float64)
    assert float(pt.cost_per_mtok_out_usd) == pytest.approx(
        cost(c, n, ctx, tp, util), rel=1e-5)
    for param, leaves in sensitivity.SCALED.items():
        want = elasticity(c, leaves[0], n, ctx, tp, util)
        got = float(pt[contract.sensitivity(param)])
        assert got == pytest.approx(want, rel=1e-3, abs=1e-5), param
    # every constant in a step's time: the elasticities of bandwidth and
    # FLOP/s are those of their utilisations; with the overheads they sum to -1
    # (doubling every rate and halving every time halves the cost)
    e = {p: float(pt[contract.sensitivity(p)]) for p in sensitivity.SCALED}
    assert e["memory_bandwidth_bytes_per_s"] == pytest.approx(
        e["mbu"] + e["kv_mbu"], abs=1e-5)
    assert e["peak_flops_per_s"] == pytest.approx(e["mfu"], abs=1e-5)
    rates = (e["memory_bandwidth_bytes_per_s"] + e["peak_flops_per_s"]
             + e["interconnect_bytes_per_s"])
    assert rates - e["step_overhead_s"] - e["sequence_overhead_s"] == pytest.approx(
        -1.0, abs=1e-5)


@pytest.mark.slow
def test_points_that_do_not_fit_have_none(run):
    _, ds = run
    gone = ~ds.kv_fits
    assert bool(gone.any())
    for p in sensitivity.SCALED:
        values = ds[contract.sensitivity(p)].where(gone)
        assert bool(np.isnan(values.values[gone.values]).all()), p


@pytest.mark.slow
def test_report_states_what_ten_percent_more_does(run, tmp_path):
    root, ds = run
    h.report([root / "c.zarr", "--out", tmp_path / "r"])
    md = (tmp_path / "r" / "report.md").read_text()
    line = next(x for x in md.splitlines() if x.startswith("Sensitivity of"))
    hw, model = re.match(r"Sensitivity of the cheapest feasible point of (\S+) x "
                         r"(\S+) \(", line).groups()
    # the report's cheapest feasible point, found here by hand: among the
    # points that fit (and a token budget >= concurrency), at the first
    # context, within the cube's SLO (slo=interactive: step <= 50 ms, a
    # whole-prompt prefill step <= 1 s)
    first = ds.isel(context_tokens=0)
    ok = (first.kv_fits & (first.step_s <= 0.05)
          & (first.mean_prompt_tokens / first.prefill_tokens_per_s <= 1.0)
          & ((first.token_budget >= first.concurrency)
             | (first.batching != "continuous")))
    costs = first.cost_per_mtok_out_usd.where(ok)
    best = costs.where(costs == costs.min(), drop=True).squeeze()
    assert (str(best.hardware.values), str(best.model.values)) == (hw, model)
    at = {d: best[d].values for d in best.coords if d in first.dims}

    def effect(e: float) -> str:
        """10 % more: the cost times 1.1^e."""
        x = (1.1**e - 1) * 100
        return ("leaves its cost unchanged" if abs(x) < 0.05 else
                f"{'lowers' if x < 0 else 'raises'} its cost by {abs(x):.1f} %")

    e = {p: float(first[contract.sensitivity(p)].sel(at)) for p in sensitivity.SCALED}
    cost = float(first.cost_per_mtok_out_usd.sel(at))
    assert (f"({cost:.3f} USD / 1M output tokens): 10 % more memory bandwidth "
            f"{effect(e['memory_bandwidth_bytes_per_s'])}, 10 % more peak FLOP/s "
            f"{effect(e['peak_flops_per_s'])}.") in line
    assert f"memory bandwidth {e['memory_bandwidth_bytes_per_s']:+.3f}, " in line
    assert f"mfu {e['mfu']:+.3f}, " in line
    assert "d ln cost / d ln x" in line


@pytest.mark.slow
def test_calibration_constants_recorded(run):
    _, ds = run
    rows = {r["hardware"]: r for r in json.loads(ds.attrs["calibration_constants"])}
    for k, v in PROFILE.items():
        assert rows["h100_sxm"][k] == pytest.approx(v)
    assert rows["l40s"]["profile"] is None


def test_off_by_default(cube_path, tmp_path):
    assert not any(v.startswith("d_cost_d_") for v in sweep.open_cube(cube_path))
    h.report([cube_path, "--out", tmp_path / "r"])
    assert "Sensitivity of" not in (tmp_path / "r" / "report.md").read_text()


# the p99 elasticities: the surrogate's p99s at every constant scaled by
# 1 +- REL, in float64, against the cube's (central differences at +-1 % in
# float32)
REL = 1e-4
SURROGATE = ["hardware=h100_sxm", "model=qwen3_8b", "workload=seed_chat",
             "grid.tensor_parallel=[1]", "grid.concurrency=[16,256]",
             "grid.token_budget=[512,8192]", "grid.context_tokens=[1500]",
             "grid.batching=[continuous]", "grid.long_prompt_tokens=[8192]",
             "grid.traffic_tokens_per_day=[1e8]", "grid.arrival_rate_per_s=[3,24]",
             "latency=surrogate", "grid.sensitivity=true"]


@pytest.fixture(scope="module")
def p99_run(run):
    root, _ = run
    proc = h.run_script("sweep-grid", [f"hydra.searchpath=[file://{root / 'conf'}]",
                                       "calibration=mine", *SURROGATE, "out=s.zarr"],
                        root)
    assert proc.returncode == 0, proc.stderr
    return root, proc, sweep.open_cube(root / "s.zarr").load()


def surrogate_p99s_float64(cube) -> dict:
    """``{(concurrency, budget, rate): (base, {constant: (up, down)})}`` of
    (p99 TTFT, p99 ITL), the surrogate in float64 at the H100's constants
    with the user's profile, each constant scaled alone."""
    import jax
    import jax.numpy as jnp

    from sweep.config.convert import hardware_params, model_params
    from sweep.latency.surrogate import latency_workload, surrogate
    from sweep.latency.workload import workload_tables

    app = h.compose_app("grid", SURROGATE[:3])
    base = hardware_params(app.hardware, 1.0)._replace(**PROFILE)
    cases = [base] + [base._replace(**{leaf: getattr(base, leaf) * f
                                       for leaf in sensitivity.SCALED[p]})
                      for p in sensitivity.SCALED for f in (1 + REL, 1 - REL)]
    points = [(float(c), float(b), float(r)) for c in cube.concurrency.values
              for b in cube.token_budget.values for r in cube.arrival_rate_per_s.values]
    with jax.enable_x64(True):
        model = jax.tree.map(jnp.float64, model_params(app.model))
        wl = latency_workload(workload_tables(app.workload), jnp.float64)
        hw = jax.tree.map(lambda *x: jnp.array([x] * len(points)), *cases)
        c, b, r = (jnp.array([[p[i]] * len(cases) for p in points]) for i in range(3))

        def p99s(hw, c, b, r):
            out = surrogate(hw, model, wl, 1.0, c, b, r)
            return jnp.stack([out["ttft_p99_s"], out["itl_p99_s"]])

        got = np.asarray(h.jit_once(jax.vmap(jax.vmap(p99s)))(hw, c, b, r))
    names = list(sensitivity.SCALED)
    return {p: (got[i, 0], {n: (got[i, 1 + 2 * j], got[i, 2 + 2 * j])
                            for j, n in enumerate(names)})
            for i, p in enumerate(points)}


@pytest.mark.slow
def test_p99_elasticities_match_central_differences(p99_run):
    _, _, ds = p99_run
    cube = ds.squeeze()
    assert float(cube.rejected_fraction.max()) == 0.0
    checked = 0
    for (c, b, r), (base, scaled) in surrogate_p99s_float64(cube).items():
        pt = cube.sel(concurrency=c, token_budget=b, arrival_rate_per_s=r)
        for k, of in enumerate(("ttft_p99_s", "itl_p99_s")):
            if int(pt.latency_status) != 0:  # saturated: no elasticity
                assert np.isnan(float(pt[contract.sensitivity("mbu", of)]))
                continue
            assert float(pt[of]) == pytest.approx(base[k], rel=2e-3), (c, b, r, of)
            for p, (up, down) in scaled.items():
                want = (math.log(up[k]) - math.log(down[k])) / (
                    math.log1p(REL) - math.log1p(-REL))
                got = float(pt[contract.sensitivity(p, of)])
                assert got == pytest.approx(want, rel=2e-2, abs=5e-3), (c, b, r, of, p)
                checked += 1
    assert checked >= 4 * 2 * len(sensitivity.SCALED)


@pytest.mark.slow
def test_p99_elasticities_reach_the_report(p99_run, tmp_path):
    root, proc, ds = p99_run
    assert "p99 elasticities need latency=surrogate" not in proc.stderr
    h.report([root / "s.zarr", "--out", tmp_path / "r"])
    line = next(x for x in (tmp_path / "r" / "report.md").read_text().splitlines()
                if x.startswith("Sensitivity of"))
    m = re.search(r"`d_ttft_p99_d_memory_bandwidth_bytes_per_s` ([-+]\d\.\d{3}), "
                  r"`d_ttft_p99_d_peak_flops_per_s` ([-+]\d\.\d{3})", line)
    assert m, line
    e_flops = float(m.group(2))
    assert e_flops < 0  # the cheapest point's p99 TTFT: prefill, compute-bound
    lowers = (1 - 1.1**e_flops) * 100
    assert (f"10 % more peak FLOP/s lowers its p99 TTFT by {lowers:.1f} %"
            in line), line
    assert "d_itl_p99_d_memory_bandwidth_bytes_per_s" in line
