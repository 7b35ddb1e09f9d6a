"""Reads measured data for ``sweep-calibrate``, refusing what cannot be fitted.

Two formats:

* a CSV of measured steps, one row per step: ``batch_size`` (sequences in
  the step), ``context_tokens`` (cached tokens of each), ``prefill_tokens``
  (new tokens of each; 0 for a decode step, which computes one token each),
  ``seconds`` (the measured step), and optionally ``tensor_parallel``
  (default 1) and ``hardware`` (checked against the hardware fitted). It is
  what ``benchmark_latency``-style scripts and per-op profilers reduce to.
* the JSON that ``vllm bench serve --save-result --save-detailed`` writes
  for one run: per-request ``input_lens``, ``output_lens``, ``ttfts`` (s) and
  ``itls`` (lists of s), plus ``request_rate`` (a number or ``"inf"``),
  ``max_concurrency`` and ``request_throughput``. A ``hardware`` key (vLLM's
  ``--metadata hardware=h100_sxm``) is checked against the hardware fitted.
  Requests that failed (no output token) are left out, as vLLM's own
  percentiles leave them out.

Every refusal is one ``ConfigError`` line naming the file, the field and
what is allowed (exit code 2 in the app).

It also writes the configs ``sweep-calibrate`` fits (``write_profile``):
atomically, never over a file it did not write.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from omegaconf import OmegaConf

from sweep.config.schema import MAX_TOKENS, CalibrationProfile
from sweep.cube import outputs
from sweep.errors import ConfigError

STEP_COLUMNS = ("batch_size", "context_tokens", "prefill_tokens", "seconds")
BENCH_FIELDS = ("input_lens", "output_lens", "ttfts", "itls")
MARK = "# Written by sweep-calibrate."
"""The first line of every config ``sweep-calibrate`` writes."""


@dataclass(frozen=True)
class StepTable:
    """Measured steps (float64 columns of one length)."""

    path: str
    batch_size: np.ndarray
    context_tokens: np.ndarray
    prefill_tokens: np.ndarray
    tensor_parallel: np.ndarray
    seconds: np.ndarray

    def __len__(self) -> int:
        return len(self.seconds)


@dataclass(frozen=True)
class BenchRun:
    """One ``vllm bench serve`` run: its requests and its measured percentiles."""

    path: str
    pairs: np.ndarray  # shape=(N, 2), (prompt, output) tokens of served requests
    rate_per_s: float  # arrival rate at the server: request_rate, or the
    # throughput where the client's max_concurrency or "inf" sets the pace
    max_concurrency: float  # client-side cap; inf when none
    measured: dict[str, float]  # ttft_p50_s, ttft_p99_s, itl_p50_s, itl_p99_s


def _refuse(path, field: str, allowed: str) -> ConfigError:
    return ConfigError(f"{Path(path).name}: {field}: {allowed}")


def _check_hardware(path, value, hardware: str) -> None:
    if value is not None and str(value) != hardware:
        raise _refuse(path, "hardware", f"{value!r} measured, but hardware={hardware} "
                      "is fitted; allowed: data of the hardware fitted (or choose "
                      f"hardware={value})")


def read_steps(path: str, hardware: str, max_tp: int) -> StepTable:
    """A CSV of measured steps; raises ``ConfigError`` on anything malformed."""
    try:
        frame = pd.read_csv(path)
    except FileNotFoundError:
        raise _refuse(path, "file", "not found") from None
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
        raise _refuse(path, "file", f"not a CSV ({str(e).splitlines()[0]})") from None
    frame.columns = [str(c).strip() for c in frame.columns]
    missing = [c for c in STEP_COLUMNS if c not in frame.columns]
    if missing:
        raise _refuse(path, ", ".join(missing), "missing column; the columns are "
                      f"{', '.join(STEP_COLUMNS)} (and optional tensor_parallel, "
                      "hardware)")
    if len(frame) == 0:
        raise _refuse(path, "rows", "no measured step; allowed: one or more rows")
    if "hardware" in frame.columns:
        for value in frame["hardware"].dropna().unique():
            _check_hardware(path, value, hardware)
    if "tensor_parallel" not in frame.columns:
        frame["tensor_parallel"] = 1
    cols = {}
    for name, low, high in (("batch_size", 1, MAX_TOKENS),
                            ("context_tokens", 0, MAX_TOKENS),
                            ("prefill_tokens", 0, MAX_TOKENS),
                            ("tensor_parallel", 1, max_tp),
                            ("seconds", 1e-9, 1e6)):
        x = pd.to_numeric(frame[name], errors="coerce").to_numpy(np.float64)
        bad = ~(np.isfinite(x) & (x >= low) & (x <= high))
        if name != "seconds":
            bad |= np.isfinite(x) & (x != np.round(x))
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            kind = "a number" if name == "seconds" else "an integer"
            raise _refuse(path, f"row {row + 2} {name}",
                          f"{_plain(frame[name].iloc[row])!r}; allowed: {kind} in "
                          f"[{low:g}, {high:g}]")
        cols[name] = x
    return StepTable(str(path), **cols)


def _plain(value):
    """A cell as Python holds it: a NumPy scalar's repr names its type."""
    return value.item() if isinstance(value, np.generic) else value


