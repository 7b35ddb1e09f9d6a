"""The summary table reduced from a sweep's blocks in memory equals the table
read back from the written cube: ties, points that fit nowhere, a scenario
axis fixed at its first value, rows cut at ``MAX_ROWS``, a resumed sweep."""

from __future__ import annotations

import io

import pytest
from helpers import grid_job
from rich.console import Console

from sweep.cube import results, summary
from sweep.grid import job as grid

# L40S cannot hold Qwen3-32B at TP 1 (rows that fit nowhere); at 32k tokens of
# context the larger concurrencies do not fit; the cost does not depend on
# the token budget (ties, first wins, across blocks too); long_prompt_tokens
# is fixed at its first value; blocks of 16 points split the choices over 32
# blocks
ARGS = ["grid=small", "grid.hardware=[h100_sxm,l40s]",
        "grid.model=[qwen3_8b,qwen3_32b]", "grid.tensor_parallel=[1]",
        "grid.concurrency=[1,8,64,256]", "grid.context_tokens=[1500,32000]",
        "grid.long_prompt_tokens=[4096,8192]",
        "grid.traffic_tokens_per_day=[1e8,1e10]", "grid.chunk_points=16",
        "calibration=roofline"]


def text(table_notes) -> str:
    table, notes = table_notes
    console = Console(file=io.StringIO(), width=300)
    console.print(table)
    return console.file.getvalue() + "\n".join(notes)


class Interrupt(Exception):
    pass


@pytest.fixture(scope="module")
def job():
    return grid_job(ARGS)


def rows_of(job) -> summary.Rows:
    rows = summary.Rows.of(results.template(job.coords, job.parts, {}, job.extra),
                           job.parts)
    assert rows is not None
    return rows


def test_rows_from_memory_equal_rows_read_back(job, tmp_path, monkeypatch):
    monkeypatch.setattr(summary, "MAX_ROWS", 5)  # the first scenarios' rows
    rows = rows_of(job)
    ds = grid.run(job, tmp_path / "c.zarr", {}, "x", observe=rows.add)
    assert rows.seen == set(range(len(job.parts[0].plan))) and len(rows.seen) > 4
    expected = text(summary.summary_table(ds))
    assert text(rows.table(ds)) == expected
    assert "does not fit" in expected
    assert "long_prompt_tokens fixed at 4,096" in expected
    assert "11 more row(s) of 16" in expected


def test_rows_of_a_resumed_sweep_read_the_earlier_blocks_back(job, tmp_path):
    out = tmp_path / "c.zarr"

    def stop(done, total):
        if done == 3:
            raise Interrupt

    earlier = rows_of(job)
    with pytest.raises(Interrupt):
        grid.run(job, out, {}, "x", progress=stop, observe=earlier.add)
    rows = rows_of(job)
    ds = grid.run(job, out, {}, "x", observe=rows.add)
    assert len(rows.seen) == len(job.parts[0].plan) - 3
    expected = text(summary.summary_table(ds))
    assert text(rows.table(ds)) == expected
    assert "4 more row(s)" not in expected and expected.count("does not fit") == 4


def test_a_cube_with_p99_variables_is_summarised_from_the_cube(tmp_path):
    job = grid_job(["grid=small", "hardware=h100_sxm", "latency=surrogate"])
    assert summary.Rows.of(results.template(job.coords, job.parts, {}, job.extra),
                           job.parts) is None
