"""Registers every schema with Hydra, and the resolvers (one place, called once).

The ``base_<group>`` schemas are what a group's configs extend (``defaults:
[base_hardware, _self_]``, in the shipped configs and in a user's own) and
the apps' roots (``base_grid_app``, ``base_optimize_app``,
``base_calibrate_app``). Hydra's
ConfigStore lists every config it holds as a choice: ``--help`` offered
``hardware: ..., base_hardware, ...``, tab completion ``hardware=base_hardware``.
So the schemas are served by a config source of their own
(``SchemaSource``, searched after the shipped configs) that loads them by
name and lists none of them; what Hydra lists is what a user can choose.
"""

from __future__ import annotations

import copy

from hydra.core.config_search_path import ConfigSearchPath
from hydra.core.object_type import ObjectType
from hydra.core.plugins import Plugins
from hydra.plugins.config_source import ConfigLoadError, ConfigResult, ConfigSource
from hydra.plugins.search_path_plugin import SearchPathPlugin
from omegaconf import DictConfig, ListConfig, OmegaConf

from sweep.config.resolve import stashed_values
from sweep.config.schema import (
    CalibrateApp,
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

SCHEMAS = {
    "hardware/base_hardware": Hardware,
    "model/base_model": Model,
    "workload/base_workload": Workload,
    "grid/base_grid": Grid,
    "slo/base_slo": Slo,
    "latency/base_latency": Latency,
    "search/base_search": Search,
    "calibration/base_calibration": Calibration,
    "base_grid_app": GridApp,
    "base_optimize_app": OptimizeApp,
    "base_calibrate_app": CalibrateApp,
}
"""Config path -> schema dataclass."""

_nodes: dict[str, DictConfig] = {}


class SchemaSource(ConfigSource):
    """The schemas as a Hydra config source: loaded by name, never listed."""

    @staticmethod
    def scheme() -> str:
        return "sweep-schema"

    def load_config(self, config_path: str) -> ConfigResult:
        path = config_path.removesuffix(".yaml")
        if path not in SCHEMAS:
            raise ConfigLoadError(f"no schema {config_path}")
        if path not in _nodes:
            _nodes[path] = OmegaConf.structured(SCHEMAS[path])
        return ConfigResult(provider=self.provider,
                            path=f"{self.scheme()}://{self.path}",
                            config=copy.deepcopy(_nodes[path]),
                            header={"package": None})

    def available(self) -> bool:
        return True

    def is_group(self, config_path: str) -> bool:
        group = config_path.strip("/")
        return group == "" or any(p.startswith(group + "/") for p in SCHEMAS)

    def is_config(self, config_path: str) -> bool:
        return config_path.strip("/").removesuffix(".yaml") in SCHEMAS

    def list(self, config_path: str, results_filter: ObjectType | None) -> list[str]:
        return []


class SchemaSearchPath(SearchPathPlugin):
    """Adds ``SchemaSource`` to every Hydra search path (the apps', the tests')."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append("sweep-schemas", f"{SchemaSource.scheme()}://sweep.config")


_LIST_RESOLVERS = {"range": axis_range, "axis_values": stashed_values}
"""OmegaConf resolvers that return a numeric axis's values."""

_done = False


def register_configs() -> None:
    """Makes the schemas composable and the resolvers ``range`` and
    ``axis_values`` known."""
    global _done
    if _done:
        return
    plugins = Plugins.instance()
    plugins.register(SchemaSource)
    plugins.register(SchemaSearchPath)
    for name, fn in _LIST_RESOLVERS.items():
        OmegaConf.register_new_resolver(name, fn, replace=True)
    _done = True


def resolve_lists_to_nodes() -> None:
    """Makes the list resolvers return ``ListConfig`` nodes: for Hydra's
    ``--resolve`` (``--cfg job --resolve``, ``--help --resolve``).

    There Hydra resolves the config in place (``OmegaConf.resolve``), which
    writes each resolver's result back into its node; a numeric axis's node is
    untyped (it takes a list or a number) and holds a primitive or a node
    only, so a plain list fails (``UnsupportedValueType: 'list'``). A run gets
    plain lists because a node costs ~0.2 ms a value (a minute for 300,000);
    printing a config in full costs that anyway.
    """
    register_configs()
    for name, fn in _LIST_RESOLVERS.items():
        OmegaConf.register_new_resolver(
            name, lambda *args, fn=fn: ListConfig(fn(*args)), replace=True)
