"""Progress of a job's blocks on stderr: a bar on a terminal, lines elsewhere.

On a terminal, a ``rich`` bar (redrawn in place). Anywhere else (a log file,
a pipe, a batch system) a bar would print nothing useful, so a line goes out
every ``SWEEP_PROGRESS_S`` seconds (default 10) from a background thread, and
one when the job ends: blocks done, time elapsed and, once blocks of the
running part have finished in this run, the time its remaining blocks take at
the rate of its last ones. The parts (roofline, p99) run one after the other
with blocks of very different cost, and the first block of each compiles,
so a part's rate says nothing of the next one's.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque

from rich.console import Console
from rich.progress import BarColumn, Progress, TimeElapsedColumn, TimeRemainingColumn

from sweep.grid.plan import duration

INTERVAL_ENV = "SWEEP_PROGRESS_S"
DEFAULT_INTERVAL_S = 10.0
RECENT_BLOCKS = 5


def interval_s() -> float:
    """Seconds between progress lines (``SWEEP_PROGRESS_S``, default 10)."""
    try:
        value = float(os.environ.get(INTERVAL_ENV, DEFAULT_INTERVAL_S))
    except ValueError:
        return DEFAULT_INTERVAL_S
    return value if value > 0 else DEFAULT_INTERVAL_S


class BlockProgress:
    """A ``progress(done_blocks, total_blocks)`` callback; ``close()`` when done.

    Args:
      console: the stderr console.
      label: what prefixes each line (the command's name).
      parts: ``(name, blocks)`` of each part, in the order they run.
    """

    def __init__(self, console: Console, label: str,
                 parts: list[tuple[str, int]]):
        self._console = console
        self._label = label
        self._parts = parts
        self._terminal = console.is_terminal
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self._done = self._total = 0
        self._recent: deque[tuple[float, int]] = deque(maxlen=RECENT_BLOCKS + 1)
        self._bar = self._task = None
        self._stop = threading.Event()
        self._thread = None

    def _part(self, done: int) -> int:
        """Index of the part whose block runs after ``done`` blocks."""
        end = 0
        for i, (_, n) in enumerate(self._parts):
            end += n
            if done < end:
                return i
        return len(self._parts) - 1

    def __call__(self, done: int, total: int) -> None:
        with self._lock:
            if self._recent and self._part(done) != self._part(self._recent[-1][1]):
                self._recent.clear()  # a new part: its own rate
            self._done, self._total = done, total
            self._recent.append((time.monotonic(), done))
        if self._terminal:
            self._draw(done, total)
        elif self._thread is None and done < total:
            self._thread = threading.Thread(target=self._report, daemon=True)
            self._thread.start()

    def _draw(self, done: int, total: int) -> None:
        if total <= 1:
            return
        if self._bar is None:
            self._bar = Progress("{task.description}", BarColumn(),
                                 "{task.completed}/{task.total} blocks",
                                 TimeElapsedColumn(), TimeRemainingColumn(),
                                 console=self._console, transient=True)
            self._bar.start()
            self._task = self._bar.add_task("evaluating", total=total)
        self._bar.update(self._task, completed=done)

    def _report(self) -> None:
        while not self._stop.wait(interval_s()):
            self._print(self.status())

    def _print(self, line: str) -> None:
        self._console.print(line, markup=False, highlight=False, soft_wrap=True)

    def status(self) -> str:
        """E.g. ``sweep-grid: 3/10 blocks, 42 s elapsed, ~1 min left for ...``."""
        with self._lock:
            done, total, recent = self._done, self._total, list(self._recent)
        elapsed = time.monotonic() - self._start
        text = f"{self._label}: {done:,}/{total:,} blocks, {duration(elapsed)} elapsed"
        if done >= total:
            return text
        i = self._part(done)
        name = self._parts[i][0]
        end = sum(n for _, n in self._parts[:i + 1])
        later = total - end
        (t0, d0), (t1, d1) = recent[0], recent[-1]
        if d1 > d0:
            left = (end - done) * (t1 - t0) / (d1 - d0)
            text += f", ~{duration(left)} left for the {name} blocks"
        else:
            text += f", a {name} block running (the first of a part compiles)"
        if later > 0:
            text += f", then {later:,} block(s) of {self._parts[i + 1][0]}"
        return text

    def close(self) -> None:
        """Stops the bar or the line thread; a last line when lines were printed."""
        if self._bar is not None:
            self._bar.stop()
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._print(f"{self._label}: {self._done:,}/{self._total:,} blocks in "
                        f"{duration(time.monotonic() - self._start)}")
