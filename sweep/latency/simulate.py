"""Discrete-step simulation of a vLLM-style serving scheduler, vectorized in JAX.

``simulate`` runs one configuration (hardware, model, tensor parallelism,
concurrency, token budget, batching mode) over a request stream and returns
p50/p90/p99 TTFT, ITL and end-to-end latency, throughput, goodput and counts.
It is a pure function of traced scalars with fixed-size arrays and
``jax.lax`` loops, so ``jax.jit(jax.vmap(simulate))`` runs thousands of
configurations at once.

Scheduler rules (SPEC "p99 latency"; ``tests/reference_scheduler.py`` is the
step-by-step reference):

* continuous batching: FCFS admission while fewer than ``concurrency`` run
  and the running requests' KV tokens (prompt + generated so far) plus the new
  prompt fit in ``roofline.kv_capacity_tokens``; each step decodes one token
  for every prefilled request, then gives the rest of the token budget to
  unfinished prompts in admission order (``min(remaining, budget left)``
  each). The step finishing a prompt emits its first token; a step with
  nothing to do jumps to the next arrival. Step time is ``roofline.step_s``
  over the step's decodes (context = prompt + generated) and chunks (cached
  prefix = tokens prefilled before the step).
* KV overflow: admission checks only the prompt, so decoding can outgrow the
  cache. When the running KV exceeds the capacity at a step's start, the
  newest running request is preempted by recompute, as vLLM does: it goes to
  the front of the waiting queue (last preempted first), and when readmitted
  prefills its prompt plus its generated tokens again; the step finishing that
  prefill emits its next token (the wait is one long ITL gap). Preemptions are
  counted.
* speculative decoding (``spec_tokens`` k > 0; n-gram proposals, no GPU
  time of their own): each decode verifies k proposals, k + 1 tokens of
  compute and of the budget, and delivers the expected accepted tokens
  ``gain = roofline.tokens_per_step(k, acceptance)`` at once (an
  expectation, not a draw): an output of ``L`` tokens is
  ``1 + ceil((L - 1) / gain)`` deliveries (``delivery_count``), a context
  grows by ``gain`` tokens a step, each decoding request holds k more KV
  slots, and the ITL samples are the gaps between deliveries. The run
  machinery counts deliveries; ``_token_context`` and ``_kv_at`` turn them
  into tokens (exactly the integers of plain decoding at k = 0). With a
  draft model (``roofline.with_proposer``) every step also takes the
  draft's k passes (``roofline.draft_lines``): the first over the step's
  decodes and prompt chunks, the other k - 1 over the decodes, and the KV
  capacity counts both models; a run also ends where either turns from
  memory- to compute-bound, so that each adds one line to the run's two.
* prefix caching (``prefix_hit_fraction`` h): each prompt's first ``h P``
  tokens, in whole 16-token blocks (vLLM's block size;
  ``roofline.cached_prefix_tokens``), are in the prefix cache at admission:
  they count in the KV the request holds, but its prefill computes only the
  rest, as chunks whose cached prefix starts at them (their KV is read and
  attended to, not recomputed). A readmitted (preempted) request finds them
  again. Per-request cached prefixes (``cached_tokens``: an LRU cache of a
  trace's block hashes, ``sweep.latency.prefix_cache``) count the same way.
* static batching (``transformers.generate`` style): a batch of up to
  ``concurrency`` arrived requests is admitted only when nothing runs,
  reserving ``sum(prompt) + size * max(output)`` KV tokens, so it never
  overflows. Its prompts are prefilled (chunked under the budget); the step
  finishing the batch's last prompt emits every member's first token, as one
  padded prefill would; then all members decode (finished ones as padding,
  which costs step time but emits nothing) until the longest output ends.
  Request-at-a-time is static batching with batches of one.
* a request that does not fit the KV capacity even alone is admitted when
  nothing else runs, and ``status`` says so.
* context limit (vLLM's ``max_model_len``): a request whose prompt + output
  exceeds ``model.max_context_tokens`` is rejected, or its prompt truncated
  (``overlong``; ``sweep.latency.workload.context_limit``). A rejected request, like
  one a load balancer sent to another replica (``mine``), is never admitted:
  the served requests are queued first, in arrival order, and the run ends
  when they are done. Percentiles, goodput and throughput count served
  requests only; ``rejected_fraction`` is rejected / offered.

Speed. A loop turn per step would take ~60,000 turns per 1,000 requests. Here
one turn advances a whole *run* of steps whose batch does not change: no
admission, completion, preemption or finished prompt. Within a run the decode
contexts grow by one per step and the one prompt being prefilled takes the
same chunk each step, so the KV read and the attention FLOPs grow linearly in
the step index ``j``: step ``j`` lasts ``max(m0 + m j, c0 + c j) + fixed``,
and the run's duration, its ITL samples and its slow-step count follow in
closed form (the sum of a maximum of two lines splits at their crossing:
``roofline.step_lines``, ``split_at_crossing`` and ``run_s``, which
``roofline.chunked_prefill`` sums its chunks with). A run ends at the earliest
of: the next completion (the smallest remaining output), the step before the
running prompt finishes (that step, with its several chunks, is then taken in
the same turn), the next arrival that could be admitted (the step index at
which the elapsed time reaches it is solved from the quadratic and checked
exactly), and the next KV overflow. Per-request bookkeeping needs no update
within a run: a decoding request's context at global step ``k`` is
``base + k`` and it ends at a fixed step index ``last``; prompts are one FIFO
of token counts, so a prompt's progress is ``clip(prefilled - cum, 0, need)`` of one
shared counter. A turn (``_iterate``) also starts one finished prompt decoding
(``_start_decoding``), retires one finished request (``_retire``), preempts
one (``_preempt``) and admits one (``_admit``); it advances (``_advance``)
only when nothing else is due, so the rules keep their order. That is about 3
turns per request.

Slots: running and preempted requests occupy ``max_slots`` slots (``Slots``:
one entry of each of 14 int and 4 float field arrays; a turn scatters only the
fields it changes, and XLA on CPU copies far less than it did for one slot
matrix, which it copied whole twice per turn). No turn sorts or searches them:
the prompts being prefilled are a FIFO ring of slots (admission order), free
slots and preempted ones are stacks, a static batch fills slots from 0, and
the counts and KV sums are scalars; three plain reductions over the slots
remain per turn (the next completion, the newest decoding request, the chunks
of a step that finishes prompts). ``max_slots`` = the grid's largest
concurrency is always exact; a smaller value is faster under light load and
sets ``STATUS_SLOTS`` (metrics NaN) if the slots ever fill up below a
configuration's concurrency, so those points can be rerun. ``jax.vmap`` of a
while loop would select the whole carry (per-request outputs, ITL histogram)
every turn, so turns run in blocks of ``turns_per_check`` inside a fixed-count
loop (a finished simulation's turns change nothing) and the while condition is
tested only between blocks.

Percentiles: TTFT and end-to-end latency are kept per request and use NumPy's
linear interpolation exactly. ITL samples (every gap between consecutive
tokens of every request) arrive as runs of linearly growing values, so they
go into a histogram: each octave from ``ITL_MIN_S`` (7.6 us) to 128 s is cut
into ``2**ITL_MANTISSA_BITS`` = 512 equal bins (a value's float exponent and
leading mantissa bits, so no logarithm), each at most 0.2 % of its values
wide. A run piece of steps ``first, first + s, ..., last`` (``s`` = its
per-step increment) gives each decoding request one sample per step: half a
step's samples go to ``first`` and to ``last``, the rest spread uniformly over
``[first, last]`` and exactly over the bins it covers; event steps and
recompute gaps are points. The histogram's count of samples below ``x`` then
lies between the exact counts below ``x - s/2`` and ``x + s/2``, so:

  a reported ITL percentile lies within ``delta`` = one bin (``2**-9`` of the
  value) + ``s/2`` of the interval between the two order statistics NumPy
  interpolates between, ``s`` the largest increment of the runs there;

and it is clipped to the smallest and largest gap, which are kept exactly, so
it is never below one decode step. ``s`` is at most ``budget *
kv_bytes_per_token / (tp * bandwidth)`` while memory-bound and ``attention
FLOPs per key * budget**2 / (tp * peak FLOPs)`` while compute-bound (a prompt
chunk's cached prefix grows by a chunk a step): nanoseconds to microseconds
for decode-only runs, 1.25 ms for Qwen3-8B chunks of 2,048 on an H100
(measured on 100k-token prompts: p99 0.4 % above the exact one, p50 and p90
within 1e-5).

Precision. Float32, the default, gives the float64 figures: p99 TTFT, ITL and
end-to-end within 0.01 % on the tests' 13 configurations (every shipped
workload, 100k-token prompts, budgets 512-16,384, 2-256 running), within
0.03 % on 126 more. Within a run piece's octaves, the mass it adds to each covered
bin is the same; it is kept as a +/- pair in that octave's own row, and whole
octaves it spans as one mass each (``_Itl``), so every stored value is a mass
no larger than a run's own, and rounding (2**-24 of a bin's running sum per
addition) stays in the octave where it happens: the total is the number of
gaps to 1e-5 and no bin is below -0.01 gap. (Before, densities (gaps per
second, huge for narrow runs) were summed across the whole histogram and their
float32 residue multiplied by widths that double per octave: p99 ITL off by up
to -76 % on those 126 configurations, and at TP 8 on an MI300X every ITL
percentile at the 7.6 us floor.) The clock is a pair of floats
(``_clock_add``) and a request's times are kept from its own arrival, so a
float32 clock hours into a stream still resolves microseconds. What remains is
float32's rounding of the step times themselves (about 1e-7 of each): an
arrival that close to a step's end can join a step apart from float64 (a
configuration's step count differs by one in 9 of those 126), which moved no
p99 by more than 0.03 %.

Goodput: a request is good when its TTFT <= ``ttft_slo_s`` and its largest
inter-token gap <= ``itl_slo_s``; ``goodput_req_per_s`` is good requests over
the time the last request finishes (the clock starts at 0, before the first
arrival). ``output_tokens_per_s`` uses the same span.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sweep.cube import status as status_flags
from sweep.latency.arrivals import Requests
from sweep.latency.workload import context_limit
from sweep.model import roofline
from sweep.model._numerics import materialize
from sweep.model.batching import CONTINUOUS, is_continuous, running
from sweep.model.params import REJECT, TRUNCATE

FREE, PREFILL, DECODE, WAIT = range(4)
_BIG = 2**30  # "no limit" for step counts (int32)

# ``status`` is a bit mask of the shared flags (``sweep.cube.status``)
STATUS_OK = status_flags.OK
STATUS_RAN_OUT = status_flags.RAN_OUT
STATUS_OVERSIZE = status_flags.OVERSIZE
STATUS_SLOTS = status_flags.SLOTS_SHORT

ITL_MIN_S = 2.0**-17
ITL_OCTAVES = 24
ITL_MANTISSA_BITS = 9
ITL_BINS = ITL_OCTAVES << ITL_MANTISSA_BITS
"""ITL histogram: each octave from ``ITL_MIN_S`` (7.6 us) to 128 s is cut into
``2**ITL_MANTISSA_BITS`` equal bins, i.e. a value's bin is its float exponent
and leading mantissa bits; a bin is at most ``2**-9 = 0.2 %`` of its values."""


class SimResult(NamedTuple):
    """One configuration's outcome (every leaf a scalar)."""

    ttft_p50_s: jax.Array
    ttft_p90_s: jax.Array
    ttft_p99_s: jax.Array
    itl_p50_s: jax.Array
    itl_p90_s: jax.Array
    itl_p99_s: jax.Array
    e2e_p50_s: jax.Array
    e2e_p99_s: jax.Array
    output_tokens_per_s: jax.Array  # achieved: all output tokens / duration
    goodput_req_per_s: jax.Array  # requests meeting both SLOs / duration
    rejected_fraction: jax.Array  # offered requests rejected by the context limit
    duration_s: jax.Array  # when the last request finishes
    preemptions: jax.Array  # int32
    steps: jax.Array  # int32, scheduler steps simulated
    iterations: jax.Array  # int32, loop turns used
    status: jax.Array  # int32 bit mask of ``sweep.cube.status`` flags


