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

from sweep.cube import contract, engines
from sweep.errors import ConfigError
from sweep.model import precision, roofline


def _check(ok: bool, key: str, value, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key} = {value!r}: {allowed}")


# Ranges sit far outside any real deployment (1,000x beyond the shipped
# figures or more, both ways) and keep every float32 product and quotient of
# the model finite and nonzero; integer counts stay at or below 2**24, below
# which float32 holds every integer exactly (the model computes in float32).
MAX_TOKENS = 2**24


def _bound(x: float) -> str:
    """A range's end: ``%g`` where that is exact, else in full."""
    short = f"{x:g}"
    if float(short) == x:
        return short
    return str(int(x)) if float(x).is_integer() else repr(x)


def _in_range(obj, prefix: str, name: str, low: float, high: float) -> None:
    """``low <= value <= high``, a finite number."""
    value = getattr(obj, name)
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
          and math.isfinite(value) and low <= value <= high)
    _check(ok, f"{prefix}.{name}" if prefix else name, value,
           f"must be a finite number in [{_bound(low)}, {_bound(high)}]")


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


def _proposer_indices(names, key: str) -> list[float]:
    """A proposer list (``roofline.PROPOSERS`` names) as the cube's values (indices)."""
    names = [str(v) for v in names]
    _check(len(names) > 0 and len(set(names)) == len(names)
           and all(v in roofline.PROPOSERS for v in names), key, names,
           f"allowed: distinct values of {', '.join(roofline.PROPOSERS)}")
    return [float(roofline.PROPOSERS.index(v)) for v in names]


def _check_draft_tokens(obj, section: str, spec_values) -> None:
    """A proposer that loads a model (draft, eagle3) needs proposals to
    make: some ``k > 0``."""
    for name in ("draft", "eagle3"):
        _check(name not in list(obj.spec_proposer) or any(k > 0 for k in spec_values),
               f"{section}.spec_tokens", [int(k) for k in spec_values],
               f"{section}.spec_proposer lists {name}: needs some k > 0 (k = 0 is "
               "no speculation, with nothing loaded)")


def _check_step_shape(obj, prefix: str) -> None:
    """``kv_mbu`` (0: the weights' ``mbu``) and ``sequence_overhead_s``."""
    if obj.kv_mbu != 0:
        _in_range(obj, prefix, "kv_mbu", 1e-3, 1)
    _in_range(obj, prefix, "sequence_overhead_s", 0, 1)


@dataclass
class Hardware:
    name: str = MISSING
    memory_bandwidth_bytes_per_s: float = MISSING
    peak_flops_per_s: float = field(
        default=MISSING, metadata={"help": "dense bf16 tensor FLOP/s, no sparsity"}
    )
    fp8_flops_per_s: float = field(
        default=0.0,
        metadata={"help": "dense fp8 tensor FLOP/s, no sparsity; 0: no FP8 tensor "
                  "cores (weight_dtype fp8 refused)"})
    fp4_flops_per_s: float = field(
        default=0.0,
        metadata={"help": "dense fp4 tensor FLOP/s, no sparsity; 0: no FP4 tensor "
                  "cores (weight_dtype fp4 refused)"})
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
    kv_mbu: float = field(
        default=0.0,
        metadata={"help": "achieved / peak bandwidth of KV-cache reads; 0: mbu"})
    sequence_overhead_s: float = field(
        default=0.0,
        metadata={"help": "fixed time each sequence adds to a step (attention "
                  "launch, sampling)"})
    kv_link_bytes_per_s: float = field(
        default=5.0e10,
        metadata={"help": "bytes/s one GPU sends KV over to another instance, "
                  "one direction (disaggregated prefill/decode): the node's "
                  "scale-out NIC per GPU (InfiniBand NDR 400 Gb/s = 5e10), or "
                  "NVLink when prefill and decode share a node"})
    kv_transfer_layerwise: bool = field(
        default=False,
        metadata={"help": "disaggregated prefill/decode: the KV connector sends "
                  "each layer's KV as the prefill computes it (vLLM's "
                  "LMCacheConnectorV1 with use_layerwise), so the transfer "
                  "overlaps the prefill; false: it starts when the prefill ends "
                  "(vLLM's NixlConnector)"})
    max_gpus_per_node: int = field(
        default=8,
        metadata={"help": "GPUs one node holds: the largest tensor-parallel size "
                  "(tensor parallelism across nodes is not modelled)"},
    )

    def __post_init__(self) -> None:
        p = f"hardware[{self.name}]"
        for name, low, high in (("memory_bandwidth_bytes_per_s", 1e6, 1e15),
                                ("peak_flops_per_s", 1e6, 1e18),
                                ("memory_bytes", 1e6, 1e14),
                                ("interconnect_bytes_per_s", 1e3, 1e15),
                                ("kv_link_bytes_per_s", 1e3, 1e15),
                                ("usd_per_gpu_hour", 1e-6, 1e4),
                                ("mbu", 1e-3, 1), ("mfu", 1e-3, 1)):
            _in_range(self, p, name, low, high)
        _in_range(self, p, "step_overhead_s", 0, 3600)
        _check_step_shape(self, p)
        for name in ("fp8_flops_per_s", "fp4_flops_per_s"):
            if getattr(self, name) != 0:
                _in_range(self, p, name, 1e6, 1e18)
        _in_range(self, p, "max_gpus_per_node", 1, 1024)


