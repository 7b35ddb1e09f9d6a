"""Traced programs kept on disk (``sweep.exported``): a rerun reads the kept
program instead of tracing, and gets the traced program's results bit for
bit; the key moves with everything the trace depends on."""

from __future__ import annotations

import time
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sweep import exported
from sweep.exported import jit


class Pair(NamedTuple):
    scale: jax.Array
    rows: jax.Array


def _program(p: Pair, x, *, offset: float = 0.0):
    # a scan, a custom-jvp function and a dict of results, as the search has
    def step(c, r):
        return (c * p.scale + jnp.sum(r * x) + offset,
                jax.scipy.special.betainc(2.0, 3.0, c % 1))

    total, path = jax.lax.scan(step, jnp.float32(0.5), p.rows)
    return {"total": total, "path": {"betainc": path, "sq": jnp.sqrt(path + 1.0)}}


def test_a_kept_program_gives_the_traced_results():
    # the session's compilation cache folder (conftest.jax_cache) holds it
    assert jax.config.jax_compilation_cache_dir
    args = (Pair(jnp.float32(0.9), jnp.asarray(np.linspace(0, 1, 12).reshape(4, 3),
                                                jnp.float32)),
            jnp.asarray([0.1, 0.2, 0.3], jnp.float32))
    traced = jax.tree.map(np.asarray, jit(_program)(*args, offset=1.0))
    path = exported.kept_path(_program, {"offset": 1.0}, args)
    path.unlink(missing_ok=True)
    exported._programs.clear()

    def call():
        return jax.tree.map(np.asarray, exported.call(_program, {"offset": 1.0}, *args))

    first = call()
    assert path.exists()
    written = path.stat().st_mtime_ns, path.read_bytes()
    exported._programs.clear()  # as a new process: read the kept program back
    second = call()
    assert (path.stat().st_mtime_ns, path.read_bytes()) == written  # read, not rebuilt
    for got in (first, second):
        jax.tree.map(np.testing.assert_array_equal, got, traced)
    # arguments committed to a device (a kept program's own results are) run
    # the program compiled for fresh ones: nothing is lowered and compiled
    compiled = []

    def listen(event, seconds, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(seconds)

    committed = jax.device_put(args, jax.devices()[0])
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        again = exported.call(_program, {"offset": 1.0}, *committed)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, again), traced)
    assert compiled == []
    # a file that is not a program is rebuilt, not trusted
    path.write_bytes(b"not a program")
    exported._programs.clear()
    third = call()
    jax.tree.map(np.testing.assert_array_equal, third, traced)
    assert path.read_bytes() == written[1]


def test_the_key_moves_with_what_the_trace_depends_on():
    args = (Pair(jnp.float32(0.9), jnp.zeros((4, 3), jnp.float32)),
            jnp.zeros(3, jnp.float32))
    base = exported.key("p", "v1", args)
    assert exported.key("p", "v1", args) == base
    others = [
        exported.key("q", "v1", args),  # another program
        exported.key("p", "v2", args),  # other static settings
        exported.key("p", "v1", (args[0]._replace(rows=jnp.zeros((5, 3), jnp.float32)),
                                 args[1])),  # another shape
        exported.key("p", "v1", (args[0], jnp.zeros(3, jnp.int32))),  # another dtype
        exported.key("p", "v1", (tuple(args[0]), args[1])),  # another tree
    ]
    with jax.enable_x64(True):
        others.append(exported.key("p", "v1", args))
    assert len({base, *others}) == len(others) + 1


def test_without_a_cache_folder_the_program_is_just_called():
    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    try:
        args = (Pair(jnp.float32(0.5), jnp.ones((2, 3), jnp.float32)),
                jnp.ones(3, jnp.float32))
        out = exported.call(_program, {"offset": -1.0}, *args)
        jax.tree.map(np.testing.assert_array_equal, out,
                     jit(_program)(*args, offset=-1.0))
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
    assert not exported.kept_path(_program, {"offset": -1.0}, args).exists()


