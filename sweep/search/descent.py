"""The optax search: cheapest replicas x concurrency x token budget under an SLO.

For each discrete candidate (hardware x model x tensor parallelism) the search
chooses three numbers: the concurrency ``c`` (vLLM ``--max-num-seqs``), the
token budget ``b`` (``--max-num-batched-tokens``) and the number of replicas
``r``; the workload's arrival rate ``lam`` is split evenly over the replicas
(``replica_surrogate``: a random split of a Poisson stream is Poisson at
``lam / r``, round-robin dealing gives each replica Erlang-``r`` gaps at that
rate, ``search.routing``). Cost per 1M
output tokens is ``r * tp * usd_per_gpu_hour / (lam * E[O] * 3600) * 1e6``
(``sweep.model.cost.cost_per_mtok_usd``): it depends on ``r`` only, and ``c`` and
``b`` decide at how few replicas the SLO still holds.

**Relaxation.** ``theta = (log c, log b, log r)`` is continuous and kept in a
box by ``optax.projections.projection_box`` after every update. The objective
is

    log r + w * sum_k s * softplus(log(p99_k / target_k) / s)

over ``k`` in {TTFT, ITL}, with the p99s from the analytic surrogate
(``sweep.latency.surrogate.surrogate``), which is smooth in ``c``, ``b`` and the rate.
Both terms are in log units, so one weight ``w`` serves every workload and
price: at the optimum the penalty's slope balances the cost's slope of 1.
This is a smooth exterior barrier rather than an augmented Lagrangian: the
rounding stage below re-establishes exact feasibility, so the continuous
answer only has to land in the right basin, and a barrier needs no
multiplier updates inside the scan. Its temperature ``s`` is annealed
geometrically from ``penalty_scale_start`` to ``penalty_scale_end``
(continuation: a wide barrier first, so that far-infeasible starts feel a
gradient, a sharp one at the end). The learning rate follows a cosine decay
(``optax.cosine_decay_schedule``).

**Integer stage.** The final ``c`` and ``b`` are rounded down and up on a
geometric lattice (``levels_per_octave`` values per doubling,
``round(min * 2**(k / L))``), the four neighbours kept, ``b`` raised to ``c``
where lower (vLLM requires ``max_num_batched_tokens >= max_num_seqs``), and for
each the fewest integer replicas meeting both targets with the surrogate is
found by bisection on ``[1, replicas_max]`` (the p99s fall as replicas are
added: less load per replica). A neighbour infeasible even at
``replicas_max`` records its p99s there: the best the candidate reaches, used
to name the binding constraint of an infeasible SLO.

**One compiled call.** The steps run in one ``lax.fori_loop`` whose step is
``vmap``-ped over every lane (a stacked candidate from one of its random
restarts). The integer stage runs as further
steps of the *same* loop (the step's query point is the iterate during the
search, a lattice neighbour afterwards), so the surrogate and its gradient
are traced once: on a CPU, compiling the surrogate dominates the run time.
The settings' numbers (steps, replicas, the lattices, the learning rates
and the barrier's temperatures, its weight, the routing) enter as arrays
(``Knobs``), padded to a few lengths, and the lanes to a few counts: the
program depends only on the optimizer, the lane count and the candidates'
shapes, so changing a number compiles nothing new.

Reference: Nocedal & Wright, *Numerical Optimization* (2nd ed., 2006),
ch. 17 (penalty and continuation methods).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sweep import exported, shapes
from sweep.config.schema import Routing
from sweep.cube import contract
from sweep.cube.status import OK
from sweep.latency.surrogate import LatencyWorkload, surrogate
from sweep.model._numerics import computed_once, softplus
from sweep.model.params import HardwareParams, ModelParams

if TYPE_CHECKING:
    from sweep.config.schema import Search

NEIGHBOURS = 4
"""Lattice neighbours of a continuous answer: (c down/up) x (b down/up)."""

METRICS = (*contract.LATENCY, "utilization")
"""Surrogate outputs kept for every evaluated integer configuration."""

REACH = (*METRICS, "achieved_req_per_s")
"""Surrogate outputs kept at ``replicas_max`` (each lattice neighbour's first
query), met or not: the best a configuration reaches, and a search held
there (``at_replicas``) gives every number of its neighbours. Past a
replica's capacity its achieved rate is that capacity, where the
utilization, a residence time over the slots, grows with the queue."""

PAD = 8
"""Candidates are stacked in multiples of this: fewer distinct shapes to compile."""

LANES_MIN = 16
"""The least lanes (candidates x restarts, padded to ``shapes.bucket``: at
most a third more) of a compiled search: the quick search of up to 8
candidates and 2 restarts and a search of 2 candidates and 4 restarts run
one program."""

LOOP_MIN = 256
"""The least loop length (search and integer steps, padded to a power of
two) of the per-step arrays: every search of up to 256 steps in all (the
shipped ones: ``search=quick`` 108, the default 182) runs one program."""

LATTICE_MIN = 64
"""The least lattice length (padded to a power of two): the shipped
lattices have 41 and 25 values."""


class Candidates(NamedTuple):
    """The discrete choices, stacked along axis 0 (leaves of shape ``(C,)``)."""

    hw: HardwareParams
    model: ModelParams
    workload: LatencyWorkload  # leaves (C,) or (C, J)
    tp: jax.Array  # tensor-parallel GPUs per replica
    arrival_rate_per_s: jax.Array  # the whole workload's rate, over all replicas
    ttft_target_s: jax.Array  # surrogate target for p99 TTFT (<= the SLO)
    itl_target_s: jax.Array  # surrogate target for p99 ITL (<= the SLO)
    spec_tokens: jax.Array  # speculative proposals per step (0: off)
    spec_acceptance: jax.Array  # chance each is accepted
    # share of each prompt in the prefix cache (the workload's; 0: no caching)
    prefix_hit_fraction: jax.Array


def _frozen(value) -> Hashable:
    """``value`` with its lists and dicts as tuples (dict items sorted)."""
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return tuple(_frozen(v) for v in value)
    return value


@dataclass(frozen=True)
class Settings:
    """Search settings: the ``search`` config group, frozen.

    ``sweep.config.schema.Search`` declares the fields, their defaults and
    their checks; ``Settings.of(config)`` keeps a copy of a validated config's
    values (lists and dicts as tuples) that reads as the config does
    (``settings.steps``) and is hashable. The compiled search keys on its
    ``program`` (the optimizer and its options); the numbers are its
    ``knobs``.
    """

    values: tuple[tuple[str, Hashable], ...]

    @classmethod
    def of(cls, config: Search) -> Settings:
        """The settings of a validated ``search`` config."""
        return cls(tuple((f.name, _frozen(getattr(config, f.name)))
                         for f in dataclasses.fields(config)))

    def __getattr__(self, name: str):
        # only reached for names that are not attributes: the config's fields
        for key, value in self.__dict__.get("values", ()):
            if key == name:
                return value
        raise AttributeError(f"search settings have no field {name!r}")

    @property
    def concurrency_values(self) -> np.ndarray:
        return lattice(self.concurrency_min, self.concurrency_max,
                       self.levels_per_octave)

    @property
    def token_budget_values(self) -> np.ndarray:
        return lattice(self.token_budget_min, self.token_budget_max,
                       self.levels_per_octave)

    @property
    def bisect_steps(self) -> int:
        """Halvings that take ``[0, replicas_max]`` to one integer."""
        return max(1, math.ceil(math.log2(self.replicas_max)))

    @property
    def integer_steps(self) -> int:
        """Loop steps of the integer stage (evaluations per restart)."""
        return integer_steps(self.bisect_steps)

    @property
    def loop_length(self) -> int:
        """Length of the per-step arrays: at least the steps in all."""
        return shapes.power_of_two(self.steps + self.integer_steps, LOOP_MIN)

    @property
    def program(self) -> dict:
        """What the compiled search depends on besides its arguments' shapes."""
        return {"optimizer": self.optimizer, "options": self.optimizer_options}

    def replaced(self, **changes) -> Settings:
        """These settings with some fields (``changes``) set otherwise."""
        return Settings(tuple((k, changes.get(k, v)) for k, v in self.values))

    def knobs(self, loop_length: int | None = None) -> Knobs:
        """The numbers of these settings as the compiled search reads them
        (per-step arrays of ``loop_length`` entries; default: their own)."""
        length = shapes.power_of_two(max(len(self.concurrency_values),
                                         len(self.token_budget_values)), LATTICE_MIN)
        loop_length = loop_length or self.loop_length

        def padded(values, n):  # the last value repeated: clipping reads it
            values = np.asarray(values, np.float32)
            return np.concatenate([values, np.repeat(values[-1:], n - len(values))])

        schedule = optax.cosine_decay_schedule(
            self.learning_rate, self.steps, alpha=self.final_learning_rate_fraction)
        with jax.numpy_dtype_promotion("standard"):  # optax mixes int and float
            rates = np.asarray(schedule(np.arange(self.steps, dtype=np.int32)))
        return Knobs(
            steps=np.int32(self.steps), bisect_steps=np.int32(self.bisect_steps),
            replicas_max=np.int32(self.replicas_max),
            learning_rate=padded(rates, loop_length),
            penalty_scale=padded(_penalty_scales(self), loop_length),
            penalty_weight=np.float32(self.penalty_weight),
            round_robin=np.bool_(self.routing == Routing.round_robin),
            concurrency=padded(self.concurrency_values, length),
            token_budget=padded(self.token_budget_values, length),
            levels=np.float32(self.levels_per_octave),
            lower=np.asarray(self.lower, np.float32),
            upper=np.asarray(self.upper, np.float32))

    @property
    def lower(self) -> np.ndarray:
        """Box of ``theta = (log c, log b, log r)``, lower corner."""
        return np.log([self.concurrency_values[0], self.token_budget_values[0], 1.0])

    @property
    def upper(self) -> np.ndarray:
        return np.log([self.concurrency_values[-1], self.token_budget_values[-1],
                       float(self.replicas_max)])


