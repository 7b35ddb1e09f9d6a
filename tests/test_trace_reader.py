"""Trace files as users have them, and the ones refused with one line.

Well-formed oddities (a UTF-8 BOM, CRLF line ends, quoted commas, JSON lines)
are read; bad traces raise ``ConfigError`` before any compilation, and the
console script turns that into one line and exit code 2.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from helpers import run_script

from sweep.config.schema import (
    ArrivalKind,
    ConfigError,
    LengthDist,
    LengthKind,
    Replay,
    Trace,
    Workload,
)
from sweep.latency.arrivals import replay_requests, sample_requests, workload_requests
from sweep.latency.workload import load_trace, served_tables, workload_tables


def trace_workload(path, fmt="csv", unit="s", arrival=ArrivalKind.trace,
                   replay=Replay.sampled) -> Workload:
    return Workload(
        name="t", prompt=LengthDist(kind=LengthKind.trace),
        output=LengthDist(kind=LengthKind.trace),
        trace=Trace(path=str(path), format=fmt, timestamp_column="t",
                    timestamp_unit=unit, prompt_column="prompt",
                    output_column="output"),
        arrival=arrival, replay=replay)


def test_csv_with_bom_crlf_and_quoted_commas(tmp_path):
    path = tmp_path / "t.csv"
    path.write_bytes(b'\xef\xbb\xbf"t","prompt",output,note\r\n'
                     b'0.0,100,10,"a, b"\r\n\r\n1.5,200,20,"c"\r\n2.0,0,5,\r\n')
    trace = load_trace(trace_workload(path).trace)
    np.testing.assert_array_equal(trace.arrival_s, [0.0, 1.5, 2.0])
    np.testing.assert_array_equal(trace.columns["prompt"], [100, 200, 0])
    np.testing.assert_array_equal(trace.columns["output"], [10, 20, 5])


def test_jsonl_with_millisecond_timestamps_and_pairs(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"t": 1700000000000, "prompt": 300, "output": 7}\n\n'
                    '{"t": 1700000000250, "prompt": 0, "output": 0}\n'
                    '{"t": 1700000001000, "prompt": 50, "output": 900}\n')
    tables = workload_tables(trace_workload(path, "jsonl", "ms",
                                            replay=Replay.exact))
    np.testing.assert_array_equal(tables.trace_arrival_s, [0.0, 0.25, 1.0])
    # the failed request (0 tokens) is not a pair; pairs keep recorded order
    np.testing.assert_array_equal(tables.pairs, [[300, 7], [50, 900]])
    np.testing.assert_array_equal(tables.pair_arrival_s, [0.0, 1.0])


def test_exact_replay_keeps_order_pairs_and_rescaled_offsets(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("t,prompt,output\n10,100,1\n11,200,2\n14,300,3\n")
    tables = workload_tables(trace_workload(path, replay=Replay.exact))
    # trace rate (3 - 1) / 4 s = 0.5 req/s, replayed at 2 req/s: offsets / 4;
    # the 4th and 5th requests repeat the trace one mean gap (2 s) after its end
    req = replay_requests(jax.random.key(0), tables, 5, 2.0, trace_arrivals=True)
    np.testing.assert_allclose(np.asarray(req.arrival_s),
                               np.array([0.0, 1.0, 4.0, 6.0, 7.0]) / 4, rtol=1e-7)
    np.testing.assert_array_equal(np.asarray(req.prompt_tokens), [100, 200, 300, 100,
                                                                  200])
    np.testing.assert_array_equal(np.asarray(req.output_tokens), [1, 2, 3, 1, 2])
    # sampled: lengths drawn from the marginals, so pairs are not kept
    s = sample_requests(jax.random.key(0), tables, 4000, 2.0, tables.trace_arrival_s)
    pairs = set(zip(np.asarray(s.prompt_tokens), np.asarray(s.output_tokens)))
    assert (100.0, 3.0) in pairs


@pytest.mark.parametrize("replay", [Replay.sampled, Replay.exact])
def test_streams_are_the_default_float_type(tmp_path, replay):
    """A console script's stream is drawn in float32 and held in the default
    float type: under ``JAX_ENABLE_X64`` the same requests in float64, in
    which the simulator then computes (it computes in its stream's type;
    the streams were float32 whatever the flag)."""
    path = tmp_path / "t.csv"
    path.write_text("t,prompt,output\n10,100,1\n11,200,2\n14,300,3\n")
    workload = trace_workload(path, replay=replay)
    tables = workload_tables(workload)
    f32 = workload_requests(jax.random.key(0), workload, tables, 64, 2.0)
    with jax.enable_x64(True):
        f64 = workload_requests(jax.random.key(0), workload, tables, 64, 2.0)
    for a, b in zip(f32, f64, strict=True):
        assert a.dtype == np.float32 and b.dtype == np.float64
        np.testing.assert_array_equal(np.asarray(a, np.float64), np.asarray(b))


def test_served_tables_by_hand():
    tables = workload_tables(Workload(
        name="d", prompt=LengthDist(values=[100, 1000], probs=[0.5, 0.5]),
        output=LengthDist(values=[10, 200], probs=[0.75, 0.25])))
    # context 1,100: only (1000, 200) exceeds it, probability 0.5 * 0.25
    served, rejected = served_tables(tables, 1100, False, joint=False)
    assert rejected == pytest.approx(0.125)
    # P(prompt 1000 | served) = 0.5 * 0.75 / 0.875
    np.testing.assert_allclose(served.prompt_probs, [0.5 / 0.875, 0.375 / 0.875])
    np.testing.assert_allclose(served.output_probs, [0.75 / 0.875, 0.125 / 0.875])
    # truncated instead: (1000, 200) becomes (900, 200)
    cut, rejected = served_tables(tables, 1100, True, joint=False)
    assert rejected == 0.0
    np.testing.assert_allclose(cut.prompt_values, [100, 900, 1000])
    np.testing.assert_allclose(cut.prompt_probs, [0.5, 0.125, 0.375])
    # no limit, or one above every request: unchanged
    assert served_tables(tables, 0, False, joint=False) == (tables, 0.0)
    assert served_tables(tables, 1200, False, joint=False) == (tables, 0.0)


@pytest.mark.parametrize("text, pattern", [
    ("t,prompt,output\n0,0,5\n1,0,7\n", r"\.prompt: every length is 0"),
    ("t,prompt,output\n0,100,5\n1,1e12,7\n",
     r"\.prompt: length above 10,000,000 tokens .* at line 3"),
    ("t,prompt,output\n0,100,5\n1,x,7\n", r"\.prompt: not a finite number at line 3"),
    # a length of 500.7 tokens was read as 501, outputs of 0.5 as failed requests
    ("t,prompt,output\n0,100,5\n1,500.7,7\n",
     r"\.prompt: not a whole number of tokens at line 3 \('500\.7'\)"),
    ("t,prompt,output\n0,100,0.5\n1,200,0.5\n",
     r"\.output: not a whole number of tokens at line 2"),
    ("t,prompt,output\n0,100,5\n1,100,7,9\n", r"Expected 3 fields in line 3, saw 4"),
    ("t,prompt,output\n", r"empty trace"),
])
def test_bad_csv_is_refused(tmp_path, text, pattern):
    path = tmp_path / "t.csv"
    path.write_text(text)
    with pytest.raises(ConfigError, match=pattern):
        workload_tables(trace_workload(path))


def test_bad_jsonl_line_is_named(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"t": 0, "prompt": 1, "output": 1}\n\n'
                    '{"t": 1, "prompt": 1, "output": 1}\n{"t": 2, "prompt": \n')
    with pytest.raises(ConfigError, match=r"line 4 is not JSON"):
        workload_tables(trace_workload(path, "jsonl"))


def test_equal_timestamps_refused_for_arrivals_only(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("t,prompt,output\n5,100,5\n5,200,7\n")
    with pytest.raises(ConfigError, match=r"\.t: every timestamp is equal: 2 row"):
        workload_tables(trace_workload(path))
    # lengths alone are fine
    workload_tables(trace_workload(path, arrival=ArrivalKind.poisson))


@pytest.mark.slow
@pytest.mark.parametrize("trace, extra, pattern", [
    ("t,prompt,output\n5,100,5\n5,200,7\n", ["latency=simulate"],
     r"every timestamp is equal"),
    ("t,prompt,output\n0,100,5\n1,1e12,7\n", [], r"length above 10,000,000 tokens"),
    (None, ["workload=seed_chat", "workload.trace.path=x"],
     r"workload.trace.path=x: workload.trace is null in this config"),
])
def test_bad_trace_through_the_cli(tmp_path, trace, extra, pattern):
    args = ["hardware=h100_sxm", "model=qwen3_8b", "grid=small", "out=c.zarr"]
    if trace is not None:
        path = tmp_path / "t.csv"
        path.write_text(trace)
        args += ["workload=azure_conv_2023", f"workload.trace.path={path}",
                 "workload.trace.timestamp_column=t",
                 "workload.trace.timestamp_unit=s",
                 "workload.trace.prompt_column=prompt",
                 "workload.trace.output_column=output"]
    proc = run_script("sweep-grid", [*args, *extra], tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and re.search(pattern, lines[0]), proc.stderr
    assert not (tmp_path / "c.zarr").exists() and not (tmp_path / "outputs").exists()


def test_lengths_without_timestamps_feed_poisson_arrivals(tmp_path):
    """A file of lengths alone (as ShareGPT's and Vidur's are) under a
    workload whose config names a timestamp column: with Poisson arrivals
    the column is not read; replaying its arrivals still needs it (one line)."""
    path = tmp_path / "lengths.csv"
    path.write_text("prompt,output\n100,10\n300,30\n300,5\n")
    tables = workload_tables(trace_workload(path, arrival=ArrivalKind.poisson,
                                            replay=Replay.exact))
    assert tables.trace_arrival_s is None
    np.testing.assert_array_equal(tables.pairs, [[100, 10], [300, 30], [300, 5]])
    np.testing.assert_allclose(tables.prompt_probs, [1 / 3, 2 / 3])
    with pytest.raises(ConfigError, match=r"^workload\.trace\[lengths\.csv\]: missing "
                       r"column\(s\) \['t'\]; the file has \['prompt', 'output'\]; t "
                       r"is the timestamp column .* allowed without one: "
                       r"workload\.arrival=poisson$"):
        workload_tables(trace_workload(path))
