"""Per-generation epochs in a small shared-memory page: how a reader learns its copy may be torn.

The daemon revokes a reader's hold on a generation after ``reader_timeout_s`` (a stuck engine must
not block training) and may then write a new step into it while a live but slow reader still copies
out of it. A seqlock-style epoch makes that visible without a round trip on the fast path:

* the daemon owns one page of ``uint64`` epochs, one per generation (``/dev/shm/<prefix>-epochs-…``,
  mode 0600, unlinked with its other segments), and bumps generation G's epoch BEFORE any byte of a
  new step is written into G (when G is claimed as a step's target);
* a ``GENERATION`` message carries the epoch G was published at, and the page's handle;
* a reader maps the page read-only and, after copying out, re-reads G's epoch: unchanged means no
  byte of G was rewritten since it was handed out (the copy is intact); changed means it may be torn.

    page = EpochPage.create("refitd-x-epochs-ab12", count=2)     # the daemon
    page.bump(0)                                                 # before writing a step into gen 0
    view = EpochView.attach(page.handle())                       # a reader, read-only
    intact = view.read(0) == epoch_at_handout                    # after the copy finished

Ordering: the daemon's bump is a single aligned 8-byte store followed by a fence; every write into
the generation happens after it (on the serve loop or on threads it hands work to through locks, or
on a GPU stream launched after it). The reader fences between its copy and the re-read, so the
re-read cannot be satisfied before the copy's loads (this matters on weakly ordered CPUs).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import torch

from transport.arena import ArenaKind
from transport.shm import ShmSegment

__all__ = ["EPOCH_BYTES", "EpochPage", "EpochView", "fence"]

EPOCH_BYTES = 8  # one uint64 per generation (stored as int64: an epoch never reaches 2**63)
FIRST_EPOCH = 1  # what every generation starts at (0 is never a published epoch)

_FENCE = threading.Lock()


def fence() -> None:
    """A full memory barrier: taking and dropping a lock orders every load and store around it
    (a pthread mutex is a barrier on every CPU CPython runs on; Python has no bare fence)."""
    with _FENCE:
        pass


class _Page:
    def __init__(self, segment: ShmSegment, count: int):
        self.segment, self.count = segment, count
        self._epochs = segment.view(0, torch.int64, (count,)).numpy()

    @property
    def name(self) -> str:
        return self.segment.name

    def read(self, index: int) -> int:
        """Generation ``index``'s epoch now (one aligned 8-byte load)."""
        if not 0 <= index < self.count:
            raise IndexError(
                f"generation {index} is not in epoch page {self.name!r} ({self.count} generations)"
            )
        return int(self._epochs[index])

    def handle(self) -> dict[str, Any]:
        """What a reader needs to map the page (plain data for msgpack)."""
        return {
            "kind": ArenaKind.SHM.value,
            "name": self.name,
            "size": self.segment.size,
            "count": self.count,
        }

    def close(self) -> None:
        self._epochs = None
        self.segment.close()


class EpochPage(_Page):
    """The daemon's page: created at start next to its arenas, the only writer, unlinked at close."""

    @classmethod
    def create(cls, name: str, count: int) -> EpochPage:
        if count <= 0:
            raise ValueError(f"epoch page {name!r}: {count} generations; it needs at least one")
        page = cls(ShmSegment.create(name, count * EPOCH_BYTES, read_only_on_disk=True), count)
        page._epochs[:] = FIRST_EPOCH
        return page

    def bump(self, index: int) -> int:
        """Advance generation ``index``'s epoch (before any byte of a new step goes into it); returns it."""
        epoch = self.read(index) + 1
        self._epochs[index] = epoch
        fence()
        return epoch

    def unlink(self) -> None:
        self.segment.unlink()


class EpochView(_Page):
    """A reader's read-only mapping of the daemon's page (a stray write faults, it cannot forge)."""

    @classmethod
    def attach(cls, handle: Mapping[str, Any]) -> EpochView:
        try:
            name, count = str(handle["name"]), int(handle["count"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(
                f"the daemon's epoch page handle {handle!r} lacks a name or count: reader and daemon "
                "versions disagree; upgrade the older one"
            ) from None
        if count <= 0:
            raise ValueError(f"the daemon's epoch page {name!r} claims {count} generations")
        view = cls(ShmSegment.attach(name, count * EPOCH_BYTES, writable=False), count)
        view._epochs.flags.writeable = False  # a write raises here instead of faulting the process
        return view
