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

A part of loop-built point functions (the p99 part: ``Part.flat``) is
instead evaluated through one ``vmap`` over the block's points
(``_region``).

Every block has the same static shape, so a grid of any size compiles once;
a block sticking out of the cube repeats the axis's last index there and is
cut on the host. Blocks are aligned to the cube's leading axes, so each is a
region that can be written, and after an interruption skipped, on its own.

A part's *write blocks* (``Part.plan``: its zarr chunks, and the unit of
resuming and of sharding) may hold several *batches* (``Part.batch``: the
shape of one compiled call): the surrogate evaluates a few hundred
configurations per call but writes chunks of at least 1 MB, since a store of
tiny chunks is slow to write and to read.

Batches are spread over every local device (a GPU each, or host devices
with ``XLA_FLAGS=--xla_force_host_platform_device_count=N``): one compiled
call (``evaluate_regions``, ``jax.shard_map`` over a one-axis ``Mesh``)
evaluates one batch per device, each device running the one-batch program,
so a cube's values are the same on one device or eight. JAX dispatches
asynchronously: the devices evaluate the next batch while the host copies,
assembles and writes the last (``iterate_blocks``).
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
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sweep import exported
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
    batch_points: int | None = None  # per compiled call; None: a whole write block
    # the optional variables it computes (``contract.Metric.option``)
    options: frozenset[str] = frozenset()

    @property
    def batch(self) -> tuple[int, ...]:
        """The shape of one compiled call's block, tiling a write block."""
        if self.batch_points is None or self.batch_points >= self.plan.size:
            return self.plan.chunks
        return blocking(self.plan.chunks, self.batch_points).chunks

    @property
    def dims(self) -> tuple[str, ...]:
        return contract.dims(self.name)

    @property
    def flat(self) -> bool:
        """One vmap over the block's points instead of one per axis
        (``_region``): the p99 part, whose point functions are built around
        loops."""
        return self.name == contract.P99

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


MIN_CHUNK_BYTES = 1 << 20
"""The least a chunk of a float32 variable holds when the cube is large enough."""


