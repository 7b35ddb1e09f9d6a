"""Shared fixtures: strict JAX promotion, composed configs, a PRNG key."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import jax
import pytest
from hydra import initialize_config_module
from hydra.core.global_hydra import GlobalHydra

from sweep.config.store import register_configs

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
    exe = shutil.which("sweep-grid")
    assert exe, "sweep-grid is not installed (pip install -e .)"
    subprocess.run([exe, *CUBE_GRID, f"out={out}"], cwd=root, check=True,
                   capture_output=True, timeout=300)
    return out