class SimOutcome(NamedTuple):
    """Per-request results and counters before summarising (``simulate_requests``)."""

    ttft_s: jax.Array  # shape=(R,), in the order of the input requests
    e2e_s: jax.Array  # shape=(R,); both NaN for requests not served
    good: jax.Array  # shape=(R,), bool
    itl_hist: jax.Array  # shape=(ITL_BINS,), gaps per bin
    itl_min_s: jax.Array  # the smallest gap (inf: none)
    itl_max_s: jax.Array  # the largest gap (-inf: none)
    duration_s: jax.Array
    preemptions: jax.Array
    steps: jax.Array
    iterations: jax.Array
    status: jax.Array
    served: jax.Array  # shape=(R,), bool: offered and within the context limit
    rejected: jax.Array  # shape=(R,), bool: offered and beyond it
    output_tokens: jax.Array  # shape=(R,), output lengths as served (truncated)
    gaps: jax.Array  # shape=(R,), inter-token gaps (ITL samples) of each request:
    #   output - 1, or fewer with speculative decoding (``delivery_count``)


class Slots(NamedTuple):
    """The slot table: one array per field, each shape=(S,); int32 but for the
    four times (``_s``), which are in the clock's dtype.

    A turn reads a slot's fields with ``_at`` and scatters only the fields it
    changes with ``_write``: XLA copies an array around each scatter into it,
    and once copied a whole 13 x S slot matrix twice per turn.
    """

    state: jax.Array  # FREE / PREFILL / DECODE / WAIT (preempted, waiting)
    req: jax.Array  # request index
    adm: jax.Array  # admission number (the newest running has the largest)
    cum: jax.Array  # prefill tokens queued before this prefill (its FIFO position)
    need: jax.Array  # tokens this prefill holds in KV (prompt + emitted)
    hit: jax.Array  # of them, the prefix found in the prefix cache: the
    #   prefill computes need - hit tokens, from the cached prefix on
    prompt: jax.Array
    output: jax.Array
    emitted: jax.Array  # tokens emitted before the current prefill
    base: jax.Array  # decode context at global step k is base + k
    last: jax.Array  # global index of the step emitting the last token
    slow: jax.Array  # steps slower than the ITL SLO before the last preemption
    slow_from: jax.Array  # the slow-step counter when the decode phase began
    flags: jax.Array  # PADDING (static batching: done, still decoding padding)
    #   | BAD (a recompute gap exceeded the ITL SLO)
    arrival_s: jax.Array  # on the clock; the times below are from the arrival:
    #   the clock is a pair (``_clock_add``), a request's times need only their
    #   own magnitude
    ttft_s: jax.Array  # first token
    last_token_s: jax.Array  # last token before a preemption
    gap_s: jax.Array  # a recompute gap not yet in the histogram (-1: none)


PADDING, BAD = 1, 2


_ROW = 1 << ITL_MANTISSA_BITS  # bins per octave


class _Itl(NamedTuple):
    """The ITL histogram while it fills (``_itl_add``; ``_itl_hist`` assembles it).

    A run's uniform density covers whole bins between its end bins. Within
    one octave every bin has the same width, so a run adds the same mass to
    each of its bins there: that mass is kept as a +/- pair of changes in the
    octave's own row (after the bins' own masses in ``bins``, summed along
    the row at the end), and the run's octaves covered entirely go to
    ``octaves``. Nothing a run adds
    reaches another octave, and every stored value is a mass at most the
    run's own, never a density: a density times a width that doubles per
    octave is what let float32 rounding grow without bound.
    """

    bins: jax.Array  # shape=(ITL_BINS + ITL_OCTAVES * (_ROW + 1),): the mass
    #   placed in each bin, then each octave's row of per-bin mass changes (one
    #   scatter a turn); a row's last entry (one past its bins) is discarded
    octaves: jax.Array  # shape=(ITL_OCTAVES,), mass spread over a whole octave
    lo_s: jax.Array  # smallest gap so far (inf: none yet)
    hi_s: jax.Array  # largest gap so far (-inf: none yet)


class _State(NamedTuple):
    slots: Slots
    fifo: jax.Array  # shape=(S,), ring of prefilling slots in admission order
    fifo_head: jax.Array  # first entry not yet decoding
    fifo_first: jax.Array  # first entry whose prompt is unfinished
    fifo_tail: jax.Array  # one past the last entry
    free_stack: jax.Array  # shape=(S,), free slots (continuous batching)
    n_free: jax.Array
    wait_stack: jax.Array  # shape=(S,), preempted slots, last preempted on top
    n_wait: jax.Array
    t_s: jax.Array  # end of the last step: t_s + t_lo_s (``_clock_add``)
    t_lo_s: jax.Array
    steps: jax.Array  # steps so far (the next step's global index)
    next_req: jax.Array  # first request never admitted
    admissions: jax.Array
    queued: jax.Array  # prefill tokens ever queued (FIFO tail position)
    prefilled: jax.Array  # prefill tokens done (FIFO head position)
    slow_steps: jax.Array  # steps slower than the ITL SLO so far
    n_run: jax.Array  # running slots (PREFILL or DECODE, static padding included)
    n_dec: jax.Array  # DECODE slots (padding included)
    n_real: jax.Array  # DECODE slots still emitting
    sum_base: jax.Array  # BASE summed over DECODE slots
    sum_prompt: jax.Array  # PROMPT summed over DECODE slots (speculation's KV)
    kv_prefill: jax.Array  # NEED summed over PREFILL slots (their KV)
    event_step: jax.Array  # the last step that finished a prompt: its index,
    event_s: jax.Array  # its end time (event_s + event_lo_s),
    event_lo_s: jax.Array
    event_slow: jax.Array  # and the slow-step counter after it
    iterations: jax.Array
    preemptions: jax.Array
    batch_open: jax.Array  # static: admissions since the batch began
    batch_prompt: jax.Array
    batch_output: jax.Array
    status: jax.Array
    done: jax.Array
    ttft_s: jax.Array
    e2e_s: jax.Array
    good: jax.Array
    itl: _Itl  # the ITL histogram being filled


