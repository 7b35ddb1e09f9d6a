"""Workloads: request traces, length distributions and their summary tables.

A length distribution is a discrete mixture, a lognormal, or the empirical
distribution of a trace column. The roofline needs its mean and, for static
batching, the whole distribution as a sorted ``(values, probs)`` table:

* discrete: the given support, exact;
* trace: the distinct lengths and their frequencies, exact;
* lognormal: ``LOGNORMAL_BINS`` equal-probability bins, each represented by
  its conditional median; ``E[max of B]`` from this table converges to the
  continuous value as the bins shrink (tested against a Monte-Carlo estimate).

Traces are CSV (header row) or JSON lines, with columns named in the config,
read by pandas (quoted fields, a UTF-8 BOM, CRLF line ends). A bare file name
is a registered public trace (``sweep.data``: a verified local copy, cached,
or fetched from its origin). Bad content (a non-number, a negative or
decreasing timestamp, a length that is not a whole number of tokens or is
above ``MAX_TRACE_TOKENS``, an all-zero length
column, equal timestamps used for arrivals) raises ``ConfigError`` naming the
column and line. A trace with both lengths also keeps its rows' (prompt,
output) pairs in recorded order (``WorkloadTables.pairs``) for exact replay.

``context_limit`` is the model's context rule (vLLM's ``max_model_len``),
shared by the simulator and ``served_tables``, which conditions the tables on
the requests a model serves.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd

from sweep.config.schema import (
    ArrivalKind,
    ConfigError,
    LengthDist,
    LengthKind,
    Replay,
    Trace,
    Workload,
)
from sweep.data import REGISTRY, DataError, fetch

LOGNORMAL_BINS = 1024


@dataclass(frozen=True)
class TraceData:
    """A loaded trace: arrival offsets (s, from the first request) and lengths."""

    arrival_s: np.ndarray | None
    columns: dict[str, np.ndarray]
    # each row's block hashes (``Trace.hash_column``), None without that column
    hashes: list[np.ndarray] | None = None


def resolve_trace_path(path: str, data_dir: str | None = None) -> Path:
    """An existing file as given; else the verified registered trace of that name.

    Args:
      data_dir: the folder of local copies (``app.data_dir``); None: the
        ``SWEEP_DATA_DIR`` environment variable.
    """
    p = Path(path).expanduser()
    if p.exists():
        return p
    if path in REGISTRY:
        try:
            return fetch(path, data_dir)
        except DataError as e:
            raise ConfigError(f"workload.trace.path = {path!r}: {e.reason}") from None
    raise ConfigError(
        f"workload.trace.path = {path!r}: no such file, nor a registered public "
        f"trace ({', '.join(REGISTRY)}; see sweep-data list)"
    )


MAX_TRACE_TOKENS = 10_000_000
"""Longest prompt or output a trace may record (tokens): far beyond every model's
context, so a larger value is a wrong column or unit, not a request."""


def _frame(path: Path, fmt: str) -> tuple[pd.DataFrame, np.ndarray | None]:
    """The trace's rows as read by pandas (quoted fields, a UTF-8 BOM, CRLF), and
    each row's line in the file (None if quoted line breaks make that unclear)."""
    key = f"workload.trace[{path.name}]"
    try:
        if fmt == "csv":
            try:
                df = pd.read_csv(path, encoding="utf-8-sig", dtype=str,
                                 keep_default_na=False, skipinitialspace=True)
            except pd.errors.EmptyDataError:
                df = pd.DataFrame()
            except pd.errors.ParserError as e:
                raise ConfigError(f"{key}: {_first_line(e)}") from None
            df.columns = [str(c).strip() for c in df.columns]
        elif fmt == "jsonl":
            try:
                df = pd.read_json(path, lines=True, dtype=False, encoding="utf-8-sig")
            except ValueError as e:
                raise ConfigError(f"{key}: {_bad_json_line(path) or _first_line(e)}"
                                  ) from None
        else:
            raise ConfigError(f"workload.trace.format = {fmt!r}: must be csv or jsonl")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{key}: cannot read ({_first_line(e)})") from None
    if df.empty:
        raise ConfigError(f"{key}: empty trace (needs " + (
            "a header row and >= 1 row)" if fmt == "csv" else ">= 1 JSON line)"))
    with path.open(encoding="utf-8-sig") as f:
        lines = np.array([i for i, ln in enumerate(f, start=1) if ln.strip()])
    if fmt == "csv":
        lines = lines[1:]  # the header
    return df, (lines if len(lines) == len(df) else None)


def _first_line(e: BaseException) -> str:
    return next((ln.strip() for ln in str(e).splitlines() if ln.strip()),
                type(e).__name__)


