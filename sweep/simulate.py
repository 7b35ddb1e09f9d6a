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

Speed. A loop turn per step would take ~60,000 turns per 1,000 requests. Here
one turn advances a whole *run* of steps whose batch does not change: no
admission, completion, preemption or finished prompt. Within a run the decode
contexts grow by one per step and the one prompt being prefilled takes the
same chunk each step, so the KV read and the attention FLOPs grow linearly in
the step index ``j``: step ``j`` lasts ``max(m0 + m j, c0 + c j) + fixed``,
and the run's duration, its ITL samples and its slow-step count follow in
closed form (the sum of a maximum of two lines splits at their crossing, as in
``roofline.chunked_prefill``). A run ends at the earliest of: the next
completion (the smallest remaining output), the step before the running prompt
finishes (that step, with its several chunks, is then taken in the same turn),
the next arrival that could be admitted (the step index at which the elapsed
time reaches it is solved from the quadratic and checked exactly), and the
next KV overflow. Per-request bookkeeping needs no update within a run:
a decoding request's context at global step ``k`` is ``base + k`` and it ends
at a fixed step index ``last``; prompts are one FIFO of token counts, so a
prompt's progress is ``clip(prefilled - cum, 0, need)`` of one shared
counter. A turn also retires one finished request, preempts one, and admits
one; it advances only when nothing else is due, so the rules keep their
order. That is about 3 turns per request.