class Knobs(NamedTuple):
    """The settings' numbers, traced (``Settings.knobs``); per-step arrays
    have ``Settings.loop_length`` entries, lattices a padded length."""

    steps: jax.Array  # int32: optimizer steps
    bisect_steps: jax.Array  # int32: halvings of [0, replicas_max]
    replicas_max: jax.Array  # int32
    learning_rate: jax.Array  # (T,) at each optimizer step (cosine decay)
    penalty_scale: jax.Array  # (T,) the barrier's temperature at each step
    penalty_weight: jax.Array
    round_robin: jax.Array  # bool: the routing
    concurrency: jax.Array  # (K,) lattice, its last value repeated
    token_budget: jax.Array  # (K,)
    levels: jax.Array  # lattice values per octave
    lower: jax.Array  # (3,) box of theta
    upper: jax.Array  # (3,)


def integer_steps(bisect_steps):
    """Loop steps of the integer stage: each lattice neighbour's first query
    and its halvings (an int, or a traced one)."""
    return NEIGHBOURS * (1 + bisect_steps)


def lattice(vmin: float, vmax: float, levels_per_octave: int) -> np.ndarray:
    """``round(vmin * 2**(k / L))`` for ``k = 0 .. K``, the last ``<= vmax``.

    Small values repeat (``round(2**0.25) = 1``); that is harmless for
    neighbours and ``np.unique`` gives the distinct ones.
    """
    top = math.floor(levels_per_octave * math.log2(vmax / vmin) + 1e-9)
    return np.round(vmin * 2.0 ** (np.arange(top + 1) / levels_per_octave))


