"""Writes a sweep's blocks in one background thread while the next ones evaluate.

Without it the device waits for the disk: each block was copied to the host,
compressed and written before the next one started. Here the caller hands
each evaluated block to ``BlockWriter.put`` and goes on evaluating; a single
thread writes the blocks in the order they come (each block's data, then its
marker: ``sweep.cube.results.write_block``), so a kill at any moment leaves a
store whose markers name only complete blocks. ``put`` returns once the
thread has taken the block, which bounds the memory held to two blocks: the
one being written and the next one, evaluated meanwhile and waiting in
``put``.

An error of the thread (a full disk, or the progress callback interrupting
the sweep) stops the writing: the blocks still waiting are dropped, and the
error is raised in the caller's thread by its next ``put`` or by ``close``.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable


class BlockWriter:
    """Calls ``write(*item)`` in a background thread for each ``put(*item)``.

    Use as a context manager: leaving it normally waits for every block to be
    written (``close``) and raises the writer's error, if any; leaving it on
    an error drops the blocks still waiting and waits only for the one being
    written.
    """

    def __init__(self, write: Callable[..., None]):
        self._write = write
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sweep-writer",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            self._queue.task_done()  # taken: the caller goes on
            if self._error is not None or self._stop.is_set():
                continue  # drained, not written: the caller stops at its next put
            try:
                self._write(*item)
            except BaseException as e:  # noqa: BLE001  (raised in the caller)
                self._error = e

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def put(self, *item) -> None:
        """Hands one block to the thread (waits until it takes it: until it
        has written the one before); raises the writer's error, if any,
        instead."""
        self._raise()
        self._queue.put(item)
        self._queue.join()

    def close(self) -> None:
        """Waits for every queued block to be written; raises the writer's error."""
        self._queue.put(None)
        self._thread.join()
        self._raise()

    def __enter__(self) -> BlockWriter:
        return self

    def __exit__(self, kind, error, tb) -> None:
        if kind is None:
            self.close()
            return
        self._stop.set()  # the caller failed: write nothing more
        self._queue.put(None)
        self._thread.join()
