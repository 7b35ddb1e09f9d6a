"""The vmapped grid evaluation: equals a loop, compiles once, obeys the laws."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from helpers import grid_job
from hypothesis import given, settings
from hypothesis import strategies as st

from sweep import exported
from sweep.exported import jit
from sweep.grid.evaluate import (
    FLAT_MIN,
    MIN_CHUNK_BYTES,
    blocking,
    evaluate_regions,
    iterate_blocks,
)
from sweep.model import batching, roofline
from sweep.model.params import GridPoint
from sweep.model.point import DIMS, evaluate_point

SMALL = [
    "grid=small", "grid.hardware=[h100_sxm,l40s]", "grid.model=[qwen3_8b,mixtral_8x7b]",
    "grid.batching=[request,static,continuous]", "grid.chunk_points=12",
    "calibration=roofline",  # the loop below runs the bare point function
]


@pytest.fixture(scope="module")
def job():
    return grid_job(SMALL)


def test_blocks_cover_the_cube_once():
    plan = blocking((2, 3, 5, 7), 40)
    seen = np.zeros(plan.shape, int)
    for b in range(len(plan)):
        seen[plan.region(b)] += 1
    assert (seen == 1).all()
    assert plan.size <= 40


def _blocks(part):
    return iterate_blocks(part.fn, part.axes, part.plan, part.tables, part.table_dims)


def _cube(part):
    out = {}
    for _, region, values in _blocks(part):
        for k, v in values.items():
            out.setdefault(k, np.zeros(part.plan.shape, v.dtype))[region] = v
    return out


def _block_programs() -> dict[str, int]:
    """The block programs this process holds (``sweep.exported`` keeps them
    beside the session's compilation cache), each with the signatures it
    compiled."""
    return {k: p._cache_size() for k, p in exported._programs.items()
            if k.startswith(exported.name(evaluate_regions))}


@pytest.fixture(scope="module")
def cube(job):
    """The part's cube, block by block, from no block program in the process;
    and the programs that compiled."""
    for k in _block_programs():
        del exported._programs[k]
    values = _cube(job.parts[0])
    return values, _block_programs()


def test_vmap_equals_python_loop_over_points(job, cube):
    part = job.parts[0]
    got, _ = cube
    take = lambda tree, i: jax.tree.map(lambda x: x[i], tree)  # noqa: E731
    rng = np.random.default_rng(0)
    from sweep.model.cost import static_slot_utilization

    for flat in rng.choice(job.points, size=12, replace=False):
        idx = np.unravel_index(flat, part.plan.shape)
        hw, model, wl, *rest = (take(a, i) for a, i in zip(part.axes, idx))
        pt = GridPoint(*rest)
        # the slot utilisation recomputed in float32 JAX, not taken from the table
        util = static_slot_utilization(wl.output_values, wl.output_probs,
                                       pt.concurrency)
        one = evaluate_point(hw, model, wl, pt, util)
        for k, v in one.items():
            np.testing.assert_allclose(got[k][idx], np.asarray(v), rtol=2e-6,
                                       equal_nan=True, err_msg=k)


def test_several_blocks_one_compiled_shape(job, cube):
    plan = job.parts[0].plan
    _, compiled = cube
    assert len(plan) > 1
    # the last blocks overhang the cube: padded to the one shape, not recompiled
    assert any(tuple(r.stop - r.start for r in plan.region(b)) != plan.chunks
               for b in range(len(plan)))
    assert list(compiled.values()) == [1]
    list(_blocks(job.parts[0]))  # a second sweep compiles nothing
    assert _block_programs() == compiled


def test_points_that_do_not_fit_are_flagged_with_nan_metrics(job, cube):
    out, _ = cube
    fits = out["kv_fits"]
    assert fits.any() and not fits.all()
    assert np.isnan(out["step_s"][~fits]).all()
    assert np.isfinite(out["step_s"][fits]).all()
    assert np.isfinite(out["max_concurrency_fit"]).all()
    # under continuous batching a point fits exactly up to max_concurrency_fit
    axis = DIMS.index("batching")
    cont = batching.index("continuous")
    shape = [1] * (len(DIMS) - 1)
    shape[DIMS.index("concurrency")] = -1
    conc = job.coords["concurrency"].reshape(shape)
    np.testing.assert_array_equal(
        fits.take(cont, axis=axis),
        conc <= out["max_concurrency_fit"].take(cont, axis=axis))


# --- property tests: one compiled shape, values drawn by hypothesis ----------

_point = jit(evaluate_point)


def _params(job, bw_scale=1.0, flops_scale=1.0):
    take = lambda tree, i: jax.tree.map(lambda x: x[i], tree)  # noqa: E731
    hw_axis, model_axis, wl_axis = job.parts[0].axes[:3]
    hw = take(hw_axis, 0)
    hw = hw._replace(memory_bandwidth_bytes_per_s=hw.memory_bandwidth_bytes_per_s
                     * np.float32(bw_scale),
                     peak_flops_per_s=hw.peak_flops_per_s * np.float32(flops_scale))
    return hw, take(model_axis, 0), take(wl_axis, 0)


def _pt(conc, ctx, budget=512.0, tp=1.0):
    f = np.float32
    return GridPoint(f(tp), f(conc), f(budget), f(ctx), np.int32(2), f(8192.0), f(1e8))


concurrency = st.integers(1, 300)
context = st.integers(1, 20_000)


@settings(max_examples=40, deadline=None)
@given(conc=concurrency, ctx=context, scale=st.floats(1.0, 4.0))
def test_more_bandwidth_or_flops_never_slows_a_step(job, conc, ctx, scale):
    hw, model, wl = _params(job)
    base = _point(hw, model, wl, _pt(conc, ctx), np.float32(1))
    for bw, fl in ((scale, 1.0), (1.0, scale)):
        hw2, _, _ = _params(job, bw, fl)
        faster = _point(hw2, model, wl, _pt(conc, ctx), np.float32(1))
        assert float(faster["step_s"]) <= float(base["step_s"]) or (
            np.isnan(base["step_s"]))
        assert float(faster["long_prefill_s"]) <= float(base["long_prefill_s"]) or (
            np.isnan(base["long_prefill_s"]))


@settings(max_examples=40, deadline=None)
@given(conc=concurrency, ctx=context, more=st.integers(1, 64))
def test_more_concurrency_or_context_never_lowers_step_time(job, conc, ctx, more):
    hw, model, wl = _params(job)
    s = lambda n, c: float(roofline.decode_step_s(hw, model, 1.0, float(n), float(c)))  # noqa: E731
    assert s(conc + more, ctx) >= s(conc, ctx)
    assert s(conc, ctx + more) >= s(conc, ctx)


@settings(max_examples=40, deadline=None)
@given(conc=st.integers(2, 2000), ctx=context, tp=st.sampled_from([1.0, 2.0, 4.0]))
def test_a_point_that_fits_at_n_fits_at_n_minus_1(job, conc, ctx, tp):
    hw, model, _ = _params(job)
    if bool(roofline.kv_fits(hw, model, tp, float(conc), float(ctx))):
        assert bool(roofline.kv_fits(hw, model, tp, float(conc - 1), float(ctx)))


def test_batches_tiling_a_write_block_equal_one_call_per_block(job, cube):
    # a write block evaluated in smaller compiled calls (the surrogate's way),
    # the last ones sticking out of it and out of the cube, cut
    part = job.parts[0]
    whole = blocking(part.plan.shape, 10**6)
    batch = blocking(part.plan.shape, 7).chunks
    assert len(whole) == 1 and math.prod(batch) < whole.size
    (_, region, got), = iterate_blocks(part.fn, part.axes, whole, part.tables,
                                       part.table_dims, batch=batch)
    want, _ = cube
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)


def test_surrogate_chunks_hold_a_megabyte_and_batches_stay_small():
    job = grid_job(["grid.hardware=[h100_sxm,h200_sxm,b200]", "model=qwen3_8b",
                    "latency=surrogate",
                    "grid.arrival_rate_per_s=${range:1,10,10,linear}",
                    "grid.concurrency=${range:1,1024,64,log}",
                    "grid.token_budget=${range:256,16384,32,log}"])
    p99 = job.parts[1]
    assert len(p99.plan) > 1
    assert p99.plan.size * 4 >= MIN_CHUNK_BYTES
    assert p99.points == 4096  # conf/latency/surrogate.yaml


def test_surrogate_grids_of_other_sizes_share_one_program():
    """Small surrogate grids of other sizes (168 and 252 configurations) and
    of two GPUs instead of one evaluate through one block program: the same
    padded axes and tables and points per call (``Part.points``,
    ``padded_inputs``), so only the first compiles; and the configurations
    they share have the same values in each (no padding leaks into a
    cube)."""
    base = ["model=qwen3_8b", "latency=surrogate"]
    parts = [grid_job([*base, *more]).parts[1] for more in (
        ["hardware=h100_sxm", "grid.concurrency=[16,64]"],
        ["hardware=h100_sxm", "grid.concurrency=[16,64,256]"],
        ["grid.hardware=[h100_sxm,h200_sxm]", "grid.concurrency=[64]"])]
    assert [p.plan.size for p in parts] == [168, 252, 168]
    assert [p.points for p in parts] == [FLAT_MIN] * 3
    assert [p.plan.shape[0] for p in parts] == [1, 1, 2]  # GPUs, in a table too
    assert any(0 in dims for dims in parts[2].table_dims)
    before = set(_block_programs())
    cubes = []
    for p in parts:
        cube = {}
        for _, region, values in iterate_blocks(p.fn, p.axes, p.plan, p.tables,
                                                p.table_dims, flat=True,
                                                points=p.points,
                                                xla_defaults=p.xla_defaults):
            for k, v in values.items():
                cube.setdefault(k, np.zeros(p.plan.shape, v.dtype))[region] = v
        cubes.append(cube)
    new = {k: n for k, n in _block_programs().items() if k not in before}
    assert list(new.values()) == [1], new  # one program, one signature
    # H100 at concurrency 64 is in every grid: the same values in each
    one, two, three = cubes
    for k, v in one.items():
        np.testing.assert_array_equal(v[:, :, :, :, 1], two[k][:, :, :, :, 1],
                                      err_msg=k)
        np.testing.assert_array_equal(v[:, :, :, :, 1], three[k][:1, :, :, :, 0],
                                      err_msg=k)


def _indices(a, b, c, pair, row, scalar):
    """Each argument's value encodes where it was gathered from."""
    return {"v": a * 1e5 + b * 1e4 + c * 1e3 + pair * 10 + row + scalar}


def test_flat_evaluation_gathers_what_the_nested_vmaps_pass():
    """One vmap over the block's points (``Part.flat``, the p99 part's way)
    hands the point function the same axis and table values as the nested
    vmaps, blocks sticking out of the cube included: multiples of 1/8 that
    float32 holds exactly, compared exactly."""
    shape = (3, 5, 5)
    axes = tuple(np.arange(n, dtype=np.float32) for n in shape)
    pair = np.arange(3 * 5, dtype=np.float32).reshape(3, 5)  # along axes 0 and 2
    row = np.arange(5, dtype=np.float32) / 8  # along axis 1
    tables, table_dims = (pair, row, np.float32(0.25)), ((0, 2), (1,), ())
    plan = blocking(shape, 12)
    # the last block along axis 1 sticks out of the cube; batches of 3
    # along axis 2 stick out of every block
    assert plan.chunks == (1, 2, 5)

    def cube(flat):
        out = np.full(shape, np.nan, np.float32)
        for _, region, values in iterate_blocks(
                _indices, axes, plan, tables, table_dims, batch=(1, 2, 3), flat=flat):
            out[region] = values["v"]
        return out

    a, b, c = np.meshgrid(*axes, indexing="ij")
    want = (a * 1e5 + b * 1e4 + c * 1e3 + pair[:, None, :] * 10
            + row[None, :, None] + 0.25).astype(np.float32)
    np.testing.assert_array_equal(cube(flat=False), want)
    np.testing.assert_array_equal(cube(flat=True), want)


def test_flat_roofline_equals_the_nested_one(job, cube):
    """The roofline part through one flat vmap: the nested cube within float32
    rounding (XLA fuses the two programs differently)."""
    part = job.parts[0]
    want, _ = cube
    got = {}
    for _, region, values in iterate_blocks(part.fn, part.axes, part.plan,
                                            part.tables, part.table_dims, flat=True):
        for k, v in values.items():
            got.setdefault(k, np.zeros(part.plan.shape, v.dtype))[region] = v
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-6, err_msg=k)
