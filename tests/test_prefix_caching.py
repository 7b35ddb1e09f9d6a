"""Prefix caching, against float64 hand calculations: the seed scenario
(H100 SXM, Qwen3-8B, 1,500-token prompts) built by ``sweep-grid`` with
``grid.prefix_caching=[false,true]`` at a hit fraction of 0.6."""

from __future__ import annotations

import math

import numpy as np
import pytest
import xarray as xr
from helpers import (
    check_png,
    chunked,
    compose_app,
    cost_per_mtok,
    jit_once,
    report,
    run_script,
    squeeze_except,
    step,
)

import sweep
from sweep.config.schema import ConfigError
from sweep.report import plots

HIT, PROMPT, LONG, BUDGET = 0.6, 1500, 8192, 2048


def cached_by_hand(prompt, hit):
    """The first h P tokens, in whole 16-token blocks (vLLM's block size)."""
    return math.floor(hit * prompt / 16) * 16


def prefill_by_hand(prompt, cached):
    """The new tokens after the cached prefix in one step: they read the
    prefix's KV and attend to it, causally among themselves."""
    m = prompt - cached
    return step(m, cached, m * cached + m * (m + 1) / 2)


@pytest.fixture(scope="module")
def prefix_cube_path(tmp_path_factory):
    out = tmp_path_factory.mktemp("prefix") / "prefix.zarr"
    proc = run_script("sweep-grid", [
        "experiment=seed", "grid.prefix_caching=[false,true]",
        f"workload.prefix_hit_fraction={HIT}", "grid.concurrency=[1,64]",
        f"grid.token_budget=[{BUDGET}]", "grid.batching=[continuous]",
        f"out={out}"], cwd=out.parent)
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture(scope="module")
def cube(prefix_cube_path) -> xr.Dataset:
    return squeeze_except(sweep.open_cube(prefix_cube_path).load(),
                          "prefix_caching", "concurrency").isel(
        traffic_tokens_per_day=0)


def test_hand_numbers():
    assert cached_by_hand(PROMPT, HIT) == 896  # 900 tokens -> 56 blocks
    assert cached_by_hand(LONG, HIT) == 4912  # 4915.2 -> 307 blocks


@pytest.mark.slow
def test_prefill_with_caching_by_hand(cube):
    off, on = cube.sel(prefix_caching=0), cube.sel(prefix_caching=1)
    # off: the whole prompt computed, as before
    rate_off = PROMPT / step(PROMPT, 0, PROMPT * (PROMPT + 1) / 2)
    c = cached_by_hand(PROMPT, HIT)
    rate_on = PROMPT / prefill_by_hand(PROMPT, c)
    for n in (1, 64):
        assert float(off.prefix_hit_fraction.sel(concurrency=n)) == 0.0
        assert float(on.prefix_hit_fraction.sel(concurrency=n)) == pytest.approx(
            c / PROMPT, rel=1e-6)
        assert float(off.prefill_tokens_per_s.sel(concurrency=n)) == pytest.approx(
            rate_off, rel=1e-5)
        assert float(on.prefill_tokens_per_s.sel(concurrency=n)) == pytest.approx(
            rate_on, rel=1e-5)
        assert float(on.cost_per_mtok_in_usd.sel(concurrency=n)) == pytest.approx(
            cost_per_mtok(rate_on), rel=1e-5)
    # compute-bound: 604 new tokens instead of 1,500, but their attention
    # over the cached 896 keys is still computed: a little under 1500 / 604
    assert 2.4 < rate_on / rate_off < PROMPT / (PROMPT - c)
    # the decode side does not change
    for v in ("step_s", "cost_per_mtok_out_usd", "max_concurrency_fit"):
        np.testing.assert_array_equal(off[v].values, on[v].values)