class _Ctx(NamedTuple):
    hw: object
    model: object
    tp: jax.Array
    concurrency: jax.Array  # int32, at most the number of slots
    slots_short: jax.Array  # bool, the true concurrency exceeds the slots
    budget: jax.Array  # int32
    capacity: jax.Array  # int32 KV tokens
    continuous: jax.Array  # bool
    ttft_slo_s: jax.Array
    itl_slo_s: jax.Array
    arrival_s: jax.Array  # shape=(R,), served requests first, sorted by arrival
    prompt: jax.Array  # shape=(R,), int32
    output: jax.Array  # shape=(R,), int32, deliveries (``delivery_count``)
    output_tokens: jax.Array  # shape=(R,), int32, tokens (static batches' KV)
    num_served: jax.Array  # int32: requests [0, num_served) are served
    spec_tokens: jax.Array  # int32, proposals verified per decode (0: off)
    spec_gain: jax.Array  # tokens each decode step gains (1 without speculation)
    hit: jax.Array  # shape=(R,), int32, each prompt's prefix in the prefix cache


def _lines(cx: _Ctx, dt, new_tokens, kv0, kv_slope, keys0, keys_slope, sequences):
    """``roofline.step_lines`` of a run, its token counts in the clock's dtype."""
    return roofline.step_lines(cx.hw, cx.model, cx.tp, new_tokens.astype(dt),
                               kv0.astype(dt), kv_slope.astype(dt), keys0, keys_slope,
                               sequences.astype(dt))


def _elapsed(lines, split, j):
    """Duration of the first ``j`` (int) steps of a run (closed form)."""
    return roofline.run_s(lines, split, j.astype(lines.fixed_s.dtype))


def _step_time(lines, j):
    """Duration of step ``j`` (int) of a run."""
    return lines.at(j.astype(lines.fixed_s.dtype))


def _first_step_reaching(lines, split, horizon, delay_s):
    """Smallest ``j`` in ``[1, horizon]`` with ``elapsed(j) >= delay_s``.

    Returns ``horizon + 1`` when there is none.

    Solves the quadratic of the piece it falls in, then picks the answer among
    the neighbours of that estimate by evaluating ``_elapsed`` exactly as the
    run will (the estimate is off by far less than one step).
    """
    jc, (a, s), (b, r) = split
    fixed = lines.fixed_s
    dt = a.dtype

    def root(lin, slope, delay):
        # smallest x >= 0 with lin x + slope x (x - 1) / 2 >= delay (stable form)
        p = lin - slope / 2.0
        disc = jnp.sqrt(jnp.maximum(p * p + 2.0 * slope * delay, 0.0))
        return jnp.where(delay > 0, 2.0 * delay / jnp.maximum(p + disc, 1e-30), 0.0)

    x_first = root(a + fixed, s, delay_s)
    rest = delay_s - _elapsed(lines, split, jc)
    x_second = jc + root(b + r * jc + fixed, r, rest)
    x = jnp.where(x_first <= jc, x_first, x_second)
    hf = horizon.astype(dt)
    guess = jnp.ceil(jnp.clip(x, 0.0, hf + 1.0)).astype(jnp.int32)
    near = jnp.clip(guess + jnp.arange(-2, 3, dtype=jnp.int32), 1, horizon + 1)
    reached = _elapsed(lines, split, near) >= delay_s
    j = jnp.where(reached.any(), near[jnp.argmax(reached)], near[-1] + 1)
    return jnp.minimum(j, horizon + 1)


def _count_at_most(lines, n, limit_s):
    """How many of the run's first ``n`` steps last at most ``limit_s``.

    Step times never decrease along a run, so they form a prefix.
    """
    y = limit_s - lines.fixed_s
    nf = n.astype(y.dtype)

    def below(a, s):
        safe = jnp.where(s > 0, s, 1.0)
        k = jnp.clip(jnp.floor((y - a) / safe) + 1.0, 0.0, nf)
        return jnp.where(s > 0, k, jnp.where(a <= y, nf, 0.0))

    k = jnp.minimum(below(lines.memory_s, lines.memory_slope_s),
                    below(lines.compute_s, lines.compute_slope_s)).astype(jnp.int32)
    # rounding in the division: settle on the exact boundary
    fast = _step_time(lines, k + jnp.arange(-1, 1, dtype=jnp.int32)) <= limit_s
    k = jnp.where((k > 0) & ~fast[0], k - 1, k)
    return jnp.where((k < n) & fast[1], k + 1, k)


def _bits(dt):
    """Integer type and mantissa width of a float dtype."""
    return (jnp.int64, 52) if jnp.dtype(dt) == jnp.float64 else (jnp.int32, 23)


def _bin(x):
    """ITL bin of ``x``: its exponent and leading mantissa bits (no logarithm)."""
    ity, mant = _bits(x.dtype)
    shift = mant - ITL_MANTISSA_BITS
    lo = jax.lax.bitcast_convert_type(jnp.asarray(ITL_MIN_S, x.dtype), ity) >> shift
    k = (jax.lax.bitcast_convert_type(jnp.maximum(x, ITL_MIN_S), ity) >> shift) - lo
    return jnp.minimum(k, ITL_BINS - 1).astype(jnp.int32)


def _edge(k, dt):
    """Lower edge of bin ``k`` (exact)."""
    ity, mant = _bits(dt)
    shift = mant - ITL_MANTISSA_BITS
    lo = jax.lax.bitcast_convert_type(jnp.asarray(ITL_MIN_S, dt), ity) >> shift
    return jax.lax.bitcast_convert_type((k.astype(ity) + lo) << shift, dt)


def _itl_empty(dt) -> _Itl:
    return _Itl(bins=jnp.zeros(ITL_BINS + ITL_OCTAVES * (_ROW + 1), dt),
                octaves=jnp.zeros(ITL_OCTAVES, dt),
                lo_s=jnp.asarray(jnp.inf, dt), hi_s=jnp.asarray(-jnp.inf, dt))


def _itl_add(h: _Itl, ramps, points) -> _Itl:
    """Adds ramps and points (arrays of any one shape each) to the histogram.

    ``ramps = (x0, x1, w_mid, w_end)``: mass ``w_mid`` spread uniformly over
    ``[x0, x1]`` plus ``w_end`` at each end; ``points = (x, w)``: mass ``w``
    at ``x``. Entries with no mass change nothing.
    """
    x0, x1, w_mid, w_end = (jnp.ravel(v) for v in ramps)
    px, pw = (jnp.ravel(v) for v in points)
    dt = x0.dtype
    # values beyond the histogram's ends count in its first and last bins
    c0, c1 = x0, jnp.maximum(x1, x0)
    k0, k1 = _bin(c0), _bin(c1)
    same = k0 == k1
    rho = w_mid / jnp.where(same, 1.0, c1 - c0)
    end0 = _edge(k0 + 1, dt)
    start1 = _edge(k1, dt)
    mass_idx = jnp.concatenate([k0, k1, _bin(px)])
    mass_val = jnp.concatenate([
        jnp.where(same, w_mid + 2.0 * w_end, rho * (end0 - c0) + w_end),
        jnp.where(same, 0.0, rho * (c1 - start1) + w_end),
        pw,
    ])
    # bins strictly between k0 and k1: per-bin mass rho * (bin width) in the
    # octaves of k0 and k1, whole octaves in between
    inner = k1 > k0 + 1
    o0, j0 = k0 >> ITL_MANTISSA_BITS, k0 & (_ROW - 1)
    o1, j1 = k1 >> ITL_MANTISSA_BITS, k1 & (_ROW - 1)
    m0 = jnp.where(inner, rho * (end0 - _edge(k0, dt)), 0.0)
    m1 = jnp.where(inner & (o1 > o0) & (j1 > 0),
                   rho * (_edge(k1 + 1, dt) - start1), 0.0)
    # a row's sum past its last bin is discarded: the run's mass in k0's row
    # needs ending only when k1 is in the same row
    row0, row1 = ITL_BINS + o0 * (_ROW + 1), ITL_BINS + o1 * (_ROW + 1)
    step_idx = [row0 + j0 + 1, row1, row1 + j1]
    octave = jnp.arange(ITL_OCTAVES, dtype=jnp.int32)
    octave_s = _edge((octave + 1) << ITL_MANTISSA_BITS, dt) - _edge(
        octave << ITL_MANTISSA_BITS, dt)
    # elementwise over the few ramps rather than reductions: under vmap every
    # reduction is a kernel of its own on each loop turn
    octave_mass = functools.reduce(jnp.add, (
        jnp.where((octave > o0[i]) & (octave < o1[i]), rho[i] * octave_s, 0.0)
        for i in range(rho.shape[0])))
    some = jnp.concatenate([(w_mid > 0) | (w_end > 0), pw > 0])
    lo = functools.reduce(jnp.minimum, jnp.where(
        some, jnp.concatenate([x0, px]), jnp.inf))
    hi = functools.reduce(jnp.maximum, jnp.where(
        some, jnp.concatenate([x1, px]), -jnp.inf))
    idx = jnp.concatenate([mass_idx, *step_idx])
    val = jnp.concatenate([mass_val, m0, m1, -jnp.where(o1 == o0, m0, m1)])
    return _Itl(bins=h.bins.at[idx].add(val), octaves=h.octaves + octave_mass,
                lo_s=jnp.minimum(h.lo_s, lo), hi_s=jnp.maximum(h.hi_s, hi))


def _itl_hist(h: _Itl):
    """Gaps per bin, shape ``(ITL_BINS,)``."""
    steps = h.bins[ITL_BINS:].reshape(ITL_OCTAVES, _ROW + 1)
    rows = jnp.cumsum(steps, axis=1)[:, :_ROW]
    return h.bins[:ITL_BINS] + (rows + h.octaves[:, None] / _ROW).ravel()


