"""Typed schemas of every config group, with their semantic checks.

OmegaConf type-checks values against these dataclasses when Hydra composes a
config; ``__post_init__`` (run by ``OmegaConf.to_object``) checks what types
cannot: ranges, non-empty axes. A failed check raises ``ConfigError`` whose
message is one line naming the key, its value and what is allowed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from omegaconf import MISSING


class ConfigError(ValueError):
    """A config that cannot describe a real deployment."""


def _check(ok: bool, key: str, value, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key} = {value!r}: {allowed}")


def _positive(obj, prefix: str, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        _check(
            isinstance(value, (int, float)) and math.isfinite(value) and value > 0,
            f"{prefix}.{name}", value, "must be a finite number > 0",
        )


class LengthKind(Enum):
    discrete = "discrete"
    lognormal = "lognormal"
    trace = "trace"


class ArrivalKind(Enum):
    poisson = "poisson"
    trace = "trace"


class LatencyMethod(Enum):
    none = "none"
    simulate = "simulate"
    surrogate = "surrogate"


class Batching(Enum):
    request = "request"
    static = "static"
    continuous = "continuous"


class Replay(Enum):
    sampled = "sampled"
    exact = "exact"


class Overlong(Enum):
    reject = "reject"
    truncate = "truncate"


class Routing(Enum):
    round_robin = "round_robin"
    random = "random"


@dataclass
class Hardware:
    name: str = MISSING
    memory_bandwidth_bytes_per_s: float = MISSING
    peak_flops_per_s: float = field(
        default=MISSING, metadata={"help": "dense bf16 tensor FLOP/s, no sparsity"}
    )
    memory_bytes: float = MISSING
    interconnect_bytes_per_s: float = field(
        default=MISSING, metadata={"help": "GPU-to-GPU bandwidth, one direction"}
    )
    usd_per_gpu_hour: float = MISSING
    mbu: float = field(default=1.0, metadata={"help": "achieved / peak bandwidth"})
    mfu: float = field(default=1.0, metadata={"help": "achieved / peak FLOP/s"})
    step_overhead_s: float = field(
        default=0.0, metadata={"help": "fixed time added to every scheduler step"}
    )

    def __post_init__(self) -> None:
        p = f"hardware[{self.name}]"
        _positive(self, p, "memory_bandwidth_bytes_per_s", "peak_flops_per_s",
                  "memory_bytes", "interconnect_bytes_per_s", "usd_per_gpu_hour")
        for name in ("mbu", "mfu"):
            v = getattr(self, name)
            _check(0 < v <= 1, f"{p}.{name}", v, "must be in (0, 1]")
        _check(self.step_overhead_s >= 0, f"{p}.step_overhead_s",
               self.step_overhead_s, "must be >= 0")


@dataclass
class Model:
    name: str = MISSING
    params: float = field(default=MISSING, metadata={"help": "total parameters"})
    active_params: float = field(
        default=MISSING, metadata={"help": "parameters used per token (MoE < params)"}
    )
    layers: int = MISSING
    q_heads: int = MISSING
    kv_heads: int = MISSING
    head_dim: int = MISSING
    hidden_size: int = MISSING
    num_experts: int = 1
    experts_per_token: int = 1
    weight_dtype_bytes: float = 2.0
    kv_dtype_bytes: float = 2.0
    max_context_tokens: int = field(
        default=0,
        metadata={"help": "longest prompt + output served (vLLM's max_model_len); "
                  "0 = no limit"},
    )

    def __post_init__(self) -> None:
        p = f"model[{self.name}]"
        _check(self.max_context_tokens == 0 or self.max_context_tokens >= 2,
               f"{p}.max_context_tokens", self.max_context_tokens,
               "must be 0 (no limit) or >= 2")
        _positive(self, p, "params", "active_params", "layers", "q_heads", "kv_heads",
                  "head_dim", "hidden_size", "num_experts", "experts_per_token",
                  "weight_dtype_bytes", "kv_dtype_bytes")
        _check(self.active_params <= self.params, f"{p}.active_params",
               self.active_params, f"must be <= params ({self.params:g})")
        _check(self.experts_per_token <= self.num_experts, f"{p}.experts_per_token",
               self.experts_per_token, f"must be <= num_experts ({self.num_experts})")


@dataclass
class LengthDist:
    kind: LengthKind = LengthKind.discrete
    values: list[float] = field(default_factory=list, metadata={"help": "tokens"})
    probs: list[float] = field(default_factory=list)
    mean_tokens: float = 0.0
    sigma: float = 0.0
    max_tokens: float = field(default=0.0, metadata={"help": "clip; 0 = no clip"})


@dataclass
class Trace:
    path: str = field(
        default=MISSING,
        metadata={"help": "a file; else a registered public trace's name (sweep-data "
                  "list), fetched from its origin and verified"},
    )
    format: str = "csv"
    timestamp_column: str = ""
    timestamp_unit: str = field(
        default="s", metadata={"help": "s, ms, us, or datetime (ISO text)"}
    )
    prompt_column: str = ""
    output_column: str = ""


@dataclass
class Workload:
    name: str = MISSING
    description: str = ""
    prompt: LengthDist = field(default_factory=LengthDist)
    output: LengthDist = field(default_factory=LengthDist)
    trace: Trace | None = None
    arrival: ArrivalKind = field(
        default=ArrivalKind.poisson,
        metadata={"help": "poisson at arrival_rate_per_s, or the trace's timestamps "
                  "rescaled to arrival_rate_per_s"},
    )
    arrival_rate_per_s: float = field(
        default=1.0, metadata={"help": "mean request rate (a grid axis may override)"}
    )
    replay: Replay = field(
        default=Replay.sampled,
        metadata={"help": "sampled: lengths drawn independently from the "
                  "distributions; exact: the trace's rows in recorded order with "
                  "their recorded (prompt, output) pairs"},
    )
    overlong: Overlong = field(
        default=Overlong.reject,
        metadata={"help": "a request whose prompt + output exceeds the model's "
                  "max_context_tokens: reject it (as vLLM does), or truncate its "
                  "prompt (vLLM's --truncate-prompt-tokens)"},
    )

    def __post_init__(self) -> None:
        p = f"workload[{self.name}]"
        _positive(self, p, "arrival_rate_per_s")
        if self.replay == Replay.exact:
            _check(self.prompt.kind == LengthKind.trace
                   and self.output.kind == LengthKind.trace, f"{p}.replay", "exact",
                   "replay=exact replays a trace's recorded (prompt, output) pairs: "
                   "it needs prompt.kind=trace and output.kind=trace")
        if self.arrival == ArrivalKind.trace:
            _check(self.trace is not None and bool(self.trace.timestamp_column),
                   f"{p}.arrival", "trace",
                   "arrival=trace needs workload.trace.timestamp_column")
        for side in ("prompt", "output"):
            d: LengthDist = getattr(self, side)
            key = f"{p}.{side}"
            if d.kind == LengthKind.discrete:
                _check(len(d.values) > 0 and len(d.values) == len(d.probs),
                       f"{key}.values", list(d.values),
                       "must be non-empty and as long as probs")
                _check(all(v >= 1 for v in d.values), f"{key}.values",
                       list(d.values), "every length must be >= 1 token")
                _check(all(q >= 0 for q in d.probs) and sum(d.probs) > 0,
                       f"{key}.probs", list(d.probs),
                       "must be >= 0 with a positive sum")
            elif d.kind == LengthKind.lognormal:
                _positive(d, key, "mean_tokens", "sigma")
            else:
                column = getattr(self.trace, f"{side}_column", "") if self.trace else ""
                _check(bool(column), f"{p}.trace.{side}_column", column,
                       f"{side}.kind=trace needs workload.trace.{side}_column")


def axis_range(start, stop, num, scale="linear") -> list[float]:
    """``num`` values from ``start`` to ``stop``, evenly spaced or log-spaced.

    Registered as the OmegaConf resolver ``range``, so a grid axis can be
    written ``grid.concurrency='${range:1,1024,11,log}'``. (A ``{start, stop,
    ...}`` mapping cannot stand where a list may also stand: OmegaConf refuses
    to merge a list over a mapping.)
    """
    key = f"range:{start},{stop},{num},{scale}"
    _check(isinstance(num, int) and num >= 1, key, num, "num must be an integer >= 1")
    _check(scale in ("linear", "log"), key, scale, "scale must be linear or log")
    start, stop = float(start), float(stop)
    if num == 1:
        return [start]
    if scale == "log":
        _check(start > 0 and stop > 0, key, (start, stop),
               "a log range needs start > 0 and stop > 0")
        r = (stop / start) ** (1 / (num - 1))
        return [start * r**i for i in range(num)]
    return [start + (stop - start) * i / (num - 1) for i in range(num)]


def _numeric_axis(spec: Any, key: str, *, integer: bool, low: float) -> list[float]:
    values = list(spec) if isinstance(spec, (list, tuple)) else [spec]
    _check(len(values) > 0, key, values, "must list at least one value")
    out = []
    for v in values:
        _check(isinstance(v, (int, float)) and math.isfinite(v), key, v,
               "must be a number")
        v = float(round(v)) if integer else float(v)
        _check(v >= low, key, v, f"every value must be >= {low:g}")
        out.append(v)
    _check(len(set(out)) == len(out), key, out, "values must be distinct")
    return out


@dataclass
class Grid:
    hardware: list[str] = field(
        default_factory=list,
        metadata={"help": "hardware options; empty: the one chosen on the command "
                  "line (hardware=...), or every shipped option"},
    )
    model: list[str] = field(default_factory=list, metadata={"help": "like hardware"})
    workload: list[str] = field(
        default_factory=list, metadata={"help": "workload options; empty: `workload`"}
    )
    tensor_parallel: Any = field(default_factory=lambda: [1, 2, 4, 8])
    concurrency: Any = field(default_factory=lambda: [2**i for i in range(11)])
    token_budget: Any = field(default_factory=lambda: [2**i for i in range(8, 15)])
    context_tokens: Any = field(default_factory=lambda: [1500, 4000, 16000])
    batching: list[Batching] = field(
        default_factory=lambda: [Batching.request, Batching.static, Batching.continuous]
    )
    long_prompt_tokens: Any = field(default_factory=lambda: [8192])
    traffic_tokens_per_day: Any = field(default_factory=lambda: [1e7, 1e9])
    arrival_rate_per_s: Any = field(
        default_factory=list,
        metadata={"help": "request rates for p99 latency; empty: each workload's own"},
    )
    gpu_memory_utilization: float = field(
        default=1.0,
        metadata={"help": "share of GPU memory for weights + KV (vLLM default 0.9)"},
    )
    chunk_points: int = field(
        default=1 << 21, metadata={"help": "grid points evaluated per compiled call"}
    )

    def __post_init__(self) -> None:
        self.axes = {
            "tensor_parallel": _numeric_axis(
                self.tensor_parallel, "grid.tensor_parallel", integer=True, low=1),
            "concurrency": _numeric_axis(self.concurrency, "grid.concurrency",
                                         integer=True, low=1),
            "token_budget": _numeric_axis(self.token_budget, "grid.token_budget",
                                          integer=True, low=1),
            "context_tokens": _numeric_axis(self.context_tokens, "grid.context_tokens",
                                            integer=True, low=1),
            "long_prompt_tokens": _numeric_axis(self.long_prompt_tokens,
                                                "grid.long_prompt_tokens",
                                                integer=True, low=1),
            "traffic_tokens_per_day": _numeric_axis(
                self.traffic_tokens_per_day, "grid.traffic_tokens_per_day",
                integer=False, low=1e-300),
        }
        if len(self.arrival_rate_per_s) > 0:
            self.axes["arrival_rate_per_s"] = _numeric_axis(
                self.arrival_rate_per_s, "grid.arrival_rate_per_s", integer=False,
                low=1e-9)
        _check(len(self.batching) > 0, "grid.batching", [],
               "must list at least one of request, static, continuous")
        _check(0 < self.gpu_memory_utilization <= 1, "grid.gpu_memory_utilization",
               self.gpu_memory_utilization, "must be in (0, 1]")
        _check(self.chunk_points >= 1, "grid.chunk_points", self.chunk_points,
               "must be >= 1")


@dataclass
class Slo:
    name: str = MISSING
    ttft_p99_s: float = field(default=MISSING, metadata={"help": "p99 TTFT limit"})
    itl_p99_s: float = field(default=MISSING, metadata={"help": "p99 ITL limit"})
    max_rejected_fraction: float = field(
        default=0.0,
        metadata={"help": "largest share of requests the deployment may reject "
                  "(prompt + output above the model's max_context_tokens)"},
    )

    def __post_init__(self) -> None:
        _positive(self, f"slo[{self.name}]", "ttft_p99_s", "itl_p99_s")
        v = self.max_rejected_fraction
        _check(math.isfinite(v) and 0 <= v <= 1,
               f"slo[{self.name}].max_rejected_fraction", v, "must be in [0, 1]")


@dataclass
class Latency:
    method: LatencyMethod = field(
        default=LatencyMethod.none,
        metadata={"help": "p99 latency from the simulator, the surrogate, or none"},
    )
    num_requests: int = field(
        default=1000, metadata={"help": "requests simulated per configuration"}
    )
    chunk_configs: int = field(
        default=256, metadata={"help": "configurations simulated per compiled call"}
    )

    def __post_init__(self) -> None:
        _check(self.num_requests >= 1, "latency.num_requests", self.num_requests,
               "must be >= 1")
        _check(self.chunk_configs >= 1, "latency.chunk_configs", self.chunk_configs,
               "must be >= 1")


@dataclass
class GridApp:
    """Top config of ``sweep-grid``."""

    hardware: Hardware = MISSING
    model: Model = MISSING
    workload: Workload = MISSING
    grid: Grid = field(default_factory=Grid)
    slo: Slo = MISSING
    latency: Latency = field(default_factory=Latency)
    out: str | None = field(
        default=None, metadata={"help": "cube path; default <run dir>/cube.zarr"}
    )
    seed: int = 0
    data_dir: str | None = field(
        default=None,
        metadata={"help": "folder of local copies of the public traces (verified, "
                  "used without download); default $SWEEP_DATA_DIR"},
    )


@dataclass
class Search:
    """The ``sweep-optimize`` search space and optimizer (``conf/search/``)."""

    hardware: list[str] = field(
        default_factory=list,
        metadata={"help": "hardware options; empty: the one chosen on the command "
                  "line (hardware=...), or every shipped option"},
    )
    model: list[str] = field(
        default_factory=list,
        metadata={"help": "model variants to compare; empty: the chosen `model`"},
    )
    tensor_parallel: Any = field(default_factory=lambda: [1, 2, 4, 8])
    optimizer: str = field(default="adam", metadata={"help": "an optax alias name"})
    optimizer_options: dict[str, float] = field(
        default_factory=lambda: {"b2": 0.9},
        metadata={"help": "keyword arguments of the optax alias"},
    )
    learning_rate: float = 0.1
    final_learning_rate_fraction: float = field(
        default=0.1, metadata={"help": "cosine decay to this share of the rate"})
    steps: int = field(default=150, metadata={"help": "optimizer steps (lax.scan)"})
    restarts: int = field(default=4, metadata={"help": "random starts per candidate"})
    concurrency_min: int = 1
    concurrency_max: int = 1024
    token_budget_min: int = 256
    token_budget_max: int = 16384
    levels_per_octave: int = field(
        default=4, metadata={"help": "integer lattice of concurrency and budget"})
    replicas_max: int = 256
    penalty_weight: float = 10.0
    penalty_scale_start: float = 0.3
    penalty_scale_end: float = 0.01
    gpu_memory_utilization: float = field(
        default=0.9, metadata={"help": "share of GPU memory for weights + KV "
                               "(vLLM's default 0.9)"})
    verify_top: int = field(
        default=3, metadata={"help": "cheapest candidates simulated per round"})
    verify_requests: int = field(
        default=1000, metadata={"help": "requests per simulated replica"})
    verify_requests_max: int = field(
        default=65536,
        metadata={"help": "requests per verified configuration, all replicas "
                  "together (caps verify_requests x replicas)"})
    routing: Routing = field(
        default=Routing.round_robin,
        metadata={"help": "how the load balancer splits the stream over the "
                  "replicas: round_robin (request i to replica i mod R) or random"})
    rounds: int = field(
        default=4, metadata={"help": "search + simulate rounds (tightening)"})
    tighten_margin: float = field(
        default=0.97, metadata={"help": "extra factor on a tightened target"})

    def __post_init__(self) -> None:
        self.tp_values = _numeric_axis(self.tensor_parallel, "search.tensor_parallel",
                                       integer=True, low=1)
        for name in ("steps", "restarts", "concurrency_min", "token_budget_min",
                     "levels_per_octave", "replicas_max", "verify_top", "rounds"):
            _check(getattr(self, name) >= 1, f"search.{name}", getattr(self, name),
                   "must be >= 1")
        _check(self.concurrency_max >= self.concurrency_min, "search.concurrency_max",
               self.concurrency_max, f"must be >= concurrency_min "
               f"({self.concurrency_min})")
        _check(self.token_budget_max >= self.token_budget_min,
               "search.token_budget_max", self.token_budget_max,
               f"must be >= token_budget_min ({self.token_budget_min})")
        _check(self.verify_requests >= 10, "search.verify_requests",
               self.verify_requests, "must be >= 10")
        _check(self.verify_requests_max >= self.verify_requests,
               "search.verify_requests_max", self.verify_requests_max,
               f"must be >= verify_requests ({self.verify_requests})")
        _positive(self, "search", "learning_rate", "penalty_weight",
                  "penalty_scale_start", "penalty_scale_end")
        for name in ("final_learning_rate_fraction", "gpu_memory_utilization",
                     "tighten_margin"):
            v = getattr(self, name)
            _check(0 < v <= 1, f"search.{name}", v, "must be in (0, 1]")
        for group in ("hardware", "model"):
            listed = list(getattr(self, group))
            _check(len(set(listed)) == len(listed), f"search.{group}", listed,
                   "options must be distinct")


@dataclass
class OptimizeApp:
    """Top config of ``sweep-optimize``."""

    hardware: Hardware = MISSING
    model: Model = MISSING
    workload: Workload = MISSING
    slo: Slo = MISSING
    search: Search = field(default_factory=Search)
    out: str | None = field(
        default=None, metadata={"help": "dataset path; default <run dir>/optimize.zarr"}
    )
    seed: int = 0
    data_dir: str | None = field(
        default=None,
        metadata={"help": "folder of local copies of the public traces (verified, "
                  "used without download); default $SWEEP_DATA_DIR"},
    )
