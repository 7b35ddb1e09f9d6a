"""Speculative decoding in the roofline cube, against float64 hand calculations:
the seed scenario (H100 SXM, Qwen3-8B, context 1,500) built by ``sweep-grid``."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
import xarray as xr
from helpers import (
    KVB,
    MEM,
    SEED_TABLE,
    W,
    check_png,
    compose_app,
    cost_per_mtok,
    report,
    run_script,
    squeeze_except,
    step,
)
from hypothesis import given, settings

import sweep
from sweep.config.schema import ConfigError
from sweep.model import roofline
from sweep.model.params import HardwareParams, ModelParams

C = 1500


def expected_tokens(k, a):
    """Leviathan et al. (2023): sum of a^j for j = 0..k."""
    return sum(a**j for j in range(k + 1))


def verify_step(n, k, c=C):
    """n sequences, each computing k + 1 tokens; token j attends to c + j keys."""
    return step(n * (k + 1), n * c, n * sum(c + j for j in range(k + 1)))


@pytest.fixture(scope="module")
def spec_cube_path(tmp_path_factory):
    out = tmp_path_factory.mktemp("spec") / "spec.zarr"
    proc = run_script("sweep-grid", [
        "experiment=seed", "grid.spec_tokens=[0,4,8]", "grid.spec_acceptance=[0.3,0.7]",
        "grid.concurrency=[1,256]", "grid.token_budget=[2048]",
        "grid.batching=[continuous]", f"out={out}"],
        cwd=out.parent)
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture(scope="module")
def cube(spec_cube_path) -> xr.Dataset:
    return squeeze_except(sweep.open_cube(spec_cube_path).load(), "spec_tokens",
                          "spec_acceptance", "concurrency").isel(
        traffic_tokens_per_day=0)


@pytest.mark.slow
def test_without_speculation_the_seed_table_holds(cube):
    off = cube.sel(spec_tokens=0)
    for n, itl_ms, per_user, _, _ in (SEED_TABLE[0], SEED_TABLE[-1]):
        for a in (0.3, 0.7):  # the acceptance rate does not matter at k = 0
            pt = off.sel(concurrency=n, spec_acceptance=a)
            assert float(pt.step_s) * 1e3 == pytest.approx(itl_ms, abs=0.005)
            assert float(pt.user_tokens_per_s) == pytest.approx(per_user, abs=0.5)
            assert float(pt.tokens_per_step) == 1.0
    assert float(off.max_concurrency_fit.sel(spec_acceptance=0.3, concurrency=1)) == 287


@pytest.mark.slow
def test_speculation_by_hand(cube):
    for k in (4, 8):
        for a in (0.3, 0.7):
            for n in (1, 256):
                pt = cube.sel(spec_tokens=k, spec_acceptance=a, concurrency=n)
                t, e = verify_step(n, k), expected_tokens(k, a)
                assert float(pt.step_s) == pytest.approx(t, rel=1e-5)
                assert float(pt.tokens_per_step) == pytest.approx(e, rel=1e-5)
                assert float(pt.user_tokens_per_s) == pytest.approx(e / t, rel=1e-5)
                assert float(pt.tpot_s) == pytest.approx(t / e, rel=1e-5)
                assert float(pt.output_tokens_per_s) == pytest.approx(n * e / t,
                                                                     rel=1e-5)
                assert float(pt.cost_per_mtok_out_usd) == pytest.approx(
                    cost_per_mtok(n * e / t), rel=1e-5)
        # k proposed tokens per sequence take KV slots: (80 GB - W) / KVB / (c + k)
        assert float(cube.max_concurrency_fit.sel(spec_tokens=k, spec_acceptance=0.3,
                                                     concurrency=1)
                     ) == np.floor((MEM - W) / KVB / (C + k))


@pytest.mark.slow
def test_speculation_pays_at_low_batch_and_hurts_at_high(cube):
    def rate(k, a, n):
        return float(cube.output_tokens_per_s.sel(spec_tokens=k, spec_acceptance=a,
                                                  concurrency=n))

    # one sequence is memory-bound: 4 proposals at 0.7 nearly triple its rate
    assert rate(4, 0.7, 1) / rate(0, 0.7, 1) == pytest.approx(
        expected_tokens(4, 0.7) * step(1, C, C) / verify_step(1, 4), rel=1e-5)
    assert rate(4, 0.7, 1) > 2.7 * rate(0, 0.7, 1)
    # 256 sequences are near the compute roof: 8 proposals at 0.3 cost more
    # compute than the 1.43 tokens they gain
    assert rate(8, 0.3, 256) < 0.8 * rate(0, 0.3, 256)


@settings(max_examples=60, deadline=None)
@given(k=st.integers(0, 16), a=st.floats(0.0, 1.0), b=st.floats(0.0, 1.0))
def test_tokens_per_step_grows_with_acceptance_and_proposals(k, a, b):
    lo, hi = sorted((a, b))
    e = [float(roofline.tokens_per_step(np.float32(k), np.float32(x)))
         for x in (lo, hi)]
    assert 1.0 <= e[0] <= e[1] * (1 + 1e-6) <= (k + 1) * (1 + 1e-6)
    more = float(roofline.tokens_per_step(np.float32(k + 1), np.float32(hi)))
    assert more >= e[1] * (1 - 1e-6)


def _h100_qwen3_8b():
    f = np.float32
    hw = HardwareParams(*(f(x) for x in (3.35e12, 9.89e14, 80e9, 4.5e11, 4.29, 1.0,
                                         1.0, 0.0, 1.0)))
    model = ModelParams(*(f(x) for x in (8.19e9, 0.0, 8.19e9, 36, 32, 8, 128, 4096,
                                         1.0, 2, 2)))
    return hw, model


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 1024), k=st.integers(1, 16), a=st.floats(0.0, 0.999),
       b=st.floats(0.0, 0.999))
def test_time_per_token_laws(n, k, a, b):
    """Proposals that are never accepted never beat plain decoding, and a
    higher acceptance never makes a token slower (float32, as users run it)."""
    hw, model = _h100_qwen3_8b()
    c = np.float32(C)

    def tpot(k, a):
        step = roofline.verify_step_s(hw, model, np.float32(1), np.float32(n), c,
                                      np.float32(k))
        return float(step / roofline.tokens_per_step(np.float32(k), np.float32(a)))

    plain = tpot(0, 0.0)
    assert tpot(k, 0.0) >= plain * (1 - 1e-6)
    lo, hi = sorted((a, b))
    assert tpot(k, hi) <= tpot(k, lo) * (1 + 1e-6)


@pytest.mark.slow
def test_simulated_p99_with_speculation(tmp_path):
    """``latency=simulate`` over the spec axes, the whole p99 part through the
    console script: at one running sequence, 4 proposals at 0.7 deliver
    2.77 tokens per step, so requests finish sooner while each delivery gap
    (the ITL) is a whole, slightly longer step; k = 0 is plain decoding."""
    out = tmp_path / "p99.zarr"
    proc = run_script("sweep-grid", [
        "experiment=seed", "grid.spec_tokens=[0,4]", "grid.spec_acceptance=[0.7]",
        "grid.concurrency=[1]", "grid.token_budget=[2048]",
        "grid.batching=[continuous]", "grid.traffic_tokens_per_day=[1e8]",
        "latency=simulate", "latency.num_requests=200",
        "grid.arrival_rate_per_s=[0.5]", f"out={out}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    ds = sweep.open_cube(out).load().squeeze()
    assert ds.ttft_p99_s.dims == ("spec_tokens",)
    assert ds.itl_p99_s.attrs["method"] == "simulate"
    on, off = ds.sel(spec_tokens=4), ds.sel(spec_tokens=0)
    assert (int(on.latency_status), int(off.latency_status)) == (0, 0)
    # one sequence at context ~1,500-2,000: memory-bound, the verification
    # step is the plain step (its contexts, sampled per delivery, differ a little)
    assert float(on.itl_p50_s) == pytest.approx(float(off.itl_p50_s), rel=0.01)
    assert float(on.e2e_p50_s) < 0.6 * float(off.e2e_p50_s)
    assert float(on.ttft_p99_s) <= float(off.ttft_p99_s)
    # the p99 never below one decode step of one sequence
    assert float(on.itl_p50_s) >= step(1, 1500, 1500)


@pytest.mark.slow
def test_acceptance_outside_zero_one_is_refused(tmp_path):
    proc = run_script("sweep-grid", ["experiment=seed", "grid.spec_acceptance=[1.5]",
                                     f"out={tmp_path / 'c.zarr'}"], cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "sweep-grid: error: grid.spec_acceptance = 1.5: every value must be in [0, 1]"]
    assert not (tmp_path / "c.zarr").exists()


@pytest.mark.slow
def test_report_draws_the_trade_off(spec_cube_path, tmp_path):
    report([spec_cube_path, "--out", tmp_path / "r"])
    check_png(tmp_path / "r" / "speculative_decoding.png")
    assert "### Speculative decoding" in (tmp_path / "r" / "report.md").read_text()


@pytest.mark.parametrize("app, args, message", [
    ("grid", ["grid.spec_tokens=[-1]"],
     "grid.spec_tokens = -1.0: every value must be in [0, 64]"),
    ("grid", ["grid.spec_tokens=[65]"],
     "grid.spec_tokens = 65.0: every value must be in [0, 64]"),
    ("grid", ["grid.spec_acceptance=[-0.1]"],
     "grid.spec_acceptance = -0.1: every value must be in [0, 1]"),
    ("optimize", ["search.spec_tokens=[0,-2]"],
     "search.spec_tokens = -2.0: every value must be in [0, 64]"),
    ("optimize", ["search.spec_acceptance=1.5"],
     "search.spec_acceptance = 1.5: one number in [0, 1], or one per "
     "search.spec_proposer (1)"),
])
def test_bad_speculation_is_one_line(app, args, message):
    with pytest.raises(ConfigError) as e:
        compose_app(app, args)
    assert str(e.value) == message