def _bad_json_line(path: Path) -> str | None:
    """The first line of a JSON-lines file that is not a JSON object, named."""
    with path.open(encoding="utf-8-sig") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                return f"line {number} is not JSON ({e.msg}, column {e.colno})"
            if not isinstance(record, dict):
                return f"line {number} is not a JSON object"
    return None


class _Column:
    """One column of a trace, with what names a row in an error message."""

    def __init__(self, df: pd.DataFrame, lines: np.ndarray | None, name: str,
                 path: Path):
        self.raw, self.lines = df[name], lines
        self.key = f"workload.trace[{path.name}].{name}"

    def refuse(self, bad: np.ndarray, what: str) -> None:
        """Raises ``ConfigError`` naming the first row where ``bad`` holds."""
        if bad.any():
            i = int(np.argmax(bad))
            where = (f"line {self.lines[i]}" if self.lines is not None
                     else f"data row {i + 1}")
            raise ConfigError(f"{self.key}: {what} at {where} "
                              f"({self.raw.iloc[i]!r})")


def _timestamps_s(col: _Column, unit: str) -> np.ndarray:
    if unit == "datetime":
        t = pd.to_datetime(col.raw.astype(str).str.strip(), format="ISO8601",
                           errors="coerce")
        col.refuse(t.isna().to_numpy(), "not an ISO date-time")
        return ((t - t.iloc[0]) / pd.Timedelta(seconds=1)).to_numpy(np.float64)
    scale = {"s": 1.0, "ms": 1e-3, "us": 1e-6}.get(unit)
    if scale is None:
        raise ConfigError(
            f"workload.trace.timestamp_unit = {unit!r}: must be s, ms, us or datetime"
        )
    t = _numbers(col) * scale
    col.refuse(t < 0, "negative timestamp")
    return t - t[0]


def _numbers(col: _Column) -> np.ndarray:
    v = pd.to_numeric(col.raw, errors="coerce").to_numpy(np.float64)
    col.refuse(~np.isfinite(v), "not a finite number")
    return v


def load_trace(trace: Trace, data_dir: str | None = None,
               timestamps: bool = True) -> TraceData:
    """Reads and checks a trace file; raises ``ConfigError`` on bad content.

    Data rows are counted from 1 (the header is not a row). Without
    ``timestamps`` (Poisson arrivals) the timestamp column is neither needed
    nor read: a file of lengths alone (ShareGPT's, Vidur's) feeds a workload
    whose config names one.
    """
    path = resolve_trace_path(trace.path, data_dir)
    df, lines = _frame(path, trace.format)
    header = list(df.columns)
    stamp = trace.timestamp_column if timestamps else ""
    wanted = [c for c in (stamp, trace.prompt_column,
                          trace.output_column, trace.hash_column) if c]
    missing = [c for c in wanted if c not in header]
    if missing:
        raise ConfigError(
            f"workload.trace[{path.name}]: missing column(s) {missing}; "
            f"the file has {header}" + (
                f"; {stamp} is the timestamp column (workload.trace."
                "timestamp_column) that arrival=trace replays: name another, or "
                "allowed without one: workload.arrival=poisson"
                if stamp in missing else ""))
    arrival = None
    if stamp:
        col = _Column(df, lines, stamp, path)
        arrival = _timestamps_s(col, trace.timestamp_unit)
        col.refuse(np.diff(arrival, prepend=0.0) < 0, "timestamps decrease")
    lengths = {}
    for c in (trace.prompt_column, trace.output_column):
        if c:
            col = _Column(df, lines, c, path)
            v = _numbers(col)
            col.refuse(v < 0, "negative length")
            col.refuse(v != np.floor(v), "not a whole number of tokens")
            col.refuse(v > MAX_TRACE_TOKENS,
                       f"length above {MAX_TRACE_TOKENS:,} tokens (the most allowed)")
            if not np.any(v >= 1):
                raise ConfigError(f"{col.key}: every length is 0; a trace needs rows "
                                  "of >= 1 token (0 marks a failed request)")
            lengths[c] = v
    hashes = None
    if trace.hash_column:
        col = _Column(df, lines, trace.hash_column, path)
        hashes = _hash_lists(col)
        if trace.prompt_column:
            blocks = np.ceil(lengths[trace.prompt_column] / trace.hash_block_tokens)
            col.refuse(np.array([len(h) for h in hashes]) > blocks,
                       f"more hashes than the prompt's blocks of "
                       f"{trace.hash_block_tokens} tokens ({trace.prompt_column})")
    return TraceData(arrival_s=arrival, columns=lengths, hashes=hashes)


