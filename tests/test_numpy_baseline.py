"""The benchmark baselines compute what the JAX sweep computes.

``benchmarks/grid_throughput.py`` compares the JAX grid path with NumPy
implementations of the same formulas and a plain-Python loop; the comparison
only means something if all of them give the same cube. One small grid
composed from the shipped configs (every hardware and model, three workloads,
all batching modes, token budgets that do and do not divide the long prompt,
contexts that overflow memory) cut into several blocks, some of them padded.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import grid_job, numpy_baseline

from sweep.grid import job as grid
from sweep.grid.evaluate import Part, iterate_blocks

numpy_model = numpy_baseline()

OVERRIDES = [
    "grid.workload=[seed_chat,azure_conv_2023,rag_long_prompt]",
    "grid.tensor_parallel=[1,4]",
    "grid.concurrency=[1,8,64,300]",
    "grid.token_budget=[100,512,3000]",
    "grid.context_tokens=[1500,16000]",
    "grid.batching=[request,static,continuous]",
    "grid.long_prompt_tokens=[300,8192]",
    "grid.traffic_tokens_per_day=[1.0e+7,1.0e+9]",
    "grid.spec_tokens=[0,3]",
    "grid.spec_acceptance=[0.6,1.0]",
    "grid.prefix_caching=[false,true]",
    "workload.prefix_hit_fraction=0.45",
    "grid.chunk_points=2000",
    "calibration=roofline",  # the baseline is the bound
]


@pytest.fixture(scope="module")
def job() -> grid.GridJob:
    return grid_job(OVERRIDES)


@pytest.fixture(scope="module")
def part(job) -> Part:
    return job.parts[0]


@pytest.fixture(scope="module")
def axes(part) -> tuple:
    return numpy_model.to_numpy(part.axes)


@pytest.fixture(scope="module")
def jax_blocks(part) -> dict[int, dict[str, np.ndarray]]:
    return {b: values for b, _, values in iterate_blocks(
        part.fn, part.axes, part.plan, part.tables, part.table_dims)}


def _cut(region) -> tuple[slice, ...]:
    return tuple(slice(0, r.stop - r.start) for r in region)


def test_grid_has_padded_blocks_and_infeasible_points(part, jax_blocks):
    plan = part.plan
    assert len(plan) > 2
    # some blocks overhang the cube: their extra points are padding
    assert any(tuple(r.stop - r.start for r in plan.region(b)) != plan.chunks
               for b in range(len(plan)))
    fits = np.concatenate([v["kv_fits"].ravel() for v in jax_blocks.values()])
    assert fits.any() and not fits.all()


@pytest.mark.parametrize("name", ["evaluate_region_flat", "evaluate_region_broadcast"])
def test_numpy_blocks_equal_jax(name, part, axes, jax_blocks):
    evaluate = getattr(numpy_model, name)
    plan = part.plan
    (utilization,) = part.tables
    for b, expected in jax_blocks.items():
        region = plan.region(b)
        out = evaluate(axes, utilization, [r.start for r in region], shape=plan.shape,
                       chunks=plan.chunks)
        assert set(out) == set(expected)
        for key, want in expected.items():
            got = out[key][_cut(region)]
            assert got.dtype == want.dtype and got.shape == want.shape, key
            # float32 both sides, same formulas; XLA and NumPy may round a
            # division or power differently in the last bit
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=0, err_msg=key)


def test_python_loop_equals_jax(part, axes, jax_blocks):
    """The loop is independent: float64, and the long prompt chunk by chunk."""
    plan = part.plan
    sample = np.random.default_rng(0).choice(math.prod(plan.shape), 1500,
                                             replace=False)
    got = numpy_model.evaluate_points_python(axes, sample, plan.shape)
    cube = {key: np.empty(plan.shape, want.dtype)
            for key, want in jax_blocks[0].items()}
    for b, values in jax_blocks.items():
        for key, v in values.items():
            cube[key][plan.region(b)] = v
    for key, full in cube.items():
        want = full.ravel()[sample]
        have = np.array([p[key] for p in got], dtype=np.float64)
        # float32 (JAX) against float64 (Python): a few float32 ulps per step
        np.testing.assert_allclose(have, want, rtol=1e-4, atol=0, err_msg=key)


def test_seed_itl_by_hand(job, part, axes):
    """H100 SXM, Qwen3-8B, 8 users at 1,500 tokens: the SPEC's 5.42 ms step."""
    coords = job.coords
    pos = [0] * len(coords)
    pos[0] = list(coords["hardware"]).index("h100_sxm")
    pos[1] = list(coords["model"]).index("qwen3_8b")
    pos[4] = list(coords["concurrency"]).index(8)
    pos[6] = list(coords["context_tokens"]).index(1500)
    pos[7] = list(coords["batching"]).index("continuous")
    (utilization,) = part.tables
    out = numpy_model.evaluate_region_flat(axes, utilization, pos,
                                           shape=part.plan.shape,
                                           chunks=(1,) * len(pos))
    step_s = float(out["step_s"].ravel()[0])
    # (16.38 GB weights + 8 x 1,500 x 147,456 B KV) / 3.35 TB/s = 5.418 ms
    expected_s = (8.19e9 * 2 + 8 * 1500 * 147_456) / 3.35e12
    np.testing.assert_allclose(step_s, expected_s, rtol=1e-6)
    assert step_s * 1e3 == pytest.approx(5.42, abs=0.005)