class SearchResult(NamedTuple):
    """Per candidate ``C``, restart ``R`` and lattice neighbour ``N = 4`` (NumPy)."""

    theta: np.ndarray  # (C, R, 3) final continuous (log c, log b, log r)
    objective: np.ndarray  # (C, R, steps) objective along the search
    max_abs_grad: np.ndarray  # (C, R) largest gradient entry seen in the search
    nonfinite_steps: np.ndarray  # (C, R) search steps whose gradient was not finite
    feasible: np.ndarray  # (C, R, N) bool: meets both targets at <= replicas_max
    concurrency: np.ndarray  # (C, R, N)
    token_budget: np.ndarray  # (C, R, N)
    replicas: np.ndarray  # (C, R, N) fewest meeting the targets (replicas_max if none)
    metrics: dict[str, np.ndarray]  # METRICS at those replicas, each (C, R, N)
    reach: dict[str, np.ndarray]  # REACH at replicas_max, each (C, R, N)
    evaluations: int  # surrogate value-and-gradient evaluations in all


def replica_surrogate(cand: Candidates, c, b, r, round_robin):
    """The surrogate's outputs for one of ``r`` replicas at concurrency ``c``
    and token budget ``b``, the workload's rate split evenly over them.

    A round-robin balancer hands each replica every ``r``-th request of the
    Poisson stream: Erlang-``r`` gaps, squared coefficient of variation
    ``1 / r``, as the verification deals them
    (``sweep.latency.arrivals.route``); a random split leaves each
    replica's stream Poisson. On a trace's recorded arrivals a replica reads
    the trace's tables of its split and routing. Both are the surrogate's
    ``split``, ``random_split``. ``round_robin``: a bool, or a traced one.
    """
    return surrogate(cand.hw, cand.model, cand.workload, cand.tp, c, b,
                     cand.arrival_rate_per_s / r, spec_tokens=cand.spec_tokens,
                     spec_acceptance=cand.spec_acceptance,
                     prefix_hit_fraction=cand.prefix_hit_fraction,
                     split=r, random_split=jnp.logical_not(round_robin))