def _run_ramps(lines, split, n, weight):
    """The ITL samples of a run's first ``n`` steps as ramps (2 pieces).

    A piece of ``count`` steps ``first, first + s, ..., last`` gives each of
    ``weight`` requests one sample per step: half a step's mass at each end
    and the rest spread uniformly over ``[first, last]``. Its cumulative
    count is then within half a sample of the exact one at every value, i.e.
    within ``s/2`` in value, and no mass leaves ``[first, last]``.
    """
    jc, (a, s), (b, r) = split
    k = jnp.minimum(jc.astype(jnp.int32), n)
    dt = a.dtype
    lo = jnp.stack([jnp.zeros_like(k), k]).astype(dt)
    count = jnp.stack([k, n - k]).astype(dt)
    c0, c = jnp.stack([a, b]), jnp.stack([s, r])
    first = c0 + c * lo + lines.fixed_s
    inner = jnp.maximum(count - 1.0, 0.0)
    last = first + c * inner
    return (first, last, weight * inner,
            jnp.where(count > 0, weight / 2.0, 0.0).astype(dt))


def _at(slots: Slots, j) -> Slots:
    """Slot ``j``'s fields (scalars)."""
    return Slots(*(x[j] for x in slots))


def _write(slots: Slots, j, do, **fields) -> Slots:
    """``slots`` with the named fields of slot ``j`` set when ``do``; only
    those are scattered (see ``Slots``)."""
    j = jnp.where(do, j, slots.state.shape[0])
    return slots._replace(**{
        name: getattr(slots, name).at[j].set(
            jnp.asarray(value, getattr(slots, name).dtype), mode="drop")
        for name, value in fields.items()})


def _clock_add(hi, lo, x):
    """``(hi, lo) + x`` for a clock kept as the unevaluated sum ``hi + lo``.

    Error-free addition (TwoSum) carries ``hi + x``'s rounding into ``lo``, so
    the clock keeps about twice the float's precision: in float32 a clock
    hours into a stream still resolves microseconds, so arrivals fall on the
    same side of a step's end as in float64 and TTFTs do not drift.
    """
    total = hi + x
    back = total - hi
    lo = lo + ((hi - (total - back)) + (x - back))
    new = total + lo
    return new, lo - (new - total)


def _since(hi, lo, x):
    """``hi + lo - x``: time from ``x`` to the clock ``(hi, lo)``."""
    return (hi - x) + lo


def _n(flag):
    """A bool as an int32 count."""
    return flag.astype(jnp.int32)


def delivery_count(output_tokens, spec_tokens, gain):
    """Deliveries of an output of ``output_tokens`` tokens: the first token,
    then one per decode step, each step gaining ``gain`` tokens (the expected
    accepted tokens, ``roofline.tokens_per_step``):
    ``1 + ceil((output - 1) / gain)``; the output itself without speculation.
    """
    spec = 1.0 + jnp.ceil(jnp.maximum(output_tokens - 1.0, 0.0) / gain)
    return jnp.where(spec_tokens > 0, spec, output_tokens)


def _spec_on(cx: _Ctx):
    return cx.spec_tokens > 0


def _token_context(cx: _Ctx, s: _State, ctx_f, n_dec):
    """Tokens in the decoding requests' contexts, given their context in
    deliveries ``ctx_f`` (prompt + deliveries, summed; float): the first
    delivery is one token, each later one ``spec_gain``. Exactly ``ctx_f``
    without speculation."""
    dt = ctx_f.dtype
    later = ctx_f - s.sum_prompt.astype(dt) - n_dec.astype(dt)
    return ctx_f + (cx.spec_gain.astype(dt) - 1.0) * later


def _kv_at(cx: _Ctx, s: _State, j):
    """KV tokens of the running requests at the start of the step ``j`` steps
    after the next one (``j`` int, any shape): each decoding request's
    context in tokens (``_token_context``) plus the ``spec_tokens`` slots its
    proposals take, rounded up to whole tokens, plus the prompts being
    prefilled. Integer arithmetic alone without speculation."""
    ctx = s.sum_base + s.n_dec * (s.steps + j)
    dt = cx.spec_gain.dtype
    later = (ctx - s.sum_prompt - s.n_dec).astype(dt)
    extra = jnp.ceil((cx.spec_gain - 1.0) * later
                     + (cx.spec_tokens * s.n_dec).astype(dt))
    extra = jnp.where(_spec_on(cx), extra, 0.0).astype(jnp.int32)
    return ctx + s.kv_prefill + extra


def _kv_tokens(cx: _Ctx, s: _State):
    """KV tokens of the running requests at the next step's start."""
    return _kv_at(cx, s, jnp.zeros((), jnp.int32))


def _recompute_tokens(cx: _Ctx, emitted):
    """Tokens a preempted request that made ``emitted`` deliveries generated
    (prefilled again on readmission): ``1 + gain (emitted - 1)``, rounded."""
    dt = cx.spec_gain.dtype
    spec = jnp.floor(1.0 + cx.spec_gain * (emitted.astype(dt) - 1.0) + 0.5)
    return jnp.where(_spec_on(cx) & (emitted > 0), spec.astype(jnp.int32), emitted)


def _start_decoding(cx: _Ctx, s: _State):
    """A prompt finished by the last step starts decoding, in FIFO order
    (static batching: the batch's prompts, once all are done).

    Returns ``(state, pending)``: ``pending`` when another one is due.
    """
    size = s.fifo.shape[0]
    all_done = cx.continuous | (s.fifo_first == s.fifo_tail)
    do = ~s.done & (s.fifo_head < s.fifo_first) & all_done
    p = s.fifo[s.fifo_head % size]
    c = _at(s.slots, p)
    recompute = c.emitted > 0
    since_event = _since(s.event_s, s.event_lo_s, c.arrival_s)
    gap = since_event - c.last_token_s
    base = c.prompt + c.emitted - s.event_step
    slots = _write(
        s.slots, p, do, state=DECODE, base=base,
        last=s.event_step + c.output - c.emitted - 1, slow_from=s.event_slow,
        flags=c.flags | jnp.where(recompute & (gap > cx.itl_slo_s), BAD, 0),
        ttft_s=jnp.where(recompute, c.ttft_s, since_event),
        gap_s=jnp.where(recompute, gap, -1.0))
    head = s.fifo_head + _n(do)
    s = s._replace(
        slots=slots, fifo_head=head,
        kv_prefill=s.kv_prefill - jnp.where(do, c.need, 0),
        n_dec=s.n_dec + _n(do), n_real=s.n_real + _n(do),
        sum_base=s.sum_base + jnp.where(do, base, 0),
        sum_prompt=s.sum_prompt + jnp.where(do, c.prompt, 0))
    return s, (head < s.fifo_first) & all_done


def _retire(cx: _Ctx, s: _State, pending):
    """A request that emitted its last token leaves (one per turn).

    Its TTFT, end-to-end latency and goodness are recorded; under continuous
    batching its slot is freed, under static batching it decodes on as
    padding until the batch's longest output ends.

    Returns ``(state, blocked, next_last, point)``: ``blocked`` when more is
    due before the clock may advance; ``next_last``, the step emitting the
    next completion among the others; ``point``, the leaver's recompute gap
    as a histogram point ``(value, weight)``.
    """
    slots = s.slots
    size = slots.state.shape[0]
    cont = cx.continuous
    real = (slots.state == DECODE) & ((slots.flags & PADDING) == 0)
    fin = real & (slots.last < s.steps)
    n_fin = fin.sum(dtype=jnp.int32)
    r = jnp.minimum(jnp.min(jnp.where(fin, jnp.arange(size, dtype=jnp.int32), size)),
                    size - 1)
    # the next completion among the others (a preemption below can only make
    # this bound early, which splits a run without changing any step)
    next_last = jnp.min(jnp.where(real & ~fin, slots.last, _BIG))
    do = ~s.done & (n_fin > 0)
    c = _at(slots, r)
    slow = c.slow + s.slow_steps - c.slow_from
    good = (c.ttft_s <= cx.ttft_slo_s) & (slow == 0) & ((c.flags & BAD) == 0)
    out = jnp.where(do, c.req, cx.arrival_s.shape[0])
    point = (c.gap_s, jnp.where(do & (c.gap_s >= 0), 1.0, 0.0))
    leave = do & cont
    n_real = s.n_real - _n(do)
    # static batching: the batch ends with its longest output; its slots are
    # reused from slot 0 by the next batch
    batch_end = do & ~cont & (n_real == 0) & ~pending

    def unless_batch_end(x):
        return jnp.where(batch_end, 0, x)

    s = s._replace(
        slots=_write(slots, r, do, state=jnp.where(cont, FREE, DECODE),
                     flags=c.flags | jnp.where(cont, 0, PADDING), gap_s=-1.0),
        ttft_s=s.ttft_s.at[out].set(c.ttft_s, mode="drop"),
        e2e_s=s.e2e_s.at[out].set(_since(s.t_s, s.t_lo_s, c.arrival_s), mode="drop"),
        good=s.good.at[out].set(good, mode="drop"),
        free_stack=s.free_stack.at[jnp.where(leave, s.n_free, size)].set(
            r.astype(jnp.int32), mode="drop"),
        n_free=s.n_free + _n(leave),
        n_run=unless_batch_end(s.n_run - _n(leave)),
        n_dec=unless_batch_end(s.n_dec - _n(leave)),
        n_real=n_real,
        sum_base=unless_batch_end(s.sum_base - jnp.where(leave, c.base, 0)),
        sum_prompt=unless_batch_end(s.sum_prompt - jnp.where(leave, c.prompt, 0)))
    return s, pending | (n_fin > 1), next_last, point