def _hash_lists(col: _Column) -> list[np.ndarray]:
    """A list column (JSON arrays; a CSV cell holds one as text) as int arrays."""
    out, bad = [], np.zeros(len(col.raw), bool)
    for i, v in enumerate(col.raw):
        if isinstance(v, str):
            try:
                v = json.loads(v) if v.strip() else []
            except json.JSONDecodeError:
                v = None
        ok = isinstance(v, list) and all(
            isinstance(x, int) and not isinstance(x, bool) for x in v)
        bad[i] = not ok
        out.append(np.asarray(v if ok else [], np.int64))
    col.refuse(bad, "not a list of integer hashes")
    return out


def lognormal_mu(mean_tokens: float, sigma: float) -> float:
    """``mu`` of the lognormal whose mean is ``mean_tokens``."""
    return math.log(mean_tokens) - sigma**2 / 2


def length_table(dist: LengthDist, column: np.ndarray | None) -> tuple[np.ndarray,
                                                                        np.ndarray]:
    """Sorted ``(values, probs)`` of a length distribution (float64).

    Args:
      column: the trace's lengths, used when ``dist.kind`` is ``trace``.
    """
    if dist.kind == LengthKind.discrete:
        v = np.asarray(dist.values, dtype=np.float64)
        p = np.asarray(dist.probs, dtype=np.float64)
    elif dist.kind == LengthKind.trace:
        raw = column[column >= 1]  # failed requests (0 tokens) are not served
        v, counts = np.unique(raw, return_counts=True)
        p = counts.astype(np.float64)
    else:
        from statistics import NormalDist

        mu = lognormal_mu(dist.mean_tokens, dist.sigma)
        q = (np.arange(LOGNORMAL_BINS) + 0.5) / LOGNORMAL_BINS
        z = np.array([NormalDist().inv_cdf(x) for x in q])
        v = np.maximum(np.round(np.exp(mu + dist.sigma * z)), 1.0)
        if dist.max_tokens > 0:
            v = np.minimum(v, dist.max_tokens)
        v, counts = np.unique(v, return_counts=True)
        p = counts.astype(np.float64)
    order = np.argsort(v)
    v, p = v[order], p[order]
    return v, p / p.sum()


@dataclass(frozen=True)
class WorkloadTables:
    """What the grid sweep needs of one workload."""

    name: str
    prompt_values: np.ndarray
    prompt_probs: np.ndarray
    output_values: np.ndarray
    output_probs: np.ndarray
    # every trace row's timestamp (s from the first row); None without timestamps
    trace_arrival_s: np.ndarray | None = None
    # shape=(N, 2) float64: the trace's recorded (prompt, output) lengths in
    # recorded order, rows with both >= 1 (0 marks a failed request); None
    # unless both lengths come from the trace
    pairs: np.ndarray | None = None
    # shape=(N,): those rows' timestamps (s from the first of them)
    pair_arrival_s: np.ndarray | None = None
    # mean share of a prompt in the prefix cache when caching is on
    prefix_hit_fraction: float = 0.0
    # each pair's block hashes (``Trace.hash_column``), aligned with ``pairs``
    pair_hashes: tuple[np.ndarray, ...] | None = None
    hash_block_tokens: int = 0
    # a distribution of each request's share in the cache (Workload's
    # prefix_hit_levels and prefix_hit_probs); None: every request at
    # prefix_hit_fraction
    hit_levels: np.ndarray | None = None
    hit_probs: np.ndarray | None = None

    @property
    def mean_prompt_tokens(self) -> float:
        return float(self.prompt_values @ self.prompt_probs)

    @property
    def mean_output_tokens(self) -> float:
        return float(self.output_values @ self.output_probs)


def _check_span(t: np.ndarray | None, w: Workload, what: str) -> None:
    if t is not None and (len(t) < 2 or t[-1] <= t[0]):
        raise ConfigError(
            f"workload.trace[{Path(w.trace.path).name}].{w.trace.timestamp_column}: "
            f"{what} {len(t)} row(s) all at one time (span 0 s); arrival=trace needs "
            "two different timestamps; allowed: workload.arrival=poisson")


