"""Block-by-block reductions of a cube too large for memory (``ds.sweep``).

A cube opened lazily (``sweep.cube.results.open_cube``) is a dask array per
variable, one block per chunk file. Each reduction here reads it block by
block and keeps only what each block contributes, so memory holds a few
blocks and the answer, and gives what the same reduction of the whole array
in memory gives, ties included:

* ``first_least``: per cell, the position of the least value over some dims
  (NaN skipped, ties to the first, as ``np.nanargmin``): each block's least
  value and its position, then per cell the least of those, ties to the
  first position;
* ``group_fronts``: the Pareto front of each block (``sweep.search.pareto``),
  per value of the grouping dims, for ``front_of_fronts`` to merge.

An array in memory (numpy) is one block.
"""

from __future__ import annotations

import itertools

import numpy as np
import xarray as xr

from sweep.search import pareto

PART_POINTS = 1 << 18
"""Points of a block ``group_fronts`` filters at once: few enough for the
filter's scratch (~20 bytes a point) to stay in a core's cache (about 1.5x
faster than parts of 2^20 points on a 4 MB L2)."""


def first_least(values: xr.DataArray, n_keep: int) -> tuple[np.ndarray, np.ndarray]:
    """Per cell of the first ``n_keep`` dims: the flat position over the other
    dims of the least value (NaN skipped, ties to the first, as ``np.nanargmin``;
    0 where there is none) and whether the cell has a value.

    A dask-backed array is reduced block by block: each block's least value
    (NaN as +inf, as ``np.nanargmin`` sees it) and its position, then per
    cell the least of the blocks', ties to the first position.
    """
    if values.chunks is None:
        return _least_of_blocks(_block_least(values.values, n_keep), n_keep)
    data = values.data
    over = [(1,) * len(c) for c in data.chunks[n_keep:]]
    parts = data.map_blocks(_block_least, n_keep, new_axis=data.ndim,
                            chunks=(*data.chunks[:n_keep], *over, (3,)),
                            dtype=np.float64)
    return _least_of_blocks(parts.compute(), n_keep)


def least_in(block: np.ndarray, n_keep: int
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per cell of the first ``n_keep`` dims of ``block``: the least value over
    the other dims (NaN as +inf, as ``np.nanargmin`` sees it), its flat
    position over them (ties to the first) and whether the cell has a value."""
    keep, over = block.shape[:n_keep], block.shape[n_keep:]
    flat = block.reshape(*keep, int(np.prod(over)))
    if flat.dtype.kind != "f":
        flat = flat.astype(np.float64)
    nan = np.isnan(flat)
    filled = np.where(nan, np.inf, flat)
    first = filled.argmin(axis=-1)
    least = np.take_along_axis(filled, first[..., None], axis=-1)[..., 0]
    return least, first, ~nan.all(axis=-1)


def position(first: np.ndarray, over: tuple[int, ...], starts, shape) -> np.ndarray:
    """Flat positions ``first`` over a block of shape ``over`` at ``starts``,
    as flat positions over the whole array's ``shape``."""
    at = np.unravel_index(first, over)
    return np.ravel_multi_index(tuple(i + s for i, s in zip(at, starts)), shape)


def _block_least(block: np.ndarray, n_keep: int, block_info=None) -> np.ndarray:
    """One block's least value, its position over the whole array's last dims
    and whether it has a value, per cell of its first ``n_keep`` dims (stacked
    last; the other dims kept at length 1)."""
    keep, over = block.shape[:n_keep], block.shape[n_keep:]
    least, first, has = least_in(block, n_keep)
    if block_info is None:  # the whole array
        starts, shape = (0,) * len(over), over
    else:
        starts = [lo for lo, _ in block_info[0]["array-location"][n_keep:]]
        shape = block_info[0]["shape"][n_keep:]
    pos = position(first, over, starts, shape)
    out = np.stack([least, pos, has], axis=-1).astype(np.float64)
    return out.reshape(*keep, *(1,) * len(over), 3)


def _least_of_blocks(parts: np.ndarray, n_keep: int) -> tuple[np.ndarray, np.ndarray]:
    """``first_least``'s answer from the blocks' (``_block_least``)."""
    parts = parts.reshape(*parts.shape[:n_keep], -1, 3)
    least, pos, has = parts[..., 0], parts[..., 1], parts[..., 2] > 0
    at_least = least == least.min(axis=-1, keepdims=True)
    return np.where(at_least, pos, np.inf).min(axis=-1).astype(np.int64), has.any(-1)


def group_fronts(x: xr.DataArray, y: xr.DataArray, by: list[int],
                 maximize: tuple[bool, bool]) -> dict[tuple, list]:
    """Each block's Pareto fronts of ``(x, y)``, one per index along the axes
    ``by`` (both arrays of one shape and, when dask-backed, one chunking).

    Returns:
      Per index tuple along ``by`` (the whole arrays' indices), a list of
      ``(pos, x, y)``, one per block: the block's front there, ``pos`` the
      points' flat positions in the arrays, increasing.
    """
    if x.chunks is None:
        blocks = [_block_fronts(x.values, y.values, (0,) * x.ndim, x.shape, by,
                                maximize)]
    else:
        import dask  # a dask-backed cube has it; keep ``import sweep`` light

        starts = [np.cumsum((0, *c[:-1])) for c in x.data.chunks]
        blocks = dask.compute(*(
            dask.delayed(_block_fronts)(xb, yb, tuple(int(s[i]) for s, i in
                                                      zip(starts, index)),
                                        x.shape, by, maximize)
            for index, xb, yb in zip(np.ndindex(*x.data.numblocks),
                                     x.data.to_delayed().ravel(),
                                     y.data.to_delayed().ravel())))
    groups: dict[tuple, list] = {}
    for block in blocks:
        for key, part in block:
            groups.setdefault(key, []).append(part)
    return groups


def _block_fronts(x: np.ndarray, y: np.ndarray, starts: tuple[int, ...],
                  shape: tuple[int, ...], by: list[int],
                  maximize: tuple[bool, bool]) -> list[tuple[tuple, tuple]]:
    """The fronts of one block at ``starts`` of arrays of ``shape``, one per
    index along the ``by`` axes: ``(by indices, (pos, x, y))``."""
    rest = [a for a in range(x.ndim) if a not in by]
    out = []
    for combo in itertools.product(*(range(x.shape[a]) for a in by)):
        sel = [slice(None)] * x.ndim
        for a, i in zip(by, combo):
            sel[a] = i
        xs, ys = x[tuple(sel)], y[tuple(sel)]
        sub = xs.shape
        xs, ys = xs.ravel(), ys.ravel()  # C order: the arrays' order
        parts = []
        for lo in range(0, xs.size, PART_POINTS):
            i = lo + pareto.front_indices(xs[lo:lo + PART_POINTS],
                                          ys[lo:lo + PART_POINTS], maximize=maximize)
            parts.append((i, xs[i], ys[i]))
        pos, fx, fy = pareto.front_of_fronts(parts, maximize=maximize)
        key = tuple(starts[a] + i for a, i in zip(by, combo))
        index = dict(zip(by, key)) | {a: starts[a] + i for a, i in
                                      zip(rest, np.unravel_index(pos, sub))}
        at = np.broadcast_arrays(*(index[a] for a in range(x.ndim)), pos)[:-1]
        out.append((key, (np.ravel_multi_index(tuple(at), shape), fx, fy)))
    return out