def _preempt(cx: _Ctx, s: _State, blocked):
    """Preemption by recompute when decoding outgrew the KV cache.

    The newest running request (the FIFO's tail, or else the newest decoding
    one) goes on the wait stack, to prefill its prompt and its emitted tokens
    again when readmitted.

    Returns ``(state, blocked, point)``: ``point``, its pending recompute gap
    as a histogram point ``(value, weight)``.
    """
    slots = s.slots
    size = slots.state.shape[0]
    k = s.steps
    do = (~s.done & ~blocked & cx.continuous & (_kv_tokens(cx, s) > cx.capacity)
          & (s.n_run > 1))
    newest_dec = jnp.max(jnp.where(
        slots.state == DECODE, slots.adm * size + jnp.arange(size, dtype=jnp.int32),
        -1)) % size
    from_fifo = s.fifo_first < s.fifo_tail
    v = jnp.where(from_fifo, s.fifo[(s.fifo_tail - 1) % size], newest_dec)
    c = _at(slots, v)
    decoding = ~from_fifo
    emitted = jnp.where(decoding, c.base + k - c.prompt, c.emitted)
    undo = do & ~decoding  # its prompt leaves the FIFO
    drop = do & decoding
    tail = s.fifo_tail - _n(undo)
    point = (c.gap_s, jnp.where(do & (c.gap_s >= 0), 1.0, 0.0))
    s = s._replace(
        slots=_write(
            slots, v, do,
            slow=jnp.where(decoding, c.slow + s.slow_steps - c.slow_from, c.slow),
            state=WAIT, emitted=emitted,
            need=c.prompt + _recompute_tokens(cx, emitted),
            last_token_s=jnp.where(decoding, _since(s.t_s, s.t_lo_s, c.arrival_s),
                                   c.last_token_s),
            gap_s=-1.0),
        queued=s.queued - jnp.where(undo, c.need - c.hit, 0),
        prefilled=jnp.where(undo, jnp.minimum(s.prefilled, c.cum), s.prefilled),
        kv_prefill=s.kv_prefill - jnp.where(undo, c.need, 0),
        fifo_tail=tail,
        fifo_first=jnp.minimum(s.fifo_first, tail),
        n_dec=s.n_dec - _n(drop),
        n_real=s.n_real - _n(drop),
        sum_base=s.sum_base - jnp.where(drop, c.base, 0),
        sum_prompt=s.sum_prompt - jnp.where(drop, c.prompt, 0),
        wait_stack=s.wait_stack.at[jnp.where(do, s.n_wait, size)].set(
            v.astype(jnp.int32), mode="drop"),
        n_run=s.n_run - _n(do),
        n_wait=s.n_wait + _n(do),
        preemptions=s.preemptions + _n(do))
    blocked = blocked | (do & (_kv_tokens(cx, s) > cx.capacity) & (s.n_run > 1))
    return s, blocked, point


def _admit(cx: _Ctx, s: _State, blocked):
    """Admission of the queue's head (one per turn): the last preempted
    request, else the next new one; an idle scheduler's clock first jumps to
    the next arrival.

    Returns ``(state, blocked)``.
    """
    num_req = cx.arrival_s.shape[0]
    cont = cx.continuous
    a = s.next_req
    a_c = jnp.minimum(a, num_req - 1)
    has_new = a < cx.num_served
    from_wait = s.n_wait > 0
    idle = ~s.done & ~blocked & (s.n_run == 0) & ~from_wait & has_new
    jump = idle & (cx.arrival_s[a_c] - s.t_s > s.t_lo_s)
    t = jnp.where(jump, cx.arrival_s[a_c], s.t_s)
    t_lo = jnp.where(jump, 0.0, s.t_lo_s)
    # static batches fill slots 0, 1, ...
    fresh_slot = jnp.where(cont, s.free_stack[jnp.maximum(s.n_free - 1, 0)], s.n_run)
    slot = jnp.where(from_wait, s.wait_stack[jnp.maximum(s.n_wait - 1, 0)],
                     fresh_slot)
    c = _at(s.slots, slot)
    fresh = ~from_wait

    def new(x, old):
        """A new request's ``x``, or the readmitted one's ``old``."""
        return jnp.where(fresh, x, old)

    prompt, output = new(cx.prompt[a_c], c.prompt), new(cx.output[a_c], c.output)
    # a static batch reserves KV for its longest output in tokens
    out_tokens = new(cx.output_tokens[a_c], c.output)
    need = new(cx.prompt[a_c], c.need)
    # a readmitted request finds its prompt's cached prefix again
    hit = new(cx.hit[a_c], c.hit)
    arrived = from_wait | (has_new & (cx.arrival_s[a_c] - t <= t_lo))
    empty = s.n_run == 0
    batch_prompt = jnp.where(empty, 0, s.batch_prompt)
    batch_output = jnp.where(empty, 0, s.batch_output)
    fits = jnp.where(
        cont,
        _kv_tokens(cx, s) + need <= cx.capacity,
        batch_prompt + prompt
        + (s.n_run + 1) * jnp.maximum(batch_output, out_tokens) <= cx.capacity,
    )
    may_open = cont | empty | s.batch_open
    do = (~s.done & ~blocked & arrived & may_open & (s.n_run < cx.concurrency)
          & (fits | empty))
    slots = _write(
        s.slots, slot, do, state=PREFILL, adm=s.admissions, cum=s.queued,
        req=new(a, c.req), prompt=prompt, output=output, emitted=new(0, c.emitted),
        need=need, hit=hit, slow=new(0, c.slow), flags=new(0, c.flags),
        arrival_s=new(cx.arrival_s[a_c], c.arrival_s), gap_s=new(-1.0, c.gap_s))
    added = jnp.where(do, need, 0)
    work = jnp.where(do, need - hit, 0)  # the FIFO holds tokens to compute
    next_req = a + _n(do & fresh)
    n_run = s.n_run + _n(do)
    n_wait = s.n_wait - _n(do & from_wait)
    size = s.fifo.shape[0]
    s = s._replace(
        slots=slots,
        fifo=s.fifo.at[jnp.where(do, s.fifo_tail % size, size)].set(
            slot.astype(jnp.int32), mode="drop"),
        fifo_tail=s.fifo_tail + _n(do),
        n_free=s.n_free - _n(do & fresh & cont),
        n_wait=n_wait,
        t_s=t,
        t_lo_s=t_lo,
        next_req=next_req,
        admissions=s.admissions + _n(do),
        queued=s.queued + work,
        kv_prefill=s.kv_prefill + added,
        n_run=n_run,
        batch_open=s.batch_open | do,
        batch_prompt=batch_prompt + jnp.where(do, prompt, 0),
        batch_output=jnp.where(do, jnp.maximum(batch_output, out_tokens), batch_output),
        status=s.status | jnp.where(do & ~fits, STATUS_OVERSIZE, 0))
    b_c = jnp.minimum(next_req, num_req - 1)
    again = (n_wait > 0) | ((next_req < cx.num_served)
                            & (cx.arrival_s[b_c] - t <= t_lo))
    return s, blocked | (do & again & (n_run < cx.concurrency))