def test_the_newest_programs_of_a_name_are_kept():
    args = (Pair(jnp.float32(0.5), jnp.ones((2, 3), jnp.float32)),
            jnp.ones(3, jnp.float32))
    folder = Path(jax.config.jax_compilation_cache_dir) / "exported"
    pattern = f"{exported.name(_pruned)}-*.bin"
    for old in folder.glob(pattern):
        old.unlink()
    paths = []
    for version in range(exported.KEEP + 2):
        exported.call(_pruned, {"offset": float(version)}, *args)
        time.sleep(0.02)  # apart by more than the file system's clock tick
        paths.append(exported.kept_path(_pruned, {"offset": float(version)}, args))
    kept = sorted(folder.glob(pattern))
    assert kept == sorted(paths[-exported.KEEP:])


def _pruned(p: Pair, x, *, offset: float):
    """Another function than ``_program``: its own programs to prune."""
    return _program(p, x, offset=offset)


def _closing_over(value):
    def point(x):
        return x * value
    return point


def test_a_program_is_described_by_its_code_and_what_it_closes_over():
    """A grid's point functions are closures and dataclasses (static
    arguments of its block program): the same function and values describe
    alike in every process, another value otherwise; one that closes over
    an array is not kept (its trace depends on the data)."""
    from sweep.cube import contract
    from sweep.grid.evaluate import Named
    from sweep.latency.p99 import SurrogatePoint
    from sweep.model.point import point_function

    plain, sensitive = (point_function(frozenset(o))
                        for o in ((), {contract.SENSITIVITY_OPTION}))
    assert exported.describe(Named(plain, ("a",))) == exported.describe(
        Named(point_function(frozenset()), ("a",)))
    described = {exported.describe(x) for x in (
        Named(plain, ("a",)), Named(sensitive, ("a",)), Named(plain, ("b",)),
        SurrogatePoint(False), SurrogatePoint(True), _closing_over(2.0),
        _closing_over(3.0), _closing_over(True))}
    assert len(described) == 8
    args = (Pair(jnp.float32(0.5), jnp.ones((2, 3), jnp.float32)),
            jnp.ones(3, jnp.float32))
    data = _closing_over(np.ones(3))
    with np.testing.assert_raises(TypeError):
        exported.describe(data)
    assert exported.kept_path(_program, {"offset": data}, args) is None
    assert exported.kept_path(_program, {"offset": 2.0}, args) is not None


def test_a_description_holds_while_other_objects_share_its_code_parts():
    """The same function describes alike at every call: ``marshal.dumps``
    of its code did not (it marks the parts referenced more than once at
    that moment), so a grid's second block program of one process got
    another key; the code's parts referenced elsewhere must not move it."""
    from sweep.latency.p99 import SurrogatePoint

    point = SurrogatePoint(False)
    before = exported.describe(point)
    code = SurrogatePoint.__call__.__code__
    held = [code.co_names, code.co_consts, code.co_varnames, code.co_code,
            *code.co_names]
    assert exported.describe(point) == before
    del held


def test_cpu_options_unless_xla_flags_name_them(monkeypatch):
    """On the CPU the package's programs compile with ``CPU_OPTIONS`` (XLA's
    loop emitters), the grid's roofline and simulator blocks with XLA's
    defaults; an ``XLA_FLAGS`` that names the option decides for all."""
    from helpers import grid_job

    assert jax.default_backend() == "cpu"
    small = ["grid=small", "hardware=h100_sxm", "model=qwen3_8b"]
    for method, defaults in (("surrogate", False), ("simulate", True)):
        roofline, p99 = grid_job([*small, f"latency={method}"]).parts
        assert (roofline.xla_defaults, p99.xla_defaults) == (True, defaults)
    exported.compiler_options.cache_clear()
    try:
        assert exported.compiler_options() == exported.CPU_OPTIONS
        monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_fusion_emitters=true")
        exported.compiler_options.cache_clear()
        assert exported.compiler_options() == {}
    finally:
        monkeypatch.undo()
        exported.compiler_options.cache_clear()
