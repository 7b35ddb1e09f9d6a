"""Plain-Python reference of the serving scheduler: one loop turn per step.

The ground truth for ``sweep.latency.simulate``. It follows the SPEC's "p99 latency"
rules literally, in float64, with none of the simulator's shortcuts (no runs
of steps, no histograms), plus the simulator's documented choices:

* continuous batching: FCFS admission while fewer than ``concurrency`` run and
  the running requests' KV (prompt + generated so far) plus the new prompt
  fit; each step decodes every prefilled request, then gives the rest of the
  token budget to unfinished prompts in admission order. If at a step's start
  the running KV exceeds the capacity (decodes grew it), the newest running
  request is preempted by recompute (vLLM's policy): it goes to the front of
  the waiting queue (last preempted first) and, when readmitted, prefills its
  prompt plus its generated tokens again; the step that finishes that prefill
  emits its next token.
* static batching: a batch of up to ``concurrency`` arrived requests is
  admitted only when nothing runs, reserving ``sum(prompt) + size * max(output)``
  KV tokens; its prompts are prefilled (chunked under the budget), the whole
  batch's first tokens come with the step that finishes its last prompt, then
  every member decodes (finished ones as padding) until the longest output
  ends. Request-at-a-time is static batching with batches of one.
* a request that does not fit the KV capacity even alone is admitted when
  nothing else runs (and flagged).
* a request whose prompt + output exceeds the model's context is dropped
  before scheduling (vLLM rejects it), or with truncation keeps the last
  ``context - output`` prompt tokens (at least one) and stops its output when
  the sequence reaches the context.
* speculative decoding (``spec_tokens`` k > 0, n-gram proposals that cost
  nothing): every decode computes k + 1 tokens (token j attending to its
  context + j keys) and takes k + 1 tokens of the budget; it delivers
  ``gain = sum_{j=0..k} a^j`` tokens (the expectation, not a draw), so an
  output of L tokens takes ``1 + ceil((L - 1) / gain)`` deliveries, the
  context after d deliveries is ``prompt + 1 + gain (d - 1)`` tokens, each
  decoding request holds k more KV slots (the running total rounded up to
  whole tokens), and a preempted one recomputes ``round(1 + gain (d - 1))``
  generated tokens. ITL samples are the gaps between deliveries. With a
  draft model (the model's ``draft_*`` sizes non-zero) each step also
  takes the draft's k passes (``draft_time_s``): the first over its decodes
  and its prompt chunks, the other k - 1 over the decodes; the KV capacity
  counts both models.
* prefix caching (``prefix_hit_fraction`` h): a request's first
  ``floor(h P / 16) * 16`` prompt tokens (whole 16-token blocks) are in the
  cache whenever it is admitted (readmissions too): they are held in KV and
  count as prefilled, so its chunks start after them and read them.

* a prefix cache of the trace's block hashes (``prefix_cache`` = (hashes,
  block tokens)): at a request's first admission its cached prefix is its
  leading hashed blocks found in an LRU cache (an ``OrderedDict`` of
  blocks and their tokens, at most the KV capacity), at most its prompt less
  one token; then its blocks, and one block of the rest of its KV (prompt
  tail and output), become the most recent and the least recent are evicted
  while the cache holds more than the capacity. A truncated prompt shares
  no block; a readmission keeps the hit.
* per-request cached tokens (``cached_tokens``, overriding the hit fraction):
  a request's first ``cached_tokens[i]`` prompt tokens are in KV whenever it
  is admitted, as above (a disaggregated decode instance receives the
  prompt's KV: all of it but the last token, which it computes).
* disaggregated prefill/decode (``simulate_disaggregated_reference``): the
  stream goes round-robin over ``p`` prefill instances, each this scheduler
  with every output one token; the requests that go on to decode are dealt
  round-robin over ``d`` decode instances in the order their prefills end;
  each one's KV transfer ``P kv_bytes_per_token / (tp link)`` starts when
  its prefill has ended and both its prefill instance's link and its decode
  instance's link are free (one transfer at a time on each, in that
  order), and its first token comes when the transfer ends (a request of
  one output token: prefill end plus its transfer, no link shared); it
  then arrives at its decode instance
  with ``P - 1`` prompt tokens cached and ``output - 1`` tokens to make; the
  decode instance's first token is the request's second (its wait for a slot
  is the first inter-token gap).

Step times come from a small float64 copy of the roofline formulas
(``step_time_s``), written out here rather than imported.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

REQUEST, STATIC, CONTINUOUS = range(3)


def _f(x) -> float:
    return float(np.asarray(x, dtype=np.float64))


def step_time_s(hw, model, tp, new_tokens, kv_read_tokens, attention_keys,
                sequences=0) -> float:
    """The roofline step time in float64 (SPEC "execution model"), with the
    calibrated KV-read utilisation and time per sequence."""
    tp = _f(tp)
    frac = _f(model.experts_per_token_fraction)
    touched = 1.0 if frac >= 1.0 else -math.expm1(new_tokens * math.log1p(-frac))
    weights = (_f(model.shared_params) + _f(model.expert_params) * touched) * _f(
        model.weight_dtype_bytes)
    kvb = (2.0 * _f(model.layers) * _f(model.kv_heads) * _f(model.head_dim)
           * _f(model.kv_dtype_bytes))
    flops = (2.0 * _f(model.active_params) * new_tokens
             + 4.0 * _f(model.layers) * _f(model.q_heads) * _f(model.head_dim)
             * attention_keys)
    memory_s = (weights / _f(hw.mbu) + kv_read_tokens * kvb / _f(hw.kv_mbu)) / tp / (
        _f(hw.memory_bandwidth_bytes_per_s))
    compute_s = flops / tp / (_f(hw.peak_flops_per_s) * _f(hw.mfu))
    allreduce_s = (2.0 * _f(model.layers) * 2.0 * (tp - 1.0) / tp * new_tokens
                   * _f(model.hidden_size) * 2.0 / _f(hw.interconnect_bytes_per_s))
    return (max(memory_s, compute_s) + allreduce_s + _f(hw.step_overhead_s)
            + _f(hw.sequence_overhead_s) * sequences)


def draft_time_s(hw, model, tp, decodes, context_tokens, k, chunk_tokens=0.0,
                 chunk_cached_tokens=0.0, chunk_keys=0.0) -> float:
    """The draft model's k passes in a step with ``decodes`` decodes of
    summed context ``context_tokens`` and prompt chunks of ``chunk_tokens``
    new tokens in all, after ``chunk_cached_tokens`` cached ones, attending
    to ``chunk_keys`` keys (0 without a draft model, at k = 0, or with
    neither decodes nor chunks). Each pass reads the draft's weights and its
    KV of what it attends to and computes its tokens, with its own
    all-reduces and no step overheads; the first covers the decodes and the
    chunks, the other k - 1 the decodes alone (none without decodes)."""
    if (k == 0 or model.draft_params is None or _f(model.draft_params) == 0.0
            or decodes + chunk_tokens == 0):
        return 0.0
    tp = _f(tp)
    layers, heads = _f(model.draft_layers), _f(model.draft_q_heads)
    head_dim = _f(model.draft_head_dim)
    kvb = 2.0 * layers * _f(model.draft_kv_heads) * head_dim * _f(model.kv_dtype_bytes)
    weights = _f(model.draft_params) * _f(model.draft_weight_dtype_bytes)

    def one_pass(tokens, kv_tokens, keys):
        memory_s = (weights / _f(hw.mbu) + kv_tokens * kvb / _f(hw.kv_mbu)) / tp / (
            _f(hw.memory_bandwidth_bytes_per_s))
        flops = (2.0 * _f(model.draft_params) * tokens
                 + 4.0 * layers * heads * head_dim * keys)
        compute_s = flops / tp / (_f(hw.peak_flops_per_s) * _f(hw.mfu))
        allreduce_s = (2.0 * layers * 2.0 * (tp - 1.0) / tp * tokens
                       * _f(model.draft_hidden_size) * 2.0
                       / _f(hw.interconnect_bytes_per_s))
        return max(memory_s, compute_s) + allreduce_s

    first = one_pass(decodes + chunk_tokens, context_tokens + chunk_cached_tokens,
                     context_tokens + chunk_keys)
    rest = 0.0
    if decodes:
        rest = (k - 1) * one_pass(decodes, context_tokens, context_tokens)
    return first + rest


def kv_capacity_tokens(hw, model, tp) -> int:
    """Whole KV tokens that fit beside the weights on the TP group (beside a
    draft model's too, each token holding its KV as well)."""
    kvb = (2.0 * _f(model.layers) * _f(model.kv_heads) * _f(model.head_dim)
           * _f(model.kv_dtype_bytes))
    weights = (_f(model.shared_params) + _f(model.expert_params)) * _f(
        model.weight_dtype_bytes)
    if model.draft_params is not None:
        kvb += (2.0 * _f(model.draft_layers) * _f(model.draft_kv_heads)
                * _f(model.draft_head_dim) * _f(model.kv_dtype_bytes))
        weights += _f(model.draft_params) * _f(model.draft_weight_dtype_bytes)
    usable = _f(hw.memory_bytes) * _f(hw.gpu_memory_utilization) * _f(tp)
    return math.floor((usable - weights) / kvb)


@dataclass
class _Req:
    index: int
    arrival_s: float
    prompt: int
    output: int  # deliveries (tokens without speculation)
    tokens: int = 0  # output tokens
    emitted: int = 0  # tokens sent to the user
    generated: int = 0  # tokens in the KV cache beyond the prompt (padding too)
    need: int = 0  # tokens this prefill holds (prompt + emitted)
    hit: int = 0  # of them, the cached prefix (never computed)
    truncated: bool = False  # the prompt was cut to the context
    prefilled: int = 0
    decoding: bool = False
    finished: bool = False
    ttft_s: float = math.nan
    e2e_s: float = math.nan
    last_token_s: float = math.nan
    gaps: list = field(default_factory=list)


class LRUCache:
    """Blocks by hash (tokens each), least recently used first."""

    def __init__(self, hashes, block_tokens, capacity):
        self.hashes, self.block, self.capacity = hashes, block_tokens, capacity
        self.blocks: OrderedDict = OrderedDict()
        self.tokens = 0

    def _use(self, key, size):
        self.tokens -= self.blocks.pop(key, 0)
        self.blocks[key] = size
        self.tokens += size

    def admit(self, r) -> int:
        """The request's cached prefix; then its blocks are the most recent."""
        own = [] if r.truncated else list(self.hashes[r.index])
        sizes = [min(self.block, r.prompt - j * self.block) for j in range(len(own))]
        found = 0
        for h, size in zip(own, sizes):
            if h not in self.blocks:
                break
            found += size
        for h, size in zip(own, sizes):
            self._use(h, size)
        self._use(("rest", r.index), r.prompt - sum(sizes) + r.tokens)
        while self.tokens > self.capacity:
            self.tokens -= self.blocks.popitem(last=False)[1]
        return min(found, r.prompt - 1)


@dataclass
class ReferenceResult:
    """Per-request outcomes and run totals (float64)."""

    ttft_s: np.ndarray
    e2e_s: np.ndarray
    max_gap_s: np.ndarray  # largest inter-token gap of each request (0 if none)
    itl_s: np.ndarray  # every inter-token gap of every request
    steps: int
    preemptions: int
    duration_s: float
    oversize: bool
    rejected: np.ndarray  # bool per request: beyond the context, not served
    # per request, the cached prefix its (first) admission found (None: the
    # disaggregated reference's)
    hit_tokens: np.ndarray | None = None
    # per step, the requests running in it and its duration (None: the
    # disaggregated reference's)
    running_s: np.ndarray | None = None


def simulate_reference(hw, model, tp, concurrency, token_budget, arrival_s,
                       prompt_tokens, output_tokens, batching=CONTINUOUS,
                       max_context_tokens=math.inf, truncate=False,
                       spec_tokens=0, spec_acceptance=0.0,
                       prefix_hit_fraction=0.0, cached_tokens=None,
                       prefix_cache=None) -> ReferenceResult:
    """Runs the scheduler one step at a time until every request has finished."""
    cap = kv_capacity_tokens(hw, model, tp)
    lru = None if prefix_cache is None else LRUCache(*prefix_cache, capacity=cap)
    k = int(spec_tokens)
    gain = sum(float(spec_acceptance) ** j for j in range(k + 1))
    conc = 1 if batching == REQUEST else int(concurrency)
    continuous = batching == CONTINUOUS
    budget = int(token_budget)
    order = np.argsort(np.asarray(arrival_s, dtype=np.float64), kind="stable")
    reqs = [_Req(int(i), float(arrival_s[i]), int(prompt_tokens[i]),
                 int(output_tokens[i])) for i in order]
    rejected = np.zeros(len(reqs), bool)
    waiting = []  # new requests, FCFS
    for r in reqs:
        if r.prompt + r.output > max_context_tokens:
            if not truncate:
                rejected[r.index] = True
                continue
            r.prompt = max(int(max_context_tokens) - r.output, 1)
            r.output = min(r.output, int(max_context_tokens) - r.prompt)
            r.truncated = True
        r.tokens = r.output  # static batches reserve KV for their tokens
        if k > 0:
            r.output = 1 + math.ceil((r.output - 1) / gain)  # deliveries
        r.need = r.prompt
        r.hit = (math.floor(prefix_hit_fraction * r.prompt / 16) * 16
                 if cached_tokens is None
                 else min(int(cached_tokens[r.index]), r.prompt - 1))
        r.prefilled = r.hit
        waiting.append(r)
    preempted: list[_Req] = []  # the last preempted is readmitted first
    running: list[_Req] = []  # admission order
    t, steps, preemptions, oversize = 0.0, 0, 0, False
    running_s = []
    batch_open = False
    remaining = len(waiting)

    def context(r):
        """Tokens in a decoding request's context."""
        return r.prompt + (r.generated if k == 0 else 1 + gain * (r.generated - 1))

    def kv_tokens():
        if k == 0:
            return sum(r.prompt + r.generated for r in running)
        decodes = [r for r in running if r.decoding]
        return (sum(r.need for r in running if not r.decoding)
                + sum(r.prompt + r.generated for r in decodes)
                + math.ceil(sum(context(r) - r.prompt - r.generated for r in decodes)
                            + k * len(decodes)))

    while remaining:
        if continuous:
            while kv_tokens() > cap and len(running) > 1:
                victim = running.pop()
                victim.need = victim.prompt + (
                    victim.emitted if k == 0 or victim.emitted == 0
                    else math.floor(1 + gain * (victim.emitted - 1) + 0.5))
                victim.prefilled, victim.decoding = victim.hit, False
                victim.generated = victim.emitted
                preempted.append(victim)
                preemptions += 1
        if not running and not preempted and waiting[0].arrival_s > t:
            t = waiting[0].arrival_s  # nothing to do: jump to the next arrival
        if not running:
            batch_open = True
            batch_prompt, batch_output = 0, 0
        while (continuous or batch_open) and len(running) < conc:
            head = preempted[-1] if preempted else (waiting[0] if waiting else None)
            if head is None or head.arrival_s > t:
                break
            if continuous:
                fits = kv_tokens() + head.need <= cap
            else:
                fits = (batch_prompt + head.prompt + (len(running) + 1)
                        * max(batch_output, head.tokens) <= cap)
            if not fits and running:
                break
            oversize |= not fits
            if preempted:
                preempted.pop()
            else:
                waiting.pop(0)
                if lru is not None:
                    head.hit = head.prefilled = lru.admit(head)
            running.append(head)
            if not continuous:
                batch_prompt += head.prompt
                batch_output = max(batch_output, head.tokens)
        batch_open = False

        decodes = [r for r in running if r.decoding]
        left = max(budget - len(decodes) * (k + 1), 0)
        chunks = []  # (request, tokens, cached tokens)
        for r in running:
            if not r.decoding and r.prefilled < r.need and left > 0:
                take = min(r.need - r.prefilled, left)
                chunks.append((r, take, r.prefilled))
                left -= take
        contexts = [context(r) for r in decodes]
        new = len(decodes) * (k + 1) + sum(m for _, m, _ in chunks)
        kv_read = sum(contexts) + sum(p for _, _, p in chunks)
        keys = (sum((k + 1) * c + k * (k + 1) / 2.0 for c in contexts)
                + sum(m * p + m * (m + 1) / 2.0 for _, m, p in chunks))
        start = t
        t += step_time_s(hw, model, tp, new, kv_read, keys,
                         len(decodes) + len(chunks))
        t += draft_time_s(hw, model, tp, len(decodes), sum(contexts), k,
                          sum(m for _, m, _ in chunks), sum(p for _, _, p in chunks),
                          sum(m * p + m * (m + 1) / 2.0 for _, m, p in chunks))
        steps += 1
        running_s.append((len(running), t - start))

        def emit(r):
            if r.emitted == 0:
                r.ttft_s = t - r.arrival_s
            else:
                r.gaps.append(t - r.last_token_s)
            r.emitted += 1
            r.last_token_s = t
            if r.emitted == r.output:
                r.finished = True
                r.e2e_s = t - r.arrival_s

        for r in decodes:
            r.generated += 1
            if not r.finished:
                emit(r)
        for r, m, _ in chunks:
            r.prefilled += m
        if continuous:
            for r, _, _ in chunks:
                if r.prefilled == r.need:
                    r.decoding = True
                    emit(r)
                    r.generated = r.emitted
        elif chunks and all(r.decoding or r.prefilled == r.need for r in running):
            for r in running:
                if not r.decoding:
                    r.decoding = True
                    emit(r)
                    r.generated = r.emitted
        done = [r for r in running if r.finished]
        if continuous:
            running = [r for r in running if not r.finished]
            remaining -= len(done)
        elif all(r.finished for r in running):
            remaining -= len(running)
            running = []

    by_index = sorted(reqs, key=lambda r: r.index)
    return ReferenceResult(
        ttft_s=np.array([r.ttft_s for r in by_index]),
        e2e_s=np.array([r.e2e_s for r in by_index]),
        max_gap_s=np.array([max(r.gaps, default=0.0) for r in by_index]),
        itl_s=np.array([g for r in by_index for g in r.gaps]),
        steps=steps,
        preemptions=preemptions,
        duration_s=t,
        oversize=oversize,
        rejected=rejected,
        hit_tokens=np.array([r.hit for r in by_index]),
        running_s=np.array(running_s, np.float64).reshape(-1, 2),
    )


def _within_context(prompt, output, max_context_tokens, truncate):
    """``(prompt, output, served)`` under the context limit, as above."""
    if prompt + output <= max_context_tokens:
        return prompt, output, True
    if not truncate:
        return prompt, output, False
    prompt = max(int(max_context_tokens) - output, 1)
    return prompt, min(output, int(max_context_tokens) - prompt), True


def simulate_disaggregated_reference(hw, model, tp, concurrency, token_budget,
                                     arrival_s, prompt_tokens, output_tokens,
                                     prefill_instances, decode_instances,
                                     max_context_tokens=math.inf, truncate=False,
                                     spec_tokens=0, spec_acceptance=0.0,
                                     prefix_hit_fraction=0.0,
                                     prefix_cache=None,
                                     prefill_tp=None) -> ReferenceResult:
    """``p`` prefill and ``d`` decode instances fed one stream (module
    docstring); with ``prefix_cache`` (hashes, block tokens) each prefill
    instance has an LRU cache of the prompts dealt to it. ``tp`` is the
    decode instances' tensor parallelism, ``prefill_tp`` the prefill
    instances' (None: the same); a transfer runs over the smaller group's
    links."""
    pre_tp = tp if prefill_tp is None else prefill_tp
    n = len(arrival_s)
    kvb = (2.0 * _f(model.layers) * _f(model.kv_heads) * _f(model.head_dim)
           * _f(model.kv_dtype_bytes))
    arrival = [float(a) for a in arrival_s]
    limited = [_within_context(int(prompt_tokens[i]), int(output_tokens[i]),
                               max_context_tokens, truncate) for i in range(n)]
    served = [i for i in sorted(range(n), key=lambda i: arrival[i]) if limited[i][2]]
    prompt = [x[0] for x in limited]
    output = [x[1] for x in limited]

    def run(tp, instances, members, arrive, prompts, outputs, cached=None,
            hashes=None, **kw):
        """Round-robin over ``instances`` schedulers, in ``members``' order:
        per-request (ttft, e2e, largest gap, cached prefix found), every gap,
        and the run totals."""
        got, gaps, steps, preemptions, duration, oversize = {}, [], 0, 0, 0.0, False
        for j in range(instances):
            mine = members[j::instances]
            if not mine:
                continue
            res = simulate_reference(
                hw, model, tp, concurrency, token_budget, [arrive[i] for i in mine],
                [prompts[i] for i in mine], [outputs[i] for i in mine],
                cached_tokens=None if cached is None else [cached[i] for i in mine],
                prefix_cache=None if hashes is None else (
                    [hashes[i] for i in mine], prefix_cache[1]), **kw)
            for pos, i in enumerate(mine):
                got[i] = (res.ttft_s[pos], res.e2e_s[pos], res.max_gap_s[pos],
                          res.hit_tokens[pos])
            gaps.extend(res.itl_s)
            steps += res.steps
            preemptions += res.preemptions
            duration = max(duration, res.duration_s)
            oversize |= res.oversize
        return got, gaps, steps, preemptions, duration, oversize

    # a truncated prompt shares no block
    hashes = None if prefix_cache is None else [
        prefix_cache[0][i] if limited[i][0] == int(prompt_tokens[i]) else []
        for i in range(n)]
    first, _, *pre = run(pre_tp, int(prefill_instances), served, arrival, prompt,
                         [1] * n, hashes=hashes,
                         prefix_hit_fraction=prefix_hit_fraction)
    # the KV transfer: over the prefill instance's link and the decode
    # instance's, one transfer at a time on each, in the order prefills end
    sender = {i: k % int(prefill_instances) for k, i in enumerate(served)}
    ready = {i: arrival[i] + first[i][0] for i in served}
    to_decode = sorted((i for i in served if output[i] > 1), key=lambda i: ready[i])
    receiver = {i: k % int(decode_instances) for k, i in enumerate(to_decode)}
    links = min(_f(tp), _f(pre_tp)) * _f(hw.kv_link_bytes_per_s)
    transfer = {i: prompt[i] * kvb / links for i in served}
    # a layer-wise connector: layer l's KV, transfer / L, ready l/L of the
    # way through the prompt's own prefill alone (its chunks' steps, as
    # above, with nothing beside them, after the cached prefix its prefill
    # instance found); sent in layer order, one at a time
    layers = int(_f(model.layers))
    layerwise = _f(getattr(hw, "kv_layerwise", 0.0)) > 0

    def alone_s(i):
        done, s = int(first[i][3]), 0.0
        while done < prompt[i]:
            m = min(int(token_budget), prompt[i] - done)
            keys = m * done + m * (m + 1) / 2.0
            s += step_time_s(hw, model, pre_tp, m, done, keys, 1)
            done += m
        return s

    span = {i: alone_s(i) for i in served} if layerwise else {}

    def arrived(i, free):
        """When request ``i``'s KV has arrived, its links free from ``free``."""
        if not layerwise:
            return max(ready[i], free) + transfer[i]
        piece, t = transfer[i] / layers, free
        for layer in range(1, layers + 1):
            t = max(t, ready[i] - span[i] * (1.0 - layer / layers)) + piece
        return t

    send_free = [-math.inf] * int(prefill_instances)
    recv_free = [-math.inf] * int(decode_instances)
    ttft = [math.nan] * n
    for i in served:  # one output token: no shared link
        ttft[i] = arrived(i, -math.inf) - arrival[i]
    for i in to_decode:
        done = arrived(i, max(send_free[sender[i]], recv_free[receiver[i]]))
        send_free[sender[i]] = recv_free[receiver[i]] = done
        ttft[i] = done - arrival[i]
    handed = [arrival[i] + ttft[i] if i in first else math.nan for i in range(n)]
    rest, dec_gaps, *dec = run(tp, int(decode_instances), to_decode, handed, prompt,
                     [o - 1 for o in output], spec_tokens=spec_tokens,
                     spec_acceptance=spec_acceptance,
                     cached=[p - 1 for p in prompt])
    e2e, max_gap = list(ttft), [0.0] * n
    for i, (gap, tail, largest, _) in rest.items():
        e2e[i] = ttft[i] + tail
        max_gap[i] = max(gap, largest)
    return ReferenceResult(
        ttft_s=np.array(ttft), e2e_s=np.array(e2e), max_gap_s=np.array(max_gap),
        itl_s=np.array([rest[i][0] for i in to_decode] + dec_gaps),
        steps=pre[0] + dec[0], preemptions=pre[1] + dec[1],
        duration_s=max(pre[2], dec[2]), oversize=pre[3] or dec[3],
        rejected=np.array([not x[2] for x in limited]),
    )