def _verified(cx: _Ctx, dt, n_dec, ctx_t):
    """The decodes' new tokens and attention keys in a step: each computes
    ``k + 1`` tokens (its own and ``k`` proposals to verify), token ``j``
    attending to its context + ``j`` keys; ``ctx_t`` is their summed context
    in tokens. ``(n_dec, ctx_t)`` exactly without speculation."""
    k = cx.spec_tokens
    pairs = (n_dec * (k * (k + 1) // 2)).astype(dt)
    return n_dec * (k + 1), (k + 1).astype(dt) * ctx_t + pairs


def _event_step(cx: _Ctx, s: _State, prefilled, left, n_dec, ctx_f):
    """The step after a run when it finishes a prompt: its decodes, plus
    chunks of every prompt the ``left`` tokens of budget reach.

    Returns ``(step_s, chunks, finished)``: its duration, its prompt tokens
    and the prompts it finishes.
    """
    dt = ctx_f.dtype
    cum, hit = s.slots.cum, s.slots.hit
    work = s.slots.need - hit
    done_old = jnp.clip(prefilled - cum, 0, work)
    done_new = jnp.clip(prefilled + left - cum, 0, work)
    taken = jnp.where(s.slots.state == PREFILL, done_new - done_old, 0)
    # a chunk's cached prefix: the prompt's cached tokens and those done
    taken_f, done_f = taken.astype(dt), (hit + done_old).astype(dt)
    chunks = taken.sum(dtype=jnp.int32)
    finished = ((taken > 0) & (done_new == work)).sum(dtype=jnp.int32)
    ctx_t = _token_context(cx, s, ctx_f, n_dec)
    dec_new, dec_keys = _verified(cx, dt, n_dec, ctx_t)
    chunk_kv = jnp.where(taken > 0, done_f, 0.0).sum()
    chunk_keys = (taken_f * done_f + taken_f * (taken_f + 1.0) / 2.0).sum()
    lines = _lines(
        cx, dt, dec_new + chunks, ctx_t + chunk_kv, jnp.zeros((), dt),
        dec_keys + chunk_keys, jnp.zeros((), dt),
        n_dec + (taken > 0).sum(dtype=n_dec.dtype),
    )
    # the draft's first pass takes every chunk of the step with the decodes
    step_s = roofline.plus_draft_s(_step_time(lines, jnp.zeros((), jnp.int32)), cx.hw,
                                   cx.model, cx.tp, n_dec.astype(dt), ctx_t,
                                   cx.spec_tokens.astype(dt), chunks.astype(dt),
                                   chunk_kv, chunk_keys)
    return step_s, chunks, finished


def _with_draft(cx: _Ctx, dt, lines: roofline.StepLines, horizon, n_dec, ctx_t,
                ctx_slope, chunk_f, p0):
    """A run's ``lines`` plus the draft model's passes in each of its steps
    (``roofline.draft_lines``: the decodes' summed context ``ctx_t +
    ctx_slope x`` at step ``x``; the first pass also takes the run's prompt
    chunk of ``chunk_f`` tokens, its cached prefix ``p0 + chunk_f x``), and
    the step (``_BIG``: none) before ``horizon`` where the first pass or the
    others change from memory- to compute-bound or back."""
    cap = _BIG
    for draft in roofline.draft_lines(
            cx.hw, cx.model, cx.tp, n_dec.astype(dt), ctx_t, ctx_slope,
            cx.spec_tokens.astype(dt), chunk_f, p0, chunk_f,
            roofline.chunk_attention_keys(chunk_f, p0), chunk_f * chunk_f):
        draft_j, draft_a, draft_b = roofline.split_at_crossing(draft, horizon)
        cap = jnp.minimum(cap, jnp.where((draft_j > 0) & (draft_j < horizon.astype(dt)),
                                         draft_j.astype(jnp.int32), _BIG))
        on_a = draft_j > 0
        s0 = jnp.where(on_a, draft_a[0], draft_b[0])
        slope = jnp.where(on_a, draft_a[1], draft_b[1])
        lines = roofline.StepLines(
            lines.memory_s + s0, lines.memory_slope_s + slope, lines.compute_s + s0,
            lines.compute_slope_s + slope, lines.fixed_s + draft.fixed_s)
    return lines, cap


def _advance(cx: _Ctx, turn, s: _State, blocked, next_last):
    """The clock advances by a run of unchanged steps, then by the step
    finishing a prompt when that comes next.

    A run ends at the earliest of: the next completion (``next_last``), the
    step before the running prompt finishes, the next KV overflow and the
    next arrival that could be admitted.

    Returns ``(state, ramps, point)``: the run's ITL samples as ramps, and
    the event step's as a histogram point ``(value, weight)``.
    """
    size = s.fifo.shape[0]
    dt = s.t_s.dtype
    cont = cx.continuous
    k, t, t_lo = s.steps, s.t_s, s.t_lo_s
    n_dec, n_real, n_run = s.n_dec, s.n_real, s.n_run
    first, tail, prefilled = s.fifo_first, s.fifo_tail, s.prefilled
    kv = _kv_tokens(cx, s)
    go = ~s.done & ~blocked & (n_run > 0)
    h = s.fifo[first % size]
    head_cum = s.slots.cum[h]
    head_end = head_cum + s.slots.need[h] - s.slots.hit[h]
    ctx0 = s.sum_base + n_dec * k
    # each decode's k proposals take budget too (vLLM counts them)
    left = jnp.maximum(cx.budget - n_dec * (cx.spec_tokens + 1), 0)
    has_pref = (first < tail) & (left > 0)
    chunk = jnp.where(has_pref, left, 0)
    cap_chunk = jnp.where(has_pref, (head_end - prefilled - 1) // jnp.maximum(left, 1),
                          _BIG)
    cap_done = jnp.where(n_real > 0, next_last - k + 1, _BIG)
    cap_kv = jnp.where(cont & (n_dec > 0) & (n_run > 1),
                       jnp.where(_spec_on(cx), _spec_overflow(cx, s, kv),
                                 (cx.capacity - kv) // jnp.maximum(n_dec, 1) + 1),
                       _BIG)
    # the run's ends other than the running prompt's
    cap_end = jnp.minimum(cap_done, cap_kv)
    horizon = jnp.minimum(cap_chunk, cap_end)
    p0 = jnp.where(has_pref, prefilled - head_cum + s.slots.hit[h], 0).astype(dt)
    chunk_f = chunk.astype(dt)
    # speculation: contexts grow by ``spec_gain`` tokens per step, each
    # decode verifying k + 1 tokens (``_verified``)
    ctx_t = _token_context(cx, s, ctx0.astype(dt), n_dec)
    dec_new, dec_keys = _verified(cx, dt, n_dec, ctx_t)
    grow = n_dec.astype(dt) * cx.spec_gain.astype(dt)
    spec = _spec_on(cx)
    lines = _lines(
        cx, dt, dec_new + chunk, ctx_t + p0,
        jnp.where(spec, grow + chunk_f, (n_dec + chunk).astype(dt)),
        dec_keys + p0 * chunk_f + chunk_f * (chunk_f + 1.0) / 2.0,
        jnp.where(spec, (cx.spec_tokens + 1).astype(dt) * grow, n_dec.astype(dt))
        + chunk_f * chunk_f,
        n_dec + has_pref.astype(n_dec.dtype),
    )
    if cx.model.draft_params is not None:
        # a draft model's passes: the run ends where they change from memory-
        # to compute-bound, so that within it they are one line each
        lines, cap_draft = _with_draft(cx, dt, lines, horizon, n_dec, ctx_t,
                                       jnp.where(spec, grow, n_dec.astype(dt)),
                                       chunk_f, p0)
        cap_end = jnp.minimum(cap_end, cap_draft)
        horizon = jnp.minimum(horizon, cap_draft)
    horizon = jnp.where(go, horizon, 0)
    split = roofline.split_at_crossing(lines, horizon)
    # the next new request, if it could join at a later step's start
    b_c = jnp.minimum(s.next_req, cx.arrival_s.shape[0] - 1)
    j_arr = _first_step_reaching(lines, split, horizon,
                                 (cx.arrival_s[b_c] - t) - t_lo)
    admissible = (cont & (s.n_wait == 0) & (s.next_req < cx.num_served)
                  & (n_run < cx.concurrency) & (j_arr <= horizon)
                  & (_kv_at(cx, s, jnp.minimum(j_arr, horizon)) + cx.prompt[b_c]
                     <= cx.capacity))
    j_arr = jnp.where(admissible, j_arr, _BIG)
    n_lin = jnp.minimum(horizon, j_arr)
    event = go & has_pref & (cap_chunk < jnp.minimum(cap_end, j_arr))
    run_s = _elapsed(lines, split, n_lin)
    slow_run = n_lin - _count_at_most(lines, n_lin, cx.itl_slo_s)
    # computed once, not in each slot update that reads them
    n_lin, event, split, lines, run_s, slow_run = materialize(
        (n_lin, event, split, lines, run_s, slow_run), turn)
    ramps = _run_ramps(lines, split, n_lin, n_real.astype(dt))

    q = prefilled + chunk * n_lin
    event_s, chunks, finished = _event_step(
        cx, s, q, left, n_dec, (ctx0 + n_dec * n_lin).astype(dt))
    t_run = _clock_add(t, t_lo, run_s)
    t_e = _clock_add(*t_run, event_s)
    slow_steps = s.slow_steps + jnp.where(
        go, slow_run + _n(event & (event_s > cx.itl_slo_s)), 0)
    s = s._replace(
        fifo_first=first + jnp.where(event, finished, 0),
        t_s=jnp.where(go, jnp.where(event, t_e[0], t_run[0]), t),
        t_lo_s=jnp.where(go, jnp.where(event, t_e[1], t_run[1]), t_lo),
        steps=k + jnp.where(go, n_lin + _n(event), 0),
        prefilled=jnp.where(go, jnp.where(event, q + chunks, q), prefilled),
        slow_steps=slow_steps,
        event_step=jnp.where(event, k + n_lin, s.event_step),
        event_s=jnp.where(event, t_e[0], s.event_s),
        event_lo_s=jnp.where(event, t_e[1], s.event_lo_s),
        event_slow=jnp.where(event, slow_steps, s.event_slow),
        batch_open=jnp.where(go, False, s.batch_open))
    return s, ramps, (event_s, jnp.where(event, n_real, 0).astype(dt))


def _spec_overflow(cx: _Ctx, s: _State, kv):
    """With speculation, the first step ``j`` of a run whose start finds the
    KV over the capacity (``_kv_at``): the linear estimate, then the exact
    answer among its neighbours."""
    dt = cx.spec_gain.dtype
    rate = jnp.maximum(s.n_dec, 1).astype(dt) * cx.spec_gain
    est = jnp.floor(jnp.clip((cx.capacity - kv).astype(dt) / rate, -1.0, 2.0**30))
    near = jnp.maximum(est.astype(jnp.int32) + jnp.arange(-1, 4, dtype=jnp.int32), 0)
    over = _kv_at(cx, s, near) > cx.capacity
    return jnp.where(over.any(), near[jnp.argmax(over)], near[-1] + 1)


def _iterate(cx: _Ctx, turn, s: _State) -> _State:
    """One loop turn.

    In order, each when due and nothing before it is still pending: one
    finished prompt starts decoding, one finished request leaves, one request
    is preempted, one is admitted; then the clock advances by a run of
    unchanged steps (and the step finishing a prompt, if that comes next).
    Slots are found through the FIFO ring and the two stacks, so only three
    plain reductions over the slots remain.
    """
    start = s
    s, pending = _start_decoding(cx, s)
    s, blocked, next_last, retired = _retire(cx, s, pending)
    s, blocked, preempted = _preempt(cx, s, blocked)
    s, blocked = _admit(cx, s, blocked)
    s, ramps, event = _advance(cx, turn, s, blocked, next_last)
    dt = s.t_s.dtype
    points = [retired, preempted, event]
    new = s._replace(
        iterations=s.iterations + _n(~start.done),
        status=s.status | jnp.where(
            cx.slots_short & (s.n_run + s.n_wait >= s.fifo.shape[0]), STATUS_SLOTS, 0),
        done=(s.next_req >= cx.num_served) & (s.n_run == 0) & (s.n_wait == 0),
        itl=_itl_add(s.itl, ramps, (jnp.stack([x for x, _ in points]).astype(dt),
                                    jnp.stack([w for _, w in points]).astype(dt))),
    )
    # sums of int32 are int64 under x64: keep the carry's dtypes
    return jax.tree.map(lambda x, old: x.astype(old.dtype), new, start)


def _initial(num_req: int, max_slots: int, dt) -> _State:
    i0 = jnp.zeros((), jnp.int32)
    zi = jnp.zeros(max_slots, jnp.int32)
    times = {"arrival_s": 0.0, "ttft_s": 0.0, "last_token_s": 0.0, "gap_s": -1.0}
    return _State(
        slots=Slots(**{name: jnp.full(max_slots, times[name], dt) if name in times
                       else jnp.zeros(max_slots, jnp.int32) for name in Slots._fields}),
        fifo=zi, fifo_head=i0, fifo_first=i0, fifo_tail=i0,
        # popped from the end: slot 0 first
        free_stack=jnp.arange(max_slots - 1, -1, -1, dtype=jnp.int32),
        n_free=jnp.asarray(max_slots, jnp.int32), wait_stack=zi, n_wait=i0,
        t_s=jnp.zeros((), dt), t_lo_s=jnp.zeros((), dt), steps=i0, next_req=i0,
        admissions=i0, queued=i0, prefilled=i0, slow_steps=i0, n_run=i0, n_dec=i0,
        n_real=i0, sum_base=i0, sum_prompt=i0, kv_prefill=i0, event_step=i0,
        event_s=jnp.zeros((), dt), event_lo_s=jnp.zeros((), dt), event_slow=i0,
        iterations=i0, preemptions=i0,
        batch_open=jnp.zeros((), bool), batch_prompt=i0, batch_output=i0, status=i0,
        done=jnp.zeros((), bool),
        ttft_s=jnp.full(num_req, jnp.nan, dt), e2e_s=jnp.full(num_req, jnp.nan, dt),
        good=jnp.zeros(num_req, bool), itl=_itl_empty(dt),
    )


def prompt_hits(prompt, prefix_hit_fraction, cached_tokens):
    """Each prompt's tokens found in the prefix cache: the larger of its
    share ``prefix_hit_fraction`` in whole blocks and its own
    ``cached_tokens`` (at most the prompt less one token)."""
    dt = prompt.dtype
    return jnp.maximum(
        roofline.cached_prefix_tokens(prompt, jnp.asarray(prefix_hit_fraction, dt)),
        jnp.clip(jnp.round(jnp.asarray(cached_tokens, dt)), 0.0, prompt - 1.0))


def simulate_requests(hw, model, tp, concurrency, token_budget, requests: Requests,
                      batching=CONTINUOUS, ttft_slo_s=jnp.inf, itl_slo_s=jnp.inf,
                      overlong=REJECT, mine=None, spec_tokens=0, spec_acceptance=0.0,
                      prefix_hit_fraction=0.0, cached_tokens=0.0, *, max_slots: int,
                      max_iterations: int | None = None,
                      turns_per_check: int = 64) -> SimOutcome:
    """Simulates one configuration and keeps per-request results.

    Args:
      hw: ``HardwareParams`` (scalar leaves).
      model: ``ModelParams`` (scalar leaves).
      tp: tensor-parallel GPUs.
      concurrency: most requests running at once (rounded down; request-at-a-time
        batching uses 1).
      token_budget: tokens per step (decodes + prefill chunks).
      requests: the stream (``sweep.latency.arrivals.Requests``); its float dtype is the
        simulation's time dtype.
      batching: a policy's index in ``sweep.model.batching.POLICIES`` (int).
      ttft_slo_s, itl_slo_s: SLOs for goodput.
      overlong: ``sweep.model.params`` ``REJECT`` or ``TRUNCATE`` (int): what becomes
        of a request whose prompt + output exceeds
        ``model.max_context_tokens`` (``sweep.latency.workload.context_limit``).
      mine: optional bool ``(R,)``: the requests this replica is offered (a
        load balancer's share, ``sweep.latency.arrivals.split``); the others are not
        served and not counted, as rejected ones are not served.
      spec_tokens, spec_acceptance: speculative decoding (n-gram proposals,
        no GPU time of their own, or a draft model's when ``model`` carries
        one, ``roofline.with_proposer``): every decode step verifies ``k`` proposals
        per request (k + 1 tokens of compute and of token budget, ``k`` KV
        slots) and gains the expected accepted tokens
        ``roofline.tokens_per_step(k, acceptance)``, a deterministic
        expectation rather than a draw per step. Its tokens arrive together:
        a request makes ``delivery_count`` deliveries, and the ITL samples are the
        gaps between deliveries (as a streaming client sees them). k = 0: off.
      prefix_hit_fraction: the share ``h < 1`` of each prompt found in the
        prefix cache (automatic prefix caching; a scalar, or ``(R,)``: each
        request's own, ``sweep.latency.arrivals.request_hits``): its first
        ``h P`` tokens in
        whole 16-token blocks (``roofline.cached_prefix_tokens``) are held
        in KV and read, not computed; the prompt's chunks start after them.
        A preempted request finds them again when readmitted. 0: off.
      cached_tokens: ``(R,)`` or a scalar: each prompt's tokens already in KV
        at admission, where more than the hit fraction's (at most the prompt
        less one: the last prompt token is computed and emits the first
        token); a disaggregated decode instance receives ``P - 1`` of them
        (``sweep.latency.disaggregated``), an LRU prefix cache of a trace's
        block hashes finds its hits (``sweep.latency.prefix_cache``).
      max_slots: static size of the slot arrays: the largest concurrency of a
        grid is always exact. A smaller size is faster under light load; if
        the slots ever fill up below the configuration's concurrency, status
        has ``STATUS_SLOTS`` and the metrics are NaN (rerun those points).
      max_iterations: static limit on loop turns (default ``16 R + 1024``);
        reaching it sets ``STATUS_RAN_OUT``.
      turns_per_check: static, loop turns between tests of the stop condition.
    """
    dt = jnp.asarray(requests.arrival_s).dtype
    num_req = requests.arrival_s.shape[0]
    if max_iterations is None:
        max_iterations = 16 * num_req + 1024
    prompt, output, fits = context_limit(
        jnp.maximum(jnp.round(requests.prompt_tokens), 1).astype(dt),
        jnp.maximum(jnp.round(requests.output_tokens), 1).astype(dt),
        jnp.asarray(model.max_context_tokens, dt),
        jnp.asarray(overlong) == TRUNCATE, xp=jnp)
    offered = jnp.ones(num_req, bool) if mine is None else jnp.asarray(mine, bool)
    served = offered & fits
    # served requests first, in arrival order; the rest are never admitted
    order = jnp.argsort(jnp.where(served, jnp.asarray(requests.arrival_s, dt),
                                  jnp.inf), stable=True)
    arrival = jnp.asarray(requests.arrival_s, dt)[order]
    spec_k = jnp.maximum(jnp.round(jnp.asarray(spec_tokens, dt)), 0.0)
    gain = roofline.tokens_per_step(spec_k, jnp.asarray(spec_acceptance, dt))
    deliveries = delivery_count(output, spec_k, gain)
    tp = jnp.asarray(tp, dt)
    conc = jnp.floor(jnp.asarray(concurrency, dt)).astype(jnp.int32)
    conc = running(jnp.asarray(batching), conc)
    cx = _Ctx(
        hw=hw, model=model, tp=tp,
        concurrency=jnp.clip(conc, 1, max_slots),
        slots_short=conc > max_slots,
        budget=jnp.maximum(jnp.floor(jnp.asarray(token_budget, dt)), 1).astype(
            jnp.int32),
        capacity=jnp.floor(jnp.clip(roofline.kv_capacity_tokens(hw, model, tp),
                                    -1.0, 2.0**30)).astype(jnp.int32),
        continuous=is_continuous(jnp.asarray(batching)),
        ttft_slo_s=jnp.asarray(ttft_slo_s, dt),
        itl_slo_s=jnp.asarray(itl_slo_s, dt),
        arrival_s=arrival, prompt=prompt[order].astype(jnp.int32),
        output=deliveries[order].astype(jnp.int32),
        output_tokens=output[order].astype(jnp.int32),
        num_served=served.sum(dtype=jnp.int32),
        spec_tokens=spec_k.astype(jnp.int32), spec_gain=gain.astype(dt),
        hit=prompt_hits(prompt, prefix_hit_fraction, cached_tokens)[order].astype(
            jnp.int32),
    )
    init = _initial(num_req, max_slots, dt)

    def block(s):
        return jax.lax.fori_loop(0, turns_per_check, lambda i, x: _iterate(cx, i, x), s)

    s = jax.lax.while_loop(lambda s: ~s.done & (s.iterations < max_iterations),
                           block, init)
    status = s.status | jnp.where(s.done, 0, STATUS_RAN_OUT)
    inverse = jnp.argsort(order)
    return SimOutcome(
        ttft_s=s.ttft_s[inverse], e2e_s=s.e2e_s[inverse], good=s.good[inverse],
        itl_hist=_itl_hist(s.itl), itl_min_s=s.itl.lo_s, itl_max_s=s.itl.hi_s,
        duration_s=s.t_s + s.t_lo_s, preemptions=s.preemptions, steps=s.steps,
        iterations=s.iterations, status=status, served=served,
        rejected=offered & ~fits, output_tokens=output, gaps=deliveries - 1.0,
    )


def itl_add_points(itl_hist, lo_s, hi_s, x, weight):
    """An assembled ITL histogram (``SimOutcome.itl_hist``) with samples
    ``x`` of mass ``weight`` added (both shape ``(R,)``; weight 0: none), and
    the smallest and largest gap with them: ``(itl_hist, lo_s, hi_s)``."""
    some = weight > 0
    return (itl_hist.at[_bin(x)].add(weight.astype(itl_hist.dtype)),
            jnp.minimum(lo_s, jnp.where(some, x, jnp.inf).min()),
            jnp.maximum(hi_s, jnp.where(some, x, -jnp.inf).max()))


def itl_percentiles(itl_hist, num_gaps, q, lo_s=-jnp.inf, hi_s=jnp.inf):
    """Percentiles of the ITL histogram (NumPy's linear method; bound in the
    module docstring).

    Args:
      itl_hist: ``SimOutcome.itl_hist``.
      num_gaps: the number of samples (``sum(output - 1)``).
      q: percentiles in ``[0, 100]``, shape ``(Q,)``.
      lo_s, hi_s: the smallest and largest gap (``SimOutcome.itl_min_s`` and
        ``itl_max_s``): every percentile lies between them, which also holds
        interpolation inside the first and last occupied bins to the truth.
    """
    dt = itl_hist.dtype
    edges = _edge(jnp.arange(ITL_BINS + 1, dtype=jnp.int32), dt)
    # running sums within each octave, then over octaves: rounding grows with
    # 512 and 24 terms, not 12,288
    rows = jnp.cumsum(itl_hist.reshape(ITL_OCTAVES, _ROW), axis=1)
    before_row = jnp.cumsum(rows[:, -1]) - rows[:, -1]
    cum = (rows + before_row[:, None]).ravel()
    n = jnp.asarray(num_gaps, dt)
    # the k-th order statistic (0-based) sits at cumulative count k + 1/2
    target = jnp.clip(jnp.asarray(q, dt) / 100.0 * (n - 1.0) + 0.5, 0.0, cum[-1])
    k = jnp.clip(jnp.searchsorted(cum, target, side="left"), 0, ITL_BINS - 1)
    before = cum[k] - itl_hist[k]
    frac = jnp.clip((target - before) / jnp.maximum(itl_hist[k], 1e-30), 0.0, 1.0)
    value = jnp.clip(edges[k] + frac * (edges[k + 1] - edges[k]), lo_s, hi_s)
    return jnp.where(n > 0, value, jnp.nan)


def summarize(outcome: SimOutcome) -> SimResult:
    """Percentiles and rates of a ``SimOutcome`` over its served requests.

    Metrics are NaN when the outcome is not valid, or when nothing was served.
    """
    ok = (outcome.status & (STATUS_RAN_OUT | STATUS_SLOTS)) == 0
    dt = outcome.ttft_s.dtype
    served = outcome.served
    nan = jnp.asarray(jnp.nan, dt)
    ttft = jnp.nanpercentile(jnp.where(served, outcome.ttft_s, nan),
                             jnp.array([50.0, 90.0, 99.0], dt))
    e2e_s = jnp.where(served, outcome.e2e_s, nan)
    # the p50 in a call of its own: XLA then compiles the p99 as it did when
    # only the p99 was used, bit for bit (together, one float32 ulp differs)
    e2e = (jnp.nanpercentile(e2e_s, jnp.array([50.0], dt))[0],
           jnp.nanpercentile(e2e_s, jnp.array([50.0, 99.0], dt))[1])
    output = jnp.where(served, outcome.output_tokens, 0.0)
    gaps = jnp.where(served, outcome.gaps, 0.0)
    itl = itl_percentiles(outcome.itl_hist, jnp.maximum(gaps, 0.0).sum(),
                          jnp.array([50.0, 90.0, 99.0], dt), outcome.itl_min_s,
                          outcome.itl_max_s)
    duration = outcome.duration_s
    offered = (served | outcome.rejected).sum(dtype=jnp.int32)

    def valid(x):
        return jnp.where(ok, x, jnp.nan)

    return SimResult(
        ttft_p50_s=valid(ttft[0]), ttft_p90_s=valid(ttft[1]), ttft_p99_s=valid(ttft[2]),
        itl_p50_s=valid(itl[0]), itl_p90_s=valid(itl[1]), itl_p99_s=valid(itl[2]),
        e2e_p50_s=valid(e2e[0]), e2e_p99_s=valid(e2e[1]),
        output_tokens_per_s=valid(output.sum() / duration),
        goodput_req_per_s=valid(outcome.good.sum().astype(dt) / duration),
        rejected_fraction=jnp.where(
            offered > 0, outcome.rejected.sum().astype(dt)
            / jnp.maximum(offered, 1).astype(dt), jnp.nan),
        duration_s=valid(duration),
        preemptions=outcome.preemptions, steps=outcome.steps,
        iterations=outcome.iterations, status=outcome.status,
    )


def pool(outcomes: SimOutcome, rows) -> SimOutcome:
    """The outcomes of several schedulers fed one stream, as one outcome.

    Replicas behind a load balancer each simulate their share
    (``simulate_requests`` with ``mine``); pooled, the percentiles are over
    every request of the stream, the ITL histogram is their sum, and rates
    are over the time the last replica finishes (every replica's clock starts
    at the stream's 0).

    Args:
      outcomes: ``SimOutcome`` with a leading axis ``K`` (one per scheduler).
      rows: bool ``(K,)``, the schedulers to pool (the others are ignored).
    """
    def mine(x, fill=0):
        """``x`` where the row is pooled, else ``fill`` (in ``x``'s dtype)."""
        keep = rows.reshape(rows.shape + (1,) * (x.ndim - 1))
        return jnp.where(keep, x, jnp.asarray(fill, x.dtype))

    def requests(x, fill=0):
        return mine(x, fill).reshape(-1)

    return SimOutcome(
        ttft_s=requests(outcomes.ttft_s, jnp.nan),
        e2e_s=requests(outcomes.e2e_s, jnp.nan),
        good=requests(outcomes.good),
        itl_hist=mine(outcomes.itl_hist).sum(0, dtype=outcomes.itl_hist.dtype),
        itl_min_s=mine(outcomes.itl_min_s, jnp.inf).min(),
        itl_max_s=mine(outcomes.itl_max_s, -jnp.inf).max(),
        duration_s=mine(outcomes.duration_s).max(),
        preemptions=mine(outcomes.preemptions).sum(dtype=outcomes.preemptions.dtype),
        steps=mine(outcomes.steps).sum(dtype=outcomes.steps.dtype),
        iterations=mine(outcomes.iterations).max(),
        status=jax.lax.reduce(mine(outcomes.status), jnp.zeros((), jnp.int32),
                              jax.lax.bitwise_or, (0,)),
        served=requests(outcomes.served),
        rejected=requests(outcomes.rejected),
        output_tokens=requests(outcomes.output_tokens),
        gaps=requests(outcomes.gaps),
    )


def simulate(hw, model, tp, concurrency, token_budget, requests: Requests,
             batching=CONTINUOUS, ttft_slo_s=jnp.inf, itl_slo_s=jnp.inf,
             overlong=REJECT, mine=None, spec_tokens=0, spec_acceptance=0.0,
             prefix_hit_fraction=0.0, cached_tokens=0.0, *, max_slots: int,
             max_iterations: int | None = None,
             turns_per_check: int = 64) -> SimResult:
    """Simulates one configuration; see ``simulate_requests`` for the arguments.

    Every argument before ``*`` may be traced, so a grid is
    ``jax.jit(jax.vmap(partial(simulate, max_slots=...)))``.
    """
    outcome = simulate_requests(
        hw, model, tp, concurrency, token_budget, requests, batching, ttft_slo_s,
        itl_slo_s, overlong, mine, spec_tokens, spec_acceptance, prefix_hit_fraction,
        cached_tokens, max_slots=max_slots,
        max_iterations=max_iterations, turns_per_check=turns_per_check)
    return summarize(outcome)
