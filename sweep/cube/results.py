"""The cube: an ``xarray.Dataset`` written to zarr, block by block, resumably.

A sweep writes into ``<out>.partial``: first a template with every
coordinate, attribute and (unwritten) variable, then one ``region=`` write
per evaluated block, each followed by its marker, an empty file
``<out>.blocks/<part>.<block>`` created once the block's data is in: a
reader trusts only the blocks with a marker, and processes writing disjoint
blocks of one store (``sweep-grid shard=K/N``) never write the same file.
``<out>.progress.json`` (``Progress``) says which sweep the store is for
(its fingerprint) and whether the template is complete. A rerun of the same
sweep finds the partial store and evaluates only the blocks without a
marker; a rerun without ``out=`` finds it under the outputs root by the
config's digest (``find_unfinished``). When every block is in, the metadata
is consolidated and the store is renamed to ``<out>``, replacing an older
cube there only if the tool wrote it (``sweep.cube.outputs``): a reader
never sees a half-written cube under the final name. Each of these writes is
a list of steps (``create_steps``, ``block_steps``, ``finish_steps``)
ordered so that a kill after any step leaves the old cube or the new one,
and a rerun that works; the tests stop after every step.

Every chunk of a store the tool writes has its file (``write_empty_chunks``),
so ``open_cube`` can tell a deleted chunk from points of fill values
(``check_chunks``).
"""

from __future__ import annotations

import glob
import itertools
import json
import math
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import xarray as xr

from sweep.cube import contract, outputs


def provenance(config_yaml: str, seed: int, overrides: list[str],
               specs: dict[str, list] | None = None) -> dict[str, str | int]:
    """Global attributes every cube carries (strings and numbers only).

    Args:
      specs: per axis (``hardware``, ``model``, ``workload``), the validated
        configs of every value swept or searched; each axis's become one YAML
        mapping of name to spec, ``<axis>_specs`` (``config_yaml`` holds only
        the groups chosen on the command line).
    """
    import jax
    import yaml
    from omegaconf import OmegaConf

    from sweep.version import __version__

    commit = git_commit()
    attrs = {
        "Conventions": contract.CONVENTIONS,
        "sweep_version": __version__,
        **({"git_sha": commit} if commit else {}),
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "jax_version": jax.__version__,
        "jax_backend": jax.default_backend(),
        "x64": int(bool(jax.config.jax_enable_x64)),
        "seed": seed,
        "hydra_overrides": " ".join(overrides),
        "config_yaml": config_yaml,
    }
    for axis, values in (specs or {}).items():
        table = {v.name: OmegaConf.to_container(OmegaConf.structured(v),
                                                enum_to_str=True) for v in values}
        attrs[f"{axis}_specs"] = yaml.safe_dump(table, sort_keys=False)
    attrs["unit_definitions"] = "\n".join(contract.UNIT_DEFINITIONS)
    return attrs


def git_commit() -> str:
    """The commit of the source tree the package runs from (``-dirty`` when a
    tracked file differs from it); "" when it runs from an installed copy or
    git is not there."""
    root = Path(__file__).resolve().parents[2]  # sweep/cube/results.py -> the checkout
    # only the project's own checkout: an installed copy may sit in another repo
    if not ((root / ".git").exists() and (root / "pyproject.toml").is_file()):
        return ""

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()

    try:
        sha = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return ""
    return sha + ("-dirty" if dirty else "")


def template(coords: dict[str, np.ndarray], parts, attrs: dict,
             extra: dict[str, xr.DataArray] | None = None) -> xr.Dataset:
    """An unwritten cube: coordinates, attributes and lazily-zero variables.

    Every variable's dtype and attributes come from its declaration
    (``sweep.cube.contract``).

    Args:
      parts: the job's parts; each contributes its variables on its dims,
        chunked like its blocks, with the part's ``attrs`` added.
    """
    import dask.array as da  # only writers need dask; keep `import sweep` light

    data_vars = {}
    for part in parts:
        shape = tuple(len(coords[d]) for d in part.dims)
        for m in part.variables:
            zeros = da.zeros(shape, dtype=m.dtype, chunks=part.plan.chunks)
            data_vars[m.name] = (part.dims, zeros, {**m.attrs(), **part.attrs})
    ds = xr.Dataset(
        data_vars,
        coords={d: (d, v, contract.AXIS[d].attrs()) for d, v in coords.items()},
        attrs=attrs,
    )
    if extra:
        ds = ds.assign(extra)
    return ds


