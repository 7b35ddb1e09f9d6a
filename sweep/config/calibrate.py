"""Schema of ``sweep-calibrate``'s top config (``conf/calibrate.yaml``).

The app fits one hardware x model x engine at a time to measured step
latencies (CSV) and ``vllm bench serve`` results (JSON) and writes a
``calibration/<name>.yaml`` config (``sweep.calibrate_cli``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from sweep.config.schema import (
    ENGINES,
    MAX_MEMORY_HELP,
    MAX_TOKENS,
    Hardware,
    Model,
    _check,
    _check_run_settings,
    _in_range,
)


@dataclass
class Fit:
    """The optax fit of the constants (``sweep.calibrate.CONSTANTS``)."""

    steps: int = field(default=1000, metadata={"help": "Adam steps (lax.scan)"})
    learning_rate: float = 0.1
    fit: list[str] = field(
        default_factory=lambda: ["mbu", "mfu", "step_overhead_s", "kv_mbu",
                                 "sequence_overhead_s"],
        metadata={"help": "constants fitted; the others keep the hardware's "
                  "(kv_mbu: follows mbu)"})

    def __post_init__(self) -> None:
        _in_range(self, "calibrate.fit", "steps", 1, 100_000)
        _in_range(self, "calibrate.fit", "learning_rate", 1e-6, 10)
        allowed = ("mbu", "mfu", "step_overhead_s", "kv_mbu", "sequence_overhead_s")
        _check(len(self.fit) > 0 and all(f in allowed for f in self.fit)
               and len(set(self.fit)) == len(self.fit), "calibrate.fit.fit",
               list(self.fit), f"a non-empty list of distinct {', '.join(allowed)}")


@dataclass
class CalibrateApp:
    """Top config of ``sweep-calibrate``."""

    hardware: Hardware = MISSING
    model: Model = MISSING
    name: str = field(
        default="measured",
        metadata={"help": "the calibration config written: calibration/<name>.yaml"})
    engine: str = field(default="vllm", metadata={"help": "vllm, sglang or trtllm"})
    steps_csv: list[str] = field(
        default_factory=list,
        metadata={"help": "CSVs of measured steps: batch_size, context_tokens, "
                  "prefill_tokens, seconds[, tensor_parallel]"})
    bench_json: list[str] = field(
        default_factory=list,
        metadata={"help": "JSONs of `vllm bench serve --save-result "
                  "--save-detailed`, one run each"})
    max_num_seqs: int = field(
        default=256, metadata={"help": "the server's --max-num-seqs in the runs"})
    max_num_batched_tokens: int = field(
        default=8192,
        metadata={"help": "the server's --max-num-batched-tokens in the runs"})
    tensor_parallel: int = field(
        default=1, metadata={"help": "the server's --tensor-parallel-size in the runs"})
    gpu_memory_utilization: float = field(
        default=0.9, metadata={"help": "the server's --gpu-memory-utilization"})
    source: str = field(default="", metadata={"help": "recorded in the profile"})
    version: str = field(default="", metadata={"help": "recorded in the profile"})
    license: str = field(default="", metadata={"help": "recorded in the profile"})
    fit: Fit = field(default_factory=Fit)
    out: str | None = field(
        default=None,
        metadata={"help": "config folder written: <out>/calibration/<name>.yaml; "
                  "default the run directory"})
    seed: int = 0
    max_memory_gb: float = field(default=0.0, metadata={"help": MAX_MEMORY_HELP})

    def __post_init__(self) -> None:
        _check_run_settings(self)
        _check(bool(self.name) and self.name.replace("_", "").replace("-", "")
               .isalnum(), "name", self.name,
               "a config name: letters, digits, '_' and '-'")
        _check(self.engine in ENGINES, "engine", self.engine,
               f"allowed: {', '.join(ENGINES)}")
        _check(len(self.steps_csv) + len(self.bench_json) > 0, "steps_csv", [],
               "give at least one measured file: steps_csv=[...] or bench_json=[...]")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            _in_range(self, "", name, 1, MAX_TOKENS)
        _in_range(self, "", "tensor_parallel", 1, self.hardware.max_gpus_per_node)
        _in_range(self, "", "gpu_memory_utilization", 1e-3, 1)