@dataclass
class Model:
    name: str = MISSING
    hf_id: str = field(default="", metadata={
        "help": "Hugging Face repository the engines load (serving commands)"})
    params: float = field(default=MISSING, metadata={"help": "total parameters"})
    active_params: float = field(
        default=MISSING, metadata={"help": "parameters used per token (MoE < params)"}
    )
    layers: int = MISSING
    q_heads: int = MISSING
    kv_heads: int = MISSING
    head_dim: int = MISSING
    hidden_size: int = MISSING
    intermediate_size: int = field(default=0, metadata={
        "help": "MLP width of a layer (of each expert in a MoE model); 0: unknown "
                "(the eagle3 proposer, whose head has one such layer, is refused)"})
    num_experts: int = 1
    experts_per_token: int = 1
    weight_dtype: str = field(
        default="bf16",
        metadata={"help": f"{', '.join(precision.WEIGHT_DTYPES)} (group scales "
                  "counted in the bytes: sweep.model.precision)"})
    kv_dtype: str = field(
        default="bf16", metadata={"help": ", ".join(precision.KV_DTYPES)})
    max_context_tokens: int = field(
        default=0,
        metadata={"help": "longest prompt + output served (vLLM's max_model_len); "
                  "0 = no limit"},
    )
    draft_model: str = field(
        default="",
        metadata={"help": "the model option (conf/model) of its draft model for "
                  "speculative decoding with spec_proposer=draft: a small dense "
                  "model of the same tokenizer; empty: none (the draft proposer "
                  "is refused)"})
    draft: Any = field(
        default=None, compare=False,
        metadata={"help": "not a config key: the draft_model's config, filled in "
                  "when a sweep lists the draft proposer (sweep.config.resolve)"})
    eagle3_head: str = field(
        default="",
        metadata={"help": "Hugging Face id of a trained EAGLE-3 head for this model "
                  "(spec_proposer=eagle3: its size follows from the model's own "
                  "layer, sweep.model.roofline.eagle3_head_params); empty: none "
                  "(the eagle3 proposer is refused)"})
    eagle3_intermediate_size: int = field(
        default=0,
        metadata={"help": "MLP width of the EAGLE-3 head's one layer (the head's "
                  "config.json intermediate_size); 0: the model's own "
                  "intermediate_size, as a dense model's heads have it. A MoE "
                  "model's heads have a dense MLP of their own width: give it "
                  "here (the eagle3 proposer is refused for a MoE model without "
                  "it)"})
    eagle3: Any = field(
        default=None, compare=False,
        metadata={"help": "not a config key: the EAGLE-3 head as a one-layer dense "
                  "model, filled in when a sweep lists the eagle3 proposer"})

    def __post_init__(self) -> None:
        p = f"model[{self.name}]"
        for name, low, high in (("params", 1, 1e14), ("active_params", 1, 1e14)):
            _in_range(self, p, name, low, high)
        for name, allowed in (("weight_dtype", precision.WEIGHT_DTYPES),
                              ("kv_dtype", precision.KV_DTYPES)):
            _check(getattr(self, name) in allowed, f"{p}.{name}", getattr(self, name),
                   f"allowed: {', '.join(allowed)}")
        for name, high in (("layers", 10_000), ("q_heads", 100_000),
                           ("kv_heads", 100_000), ("head_dim", 100_000),
                           ("hidden_size", 10_000_000), ("num_experts", 100_000),
                           ("experts_per_token", 100_000)):
            _in_range(self, p, name, 1, high)
        _in_range(self, p, "max_context_tokens", 0, MAX_TOKENS)
        _in_range(self, p, "intermediate_size", 0, 10_000_000)
        _in_range(self, p, "eagle3_intermediate_size", 0, 10_000_000)
        _check(self.max_context_tokens == 0 or self.max_context_tokens >= 2,
               f"{p}.max_context_tokens", self.max_context_tokens,
               "must be 0 (no limit) or >= 2")
        _check(self.q_heads % self.kv_heads == 0, f"{p}.kv_heads", self.kv_heads,
               f"must divide q_heads ({self.q_heads}): each KV head serves "
               "q_heads / kv_heads query heads")
        _check(self.active_params <= self.params, f"{p}.active_params",
               self.active_params, f"must be <= params ({self.params:g})")
        _check(self.experts_per_token <= self.num_experts, f"{p}.experts_per_token",
               self.experts_per_token, f"must be <= num_experts ({self.num_experts})")

    @property
    def weight_dtype_bytes(self) -> float:
        """Bytes per weight at ``weight_dtype``, group scales included."""
        return precision.WEIGHT_BYTES[self.weight_dtype]

    @property
    def kv_dtype_bytes(self) -> float:
        """Bytes per KV-cache value at ``kv_dtype``."""
        return precision.KV_BYTES[self.kv_dtype]


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
    hash_column: str = field(
        default="",
        metadata={"help": "a list column: one hash per block of hash_block_tokens "
                  "prompt tokens (equal hashes, equal prefixes), e.g. hash_ids; with "
                  "prefix caching on, the hits come from an LRU cache of them"},
    )
    hash_block_tokens: int = field(
        default=0, metadata={"help": "prompt tokens per hashed block (needed with "
                             "hash_column; the trace's publisher gives it)"})


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
    prefix_hit_fraction: float = field(
        default=0.0,
        metadata={"help": "share of each prompt's tokens found in the prefix cache "
                  "when prefix caching is on (grid.prefix_caching), in [0, 1): "
                  "shared system prompts, multi-turn history"},
    )
    prefix_hit_levels: list[float] = field(
        default_factory=list,
        metadata={"help": "a distribution of the share of a prompt found in the "
                  "cache, in place of prefix_hit_fraction: each request's share "
                  "is levels[i] with probability prefix_hit_probs[i], e.g. [0, 0.8] "
                  "for first turns beside later ones"},
    )
    prefix_hit_probs: list[float] = field(
        default_factory=list,
        metadata={"help": "the probabilities of prefix_hit_levels (summing to 1)"},
    )

    @property
    def mean_prefix_hit(self) -> float:
        """The mean share of a prompt in the cache: ``prefix_hit_fraction``,
        or the mean of the levels."""
        if self.prefix_hit_levels:
            return float(sum(h * q for h, q in zip(self.prefix_hit_levels,
                                                   self.prefix_hit_probs)))
        return float(self.prefix_hit_fraction)

    def __post_init__(self) -> None:
        p = f"workload[{self.name}]"
        _in_range(self, p, "arrival_rate_per_s", 1e-9, 1e12)
        h = self.prefix_hit_fraction
        _check(isinstance(h, (int, float)) and not isinstance(h, bool)
               and math.isfinite(h) and 0 <= h < 1, f"{p}.prefix_hit_fraction", h,
               "must be a finite number in [0, 1)")
        levels, probs = list(self.prefix_hit_levels), list(self.prefix_hit_probs)
        if levels or probs:
            _check(1 <= len(levels) <= MAX_HIT_LEVELS and len(levels) == len(probs),
                   f"{p}.prefix_hit_levels", levels,
                   f"must list 1 to {MAX_HIT_LEVELS} shares, as many as "
                   "prefix_hit_probs")
            _check(all(math.isfinite(v) and 0 <= v < 1 for v in levels),
                   f"{p}.prefix_hit_levels", levels, "every share must be in [0, 1)")
            _check(all(math.isfinite(q) and q > 0 for q in probs)
                   and abs(sum(probs) - 1) <= 1e-6, f"{p}.prefix_hit_probs", probs,
                   "must be > 0 and sum to 1")
            _check(h == 0, f"{p}.prefix_hit_fraction", h,
                   "prefix_hit_levels gives the shares: leave prefix_hit_fraction "
                   "at 0")
        if self.trace is not None and self.trace.hash_column:
            t = self.trace
            _check(isinstance(t.hash_block_tokens, int)
                   and not isinstance(t.hash_block_tokens, bool)
                   and 1 <= t.hash_block_tokens <= MAX_TOKENS,
                   f"{p}.trace.hash_block_tokens", t.hash_block_tokens,
                   f"hash_column needs the tokens per hashed block, an integer in "
                   f"[1, {MAX_TOKENS}]")
            _check(self.replay == Replay.exact, f"{p}.replay", self.replay.value,
                   "block hashes belong to their rows: hash_column needs "
                   "replay=exact")
            _check(self.mean_prefix_hit == 0 and not levels, f"{p}.prefix_hit_fraction",
                   self.mean_prefix_hit,
                   "the hits come from the trace's block hashes (hash_column); "
                   "leave prefix_hit_fraction at 0 and prefix_hit_levels empty")
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
                _check(all(math.isfinite(v) and 1 <= v <= MAX_TOKENS
                           for v in d.values), f"{key}.values", list(d.values),
                       f"every length must be in [1, {MAX_TOKENS}] tokens")
                _check(all(math.isfinite(q) and q >= 0 for q in d.probs)
                       and sum(d.probs) > 0, f"{key}.probs", list(d.probs),
                       "must be finite, >= 0, with a positive sum")
            elif d.kind == LengthKind.lognormal:
                _in_range(d, key, "mean_tokens", 1, MAX_TOKENS)
                _in_range(d, key, "sigma", 1e-3, 10)
            else:
                column = getattr(self.trace, f"{side}_column", "") if self.trace else ""
                _check(bool(column), f"{p}.trace.{side}_column", column,
                       f"{side}.kind=trace needs workload.trace.{side}_column")
            # unused by other kinds, but never nonsense
            _in_range(d, key, "mean_tokens", 0, MAX_TOKENS)
            _in_range(d, key, "sigma", 0, 10)
            _in_range(d, key, "max_tokens", 0, MAX_TOKENS)


