"""Shared fixtures: strict JAX promotion, a Hydra context, a PRNG key, one
JAX compilation cache for the console scripts, and the outputs of the
``sweep-grid`` and ``sweep-optimize`` runs shared by a session (a roofline,
a surrogate and a simulated cube, an optimize dataset).

A test that runs a console script is marked ``slow``: by hand where it runs
one itself, here (``pytest_collection_modifyitems``) where it reads a run of
the session fixtures below. ``python -m pytest -q`` runs them all;
``-m "not slow"`` leaves them out; ``-n 2`` spreads them over two processes,
a test module (or every test reading one of the session's console runs) to
each.

The public traces come from ``SWEEP_DATA_DIR``; unset, it defaults to the
``shared/data`` folder beside the checkout (CI's layout), or beside the main
checkout of a git worktree, when there is one: no test downloads anything.
"""

from __future__ import annotations

import json
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

CONSOLE_GROUPS = {"cube_path": "console-cube", "optimize_run": "console-optimize",
                  "simulated_run": "console-p99", "surrogate_run": "console-p99"}
"""The session's console runs (fixtures below), each with the group of the
tests that read it."""


@pytest.hookimpl(tryfirst=True)  # before -m reads the marks
def pytest_collection_modifyitems(items) -> None:
    for item in items:
        # a module's own fixture of one of these names is not the session's
        console = sorted({CONSOLE_GROUPS[n] for n in getattr(item, "fixturenames", ())
                          if n in CONSOLE_GROUPS and not hasattr(item.module, n)})
        if console:
            item.add_marker(pytest.mark.slow)
        # with ``-n`` (pytest-xdist, ``--dist loadgroup``) one worker takes a
        # group: each console run of the session is made once (with the
        # tests reading it), a module's fixtures once
        item.add_marker(pytest.mark.xdist_group(
            console[0] if console else item.module.__name__))


GROUP_SECONDS = Path(__file__).with_name("group_seconds.json")
"""Each group's measured test time on a 2-core machine, longest first:
written by ``python -m pytest -n 2 --store-group-seconds``, read to run the
longest groups first (``LongestFirst``)."""


def group(item) -> str:
    return item.get_closest_marker("xdist_group").args[0]


class LongestFirst:
    """With ``-n 2`` and ``--no-loadscope-reorder`` the two workers start on
    the longest groups and end together, where xdist's own order (the most
    tests first) left a long group with few tests to the end. A group not in
    ``GROUP_SECONDS`` starts after the others, in the order of collection."""

    @pytest.hookimpl(trylast=True)  # after pytest's own reordering by fixture
    def pytest_collection_modifyitems(self, items) -> None:
        seconds = (json.loads(GROUP_SECONDS.read_text())
                   if GROUP_SECONDS.exists() else {})
        for item in items:  # the controller sees reports, not items
            item.user_properties.append(("group", group(item)))
        items.sort(key=lambda item: -seconds.get(group(item), 0.0))


class GroupSeconds:
    """Sums each group's test time and writes ``GROUP_SECONDS``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report) -> None:
        g = dict(report.user_properties).get("group")
        if g is not None:
            self.seconds[g] = self.seconds.get(g, 0.0) + report.duration

    def pytest_sessionfinish(self, session, exitstatus) -> None:
        # failed tests count too: a session that ran gives its groups' times
        ran = exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED)
        if ran and self.seconds:
            ranked = sorted(self.seconds.items(), key=lambda kv: -kv[1])
            GROUP_SECONDS.write_text(json.dumps(
                {g: round(s) for g, s in ranked}, indent=1) + "\n")


def pytest_addoption(parser) -> None:
    parser.addoption("--store-group-seconds", action="store_true",
                     help=f"write each test group's time to {GROUP_SECONDS.name}")


def pytest_configure(config) -> None:
    config.pluginmanager.register(LongestFirst())
    if config.getoption("--store-group-seconds") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(GroupSeconds())


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
    run of the session and for the test processes themselves, however small
    the program: a run reuses what an earlier one compiled (a rerun of the
    same grid, the same search, a program a test compiled in-process). With
    ``-n``, the workers share it (a folder beside theirs, under the session's
    base folder): a program that two test modules run compiles once, not
    once per worker."""
    names = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")
    old = {n: os.environ.get(n) for n in names}
    if os.environ.get("PYTEST_XDIST_WORKER"):
        folder = tmp_path_factory.getbasetemp().parent / "jax_cache"
        folder.mkdir(exist_ok=True)
    else:
        folder = tmp_path_factory.mktemp("jax_cache")
    os.environ[names[0]] = str(folder)
    os.environ[names[1]] = "0"
    settings = [n.lower() for n in names]  # the same settings, in this process
    before = [getattr(jax.config, s) for s in settings]
    jax.config.update(settings[0], str(folder))
    jax.config.update(settings[1], 0.0)
    yield
    for s, v in zip(settings, before):
        jax.config.update(s, v)
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
