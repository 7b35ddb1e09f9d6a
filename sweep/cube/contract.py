"""The cube contract, declared once: every axis and every variable a result holds.

Each axis of a cube is an ``Axis`` and each variable a ``Metric``, with its
name (SPEC.md's, which is the contract), units, ``long_name`` and what the
code around it needs to know: which part of the cube it spans, its role in
an analysis, its summary-table column. Everything else is built from these
declarations (the idea of xarray-simlab's declare-once variables and of
diffrax's ``RESULTS``):

* the cube's template, dims order, dtypes and attributes (``sweep.cube.results``,
  ``sweep.grid.job``, ``sweep.latency.p99``), and the plan's disk estimate;
* the point functions' arguments, which are named by axis (``sweep.model.point``,
  ``sweep.latency.p99``): no code depends on the position of an axis but the cube's
  layout itself, which is the order of ``AXES``;
* the schema's numeric grid axes and their ranges (``sweep.config.schema``);
* the analysis roles, SLO fields and vLLM flags of ``ds.sweep``
  (``sweep.cube.accessor``), the summary table (``sweep.cube.summary``);
* the optimizer's dataset (``sweep.search.optimize.to_dataset``) and the surrogate
  outputs the search keeps (``sweep.search.descent.METRICS``).

Adding a metric: one ``Metric`` below, and the code that computes it (the
point function of its part returns it under its name or ``source``); a
latency percentile (``latency=True``) comes from both latency models, and the
optimizer keeps and reports it for each. Adding a numeric axis: one ``Axis``
below (its place is its place in the cube), a field of the same name in the
schema's ``Grid`` (the values a user sweeps), and the code that uses it: a
``GridPoint`` field of the same name for the roofline, a keyword argument of
the p99 point functions for the latency part.

Units are written so that pint parses them (``unit_registry``) once the few
counting units and the currency below are defined (``UNIT_DEFINITIONS``,
stored in every cube as the ``unit_definitions`` attribute). ``"1"`` is
dimensionless; a label axis or a flag variable has no units (CF).
"""

from __future__ import annotations

from dataclasses import dataclass

from sweep.cube import status

ROOFLINE = "roofline"
"""The part of a cube evaluated by ``sweep.model.point`` over the roofline axes."""
P99 = "p99"
"""The part evaluated by the simulator or the surrogate over the latency axes."""
OPTIMIZE = "optimize"
"""Variables of ``sweep-optimize``'s dataset only (not a cube part)."""

PLATFORM, CONFIG, SCENARIO = "platform", "config", "scenario"
"""Axis roles: what runs (hardware, model); what an operator chooses for it
(the serving settings, optimised over by analyses); the situation (fixed by
analyses, one table row or chart per value)."""

LABEL, INTEGER, REAL = "label", "integer", "real"
"""Axis kinds: names (strings), integer counts (int64 coordinates), reals."""

CONVENTIONS = "CF-1.11"

UNIT_DEFINITIONS = (
    "token = [token]",
    "request = [request]",
    "sequence = request",  # a request while it runs (vLLM's max_num_seqs)
    "step = [step]",  # one scheduler step
    "GPU = [GPU]",
    "replica = [replica]",
    "USD = [currency]",
    "billing_month = 730 * hour",  # SPEC: a month is 730 hours
)
"""pint definitions of the units the cube uses beyond SI (one per line)."""


@dataclass(frozen=True)
class Axis:
    """One sweep axis: a cube dimension and its coordinate."""

    name: str
    units: str  # "" for a label axis
    long_name: str
    role: str  # PLATFORM, CONFIG or SCENARIO ("": not a cube axis)
    kind: str  # LABEL, INTEGER or REAL
    parts: tuple[str, ...] = (ROOFLINE, P99)  # the parts whose dims include it
    header: str = ""  # its column in the summary table
    low: float = 1.0  # numeric axes: the values the schema allows
    high: float | None = None  # None: the schema's token ceiling
    optional: bool = False  # may be left empty (each workload's own value)
    affects: tuple[str, ...] = ()  # the only metrics it changes; (): any

    def attrs(self) -> dict[str, str]:
        return _attrs(self.units, self.long_name)


SPEED, COST = "speed", "cost"
"""Summary-table sections, shown in this order (each in declaration order)."""


@dataclass(frozen=True)
class Column:
    """How a summary table shows a metric: ``fmt.format(value * scale)``."""

    header: str
    fmt: str
    scale: float = 1.0
    section: str = SPEED

    def format(self, value) -> str:
        return self.fmt.format(float(value) * self.scale)