def partial_path(out: Path) -> Path:
    """Where an unfinished cube is written."""
    return out.with_name(out.name + ".partial")


def progress_path(out: Path) -> Path:
    """The bookkeeping of an unfinished cube (beside the store)."""
    return out.with_name(out.name + PROGRESS_SUFFIX)


PROGRESS_SUFFIX = ".progress.json"

def blocks_path(out: Path) -> Path:
    """The folder of the block markers of an unfinished cube (beside the store,
    where zarr does not look)."""
    return out.with_name(out.name + ".blocks")


def block_key(part: str, block: int) -> str:
    """A block's name (and its marker's): ``<part>.<block>``."""
    return f"{part}.{block}"


@dataclass
class Progress:
    """The bookkeeping of an unfinished cube, ``<out>.progress.json``.

    Written atomically (a new file renamed over the old) before the partial
    store is created and once its template is complete: the partial store is
    the tool's to replace whenever this file is there. Which blocks are in
    the store, its markers say (``done``).
    """

    out: Path
    fingerprint: str  # the sweep's (config and blocking): resume when equal
    config: str = ""  # the config's digest alone: how a rerun finds this cube
    blocks: int = 0  # blocks in all
    opened: bool = False  # the store's template is complete

    def save(self) -> None:
        path = progress_path(self.out)
        staged = path.with_name(path.name + ".new")
        staged.write_text(json.dumps({
            "fingerprint": self.fingerprint, "config": self.config,
            "blocks": self.blocks, "opened": self.opened}))
        os.replace(staged, path)

    @classmethod
    def read(cls, out: Path) -> Progress | None:
        """The bookkeeping beside ``out``; None when absent or unreadable."""
        try:
            state = json.loads(progress_path(out).read_text())
            return cls(out, str(state["fingerprint"]), str(state.get("config", "")),
                       int(state.get("blocks", 0)), state.get("opened") is True)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def resumable(self) -> bool:
        """Whether the partial store's template is complete."""
        return self.opened and partial_path(self.out).is_dir()

    def done(self) -> set[str]:
        """The blocks in the store (``block_key``), by their markers."""
        try:
            return {p.name for p in blocks_path(self.out).iterdir()}
        except FileNotFoundError:
            return set()

    def complete(self) -> bool:
        """Whether every block is in the store."""
        return self.resumable() and len(self.done()) >= self.blocks


def find_unfinished(folders: str, name: str, config: str) -> Progress | None:
    """The latest unfinished cube ``name`` of this config in ``folders``.

    Args:
      folders: a glob pattern of run folders (``outputs/*/*``).
      config: the config's digest (``Progress.config``).
    """
    found = []
    for path in glob.glob(os.path.join(folders, glob.escape(name) + PROGRESS_SUFFIX)):
        state = Progress.read(Path(path[:-len(PROGRESS_SUFFIX)]))
        if state is not None and state.config == config and state.resumable():
            found.append((os.path.getmtime(path), path, state))
    return max(found, key=lambda f: f[:2])[2] if found else None


def start_store(out: Path, ds: xr.Dataset, fingerprint: str, config: str = "",
                blocks: int = 0) -> Progress:
    """Reopens the partial store of the same sweep, or creates it anew.

    A partial store left by another sweep is replaced; one the tool did not
    write is refused (``OutputError``). Shards of one sweep call it one at a
    time (``sweep.cube.outputs.serial``): the first creates the store, the
    others find it.

    Returns:
      The bookkeeping; its ``done()`` lists the blocks already written.
    """
    state = Progress.read(out)
    if state is not None and state.fingerprint == fingerprint and state.resumable():
        return state
    if state is None:
        outputs.remove(partial_path(out), "cube")  # refuses a folder not the tool's
    state = Progress(out, fingerprint, config, blocks)
    for step in create_steps(state, ds):
        step()
    return state