def write_blocking(shape: tuple[int, ...], batch_points: int) -> Blocking:
    """Write blocks of at least ``batch_points`` and of more than
    ``MIN_CHUNK_BYTES`` of float32 per variable, whole batches where the
    cube allows (``blocking`` gives more than half its ``max_points``)."""
    return blocking(shape, max(batch_points, 2 * MIN_CHUNK_BYTES // 4))


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


def _region(fn: Callable, axes: tuple, tables: tuple, starts, shape, chunks,
            table_dims, flat=False):
    """``evaluate_region``'s computation (traced, not compiled, here).

    Nested, each axis's values are gathered for the block once and each
    table's on the grid of its axes, and ``fn`` runs under one ``vmap`` per
    axis of more than one index in the block (one index: a scalar; the
    default grid traces 4x faster, ``benchmarks/README.md``).
    ``flat`` (``Part.flat``): every argument is gathered per point and
    ``fn`` runs under one ``vmap`` over the block's points. The p99 part's
    point functions are built around loops (the simulator's
    ``while_loop``, the surrogate's bisections), whose every operation ends
    up batched over all the axes anyway, so the nested vmaps save them no
    arithmetic, while each level batches the loops' bodies again. Measured
    on the 2-core CPU: tracing a simulated grid of 2 points took 34.0 s
    nested, 5.0 s flat; a surrogate grid of 48 configurations traced in
    20.8 s and compiled in 15.7 s nested, 2.0 s and 11.0 s flat; the
    surrogate's run time on 20,480 configurations was the same (286 and 294
    configurations/s).
    """
    idx = [jnp.minimum(starts[d] + jnp.arange(c, dtype=jnp.int32), n - 1)
           for d, (c, n) in enumerate(zip(chunks, shape))]
    if flat:
        idx = [g.ravel() for g in jnp.meshgrid(*idx, indexing="ij")]
    args = [jax.tree.map(lambda x, i=i: x[i], axis) for axis, i in zip(axes, idx)]
    for table, dims in zip(tables, table_dims):
        rows = [idx[d] for d in dims]
        grids = (tuple(rows) if flat else jnp.ix_(*rows)) if dims else ()
        args.append(jax.tree.map(lambda x, g=grids: x[g] if g else x, table))
    n = len(axes)
    if flat:
        in_axes = (0,) * n + tuple(0 if dims else None for dims in table_dims)
        out = jax.vmap(fn, in_axes=in_axes)(*args)
        return jax.tree.map(lambda x: x.reshape(chunks), out)
    # an axis of one index in the block enters as a scalar, not through a
    # vmap of size 1: each vmap level traces every operation of fn again
    single = [c == 1 for c in chunks]
    args[:n] = [jax.tree.map(lambda x: x[0], a) if single[d] else a
                for d, a in enumerate(args[:n])]
    for t, dims in enumerate(table_dims):
        drop = tuple(k for k, d in enumerate(dims) if single[d])
        if drop:
            args[n + t] = jax.tree.map(lambda x, k=drop: x.squeeze(k), args[n + t])
    for d in reversed(range(n)):
        if single[d]:
            continue
        in_axes = [None] * len(args)
        in_axes[d] = 0
        for t, dims in enumerate(table_dims):
            if d in dims:
                in_axes[n + t] = 0
        fn = jax.vmap(fn, in_axes=tuple(in_axes))
    return jax.tree.map(lambda x: x.reshape(chunks), fn(*args))


@partial(jax.jit, static_argnames=("fn", "shape", "chunks", "table_dims", "flat"))
def evaluate_region(fn: Callable, axes: tuple, tables: tuple, starts, *,
                    shape: tuple[int, ...], chunks: tuple[int, ...],
                    table_dims: tuple[tuple[int, ...], ...], flat: bool = False):
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
      flat: one vmap over the block's points (``Part.flat``; static).

    Returns:
      A dict of arrays of shape ``chunks``.
    """
    return _region(fn, axes, tables, starts, shape, chunks, table_dims, flat)


BLOCKS = "blocks"
"""The mesh axis that blocks are spread over."""


def evaluate_regions(axes: tuple, tables: tuple, starts, *, fn: Callable,
                     shape: tuple[int, ...], chunks: tuple[int, ...],
                     table_dims: tuple[tuple[int, ...], ...], mesh: Mesh,
                     flat: bool = False):
    """``evaluate_region`` for one block per device of ``mesh``, at once
    (traced, not compiled, here: ``iterate_blocks`` runs it through
    ``sweep.exported.program``).

    Each device runs the one-block program on its own row of ``starts``
    (``shard_map``): the program a device runs does not depend on how many
    there are, so neither do the values.

    Args:
      starts: int32 ``(devices, len(axes))``, each block's first index.
      mesh: a one-axis mesh (``BLOCKS``) of the devices (static).

    Returns:
      A dict of arrays of shape ``(devices, *chunks)``, sharded by device.
    """
    def one(axes, tables, starts):
        out = _region(fn, axes, tables, starts[0], shape, chunks, table_dims, flat)
        return jax.tree.map(lambda x: x[None], out)

    # no collectives: the loops of the point functions need not track which
    # values vary across devices (check_vma)
    return jax.shard_map(one, mesh=mesh, in_specs=(P(), P(), P(BLOCKS)),
                         out_specs=P(BLOCKS), check_vma=False)(axes, tables, starts)


def iterate_blocks(fn: Callable, axes: tuple, plan: Blocking, tables: tuple = (),
                   table_dims: tuple = (), skip: Any = frozenset(),
                   batch: tuple[int, ...] | None = None, devices=None,
                   flat: bool = False
                   ) -> Iterator[tuple[int, tuple[slice, ...], dict]]:
    """Yields ``(block id, region, {name: ndarray of the region's shape})``.

    Args:
      plan: the write blocks.
      skip: write blocks not to evaluate.
      batch: the shape of one compiled call (``Part.batch``); default a
        whole write block. A write block is evaluated in batches that tile
        it (the last ones cut where they stick out).
      devices: where the batches run, one per device at a time (default
        every local device: ``jax.local_devices()``).
      flat: one vmap over each batch's points (``Part.flat``).
    """
    batch = tuple(batch or plan.chunks)
    todo = {}  # write block -> its region and the tiling of it by batches
    units = []  # (write block, batch within it), in order
    for b in range(len(plan)):
        if b not in skip:
            region = plan.region(b)
            todo[b] = (region, Blocking(tuple(r.stop - r.start for r in region),
                                        batch))
            units += [(b, s) for s in range(len(todo[b][1]))]
    if not units:
        return
    devices = list(devices or jax.local_devices())[:len(units)]
    mesh = Mesh(np.array(devices), (BLOCKS,))
    # the inputs go to every device once, not with each call
    axes, tables = jax.device_put((axes, tables), NamedSharding(mesh, P()))
    values, left = {}, {b: len(within) for b, (_, within) in todo.items()}
    groups = [units[i:i + len(devices)] for i in range(0, len(units), len(devices))]

    def starts_of(group):
        group = group + [group[-1]] * (len(devices) - len(group))  # padding, dropped
        return np.array([[r.start + q.start for r, q in
                          zip(todo[b][0], todo[b][1].region(s))]
                         for b, s in group], np.int32)

    # the program kept beside the compilation cache: a rerun skips tracing
    # it (``sweep.exported``)
    run = exported.program(
        evaluate_regions, dict(fn=fn, shape=plan.shape, chunks=batch,
                               table_dims=table_dims, mesh=mesh, flat=flat),
        (axes, tables, starts_of(groups[0])))

    def dispatch(group):
        return run(axes, tables, starts_of(group))

    # write blocks of several (small) batches: the next batch is dispatched
    # before this one is copied to the host and assembled, so the devices do
    # not wait for the host; a batch that is a whole write block is
    # dispatched when the last one has been handed on, to be evaluated while
    # that one is written (``sweep.grid.writer``): ahead of that, it would
    # hold one more block in memory for nothing
    ahead = len(units) > len(todo)
    pending = dispatch(groups[0])
    for n, group in enumerate(groups):
        out, later = pending, groups[n + 1] if n + 1 < len(groups) else None
        if ahead and later:
            pending = dispatch(later)
        out = {k: np.asarray(v) for k, v in out.items()}
        for j, (b, s) in enumerate(group):
            region, within = todo[b]
            local = within.region(s)
            cut = (j, *(slice(0, q.stop - q.start) for q in local))
            if len(within) == 1:  # one batch is the write block: no copy
                yield b, region, {k: v[cut] for k, v in out.items()}
                continue
            block = values.setdefault(b, {})
            for k, v in out.items():
                if k not in block:
                    block[k] = np.empty(within.shape, v.dtype)
                block[k][local] = v[cut]
            left[b] -= 1
            if left[b] == 0:
                yield b, region, values.pop(b)
        if not ahead and later:
            pending = dispatch(later)
