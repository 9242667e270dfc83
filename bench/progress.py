"""Progress of a long bench on stderr: what runs now, how far along, and the time left.

On a terminal it is a ``rich`` progress bar (the bar, steps done, elapsed and remaining
time), which it clears when done; elsewhere (a pipe, a log, CI) one plain line per step
with the time left estimated from the steps so far. Stdout stays the bench's result alone.
Without ``rich`` installed the plain lines are used everywhere.

Used from one thread (the bench's event loop); ``step`` never blocks.
"""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import Any, TextIO


def _rich_progress(stream: TextIO) -> Any:
    try:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
    except ImportError:
        return None
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("left"),
        TimeRemainingColumn(),
        console=Console(file=stream),
        transient=True,
    )


class Steps:
    """``with Steps(total, "bench overhead") as steps: steps.step("label"); ...``: each
    ``step`` says that the previous one is done and names the one that begins."""

    def __init__(self, total: int, what: str, stream: TextIO | None = None) -> None:
        self.total, self.what = max(total, 1), what
        self.stream = stream or sys.stderr
        self.done = -1  # the first step() begins step 1, nothing done yet
        self.started = time.monotonic()
        self._bar: Any = _rich_progress(self.stream) if self.stream.isatty() else None
        self._task: Any = None

    def __enter__(self) -> Steps:
        if self._bar is not None:
            self._bar.start()
            self._task = self._bar.add_task(self.what, total=self.total)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._bar is not None:
            self._bar.stop()
        elif kind is None:
            took = time.monotonic() - self.started
            self.stream.write(f"{self.what}: done in {_duration(took)}\n")
            self.stream.flush()

    def left_s(self) -> float | None:
        """Estimated seconds left (None before a step is done)."""
        if self.done <= 0:
            return None
        per = (time.monotonic() - self.started) / self.done
        return per * (self.total - self.done)

    def step(self, label: str) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, description=f"{self.what}: {label}")
            return
        left = self.left_s()
        eta = "" if left is None else f", about {_duration(left)} left"
        self.stream.write(f"{self.what}: [{self.done + 1}/{self.total}] {label}{eta}\n")
        self.stream.flush()


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 60} min {seconds % 60} s" if seconds >= 60 else f"{seconds} s"