@dataclass(frozen=True)
class Metric:
    """One variable: its name, units and where it lives.

    ``over``: a part (``ROOFLINE``, ``P99``: on that part's dims), an axis
    name or a tuple of them (a property of each of their values, e.g. a
    hardware's price, a model's weights at a precision), or ``OPTIMIZE``.
    """

    name: str
    units: str  # "" for a flag variable or an index
    long_name: str
    over: str | tuple[str, ...] = ROOFLINE
    dtype: str = "float32"  # "bool", "int32", "float64"
    source: str = ""  # the producing function's key, when not ``name``
    latency: bool = False  # a latency percentile both latency models give
    slo: bool = False  # an SLO limit of ``conf/slo`` bounds it
    flags: bool = False  # a ``sweep.cube.status`` bit mask (CF flag attributes)
    column: Column | None = None  # shown in the summary table
    # a variable only the cubes that ask for it hold (``grid.<option>=true``)
    option: str = ""

    @property
    def key(self) -> str:
        """The key the producing function returns it under."""
        return self.source or self.name

    def attrs(self) -> dict:
        out = _attrs(self.units, self.long_name)
        if self.flags:
            out.update(status.cf_attrs())
        return out


def _attrs(units: str, long_name: str) -> dict[str, str]:
    return {**({"units": units} if units else {}), "long_name": long_name}


SENSITIVITY: tuple[tuple[str, str], ...] = (
    ("memory_bandwidth_bytes_per_s", "memory bandwidth"),
    ("peak_flops_per_s", "peak FLOP/s (every tensor-core rate: BF16, FP8, FP4)"),
    ("interconnect_bytes_per_s", "interconnect bandwidth"),
    ("mbu", "the weights' memory bandwidth utilisation (mbu)"),
    ("kv_mbu", "the KV cache's memory bandwidth utilisation (kv_mbu)"),
    ("mfu", "FLOP/s utilisation (mfu)"),
    ("step_overhead_s", "the fixed time per step (step_overhead_s)"),
    ("sequence_overhead_s", "the fixed time per sequence in a step "
     "(sequence_overhead_s)"),
)
"""The hardware and calibration constants whose elasticities a cube carries
with ``grid.sensitivity=true`` (``sweep.model.sensitivity``): each roofline
point the cost's, ``d_cost_d_<name>`` = d ln ``cost_per_mtok_out_usd`` / d ln
constant; each point of a surrogate p99 part the p99 TTFT's and ITL's,
``d_ttft_p99_d_<name>`` and ``d_itl_p99_d_<name>``. -0.9 means 10 % more of
it cuts the figure by about 9 %, 0 that the figure does not depend on it
there (an overhead that is 0 has elasticity 0). The price is left out: cost
is proportional to ``usd_per_gpu_hour`` (elasticity exactly 1) and latency
does not depend on it."""
SENSITIVITY_OPTION = "sensitivity"
"""The ``option`` of the elasticities: ``grid.sensitivity=true``."""
SENSITIVITY_OF = {"cost_per_mtok_out_usd": "cost", "ttft_p99_s": "ttft_p99",
                  "itl_p99_s": "itl_p99"}
"""The figures with elasticities, and their short names in the variables'."""


DISAGGREGATION_OPTION = "disaggregation"
"""The ``option`` of the disaggregated deployment's own variables: a cube
holds them when ``grid.disaggregated`` lists true."""


def sensitivity(param: str, of: str = "cost_per_mtok_out_usd") -> str:
    """The cube variable holding the elasticity of the figure ``of`` to
    ``param``."""
    return f"d_{SENSITIVITY_OF[of]}_d_{param}"


