"""Traced programs kept on disk beside the compilation cache: a rerun skips tracing.

JAX's persistent compilation cache keys on the lowered program, so every run
traces and lowers a program before it can find its compiled code there: for
the optax search of ``sweep-optimize`` that is 3-4 s of each run on a 2-core
CPU, for ``sweep-calibrate``'s fit 6-7 s (benchmarks/README.md, "Tracing the
search, skipped"); for a grid's block program (``sweep.grid.evaluate``)
0.8-1.1 s a part. ``call`` (and ``program``) keeps the lowered program
itself (``jax.export``, serialized) in an ``exported`` folder of the
compilation cache, under a key of everything the trace depends on: the
function's name and static keyword arguments (``describe``: a point
function by its code and what it closes over), the package's source, the
versions of JAX, jaxlib, NumPy and optax, the backend, the x64 setting and
the arguments' tree and shapes. A rerun reads it back and calls it; the
compilation cache then holds its compiled code as for any program. The
results are the traced program's, bit for bit (``tests/test_exported.py``).
The newest ``KEEP`` programs of each function are kept.

A program's arguments may be NamedTuples (registered for serialization by
their qualified names as they are met); its result must be built of tuples,
lists and dicts of arrays. Without a compilation cache folder (in-process use
without ``JAX_COMPILATION_CACHE_DIR``) nothing is kept and the program is
simply called.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import os
import types
from importlib import metadata
from pathlib import Path

import jax
import numpy as np
from jax import export

from sweep.cube import outputs

_registered: set[type] = set()
_programs: dict[str, jax.stages.Wrapped] = {}


@functools.cache
def _environment() -> str:
    """What every key shares in a process: the SHA-256 of the package's Python
    files (in path order), the library versions and the backend."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return repr((h.hexdigest(), jax.__version__, metadata.version("jaxlib"),
                 np.__version__, metadata.version("optax"), jax.default_backend()))


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


def _static(static: dict) -> tuple:
    return tuple(sorted(static.items()))


CPU_OPTIONS = {"xla_cpu_use_fusion_emitters": False}
"""XLA's options on the CPU: its loop emitters rather than its MLIR fusion
emitters. They compile the search, the calibration's fit, the optimizer's
verification and the surrogate's grid blocks in two thirds to four fifths
of the time, and the surrogate's blocks then run 10 % faster at 0.58x the
peak memory (690 MB against 1.2 GB on a 98,000-point grid). The roofline's
and the simulator's grid blocks keep XLA's defaults (``jit``'s
``xla_defaults``; ``grid.evaluate.Part.xla_defaults``) (benchmarks/README.md,
"XLA's CPU emitters")."""


@functools.cache
def compiler_options() -> dict:
    """``CPU_OPTIONS`` where the default backend is the CPU and its XLA takes
    them; none on an accelerator, with an XLA that does not know them, or
    where ``XLA_FLAGS`` sets them itself (the user's choice stands)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if jax.default_backend() != "cpu" or any(k in flags for k in CPU_OPTIONS):
        return {}
    try:
        jax.jit(lambda x: x + 1, compiler_options=CPU_OPTIONS)(np.float32(0))
    except Exception:  # an XLA without these options refuses them
        return {}
    return dict(CPU_OPTIONS)


def jit(fn, /, *, xla_defaults: bool = False, **kwargs) -> jax.stages.Wrapped:
    """``jax.jit(fn, **kwargs)`` compiled with ``compiler_options()`` (those
    in ``kwargs`` added), or with XLA's defaults (``xla_defaults``): every
    program of the package and of its tests."""
    options = {**({} if xla_defaults else compiler_options()),
               **kwargs.pop("compiler_options", {})}
    return jax.jit(fn, compiler_options=options or None, **kwargs)


@functools.lru_cache(maxsize=32)
def _jitted(fn, static: tuple, xla_defaults: bool) -> jax.stages.Wrapped:
    return jit(functools.partial(fn, **dict(static)), xla_defaults=xla_defaults)


def jitted(fn, /, xla_defaults: bool = False, **static) -> jax.stages.Wrapped:
    """``fn`` with its ``static`` keyword arguments, jitted (once per value)."""
    return _jitted(fn, _static(static), xla_defaults)


def name(fn) -> str:
    """The name of ``fn``'s kept programs."""
    return f"{fn.__module__}.{fn.__qualname__}"


def describe(obj) -> str:
    """Text that names ``obj`` the same in every process, for a key: values,
    enums, tuples, lists and frozensets of them, frozen dataclasses (by their
    class and fields), functions (by their module, name, code and what they
    close over) and meshes (by their axes; the devices' kind is the key's
    backend). Raises ``TypeError`` for anything else, e.g. an array a
    function closes over: a program whose trace depends on data is not kept.
    """
    if obj is None or isinstance(obj, bool | int | float | str):
        return repr(obj)
    if isinstance(obj, enum.Enum):
        return f"{type(obj).__qualname__}.{obj.name}"
    if isinstance(obj, tuple | list):
        return "(" + ", ".join(map(describe, obj)) + ")"
    if isinstance(obj, frozenset):
        return "{" + ", ".join(sorted(map(describe, obj))) + "}"
    if isinstance(obj, types.FunctionType):
        # the code itself: a function outside the package (whose source the
        # key does not hash) changes its key when it changes
        code = hashlib.sha256(_code_text(obj.__code__).encode()).hexdigest()[:16]
        cells = tuple(c.cell_contents for c in obj.__closure__ or ())
        return (f"{obj.__module__}.{obj.__qualname__}[{code}]"
                f"{describe((cells, obj.__defaults__, obj.__kwdefaults__))}")
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        call = getattr(type(obj), "__call__", None)
        fields = tuple((f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj))
        return (f"{type(obj).__module__}.{type(obj).__qualname__}"
                f"{describe(call) if isinstance(call, types.FunctionType) else ''}"
                f"{describe(fields)}")
    if isinstance(obj, jax.sharding.Mesh):
        return f"Mesh({describe(tuple(obj.axis_sizes))}, {describe(obj.axis_names)})"
    raise TypeError(f"{type(obj).__qualname__}: no description across processes")


