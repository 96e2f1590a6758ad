"""Same-node ranks: pieces copied straight into the daemon's staging arena, never exported.

The daemon hands the rank a handle to its staging arena (POSIX shm, or a CUDA-IPC handle to its GPU
arena) in READY; :class:`StagingWriter` maps it once and copies each piece into its tensor's place:
the whole step at once, or, with a staging ring, one granted layer-group region at a time. A piece
the daemon publishes unchanged (READY's ``direct``) goes straight into the generation being written. Every
``DONE_BATCH_BYTES`` / ``DONE_BATCH_PIECES`` it tells the daemon which pieces landed (PIECE_DONE), so
the daemon quantizes layers while later ones are still being written.

    writer = StagingWriter(link)
    writer.write_step(step, pieces, ids, ready["staging"], deadline)   # whole-step staging
    writer.close()                                                     # unmap the arena
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from sidecar.client import pieces as P
from sidecar.client.pieces import Link, Piece, copy_all
from sidecar.ops.gcpause import gc_paused
from transport.cuda_ipc import open_any_arena
from transport.wire import Kind

#: pieces of at most this many bytes are copied together (one foreach copy per PIECE_DONE batch), not
#: one torch call each
FOREACH_COPY_BYTES = 256 << 10


class StagingWriter:
    """Writes a local rank's pieces into the daemon's staging arena (the client's worker thread only)."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.arena: Any = None  # the mapped staging arena (ShmArena or a CUDA-IPC arena), or None
        #: the daemon's generations this rank wrote directly (READY's ``direct``), by segment name, and
        #: the tensor views made in each (the same offsets come back every step)
        self.generations: dict[str, Any] = {}
        self._direct_views: dict[tuple[str, int, torch.dtype, tuple[int, ...]], torch.Tensor] = {}
        #: CUDA events recorded on the trainer's streams at push_step: the tensors are written once they fire
        self.ready_events: list = []
        self._streams: dict[int, torch.cuda.Stream] = {}  # GPU staging: the copy stream per device

    def open(self, handle: dict) -> None:
        """Map the arena READY names (again only when it is another one)."""
        if self.arena is None or self.arena.name != handle.get("name"):
            self.close()
            self.arena = open_any_arena(handle, writable=True)

    def close(self) -> None:
        """Unmap the arenas (a restarted daemon's segments are never written again); idempotent."""
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        self._close_generations()

    def _close_generations(self) -> None:
        self._direct_views.clear()
        for arena in self.generations.values():
            arena.close()
        self.generations.clear()

    def _generation(self, handle: dict) -> Any:
        """The generation READY's ``direct`` names, mapped once (a daemon has two; another name
        means another daemon instance: the old mappings go)."""
        name = handle.get("name")
        arena = self.generations.get(name)
        if arena is None:
            if len(self.generations) >= 2:
                self._close_generations()
            arena = self.generations[name] = open_any_arena(handle, writable=True)
        return arena

    def _direct_view(self, arena: Any, offset: int, piece: Piece) -> torch.Tensor:
        key = (arena.name, offset, piece.tensor.dtype, piece.global_shape)
        view = self._direct_views.get(key)
        if view is None:
            view = self._direct_views[key] = arena.view(offset, piece.tensor.dtype, piece.global_shape)
        return view

    def write_step(
        self,
        step: int,
        pieces: list[Piece],
        ids: list[int],
        handle: dict,
        deadline: float,
        direct: tuple[dict, dict[int, int]] | None = None,
    ) -> None:
        """Whole-step staging: every piece into its tensor's slot of the arena; with ``direct``
        (the generation's handle, and piece id -> byte offset of its tensor there), a piece the
        daemon publishes unchanged goes straight into the generation instead."""
        self.open(handle)
        views = self.arena.tensors()  # device-to-device copies through the mapped handle on GPUs
        if direct is None:
            dests = ((p, pid, views[p.name]) for p, pid in zip(pieces, ids))
        else:
            gen, offsets = self._generation(direct[0]), direct[1]

            def dest(p: Piece, pid: int) -> torch.Tensor:
                offset = offsets.get(pid, -1)
                return views[p.name] if offset < 0 else self._direct_view(gen, offset, p)

            dests = ((p, pid, dest(p, pid)) for p, pid in zip(pieces, ids))
        self._copy_in(step, dests, deadline)

    def write_group(
        self, step: int, rows: list[tuple[Piece, int, int, Any]], offset: int, deadline: float
    ) -> None:
        """One granted ring region: each ``(piece, id, offset in the region, _)`` into its tensor's place
        in the region at ``offset``."""
        view = self.arena.view
        dests = ((p, pid, view(offset + rel, p.tensor.dtype, p.global_shape)) for p, pid, rel, _ in rows)
        self._copy_in(step, dests, deadline)

    def _copy_in(self, step: int, dests: Iterable[tuple[Piece, int, torch.Tensor]], deadline: float) -> None:
        """Copy each ``(piece, id, its global tensor in staging)``; PIECE_DONE every batch."""
        # many small copies make many small objects: no collections meanwhile
        with gc_paused(), self._copy_stream():
            self._copy_pieces(step, dests, deadline)

    @contextlib.contextmanager
    def _copy_stream(self) -> Iterator[None]:
        """GPU staging: the copies run on a stream of the client's own, which first waits for what
        the trainer had queued when it called push_step (the work that wrote the tensors). They then
        neither queue behind the trainer's later work nor hold it up, and PIECE_DONE waits for the
        copies alone, not for the whole device."""
        if self.arena is None or getattr(self.arena, "kind", "shm") == "shm":
            yield
            return
        device = torch.device("cuda", self.arena.device)
        stream = self._streams.get(device.index)
        if stream is None:
            stream = self._streams[device.index] = torch.cuda.Stream(device)
        for event in self.ready_events:
            stream.wait_event(event)
        with torch.cuda.stream(stream):
            yield

    def _copy_pieces(
        self, step: int, dests: Iterable[tuple[Piece, int, torch.Tensor]], deadline: float
    ) -> None:
        batch, batch_bytes, region = [], 0, None
        next_poll = 0.0
        regions: list[torch.Tensor] = []  # small copies wait for one foreach copy before PIECE_DONE
        srcs: list[torch.Tensor] = []
        for piece, pid, full in dests:
            src = piece.tensor
            if piece.whole and full.shape == src.shape:
                region = full
            else:
                region = full[tuple(slice(o, o + s) for o, s in zip(piece.offsets, src.shape))]
            nbytes = src.numel() * src.element_size()
            if (
                nbytes <= FOREACH_COPY_BYTES
                and region.shape == src.shape
                and region.dtype == src.dtype
                and region.device == src.device
            ):
                regions.append(region)
                srcs.append(src)
            else:
                region.copy_(src)
            batch.append(pid)
            batch_bytes += nbytes
            if batch_bytes >= P.DONE_BATCH_BYTES or len(batch) >= P.DONE_BATCH_PIECES:
                copy_all(regions, srcs)
                self._pieces_done(step, batch, region)
                batch, batch_bytes = [], 0
            now = time.monotonic()
            if now >= next_poll:
                self.link.poll(step, 0.0)
                self.link.keepalive(step, deadline, "writing its shards")
                next_poll = now + P.POLL_INTERVAL_S
        if batch:
            copy_all(regions, srcs)
            self._pieces_done(step, batch, region)

    def _pieces_done(self, step: int, batch: list[int], last: torch.Tensor | None) -> None:
        if last is not None and last.is_cuda:  # copies are asynchronous: they land before the daemon reads
            torch.cuda.current_stream(last.device).synchronize()  # the copy stream (_copy_stream)
        self.link.send(Kind.PIECE_DONE, {"step": step, "pieces": batch})