@pytest.mark.slow
def test_serving_flags_at_a_cube_point(cube):
    for on in (0, 1):
        vllm = cube.sweep.to_serving_flags(prefix_caching=on, concurrency=64)
        assert ("--enable-prefix-caching" in vllm.cli) == bool(on)
        sglang = cube.sweep.to_serving_flags("sglang", prefix_caching=on,
                                             concurrency=64)
        assert ["radix cache" in n for n in sglang.notes] == [True] * on


@pytest.mark.slow
def test_long_prompt_chunks_start_after_the_cached_prefix(cube):
    c = cached_by_hand(LONG, HIT)
    for n in (1, 64):
        pt = cube.sel(prefix_caching=1, concurrency=n)
        # helpers.chunked from the cached prefix: chunks of the budget,
        # each reading the n decodes' context and everything before it
        total, steps, worst = chunked_from(n, 1500, LONG, BUDGET, c)
        assert float(pt.long_prefill_steps) == steps == math.ceil((LONG - c) / BUDGET)
        assert float(pt.long_prefill_s) == pytest.approx(total, rel=1e-5)
        assert float(pt.long_prefill_worst_itl_s) == pytest.approx(worst, rel=1e-5)
        off = cube.sel(prefix_caching=0, concurrency=n)
        assert (float(off.long_prefill_s), float(off.long_prefill_steps)) == (
            pytest.approx(chunked(n, 1500, LONG, BUDGET)[0], rel=1e-5), 4.0)


def chunked_from(n, ctx, prompt, budget, cached):
    """Chunk by chunk from ``cached`` (independent of helpers.chunked's start)."""
    total, steps, worst, done = 0.0, 0, 0.0, cached
    while done < prompt:
        m = min(budget, prompt - done)
        t = step(n + m, n * ctx + done, n * ctx + m * done + m * (m + 1) / 2)
        total, steps, worst, done = total + t, steps + 1, max(worst, t), done + m
    return total, steps, worst


@pytest.mark.parametrize("value", [1.0, -0.1, 1.5, "nan"])
def test_bad_hit_fraction_is_one_line(value):
    with pytest.raises(ConfigError,
                       match=r"workload\[seed_chat\]\.prefix_hit_fraction = .*"
                             r"must be a finite number in \[0, 1\)"):
        compose_app("grid", ["experiment=seed",
                             f"workload.prefix_hit_fraction={value}"])


def test_bad_prefix_caching_axis_is_one_line():
    with pytest.raises(ConfigError, match=r"grid\.prefix_caching: 0 appears more than "
                                          "once"):
        compose_app("grid", ["experiment=seed", "grid.prefix_caching=[false,false]"])


def test_surrogate_at_zero_load_by_hand():
    """No traffic, 1,500-token prompts: the p50 TTFT is the prefill of the
    604 tokens after the 896 cached, in one chunk of the 2,048 budget."""
    import jax
    import jax.numpy as jnp

    from sweep.config.convert import hardware_params, model_params
    from sweep.latency.surrogate import latency_workload, surrogate
    from sweep.latency.workload import WorkloadTables

    app = compose_app("grid", ["experiment=seed"])
    hw, model = hardware_params(app.hardware, 1.0), model_params(app.model)
    wl = latency_workload(WorkloadTables(
        "fixed", np.array([1500.0]), np.array([1.0]), np.array([200.0]),
        np.array([1.0])))
    out = jit_once(jax.vmap(lambda h: surrogate(
        hw, model, wl, 1.0, 64.0, 2048.0, 1e-6, prefix_hit_fraction=h)))(
        jnp.array([0.0, HIT], jnp.float32))
    ttft = np.asarray(out["ttft_p50_s"])
    # the logistic kernels are 0.3 % wide; the median of a symmetric one is exact
    np.testing.assert_allclose(ttft[0], prefill_by_hand(PROMPT, 0), rtol=2e-3)
    np.testing.assert_allclose(ttft[1], prefill_by_hand(PROMPT, 896), rtol=2e-3)
    # the decodes keep the whole prompt as context: the ITL does not change
    np.testing.assert_allclose(*np.asarray(out["itl_p50_s"]), rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["simulate", "surrogate"])
