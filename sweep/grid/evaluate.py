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

from sweep import exported, shapes
from sweep.cube import contract
from sweep.model._numerics import computed_once


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


FLAT_MIN = 256
"""Fewest points of a surrogate's compiled call (``flat_points``)."""


def flat_points(write_points: int, batch_points: int | None) -> int:
    """Points per compiled call of a flat part whose write blocks hold
    ``write_points`` (``iterate_blocks``). The surrogate's (a few hundred
    microseconds a point; ``batch_points`` configured): ``batch_points``, or
    where its write blocks are smaller a power of two, at least
    ``FLAT_MIN``: a small grid evaluates up to that many points, padding
    included, in a fraction of a second, and shares its program with every
    grid of that size or less. A simulator's (``batch_points`` None: a
    padded point costs as much as any): ``shapes.bucket`` of its write
    block."""
    if batch_points is None:
        return shapes.bucket(write_points)
    return min(batch_points, shapes.power_of_two(write_points, FLAT_MIN))


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
    # compiled with XLA's default options (``sweep.exported.jit``): the
    # roofline's blocks, the same bit for bit on any number of devices, and
    # the simulator's, which ran 1.5-1.7x faster on the CPU than with the
    # loop emitters; the surrogate's compile and run faster with them
    xla_defaults: bool = True
    # the optional variables it computes (``contract.Metric.option``)
    options: frozenset[str] = frozenset()

    @property
    def batch(self) -> tuple[int, ...]:
        """The shape of one compiled call's block, tiling a write block."""
        if self.batch_points is None or self.batch_points >= self.plan.size:
            return self.plan.chunks
        return blocking(self.plan.chunks, self.batch_points).chunks

    @property
    def points(self) -> int:
        """A flat part's points per compiled call (``flat_points``)."""
        return flat_points(self.plan.size, self.batch_points)

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
        points = jnp.stack([g.ravel() for g in jnp.meshgrid(*idx, indexing="ij")], 1)
        out = _points(fn, axes, tables, points, table_dims)
        return jax.tree.map(lambda x: x.reshape(chunks), out)
    args = [jax.tree.map(lambda x, i=i: x[i], axis) for axis, i in zip(axes, idx)]
    for table, dims in zip(tables, table_dims):
        grids = jnp.ix_(*[idx[d] for d in dims]) if dims else ()
        args.append(jax.tree.map(lambda x, g=grids: x[g] if g else x, table))
    n = len(axes)
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


def _points(fn: Callable, axes: tuple, tables: tuple, points, table_dims):
    """``fn`` at each row of ``points`` (int32 ``(B, len(axes))``, an index
    along every axis) through one ``vmap``: every argument gathered per
    point (``Part.flat``)."""
    args = [jax.tree.map(lambda x, i=points[:, d]: x[i], axis)
            for d, axis in enumerate(axes)]
    for table, dims in zip(tables, table_dims):
        rows = tuple(points[:, d] for d in dims)
        args.append(jax.tree.map(lambda x, g=rows: x[g] if g else x, table))
    in_axes = (0,) * len(axes) + tuple(0 if dims else None for dims in table_dims)
    return jax.vmap(fn, in_axes=in_axes)(*args)


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
                     shape: tuple[int, ...] | None, chunks: tuple[int, ...] | None,
                     table_dims: tuple[tuple[int, ...], ...], mesh: Mesh,
                     flat: bool = False):
    """``evaluate_region`` for one block per device of ``mesh``, at once
    (traced, not compiled, here: ``iterate_blocks`` runs it through
    ``sweep.exported.program``).

    Each device runs the one-block program on its own row of ``starts``
    (``shard_map``): the program a device runs does not depend on how many
    there are, so neither do the values.

    Args:
      starts: int32 ``(devices, len(axes))``, each block's first index; with
        ``flat``, ``(devices, B, len(axes))``, each batch's points (``_points``:
        the program then depends on neither the cube's nor the block's shape,
        ``shape`` and ``chunks`` are None).
      mesh: a one-axis mesh (``BLOCKS``) of the devices (static).

    Returns:
      A dict of arrays of shape ``(devices, *chunks)`` (flat: ``(devices, B)``),
      sharded by device.
    """
    def one(axes, tables, starts):
        # a block index: no vmap of the points batches it
        with computed_once(starts.ravel()[0]):
            out = (_points(fn, axes, tables, starts[0], table_dims) if flat else
                   _region(fn, axes, tables, starts[0], shape, chunks, table_dims))
        return jax.tree.map(lambda x: x[None], out)

    # no collectives: the loops of the point functions need not track which
    # values vary across devices (check_vma)
    return jax.shard_map(one, mesh=mesh, in_specs=(P(), P(), P(BLOCKS)),
                         out_specs=P(BLOCKS), check_vma=False)(axes, tables, starts)