def create_steps(state: Progress, ds: xr.Dataset) -> list[Callable[[], None]]:
    """``start_store``'s steps for a new partial store, in order.

    The bookkeeping comes first: from then on the partial store is the tool's
    to replace, so a kill after any step leaves what a rerun starts over from.
    A new template replaces the old store whole, and its markers.
    """
    tmp = partial_path(state.out)
    markers = blocks_path(state.out)

    def template() -> None:
        for folder in (markers, tmp):
            if folder.exists():
                shutil.rmtree(folder)
        ds.to_zarr(tmp, compute=False, mode="w", consolidated=False, zarr_format=2,
                   write_empty_chunks=True)
        markers.mkdir()

    def opened() -> None:
        state.opened = True
        state.save()

    return [state.save, template, opened]


def block_steps(out: Path, dims: tuple[str, ...], region: tuple[slice, ...],
                values: dict[str, np.ndarray], key: str
                ) -> list[Callable[[], None]]:
    """``write_block``'s steps: the block's values, then its marker (a block
    written but not marked is written again by a rerun)."""

    def write() -> None:
        ds = xr.Dataset({k: (dims, v) for k, v in values.items()})
        # every chunk gets its file, even one of fill values only: a missing
        # file then means a damaged cube (``check_chunks``)
        ds.to_zarr(partial_path(out), region=dict(zip(dims, region)),
                   consolidated=False, zarr_format=2, write_empty_chunks=True)

    def record() -> None:
        (blocks_path(out) / key).touch()

    return [write, record]


def write_block(out: Path, dims: tuple[str, ...], region: tuple[slice, ...],
                values: dict[str, np.ndarray], key: str) -> None:
    """Writes one evaluated block, then marks it as finished."""
    for step in block_steps(out, dims, region, values, key):
        step()


def finish_steps(out: Path) -> list[Callable[[], None]]:
    """``finish_store``'s steps, in order: mark the store as the tool's cube and
    consolidate its metadata (both repeatable); move the old cube aside, rename
    the new one into place and remove the old one (``outputs.install_steps``);
    drop the block markers and the bookkeeping (a rerun that still finds
    them, without the partial store, starts over)."""
    import zarr

    tmp = partial_path(out)
    return [lambda: outputs.mark(tmp, "cube"),
            lambda: zarr.consolidate_metadata(str(tmp), zarr_format=2),
            *outputs.install_steps(tmp, out, "cube"),
            lambda: shutil.rmtree(blocks_path(out), ignore_errors=True),
            progress_path(out).unlink]


def finish_store(out: Path) -> None:
    """Moves the finished cube to its final name; a kill at any point leaves
    the old cube or the new one, and a rerun finishes."""
    for step in finish_steps(out):
        step()


class DamagedCube(ValueError):
    """A cube store with a chunk missing or unreadable: one line for the user."""


def _blosc_size_matches(head: bytes, size: int) -> bool:
    """Whether a blosc chunk of ``size`` bytes starting with ``head`` is as long
    as its header says (blosc itself reads past the end of a truncated one)."""
    # header: version, versionlz, flags, typesize, then uint32 LE nbytes,
    # blocksize, cbytes (c-blosc's README_HEADER.rst)
    return len(head) >= 16 and int.from_bytes(head[12:16], "little") == size


