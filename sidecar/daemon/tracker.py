"""Where a step's data has arrived: the :class:`CoverageTracker` of one step.

Declarations are checked with the geometry of sidecar.daemon.coverage (pieces that tile each global
tensor exactly once); arrivals are tracked by position: each piece keeps the ranges of its flattened
elements received so far, so a block sent twice is refused (:class:`FrameError`) even when as many
bytes as the piece holds have arrived, and a piece completes only when its blocks tile it.
"""

from __future__ import annotations

import bisect
import math
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sidecar.daemon.coverage import (  # the geometry the tracker applies to each declaration
    MAX_LISTED_TENSORS,
    CoverageError,
    Piece,
    _covers,
    _global_shape,
    _plural,
    _shape,
    _validate,
    check_cover,
)

__all__ = ["CoverageTracker", "FrameError"]


class FrameError(CoverageError):
    """A block of data that does not fit its piece: outside it, not one contiguous run of it, or
    overlapping data already received (a duplicated frame). A protocol violation of the sender."""


class _Ranges:
    """Disjoint half-open ranges ``[lo, hi)`` of a piece's flattened (C-order) element index space.

    Sorted, merged when adjacent: a piece streamed front to back stays one range, so the usual add
    is O(1) and any add O(log n) to find its place. ``add`` refuses a range that overlaps one held.
    """

    __slots__ = ("held", "his", "los")

    def __init__(self) -> None:
        self.los: list[int] = []
        self.his: list[int] = []
        self.held = 0  # elements covered

    def add(self, lo: int, hi: int) -> tuple[int, int] | None:
        """Add ``[lo, hi)``; the range it overlaps (nothing added then), or None once added."""
        los, his = self.los, self.his
        i = bisect.bisect_right(los, lo)
        if i and his[i - 1] > lo:
            return los[i - 1], his[i - 1]
        if i < len(los) and los[i] < hi:
            return los[i], his[i]
        left = bool(i) and his[i - 1] == lo
        right = i < len(los) and los[i] == hi
        if left and right:
            his[i - 1] = his[i]
            del los[i], his[i]
        elif left:
            his[i - 1] = hi
        elif right:
            los[i] = lo
        else:
            los.insert(i, lo)
            his.insert(i, hi)
        self.held += hi - lo
        return None


@dataclass(slots=True)
class _Tensor:
    """What the tracker knows about one tensor: its shape, element size and declared pieces (the
    declaration only: what arrived is the tracker's, so a later step's tracker can share these)."""

    global_shape: tuple[int, ...]
    itemsize: int
    first_rank: int
    pieces: list[Piece] = field(default_factory=list)


