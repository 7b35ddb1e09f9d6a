"""Traced programs kept on disk beside the compilation cache: a rerun skips tracing.

JAX's persistent compilation cache keys on the lowered program, so every run
traces and lowers a program before it can find its compiled code there: for
the optax search of ``sweep-optimize`` that is 3-4 s of each run on a 2-core
CPU, for ``sweep-calibrate``'s fit 6-7 s (benchmarks/README.md, "Tracing the
search, skipped"). ``call`` keeps the
lowered program itself (``jax.export``, serialized) in an ``exported`` folder
of the compilation cache, under a key of everything the trace depends on:
the program's name and static settings, the package's source, the versions
of JAX, NumPy and optax, the backend, the x64 setting and the arguments'
tree and shapes. A rerun reads it back and calls it; the compilation cache
then holds its compiled code as for any program. The results are the traced
program's, bit for bit (``tests/test_exported.py``). The newest ``KEEP``
programs of each name are kept.

A program's arguments may be NamedTuples (registered for serialization by
their qualified names as they are met); its result must be built of tuples,
lists and dicts of arrays. Without a compilation cache folder (in-process use
without ``JAX_COMPILATION_CACHE_DIR``) nothing is kept and the program is
simply called.
"""

from __future__ import annotations

import functools
import hashlib
from importlib import metadata
from pathlib import Path

import jax
import numpy as np
import optax
from jax import export

from sweep.cube import outputs

_registered: set[type] = set()
_programs: dict[str, jax.stages.Wrapped] = {}


@functools.cache
def _source_digest() -> str:
    """SHA-256 of every Python file of the package, in path order."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _register(tree) -> None:
    """Registers the NamedTuple classes in ``tree`` for serialization."""
    cls = type(tree)
    if isinstance(tree, tuple) and hasattr(tree, "_fields") and cls not in _registered:
        export.register_namedtuple_serialization(
            cls, serialized_name=f"{cls.__module__}.{cls.__qualname__}")
        _registered.add(cls)
    if isinstance(tree, list | tuple):
        for x in tree:
            _register(x)
    elif isinstance(tree, dict):
        for x in tree.values():
            _register(x)


def key(name: str, static, args) -> str:
    """The key of ``name``'s program for these static settings and arguments."""
    leaves, treedef = jax.tree.flatten(args)
    shapes = [(np.shape(x), str(jax.numpy.result_type(x)),
               bool(getattr(x, "weak_type", False))) for x in leaves]
    parts = (name, repr(static), _source_digest(), jax.__version__,
             metadata.version("jaxlib"), np.__version__, optax.__version__,
             jax.default_backend(),
             bool(jax.config.jax_enable_x64), str(treedef), repr(shapes))
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


def _folder() -> Path | None:
    folder = jax.config.jax_compilation_cache_dir
    return Path(folder) / "exported" if folder else None


KEEP = 8
"""Programs kept per name: writing another (new source, settings or shapes)
removes the least recently written beyond these."""


def _prune(folder: Path, name: str) -> None:
    kept = sorted(folder.glob(f"{name}-*.bin"), key=lambda p: p.stat().st_mtime_ns)
    for path in kept[:-KEEP]:
        path.unlink(missing_ok=True)


def call(jitted, name: str, static, *args):
    """``jitted(*args)``, through the exported program kept for this key."""
    folder = _folder()
    if folder is None:
        return jitted(*args)
    k = key(name, static, args)
    program = _programs.get(k)
    if program is None:
        _register(args)
        path = folder / f"{name}-{k}.bin"
        exp = None
        if path.exists():
            try:
                exp = export.deserialize(bytearray(path.read_bytes()))
            except Exception:  # an unreadable file is rebuilt below
                exp = None
        if exp is None:
            exp = export.export(jitted)(*args)
            try:
                outputs.write_whole(path, exp.serialize())
                _prune(folder, name)
            except OSError:  # a read-only or full cache folder: run uncached
                pass
        program = _programs[k] = jax.jit(exp.call)
    return program(*args)
