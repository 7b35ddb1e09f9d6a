"""Shared fixtures: strict JAX promotion, composed configs, a PRNG key."""

from __future__ import annotations

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