MAX_AXIS_VALUES = 10_000_000
MAX_HIT_LEVELS = 16
"""Most shares in a workload's distribution of prefix hits."""


def axis_range(start, stop, num, scale="linear") -> list[float]:
    """``num`` values from ``start`` to ``stop``, evenly spaced or log-spaced.

    Registered as the OmegaConf resolver ``range``, so a grid axis can be
    written ``grid.concurrency='${range:1,1024,11,log}'``. (A ``{start, stop,
    ...}`` mapping cannot stand where a list may also stand: OmegaConf refuses
    to merge a list over a mapping.)
    """
    key = f"range:{start},{stop},{num},{scale}"
    _check(isinstance(num, int) and 1 <= num <= MAX_AXIS_VALUES, key, num,
           f"num must be an integer in [1, {MAX_AXIS_VALUES}]")
    _check(scale in ("linear", "log"), key, scale, "scale must be linear or log")
    try:
        start, stop = float(start), float(stop)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: start and stop must be numbers") from None
    _check(math.isfinite(start) and math.isfinite(stop), key, (start, stop),
           "start and stop must be finite")
    if num == 1:
        return [start]
    if scale == "log":
        _check(start > 0 and stop > 0, key, (start, stop),
               "a log range needs start > 0 and stop > 0")
        r = (stop / start) ** (1 / (num - 1))
        return [start * r**i for i in range(num)]
    return [start + (stop - start) * i / (num - 1) for i in range(num)]


