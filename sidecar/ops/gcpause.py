"""``gc_paused()``: no cyclic garbage collection inside a block that allocates many small objects.

A step of thousands of tensors makes tens of thousands of short-lived, acyclic objects (pieces,
message rows, units, results); each automatic collection they trigger walks every tracked object of
the process, which in a trainer holds millions. Pausing collection for the block and letting the
next one run after it cut a 10,000-tensor step from 125 to 21 µs per tensor (bench/ingest.py
--overhead-only). Nothing changes when collection is already off (a trainer's manual-GC mode).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class StepHold:
    """The collector off for a whole step, from the serve-loop turn that starts it to the one after it ends.

    ``gc_paused`` around each turn still let the collections run between turns, and in the worker
    thread meanwhile: every object a step keeps (its pieces, units, results) was walked once per
    generation it passed through while the step ran. Held, they are freed by reference counting
    when the step ends, and any garbage cycles wait for the first collection after it. A collector
    found off (a manual-GC mode) is left alone.
    """

    def __init__(self) -> None:
        self.held = False  # this object turned the collector off and turns it back on

    @contextlib.contextmanager
    def turn(self, busy: Callable[[], bool]) -> Iterator[None]:
        """One turn with the collector off; it stays off after the turn while ``busy()``."""
        if not self.held and not gc.isenabled():
            yield
            return
        gc.disable()
        self.held = True
        try:
            yield
        finally:
            if not busy():
                self.release()

    def release(self) -> None:
        """Turn the collector back on if this hold turned it off (the daemon's close)."""
        if self.held:
            self.held = False
            gc.enable()


def freeze_long_lived() -> None:
    """Move every object alive now out of the collector's sight (``gc.freeze``).

    The daemon's long-lived state (torch's modules, the plan of thousands of units, the arenas'
    views) otherwise sits in the oldest generation, and each full collection walks all of it again:
    measured at 180-300 ms per full collection with a 10,000-tensor plan, one every step or two.
    Frozen objects are still freed by reference counting; only garbage cycles among them stay (none
    are made at startup or by a plan).
    """
    gc.freeze()
