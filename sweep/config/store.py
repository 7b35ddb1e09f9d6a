"""Registers every schema in Hydra's ConfigStore (one place, called once)."""

from __future__ import annotations

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from sweep.config.calibrate import CalibrateApp
from sweep.config.resolve import stashed_values
from sweep.config.schema import (
    Calibration,
    Grid,
    GridApp,
    Hardware,
    Latency,
    Model,
    OptimizeApp,
    Search,
    Slo,
    Workload,
    axis_range,
)

_done = False


def register_configs() -> None:
    """Makes ``base_<group>`` schemas and the apps' base configs composable."""
    global _done
    if _done:
        return
    cs = ConfigStore.instance()
    cs.store(group="hardware", name="base_hardware", node=Hardware)
    cs.store(group="model", name="base_model", node=Model)
    cs.store(group="workload", name="base_workload", node=Workload)
    cs.store(group="grid", name="base_grid", node=Grid)
    cs.store(group="slo", name="base_slo", node=Slo)
    cs.store(group="latency", name="base_latency", node=Latency)
    cs.store(name="base_grid_app", node=GridApp)
    cs.store(group="search", name="base_search", node=Search)
    cs.store(name="base_optimize_app", node=OptimizeApp)
    cs.store(group="calibration", name="base_calibration", node=Calibration)
    cs.store(name="base_calibrate_app", node=CalibrateApp)
    OmegaConf.register_new_resolver("range", axis_range, replace=True)
    OmegaConf.register_new_resolver("axis_values", stashed_values, replace=True)
    _done = True