Slots: requests occupy ``max_slots`` slots (the largest concurrency of a grid);
no per-step sort is needed. ``jax.vmap`` of a while loop would select the
whole carry (per-request outputs and the ITL histogram) every turn, so turns
run in blocks of ``turns_per_check`` inside a fixed-count loop (a finished
simulation's turns change nothing) and the while condition is tested only
between blocks.

Percentiles: TTFT and end-to-end latency are kept per request and use NumPy's
linear interpolation exactly. ITL samples (every gap between consecutive
tokens of every request) arrive as runs of linearly growing values, so they
go into a histogram of ``ITL_BINS_PER_OCTAVE`` log-spaced bins per octave from
``ITL_MIN_S`` seconds: each run adds a uniform density over
``[first - s/2, last + s/2]`` (``s`` = its per-step increment), spread exactly
over the bins it covers. A reported ITL percentile is within one bin
(``2**(1/256) - 1 = 0.27 %`` relative) plus half a step increment of NumPy's
value over the true samples.

Goodput: a request is good when its TTFT <= ``ttft_slo_s`` and its largest
inter-token gap <= ``itl_slo_s``; ``goodput_req_per_s`` is good requests over
the time the last request finishes (the clock starts at 0, before the first
arrival). ``output_tokens_per_s`` uses the same span.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sweep import roofline
from sweep.arrivals import Requests
from sweep.params import CONTINUOUS, REQUEST

FREE, PREFILL, DECODE, WAIT = range(4)
_BIG = 2**30  # "no limit" for step counts (int32)

STATUS_OK = 0
STATUS_RAN_OUT = 1
STATUS_OVERSIZE = 2
STATUS_SLOTS = 4
STATUS_MESSAGES = {
    STATUS_RAN_OUT: "the loop ran out of iterations before every request finished "
    "(metrics are NaN; raise max_iterations)",
    STATUS_OVERSIZE: "a request needed more KV than the capacity and ran alone",
    STATUS_SLOTS: "concurrency exceeds max_slots (clamped to max_slots)",
}
"""``status`` is a bit mask of these codes."""

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
    duration_s: jax.Array  # when the last request finishes
    preemptions: jax.Array  # int32
    steps: jax.Array  # int32, scheduler steps simulated
    iterations: jax.Array  # int32, loop turns used
    status: jax.Array  # int32 bit mask, see STATUS_MESSAGES


class SimOutcome(NamedTuple):
    """Per-request results and counters before summarising (``simulate_requests``)."""

    ttft_s: jax.Array  # shape=(R,), in the order of the input requests
    e2e_s: jax.Array  # shape=(R,)
    good: jax.Array  # shape=(R,), bool
    itl_hist: jax.Array  # shape=(ITL_BINS,), gaps per bin
    duration_s: jax.Array
    preemptions: jax.Array
    steps: jax.Array
    iterations: jax.Array
    status: jax.Array


class _Slots(NamedTuple):
    state: jax.Array  # FREE / PREFILL / DECODE / WAIT (preempted, waiting)
    req: jax.Array  # request index
    adm: jax.Array  # admission number (newest running = largest)
    pre: jax.Array  # preemption number (readmitted first = largest)
    cum: jax.Array  # prefill tokens queued before this prefill (FIFO position)
    need: jax.Array  # tokens this prefill computes: prompt + emitted
    prompt: jax.Array
    output: jax.Array
    emitted: jax.Array  # tokens emitted before the current prefill
    base: jax.Array  # decode context at global step k is base + k
    last: jax.Array  # global index of the step emitting the last token
    padding: jax.Array  # bool, static batching: done, still decoding padding
    slow: jax.Array  # steps slower than the ITL SLO before the last preemption
    slow_from: jax.Array  # slow-step counter when the decode phase began
    bad: jax.Array  # bool, a recompute gap exceeded the ITL SLO
    arrival_s: jax.Array
    first_s: jax.Array  # first-token time
    last_token_s: jax.Array  # last token before a preemption
    gap_s: jax.Array  # recompute gap not yet in the histogram (-1: none)


class _State(NamedTuple):
    slots: _Slots
    t_s: jax.Array  # end of the last step
    steps: jax.Array  # steps so far (the next step's global index)
    next_req: jax.Array  # first request never admitted
    admissions: jax.Array
    preempt_seq: jax.Array
    queued: jax.Array  # prefill tokens ever queued (FIFO tail position)
    prefilled: jax.Array  # prefill tokens done (FIFO head position)
    slow_steps: jax.Array  # steps slower than the ITL SLO so far
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
    hist_mass: jax.Array  # ITL mass placed directly in a bin
    hist_dens: jax.Array  # ITL density changes (mass per second) at bin starts


class _Ctx(NamedTuple):
    hw: object
    model: object
    tp: jax.Array
    concurrency: jax.Array  # int32
    budget: jax.Array  # int32
    capacity: jax.Array  # int32 KV tokens
    continuous: jax.Array  # bool
    ttft_slo_s: jax.Array
    itl_slo_s: jax.Array
    arrival_s: jax.Array  # shape=(R,), sorted
    prompt: jax.Array  # shape=(R,), int32
    output: jax.Array  # shape=(R,), int32


def _lines(cx: _Ctx, dt, new_tokens, kv0, kv_slope, keys0, keys_slope):
    """Step ``j`` of a run: memory ``m0 + m j``, compute ``c0 + c j``, plus ``fixed``.

    The same terms as ``roofline.step_s``, split into intercept and slope.
    """
    hw, model = cx.hw, cx.model
    new = new_tokens.astype(dt)
    kvb = roofline.kv_bytes_per_token(model)
    fpk = roofline.attention_flops_per_key(model)
    bw = hw.memory_bandwidth_bytes_per_s * hw.mbu
    peak = hw.peak_flops_per_s * hw.mfu
    m0 = (roofline.weight_bytes_read(model, new) + kv0.astype(dt) * kvb) / cx.tp / bw
    m = kv_slope.astype(dt) * kvb / cx.tp / bw
    c0 = (2.0 * model.active_params * new + fpk * keys0) / cx.tp / peak
    c = fpk * keys_slope / cx.tp / peak
    fixed = roofline.allreduce_s(hw, model, cx.tp, new) + hw.step_overhead_s
    return (m0, m, c0, c, fixed)


def _pieces(lines, horizon):
    """Splits steps ``0..horizon-1`` where the larger of the two lines changes.

    Returns ``(jc, (a, s), (b, r))``: step ``j < jc`` lasts ``a + s j``, a later
    one ``b + r j`` (plus ``fixed``).
    """
    m0, m, c0, c, _ = lines
    d0, ds = m0 - c0, m - c
    x = -d0 / jnp.where(ds == 0.0, 1.0, ds)
    h = horizon.astype(x.dtype)
    # memory wins from ceil(x) on (ds > 0) or up to floor(x) (ds < 0)
    jc = jnp.where(ds > 0, jnp.clip(jnp.ceil(x), 0.0, h),
                   jnp.where(ds < 0, jnp.clip(jnp.floor(x) + 1.0, 0.0, h), 0.0))
    memory_first = ds < 0
    memory_last = (ds > 0) | ((ds == 0) & (d0 >= 0))
    first = (jnp.where(memory_first, m0, c0), jnp.where(memory_first, m, c))
    second = (jnp.where(memory_last, m0, c0), jnp.where(memory_last, m, c))
    return jc.astype(jnp.int32), first, second


def _sum_linear(lo, hi, a, s):
    """``sum_{i=lo}^{hi-1} (a + s i)`` for ``lo <= hi`` (float)."""
    n = hi - lo
    return n * a + s * n * (hi + lo - 1.0) / 2.0


def _elapsed(lines, split, j):
    """Duration of the first ``j`` steps of a run (closed form)."""
    jc, (a, s), (b, r) = split
    dt = a.dtype
    j = j.astype(dt)
    k = jnp.minimum(jc.astype(dt), j)
    return _sum_linear(0.0, k, a, s) + _sum_linear(k, j, b, r) + j * lines[4]


def _step_time(lines, j):
    m0, m, c0, c, fixed = lines
    jf = j.astype(m0.dtype)
    return jnp.maximum(m0 + m * jf, c0 + c * jf) + fixed


def _first_step_reaching(lines, split, horizon, delay_s):
    """Smallest ``j`` in ``[1, horizon]`` with ``elapsed(j) >= delay_s``, else ``horizon + 1``.

    Solves the quadratic of the piece it falls in, then picks the answer among
    the neighbours of that estimate by evaluating ``_elapsed`` exactly as the
    run will (the estimate is off by far less than one step).
    """
    jc, (a, s), (b, r) = split
    fixed = lines[4]
    dt = a.dtype

    def root(lin, slope, delay):
        # smallest x >= 0 with lin x + slope x (x - 1) / 2 >= delay (stable form)
        p = lin - slope / 2.0
        disc = jnp.sqrt(jnp.maximum(p * p + 2.0 * slope * delay, 0.0))
        return jnp.where(delay > 0, 2.0 * delay / jnp.maximum(p + disc, 1e-30), 0.0)

    jcf = jc.astype(dt)
    x_first = root(a + fixed, s, delay_s)
    rest = delay_s - _elapsed(lines, split, jc)
    x_second = jcf + root(b + r * jcf + fixed, r, rest)
    x = jnp.where(x_first <= jcf, x_first, x_second)
    hf = horizon.astype(dt)
    guess = jnp.ceil(jnp.clip(x, 0.0, hf + 1.0)).astype(jnp.int32)
    near = jnp.clip(guess + jnp.arange(-2, 3), 1, horizon + 1)
    reached = _elapsed(lines, split, near) >= delay_s
    j = jnp.where(reached.any(), near[jnp.argmax(reached)], near[-1] + 1)
    return jnp.minimum(j, horizon + 1)


def _count_at_most(lines, n, limit_s):
    """How many of the run's first ``n`` steps last at most ``limit_s``.

    Step times never decrease along a run, so they form a prefix.
    """
    m0, m, c0, c, fixed = lines
    y = limit_s - fixed
    nf = n.astype(m0.dtype)

    def below(a, s):
        safe = jnp.where(s > 0, s, 1.0)
        k = jnp.clip(jnp.floor((y - a) / safe) + 1.0, 0.0, nf)
        return jnp.where(s > 0, k, jnp.where(a <= y, nf, 0.0))

    k = jnp.minimum(below(m0, m), below(c0, c)).astype(jnp.int32)
    # rounding in the division: settle on the exact boundary
    fast = _step_time(lines, k + jnp.arange(-1, 1)) <= limit_s
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


def _ramp(x0, x1, weight):
    """Histogram updates for mass ``weight`` spread uniformly over ``[x0, x1]``.

    Returns ``(mass_index, mass_value, dens_index, dens_value)``, two of each;
    the bin masses always add up to ``weight``.
    """
    dt = x0.dtype
    k0, k1 = _bin(x0), _bin(x1)
    same = k0 == k1
    rho = weight / jnp.where(same, 1.0, x1 - x0)
    mass_idx = jnp.stack([k0, k1])
    mass_val = jnp.stack([
        jnp.where(same, weight, rho * (_edge(k0 + 1, dt) - x0)),
        jnp.where(same, 0.0, rho * (x1 - _edge(k1, dt))),
    ])
    interior = jnp.where(k1 > k0 + 1, rho, 0.0)
    dens_idx = jnp.stack([jnp.minimum(k0 + 1, ITL_BINS - 1), k1])
    dens_val = jnp.stack([interior, -interior])
    return mass_idx, mass_val, dens_idx, dens_val


def _run_ramps(lines, split, n, weight):
    """``(x0, x1, mass)`` of the ITL samples of a run's first ``n`` steps (2 pieces)."""
    jc, (a, s), (b, r) = split
    k = jnp.minimum(jc, n)
    lo = jnp.stack([jnp.zeros_like(k), k]).astype(a.dtype)
    count = jnp.stack([k, n - k]).astype(a.dtype)
    c0, c = jnp.stack([a, b]), jnp.stack([s, r])
    first = c0 + c * lo + lines[4]
    x0 = first - c / 2.0
    x1 = jnp.maximum(first + c * (count - 1.0) + c / 2.0, x0)
    return x0, x1, weight * count


def _barrier(*xs):
    return jax.lax.optimization_barrier(xs)


def _put(mask, new, old):
    return jnp.where(mask, new, old)


def _iterate(cx: _Ctx, s: _State) -> _State:
    """One loop turn: retire one, preempt one, admit one, then maybe advance."""
    sl = s.slots
    dt = s.t_s.dtype
    num_req = cx.arrival_s.shape[0]
    iota = jnp.arange(sl.state.shape[0])
    active = ~s.done
    k = s.steps
    t = s.t_s

    # 1. a request that emitted its last token leaves (one per turn)
    real = (sl.state == DECODE) & ~sl.padding
    fin = real & (sl.last < k)
    n_fin = fin.sum()
    r = jnp.argmax(fin)
    do_fin = active & (n_fin > 0)
    ttft_r = sl.first_s[r] - sl.arrival_s[r]
    slow_r = sl.slow[r] + s.slow_steps - sl.slow_from[r]
    good_r = (ttft_r <= cx.ttft_slo_s) & (slow_r == 0) & ~sl.bad[r]
    out = jnp.where(do_fin, sl.req[r], num_req)
    ttft_s = s.ttft_s.at[out].set(ttft_r, mode="drop")
    e2e_s = s.e2e_s.at[out].set(t - sl.arrival_s[r], mode="drop")
    good = s.good.at[out].set(good_r, mode="drop")
    # histogram points of this turn: (value, weight)
    fin_gap = (sl.gap_s[r], jnp.where(do_fin & (sl.gap_s[r] >= 0), 1.0, 0.0))
    batch_end = do_fin & ~cx.continuous & (real.sum() == 1)
    do_fin, r, batch_end = _barrier(do_fin, r, batch_end)
    hit = do_fin & (iota == r)
    state = _put(hit & cx.continuous, FREE, sl.state)
    padding = sl.padding | (hit & ~cx.continuous)
    gap_s = _put(hit, -1.0, sl.gap_s)
    # static batching: the batch ends with its longest output
    state = _put(batch_end & (state == DECODE), FREE, state)
    blocked = n_fin > 1

    # 2. preemption by recompute when decoding outgrew the KV cache
    running = (state == PREFILL) | (state == DECODE)
    n_run = running.sum()
    kv_slot = jnp.where(state == DECODE, sl.base + k,
                        jnp.where(state == PREFILL, sl.need, 0))
    kv = kv_slot.sum()
    do_pre = active & ~blocked & cx.continuous & (kv > cx.capacity) & (n_run > 1)
    v = jnp.argmax(jnp.where(running, sl.adm, -1))
    v_dec = state[v] == DECODE
    emitted_v = jnp.where(v_dec, sl.base[v] + k - sl.prompt[v], sl.emitted[v])
    undo = do_pre & ~v_dec  # the newest prefill is the FIFO's tail
    queued = s.queued - jnp.where(undo, sl.need[v], 0)
    prefilled = jnp.where(undo, jnp.minimum(s.prefilled, sl.cum[v]), s.prefilled)
    pre_gap = (gap_s[v], jnp.where(do_pre & (gap_s[v] >= 0), 1.0, 0.0))
    do_pre, v, v_dec, emitted_v, queued, prefilled = _barrier(
        do_pre, v, v_dec, emitted_v, queued, prefilled)
    hit = do_pre & (iota == v)
    state = _put(hit, WAIT, state)
    emitted = _put(hit, emitted_v, sl.emitted)
    need = _put(hit, sl.prompt + emitted_v, sl.need)
    last_token_s = _put(hit & v_dec, t, sl.last_token_s)
    slow = _put(hit & v_dec, sl.slow + s.slow_steps - sl.slow_from, sl.slow)
    pre = _put(hit, s.preempt_seq, sl.pre)
    gap_s = _put(hit, -1.0, gap_s)
    kv = kv - jnp.where(do_pre, kv_slot[v], 0)
    n_run = n_run - do_pre
    blocked = blocked | (do_pre & (kv > cx.capacity) & (n_run > 1))

    # 3. admission of the queue's head (one per turn)
    waiting = state == WAIT
    n_wait = waiting.sum()
    w = jnp.argmax(jnp.where(waiting, pre, -1))
    a = s.next_req
    a_c = jnp.minimum(a, num_req - 1)
    has_new = a < num_req
    idle = active & ~blocked & (n_run == 0) & (n_wait == 0) & has_new
    t = jnp.where(idle, jnp.maximum(t, cx.arrival_s[a_c]), t)
    from_wait = n_wait > 0
    head_prompt = jnp.where(from_wait, sl.prompt[w], cx.prompt[a_c])
    head_output = jnp.where(from_wait, sl.output[w], cx.output[a_c])
    head_need = jnp.where(from_wait, need[w], cx.prompt[a_c])
    arrived = from_wait | (has_new & (cx.arrival_s[a_c] <= t))
    empty = n_run == 0
    batch_prompt = jnp.where(empty, 0, s.batch_prompt)
    batch_output = jnp.where(empty, 0, s.batch_output)
    fits = jnp.where(
        cx.continuous,
        kv + head_need <= cx.capacity,
        batch_prompt + head_prompt + (n_run + 1) * jnp.maximum(batch_output, head_output)
        <= cx.capacity,
    )
    may_open = cx.continuous | empty | s.batch_open
    do_adm = (active & ~blocked & arrived & may_open & (n_run < cx.concurrency)
              & (fits | empty))
    status = s.status | jnp.where(do_adm & ~fits, STATUS_OVERSIZE, 0)
    slot = jnp.where(from_wait, w, jnp.argmax(state == FREE))
    do_adm, slot, from_wait, a_c = _barrier(do_adm, slot, from_wait, a_c)
    hit = do_adm & (iota == slot)
    fresh = hit & ~from_wait
    state = _put(hit, PREFILL, state)
    adm = _put(hit, s.admissions, sl.adm)
    cum = _put(hit, queued, sl.cum)
    req = _put(fresh, a, sl.req)
    prompt = _put(fresh, cx.prompt[a_c], sl.prompt)
    output = _put(fresh, cx.output[a_c], sl.output)
    arrival_s = _put(fresh, cx.arrival_s[a_c], sl.arrival_s)
    emitted = _put(fresh, 0, emitted)
    need = _put(fresh, cx.prompt[a_c], need)
    slow = _put(fresh, 0, slow)
    bad = _put(fresh, False, sl.bad)
    padding = _put(fresh, False, padding)
    queued = queued + jnp.where(do_adm, head_need, 0)
    next_req = a + (do_adm & ~from_wait)
    kv = kv + jnp.where(do_adm, head_need, 0)
    n_run = n_run + do_adm
    batch_prompt = batch_prompt + jnp.where(do_adm, head_prompt, 0)
    batch_output = jnp.where(do_adm, jnp.maximum(batch_output, head_output),
                             batch_output)
    n_wait = n_wait - (do_adm & from_wait)
    b_c = jnp.minimum(next_req, num_req - 1)
    again = (n_wait > 0) | ((next_req < num_req) & (cx.arrival_s[b_c] <= t))
    blocked = blocked | (do_adm & again & (n_run < cx.concurrency))

    state, cum, need, emitted, padding = _barrier(state, cum, need, emitted, padding)

    # 4. advance: a run of unchanged steps, then the step finishing a prompt
    go = active & ~blocked & (n_run > 0)
    dec = state == DECODE
    real = dec & ~padding
    n_dec = dec.sum()
    n_real = real.sum()
    ctx0 = jnp.where(dec, sl.base, 0).sum() + n_dec * k
    pf = (state == PREFILL) & (cum + need > prefilled)
    head_cum = jnp.min(jnp.where(pf, cum, _BIG))
    head_end = jnp.min(jnp.where(pf, cum + need, _BIG))
    left = jnp.maximum(cx.budget - n_dec, 0)
    has_pref = (queued > prefilled) & (left > 0)
    chunk = jnp.where(has_pref, left, 0)
    cap_chunk = jnp.where(has_pref, (head_end - prefilled - 1) // jnp.maximum(left, 1),
                          _BIG)
    cap_done = jnp.where(n_real > 0, jnp.min(jnp.where(real, sl.last, _BIG)) - k + 1,
                         _BIG)
    cap_kv = jnp.where(cx.continuous & (n_dec > 0) & (n_run > 1),
                       (cx.capacity - kv) // jnp.maximum(n_dec, 1) + 1, _BIG)
    horizon = jnp.minimum(jnp.minimum(cap_chunk, cap_done), cap_kv)
    horizon = jnp.where(go, horizon, 0)
    p0 = jnp.where(has_pref, prefilled - head_cum, 0)
    chunk_f = chunk.astype(dt)
    lines = _lines(
        cx, dt, n_dec + chunk, ctx0 + p0, n_dec + chunk,
        (ctx0 + p0 * chunk).astype(dt) + chunk_f * (chunk_f + 1.0) / 2.0,
        (n_dec + chunk * chunk).astype(dt),
    )
    split = _pieces(lines, horizon)
    # the next new request, if it could join at a later step's start
    j_arr = _first_step_reaching(lines, split, horizon, cx.arrival_s[b_c] - t)
    admissible = (cx.continuous & (n_wait == 0) & (next_req < num_req)
                  & (n_run < cx.concurrency) & (j_arr <= horizon)
                  & (kv + n_dec * jnp.minimum(j_arr, horizon) + cx.prompt[b_c]
                     <= cx.capacity))
    j_arr = jnp.where(admissible, j_arr, _BIG)
    n_lin = jnp.minimum(horizon, j_arr)
    event = go & has_pref & (cap_chunk < jnp.minimum(jnp.minimum(cap_done, cap_kv),
                                                     j_arr))
    run_s = _elapsed(lines, split, n_lin)
    slow_run = n_lin - _count_at_most(lines, n_lin, cx.itl_slo_s)
    run_x0, run_x1, run_w = _run_ramps(lines, split, n_lin, n_real.astype(dt))

    # XLA would otherwise recompute this scalar chain inside every slot update
    n_lin, event, run_s, slow_run, left, n_dec, n_real, ctx0 = _barrier(
        n_lin, event, run_s, slow_run, left, n_dec, n_real, ctx0)

    # the event step: decodes plus chunks of every prompt the budget reaches
    k_e = k + n_lin
    q = prefilled + chunk * n_lin
    ctx_e = ctx0 + n_dec * n_lin
    done_old = jnp.clip(q - cum, 0, need)
    taken = jnp.where(state == PREFILL, jnp.clip(q + left - cum, 0, need) - done_old, 0)
    taken_f = taken.astype(dt)
    chunks = taken.sum()
    zero = jnp.zeros((), jnp.int32)
    e_lines = _lines(
        cx, dt, n_dec + chunks, ctx_e + jnp.where(taken > 0, done_old, 0).sum(), zero,
        ctx_e.astype(dt) + (taken_f * done_old.astype(dt)
                            + taken_f * (taken_f + 1.0) / 2.0).sum(),
        jnp.zeros((), dt),
    )
    event_s = _step_time(e_lines, zero)
    t_e = t + run_s + event_s
    q_e = q + chunks
    ready = jnp.where(cx.continuous, (taken > 0) & (done_old + taken == need),
                      q_e == queued)
    event_s, t_e, q_e, k_e = _barrier(event_s, t_e, q_e, k_e)
    tr = event & (state == PREFILL) & ready
    points = jnp.stack([fin_gap[0], pre_gap[0], event_s]).astype(dt)
    point_w = jnp.stack([fin_gap[1], pre_gap[1],
                         jnp.where(event, n_real, 0)]).astype(dt)
    mass_idx, mass_val, dens_idx, dens_val = _ramp(
        jnp.concatenate([run_x0, points]), jnp.concatenate([run_x1, points]),
        jnp.concatenate([run_w, point_w]))

    slow_steps = s.slow_steps + jnp.where(
        go, slow_run + (event & (event_s > cx.itl_slo_s)), 0)
    new_gap = t_e - last_token_s
    recompute = tr & (emitted > 0)
    tr, recompute, new_gap, slow_steps = _barrier(tr, recompute, new_gap, slow_steps)
    slots = _Slots(
        state=_put(tr, DECODE, state),
        req=req,
        adm=adm,
        pre=pre,
        cum=cum,
        need=need,
        prompt=prompt,
        output=output,
        emitted=emitted,
        base=_put(tr, prompt + emitted - k_e, sl.base),
        last=_put(tr, k_e + output - emitted - 1, sl.last),
        padding=padding,
        slow=slow,
        slow_from=_put(tr, slow_steps, sl.slow_from),
        bad=bad | (recompute & (new_gap > cx.itl_slo_s)),
        arrival_s=arrival_s,
        first_s=_put(tr & (emitted == 0), t_e, sl.first_s),
        last_token_s=last_token_s,
        gap_s=_put(recompute, new_gap, gap_s),
    )
    steps = k + jnp.where(go, n_lin + event, 0)
    done = (next_req >= num_req) & jnp.all(slots.state == FREE)
    new = _State(
        slots=slots,
        t_s=jnp.where(go, jnp.where(event, t_e, t + run_s), t),
        steps=steps,
        next_req=next_req,
        admissions=s.admissions + do_adm,
        preempt_seq=s.preempt_seq + do_pre,
        queued=queued,
        prefilled=jnp.where(go, jnp.where(event, q_e, q), prefilled),
        slow_steps=slow_steps,
        iterations=s.iterations + active,
        preemptions=s.preemptions + do_pre,
        batch_open=jnp.where(go, False, s.batch_open | do_adm),
        batch_prompt=batch_prompt,
        batch_output=batch_output,
        status=status,
        done=done,
        ttft_s=ttft_s,
        e2e_s=e2e_s,
        good=good,
        hist_mass=s.hist_mass.at[mass_idx.ravel()].add(mass_val.ravel()),
        hist_dens=s.hist_dens.at[dens_idx.ravel()].add(dens_val.ravel()),
    )
    # sums of int32 are int64 under x64: keep the carry's dtypes
    return jax.tree.map(lambda x, old: x.astype(old.dtype), new, s)


def _initial(num_req: int, max_slots: int, dt) -> _State:
    zi = jnp.zeros(max_slots, jnp.int32)
    zf = jnp.zeros(max_slots, dt)
    zb = jnp.zeros(max_slots, bool)
    slots = _Slots(state=zi, req=zi, adm=zi, pre=zi, cum=zi, need=zi, prompt=zi,
                   output=zi, emitted=zi, base=zi, last=zi, padding=zb, slow=zi,
                   slow_from=zi, bad=zb, arrival_s=zf, first_s=zf, last_token_s=zf,
                   gap_s=zf - 1.0)
    i0 = jnp.zeros((), jnp.int32)
    return _State(
        slots=slots, t_s=jnp.zeros((), dt), steps=i0, next_req=i0, admissions=i0,
        preempt_seq=i0, queued=i0, prefilled=i0, slow_steps=i0, iterations=i0,
        preemptions=i0, batch_open=jnp.zeros((), bool), batch_prompt=i0,
        batch_output=i0, status=i0, done=jnp.zeros((), bool),
        ttft_s=jnp.full(num_req, jnp.nan, dt), e2e_s=jnp.full(num_req, jnp.nan, dt),
        good=jnp.zeros(num_req, bool), hist_mass=jnp.zeros(ITL_BINS, dt),
        hist_dens=jnp.zeros(ITL_BINS, dt),
    )


def simulate_requests(hw, model, tp, concurrency, token_budget, requests: Requests,
                      batching=CONTINUOUS, ttft_slo_s=jnp.inf, itl_slo_s=jnp.inf, *,
                      max_slots: int, max_iterations: int | None = None,
                      turns_per_check: int = 64) -> SimOutcome:
    """Simulates one configuration and keeps per-request results.

    Args:
      hw: ``HardwareParams`` (scalar leaves).
      model: ``ModelParams`` (scalar leaves).
      tp: tensor-parallel GPUs.
      concurrency: most requests running at once (rounded down; request-at-a-time
        batching uses 1).
      token_budget: tokens per step (decodes + prefill chunks).
      requests: the stream (``sweep.arrivals.Requests``); its float dtype is the
        simulation's time dtype.
      batching: ``sweep.params`` ``REQUEST``, ``STATIC`` or ``CONTINUOUS`` (int).
      ttft_slo_s, itl_slo_s: SLOs for goodput.
      max_slots: static, the largest concurrency that will be simulated.
      max_iterations: static limit on loop turns (default ``16 R + 1024``);
        reaching it sets ``STATUS_RAN_OUT``.
      turns_per_check: static, loop turns between tests of the stop condition.
    """
    dt = jnp.asarray(requests.arrival_s).dtype
    num_req = requests.arrival_s.shape[0]
    if max_iterations is None:
        max_iterations = 16 * num_req + 1024
    order = jnp.argsort(requests.arrival_s, stable=True)
    arrival = jnp.asarray(requests.arrival_s, dt)[order]
    prompt = jnp.maximum(jnp.round(requests.prompt_tokens[order]), 1).astype(jnp.int32)
    output = jnp.maximum(jnp.round(requests.output_tokens[order]), 1).astype(jnp.int32)
    tp = jnp.asarray(tp, dt)
    conc = jnp.floor(jnp.asarray(concurrency, dt)).astype(jnp.int32)
    conc = jnp.where(jnp.asarray(batching) == REQUEST, 1, conc)
    cx = _Ctx(
        hw=hw, model=model, tp=tp,
        concurrency=jnp.clip(conc, 1, max_slots),
        budget=jnp.maximum(jnp.floor(jnp.asarray(token_budget, dt)), 1).astype(
            jnp.int32),
        capacity=jnp.floor(jnp.clip(roofline.kv_capacity_tokens(hw, model, tp),
                                    -1.0, 2.0**30)).astype(jnp.int32),
        continuous=jnp.asarray(batching) == CONTINUOUS,
        ttft_slo_s=jnp.asarray(ttft_slo_s, dt),
        itl_slo_s=jnp.asarray(itl_slo_s, dt),
        arrival_s=arrival, prompt=prompt, output=output,
    )
    init = _initial(num_req, max_slots, dt)
    init = init._replace(status=jnp.where(conc > max_slots, STATUS_SLOTS, 0))

    def block(s):
        return jax.lax.fori_loop(0, turns_per_check, lambda _, x: _iterate(cx, x), s)

    s = jax.lax.while_loop(lambda s: ~s.done & (s.iterations < max_iterations),
                           block, init)
    status = s.status | jnp.where(s.done, 0, STATUS_RAN_OUT)
    inverse = jnp.argsort(order)
    dens = jnp.cumsum(s.hist_dens)
    edges = _edge(jnp.arange(ITL_BINS + 1), dt)
    return SimOutcome(
        ttft_s=s.ttft_s[inverse], e2e_s=s.e2e_s[inverse], good=s.good[inverse],
        itl_hist=s.hist_mass + dens * jnp.diff(edges),
        duration_s=s.t_s, preemptions=s.preemptions, steps=s.steps,
        iterations=s.iterations, status=status,
    )


def itl_percentiles(itl_hist, num_gaps, q):
    """Percentiles of the ITL histogram (NumPy's linear method, within one bin).

    Args:
      itl_hist: ``SimOutcome.itl_hist``.
      num_gaps: the number of samples (``sum(output - 1)``).
      q: percentiles in ``[0, 100]``, shape ``(Q,)``.
    """
    dt = itl_hist.dtype
    edges = _edge(jnp.arange(ITL_BINS + 1), dt)
    cum = jnp.cumsum(itl_hist)
    n = jnp.asarray(num_gaps, dt)
    # the k-th order statistic (0-based) sits at cumulative count k + 1/2
    target = jnp.clip(jnp.asarray(q, dt) / 100.0 * (n - 1.0) + 0.5, 0.0, cum[-1])
    k = jnp.clip(jnp.searchsorted(cum, target, side="left"), 0, ITL_BINS - 1)
    before = cum[k] - itl_hist[k]
    frac = jnp.clip((target - before) / jnp.maximum(itl_hist[k], 1e-30), 0.0, 1.0)
    value = edges[k] + frac * (edges[k + 1] - edges[k])
    return jnp.where(n > 0, value, jnp.nan)


def summarize(outcome: SimOutcome, requests: Requests) -> SimResult:
    """Percentiles and rates of a ``SimOutcome``; NaN when the loop ran out."""
    ok = (outcome.status & STATUS_RAN_OUT) == 0
    dt = outcome.ttft_s.dtype
    ttft = jnp.percentile(outcome.ttft_s, jnp.array([50.0, 90.0, 99.0], dt))
    e2e = jnp.percentile(outcome.e2e_s, jnp.array([50.0, 99.0], dt))
    output = jnp.maximum(jnp.round(requests.output_tokens), 1.0).astype(dt)
    itl = itl_percentiles(outcome.itl_hist, (output - 1.0).sum(),
                          jnp.array([50.0, 90.0, 99.0], dt))
    duration = outcome.duration_s

    def valid(x):
        return jnp.where(ok, x, jnp.nan)

    return SimResult(
        ttft_p50_s=valid(ttft[0]), ttft_p90_s=valid(ttft[1]), ttft_p99_s=valid(ttft[2]),
        itl_p50_s=valid(itl[0]), itl_p90_s=valid(itl[1]), itl_p99_s=valid(itl[2]),
        e2e_p50_s=valid(e2e[0]), e2e_p99_s=valid(e2e[1]),
        output_tokens_per_s=valid(output.sum() / duration),
        goodput_req_per_s=valid(outcome.good.sum().astype(dt) / duration),
        duration_s=valid(duration),
        preemptions=outcome.preemptions, steps=outcome.steps,
        iterations=outcome.iterations, status=outcome.status,
    )


def simulate(hw, model, tp, concurrency, token_budget, requests: Requests,
             batching=CONTINUOUS, ttft_slo_s=jnp.inf, itl_slo_s=jnp.inf, *,
             max_slots: int, max_iterations: int | None = None,
             turns_per_check: int = 64) -> SimResult:
    """Simulates one configuration; see ``simulate_requests`` for the arguments.

    Every argument before ``*`` may be traced, so a grid is
    ``jax.jit(jax.vmap(partial(simulate, max_slots=...)))``.
    """
    outcome = simulate_requests(
        hw, model, tp, concurrency, token_budget, requests, batching, ttft_slo_s,
        itl_slo_s, max_slots=max_slots, max_iterations=max_iterations,
        turns_per_check=turns_per_check)
    return summarize(outcome, requests)