def test_p99_with_caching(tmp_path, method):
    """The p99 part over grid.prefix_caching through the console script: at
    8 req/s of 1,500-token prompts, caching 896 of them cuts the p99 TTFT;
    at zero load it would be the hand prefill (604 new tokens)."""
    out = tmp_path / "p99.zarr"
    proc = run_script("sweep-grid", [
        "experiment=seed", "grid.prefix_caching=[false,true]",
        f"workload.prefix_hit_fraction={HIT}", "grid.concurrency=[64]",
        f"grid.token_budget=[{BUDGET}]", "grid.batching=[continuous]",
        "grid.traffic_tokens_per_day=[1e8]", f"latency={method}",
        "latency.num_requests=200", "grid.arrival_rate_per_s=[8]",
        f"out={out}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    ds = sweep.open_cube(out).load().squeeze()
    assert ds.ttft_p99_s.dims == ("prefix_caching",)
    assert ds.ttft_p99_s.attrs["method"] == method
    on, off = ds.sel(prefix_caching=1), ds.sel(prefix_caching=0)
    assert (int(on.latency_status), int(off.latency_status)) == (0, 0)
    assert float(on.ttft_p99_s) < float(off.ttft_p99_s)
    # never below the prefill of the uncached tokens alone
    assert float(on.ttft_p50_s) >= prefill_by_hand(PROMPT, 896) * (1 - 2e-3)
    if method == "surrogate":
        _check_report(out, tmp_path / "r", ds)


def _plotted(ax) -> tuple[np.ndarray, np.ndarray]:
    """The x and y of a panel's line (off to on)."""
    line = ax.get_lines()[0]
    return np.asarray(line.get_xdata()), np.asarray(line.get_ydata())


def _check_report(out, folder, ds: xr.Dataset) -> None:
    """sweep-report draws the trade-off; its panels plot the cube's values at
    hit fraction 0 (off) and the workload's (on): the grid has one
    configuration, so each is the cheapest point."""
    report([out, "--out", folder])
    check_png(folder / "prefix_caching.png")
    assert "### Prefix caching" in (folder / "report.md").read_text()
    fig = plots.prefix_caching(sweep.open_cube(out), "h100_sxm", "qwen3_8b", {})
    axes = fig.get_axes()
    assert [ax.get_ylabel() for ax in axes] == [
        "cost per 1M input tokens (USD / Mtoken)", "p99 TTFT (ms)", "p99 ITL (ms)"]
    for ax, var, scale in zip(axes, ("cost_per_mtok_in_usd", "ttft_p99_s",
                                     "itl_p99_s"), (1.0, 1e3, 1e3)):
        x, y = _plotted(ax)
        np.testing.assert_allclose(x, [0.0, cached_by_hand(PROMPT, HIT) / PROMPT],
                                   rtol=1e-6)
        np.testing.assert_allclose(y, ds[var].values * scale, rtol=1e-6)


@pytest.mark.slow
def test_chart_without_p99_shows_the_prefill_rate(prefix_cube_path):
    """On a roofline cube the second panel is the prefill rate per GPU (the
    same at both concurrencies: it is prefill alone) against the hit fraction."""
    fig = plots.prefix_caching(sweep.open_cube(prefix_cube_path), "h100_sxm",
                               "qwen3_8b", {})
    axes = fig.get_axes()
    assert axes[1].get_ylabel() == "prefill rate per GPU (tokens/s/GPU)"
    x, y = _plotted(axes[1])
    np.testing.assert_allclose(x, [0.0, cached_by_hand(PROMPT, HIT) / PROMPT],
                               rtol=1e-6)
    np.testing.assert_allclose(
        y, [PROMPT / step(PROMPT, 0, PROMPT * (PROMPT + 1) / 2),
            PROMPT / prefill_by_hand(PROMPT, cached_by_hand(PROMPT, HIT))],
        rtol=2e-3)
