"""A clock the test sets by hand, for code that takes a ``clock`` callable."""

from __future__ import annotations


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t