def _numeric_axis(spec: Any, key: str, *, integer: bool, low: float,
                  high: float = MAX_TOKENS) -> list[float]:
    """An axis's values, checked, in ascending order.

    A value typed twice is refused (a slip of the pen); on an integer axis,
    distinct values that round to the same integer are kept once, so a log
    range over small integers (``${range:1,1024,64,log}``) is usable. The
    order is ascending whatever the order typed: the values become a cube's
    coordinate, which ``.sel(axis=slice(a, b))`` reads as sorted.
    """
    values = list(spec) if isinstance(spec, (list, tuple)) else [spec]
    _check(len(values) > 0, key, values, "must list at least one value")
    _check(len(values) <= MAX_AXIS_VALUES, key, f"{len(values)} values",
           f"at most {MAX_AXIS_VALUES} values per axis")
    out = []
    for v in values:
        _check(isinstance(v, (int, float)) and not isinstance(v, bool)
               and math.isfinite(v), key, v, "must be a number")
        r = float(round(v)) if integer else float(v)
        _check(low <= r <= high, key, r,
               f"every value must be in [{_bound(low)}, {_bound(high)}]")
        out.append(r)
    if len(set(values)) != len(values):
        seen: set[float] = set()
        twice = next(v for v in values if v in seen or seen.add(v))
        raise ConfigError(f"{key}: {twice:g} appears more than once; values must be "
                          "distinct")
    return sorted(set(out))


