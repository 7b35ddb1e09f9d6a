"""Shared fixtures: strict JAX promotion, a Hydra context, a PRNG key, one
JAX compilation cache for the console scripts, and the outputs of the
``sweep-grid`` and ``sweep-optimize`` runs shared by a session (a roofline,
a surrogate and a simulated cube, an optimize dataset).

A test that runs a console script is marked ``slow``: by hand where it runs
one itself, here (``pytest_collection_modifyitems``) where it reads a run of
the session fixtures below. ``python -m pytest -q`` runs them all;
``-m "not slow"`` leaves them out; ``-n 2`` spreads them over two processes,
a test module (or every test reading the session's console runs) to each.

The public traces come from ``SWEEP_DATA_DIR``; unset, it defaults to the
``shared/data`` folder beside the checkout (CI's layout), or beside the main
checkout of a git worktree, when there is one: no test downloads anything.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import jax
import pytest
from helpers import (
    CUBE_GRID,
    OPTIMIZE_QUICK,
    SHARED_DATA,
    hydra_context,
    run_script,
)

if not os.environ.get("SWEEP_DATA_DIR") and SHARED_DATA is not None:
    os.environ["SWEEP_DATA_DIR"] = str(SHARED_DATA)

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

CONSOLE_FIXTURES = frozenset({"cube_path", "optimize_run", "simulated_run",
                              "surrogate_run"})


@pytest.hookimpl(tryfirst=True)  # before -m reads the marks
def pytest_collection_modifyitems(items) -> None:
    for item in items:
        console = CONSOLE_FIXTURES & set(getattr(item, "fixturenames", ()))
        if console:
            item.add_marker(pytest.mark.slow)
        # with ``-n`` (pytest-xdist, ``--dist loadgroup``) one worker takes a
        # group: the session's console runs are made once, a module's
        # fixtures once
        item.add_marker(pytest.mark.xdist_group(
            "console" if console else item.module.__name__))


@pytest.fixture
def hydra_ctx():
    """A Hydra context over the shipped configs (like the apps use)."""
    with hydra_context():
        yield


@pytest.fixture
def key():
    return jax.random.key(0)


@pytest.fixture(scope="session")
def cube_path(tmp_path_factory) -> Path:
    """A 64-point cube written by the installed ``sweep-grid`` (once a session)."""
    root = tmp_path_factory.mktemp("sweep_cube")
    out = root / "c.zarr"
    proc = run_script("sweep-grid", [*CUBE_GRID, f"out={out}"], root)
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture(scope="session", autouse=True)
def jax_cache(tmp_path_factory):
    """One JAX compilation cache (a temporary folder) for every console-script
    run of the session, however small the program: a run reuses what an
    earlier one compiled (a rerun of the same grid, the same search). This
    process imported JAX before and keeps compiling in memory only."""
    names = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")
    old = {n: os.environ.get(n) for n in names}
    os.environ[names[0]] = str(tmp_path_factory.mktemp("jax_cache"))
    os.environ[names[1]] = "0"
    yield
    for n, v in old.items():
        if v is None:
            os.environ.pop(n)
        else:
            os.environ[n] = v


@dataclass(frozen=True)
class OptimizeRun:
    path: Path  # the dataset (written when the run succeeded)
    proc: subprocess.CompletedProcess


@pytest.fixture(scope="session")
def optimize_run(tmp_path_factory) -> OptimizeRun:
    """``sweep-optimize OPTIMIZE_QUICK out=opt.zarr`` by the installed script,
    once a session; its exit code is for the tests to check."""
    root = tmp_path_factory.mktemp("sweep_optimize")
    proc = run_script("sweep-optimize", [*OPTIMIZE_QUICK, "out=opt.zarr"], root)
    return OptimizeRun(root / "opt.zarr", proc)


@dataclass(frozen=True)
class GridRun:
    path: Path  # the cube
    proc: subprocess.CompletedProcess


def _grid_run(root: Path, args: list[str]) -> GridRun:
    proc = run_script("sweep-grid", [*args, "out=cube.zarr"], root)
    assert proc.returncode == 0, proc.stderr
    return GridRun(root / "cube.zarr", proc)


P99_BASE = ["model=qwen3_8b", "grid.tensor_parallel=[1]",
            "grid.context_tokens=[1500,4000]", "grid.traffic_tokens_per_day=[1e8]"]


@pytest.fixture(scope="session")
def simulated_run(tmp_path_factory) -> GridRun:
    """A ``latency=simulate`` cube by the installed ``sweep-grid``: two arrival
    rates, two contexts, static and continuous batching (once a session)."""
    return _grid_run(tmp_path_factory.mktemp("simulated"), [
        *P99_BASE, "hardware=h100_sxm", "workload=azure_conv_2023",
        "grid.arrival_rate_per_s=[1,4]", "grid.concurrency=[16,64]",
        "grid.token_budget=[512,2048]", "grid.batching=[static,continuous]",
        "latency=simulate", "latency.num_requests=300"])


@pytest.fixture(scope="session")
def surrogate_run(tmp_path_factory) -> GridRun:
    """A ``latency=surrogate`` cube by the installed ``sweep-grid``: two GPUs,
    two contexts, the workload's own rate set to 3 req/s (once a session)."""
    return _grid_run(tmp_path_factory.mktemp("surrogate"), [
        *P99_BASE, "grid.hardware=[h100_sxm,l40s]", "workload=seed_chat",
        "workload.arrival_rate_per_s=3", "grid.concurrency=[1,8,64]",
        "grid.token_budget=[512,2048]", "grid.batching=[static,continuous]",
        "latency=surrogate"])