def _pad(x, lengths: tuple[int, ...]):
    """``x`` with its leading axes repeated at their last index up to ``lengths``."""
    x = np.asarray(x)
    if x.shape[:len(lengths)] == lengths:
        return x
    return x[np.ix_(*[np.minimum(np.arange(m), n - 1)
                      for m, n in zip(lengths, x.shape)])]


TABLE_PAD_BYTES = 1 << 22
"""Most bytes the tables of a flat part may take once padded along their axes
to ``shapes.AXIS_MIN`` (``padded_inputs``)."""


def padded_inputs(axes: tuple, tables: tuple, table_dims: tuple) -> tuple[tuple, tuple]:
    """The axes' values and the tables, each axis padded (its last value
    repeated) to a length shared by many grids: the least power of two at or
    above its length and ``shapes.AXIS_MIN``. An axis that tables run along
    is padded so too while the padded tables stay within
    ``TABLE_PAD_BYTES`` (the surrogate's workload summaries, a calibration
    per GPU and model: kilobytes), else, the axes of the largest tables
    first, only to its own power of two (a simulator's request streams of
    ten thousand requests per workload and rate). A flat program's input
    shapes then depend on few grid sizes (``iterate_blocks``: a grid of one
    GPU or of two runs one program); its points never index the padding."""
    tables = jax.tree.map(np.asarray, tables)
    own = [shapes.power_of_two(len(jax.tree.leaves(a)[0])) for a in axes]
    lengths = [max(n, shapes.AXIS_MIN) for n in own]
    leaves = [(x.shape, x.itemsize, dims)
              for t, dims in zip(tables, table_dims) for x in jax.tree.leaves(t)]

    def padded_bytes(d=None) -> float:
        """Bytes of the padded tables (``d``: only those along axis ``d``)."""
        return sum(math.prod(shape) * size * math.prod(
            lengths[k] / shape[i] for i, k in enumerate(dims))
            for shape, size, dims in leaves if d is None or d in dims)

    tabled = {d for dims in table_dims for d in dims}
    for d in sorted(tabled, key=lambda d: (-padded_bytes(d), d)):
        if padded_bytes() <= TABLE_PAD_BYTES:
            break
        lengths[d] = own[d]
    axes = tuple(jax.tree.map(lambda x, n=n: _pad(x, (n,)), a)
                 for a, n in zip(axes, lengths))
    tables = tuple(jax.tree.map(lambda x, dims=dims: _pad(
        x, tuple(lengths[d] for d in dims)), t) for t, dims in zip(tables, table_dims))
    return axes, tables