def workload_tables(w: Workload, data_dir: str | None = None) -> WorkloadTables:
    """Loads the trace (if any) and tabulates both length distributions.

    Raises:
      ConfigError: a trace that cannot feed this workload (one line).
    """
    trace = (load_trace(w.trace, data_dir, w.arrival == ArrivalKind.trace)
             if w.trace is not None else None)
    cols = trace.columns if trace is not None else {}
    prompt = cols.get(w.trace.prompt_column) if trace else None
    output = cols.get(w.trace.output_column) if trace else None
    pv, pp = length_table(w.prompt, prompt)
    ov, op = length_table(w.output, output)
    arrival = trace.arrival_s if trace is not None else None
    pairs = pair_arrival = pair_hashes = None
    if w.prompt.kind == LengthKind.trace and w.output.kind == LengthKind.trace:
        kept = (prompt >= 1) & (output >= 1)
        if not kept.any():
            raise ConfigError(
                f"workload.trace[{Path(w.trace.path).name}]: no row has both a "
                f"{w.trace.prompt_column} and a {w.trace.output_column} of >= 1 "
                "token (0 marks a failed request)")
        pairs = np.stack([prompt[kept], output[kept]], axis=1)
        if trace.hashes is not None:
            pair_hashes = tuple(h for h, k in zip(trace.hashes, kept) if k)
        if arrival is not None:
            pair_arrival = arrival[kept] - arrival[kept][0]
    if w.arrival == ArrivalKind.trace:
        _check_span(arrival, w, "every timestamp is equal:")
        if w.replay == Replay.exact:
            _check_span(pair_arrival, w, "the rows with both lengths >= 1 are")
    levels = (np.asarray(w.prefix_hit_levels, np.float64), np.asarray(
        w.prefix_hit_probs, np.float64) / sum(w.prefix_hit_probs)) if (
        w.prefix_hit_levels) else (None, None)
    return WorkloadTables(w.name, pv, pp, ov, op, arrival, pairs, pair_arrival,
                          w.mean_prefix_hit, pair_hashes,
                          w.trace.hash_block_tokens if pair_hashes else 0, *levels)


def context_limit(prompt, output, max_context_tokens, truncate, xp=np):
    """vLLM's context limit applied to requests: ``(prompt, output, served)``.

    A request is served as recorded when ``prompt + output <= max_context``.
    Otherwise it is rejected (not served), or with ``truncate`` (vLLM's
    ``--truncate-prompt-tokens``) its prompt is cut to its last
    ``max_context - output`` tokens; when the output alone leaves no room for
    a prompt token (``output >= max_context``), the prompt keeps one token and
    the output stops at ``max_context - 1`` tokens, where vLLM ends a sequence
    that reaches ``max_model_len``.

    Args:
      prompt, output: lengths (tokens >= 1), float arrays.
      max_context_tokens: the model's limit (``inf``: none).
      truncate: bool (a traced one under ``xp=jax.numpy``).
      xp: the array module, ``numpy`` or ``jax.numpy``.
    """
    fits = prompt + output <= max_context_tokens
    cut_prompt = xp.minimum(prompt, xp.maximum(max_context_tokens - output, 1.0))
    cut_output = xp.minimum(output, max_context_tokens - cut_prompt)
    return (xp.where(truncate, cut_prompt, prompt),
            xp.where(truncate, cut_output, output), fits | truncate)


def _table(values: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    v, inverse = np.unique(values, return_inverse=True)
    p = np.bincount(inverse, weights=weights, minlength=len(v))
    return v, p / p.sum()


def served_tables(tables: WorkloadTables, max_context_tokens: float, truncate: bool,
                  joint: bool) -> tuple[WorkloadTables, float]:
    """The length tables of the requests a model serves, and the share rejected.

    Args:
      max_context_tokens: the model's limit (0 or ``inf``: none).
      truncate: ``workload.overlong=truncate``.
      joint: prompt and output as the trace pairs them (``replay=exact``);
        otherwise independent, as ``replay=sampled`` draws them. The served
        requests' lengths are then no longer independent; the returned
        marginals are exact, their pairing is in ``pairs`` only when joint.

    Returns:
      ``(tables, rejected_fraction)``; the tables unchanged when nothing is
      rejected or cut, or when every request is rejected (fraction 1).
    """
    limit = max_context_tokens if max_context_tokens > 0 else math.inf
    if tables.prompt_values[-1] + tables.output_values[-1] <= limit:
        return tables, 0.0
    if joint:
        p, o = tables.pairs[:, 0], tables.pairs[:, 1]
        w = np.full(len(p), 1.0 / len(p))
    else:
        p = np.repeat(tables.prompt_values, len(tables.output_values))
        o = np.tile(tables.output_values, len(tables.prompt_values))
        w = np.outer(tables.prompt_probs, tables.output_probs).ravel()
    p, o, served = context_limit(p, o, limit, truncate)
    rejected = float(w[~served].sum())
    if not served.any():
        return tables, 1.0
    pairs, pair_arrival = tables.pairs, tables.pair_arrival_s
    if pairs is not None:
        pp, po, ok = context_limit(pairs[:, 0], pairs[:, 1], limit, truncate)
        pairs = np.stack([pp, po], axis=1)[ok]
        pair_arrival = pair_arrival[ok] if pair_arrival is not None else None
    pv, pp_ = _table(p[served], w[served])
    ov, op = _table(o[served], w[served])
    return replace(tables, prompt_values=pv, prompt_probs=pp_, output_values=ov,
                   output_probs=op, pairs=pairs, pair_arrival_s=pair_arrival,
                   pair_hashes=None), rejected  # hashes no longer align