AXES: tuple[Axis, ...] = (
    Axis("hardware", "", "hardware", PLATFORM, LABEL, header="hardware"),
    Axis("model", "", "model", PLATFORM, LABEL, header="model"),
    Axis("workload", "", "workload", SCENARIO, LABEL, header="workload"),
    Axis("tensor_parallel", "GPU", "tensor-parallel GPUs", CONFIG, INTEGER,
         header="TP"),
    Axis("concurrency", "sequence", "concurrency (max_num_seqs)", CONFIG, INTEGER,
         header="conc."),
    Axis("token_budget", "token", "token budget (max_num_batched_tokens)", CONFIG,
         INTEGER, header="budget tok"),
    Axis("context_tokens", "token", "mean context", SCENARIO, INTEGER,
         parts=(ROOFLINE,), header="context tok"),
    Axis("batching", "", "batching", CONFIG, LABEL, header="batching"),
    Axis("long_prompt_tokens", "token", "long prompt length", SCENARIO, INTEGER,
         parts=(ROOFLINE,), header="long prompt tok",
         affects=("long_prefill_s", "long_prefill_steps", "long_prefill_worst_itl_s")),
    Axis("traffic_tokens_per_day", "token / day", "output traffic", SCENARIO, REAL,
         parts=(ROOFLINE,), header="tok/day", low=1e-6, high=1e18),
    Axis("weight_dtype", "", "weight precision (with group scales)", CONFIG, LABEL,
         header="weights"),
    Axis("kv_dtype", "", "KV cache precision", CONFIG, LABEL, header="KV"),
    # speculative decoding (sweep.model.roofline.speculative_step_s; the
    # simulator's and the surrogate's decode steps); k = 0: off
    Axis("spec_tokens", "token", "speculative tokens proposed per step (k)", CONFIG,
         INTEGER, header="spec k", low=0, high=64),
    Axis("spec_acceptance", "1", "speculative acceptance rate per token", CONFIG,
         REAL, header="accept", low=0, high=1),
    # who proposes them (sweep.model.roofline.PROPOSERS): 0 an n-gram lookup,
    # 1 the model's draft model, 2 its EAGLE-3 head (their passes and memory
    # counted)
    Axis("spec_proposer", "1",
         "speculative proposer (0 n-gram, 1 draft model, 2 EAGLE-3 head)",
         CONFIG, INTEGER, header="proposer", low=0, high=2),
    # automatic prefix caching (sweep.model.roofline.cached_prefix_tokens):
    # 0 off, 1 on at each workload's prefix_hit_fraction
    Axis("prefix_caching", "1", "prefix caching (0 off, 1 on)", CONFIG, INTEGER,
         header="prefix cache", low=0, high=1,
         affects=("prefix_hit_fraction", "prefill_tokens_per_s",
                  "cost_per_mtok_in_usd", "long_prefill_s", "long_prefill_steps",
                  "long_prefill_worst_itl_s")),
    # disaggregated prefill/decode (sweep.model.point.disaggregated_figures):
    # 0 one aggregated engine, 1 prefill_instances prefill-only instances of
    # prefill_tensor_parallel GPUs and decode_instances decode-only instances
    # of tensor_parallel GPUs
    Axis("disaggregated", "1", "disaggregated prefill/decode (0 aggregated, 1 "
         "separate prefill and decode instances)", CONFIG, INTEGER,
         header="disagg.", low=0, high=1),
    Axis("prefill_instances", "replica", "prefill instances (disaggregated)", CONFIG,
         INTEGER, header="P inst.", low=1, high=4096),
    Axis("decode_instances", "replica", "decode instances (disaggregated)", CONFIG,
         INTEGER, header="D inst.", low=1, high=4096),
    # the prefill instances' own tensor parallelism; 0: the point's
    # tensor_parallel (the decode instances always take the point's)
    Axis("prefill_tensor_parallel", "GPU", "prefill instances' tensor-parallel GPUs "
         "(disaggregated; 0: tensor_parallel)", CONFIG, INTEGER, header="P TP",
         low=0, high=1024),
    Axis("arrival_rate_per_s", "request / s", "arrival rate", SCENARIO, REAL,
         parts=(P99,), header="req/s", low=1e-9, high=1e12, optional=True),
)
"""Every sweep axis, in the cube's order (SPEC.md's names)."""

