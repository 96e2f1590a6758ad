"""Same-node ranks: pieces copied straight into the daemon's staging arena, never exported.

The daemon hands the rank a handle to its staging arena (POSIX shm, or a CUDA-IPC handle to its GPU
arena) in READY; :class:`StagingWriter` maps it once and copies each piece into its tensor's place:
the whole step at once, or, with a staging ring, one granted layer-group region at a time. A rank
never maps a generation: the daemon copies staging out into it once the step's local ranks
committed, and checks the copy (README, Guarantees). Every ``DONE_BATCH_BYTES`` / ``DONE_BATCH_PIECES`` it tells the daemon which pieces landed (PIECE_DONE), so
the daemon quantizes layers while later ones are still being written.

    writer = StagingWriter(link)
    writer.write_step(step, pieces, ids, ready["staging"], deadline)   # whole-step staging
    writer.close()                                                     # unmap the arena
"""

from __future__ import annotations

import contextlib
import operator
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from sidecar.client import pieces as P
from sidecar.client.pieces import Link, Piece
from sidecar.ops.gcpause import gc_paused
from transport.arena import ArenaKind
from transport.cuda_ipc import open_any_arena, own_device
from transport.layout import ALIGN
from transport.wire import Kind, ProtocolError

#: pieces of at most this many bytes are copied together (one foreach copy per PIECE_DONE batch), not
#: one torch call each
FOREACH_COPY_BYTES = 256 << 10
#: at least this many small pieces of one size, at even pitches in the source and in staging (views
#: of one flat buffer, written into their aligned slots), are copied as one strided 2-D copy: a
#: foreach copy still costs about a microsecond per tensor, the strided copy only its bytes
MIN_RUN = 8


@dataclass(slots=True)
class _Batch:
    """The copies before one PIECE_DONE: small ones in one foreach copy, the others one by one."""

    ids: list[int] = field(default_factory=list)
    regions: list[torch.Tensor] = field(default_factory=list)  # small: torch._foreach_copy_
    srcs: list[torch.Tensor] = field(default_factory=list)
    big: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (region, src)
    last: torch.Tensor | None = None  # the last region written (on a GPU: synchronized first)
    nbytes: int = 0
    small_at: list[int] = field(default_factory=list)  # the pieces of ``srcs``, by position
    big_at: list[int] = field(default_factory=list)  # the pieces of ``big``, by position
    #: runs of ``srcs`` copied as one strided copy (:func:`_runs`); ``loose``: the others' positions
    runs: list[_Run] = field(default_factory=list)
    loose: list[int] = field(default_factory=list)

    def with_sources(self, pieces: list[Piece]) -> _Batch:
        """The same copies from ``pieces`` (in the places of the pieces this batch was planned
        for: :func:`_same_places`)."""
        return _Batch(
            self.ids,
            self.regions,
            [pieces[i].tensor for i in self.small_at],
            [(region, pieces[i].tensor) for (region, _), i in zip(self.big, self.big_at)],
            self.last,
            self.nbytes,
            self.small_at,
            self.big_at,
            self.runs,
            self.loose,
        )

    def copy_small(self) -> None:
        """The small copies: each run as one strided copy where its sources still lie where they
        lay when it was planned (checked every step: a trainer may have swapped a tensor's
        storage), the rest in one foreach copy."""
        srcs = self.srcs
        if not self.runs:
            torch._foreach_copy_(self.regions, srcs)
            return
        loose = [(self.regions[i], srcs[i]) for i in self.loose]
        for run in self.runs:
            if not run.copy(srcs):
                loose += [(self.regions[i], srcs[i]) for i in range(run.first, run.first + run.count)]
        if loose:
            torch._foreach_copy_([d for d, _ in loose], [s for _, s in loose])


