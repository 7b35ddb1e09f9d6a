"""A prefix cache that emerges from a trace's block hashes (LRU, in KV capacity).

Some public traces publish, for each request, one hash per fixed block of its
prompt (a ``hash_ids`` list: equal hashes, equal token blocks, each hash
covering its whole prefix). Replayed in order through an engine with prefix
caching (vLLM's automatic prefix caching, SGLang's radix cache), a request
finds its leading blocks in the cache if nothing evicted them since they were
last used, so the hit rate depends on the trace and on the cache's size.

The rule (shared by the simulator, the surrogate and the roofline):

* at its admission, in arrival order (the engine admits first come, first
  served), a request looks up its hashed blocks in order: its cached prefix
  is the leading blocks found, at most its prompt less one token (the last
  is computed and emits the first token, as vLLM recomputes it);
* then its blocks are the most recently used, in order, followed by the rest
  of its KV (its unhashed prompt tail and its output) as one new block no
  later request shares;
* the cache holds the most recently used blocks up to ``C`` tokens, ``C`` the
  configuration's KV capacity (``roofline.kv_capacity_tokens``): the running
  requests' KV is part of it, and the least recently used blocks go first.

The hit rule needs one pass over the stream, whatever ``C``: a block is
found iff the tokens of the distinct blocks used since its last use, itself
included, are at most ``C`` (LRU's stack distance, in tokens: an LRU cache
keeps exactly its most recent blocks up to its size). ``lru_table`` records,
for each request and each ``k``, the capacity its first ``k`` blocks need;
``cached_tokens`` reads a configuration's hits from it and ``hit_curve``
the stream's hit fraction as a function of the capacity. A request the model
rejects uses no block; one whose prompt is truncated (its leading tokens cut)
shares none.

Approximations: running requests' blocks are never evicted in an engine, but
they are among the most recent here too; a preempted request keeps its hit.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from sweep.latency.workload import WorkloadTables, context_limit


class CacheTable(NamedTuple):
    """Each request's prefix hits as a function of the cache's capacity.

    Row ``i`` covers request ``i`` of a stream; column ``k`` its first
    ``k + 1`` hashed blocks (rows padded with ``inf`` needs).
    """

    need_tokens: np.ndarray  # shape=(R, K), capacity (tokens) those blocks need
    cached_tokens: np.ndarray  # shape=(R, K), prompt tokens they hold (< prompt)


class _Fenwick:
    """Prefix sums over positions with point updates, in O(log n)."""

    def __init__(self, n: int):
        self.tree = np.zeros(n + 1, np.float64)

    def add(self, i: int, v: float) -> None:
        i += 1
        while i < len(self.tree):
            self.tree[i] += v
            i += i & -i

    def below(self, i: int) -> float:
        """The sum over positions ``< i``."""
        s = 0.0
        while i > 0:
            s += self.tree[i]
            i -= i & -i
        return s


def block_sizes(prompt_tokens: int, blocks: int, block_tokens: int) -> np.ndarray:
    """Tokens of a prompt's first ``blocks`` hashed blocks (the last may be short)."""
    start = np.arange(blocks) * block_tokens
    return np.clip(prompt_tokens - start, 0, block_tokens).astype(np.float64)


def lru_table(hashes, prompt_tokens, output_tokens, served, shared,
              block_tokens: int) -> CacheTable:
    """The LRU hit table of a stream (host arrays, in arrival order).

    Args:
      hashes: one integer array per request, its blocks' hashes in order.
      prompt_tokens, output_tokens: ``(R,)``, the lengths served (after a
        context limit's truncation).
      served: ``(R,)`` bool, the requests admitted (rejected ones use no block).
      shared: ``(R,)`` bool, the requests whose blocks are as recorded (False
        where the prompt was truncated: it shares no block).
      block_tokens: tokens per hashed block.
    """
    num = len(hashes)
    counts = [len(h) if (ok and sh) else 0
              for h, ok, sh in zip(hashes, served, shared)]
    width = max(max(counts, default=0), 1)
    need = np.full((num, width), np.inf)
    cached = np.zeros((num, width))
    fenwick = _Fenwick(sum(counts) + num)
    last: dict[int, tuple[int, float]] = {}  # hash -> (position, size)
    total, position = 0.0, 0
    for i in range(num):
        if not served[i]:
            continue
        prompt = int(prompt_tokens[i])
        own = np.asarray(hashes[i][:counts[i]], np.int64)
        sizes = block_sizes(prompt, len(own), block_tokens)
        depth = np.array([total - fenwick.below(last[h][0]) if h in last else np.inf
                          for h in own.tolist()])
        need[i, :len(own)] = np.maximum.accumulate(depth) if len(own) else depth
        cached[i, :len(own)] = np.minimum(np.cumsum(sizes), prompt - 1)
        cached[i, len(own):] = cached[i, len(own) - 1] if len(own) else 0.0
        for h, size in zip(own.tolist(), sizes):
            if h in last:
                old, old_size = last[h]
                fenwick.add(old, -old_size)
                total -= old_size
            fenwick.add(position, size)
            last[h] = (position, size)
            total += size
            position += 1
        rest = prompt - sizes.sum() + float(output_tokens[i])
        fenwick.add(position, rest)
        total += rest
        position += 1
    return CacheTable(need, cached)