def iterate_blocks(fn: Callable, axes: tuple, plan: Blocking, tables: tuple = (),
                   table_dims: tuple = (), skip: Any = frozenset(),
                   batch: tuple[int, ...] | None = None, devices=None,
                   flat: bool = False, points: int | None = None,
                   xla_defaults: bool = True
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
      flat: one vmap over each batch's points (``Part.flat``). A batch is
        then ``points`` points (``flat_points``; default ``shapes.bucket``
        of ``batch``'s), taken from a write block in C order (the last one
        padded), and the axes are padded
        (``padded_inputs``): the compiled program depends on the grid's
        size only through those buckets, so grids of other values, or of a
        few more or fewer, reuse it (the p99 part's programs take 3-20 s
        to compile on a 2-core CPU).
      xla_defaults: compiled with XLA's default options, or with
        ``sweep.exported.compiler_options()`` (``Part.xla_defaults``).
    """
    batch = tuple(batch or plan.chunks)
    size = (points or shapes.bucket(math.prod(batch))) if flat else 0
    todo = {}  # write block -> its region, shape and batches
    units = []  # (write block, batch within it), in order
    for b in range(len(plan)):
        if b not in skip:
            region = plan.region(b)
            shape = tuple(r.stop - r.start for r in region)
            count = (-(-math.prod(shape) // size) if flat
                     else len(Blocking(shape, batch)))
            todo[b] = (region, shape, count)
            units += [(b, s) for s in range(count)]
    if not units:
        return
    devices = list(devices or jax.local_devices())[:len(units)]
    mesh = Mesh(np.array(devices), (BLOCKS,))
    if flat:
        axes, tables = padded_inputs(axes, tables, table_dims)
    # the inputs go to every device once, not with each call
    axes, tables = jax.device_put((axes, tables), NamedSharding(mesh, P()))
    values, left = {}, {b: count for b, (_, _, count) in todo.items()}
    groups = [units[i:i + len(devices)] for i in range(0, len(units), len(devices))]

    def place(b, s):
        """Where batch ``s`` of write block ``b`` goes in the write block
        (flat: a slice of its points in C order) and the cut of a device's
        row of values that goes there."""
        shape = todo[b][1]
        if flat:
            local = slice(s * size, min((s + 1) * size, math.prod(shape)))
            return local, (slice(0, local.stop - local.start),)
        local = Blocking(shape, batch).region(s)
        return local, tuple(slice(0, q.stop - q.start) for q in local)

    def input_of(b, s):
        """Batch ``s``'s input: flat, its points' indices (int32 ``(size,
        len(axes))``, the last batch padded with its last point), made when
        it is dispatched; else its first index."""
        region, shape, _ = todo[b]
        start = np.array([r.start for r in region], np.int32)
        local, _ = place(b, s)
        if flat:
            at = np.minimum(np.arange(local.start, local.start + size), local.stop - 1)
            return (np.stack(np.unravel_index(at, shape), 1) + start).astype(np.int32)
        return start + np.array([q.start for q in local], np.int32)

    def starts_of(group):
        group = group + [group[-1]] * (len(devices) - len(group))  # padding, dropped
        return np.stack([input_of(b, s) for b, s in group])

    # the program kept beside the compilation cache: a rerun skips tracing
    # it (``sweep.exported``)
    first = starts_of(groups[0])
    run = exported.program(
        evaluate_regions, dict(fn=fn, shape=None if flat else plan.shape,
                               chunks=None if flat else batch,
                               table_dims=table_dims, mesh=mesh, flat=flat),
        (axes, tables, first), xla_defaults=xla_defaults)

    def dispatch(group):
        return run(axes, tables, starts_of(group))

    # write blocks of several (small) batches: the next batch is dispatched
    # before this one is copied to the host and assembled, so the devices do
    # not wait for the host; a batch that is a whole write block is
    # dispatched when the last one has been handed on, to be evaluated while
    # that one is written (``sweep.grid.writer``): ahead of that, it would
    # hold one more block in memory for nothing
    ahead = len(units) > len(todo)
    pending = run(axes, tables, first)
    for n, group in enumerate(groups):
        out, later = pending, groups[n + 1] if n + 1 < len(groups) else None
        if ahead and later:
            pending = dispatch(later)
        out = {k: np.asarray(v) for k, v in out.items()}
        for j, (b, s) in enumerate(group):
            region, shape, count = todo[b]
            local, cut = place(b, s)
            cut = (j, *cut)
            if count == 1:  # one batch is the write block: no copy
                yield b, region, {k: v[cut].reshape(shape) for k, v in out.items()}
                continue
            block = values.setdefault(b, {})
            for k, v in out.items():
                if k not in block:
                    block[k] = np.empty((math.prod(shape),) if flat else shape, v.dtype)
                block[k][local] = v[cut]
            left[b] -= 1
            if left[b] == 0:
                block = values.pop(b)
                yield b, region, {k: v.reshape(shape) for k, v in block.items()}
        if not ahead and later:
            pending = dispatch(later)