METRICS: tuple[Metric, ...] = (
    # the roofline part (sweep.model.point)
    Metric("step_s", "s", "decode step time (ITL)",
           column=Column("ITL ms", "{:.2f}", 1e3)),
    Metric("tokens_per_step", "token / step", "tokens each sequence gains per "
           "decode step (1 without speculation)"),
    Metric("tpot_s", "s", "time per output token (step_s / tokens_per_step: "
           "vLLM bench's TPOT)"),
    Metric("user_tokens_per_s", "token / s", "per-user decode rate",
           column=Column("tok/s/user", "{:,.0f}")),
    Metric("output_tokens_per_s", "token / s", "replica output rate"),
    Metric("slot_utilization", "1", "batch slot utilisation"),
    Metric("cost_per_mtok_out_usd", "USD / Mtoken", "cost per 1M output tokens",
           column=Column("USD/1M out", "{:.3f}", section=COST)),
    Metric("prefix_hit_fraction", "1", "share of the mean prompt read from the "
           "prefix cache (whole 16-token blocks; 0 without prefix caching)"),
    Metric("prefill_tokens_per_s", "token / s", "prefill rate of one engine (a "
           "disaggregated point's prefill instance; input tokens, cached ones "
           "included)"),
    # the GPUs that prefill pay for the input tokens: a disaggregated
    # point's prefill instance
    Metric("cost_per_mtok_in_usd", "USD / Mtoken", "cost per 1M input tokens"),
    Metric("long_prefill_s", "s", "long-prompt prefill time"),
    Metric("long_prefill_steps", "step", "long-prompt prefill steps"),
    Metric("long_prefill_worst_itl_s", "s", "worst ITL during long prefill"),
    Metric("replicas", "replica", "replicas for the traffic",
           column=Column("replicas", "{:,.0f}", section=COST)),
    Metric("effective_cost_per_mtok_out_usd", "USD / Mtoken",
           "cost per 1M output tokens at the traffic"),
    Metric("kv_fits", "1", "KV cache fits in memory", dtype="bool"),
    Metric("max_concurrency_fit", "sequence", "largest concurrency that fits",
           column=Column("max conc.", "{:,.0f}", section=COST)),
    # with grid.disaggregated listing true (sweep.model.point)
    Metric("gpus", "GPU", "GPUs of one deployment (tensor_parallel, or "
           "tensor_parallel x (prefill + decode instances) disaggregated)",
           option=DISAGGREGATION_OPTION),
    Metric("kv_transfer_s", "s", "KV transfer of the mean prompt from a prefill "
           "to a decode instance (0 aggregated)", option=DISAGGREGATION_OPTION),
    Metric("zero_load_ttft_s", "s", "TTFT of the mean prompt alone: its chunked "
           "prefill at the token budget, plus the KV transfer disaggregated (the part "
           "after the prefill: all of it, or with hardware.kv_transfer_layerwise "
           "max(T - S (L - 1) / L, T / L))",
           option=DISAGGREGATION_OPTION),
    Metric("prefill_pool_req_per_s", "request / s", "requests per second the "
           "prefill instances sustain (NaN aggregated)",
           option=DISAGGREGATION_OPTION),
    Metric("decode_pool_req_per_s", "request / s", "requests per second the "
           "decode instances sustain (NaN aggregated)", option=DISAGGREGATION_OPTION),
    *(Metric(sensitivity(p), "1", f"elasticity of cost per 1M output tokens to "
             f"{what} (d ln cost / d ln {p})", option=SENSITIVITY_OPTION)
      for p, what in SENSITIVITY),
    # the p99 part (sweep.latency.p99: the simulator or the surrogate)
    Metric("ttft_p50_s", "s", "p50 time to first token", P99, latency=True),
    Metric("ttft_p99_s", "s", "p99 time to first token", P99, latency=True, slo=True,
           column=Column("p99 TTFT s", "{:.3f}")),
    Metric("itl_p50_s", "s", "p50 inter-token latency", P99, latency=True),
    Metric("itl_p99_s", "s", "p99 inter-token latency", P99, latency=True, slo=True,
           column=Column("p99 ITL ms", "{:.2f}", 1e3)),
    Metric("e2e_p50_s", "s", "p50 end-to-end latency", P99, latency=True),
    Metric("e2e_p99_s", "s", "p99 end-to-end latency", P99, latency=True),
    Metric("achieved_output_tokens_per_s", "token / s", "achieved output rate", P99,
           source="output_tokens_per_s"),
    Metric("goodput_req_per_s", "request / s", "requests meeting the SLO per second",
           P99),
    Metric("rejected_fraction", "1", "share of requests rejected (prompt + output "
           "above the model's max_context_tokens)", P99),
    Metric("slo_met", "1", "p99 TTFT and ITL within the SLO, rejected share within "
           "slo.max_rejected_fraction", P99, dtype="bool"),
    Metric("latency_status", "", "latency model status flags (0 = ok)", P99,
           dtype="int32", source="status", flags=True),
    # with grid.sensitivity=true under latency=surrogate (sweep.latency.p99)
    *(Metric(sensitivity(p, of), "1", f"elasticity of {long} to {what} "
             f"(d ln {of} / d ln {p})", P99, option=SENSITIVITY_OPTION)
      for of, long in (("ttft_p99_s", "p99 TTFT"), ("itl_p99_s", "p99 ITL"))
      for p, what in SENSITIVITY),
    # properties of each value of an axis, from its config (sweep.grid.job)
    Metric("usd_per_gpu_hour", "USD / GPU / hour", "price per GPU-hour", "hardware",
           dtype="float64"),
    Metric("memory_bytes", "byte", "memory per GPU", "hardware", dtype="float64"),
    Metric("weight_bytes", "byte", "weights", ("model", "weight_dtype"),
           dtype="float64"),
    Metric("kv_bytes_per_token", "byte / token", "KV cache per token",
           ("model", "kv_dtype"), dtype="float64"),
    Metric("mean_prompt_tokens", "token", "mean prompt length", "workload",
           dtype="float64"),
    Metric("mean_output_tokens", "token", "mean output length", "workload",
           dtype="float64"),
    # sweep-optimize's dataset only (sweep.search.optimize)
    Metric("round", "", "search round", OPTIMIZE),
    Metric("simulated_requests", "request", "requests simulated (all replicas)",
           OPTIMIZE, dtype="int32"),
    Metric("meets_targets", "1", "meets the surrogate targets", OPTIMIZE,
           dtype="bool"),
    Metric("verified", "1", "simulated", OPTIMIZE, dtype="bool"),
    Metric("slo_met_simulated", "1", "simulated p99s within the SLO", OPTIMIZE,
           dtype="bool"),
    Metric("chosen", "1", "the chosen candidate", OPTIMIZE, dtype="bool"),
    Metric("cost_per_month_usd", "USD / billing_month", "cost per month (730 h)",
           OPTIMIZE),
    Metric("utilization", "1", "offered load / sustainable load (surrogate)",
           OPTIMIZE),
    Metric("ttft_target_s", "s", "surrogate target for p99 TTFT (tightened)",
           OPTIMIZE),
    Metric("itl_target_s", "s", "surrogate target for p99 ITL (tightened)", OPTIMIZE),
    Metric("ttft_slack_s", "s", "slo.ttft_p99_s - p99 TTFT (simulated if verified)",
           OPTIMIZE),
    Metric("itl_slack_s", "s", "slo.itl_p99_s - p99 ITL (simulated if verified)",
           OPTIMIZE),
    Metric("pareto_itl", "1", "on the cost vs p99 ITL Pareto front", OPTIMIZE,
           dtype="bool"),
    Metric("pareto_ttft", "1", "on the cost vs p99 TTFT Pareto front", OPTIMIZE,
           dtype="bool"),
)
"""Every variable of a cube or of the optimizer's dataset (SPEC.md's names)."""