def cached_tokens(table: CacheTable, capacity_tokens, xp=jnp):
    """Each request's cached prefix (tokens) in a cache of ``capacity_tokens``."""
    need = xp.asarray(table.need_tokens)
    found = ((need <= capacity_tokens) & xp.isfinite(need)).sum(-1)
    at = xp.take_along_axis(xp.asarray(table.cached_tokens),
                            xp.maximum(found - 1, 0)[:, None], axis=-1)[:, 0]
    return xp.where(found > 0, at, 0.0)


def hit_curve(table: CacheTable, prompt_tokens, served) -> tuple[np.ndarray,
                                                                 np.ndarray]:
    """The served prompts' cached share as a step function of the capacity.

    Returns ``(capacity_tokens, hit_fraction)``, both ascending: at capacity
    ``C`` the share is ``hit_fraction`` at the last ``capacity_tokens <= C``
    (the first entry is ``-inf`` with share 0; ``roofline.lru_hit_fraction``),
    exactly the mean of ``cached_tokens`` over the served requests' prompt
    tokens.
    """
    need, cached = table.need_tokens, table.cached_tokens
    gained = np.diff(cached, axis=1, prepend=0.0)
    keep = np.isfinite(need) & (gained > 0)
    order = np.argsort(need[keep], kind="stable")
    capacity = need[keep][order]
    total = float(np.asarray(prompt_tokens, np.float64)[np.asarray(served)].sum())
    share = np.cumsum(gained[keep][order]) / max(total, 1.0)
    # one entry per distinct capacity: the share once all its blocks are in
    last = np.r_[capacity[1:] != capacity[:-1], True] if len(capacity) else []
    return (np.r_[-np.inf, capacity[last]], np.r_[0.0, share[last]])


def _pad(need: np.ndarray, value: np.ndarray, width: int):
    """Pads the last axis to ``width``: needs with ``inf`` (never found),
    values with their last (nothing more found)."""
    extra = [(0, 0)] * (need.ndim - 1) + [(0, width - need.shape[-1])]
    return (np.pad(need, extra, constant_values=np.inf),
            np.pad(value, extra, mode="edge"))


def _stacked(pairs) -> tuple[np.ndarray, np.ndarray]:
    width = max(need.shape[-1] for need, _ in pairs)
    padded = [_pad(np.asarray(n), np.asarray(v), width) for n, v in pairs]
    return tuple(np.stack(x).astype(np.float32) for x in zip(*padded))


def padded_curves(curves) -> tuple[np.ndarray, np.ndarray]:
    """``hit_curve`` results (None: a workload without hashes, share 0) as
    two float32 arrays ``(N, J)``, each padded with its last share at ``inf``."""
    none = (np.array([-np.inf]), np.array([0.0]))
    return _stacked([c if c is not None else none for c in curves])


def padded_tables(tables, num_requests: int) -> CacheTable:
    """``CacheTable``s of ``num_requests`` rows (None: a workload without
    hashes, no hit) as one float32 table ``(N, num_requests, K)``."""
    none = (np.full((num_requests, 1), np.inf), np.zeros((num_requests, 1)))
    return CacheTable(*_stacked([t if t is not None else none for t in tables]))


