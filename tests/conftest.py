"""Shared fixtures: strict JAX promotion, composed configs, a PRNG key, and
the outputs of one ``sweep-grid`` and one ``sweep-optimize`` run a session.

The public traces come from ``SWEEP_DATA_DIR``; unset, it defaults to the
``shared/data`` folder beside the checkout (CI's layout), or beside the main
checkout of a git worktree, when there is one: no test downloads anything.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import jax
import pytest
from hydra import initialize_config_module
from hydra.core.global_hydra import GlobalHydra

from sweep.config.store import register_configs

REPO = Path(__file__).resolve().parents[1]


def shared_data_dir() -> Path | None:
    """``shared/data`` beside this checkout, or beside its main worktree."""
    roots = [REPO]
    common = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--path-format=absolute",
         "--git-common-dir"], capture_output=True, text=True, check=False)
    if common.returncode == 0:
        roots.append(Path(common.stdout.strip()).parent)
    return next((r.parent / "shared" / "data" for r in roots
                 if (r.parent / "shared" / "data").is_dir()), None)


SHARED_DATA = shared_data_dir()
if not os.environ.get("SWEEP_DATA_DIR") and SHARED_DATA is not None:
    os.environ["SWEEP_DATA_DIR"] = str(SHARED_DATA)

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")
register_configs()


@pytest.fixture
def hydra_ctx():
    """A Hydra context over the shipped configs (like the apps use)."""
    GlobalHydra.instance().clear()
    with initialize_config_module("sweep.conf", version_base="1.3"):
        yield
    GlobalHydra.instance().clear()


@pytest.fixture
def key():
    return jax.random.key(0)


CUBE_GRID = ["grid=small", "grid.hardware=[h100_sxm,l40s]", "model=qwen3_8b",
             "grid.concurrency=[1,8,64,512]", "grid.token_budget=[256,2048]"]


@pytest.fixture(scope="session")
def cube_path(tmp_path_factory) -> Path:
    """A 64-point cube written by the installed ``sweep-grid`` (once a session)."""
    root = tmp_path_factory.mktemp("sweep_cube")
    out = root / "c.zarr"
    subprocess.run([script("sweep-grid"), *CUBE_GRID, f"out={out}"], cwd=root,
                   check=True, capture_output=True, timeout=300)
    return out


def script(name: str) -> str:
    """The installed console script ``name``."""
    exe = shutil.which(name)
    assert exe, f"{name} is not installed (pip install -e .)"
    return exe


OPTIMIZE_QUICK = ["hardware=h100_sxm", "model=qwen3_8b", "search=quick",
                  "search.tensor_parallel=[1,2]", "search.verify_requests=200"]


@pytest.fixture(scope="session")
def jax_cache_env(tmp_path_factory) -> dict[str, str]:
    """The environment of console-script runs: one JAX compilation cache (a
    temporary folder) for the session, so a later run reuses an earlier one's
    compiled programs."""
    env = dict(os.environ)
    env["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path_factory.mktemp("jax_cache"))
    return env


@dataclass(frozen=True)
class OptimizeRun:
    path: Path  # the dataset (written when the run succeeded)
    proc: subprocess.CompletedProcess


@pytest.fixture(scope="session")
def optimize_run(tmp_path_factory, jax_cache_env) -> OptimizeRun:
    """``sweep-optimize OPTIMIZE_QUICK out=opt.zarr`` by the installed script,
    once a session; its exit code is for the tests to check."""
    root = tmp_path_factory.mktemp("sweep_optimize")
    proc = subprocess.run([script("sweep-optimize"), *OPTIMIZE_QUICK, "out=opt.zarr"],
                          cwd=root, capture_output=True, text=True, timeout=900,
                          env=jax_cache_env)
    return OptimizeRun(root / "opt.zarr", proc)