def check_chunks(path: Path, decode: bool = False) -> None:
    """Checks the chunk files of every array of a zarr v2 store.

    In a store the tool wrote, every chunk must have its file: zarr reads a
    missing chunk as fill values (NaN), so a deleted chunk file would pass as
    points that do not fit. The tool writes every chunk's file
    (``write_empty_chunks``); other writers may leave out chunks of fill values
    only. A blosc chunk (zarr's default codec) must be as long as its header
    says, which catches a truncated or overwritten chunk without decoding it.

    Args:
      decode: also decode every chunk and check its decoded size (as costly
        as loading the store).

    Raises:
      DamagedCube: naming the first bad variable and chunk.
    """
    import numcodecs

    complete = outputs.kind_of(path) is not None
    for meta_path in sorted(path.glob("**/.zarray")):
        array = meta_path.parent
        name = array.relative_to(path).as_posix()
        meta = json.loads(meta_path.read_text())
        shape, chunks = meta["shape"], meta["chunks"]
        sep = meta.get("dimension_separator") or "."
        dtype = np.dtype(meta["dtype"]) if isinstance(meta["dtype"], str) else None
        nbytes = math.prod(chunks) * dtype.itemsize if (
            dtype is not None and dtype.kind != "O") else None
        codecs = [numcodecs.get_codec(c) for c in
                  [*(meta.get("filters") or []), meta["compressor"]] if c]
        blosc = (meta["compressor"] or {}).get("id") == "blosc"
        counts = [-(-n // c) for n, c in zip(shape, chunks)]
        for index in itertools.product(*(range(n) for n in counts)):
            key = sep.join(map(str, index)) if index else "0"

            def damaged(why: str, key=key) -> DamagedCube:
                return DamagedCube(f"{path} is damaged: variable {name}, chunk {key}: "
                                   f"{why}; rerun the command that wrote it")

            file = array / key
            try:
                if not (blosc or decode):
                    file.stat()
                    continue
                with open(file, "rb") as f:
                    data = f.read() if decode else f.read(16)
                    size = os.fstat(f.fileno()).st_size
            except FileNotFoundError:
                if not complete:
                    continue
                raise damaged("the chunk file is missing") from None
            if blosc and not _blosc_size_matches(data, size):
                raise damaged("does not decode (its size is not the one its header "
                              "states)")
            if not decode:
                continue
            try:
                for codec in reversed(codecs):
                    data = codec.decode(data)
            except Exception as e:  # whatever a codec raises on bad bytes
                raise damaged(f"does not decode ({type(e).__name__})") from None
            if nbytes is not None and memoryview(data).nbytes != nbytes:
                raise damaged(f"decodes to {memoryview(data).nbytes} bytes, not "
                              f"{nbytes}")


def open_cube(path: str | os.PathLike, *, chunks: str | dict | None = "store"
              ) -> xr.Dataset:
    """Opens a result cube written by any sweep entry point.

    The chunk files of a zarr store are checked first (``check_chunks``: each
    there, each as long as its header says), so a damaged cube is refused
    here rather than read as NaNs. A chunk whose bytes are changed but keep
    their length fails only when decoded (``sweep-report`` names it then).

    Args:
      path: a ``.zarr`` store (or a netCDF file saved from a cube).
      chunks: dask chunks: ``"store"``, the file's own (a task reads one
        chunk file, so ``ds.sweep``'s block-by-block reductions hold a few
        chunks in memory, not the cube); or what xarray's ``chunks`` takes
        (``"auto"``, a dict of dim sizes); ``None`` loads eagerly.

    Returns:
      The cube as an ``xarray.Dataset``, lazily loaded (dask) by default.

    Raises:
      FileNotFoundError: nothing at ``path``.
      DamagedCube: a chunk is missing or does not decode.
      ValueError: ``path`` is no readable store.
    """
    p = Path(path)
    if not p.exists():
        hint = (": the sweep was interrupted; rerun it to resume"
                if partial_path(p).exists() else "")
        raise FileNotFoundError(f"no cube at {p}{hint}")
    chunks = {} if chunks == "store" else chunks
    if p.suffix in (".nc", ".nc4", ".netcdf"):
        return xr.open_dataset(p, chunks=chunks)
    try:
        ds = xr.open_zarr(p, chunks=chunks)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{p} is not a result cube: no readable zarr store there "
                         f"({type(e).__name__})") from None
    check_chunks(p)
    return ds