class CoverageTracker:
    """Per-step bookkeeping: which pieces were announced, whether they tile, which elements arrived.

    One tracker per step; the daemon throws it away when the step seals or aborts. Piece ids are
    per tensor (0, 1, 2, ... in declaration order), so a ``(name, piece_id)`` pair names a piece.
    Arrivals are tracked by position, not by byte count: a block sent twice is refused even when
    another block of the same size never came, so a piece completes only when its blocks tile it::

        tracker = CoverageTracker()
        (pid,) = tracker.declare_all([("w", (256, 1024), Piece(rank=1, offsets=(128, 0), shape=(128, 1024)), 2)])
        ...                                    # every rank's announcements arrive
        tracker.check_declared(expected_names)  # raises CoverageError naming gaps / overlaps
        tracker.received("w", pid, offsets, shape)  # as data frames land; True once the piece is full
        tracker.received("w", pid)              # or the whole piece at once (written into staging)
        if not tracker.incomplete(): seal()
    """

    def __init__(self) -> None:
        self._tensors: dict[str, _Tensor] = {}
        self._count: dict[str, int] = {}  # pieces declared per tensor
        # what arrived: pieces not yet complete per tensor; pieces that arrived whole (PIECE_DONE);
        # the ranges of pieces that arrive in blocks (made at a piece's first block)
        self._pending: dict[str, int] = {}
        self._whole: set[tuple[str, int]] = set()
        self._blocks: dict[tuple[str, int], _Ranges] = {}
        self._shared = False  # declarations shared with another tracker: no more may be added

    def fresh(self) -> CoverageTracker:
        """A tracker with this one's declarations and nothing arrived, for a later step whose ranks
        declared exactly the same pieces (its declarations are shared: none may be added to it)."""
        other = CoverageTracker()
        other._tensors, other._count = dict(self._tensors), self._count
        other._pending = dict(self._count)
        other._shared = self._shared = True
        return other

    def declare(self, name: str, global_shape: Sequence[int], piece: Piece, itemsize: int) -> int:
        """Record that ``piece.rank`` will send ``piece`` of tensor ``name``; return its piece id.

        The piece is validated now, so a malformed announcement fails at once with the rank named.
        Every piece of one tensor must agree on the global shape and the element size.
        """
        return self.declare_all([(name, global_shape, piece, itemsize)])[0]

    def declare_all(self, items: Sequence[tuple[str, Sequence[int], Piece, int]]) -> list[int]:
        """:meth:`declare` for many pieces, all or nothing: every piece is validated (against the
        tensors declared so far and against each other) before any is recorded, so a refused
        announcement leaves the tracker as it was. Returns the piece ids in order."""
        if self._shared:
            raise RuntimeError("this tracker shares its declarations (fresh()): declare into a new one")
        new: dict[str, _Tensor] = {}
        checked = []
        tensors = self._tensors
        for name, global_shape, piece, itemsize in items:
            t = tensors.get(name) or new.get(name)
            if (
                t is not None
                and type(itemsize) is int
                and itemsize == t.itemsize
                and global_shape == t.global_shape
            ):
                _validate(name, t.global_shape, piece)  # a known tensor, described the same way
                checked.append((name, piece))
                continue
            gs = _global_shape(name, global_shape)
            try:
                size = operator.index(itemsize)  # numpy ints too, but not 2.0
            except TypeError:
                size = 0
            if isinstance(itemsize, bool) or size <= 0:
                raise CoverageError(
                    f"tensor {name!r}: rank {piece.rank} declared itemsize {itemsize!r}: "
                    "give the element size in bytes (2 for bf16)"
                )
            _validate(name, gs, piece)
            if t is None:
                t = new[name] = _Tensor(gs, size, piece.rank)
            elif t.global_shape != gs:
                raise CoverageError(
                    f"tensor {name!r}: rank {piece.rank} declared global shape {_shape(gs)}, but rank "
                    f"{t.first_rank} declared {_shape(t.global_shape)}: the ranks disagree about the model"
                )
            elif t.itemsize != size:
                raise CoverageError(
                    f"tensor {name!r}: rank {piece.rank} declared itemsize {size}, but rank "
                    f"{t.first_rank} declared {t.itemsize}: every rank must send one dtype per tensor"
                )
            checked.append((name, piece))
        self._tensors.update(new)
        ids = []
        tensors, count, pending = self._tensors, self._count, self._pending
        for name, piece in checked:
            t = tensors[name]
            t.pieces.append(piece)
            ids.append(count.get(name, 0))
            count[name] = len(t.pieces)
            pending[name] = pending.get(name, 0) + 1
        return ids

    def forget(self, names: Iterable[str]) -> None:
        """Stop tracking tensors ``names`` (declared, but not wanted this step: outside a node's
        share). They are then neither checked by :meth:`check_declared` nor listed as incomplete."""
        gone = set(names)
        for name in gone:
            self._tensors.pop(name, None)
            self._pending.pop(name, None)
        self._count = {n: c for n, c in self._count.items() if n not in gone}  # may be shared: a copy

    def __len__(self) -> int:
        """Pieces declared so far, over every tensor."""
        return sum(len(t.pieces) for t in self._tensors.values())

    def check_declared(self, names: Iterable[str], *, allow_extra: bool = False) -> None:
        """Raise :class:`CoverageError` unless every tensor in ``names`` is tiled exactly once.

        A tensor nobody declared is a gap. A declared tensor outside ``names`` is an error too (a
        rank is sending something this step does not expect) unless ``allow_extra``. All problems
        are counted into one error, so one run shows every broken tensor; the first
        :data:`MAX_LISTED_TENSORS` are explained.
        """
        problems, more = [], 0

        def problem(text: Callable[[], str]) -> None:
            nonlocal more
            if len(problems) < MAX_LISTED_TENSORS:
                problems.append(text())
            else:
                more += 1  # counted, not explained: explaining costs more than deciding

        expected = dict.fromkeys(names)
        for name in expected:
            t = self._tensors.get(name)
            if t is None:
                problem(lambda name=name: f"tensor {name!r}: no rank sent any part of it")
                continue
            try:
                if len(problems) < MAX_LISTED_TENSORS:
                    check_cover(name, t.global_shape, t.pieces)
                else:
                    for p in t.pieces:
                        _validate(name, t.global_shape, p)
                    if not _covers(t.global_shape, t.pieces):
                        more += 1
            except CoverageError as exc:
                problem(lambda exc=exc: str(exc))
        if not allow_extra:
            for name, t in self._tensors.items():
                if name not in expected:
                    problem(
                        lambda name=name, t=t: (
                            f"tensor {name!r}: sent by ranks {sorted({p.rank for p in t.pieces})} but not "
                            "expected this step; check the trainer's parameter names against the model's"
                        )
                    )
        if not problems:
            return
        tail = [f"... and {_plural(more, 'more problem')}"] if more else []
        raise CoverageError(
            "\n".join(
                [
                    f"step coverage check failed ({_plural(len(problems) + more, 'problem')}):",
                    *problems,
                    *tail,
                ]
            )
        )

    def _piece(self, name: str, piece_id: int) -> tuple[_Tensor, Piece]:
        t = self._tensors.get(name)
        if t is None:
            raise CoverageError(
                f"received data for tensor {name!r}, which no rank declared: declare() its pieces first"
            )
        if type(piece_id) is not int or not 0 <= piece_id < len(t.pieces):
            raise CoverageError(
                f"tensor {name!r}: received data for piece id {piece_id!r}, but only ids "
                f"0..{len(t.pieces) - 1} were declared"
            )
        return t, t.pieces[piece_id]

    def block_range(
        self, name: str, piece_id: int, offsets: Sequence[int], shape: Sequence[int]
    ) -> tuple[int, int]:
        """Where block ``offsets``/``shape`` (global coordinates) lies in the piece's flattened index
        space, ``[lo, hi)``. :class:`FrameError` unless it is a non-empty box inside the piece that
        is one contiguous run of it: leading dims of extent 1, a range along one dim, every later
        dim whole (how a client splits a piece into frames)."""
        _, piece = self._piece(name, piece_id)

        def where() -> str:  # built only for an error: a step of many frames pays nothing for it
            return f"tensor {name!r}: rank {piece.rank}'s block at {_show(offsets)} shape {_show(shape)}"

        if not self.contains(name, piece_id, offsets, shape):
            raise FrameError(
                f"{where()} is not a non-empty box inside the piece it declared, {piece.describe()}: "
                "send blocks of the declared piece, in global coordinates"
            )
        rel = [o - lo for o, lo in zip(offsets, piece.offsets)]
        partial = [d for d, (s, full) in enumerate(zip(shape, piece.shape)) if s != full or rel[d]]
        if partial and any(shape[d] != 1 for d in range(partial[-1])):
            raise FrameError(
                f"{where()} is not one contiguous run of {piece.describe()}: fix the leading indices, take "
                "a range along one dim and all of every dim after it"
            )
        lo, stride = 0, 1
        for r, full in zip(reversed(rel), reversed(piece.shape)):
            lo += r * stride
            stride *= full
        return lo, lo + math.prod(shape)

    def received(
        self,
        name: str,
        piece_id: int,
        offsets: Sequence[int] | None = None,
        shape: Sequence[int] | None = None,
    ) -> bool:
        """Record that block ``offsets``/``shape`` of a piece arrived (the whole piece when None);
        True once the piece holds every element. A block overlapping one already received raises
        :class:`FrameError` and records nothing."""
        _, piece = self._piece(name, piece_id)
        key = (name, piece_id)
        whole = offsets is None or shape is None
        if whole:
            lo, hi = 0, piece.numel
            ranges = self._blocks.get(key)
            if key in self._whole:
                clash = (0, piece.numel)
            elif ranges is not None and ranges.held:
                clash = (ranges.los[0], ranges.his[0])
            else:  # the usual case: a piece written into staging, said once
                self._whole.add(key)
                self._pending[name] -= 1
                return True
        else:
            lo, hi = self.block_range(name, piece_id, offsets, shape)
            ranges = self._blocks.get(key)
            if ranges is None:
                ranges = self._blocks[key] = _Ranges()
            clash = (0, piece.numel) if key in self._whole else ranges.add(lo, hi)
        if clash is not None:  # the message is built only now: a step of many pieces pays nothing for it
            if whole:
                what = f"tensor {name!r}: rank {piece.rank} reported all of {piece.describe()} written"
            else:
                what = (
                    f"tensor {name!r}: rank {piece.rank} sent the block at {_show(offsets)} "
                    f"shape {_show(shape)}"
                )
            raise FrameError(
                f"{what}, but elements [{max(lo, clash[0])}, {min(hi, clash[1])}) of that piece "
                f"({piece.describe()}, flattened) already arrived: every element must be sent exactly once; "
                "a duplicated or overlapping frame means the sender's split is wrong"
            )
        if ranges.held == piece.numel:
            self._pending[name] -= 1
            return True
        return False

    def whole_rows(
        self, rows: Iterable[tuple[Any, str, int]]
    ) -> list[tuple[Any, str, int, tuple[str, int], int, bool]]:
        """``rows`` (``StepState.pieces``: ``(rank, name, piece id)``) as :meth:`received_whole`
        takes them: each with its key, its bytes and whether it is its tensor's only piece, worked
        out once for every step that declares the same pieces (a piece this tracker does not know
        gets 0 bytes: received_whole refuses it)."""
        tensors = self._tensors
        out = []
        for rank, name, pid in rows:
            t = tensors.get(name)
            ok = t is not None and type(pid) is int and 0 <= pid < len(t.pieces)
            size = t.pieces[pid].numel * t.itemsize if ok else 0
            out.append((rank, name, pid, (name, pid), size, ok and len(t.pieces) == 1))
        return out

    def received_sole(
        self, rows: list[tuple[Any, str, int, tuple[str, int], int, bool]]
    ) -> tuple[int, list[str]] | None:
        """:meth:`received_whole` of ``rows`` at once, when each is its tensor's only piece, none
        arrived before and none is named twice: a PIECE_DONE of small whole tensors, recorded
        without a Python loop. None (nothing recorded) for any other batch."""
        if not rows or not all(map(_SOLE, rows)):
            return None
        keys = list(map(_KEY, rows))
        if len(set(keys)) != len(keys):
            return None
        names = list(map(_NAME, rows))
        if not self.received_keys(keys, dict.fromkeys(names, 0)):
            return None
        return sum(map(_SIZE, rows)), names

    def received_keys(self, keys: list[tuple[str, int]], zeros: dict[str, int]) -> bool:
        """Record the sole whole pieces ``keys`` (distinct, each its tensor's only piece; ``zeros``:
        their tensors, each 0) unless one of them arrived already (False: nothing recorded)."""
        whole, blocks = self._whole, self._blocks
        if not whole.isdisjoint(keys) or (blocks and not blocks.keys().isdisjoint(keys)):
            return False
        # a sole piece neither whole nor in blocks yet: its tensor has one piece pending
        whole.update(keys)
        self._pending.update(zeros)
        return True

    def received_whole(
        self, rows: Iterable[tuple[Any, str, int, tuple[str, int], int]]
    ) -> tuple[int, list[str]]:
        """:meth:`received` of each whole piece of ``rows`` (:meth:`whole_rows`), in order, in one
        pass (a PIECE_DONE names hundreds of small pieces). Returns the bytes they hold and the
        tensors they completed; the first refused one raises as :meth:`received` does, after the
        ones before it were recorded."""
        whole, blocks, pending = self._whole, self._blocks, self._pending
        nbytes, done = 0, []
        for _, name, pid, key, size, _ in rows:
            if key in whole or key in blocks or name not in pending:
                self.received(name, pid)  # raises naming the problem, or records it the long way
            else:
                whole.add(key)
                pending[name] -= 1
            nbytes += size
            if not pending[name]:
                done.append(name)
        return nbytes, done

    def _held(self, name: str, piece_id: int, piece: Piece) -> int:
        """Elements of a piece that arrived."""
        if (name, piece_id) in self._whole:
            return piece.numel
        ranges = self._blocks.get((name, piece_id))
        return 0 if ranges is None else ranges.held

    def piece_nbytes(self, name: str, piece_id: int) -> int:
        """Bytes piece ``piece_id`` of ``name`` holds."""
        t = self._tensors[name]
        return t.pieces[piece_id].numel * t.itemsize

    def contains(self, name: str, piece_id: int, offsets: Sequence[int], shape: Sequence[int]) -> bool:
        """Whether ``offsets``/``shape`` (global coordinates) is a non-empty box inside the piece:
        one plain int (not a bool) per dim of the piece, extents at least 1."""
        _, piece = self._piece(name, piece_id)
        if not isinstance(offsets, (list, tuple)) or not isinstance(shape, (list, tuple)):
            return False
        if len(offsets) != len(piece.offsets) or len(shape) != len(piece.offsets):
            return False
        for o, s, lo, hi in zip(offsets, shape, piece.offsets, piece.end):
            if type(o) is not int or type(s) is not int or not (lo <= o and s >= 1 and o + s <= hi):
                return False
        return True

    def tensor_complete(self, name: str) -> bool:
        """True when every declared piece of ``name`` holds all its elements (False if none declared).

        Completeness only: whether the pieces tile the tensor is :meth:`check_declared`'s job.
        """
        return self._pending.get(name) == 0

    def complete(self) -> list[str]:
        """The tensors whose every declared piece holds all its elements, in declaration order."""
        if 0 not in self._pending.values():  # the usual question at BEGIN: none yet (no loop in Python)
            return []
        return [name for name, left in self._pending.items() if not left]

    def incomplete(self, rank: int | None = None) -> list[str]:
        """One line per declared piece still missing elements (of ``rank``, or of every rank), by rank,
        e.g. for a stall report."""
        rows = []
        if not any(self._pending.values()):  # the usual question at COMMIT: every piece is in
            return []
        for name, t in self._tensors.items():
            if not self._pending.get(name):
                continue
            for pid, piece in enumerate(t.pieces):
                held = self._held(name, pid, piece)
                if held < piece.numel and (rank is None or piece.rank == rank):
                    rows.append((piece.rank, name, piece, held * t.itemsize, piece.numel * t.itemsize))
        rows.sort(key=lambda r: (r[0], r[1]))
        return [
            f"rank {rank}: {name!r} {piece.describe()} ({have} of {want} bytes)"
            for rank, name, piece, have, want in rows
        ]


_NAME, _KEY, _SIZE, _SOLE = (operator.itemgetter(k) for k in (1, 3, 4, 5))  # of whole_rows' rows


def _show(values: Any) -> str:
    """A wire value for a message, bounded: a list of ints as is, anything else by type and length."""
    if isinstance(values, (list, tuple)) and len(values) <= 8 and all(type(v) is int for v in values):
        return str(list(values))
    return f"<{type(values).__name__}>"