OPTIMIZE_AXES: tuple[Axis, ...] = (
    Axis("candidate", "", "candidate (hardware x model x tensor parallelism)",
         "", INTEGER, parts=(OPTIMIZE,)),
    Axis("config", "", "integer configuration meeting the targets", "", INTEGER,
         parts=(OPTIMIZE,)),
    Axis("verification", "", "simulation, in order", "", INTEGER,
         parts=(OPTIMIZE,)),
    Axis("disaggregated_verification", "", "simulation of a disaggregated "
         "deployment, in order", "", INTEGER, parts=(OPTIMIZE,)),
)
"""The dims of ``sweep-optimize``'s dataset."""

AXIS: dict[str, Axis] = {a.name: a for a in AXES + OPTIMIZE_AXES}
METRIC: dict[str, Metric] = {m.name: m for m in METRICS}


def dims(part: str) -> tuple[str, ...]:
    """The dims of a part of the cube, in the cube's order."""
    return tuple(a.name for a in AXES if part in a.parts)


def metrics(over: str, options: frozenset[str] = frozenset()) -> tuple[Metric, ...]:
    """The variables of one part (or over one axis), in declaration order,
    those of an ``option`` only when ``options`` has it."""
    return tuple(m for m in METRICS
                 if m.over == over and (not m.option or m.option in options))


def names(items) -> tuple[str, ...]:
    return tuple(x.name for x in items)


def attrs(name: str) -> dict:
    """The attributes of any declared axis or variable."""
    return (AXIS[name] if name in AXIS else METRIC[name]).attrs()


def role(r: str) -> tuple[str, ...]:
    """The cube axes of one role, in the cube's order."""
    return tuple(a.name for a in AXES if a.role == r)


LATENCY = names(m for m in METRICS if m.latency)
"""The latency percentiles both latency models give (the optimizer reports each
model's)."""
SLO = names(m for m in METRICS if m.slo)
"""The metrics an SLO bounds (the fields of ``conf/slo``)."""


def unit_registry():
    """A pint ``UnitRegistry`` that parses every ``units`` attribute of a cube.

    pint is not a dependency of the package: install it to use this.
    """
    import pint

    registry = pint.UnitRegistry()
    for line in UNIT_DEFINITIONS:
        registry.define(line)
    return registry