def objective(theta, cand: Candidates, penalty_scale, penalty_weight,
              round_robin: bool):
    """Relaxed cost of one candidate at ``theta = (log c, log b, log r)``.

    Returns:
      ``(value, surrogate outputs)``; the value is ``log r`` plus the SLO
      penalty (the cost's constant factor does not move the optimum).
    """
    c, b, r = jnp.exp(theta[0]), jnp.exp(theta[1]), jnp.exp(theta[2])
    out = replica_surrogate(cand, c, b, r, round_robin)

    def over(p99, target):
        # log of the ratio, floored so that a zero p99 cannot reach log(0)
        return jnp.log(jnp.maximum(p99, 1e-12) / target)

    penalty = (softplus(over(out["ttft_p99_s"], cand.ttft_target_s), penalty_scale)
               + softplus(over(out["itl_p99_s"], cand.itl_target_s), penalty_scale))
    return theta[2] + penalty_weight * penalty, out


def make_optimizer(optimizer: str, options,
                   learning_rate) -> optax.GradientTransformation:
    """The optax alias ``optimizer`` with ``options`` (pairs) whose learning
    rate at step ``count`` is ``learning_rate[count]`` (``Knobs``: a cosine
    decay, ``optax.cosine_decay_schedule``).

    Adam's default ``b2 = 0.999`` remembers the huge gradients of an
    infeasible start for ~1,000 steps and then barely moves ``c`` and ``b``
    once the penalty is small; the shipped ``b2 = 0.9`` forgets them in ~10.
    """
    alias = getattr(optax, optimizer)
    return alias(learning_rate=lambda count: learning_rate[count], **dict(options))


class _Carry(NamedTuple):
    theta: jax.Array  # (3,)
    opt_state: optax.OptState
    lo: jax.Array  # int32, bisection: largest replicas known to miss
    hi: jax.Array  # int32, bisection: fewest replicas known to meet
    feasible: jax.Array  # (N,) bool
    replicas: jax.Array  # (N,) int32
    concurrency: jax.Array  # (N,)
    token_budget: jax.Array  # (N,)
    metrics: dict  # METRICS -> (N,)
    reach: dict  # REACH -> (N,)
    max_abs_grad: jax.Array
    nonfinite_steps: jax.Array  # int32


def _index(u, vmin, levels):
    """Continuous lattice index of ``exp(u)``."""
    return (u - jnp.log(vmin)) * levels / jnp.log(2.0)


def _penalty_scales(settings: Settings) -> np.ndarray:
    """The barrier's temperature at every scan step: geometric from
    ``penalty_scale_start`` to ``penalty_scale_end`` over the search steps,
    then held for the integer stage."""
    steps = settings.steps
    ratio = settings.penalty_scale_end / settings.penalty_scale_start
    return settings.penalty_scale_start * ratio ** (
        np.minimum(np.arange(steps + settings.integer_steps), steps - 1)
        / max(steps - 1, 1))