def _check_precision_axes(section, prefix: str) -> None:
    """``weight_dtype`` and ``kv_dtype`` lists: known dtypes, each once."""
    for name, allowed in (("weight_dtype", precision.WEIGHT_DTYPES),
                          ("kv_dtype", precision.KV_DTYPES)):
        values = list(getattr(section, name))
        bad = [v for v in values if v not in allowed]
        _check(not bad, f"{prefix}.{name}", values, f"allowed: {', '.join(allowed)}")
        _check(len(set(values)) == len(values), f"{prefix}.{name}", values,
               "values must be distinct")


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
    weight_dtype: list[str] = field(
        default_factory=list,
        metadata={"help": f"weight precisions ({', '.join(precision.WEIGHT_DTYPES)}); "
                  "empty: each model's own"})
    kv_dtype: list[str] = field(
        default_factory=list,
        metadata={"help": f"KV cache precisions ({', '.join(precision.KV_DTYPES)}); "
                  "empty: each model's own"})
    long_prompt_tokens: Any = field(default_factory=lambda: [8192])
    traffic_tokens_per_day: Any = field(default_factory=lambda: [1e7, 1e9])
    spec_tokens: Any = field(
        default_factory=lambda: [0],
        metadata={"help": "speculative decoding: tokens proposed per step (n-gram "
                  "proposer); 0: off"})
    spec_acceptance: Any = field(
        default_factory=lambda: [0.7],
        metadata={"help": "chance each proposed token is accepted (0-1)"})
    spec_proposer: list[str] = field(
        default_factory=lambda: ["ngram"],
        metadata={"help": "who proposes the speculative tokens: ngram (a lookup "
                  "in the sequence, no GPU time) and/or draft (each model's "
                  "draft_model, whose decode steps and memory are counted) or "
                  "eagle3 (each model's EAGLE-3 head, likewise; not beside draft "
                  "in one grid); a cube axis (0 ngram, 1 draft, 2 eagle3)"})
    prefix_caching: list[bool] = field(
        default_factory=lambda: [False],
        metadata={"help": "automatic prefix caching off (false) and/or on (true, at "
                  "each workload's prefix_hit_fraction); a 0/1 cube axis"})
    disaggregated: list[bool] = field(
        default_factory=lambda: [False],
        metadata={"help": "one aggregated engine (false) and/or disaggregated "
                  "prefill/decode (true): prefill_instances prefill-only "
                  "instances of prefill_tensor_parallel GPUs and decode_instances "
                  "decode-only instances of the point's tensor parallelism, the "
                  "prompt's KV sent over "
                  "hardware.kv_link_bytes_per_s; a 0/1 cube axis"})
    prefill_instances: Any = field(
        default_factory=lambda: [1],
        metadata={"help": "prefill instances of a disaggregated deployment (>= 1)"})
    decode_instances: Any = field(
        default_factory=lambda: [1],
        metadata={"help": "decode instances of a disaggregated deployment (>= 1)"})
    prefill_tensor_parallel: Any = field(
        default_factory=lambda: [0],
        metadata={"help": "tensor-parallel GPUs of each prefill instance of a "
                  "disaggregated deployment (0: the point's tensor_parallel, "
                  "which the decode instances take)"})
    arrival_rate_per_s: Any = field(
        default_factory=list,
        metadata={"help": "request rates for p99 latency; empty: each workload's own"},
    )
    gpu_memory_utilization: float = field(
        default=1.0,
        metadata={"help": "share of GPU memory for weights + KV (vLLM default 0.9)"},
    )
    sensitivity: bool = field(
        default=False,
        metadata={"help": "also store d_cost_d_<constant>: the cost's elasticity to "
                  "each hardware and calibration constant (forward-mode jax; +56 % "
                  "bytes per point), and under latency=surrogate "
                  "d_ttft_p99_d_<constant> and d_itl_p99_d_<constant> (central "
                  "differences: 17 surrogate evaluations a point)"})
    chunk_points: int = field(
        default=1 << 21, metadata={"help": "grid points evaluated per compiled call"}
    )

    def __post_init__(self) -> None:
        # the numeric axes of the cube (sweep.cube.contract), each a list of floats
        self.axes = {}
        for a in contract.AXES:
            spec = getattr(self, a.name) if a.kind != contract.LABEL else None
            if spec is None or (a.optional and len(spec) == 0):
                continue
            if a.name in ("prefix_caching", "disaggregated"):  # flags: 0/1
                spec = [float(v) for v in spec]
            if a.name == "spec_proposer":
                spec = _proposer_indices(spec, "grid.spec_proposer")
                # a model's draft leaves hold one loaded proposer per grid
                _check(not {"draft", "eagle3"} <= set(self.spec_proposer),
                       "grid.spec_proposer", list(self.spec_proposer),
                       "draft and eagle3 load different models: list one of them "
                       "per grid (sweep-optimize compares all three)")
            self.axes[a.name] = _numeric_axis(
                spec, f"grid.{a.name}", integer=a.kind == contract.INTEGER,
                low=a.low, high=MAX_TOKENS if a.high is None else a.high)
        _check(len(self.batching) > 0, "grid.batching", [],
               "must list at least one of request, static, continuous")
        _check_draft_tokens(self, "grid", self.axes["spec_tokens"])
        _check_precision_axes(self, "grid")
        _in_range(self, "grid", "gpu_memory_utilization", 1e-3, 1)
        _in_range(self, "grid", "chunk_points", 1, 2**31 - 1)

    @property
    def prefill_pools(self) -> list[int]:
        """The prefill instance counts of the grid's disaggregated points, in
        ascending order (none without disaggregated points)."""
        if max(self.axes["disaggregated"]) == 0:
            return []
        return [int(p) for p in self.axes["prefill_instances"]]

    @property
    def optional_variables(self) -> frozenset[str]:
        """The cube's optional variables asked for (``contract.Metric.option``)."""
        return frozenset(
            ({contract.SENSITIVITY_OPTION} if self.sensitivity else set())
            | ({contract.DISAGGREGATION_OPTION} if any(self.disaggregated) else set()))

    def precision(self, name: str, models: list[Model]) -> list[str]:
        """The values of a precision axis (``weight_dtype``, ``kv_dtype``): the
        grid's, else the models' own when they agree, else ``own`` (each
        model's own)."""
        values = list(getattr(self, name))
        if values:
            return values
        own = {getattr(m, name) for m in models}
        return [own.pop()] if len(own) == 1 else ["own"]


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
        for name in ("ttft_p99_s", "itl_p99_s"):
            _in_range(self, f"slo[{self.name}]", name, 1e-9, 1e9)
        _in_range(self, f"slo[{self.name}]", "max_rejected_fraction", 0, 1)


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
        _in_range(self, "latency", "num_requests", 1, MAX_TOKENS)
        _in_range(self, "latency", "chunk_configs", 1, 2**20)


