"""Evaluates a point function over a Cartesian product: the only ``jit`` of a sweep.

The product is never built on the host. A compiled call receives the stacked
values of every axis (pytrees whose leading axis runs along the axis) and the
first index of a rectangular block, gathers each axis's indices for the block
once, and applies the one-point function through one ``jax.vmap`` per axis,
each batching only the arguments that vary along that axis. JAX leaves an
operation unbatched when none of its operands is batched, so every
sub-expression is computed at the rank of the axes it depends on (weight
bytes once per hardware x model, the prefill rate without the concurrency
axis, ...) and broadcast afterwards: measured 8-21x faster than gathering
every parameter per flat point (benchmarks/README.md, "Grid throughput").

*Tables* are inputs that vary along several axes at once (static batching's
slot utilisation per workload x concurrency; a simulator's request streams
per workload x arrival rate); each names the axes its leading dimensions run
along, in increasing order.

Every block has the same static shape, so a grid of any size compiles once;
a block sticking out of the cube repeats the axis's last index there and is
cut on the host. Blocks are aligned to the cube's leading axes, so each is a
region that can be written, and after an interruption skipped, on its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sweep.cube import contract


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

    def region(self, b: int) -> tuple[slice, ...]:
        """The cube region of block ``b``."""
        pos = np.unravel_index(b, self.grid)
        return tuple(
            slice(p * c, min((p + 1) * c, n))
            for p, c, n in zip(pos, self.chunks, self.shape)
        )


@dataclass
class Part:
    """One point function over the product of some of the cube's axes.

    The function takes one keyword argument per axis of the part and per
    table, named as they are: nothing depends on positions but the cube's
    layout (``sweep.cube.contract.dims``). ``fn``, ``axes``, ``tables`` and
    ``table_dims`` are the positional views ``sweep.grid.evaluate`` takes.
    """

    name: str  # sweep.cube.contract.ROOFLINE or P99: the part's dims and variables
    point: Callable  # keyword arguments: each dim's value, each table's
    inputs: dict[str, Any]  # per dim: its values, stacked along the leading axis
    plan: Blocking
    # per table name: its values and the dims its leading axes run along (in
    # the part's order)
    lookups: dict[str, tuple[Any, tuple[str, ...]]] = field(default_factory=dict)
    attrs: dict = field(default_factory=dict)  # added to each of its variables
    # the optional variables it computes (``contract.Metric.option``)
    options: frozenset[str] = frozenset()

    @property
    def dims(self) -> tuple[str, ...]:
        return contract.dims(self.name)

    @property
    def variables(self) -> tuple[contract.Metric, ...]:
        return contract.metrics(self.name, self.options)

    @property
    def fn(self) -> Named:
        return Named(self.point, (*self.dims, *self.lookups))

    @property
    def axes(self) -> tuple:
        return tuple(self.inputs[d] for d in self.dims)

    @property
    def tables(self) -> tuple:
        return tuple(values for values, _ in self.lookups.values())

    @property
    def table_dims(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(self.dims.index(d) for d in dims)
                     for _, dims in self.lookups.values())


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


@dataclass(frozen=True)
class Named:
    """A point function of keyword arguments, called with positional ones.

    ``evaluate_region`` passes each axis's and each table's value in order;
    ``Named`` gives them their names, so the function never depends on
    that order (hashable: a static jit argument, equal when built alike).
    """

    fn: Callable
    names: tuple[str, ...]  # of the axes, then of the tables

    def __call__(self, *args):
        return self.fn(**dict(zip(self.names, args, strict=True)))


@partial(jax.jit, static_argnames=("fn", "shape", "chunks", "table_dims"))
def evaluate_region(fn: Callable, axes: tuple, tables: tuple, starts, *,
                    shape: tuple[int, ...], chunks: tuple[int, ...],
                    table_dims: tuple[tuple[int, ...], ...]):
    """``fn`` over the block of shape ``chunks`` whose first index is ``starts``.

    Args:
      fn: one-point function ``fn(*axis_values, *table_values)`` returning a
        dict of scalars (static: a module-level function).
      axes: one pytree per axis, leading dimension = the axis's length.
      tables: pytrees whose leading dimensions run along ``table_dims``.
      starts: int32 ``(len(axes),)``, the block's first index along each axis.
      shape: the cube's shape (static).
      chunks: the block's shape (static).
      table_dims: for each table, the axes of its leading dimensions (static).

    Returns:
      A dict of arrays of shape ``chunks``.
    """
    idx = [jnp.minimum(starts[d] + jnp.arange(c, dtype=jnp.int32), n - 1)
           for d, (c, n) in enumerate(zip(chunks, shape))]
    args = [jax.tree.map(lambda x, i=i: x[i], axis) for axis, i in zip(axes, idx)]
    for table, dims in zip(tables, table_dims):
        grids = jnp.ix_(*(idx[d] for d in dims)) if dims else ()
        args.append(jax.tree.map(lambda x, g=grids: x[g] if g else x, table))
    n = len(axes)
    for d in reversed(range(n)):
        in_axes = [None] * len(args)
        in_axes[d] = 0
        for t, dims in enumerate(table_dims):
            if d in dims:
                in_axes[n + t] = 0
        fn = jax.vmap(fn, in_axes=tuple(in_axes))
    return fn(*args)


def iterate_blocks(fn: Callable, axes: tuple, plan: Blocking, tables: tuple = (),
                   table_dims: tuple = (), skip: Any = frozenset()
                   ) -> Iterator[tuple[int, tuple[slice, ...], dict]]:
    """Yields ``(block id, region, {name: ndarray of the region's shape})``."""
    for b in range(len(plan)):
        if b in skip:
            continue
        region = plan.region(b)
        starts = jnp.asarray([r.start for r in region], jnp.int32)
        out = evaluate_region(fn, axes, tables, starts, shape=plan.shape,
                              chunks=plan.chunks, table_dims=table_dims)
        cut = tuple(slice(0, r.stop - r.start) for r in region)
        yield b, region, {k: np.asarray(v)[cut] for k, v in out.items()}
