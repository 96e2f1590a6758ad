"""A streamed step: ``push_step(step, export, declare=...)`` with ``export`` an iterable of
``(name, tensor)`` pairs (a Megatron-Bridge export), written to the daemon one item at a time.

BEGIN must list every piece before any data moves, so the pieces are declared up front (``declare``:
meta tensors, e.g. ``meta_state_dict(config)``) and the export is read afterwards. The trainer's
thread reads it (:meth:`StreamFeed.pour`: the export's own collectives and CUDA work run where the
trainer runs them) and hands each item through a queue of :data:`FEED_DEPTH` to the client's worker
thread, which writes it at once (:func:`write_stream`): into staging (same node), as frames (remote),
or, with a staging ring, into its layer group's region once granted. An item whose group is not
granted yet is held until it is (the only items ever held: an export in layer order holds none for
long). Each item must be one of the declared pieces, once; what is missing at the end, arrives
undeclared or twice, or differs in dtype or shape fails the step, and nothing is published.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from typing import Any

import torch

from sidecar.client.pieces import Piece, pieces
from sidecar.client.placement import placed_row, ring_arenas

#: the client (sidecar.client.client.RefitClient), typed loosely: that module imports this one
RefitClient = Any

#: items handed over ahead of the worker: the trainer computes the next while one is written
FEED_DEPTH = 2
#: how often the trainer's thread looks whether the step already failed while the queue is full
FEED_POLL_S = 0.05
_END = object()

Key = tuple[str, tuple[int, ...], tuple[int, ...], torch.dtype]


class StreamFeed:
    """The hand-off of a stream's items from the trainer's thread to the client's worker."""

    def __init__(self, depth: int = FEED_DEPTH) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None  # what the trainer's export raised
        self.declared: list[Piece] = []  # every piece BEGIN declares (READY may skip some)
        #: set once this rank's BEGIN is sent: the stream is read only then (see :meth:`pour`)
        self.begun = threading.Event()
        #: replicated=True: the names other ranks send, discarded as they come
        self.others: frozenset[str] = frozenset()
        #: replicated=True: after a failed step keep reading (discarding) until then, so every
        #: rank leaves the export's collectives together (time.monotonic(); 0: stop at once)
        self.drain_until = 0.0

    def pour(self, items: Mapping[str, Any] | Iterable[tuple[str, Any]], future: Future) -> None:
        """Read ``items`` on this thread, each handed over as soon as the worker can take it. Reading
        starts once this rank's BEGIN is out: the daemon hears of every rank before any rank waits
        on another inside the export's collectives (READY needs every rank's BEGIN). Stops early
        when the step ``future`` already ended (failed), except that a replicated stream is read to
        its end while its deadline allows (the other ranks' collectives wait for this rank). Never
        raises: an error of the export fails the step, which ``future`` reports."""
        while not self.begun.wait(FEED_POLL_S):
            if future.done():
                return
        try:
            source = iter(items.items() if isinstance(items, Mapping) else items)
            for name, value in source:
                if name in self.others:
                    value = None  # another rank sends it: dropped before the next item is made
                    continue
                ready = None
                if isinstance(value, torch.Tensor) and value.is_cuda:  # written once the trainer's work is
                    ready = torch.cuda.current_stream(value.device).record_event()
                if not self._put((name, value, ready), future):
                    self._drain(source)
                    return
        except Exception as exc:  # the trainer's export failed: the step fails with it
            self.error = exc
        self._put(_END, future)

    def _drain(self, source: Iterable[tuple[str, Any]]) -> None:
        """The step failed: read the rest of a replicated stream, discarding it, while its deadline
        allows (a rank that never began fails it at the deadline: then nothing is read)."""
        if time.monotonic() >= self.drain_until:
            return
        with contextlib.suppress(Exception):  # the step's error is what the trainer hears
            for _ in source:
                if time.monotonic() >= self.drain_until:
                    return

    def _put(self, item: Any, future: Future) -> bool:
        while not future.done():
            try:
                self._queue.put(item, timeout=FEED_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def take(self, client: RefitClient, step: int, deadline: float) -> Any:
        """The next item (``_END`` after the last), keeping the step alive while waiting for it."""
        while True:
            try:
                return self._queue.get(timeout=min(client._heartbeat(), FEED_POLL_S))
            except queue.Empty:
                client._keepalive(step, deadline, "waiting for the trainer's export (a streamed step)")
                client._poll(step, 0.0)


def _key(p: Piece) -> Key:
    return (p.name, tuple(p.offsets), tuple(p.tensor.shape), p.tensor.dtype)


def write_stream(
    client: RefitClient,
    step: int,
    declared: list[Piece],
    ids: list[int],
    ready: dict,
    feed: StreamFeed,
    deadline: float,
) -> tuple[str, str]:
    """Write the stream's items as they come (on the client's worker thread); ``declared`` and
    ``ids`` are the pieces READY asks for (those outside the node share left out)."""
    local, ring = "staging" in ready, "ring" in ready
    placement = ready.get("placement") if ring else None
    if ring and (not isinstance(placement, list) or len(placement) != len(declared)):
        raise ValueError(f"READY places {len(placement or ())} pieces, this rank declared {len(declared)}")
    want: dict[Key, tuple[int, int, int]] = {}  # key -> (piece id, group, offset in the group's region)
    by_name: dict[str, list[Key]] = {}
    arenas = ring_arenas(ready) if ring else 1
    placed: dict[int, int] = {}  # group -> the staging arena READY places it in
    for i, (p, pid) in enumerate(zip(declared, ids)):
        group, rel, arena = placed_row(placement[i], arenas) if ring else (-1, 0, 0)
        placed[group] = arena
        want[_key(p)] = (pid, group, rel)
        by_name.setdefault(p.name, []).append(_key(p))
    if local and ring:
        client.open_staging(ready)
    elif local:
        client._local.open(ready["staging"])
    pending: dict[int, list[tuple[Piece, int, int]]] = {}
    got: set[Key] = set()
    # Backpressure: the items of at most ``hold`` ungranted groups wait here (the ring's regions on
    # every GPU), so a trainer's export is not drained into memory while the daemon is slow to
    # grant. Waiting is safe only once this rank has sent everything of every earlier group (the
    # daemon grants in plan order and frees a region when its group completes), so a stream out of
    # plan order keeps being read instead of deadlocking.
    hold = _held_groups(ready, arenas) if ring else 0
    left: dict[int, int] = {}  # group -> this rank's pieces of it not yet yielded
    for _, group, _ in want.values():
        left[group] = left.get(group, 0) + 1
    order, first = sorted(left), 0  # order[first]: this rank's first group not wholly yielded

    def earlier_sent(group: int) -> bool:
        nonlocal first
        while first < len(order) and left[order[first]] == 0:
            first += 1
        return first == len(order) or order[first] >= group

    skipped_names = {p.name for p in getattr(feed, "declared", ())} - set(by_name)

    def write(group: int, rows: list[tuple[Piece, int, int]]) -> None:
        ps, pids = [r[0] for r in rows], [r[1] for r in rows]
        if local and ring:
            offset, arena = client.granted_region(group, placed[group], arenas)
            client._local.write_group(
                step, [(p, pid, rel, None) for p, pid, rel in rows], offset, deadline, arena
            )
        elif local:
            client._local.write_pieces(step, ps, pids, ready["staging"], deadline)
        else:
            client._remote.stream(step, ps, pids, deadline, client._frame_limit())

    def flush() -> None:
        for g in [g for g in pending if g in client._slots]:
            write(g, pending.pop(g))

    while True:
        item = feed.take(client, step, deadline)
        if item is _END:
            break
        name, value, event = item
        if name in skipped_names:
            continue  # outside the daemon's node share
        if event is not None:
            if local:
                client._local.ready_events = [event]
            else:
                event.synchronize()
        for p in pieces([(name, value)]):
            key = _key(p)
            if key not in want:
                raise ValueError(_unexpected(p, by_name.get(p.name, ())))
            if key in got:
                raise ValueError(
                    f"{p.name!r} (offsets {list(p.offsets)}) arrived twice in the stream; send each piece once"
                )
            got.add(key)
            pid, group, rel = want[key]
            left[group] -= 1
            if ring:
                pending.setdefault(group, []).append((p, pid, rel))
            else:
                write(group, [(p, pid, rel)])
        if ring:
            client._poll(step, 0.0)
            flush()
            while len(pending) > hold and earlier_sent(min(pending)):
                client._keepalive(step, deadline, "waiting for a staging region (SLOT)")
                client._poll(step, client._heartbeat())
                flush()
    if feed.error is not None:
        raise ValueError(
            f"the trainer's export raised {type(feed.error).__name__}: {feed.error}"
        ) from feed.error
    missing = [k[0] for k in want if k not in got]
    if missing:
        raise ValueError(
            f"the stream ended without {len(missing)} declared piece(s): {missing[:10]}; yield every tensor "
            "declare= lists (or declare only what this rank sends)"
        )
    while pending:  # items whose group the daemon has not granted a region yet
        client._keepalive(step, deadline, "waiting for a staging region (SLOT)")
        client._poll(step, client._heartbeat())
        flush()
    return ("staging", "") if local else ("zmq", "a streamed step sends frames")


def _held_groups(ready: dict, arenas: int) -> int:
    """How many ungranted groups' items a rank holds before it waits for a SLOT: the ring's regions
    on every GPU (READY's ``ring.regions``; at least one)."""
    regions = ready["ring"].get("regions", 1) if isinstance(ready.get("ring"), dict) else 1
    return max(1, regions if type(regions) is int else 1) * arenas


def _unexpected(p: Piece, keys: Iterable[Key]) -> str:
    keys = list(keys)
    what = f"{p.name!r} ({str(p.tensor.dtype).removeprefix('torch.')} {list(p.tensor.shape)} at {list(p.offsets)})"
    if not keys:
        return f"{what} arrived in the stream but declare= does not list it; declare every tensor the export yields"
    shown = ", ".join(f"{str(d).removeprefix('torch.')} {list(s)} at {list(o)}" for _, o, s, d in keys)
    return (
        f"{what} is not what declare= lists for it ({shown}); declare the dtype and shape the export yields"
    )