@dataclass(slots=True)
class _Run:
    """``count`` small sources from position ``first`` of a batch, of one size and dtype, each
    ``pitch`` bytes after the one before, into staging slots ``dst`` (a strided 2-D view) holds."""

    first: int
    count: int
    pitch: int
    dst: torch.Tensor

    def copy(self, srcs: list[torch.Tensor]) -> bool:
        """One copy of the whole run, if its sources are still contiguous at the planned pitch
        (False: nothing copied, the caller copies them one by one)."""
        first, count, pitch = self.first, self.count, self.pitch
        head = srcs[first]
        base = head.data_ptr()
        run = srcs[first : first + count]
        if list(map(_DATA_PTR, run)) != list(range(base, base + count * pitch, pitch)) or not all(
            map(_IS_CONTIGUOUS, run)
        ):
            return False
        numel = self.dst.shape[1]
        try:  # out of the first tensor's storage (not one buffer after all): copied one by one
            src = torch.as_strided(
                head, (count, numel), (pitch // head.element_size(), 1), head.storage_offset()
            )
        except RuntimeError:
            return False
        self.dst.copy_(src)
        return True


_DATA_PTR, _IS_CONTIGUOUS = torch.Tensor.data_ptr, torch.Tensor.is_contiguous


def _runs(batch: _Batch, arena: Any) -> None:
    """Find ``batch``'s runs: at least MIN_RUN consecutive small CPU sources of one shape and dtype,
    contiguous, at one pitch in one storage, whose staging slots lie at one pitch too. Only on
    shared-memory staging (a GPU arena's copies stay as they are)."""
    if getattr(arena, "kind", None) != ArenaKind.SHM or len(batch.srcs) < MIN_RUN:
        batch.loose = list(range(len(batch.srcs)))
        return
    srcs, regions = batch.srcs, batch.regions
    base = arena.view(0, torch.uint8, (arena.size,)).data_ptr()
    i, n = 0, len(srcs)
    while i < n:
        j = i + 1
        a = srcs[i]
        if a.is_contiguous() and a.device.type == "cpu" and a.numel():
            sp = dp = None
            while j < n:
                b, prev = srcs[j], srcs[j - 1]
                if (
                    b.shape != a.shape
                    or b.dtype != a.dtype
                    or not b.is_contiguous()
                    or b.device.type != "cpu"
                ):
                    break
                s_step = b.data_ptr() - prev.data_ptr()
                d_step = regions[j].data_ptr() - regions[j - 1].data_ptr()
                if sp is None:
                    if (
                        s_step < a.nbytes
                        or d_step < a.nbytes
                        or s_step % a.element_size()
                        or d_step % a.element_size()
                    ):
                        break
                    sp, dp = s_step, d_step
                elif s_step != sp or d_step != dp:
                    break
                if b.untyped_storage().data_ptr() != a.untyped_storage().data_ptr():
                    break
                j += 1
        if j - i >= MIN_RUN:
            item, numel = a.element_size(), a.numel()
            start = regions[i].data_ptr() - base  # a shard's rows start anywhere in their slot
            lead = start % ALIGN
            span = lead + (j - i - 1) * dp + a.nbytes
            raw = arena.view(start - lead, torch.uint8, (span,))  # the arena hands out aligned views
            dst = torch.as_strided(raw[lead:].view(a.dtype), (j - i, numel), (dp // item, 1))
            batch.runs.append(_Run(i, j - i, sp, dst))
        else:
            batch.loose += range(i, j)
        i = j


def _same_places(old: list[Piece], new: list[Piece]) -> bool:
    """Whether ``new`` pieces go exactly where ``old`` ones went, copied the same way: the same
    names, offsets, global shapes, and tensors of the same shapes, dtypes and devices."""
    if len(old) != len(new):
        return False
    for a, b in zip(old, new):
        ta, tb = a.tensor, b.tensor
        if (
            a.name != b.name
            or a.whole != b.whole
            or a.offsets != b.offsets
            or a.global_shape != b.global_shape
            or ta.shape != tb.shape
            or ta.dtype != tb.dtype
            or ta.get_device() != tb.get_device()
        ):
            return False
    return True


def devices_of(pieces: Iterable[Piece]) -> set[int]:
    """The pieces' ``get_device()`` indices (-1: the CPU), in one pass in C (a step has thousands)."""
    return set(map(_GET_DEVICE, map(_TENSOR, pieces)))


def pieces_device(pieces: Iterable[Piece], devices: set[int] | None = None) -> int | None:
    """The one CUDA index every GPU piece lives on (the rank's GPU), None when there is none or
    several. ``devices``: :func:`devices_of` the pieces, when the caller has it already."""
    devices = (devices_of(pieces) if devices is None else devices) - {-1}
    return devices.pop() if len(devices) == 1 else None


_GET_DEVICE, _TENSOR = torch.Tensor.get_device, operator.attrgetter("tensor")


class StagingWriter:
    """Writes a local rank's pieces into the daemon's staging arena (the client's worker thread only)."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.arena: Any = None  # the mapped staging arena (ShmArena or a CUDA-IPC arena), or None
        #: CUDA events recorded on the trainer's streams at push_step: the tensors are written once they fire
        self.ready_events: list = []
        self._streams: dict[int, torch.cuda.Stream] = {}  # GPU staging: the copy stream per device
        #: whole-step staging: (pieces, arena views, ids, batches) of the last step, reused by a
        #: step of the same pieces list with the same ids into the same views
        self._planned: tuple[list[Piece], Any, list[int], list[_Batch]] | None = None
        self._layout_id: str | None = None  # the mapped arena's layout (READY's layout_id)
        #: several GPUs (docs/multi_gpu.md): the staging arenas of the other GPUs, by the index
        #: READY's ``stagings`` and SLOT's ``arena`` give them (``arena`` is index 0)
        self.others: dict[int, Any] = {}
        #: the CUDA index GPU staging is mapped on in this process: the rank's own GPU (the pieces'
        #: device, :func:`pieces_device`; None: the current device), never the daemon's index
        self.device: int | None = None

    def _map(self, handle: dict) -> Any:
        """Map a staging arena on this rank's own GPU. CUDA opens another GPU's allocation as peer
        memory (cudaIpcMemLazyEnablePeerAccess) even where that GPU is not visible here (Ray
        actors, Slurm --gpus-per-task, CUDA_VISIBLE_DEVICES per rank), and mapping it on the arena's
        own index instead would fail there, or, where every GPU is visible, make this process a
        primary context (hundreds of MiB) on every staging GPU and run the copy on that GPU's
        stream, behind the trainer's own work there."""
        device = None
        if handle.get("kind") == ArenaKind.CUDA_IPC.value:
            device = self.device if self.device is not None else own_device()
        return open_any_arena(handle, writable=True, device=device)

    def open(self, handle: dict) -> None:
        """Map the arena READY names (again only when it is another one, or carved another way:
        its ``layout_id`` differs), closing the one mapped before: a daemon that retired its
        staging after a failed step names a new one. A READY names an arena this client mapped by
        name and layout id alone, without its layout."""
        layout_id = handle.get("layout_id")
        if self.arena is not None and self.arena.name == handle.get("name") and layout_id == self._layout_id:
            return
        if "layout" not in handle:
            raise ProtocolError(
                f"READY names staging arena {handle.get('name')!r} (layout {layout_id!r}) without its "
                "layout, but this client has not mapped it: the daemon and the client disagree on the "
                "protocol; run the same refitd version on both"
            )
        self.close()
        self.arena = self._map(handle)
        self._layout_id = layout_id

    def open_lanes(self, handles: Any, count: int) -> None:
        """Several GPUs: map the staging arena of each of the ``count`` GPUs READY's ``stagings``
        lists (the first as :meth:`open` maps READY's ``staging``), each once while READY names
        the same one. A list that is not ``count`` handles is a protocol error."""
        if (
            not isinstance(handles, list)
            or len(handles) != count
            or not all(isinstance(h, dict) for h in handles)
        ):
            shown = f"{len(handles)} entries" if isinstance(handles, list) else type(handles).__name__
            raise ProtocolError(
                f"READY spreads the staging ring over {count} GPU arenas but its stagings field holds "
                f"{shown}, not {count} arena handles: the daemon and the client disagree on the "
                "protocol; run the same refitd version on both"
            )
        for k, handle in enumerate(handles[1:], 1):
            old = self.others.get(k)
            if old is not None and old.name == handle.get("name"):
                continue
            if old is not None:
                old.close()
            self.others[k] = self._map(handle)
        for k in [k for k in self.others if k >= count]:
            self.others.pop(k).close()

    def lane(self, index: int) -> Any:
        """The mapped staging arena of GPU ``index`` (0: :attr:`arena`)."""
        arena = self.arena if index == 0 else self.others.get(index)
        if arena is None:
            raise ProtocolError(f"no staging arena {index} is mapped: READY did not list it")
        return arena

    def close(self) -> None:
        """Unmap the arenas (a restarted daemon's segments are never written again); idempotent."""
        self._planned = None  # its views are of this arena
        self._layout_id = None
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        for other in self.others.values():
            other.close()
        self.others = {}

    def write_step(
        self, step: int, pieces: list[Piece], ids: list[int], handle: dict, deadline: float
    ) -> None:
        """Whole-step staging: every piece into its tensor's slot of the arena."""
        self.open(handle)
        views = self.arena.tensors()  # device-to-device copies through the mapped handle on GPUs
        # the copies of the same pieces into the same places, reused while pieces, ids and places hold
        planned = self._planned
        if planned is None or planned[0] is not pieces or planned[1] is not views or planned[2] != ids:
            with gc_paused():  # many small objects (views, lists): no collections meanwhile
                if (
                    planned is not None
                    and planned[1] is views
                    and planned[2] == ids
                    and _same_places(planned[0], pieces)
                ):  # other tensor objects in the same places (a fresh state_dict()): new sources only
                    batches = [batch.with_sources(pieces) for batch in planned[3]]
                else:
                    dests = ((p, pid, views[p.name]) for p, pid in zip(pieces, ids))
                    batches = self._plan(dests, runs=True)  # planned once, reused: runs pay off
            planned = (pieces, views, list(ids), batches)
            self._planned = planned
        with gc_paused(), self._copy_stream():
            self._run(step, planned[3], deadline)

    def write_pieces(
        self, step: int, pieces: list[Piece], ids: list[int], handle: dict, deadline: float
    ) -> None:
        """A few pieces of a streamed step (``sidecar.client.stream``) into their staging slots now,
        as :meth:`write_step` would; nothing is kept for a later step (the next pieces are others)."""
        self.open(handle)
        views = self.arena.tensors()
        self._copy_in(step, ((p, pid, views[p.name]) for p, pid in zip(pieces, ids)), deadline)

    def write_group(
        self,
        step: int,
        rows: list[tuple[Piece, int, int, Any]],
        offset: int,
        deadline: float,
        arena: int = 0,
    ) -> None:
        """One granted ring region: each ``(piece, id, offset in the region, _)`` into its tensor's place
        in the region at ``offset`` of staging arena ``arena`` (the GPU the group is placed on)."""
        target = self.lane(arena)
        view = target.view
        dests = ((p, pid, view(offset + rel, p.tensor.dtype, p.global_shape)) for p, pid, rel, _ in rows)
        self._copy_in(step, dests, deadline, target)

    def _copy_in(
        self, step: int, dests: Iterable[tuple[Piece, int, torch.Tensor]], deadline: float, arena: Any = None
    ) -> None:
        """Copy each ``(piece, id, its global tensor in staging)``; PIECE_DONE every batch."""
        # many small copies make many small objects: no collections meanwhile
        with gc_paused(), self._copy_stream(arena):
            self._run(step, self._plan(dests, arena), deadline)

    @contextlib.contextmanager
    def _copy_stream(self, arena: Any = None) -> Iterator[None]:
        """GPU staging: the copies run on a stream of the client's own, which first waits for what
        the trainer had queued when it called push_step (the work that wrote the tensors). They then
        neither queue behind the trainer's later work nor hold it up, and PIECE_DONE waits for the
        copies alone, not for the whole device. ``arena``: the one written (default :attr:`arena`);
        its GPU's stream."""
        arena = self.arena if arena is None else arena
        if arena is None or getattr(arena, "kind", "shm") == "shm":
            yield
            return
        device = torch.device("cuda", arena.device)
        stream = self._streams.get(device.index)
        if stream is None:
            stream = self._streams[device.index] = torch.cuda.Stream(device)
        for event in self.ready_events:
            stream.wait_event(event)
        with torch.cuda.stream(stream):
            yield

    def _plan(
        self, dests: Iterable[tuple[Piece, int, torch.Tensor]], arena: Any = None, *, runs: bool = False
    ) -> list[_Batch]:
        """The copies of ``dests`` (into ``arena``, default :attr:`arena`) in PIECE_DONE batches
        (every DONE_BATCH_BYTES or DONE_BATCH_PIECES): small pieces of one dtype and device go in
        one foreach copy; with ``runs`` (a plan kept for later steps), evenly spaced ones in one
        strided copy (:func:`_runs`)."""
        batches, batch = [], _Batch()
        device = getattr(self.arena if arena is None else arena, "device", -1)  # shm: the CPU (-1)
        if not isinstance(device, int):
            device = -1
        for at, (piece, pid, full) in enumerate(dests):
            src = piece.tensor
            nbytes = src.nbytes
            if piece.whole and full.shape == src.shape:
                region = full
                # the usual case, checked cheaply: get_device() is -1 on the CPU, the index on a GPU
                same = full.dtype == src.dtype and src.get_device() == device == full.get_device()
            else:
                region = full[tuple(slice(o, o + s) for o, s in zip(piece.offsets, src.shape))]
                same = region.shape == src.shape and region.dtype == src.dtype and region.device == src.device
            if same and nbytes <= FOREACH_COPY_BYTES:
                batch.regions.append(region)
                batch.srcs.append(src)
                batch.small_at.append(at)
            else:
                batch.big.append((region, src))
                batch.big_at.append(at)
            batch.ids.append(pid)
            batch.last = region
            batch.nbytes += nbytes
            if batch.nbytes >= P.DONE_BATCH_BYTES or len(batch.ids) >= P.DONE_BATCH_PIECES:
                batches.append(batch)
                batch = _Batch()
        if batch.ids:
            batches.append(batch)
        for batch in batches:
            if runs:
                _runs(batch, self.arena if arena is None else arena)
            else:
                batch.loose = list(range(len(batch.srcs)))
        return batches

    def _run(self, step: int, batches: list[_Batch], deadline: float) -> None:
        """Each batch's copies, then its PIECE_DONE (only pieces that landed are named); what the
        daemon sent meanwhile is taken in every POLL_INTERVAL_S."""
        next_poll = 0.0
        for batch in batches:
            for region, src in batch.big:
                region.copy_(src)
                next_poll = self._keepalive(step, deadline, next_poll)
            if batch.regions:
                batch.copy_small()
            self._pieces_done(step, batch.ids, batch.last)
            next_poll = self._keepalive(step, deadline, next_poll)

    def _keepalive(self, step: int, deadline: float, next_poll: float) -> float:
        now = time.monotonic()
        if now < next_poll:
            return next_poll
        self.link.poll(step, 0.0)
        self.link.keepalive(step, deadline, "writing its shards")
        return now + P.POLL_INTERVAL_S

    def _pieces_done(self, step: int, batch: list[int], last: torch.Tensor | None) -> None:
        if last is not None and last.is_cuda:  # copies are asynchronous: they land before the daemon reads
            torch.cuda.current_stream(last.device).synchronize()  # the copy stream (_copy_stream)
        self.link.send(Kind.PIECE_DONE, {"step": step, "pieces": batch})