ENGINES = tuple(engines.ENGINES)
"""Serving engines a measured profile may name: those ``sweep.cube.engines``
gives flags for."""


@dataclass
class CalibrationProfile:
    """Fitted constants of one hardware x model x engine (``conf/calibration/``)."""

    hardware: str = field(default=MISSING, metadata={"help": "a hardware option name"})
    model: str = field(
        default="", metadata={"help": "a model option name; empty: any model"})
    engine: str = field(default="vllm", metadata={"help": "vllm, sglang or trtllm"})
    mbu: float = field(default=1.0, metadata={"help": "achieved / peak bandwidth"})
    mfu: float = field(default=1.0, metadata={"help": "achieved / peak FLOP/s"})
    step_overhead_s: float = field(
        default=0.0, metadata={"help": "fixed time added to every scheduler step"})
    kv_mbu: float = field(
        default=0.0,
        metadata={"help": "achieved / peak bandwidth of KV-cache reads; 0: mbu"})
    sequence_overhead_s: float = field(
        default=0.0, metadata={"help": "fixed time each sequence adds to a step"})
    source: str = field(default="", metadata={"help": "what was measured, where"})
    version: str = field(default="", metadata={"help": "the source's version"})
    license: str = field(default="", metadata={"help": "the source's license"})
    active_params: float = field(
        default=0.0,
        metadata={"help": "the model's active parameters (the profile of the nearest "
                  "size serves a model without its own); 0: unknown"})
    fitted_points: int = field(
        default=0, metadata={"help": "measured points the constants were fitted to"})
    rms_relative_error: float = field(
        default=0.0, metadata={"help": "root-mean-square relative error of the fit"})

    def __post_init__(self) -> None:
        p = f"calibration.profiles[{self.hardware}/{self.model or '*'}/{self.engine}]"
        _check(self.engine in ENGINES, f"{p}.engine", self.engine,
               f"allowed: {', '.join(ENGINES)}")
        for name in ("mbu", "mfu"):
            _in_range(self, p, name, 1e-3, 1)
        _in_range(self, p, "step_overhead_s", 0, 3600)
        _check_step_shape(self, p)
        _in_range(self, p, "active_params", 0, 1e14)
        _in_range(self, p, "fitted_points", 0, 2**31 - 1)
        _in_range(self, p, "rms_relative_error", 0, 1e6)


@dataclass
class Calibration:
    """Which measured constants scale the roofline bound (``calibration=``).

    ``roofline``: no profile, every hardware keeps its own ``mbu``, ``mfu``
    and ``step_overhead_s`` (the theoretical bound as shipped). Otherwise each
    hardware x model of a run takes the profile of its hardware and
    ``engine`` (the model's own, else the one of the nearest model size), and
    hardware without one keeps its own constants.
    """

    name: str = MISSING
    engine: str = field(
        default="vllm", metadata={"help": "the engine whose profiles apply"})
    profiles: list[CalibrationProfile] = field(default_factory=list)

    def __post_init__(self) -> None:
        _check(self.engine in ENGINES, "calibration.engine", self.engine,
               f"allowed: {', '.join(ENGINES)}")
        keys = [(p.hardware, p.model, p.engine) for p in self.profiles]
        _check(len(set(keys)) == len(keys), f"calibration[{self.name}].profiles",
               len(keys), "one profile per hardware x model x engine")


MAX_MEMORY_HELP = ("refuse a run whose estimated peak memory exceeds this many "
                   "GB; 0: 80 % of this machine's physical memory")


def _check_run_settings(app) -> None:
    """The fields every app has: the seed and the memory budget."""
    _in_range(app, "", "seed", 0, 2**63 - 1)
    _in_range(app, "", "max_memory_gb", 0, 1e9)


