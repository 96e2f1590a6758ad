"""Staging as a ring of regions: pure bookkeeping over byte ranges, for shm and CUDA arenas alike.

``StagingRing`` knows which region is free, granted, filled or being drained, and who waits for
one; it holds no memory. The daemon's ``sidecar.daemon.memory.staging.RingStaging`` uses it to stream a step
through staging one layer group at a time.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import enum
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from transport.layout import ALIGN

__all__ = ["RingError", "RingSlot", "SlotState", "StagingRing"]


class SlotState(enum.Enum):
    FREE = "free"  # nobody owns it
    CLAIMED = "claimed"  # granted to a producer, which is writing it
    FILLED = "filled"  # written; queued for the consumer in fill order
    DRAINING = "draining"  # the consumer is reading it (assembling / quantizing)


@dataclass(slots=True)
class RingSlot:
    index: int
    offset: int  # bytes from the start of the staging arena
    nbytes: int
    ticket: int = 0  # changes at every grant: a fill or release naming an old ticket is refused
    state: SlotState = SlotState.FREE
    owner: Hashable | None = None
    contents: Any = None  # what the producer said it wrote (piece ids, sub-blocks), set at fill


class RingError(ValueError):
    """A ring operation out of turn: a stale ticket, a slot in the wrong state, an oversized write."""


class StagingRing:
    """``regions`` staging regions of ``region_bytes`` each, granted to producers one at a time.

    Trainers stream layer by layer through the ring while the daemon drains filled regions behind
    them, so staging need not hold a whole step. A region goes FREE -> CLAIMED (``claim``) ->
    FILLED (``fill``) -> DRAINING (``take``) -> FREE (``release``); producers that find no free
    region wait in FIFO order and are granted the next one released. Tickets make every grant
    distinct, so a late message about an earlier use of a region is refused, not obeyed. Slots
    handed out are snapshots; ``slots`` is the live table. Operations that free capacity (``fill``
    under a ``per_owner`` limit, ``release``, ``drop``) return the grants they made to waiters.

    >>> ring = StagingRing(regions=4, region_bytes=256 << 20)
    >>> slot = ring.claim(owner=0)           # None: queued; the grant comes back from release()
    >>> ring.fill(slot.index, slot.ticket, contents=[(7, (0, 0), (128, 4096))])   # -> grants
    >>> slot = ring.take()                   # daemon: oldest filled region
    >>> granted = ring.release(slot.index, slot.ticket)   # [RingSlot …] to tell their owners
    """

    def __init__(
        self, *, regions: int, region_bytes: int, base_offset: int = 0, per_owner: int | None = None
    ):
        if regions < 1:
            raise ValueError(f"a staging ring needs at least 1 region, got {regions}")
        if region_bytes < ALIGN or region_bytes % ALIGN:
            raise ValueError(f"region_bytes must be a positive multiple of {ALIGN}, got {region_bytes}")
        if base_offset % ALIGN:
            raise ValueError(f"base_offset must be a multiple of {ALIGN}, got {base_offset}")
        if per_owner is not None and per_owner < 1:
            raise ValueError(f"per_owner must be at least 1 (or None for no limit), got {per_owner}")
        self.region_bytes, self.per_owner = region_bytes, per_owner
        self.slots = [RingSlot(i, base_offset + i * region_bytes, region_bytes) for i in range(regions)]
        self._free: collections.deque[int] = collections.deque(range(regions))
        self._filled: collections.deque[int] = collections.deque()
        self._waiting: collections.deque[Hashable] = collections.deque()
        self._tickets = 0

    @property
    def size(self) -> int:
        """Bytes the staging arena must hold from ``base_offset`` on."""
        return len(self.slots) * self.region_bytes

    def count(self, state: SlotState) -> int:
        return sum(s.state is state for s in self.slots)

    @property
    def waiting(self) -> list[Hashable]:
        return list(self._waiting)

    def held_by(self, owner: Hashable) -> list[RingSlot]:
        return [s for s in self.slots if s.owner == owner and s.state is SlotState.CLAIMED]

    def claim(self, owner: Hashable) -> RingSlot | None:
        """A free region for ``owner``, or None with ``owner`` queued (once) for a later grant.

        Every waiter ahead is at its ``per_owner`` limit or there would be no free region (each
        operation that frees capacity serves the queue), so a grant here jumps nobody.
        """
        if self._free and owner not in self._waiting and self._may_hold(owner):
            return self._grant(owner)
        if owner not in self._waiting:
            self._waiting.append(owner)
        return None

    def fill(
        self, index: int, ticket: int, contents: Any = None, *, nbytes: int | None = None
    ) -> list[RingSlot]:
        """The producer finished writing region ``index``: queue it for the consumer.

        Returns the grants this made (the producer may now be under its ``per_owner`` limit).
        """
        slot = self._slot(index, ticket, SlotState.CLAIMED, "fill")
        if nbytes is not None and not 0 <= nbytes <= slot.nbytes:
            raise RingError(f"region {index} holds {slot.nbytes} bytes; the producer says it wrote {nbytes}")
        slot.state, slot.contents = SlotState.FILLED, contents
        self._filled.append(index)
        return self._serve_waiters()

    def take(self) -> RingSlot | None:
        """The oldest filled region, now DRAINING; None when nothing is filled."""
        if not self._filled:
            return None
        slot = self.slots[self._filled.popleft()]
        slot.state = SlotState.DRAINING
        return copy.copy(slot)

    def release(self, index: int, ticket: int) -> list[RingSlot]:
        """The consumer is done with region ``index``; returns the grants this made to waiters."""
        self._free_slot(self._slot(index, ticket, SlotState.DRAINING, "release"))
        return self._serve_waiters()

    def drop(self, owner: Hashable) -> list[RingSlot]:
        """Forget a producer that left: unqueue it and free its CLAIMED regions; returns new grants.

        Regions it already filled stay queued (their bytes are whole); the step decides their fate.
        """
        with contextlib.suppress(ValueError):
            self._waiting.remove(owner)
        for slot in self.held_by(owner):
            self._free_slot(slot)
        return self._serve_waiters()

    def reset(self) -> None:
        """Every region FREE, queues empty, old tickets void (the step aborted or finished)."""
        for slot in self.slots:
            slot.state, slot.owner, slot.contents = SlotState.FREE, None, None
            self._tickets += 1
            slot.ticket = self._tickets
        self._free = collections.deque(range(len(self.slots)))
        self._filled.clear()
        self._waiting.clear()

    # ---- internals

    def _may_hold(self, owner: Hashable) -> bool:
        return self.per_owner is None or len(self.held_by(owner)) < self.per_owner

    def _grant(self, owner: Hashable) -> RingSlot:
        slot = self.slots[self._free.popleft()]
        self._tickets += 1
        slot.state, slot.owner, slot.ticket, slot.contents = SlotState.CLAIMED, owner, self._tickets, None
        return copy.copy(slot)  # a snapshot: the grant as sent to its owner

    def _free_slot(self, slot: RingSlot) -> None:
        slot.state, slot.owner, slot.contents = SlotState.FREE, None, None
        self._free.append(slot.index)

    def _serve_waiters(self) -> list[RingSlot]:
        granted: list[RingSlot] = []
        skipped: list[Hashable] = []
        while self._free and self._waiting:
            owner = self._waiting.popleft()
            if self._may_hold(owner):
                granted.append(self._grant(owner))
            else:
                skipped.append(owner)  # at its limit: keeps its place for the next release
        self._waiting.extendleft(reversed(skipped))
        return granted

    def _slot(self, index: int, ticket: int, state: SlotState, op: str) -> RingSlot:
        if not 0 <= index < len(self.slots):
            raise RingError(f"{op}: region {index} does not exist (the ring has {len(self.slots)})")
        slot = self.slots[index]
        if slot.ticket != ticket:
            raise RingError(f"{op}: region {index} ticket {ticket} is stale (current {slot.ticket})")
        if slot.state is not state:
            raise RingError(f"{op}: region {index} is {slot.state.value}, expected {state.value}")
        return slot
