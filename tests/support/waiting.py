"""Waiting on a condition with a deadline: never a bare ``sleep`` to let something happen."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

#: how long a test waits for something that takes milliseconds when all is well
DEFAULT_TIMEOUT_S = 30.0


def wait_until(
    what: str, predicate: Callable[[], T], *, timeout: float = DEFAULT_TIMEOUT_S, interval: float = 0.05
) -> T:
    """``predicate()``'s first truthy value, asked every ``interval`` seconds until ``timeout``;
    AssertionError naming ``what`` and the last value seen when the deadline passes.

    ``predicate`` may itself block (a status round trip to a daemon); the deadline is checked
    between calls, so one slow call can overrun it by its own duration, never forever.
    """
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what} (last: {value!r:.200})")
        pause.wait(interval)