class Streams:
    """``stream_table`` (or ``pool_table``) of one workload's first
    ``requests`` rows, built once per distinct effect of a context limit: a
    limit no request reaches serves the stream as no limit does, so every
    such model shares one table."""

    def __init__(self, tables: WorkloadTables, requests: int):
        self.tables, self.requests = tables, requests
        rows = np.arange(requests) % len(tables.pairs)
        self._longest = float(tables.pairs[rows].sum(-1).max())
        self._built: dict[tuple[float, bool, int], tuple] = {}

    def __call__(self, max_context_tokens: float, truncate: bool,
                 prefill_instances: int = 0):
        """``stream_table`` through this limit (0: none); with
        ``prefill_instances``, ``pool_table``'s over that many."""
        limit = max_context_tokens if max_context_tokens > 0 else np.inf
        key = ((np.inf, False) if self._longest <= limit
               else (limit, bool(truncate))) + (int(prefill_instances),)
        if key not in self._built:
            self._built[key] = (
                pool_table(self.tables, self.requests, *key) if key[2]
                else stream_table(self.tables, self.requests, *key[:2]))
        return self._built[key]

    def stream_requests(self, max_context_tokens: float, truncate: bool):
        """``stream_requests`` of this stream through this limit."""
        return stream_requests(self.tables, np.arange(self.requests),
                               max_context_tokens, truncate)


def stream_requests(tables: WorkloadTables, index: np.ndarray,
                    max_context_tokens: float, truncate: bool):
    """``(prompt, output, served)`` of a trace's rows ``index`` (repeated past
    its end, as replayed) through a model's context limit (0: none), and
    whether each prompt is as recorded (not truncated)."""
    rows = index % len(tables.pairs)
    prompt, output = tables.pairs[rows, 0], tables.pairs[rows, 1]
    limit = max_context_tokens if max_context_tokens > 0 else np.inf
    served_prompt, served_output, served = context_limit(prompt, output, limit,
                                                         truncate)
    return served_prompt, served_output, served, served_prompt == prompt


def stream_table(tables: WorkloadTables, requests, max_context_tokens: float,
                 truncate: bool, prefill_only: bool = False,
                 ) -> tuple[CacheTable, tuple[np.ndarray, np.ndarray]]:
    """The hit table and curve of a trace replayed exactly through a model's
    context limit (``context_limit``).

    Args:
      requests: the stream's requests, in arrival order: a count (the first
        rows, repeated if the trace is shorter, as ``replay_requests`` takes
        them) or the indices into that stream of one cache's requests (a
        replica's share).
      prefill_only: each request makes one output token (a disaggregated
        prefill instance's: its KV goes to a decode instance).
    """
    index = np.arange(requests) if np.ndim(requests) == 0 else np.asarray(requests)
    served_prompt, served_output, served, whole = stream_requests(
        tables, index, max_context_tokens, truncate)
    if prefill_only:
        served_output = np.ones_like(served_output)
    table = lru_table([tables.pair_hashes[r] for r in index % len(tables.pairs)],
                      served_prompt, served_output, served, whole,
                      tables.hash_block_tokens)
    return table, hit_curve(table, served_prompt, served)


def pool_table(tables: WorkloadTables, requests: int, max_context_tokens: float,
               truncate: bool, instances: int,
               ) -> tuple[CacheTable, tuple[np.ndarray, np.ndarray]]:
    """A disaggregated prefill pool's hit table and curve over the first
    ``requests`` of a stream: the served requests dealt round-robin over
    ``instances`` in arrival order (``sweep.latency.disaggregated``), each
    instance an LRU cache of its own prompts (``stream_table``'s
    ``prefill_only``); rows in stream order, a rejected request's finding
    nothing."""
    index = np.arange(requests)
    served_prompt, _, served, _ = stream_requests(tables, index, max_context_tokens,
                                                  truncate)
    rank = np.cumsum(served) - 1
    parts = [(mine, stream_table(tables, mine, max_context_tokens, truncate,
                                 prefill_only=True)[0])
             for mine in (index[served & (rank % instances == r)]
                          for r in range(instances))]
    width = max(t.need_tokens.shape[1] for _, t in parts)
    need = np.full((requests, width), np.inf)
    cached = np.zeros((requests, width))
    for mine, t in parts:
        need[mine], cached[mine] = _pad(t.need_tokens, t.cached_tokens, width)
    table = CacheTable(need, cached)
    return table, hit_curve(table, served_prompt, served)
