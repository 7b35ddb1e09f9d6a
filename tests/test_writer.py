"""The block writer: blocks written in order in its thread, its errors raised
in the caller's thread, nothing written after an error or an interruption."""

from __future__ import annotations

import threading

import pytest

from sweep.grid.writer import BlockWriter


def test_blocks_are_written_in_order_in_another_thread():
    seen, threads = [], set()

    def write(i):
        seen.append(i)
        threads.add(threading.current_thread().name)

    with BlockWriter(write) as writer:
        for i in range(5):
            writer.put(i)
    assert seen == list(range(5)) and threads == {"sweep-writer"}


def test_an_error_of_the_writer_is_raised_in_the_caller_and_stops_the_writing():
    seen = []

    def write(i):
        if i == 2:
            raise OSError(28, "No space left on device")
        seen.append(i)

    with pytest.raises(OSError, match="No space left"):
        with BlockWriter(write) as writer:
            for i in range(6):
                writer.put(i)
    assert seen == [0, 1]


def test_an_interrupted_caller_leaves_the_waiting_blocks_unwritten():
    seen, release = [], threading.Event()

    def write(i):
        release.wait(5)
        seen.append(i)

    with pytest.raises(KeyboardInterrupt):
        with BlockWriter(write) as writer:
            writer.put(0)  # taken: being written
            release.set()
            raise KeyboardInterrupt
    assert seen == [0]  # the block being written is finished, not cut