@dataclass
class GridApp:
    """Top config of ``sweep-grid``."""

    hardware: Hardware = MISSING
    model: Model = MISSING
    workload: Workload = MISSING
    grid: Grid = field(default_factory=Grid)
    slo: Slo = MISSING
    latency: Latency = field(default_factory=Latency)
    calibration: Calibration = MISSING
    out: str | None = field(
        default=None, metadata={"help": "cube path; default <run dir>/cube.zarr"}
    )
    seed: int = 0
    data_dir: str | None = field(
        default=None,
        metadata={"help": "folder of local copies of the public traces (verified, "
                  "used without download); default $SWEEP_DATA_DIR"},
    )
    max_memory_gb: float = field(default=0.0, metadata={"help": MAX_MEMORY_HELP})
    shard: str | None = field(
        default=None,
        metadata={"help": "K/N: evaluate the K-th of N disjoint block sets into "
                  "the store out= that the N shards share (1 <= K <= N)"},
    )

    def __post_init__(self) -> None:
        _check_run_settings(self)
        self.shards = None  # (K, N) of shard=K/N
        if self.shard is not None:
            k, _, n = str(self.shard).partition("/")
            ok = k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)
            _check(ok, "shard", self.shard,
                   "must be K/N with whole numbers 1 <= K <= N, e.g. shard=2/3")
            _check(bool(self.out), "shard", self.shard,
                   "needs out=PATH, the store the shards share")
            self.shards = (int(k), int(n))


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
    weight_dtype: list[str] = field(
        default_factory=list,
        metadata={"help": f"weight precisions to compare "
                  f"({', '.join(precision.WEIGHT_DTYPES)}); empty: the model's own"})
    kv_dtype: list[str] = field(
        default_factory=list,
        metadata={"help": f"KV cache precisions to compare "
                  f"({', '.join(precision.KV_DTYPES)}); empty: the model's own"})
    spec_tokens: Any = field(
        default_factory=lambda: [0],
        metadata={"help": "speculative decoding: tokens proposed per step (k) to "
                  "compare; 0: off"})
    spec_proposer: list[str] = field(
        default_factory=lambda: ["ngram"],
        metadata={"help": "speculative proposers to compare at each k > 0: ngram, "
                  "draft (the model's draft_model) and/or eagle3 (its EAGLE-3 "
                  "head, model.eagle3_head)"})
    spec_acceptance: Any = field(
        default=0.7,
        metadata={"help": "chance each proposed token is accepted (0-1; measure it "
                  "on the workload: vLLM's spec-decode acceptance metrics): one "
                  "for every proposer, or a list, one per spec_proposer (a "
                  "trained head accepts more than an n-gram lookup)"})
    optimizer: str = field(default="adam", metadata={"help": "an optax alias name"})
    optimizer_options: dict[str, float] = field(
        default_factory=lambda: {"b2": 0.9},
        metadata={"help": "keyword arguments of the optax alias"},
    )
    learning_rate: float = 0.1
    final_learning_rate_fraction: float = field(
        default=0.1, metadata={"help": "cosine decay to this share of the rate"})
    steps: int = field(default=150, metadata={"help": "optimizer steps"})
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
    disaggregated: list[bool] = field(
        default_factory=lambda: [False],
        metadata={"help": "deployments compared: [false] one aggregated engine per "
                  "replica; [false, true] also disaggregated prefill/decode pools "
                  "(P:D ratios enumerated from the roofline, verified by the "
                  "simulator: sweep.search.disaggregate)"})
    disaggregated_max_instances: int = field(
        default=16, metadata={"help": "most prefill (and most decode) instances of "
                              "a disaggregated deployment"})
    rounds: int = field(
        default=4, metadata={"help": "search + simulate rounds (tightening)"})
    tighten_margin: float = field(
        default=0.97, metadata={"help": "extra factor on a tightened target"})
    loosen_margin: float = field(
        default=1.05, metadata={
            "help": "extra factor on a raised target: the simulator's ratio at a "
                    "confirmed answer is not its ratio one replica fewer, so an "
                    "answer the ratio puts this little past the SLO is simulated "
                    "too (1: none)"})

    def __post_init__(self) -> None:
        self.tp_values = _numeric_axis(self.tensor_parallel, "search.tensor_parallel",
                                       integer=True, low=1)
        self.spec_values = _numeric_axis(self.spec_tokens, "search.spec_tokens",
                                         integer=True, low=0, high=64)
        self.proposer_values = _proposer_indices(self.spec_proposer,
                                                 "search.spec_proposer")
        a, count = self.spec_acceptance, len(self.spec_proposer)
        rates = list(a) if isinstance(a, (list, tuple)) else [a] * count
        _check(len(rates) == count
               and all(isinstance(r, (int, float)) and not isinstance(r, bool)
                       and math.isfinite(r) and 0 <= r <= 1 for r in rates),
               "search.spec_acceptance", a,
               f"one number in [0, 1], or one per search.spec_proposer ({count})")
        # each proposer's acceptance
        self.acceptance = dict(zip(self.spec_proposer, map(float, rates)))
        _check_draft_tokens(self, "search", self.spec_values)
        for name, high in (("steps", 100_000), ("restarts", 10_000),
                           ("concurrency_min", MAX_TOKENS),
                           ("concurrency_max", MAX_TOKENS),
                           ("token_budget_min", MAX_TOKENS),
                           ("token_budget_max", MAX_TOKENS),
                           ("levels_per_octave", 64), ("replicas_max", 2**20),
                           ("verify_top", 1_000), ("verify_requests", MAX_TOKENS),
                           ("verify_requests_max", MAX_TOKENS),
                           ("disaggregated_max_instances", 4096),
                           ("rounds", 100)):
            _in_range(self, "search", name, 1, high)
        flags = list(self.disaggregated)
        _check(False in flags and len(set(flags)) == len(flags), "search.disaggregated",
               flags, "allowed: [false] or [false, true] (the aggregated search runs "
               "and is the baseline)")
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
        for name in ("learning_rate", "penalty_weight", "penalty_scale_start",
                     "penalty_scale_end"):
            _in_range(self, "search", name, 1e-9, 1e6)
        for name in ("final_learning_rate_fraction", "gpu_memory_utilization",
                     "tighten_margin"):
            _in_range(self, "search", name, 1e-3, 1)
        _in_range(self, "search", "loosen_margin", 1, 2)
        for group in ("hardware", "model"):
            listed = list(getattr(self, group))
            _check(len(set(listed)) == len(listed), f"search.{group}", listed,
                   "options must be distinct")
        _check_precision_axes(self, "search")

    def verified_requests(self, replicas: int, trace_rows: int = 0) -> int:
        """Requests the verification simulates for a configuration of
        ``replicas`` replicas: ``verify_requests`` per replica and, on a
        trace's recorded arrivals, at least the whole trace (``trace_rows``);
        at most ``verify_requests_max``."""
        return min(max(self.verify_requests * replicas, trace_rows),
                   self.verify_requests_max)