def _code_text(code: types.CodeType) -> str:
    """A code object's bytecode, names and constants (nested code objects
    alike) as text that is the same in every process and at every call.
    ``marshal.dumps`` is not: it marks the objects referenced more than
    once at that moment, so the same function's bytes changed between two
    calls in one process, and with them the key."""
    def const(c) -> str:
        if isinstance(c, types.CodeType):
            return _code_text(c)
        if isinstance(c, tuple):
            return "(" + ", ".join(map(const, c)) + ")"
        if isinstance(c, frozenset):  # its order follows the string hash seed
            return "{" + ", ".join(sorted(map(const, c))) + "}"
        return repr(c)

    return repr((code.co_code.hex(), const(code.co_consts), code.co_names,
                 code.co_varnames, code.co_freevars, code.co_cellvars))


def key(program: str, static, args) -> str:
    """The key of ``program``'s trace for these static settings and arguments
    (``TypeError``: settings that ``describe`` cannot name)."""
    leaves, treedef = jax.tree.flatten(args)
    shapes = [(np.shape(x), str(jax.numpy.result_type(x)),
               bool(getattr(x, "weak_type", False))) for x in leaves]
    parts = (program, describe(static), _environment(),
             bool(jax.config.jax_enable_x64), str(treedef), repr(shapes))
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


def _folder(kind: str = "exported") -> Path | None:
    folder = jax.config.jax_compilation_cache_dir
    return Path(folder) / kind if folder else None


def kept_path(fn, static: dict, args) -> Path | None:
    """Where ``fn``'s program for these arguments is kept (None: no folder, or
    static settings with no description across processes)."""
    folder = _folder()
    if folder is None:
        return None
    try:
        k = key(name(fn), _static(static), args)
    except TypeError:
        return None
    return folder / f"{name(fn)}-{k}.bin"


KEEP = 8
"""Programs kept per function: writing another (new source, settings or
shapes) removes the least recently written beyond these."""


def _prune(folder: Path, program: str) -> None:
    kept = sorted(folder.glob(f"{program}-*.bin"), key=lambda p: p.stat().st_mtime_ns)
    for path in kept[:-KEEP]:
        path.unlink(missing_ok=True)


def keep(path: Path, name: str, data: bytes) -> None:
    """Writes ``data`` to ``path`` whole, pruning ``name``'s older files
    beyond ``KEEP``; a read-only or full cache folder keeps nothing."""
    try:
        outputs.write_whole(path, data)
        _prune(path.parent, name)
    except OSError:
        pass


def kept_data(name: str, content_key: str, build, encode, decode):
    """``build()``, kept in the compilation cache's ``name`` folder under
    ``content_key`` and the package's source (``_environment``): read back
    (``decode`` of the bytes) when there, else built and kept (``encode``).
    Without a cache folder it is simply built; an unreadable file is
    rebuilt."""
    folder = _folder(name)
    if folder is None:
        return build()
    k = hashlib.sha256(repr((content_key, _environment())).encode()).hexdigest()[:32]
    path = folder / f"{name}-{k}.bin"
    if path.exists():
        try:
            return decode(path.read_bytes())
        except Exception:  # rebuilt below
            pass
    value = build()
    keep(path, name, encode(value))
    return value


def call(fn, static: dict, *args):
    """``fn(*args, **static)``, jitted, through the exported program kept for
    these settings and arguments."""
    # an exported program's results are committed to their device, and a
    # committed argument lowers (and compiles) a program of its own: one fed
    # back (the calibration's fitted constants) enters as a fresh one
    args = jax.tree.map(lambda x: np.asarray(x) if getattr(x, "committed", False)
                        else x, args)
    return program(fn, static, args)(*args)


def program(fn, static: dict, args, *, xla_defaults: bool = False):
    """``fn`` with ``static``, jitted (``jit``'s ``xla_defaults``), for
    arguments like ``args``: the exported program kept for them (read back,
    or traced and kept now), or the plain jit without a folder to keep it in.

    Its arguments are taken as they are: a caller that places them (on a
    mesh) places them alike at every call, since a committed argument
    lowers a program of its own (``call`` hands over fresh ones).
    """
    path = kept_path(fn, static, args)
    if path is None:
        return jitted(fn, xla_defaults, **static)
    held = f"{path.name}:xla_defaults" if xla_defaults else path.name
    kept = _programs.get(held)
    if kept is None:
        _register(args)
        exp = None
        if path.exists():
            try:
                exp = export.deserialize(bytearray(path.read_bytes()))
            except Exception:  # an unreadable file is rebuilt below
                exp = None
        if exp is None:
            exp = export.export(jitted(fn, xla_defaults, **static))(*args)
            keep(path, name(fn), exp.serialize())
        kept = _programs[held] = jit(
            _named(exp.call, fn.__name__), xla_defaults=xla_defaults)
    return kept


def _named(call, name: str):
    """``call`` under ``name``: the compiled program and its compilation cache
    entry carry the function's name (``jit__run_lanes``), not ``jit_call``."""
    def named(*args):
        return call(*args)
    named.__name__ = named.__qualname__ = name
    return named