def _percentiles(x: np.ndarray) -> tuple[float, float]:
    p50, p99 = np.percentile(x, [50, 99])  # NumPy's linear interpolation
    return float(p50), float(p99)


def _number(path, data: dict, key: str, low: float, allow_inf: bool = False):
    value = data.get(key)
    if allow_inf and value in ("inf", float("inf")):
        return math.inf
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (
        math.isfinite(value) and value >= low)
    if not ok:
        raise _refuse(path, key, f"{value!r}; allowed: a number >= {low:g}"
                      + (" or \"inf\"" if allow_inf else ""))
    return float(value)


def read_bench(path: str, hardware: str) -> BenchRun:
    """One ``vllm bench serve`` result; raises ``ConfigError`` on anything
    malformed (missing fields, a run with no completed request, ...)."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise _refuse(path, "file", "not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _refuse(path, "file", f"not JSON ({e})") from None
    if not isinstance(data, dict):
        raise _refuse(path, "file", "a JSON object of one run is expected")
    missing = [f for f in BENCH_FIELDS if f not in data]
    if missing:
        raise _refuse(path, ", ".join(missing), "missing; allowed: the JSON of "
                      "`vllm bench serve --save-result --save-detailed`")
    _check_hardware(path, data.get("hardware"), hardware)
    lists = [data[f] for f in BENCH_FIELDS]
    if not all(isinstance(x, list) for x in lists) or len({len(x) for x in lists}) > 1:
        raise _refuse(path, ", ".join(BENCH_FIELDS),
                      "must be lists with one entry per request")
    try:
        prompt = np.asarray(data["input_lens"], np.float64)
        output = np.asarray(data["output_lens"], np.float64)
        ttft = np.asarray(data["ttfts"], np.float64)
        itls = [np.asarray(x, np.float64).reshape(-1) for x in data["itls"]]
    except (TypeError, ValueError):
        raise _refuse(path, ", ".join(BENCH_FIELDS), "must hold numbers") from None
    ok = (output >= 1) & (ttft > 0) & (prompt >= 1)
    if not ok.any():
        raise _refuse(path, "requests", "no request completed with a first token "
                      "(zero-length run); allowed: a run with completed requests")
    gaps = [g for g, keep in zip(itls, ok) if keep and len(g)]
    gaps = np.concatenate(gaps) if gaps else np.zeros(0)
    if len(gaps) == 0:
        raise _refuse(path, "itls", "no inter-token gap (every output is one token); "
                      "allowed: a run whose outputs have two tokens or more")
    for name, x in (("input_lens", prompt[ok]), ("output_lens", output[ok]),
                    ("ttfts", ttft[ok]), ("itls", gaps)):
        if not (np.isfinite(x).all() and (x >= 0).all()):
            raise _refuse(path, name, "every value must be a finite number >= 0")
    rate = _number(path, data, "request_rate", 1e-9, allow_inf=True)
    conc = data.get("max_concurrency")
    conc = math.inf if conc is None else _number(path, data, "max_concurrency", 1)
    if math.isinf(rate) or not math.isinf(conc):
        # requests held back by the client's cap are sent as others complete:
        # the server sees them arrive at the throughput
        rate = _number(path, data, "request_throughput", 1e-9)
    ttft50, ttft99 = _percentiles(ttft[ok])
    itl50, itl99 = _percentiles(gaps)
    if min(ttft50, itl50) <= 0:
        raise _refuse(path, "ttfts, itls", "the median TTFT and ITL must be > 0 s")
    return BenchRun(str(path), np.stack([prompt[ok], output[ok]], axis=1), rate, conc,
                    {"ttft_p50_s": ttft50, "ttft_p99_s": ttft99,
                     "itl_p50_s": itl50, "itl_p99_s": itl99})


def profile_path(root: Path, name: str) -> Path:
    """Where the config ``calibration=<name>`` lives under a search-path root."""
    return root / "calibration" / f"{name}.yaml"


def check_writable(path: Path) -> None:
    """A file there must be one this tool wrote (else ``ConfigError``)."""
    if path.exists() and not (path.is_file()
                              and path.read_text().startswith(MARK)):
        raise ConfigError(f"out: {path} exists and was not written by "
                          "sweep-calibrate; allowed: another out= or name=")


def write_profile(path: Path, name: str, profile: CalibrationProfile) -> None:
    """Writes (or updates) ``path`` with ``profile``, keeping the file's
    profiles of other hardware x model x engine; atomic (a kill leaves the
    old file or the new)."""
    check_writable(path)
    profiles = []
    if path.exists():
        old = OmegaConf.to_container(OmegaConf.load(path))
        key = (profile.hardware, profile.model, profile.engine)
        profiles = [p for p in old.get("profiles", [])
                    if (p["hardware"], p.get("model", ""), p.get("engine", "vllm"))
                    != key]
    profiles.append(dataclasses.asdict(profile))
    body = OmegaConf.to_yaml({"defaults": ["base_calibration", "_self_"],
                              "name": name, "engine": profile.engine,
                              "profiles": profiles})
    text = (f"{MARK} Select it with hydra.searchpath=[file://<this folder's "
            f"parent>] calibration={name}\n{body}")
    outputs.write_whole(path, text)
