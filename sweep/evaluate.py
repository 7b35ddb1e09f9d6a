"""Evaluates ``evaluate_point`` over a Cartesian grid: the only ``jit`` of a sweep.

The product of the axes is never built on the host. A compiled call receives
the stacked per-axis parameters and a start offset, turns ``start + arange(S)``
into multi-indices with ``unravel_index``, gathers each point's parameters and
vmaps the point model. Every call has the same static size ``S``, so a grid of
any size compiles once; the last block is padded (its extra points repeat the
final point and are dropped).

Blocks are contiguous in C order and aligned to the cube's leading axes, so
each one is a rectangular region of the cube that can be written (and, after
an interruption, skipped) on its own.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sweep.cost import static_slot_utilization
from sweep.params import GridPoint, HardwareParams, ModelParams, WorkloadParams
from sweep.point import evaluate_point

DIMS = (
    "hardware",
    "model",
    "workload",
    "tensor_parallel",
    "concurrency",
    "token_budget",
    "context_tokens",
    "batching",
    "long_prompt_tokens",
    "traffic_tokens_per_day",
)
POINT_AXES = DIMS[3:]


class GridInputs(NamedTuple):
    """Stacked parameters of every axis (leading axis = that axis's length)."""

    hardware: HardwareParams
    model: ModelParams
    workload: WorkloadParams
    axes: GridPoint  # each leaf shape (n_axis,)


def shape_of(inputs: GridInputs) -> tuple[int, ...]:
    """The cube's shape, in ``DIMS`` order."""
    return (
        inputs.hardware.memory_bytes.shape[0],
        inputs.model.layers.shape[0],
        inputs.workload.mean_prompt_tokens.shape[0],
        *(leaf.shape[0] for leaf in inputs.axes),
    )


@partial(jax.jit, static_argnames=("shape", "size"))
def evaluate_block(inputs: GridInputs, start, *, shape, size):
    """Metrics of the ``size`` points from flat index ``start`` (C order).

    Returns a dict of arrays of shape ``(size,)``.
    """
    total = math.prod(shape)
    flat = jnp.minimum(start + jnp.arange(size, dtype=jnp.int32), total - 1)
    idx = jnp.unravel_index(flat, shape)
    # static batching's slot utilisation depends on (workload, concurrency)
    # only: tabulate it once per block instead of once per point
    util = jax.vmap(
        lambda v, p: jax.vmap(lambda b: static_slot_utilization(v, p, b))(
            inputs.axes.concurrency
        )
    )(inputs.workload.output_values, inputs.workload.output_probs)

    def one(i):
        take = lambda tree, j: jax.tree.map(lambda x: x[j], tree)  # noqa: E731
        pt = GridPoint(*(axis[i[3 + k]] for k, axis in enumerate(inputs.axes)))
        return evaluate_point(
            take(inputs.hardware, i[0]),
            take(inputs.model, i[1]),
            take(inputs.workload, i[2]),
            pt,
            util[i[2], i[4]],
        )

    return jax.vmap(one)(idx)


@dataclass(frozen=True)
class Blocking:
    """How a cube is cut into equal, rectangular, C-contiguous blocks."""

    shape: tuple[int, ...]
    chunks: tuple[int, ...]  # block shape (also the zarr chunk shape)

    @property
    def size(self) -> int:
        return math.prod(self.chunks)

    @property
    def grid(self) -> tuple[int, ...]:
        return tuple(-(-n // c) for n, c in zip(self.shape, self.chunks))

    def __len__(self) -> int:
        return math.prod(self.grid)

    def block(self, b: int) -> tuple[int, tuple[slice, ...]]:
        """Flat start index and region of block ``b``."""
        pos = np.unravel_index(b, self.grid)
        region = tuple(
            slice(p * c, min((p + 1) * c, n))
            for p, c, n in zip(pos, self.chunks, self.shape)
        )
        start = int(np.ravel_multi_index([r.start for r in region], self.shape))
        return start, region


def blocking(shape: tuple[int, ...], max_points: int) -> Blocking:
    """Largest blocks of at most ``max_points`` points that keep whole trailing axes.

    The block spans all of the axes after some axis ``d``, ``k`` indices of
    ``d`` and one index of each axis before it.
    """
    for d in range(len(shape)):
        inner = math.prod(shape[d + 1:])
        if inner <= max_points:
            k = min(shape[d], max(1, max_points // inner))
            return Blocking(tuple(shape), (1,) * d + (k,) + tuple(shape[d + 1:]))
    raise ValueError(f"max_points must be >= 1, got {max_points}")


def iterate_blocks(inputs: GridInputs, plan: Blocking,
                   skip: set[int] = frozenset()) -> Iterator[tuple[int, tuple, dict]]:
    """Yields ``(block id, region, {name: ndarray of the region's shape})``."""
    for b in range(len(plan)):
        if b in skip:
            continue
        start, region = plan.block(b)
        out = evaluate_block(inputs, jnp.int32(start), shape=plan.shape, size=plan.size)
        region_shape = tuple(r.stop - r.start for r in region)
        n = math.prod(region_shape)
        yield b, region, {
            k: np.asarray(v)[:n].reshape(region_shape) for k, v in out.items()
        }