@dataclass
class OptimizeApp:
    """Top config of ``sweep-optimize``."""

    hardware: Hardware = MISSING
    model: Model = MISSING
    workload: Workload = MISSING
    slo: Slo = MISSING
    search: Search = field(default_factory=Search)
    calibration: Calibration = MISSING
    out: str | None = field(
        default=None, metadata={"help": "dataset path; default <run dir>/optimize.zarr"}
    )
    seed: int = 0
    data_dir: str | None = field(
        default=None,
        metadata={"help": "folder of local copies of the public traces (verified, "
                  "used without download); default $SWEEP_DATA_DIR"},
    )
    max_memory_gb: float = field(default=0.0, metadata={"help": MAX_MEMORY_HELP})

    def __post_init__(self) -> None:
        _check_run_settings(self)


@dataclass
class CalibrateFit:
    """``sweep-calibrate``'s optax fit of ``sweep.search.calibrate.CONSTANTS``."""

    steps: int = field(default=1000, metadata={
        "help": "Adam steps (a traced loop count: another count runs the same "
                "compiled program)"})
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
    """Top config of ``sweep-calibrate``: it fits one hardware x model x
    engine at a time to measured step latencies (CSV) and ``vllm bench
    serve`` results (JSON) and writes a ``calibration/<name>.yaml`` config
    (``sweep.cli.calibrate``)."""

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
    fit: CalibrateFit = field(default_factory=CalibrateFit)
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


def tp_splits_heads(model: Model, tp: int) -> bool:
    """Whether vLLM can shard ``model``'s attention over ``tp`` GPUs.

    vLLM requires ``q_heads % tp == 0`` (``ModelConfig.verify_with_parallel_config``)
    and splits the KV heads evenly, or replicates them when there are fewer
    than GPUs, which needs ``kv_heads % tp == 0`` or ``tp % kv_heads == 0``
    (``QKVParallelLinear``, vllm/model_executor/layers/linear.py).
    """
    return model.q_heads % tp == 0 and (model.kv_heads % tp == 0
                                        or tp % model.kv_heads == 0)


def check_tensor_parallel(key: str, sizes, hardware: list[Hardware],
                          models: list[Model]) -> None:
    """Every tensor-parallel size fits in one node and splits every model's heads.

    Raises:
      ConfigError: naming the size, the hardware or model, and the sizes allowed.
    """
    for t in (int(s) for s in sizes):
        for h in hardware:
            _check(t <= h.max_gpus_per_node, key, t,
                   f"more than hardware[{h.name}].max_gpus_per_node = "
                   f"{h.max_gpus_per_node} (tensor parallelism across nodes is not "
                   f"modelled); allowed: <= {h.max_gpus_per_node}")
        for m in models:
            if not tp_splits_heads(m, t):
                top = min(h.max_gpus_per_node for h in hardware)
                ok = [s for s in range(1, top + 1) if tp_splits_heads(m, s)]
                raise ConfigError(
                    f"{key} = {t}: model[{m.name}] has {m.q_heads} query and "
                    f"{m.kv_heads} KV heads, which vLLM cannot split over {t} GPUs "
                    f"(q_heads divisible by TP; kv_heads divisible by TP or TP by "
                    f"kv_heads); allowed: {', '.join(map(str, ok))}")
