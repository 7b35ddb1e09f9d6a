"""The option objects of a swept grid: what each composition gives, and the
compositions a preflight shares.

``grid_options`` composes option i of every swept group together, choosing
``calibration=roofline`` there (cheap to compose; the swept groups' nodes
never read the calibration). The reference here is the plain way: one full
composition of the app per option, with every override of the command line
but the group's own choice and the grid's lists.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from helpers import hydra_context
from hydra._internal.hydra import Hydra
from hydra.types import RunMode

import sweep
from sweep.cli.commands import known_mode
from sweep.config.resolve import compose_object, composed, composing_once, grid_options

CONF = Path(sweep.__file__).parent.parent / "conf"

SWEPT = ["grid.hardware=[h100_sxm,b200]",
         "grid.model=[qwen3_8b,llama3_1_70b,mixtral_8x7b]",
         "grid.workload=[seed_chat,rag_long_prompt]"]
EDITS = ["hardware.mbu=0.7", "hardware.usd_per_gpu_hour=3.5", "model.kv_dtype=fp8",
         "workload.arrival_rate_per_s=2", "calibration=auto",
         "calibration.engine=sglang"]


def shipped(group: str, name: str) -> dict:
    """A shipped option's own values, read from its file."""
    return yaml.safe_load((CONF / group / f"{name}.yaml").read_text())


def test_field_override_applies_to_every_swept_option():
    names = ["h100_sxm", "h200_sxm", "b200", "l40s"]
    with hydra_context():
        _, options = grid_options("grid", [f"grid.hardware=[{','.join(names)}]",
                                           "hardware.mbu=0.7"])
    assert [h.name for h in options["hardware"]] == names
    for h in options["hardware"]:
        own = shipped("hardware", h.name)
        assert own["mbu"] == 1.0  # the override, not the file, sets it
        assert h.mbu == 0.7
        assert h.memory_bandwidth_bytes_per_s == own["memory_bandwidth_bytes_per_s"]
        assert h.usd_per_gpu_hour == own["usd_per_gpu_hour"]


def test_options_equal_one_full_composition_per_option():
    overrides = [*SWEPT, *EDITS]
    with hydra_context():
        base, options = grid_options("grid", overrides)
        for group in ("hardware", "model", "workload"):
            listed = list(getattr(base.grid, group))
            assert [o.name for o in options[group]] == listed
            for name, got in zip(listed, options[group], strict=True):
                want = getattr(compose_object("grid", [*EDITS, f"{group}={name}"]),
                               group)
                assert got == want, (group, name)
    # the edits reached every option (and the calibration is the base's)
    assert {h.mbu for h in options["hardware"]} == {0.7}
    assert {m.kv_dtype for m in options["model"]} == {"fp8"}
    assert {w.arrival_rate_per_s for w in options["workload"]} == {2.0}
    assert base.calibration.name == "auto" and base.calibration.engine == "sglang"


def test_experiment_options_composed_with_the_experiment():
    with hydra_context():
        base, options = grid_options("grid", ["experiment=seed",
                                              "grid.hardware=[h100_sxm,b200]"])
        want = [compose_object("grid", ["experiment=seed", f"hardware={h}"]).hardware
                for h in ("h100_sxm", "b200")]
    assert options["hardware"] == want
    assert base.calibration.name == "roofline"  # the experiment's choice


def test_composing_once_shares_one_composition():
    with hydra_context():
        with composing_once():
            first = composed("grid", ["hardware=b200"])
            assert composed("grid", ["hardware=b200"]) is first
            assert composed("grid", ["hardware=l40s"]) is not first
        again = composed("grid", ["hardware=b200"])
    assert again is not first
    assert again[0] == first[0] and again[1] == first[1]
    assert "hydra" not in again[0]
    assert again[1].run_dir.startswith("outputs/") and again[1].mode is None
    # the run mode the console scripts hand to @hydra.main (commands.known_mode)
    with hydra_context():
        multirun = composed("grid", ["hydra.mode=MULTIRUN"])[1]
    assert multirun.mode == RunMode.MULTIRUN
    own = Hydra.get_mode
    with known_mode(multirun):
        assert Hydra.get_mode(None, "grid", []) == RunMode.MULTIRUN
    assert Hydra.get_mode is own
    with known_mode(None):  # no preflight: Hydra reads it itself
        assert Hydra.get_mode is own


@pytest.mark.parametrize("args, pattern", [
    (["grid.hardware=[h100_sxm,nope]"], "grid.hardware entry hardware=nope"),
    (["grid.model=[qwen3_8b,qwen3_8b]"], "options must be distinct"),
])
def test_option_errors_unchanged(args, pattern):
    from sweep.config.schema import ConfigError

    with hydra_context(), pytest.raises(ConfigError, match=pattern):
        grid_options("grid", args)