def _neighbour(knobs: Knobs, theta, n):
    """Lattice neighbour ``n`` of ``theta``: concurrency down (``n`` even) or
    up, token budget down (``n < 2``) or up, the budget raised to the
    concurrency where lower. Returns ``(concurrency, token_budget)``."""
    c_tab, b_tab = knobs.concurrency, knobs.token_budget
    kc = _index(theta[0], c_tab[0], knobs.levels)
    kb = _index(theta[1], b_tab[0], knobs.levels)
    # past a lattice's end its padding repeats the last value
    ci = jnp.clip(jnp.where(n % 2 == 1, jnp.ceil(kc), jnp.floor(kc)),
                  0, len(c_tab) - 1).astype(jnp.int32)
    bi = jnp.clip(jnp.where(n // 2 == 1, jnp.ceil(kb), jnp.floor(kb)),
                  0, len(b_tab) - 1).astype(jnp.int32)
    c_val = c_tab[ci]
    return c_val, jnp.maximum(b_tab[bi], c_val)


def _descend(knobs: Knobs, opt, carry: _Carry, grad):
    """One optax step on ``theta``, projected onto the box; a non-finite
    gradient is replaced by zeros. Returns ``(theta, opt_state, grad, finite)``."""
    finite = jnp.all(jnp.isfinite(grad))
    grad = jnp.where(finite, grad, 0.0)
    # optax mixes its int32 step count with floats (bias correction,
    # schedules): allowed here even where a caller made promotion strict
    with jax.numpy_dtype_promotion("standard"):
        updates, opt_state = opt.update(grad, carry.opt_state, carry.theta)
    theta = optax.projections.projection_box(
        optax.apply_updates(carry.theta, updates), knobs.lower, knobs.upper)
    return theta, opt_state, grad, finite


def _bisect(carry: _Carry, first, mid, meets, r_max):
    """One bisection step on a neighbour's replicas (its first query is at
    ``r_max``). Returns ``(lo, hi, kept)``: ``kept`` when the query is the
    fewest replicas known to meet the targets."""
    open_ = carry.hi - carry.lo > 1
    lo = jnp.where(first, 0, jnp.where(open_ & ~meets, mid, carry.lo))
    hi = jnp.where(first, r_max, jnp.where(open_ & meets, mid, carry.hi))
    return lo, hi, jnp.where(first, meets, open_ & meets)


def _loop_step(knobs: Knobs, opt, cand: Candidates, carry: _Carry, k):
    """Loop step ``k``: a search step while ``k < steps``, then bisection
    steps on the replicas of each lattice neighbour in turn
    (``1 + bisect_steps`` per neighbour)."""
    steps, r_max = knobs.steps, knobs.replicas_max
    searching = k < steps
    k2 = jnp.maximum(k - steps, 0)
    n, j = k2 // (1 + knobs.bisect_steps), k2 % (1 + knobs.bisect_steps)
    c_val, b_val = _neighbour(knobs, carry.theta, n)
    first = j == 0
    mid = (carry.lo + carry.hi) // 2
    r_query = jnp.where(first, r_max, jnp.maximum(mid, 1))
    query = jnp.where(searching, carry.theta,
                      jnp.log(jnp.stack([c_val, b_val, r_query.astype(jnp.float32)])))
    grad_fn = jax.value_and_grad(objective, has_aux=True)
    (value, out), grad = grad_fn(query, cand, knobs.penalty_scale[k],
                                 knobs.penalty_weight, knobs.round_robin)

    theta, opt_state, grad, finite = _descend(knobs, opt, carry, grad)
    meets = ((out["ttft_p99_s"] <= cand.ttft_target_s)
             & (out["itl_p99_s"] <= cand.itl_target_s)
             & (out["status"] == OK))
    lo, hi, kept = _bisect(carry, first, mid, meets, r_max)
    keep = ~searching & kept
    top = ~searching & first

    def put(arr, new, when):
        # the record keeps its float32 where the surrogate runs in float64
        # (JAX_ENABLE_X64): said, not left to scatter's implicit cast
        return arr.at[n].set(jnp.where(when, new, arr[n]).astype(arr.dtype))

    def pick(a, b):
        return jnp.where(searching, a, b)

    carry = _Carry(
        theta=pick(theta, carry.theta),
        opt_state=jax.tree.map(pick, opt_state, carry.opt_state),
        lo=pick(carry.lo, lo),
        hi=pick(carry.hi, hi),
        feasible=put(carry.feasible, meets, top),
        replicas=put(carry.replicas, r_query, keep),
        concurrency=put(carry.concurrency, c_val, ~searching),
        token_budget=put(carry.token_budget, b_val, ~searching),
        metrics={m: put(carry.metrics[m], out[m], keep) for m in METRICS},
        reach={m: put(carry.reach[m], out[m], top) for m in carry.reach},
        max_abs_grad=pick(jnp.maximum(carry.max_abs_grad, jnp.max(jnp.abs(grad))),
                          carry.max_abs_grad),
        nonfinite_steps=carry.nonfinite_steps + (searching & ~finite).astype(jnp.int32),
    )
    return carry, value


def _run_lanes(cand: Candidates, owner, init, knobs: Knobs, *, optimizer: str,
               options):
    """Every lane (candidate ``owner[l]`` from start ``init[l]``; ``owner``
    int32 ``(L,)``, ``init`` ``(L, 3)``): the search and the integer stage as
    one loop whose step is ``vmap``-ped over the lanes. Inside the loop, the
    step is traced once with its batching; a ``vmap`` around the loop would
    batch the traced step again per ``vmap`` level (JAX's batching rule for
    loops). The loop
    runs ``steps + integer_steps`` times, a traced count. Returns the
    ``SearchResult`` fields the final carry gives and the objective at each
    loop step (``(L, T)``; the search steps first), as a dict (a result
    ``sweep.exported`` can keep)."""
    opt = make_optimizer(optimizer, options, knobs.learning_rate)
    # each candidate goes to the device once, its lanes gathered here
    cand = jax.tree.map(lambda x: x[owner], cand)
    lanes, r_max = init.shape[0], knobs.replicas_max
    nan = jnp.full((lanes, NEIGHBOURS), jnp.nan, jnp.float32)
    carry = _Carry(
        theta=init,
        opt_state=jax.vmap(opt.init)(init),
        lo=jnp.zeros(lanes, jnp.int32), hi=jnp.full(lanes, r_max, jnp.int32),
        feasible=jnp.zeros((lanes, NEIGHBOURS), bool),
        replicas=jnp.full((lanes, NEIGHBOURS), r_max, jnp.int32),
        concurrency=nan, token_budget=nan,
        metrics={m: nan for m in METRICS},
        reach={m: nan for m in REACH},
        max_abs_grad=jnp.zeros(lanes, jnp.float32),
        nonfinite_steps=jnp.zeros(lanes, jnp.int32),
    )
    step = jax.vmap(functools.partial(_loop_step, knobs, opt), in_axes=(0, 0, None))

    def body(k, state):
        carry, values = state
        # the lanes' vmap does not batch the loop index: the surrogate's
        # stages are computed once
        with computed_once(k):
            carry, value = step(cand, carry, k)
        return carry, values.at[:, k].set(value.astype(values.dtype))

    values = jnp.zeros((lanes, len(knobs.penalty_scale)), jnp.float32)
    total = knobs.steps + integer_steps(knobs.bisect_steps)
    carry, values = jax.lax.fori_loop(0, total, body, (carry, values))
    out = {f: getattr(carry, f) for f in SearchResult._fields if f in _Carry._fields}
    out["objective"] = values
    return out


def initial_theta(key, settings: Settings, num_candidates: int,
                  restarts: int) -> jax.Array:
    """Starting points ``(C, R, 3)``: a Latin hypercube over the box.

    Each axis of the box (log c, log b, log r) is cut into ``R`` equal strata
    and every stratum gets exactly one restart, in a random order per axis
    and candidate. The relaxed objective has separate basins (e.g. small
    token budgets against large ones, benchmarks/README.md), and independent
    uniform starts leave a quarter of an axis unvisited with probability
    ``(3/4)**R``; stratified starts visit every quarter at ``R = 4``. On the
    128 scenarios of ``benchmarks/optimize_vs_grid.py`` this raised the share
    within 2 % of the grid optimum from 121 to 126 at the same cost.

    Args:
      key: PRNG key of the random restarts.

    Reference: McKay, Beckman & Conover, *Technometrics* 21(2), 1979.
    """
    lower = jnp.asarray(settings.lower, jnp.float32)[None, None]
    upper = jnp.asarray(settings.upper, jnp.float32)[None, None]
    k_perm, k_jitter = jax.random.split(key)
    keys = jax.random.split(k_perm, (num_candidates, 3))
    strata = jax.vmap(jax.vmap(lambda k: jax.random.permutation(k, restarts)))(keys)
    u = (jnp.swapaxes(strata, 1, 2).astype(jnp.float32)
         + jax.random.uniform(k_jitter, (num_candidates, restarts, 3))) / restarts
    return lower + (upper - lower) * u


def search(candidates: Candidates, init, settings: Settings,
           knobs: Knobs | None = None) -> SearchResult:
    """Runs the search for every candidate and restart in one compiled call.

    The candidates (padded to a multiple of ``PAD``) go to the program
    once, with each lane's candidate (the program gathers them); the lanes
    (each candidate from each start) are padded to ``shapes.bucket`` (at
    least ``LANES_MIN``) by repeating the first; the settings' numbers are
    ``Knobs``: one program for every search of these shapes and this
    optimizer.

    Args:
      candidates: stacked ``Candidates`` (leaves ``(C, ...)``).
      init: starting ``theta``, shape ``(C, R, 3)`` (``initial_theta``).
      settings: the search settings.
      knobs: the numbers, where not ``settings.knobs()`` (``at_replicas``).
    """
    knobs = settings.knobs() if knobs is None else knobs
    init = np.asarray(init, np.float32)
    num_c, num_r = init.shape[:2]
    lanes = num_c * num_r
    pad = max(shapes.bucket(lanes), LANES_MIN) - lanes
    if num_c % PAD:  # as ``sweep-optimize`` stacks them: fewer shapes
        candidates = jax.tree.map(lambda x: np.concatenate(
            [x, np.repeat(np.asarray(x)[:1], -num_c % PAD, axis=0)]), candidates)
    # padding lanes: the first candidate from its first start
    owner = np.concatenate([np.repeat(np.arange(num_c, dtype=np.int32), num_r),
                            np.zeros(pad, np.int32)])
    init = init.reshape(lanes, 3)
    out = exported.call(_run_lanes, settings.program, candidates, owner,
                        np.concatenate([init, np.repeat(init[:1], pad, axis=0)]), knobs)
    steps = int(knobs.steps)
    out["objective"] = out["objective"][:, :steps]
    return SearchResult(
        **jax.tree.map(lambda x: np.asarray(x)[:lanes].reshape(num_c, num_r,
                                                               *x.shape[1:]), out),
        evaluations=lanes * (steps + integer_steps(int(knobs.bisect_steps))),
    )


def at_replicas(settings: Settings, replicas: int, steps: int | None = None) -> Knobs:
    """The numbers that make ``search`` hold every lane on ``replicas``
    replicas (the box's replica side closed there), through the same
    compiled program: the optimizer moves the concurrency and the token
    budget only, so it minimises the penalty there. No halving: each lattice
    neighbour is one query at ``replicas``, every number of it in ``reach``
    (its ``metrics`` where it meets the candidate's targets). ``steps``:
    optimizer steps, at most ``settings.steps`` where given (the learning rate's decay
    and the barrier's cooling over those; the per-step arrays keep the
    settings' length, so the program is the same)."""
    held = settings if steps is None else settings.replaced(steps=steps)
    knobs = held.knobs(settings.loop_length)
    r = np.float32(np.log(replicas))
    return knobs._replace(
        bisect_steps=np.int32(0), replicas_max=np.int32(replicas),
        lower=np.concatenate([knobs.lower[:2], [r]]).astype(np.float32),
        upper=np.concatenate([knobs.upper[:2], [r]]).astype(np.float32))
