"""Workloads: request traces, length distributions and their summary tables.

A length distribution is a discrete mixture, a lognormal, or the empirical
distribution of a trace column. The roofline needs its mean and, for static
batching, the whole distribution as a sorted ``(values, probs)`` table:

* discrete: the given support, exact;
* trace: the distinct lengths and their frequencies, exact;
* lognormal: ``LOGNORMAL_BINS`` equal-probability bins, each represented by
  its conditional median; ``E[max of B]`` from this table converges to the
  continuous value as the bins shrink (tested against a Monte-Carlo estimate).

Traces are CSV (header row) or JSON lines, with columns named in the config.
A bare file name that is not a file is a registered public trace
(``sweep.data``): a verified local copy, cached, or fetched from its origin.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sweep.config.schema import ConfigError, LengthDist, LengthKind, Trace, Workload
from sweep.data import REGISTRY, DataError, fetch

LOGNORMAL_BINS = 1024


@dataclass(frozen=True)
class TraceData:
    """A loaded trace: arrival offsets (s, from the first request) and lengths."""

    arrival_s: np.ndarray | None
    columns: dict[str, np.ndarray]


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


def _read_rows(path: Path, fmt: str) -> tuple[list[str], list[list[str]]]:
    key = f"workload.trace[{path.name}]"
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{key}: cannot read ({e})") from None
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if fmt == "csv":
        if len(lines) < 2:
            raise ConfigError(f"{key}: empty trace (needs a header row and >= 1 row)")
        header = [h.strip() for h in lines[0].split(",")]
        return header, [ln.split(",") for ln in lines[1:]]
    if fmt == "jsonl":
        if not lines:
            raise ConfigError(f"{key}: empty trace (needs >= 1 JSON line)")
        try:
            records = [json.loads(ln) for ln in lines]
        except json.JSONDecodeError as e:
            raise ConfigError(f"{key}: line {e.lineno} is not JSON ({e.msg})") from None
        header = list(records[0])
        return header, [[str(r.get(h, "")) for h in header] for r in records]
    raise ConfigError(f"workload.trace.format = {fmt!r}: must be csv or jsonl")


def _timestamps_s(raw: list[str], unit: str, key: str) -> np.ndarray:
    if unit == "datetime":
        try:
            t = np.array([np.datetime64(v.strip().replace(" ", "T")) for v in raw],
                         dtype="datetime64[ns]")
        except ValueError as e:
            raise ConfigError(f"{key}: not an ISO date-time ({e})") from None
        return (t - t[0]).astype(np.int64) / 1e9
    scale = {"s": 1.0, "ms": 1e-3, "us": 1e-6}.get(unit)
    if scale is None:
        raise ConfigError(
            f"workload.trace.timestamp_unit = {unit!r}: must be s, ms, us or datetime"
        )
    t = _numbers(raw, key) * scale
    if np.any(t < 0):
        raise ConfigError(f"{key}: negative timestamp {t[t < 0][0]:g}")
    return t - t[0]


def _numbers(raw: list[str], key: str) -> np.ndarray:
    try:
        v = np.array([float(x) for x in raw])
    except ValueError as e:
        raise ConfigError(f"{key}: not a number ({e})") from None
    if not np.all(np.isfinite(v)):
        raise ConfigError(f"{key}: non-finite value")
    return v


def load_trace(trace: Trace, data_dir: str | None = None) -> TraceData:
    """Reads and checks a trace file; raises ``ConfigError`` on bad content.

    Args:
      data_dir: as in ``resolve_trace_path``.
    """
    path = resolve_trace_path(trace.path, data_dir)
    header, rows = _read_rows(path, trace.format)
    wanted = [c for c in (trace.timestamp_column, trace.prompt_column,
                          trace.output_column) if c]
    missing = [c for c in wanted if c not in header]
    if missing:
        raise ConfigError(
            f"workload.trace[{path.name}]: missing column(s) {missing}; "
            f"the file has {header}"
        )
    bad = next((i for i, r in enumerate(rows) if len(r) != len(header)), None)
    if bad is not None:
        raise ConfigError(
            f"workload.trace[{path.name}]: line {bad + 2} has {len(rows[bad])} fields, "
            f"the header has {len(header)}"
        )
    col = {h: [r[i] for r in rows] for i, h in enumerate(header)}
    arrival = None
    if trace.timestamp_column:
        key = f"workload.trace[{path.name}].{trace.timestamp_column}"
        arrival = _timestamps_s(col[trace.timestamp_column], trace.timestamp_unit, key)
        if np.any(np.diff(arrival) < 0):
            row = int(np.argmax(np.diff(arrival) < 0)) + 1
            # file line: one header line, rows counted from 1
            raise ConfigError(f"{key}: timestamps decrease at line {row + 2}")
    lengths = {}
    for c in (trace.prompt_column, trace.output_column):
        if c:
            v = _numbers(col[c], f"workload.trace[{path.name}].{c}")
            if np.any(v < 0):
                raise ConfigError(
                    f"workload.trace[{path.name}].{c}: negative length {v[v < 0][0]:g}"
                )
            lengths[c] = v
    return TraceData(arrival_s=arrival, columns=lengths)


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

    @property
    def mean_prompt_tokens(self) -> float:
        return float(self.prompt_values @ self.prompt_probs)

    @property
    def mean_output_tokens(self) -> float:
        return float(self.output_values @ self.output_probs)


def workload_tables(w: Workload, data_dir: str | None = None) -> WorkloadTables:
    """Loads the trace (if any) and tabulates both length distributions.

    Args:
      data_dir: as in ``resolve_trace_path``.
    """
    trace = load_trace(w.trace, data_dir) if w.trace is not None else None
    cols = trace.columns if trace is not None else {}
    pv, pp = length_table(w.prompt, cols.get(w.trace.prompt_column) if trace else None)
    ov, op = length_table(w.output, cols.get(w.trace.output_column) if trace else None)
    return WorkloadTables(w.name, pv, pp, ov, op)
