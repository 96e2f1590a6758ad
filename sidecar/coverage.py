"""Does every element of every expected tensor arrive exactly once? Shard bookkeeping for one step.

Trainer ranks push slices ("pieces") of global weight tensors: tensor-parallel slices along a dim,
expert-parallel slices of an expert slab, sometimes several slices of one tensor from one rank. A
step may only be sealed when the pieces of each tensor tile its global shape exactly: a gap means
the engine would load stale or uninitialised weights, an overlap means two ranks disagree about
the sharding plan and one of them silently wins. Both are plan bugs that should fail loudly, with a
message naming the tensor, the ranks and the element ranges, not surface later as a bad eval.

The check never materialises a tensor. The common case (the pieces' volumes add up to the tensor's
and no two pieces intersect) is decided by a sweep: pieces sorted along one dim, each compared with
the few still open there, O(n log n) for TP, EP and block-grid splits. Only when that fails, or the
sweep exceeds its budget, is the coordinate-compressed grid built (one cell per interval between
consecutive piece boundaries, in every dim, counted with a difference array) to decide and to name
the gaps; overlaps are named by the sweep, a few of them, the rest counted. No declaration, however
hostile, costs pairwise work.

Data is tracked by position: each piece keeps the ranges of its flattened elements received so far,
so a block sent twice is refused (:class:`FrameError`) even when as many bytes as the piece holds
have arrived, and a piece completes only when its blocks tile it.

Ranges print half-open per dim, joined with `` x ``: ``[0, 128) x [0, 1024)``.

numpy is imported lazily, only to explain a failure, so the fast path is pure Python.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CoverageError",
    "CoverageTracker",
    "FrameError",
    "Piece",
    "check_cover",
    "format_range",
    "validate_piece",
]

#: how many overlaps / gaps one tensor's error lists before saying "and N more"
MAX_LISTED = 5
#: how many tensors' problems one check_declared error lists before saying "and N more"
MAX_LISTED_TENSORS = 20
#: a compressed grid with more cells than this is too fragmented to list gap ranges from
MAX_GRID_CELLS = 1 << 20
#: how many gap boxes are merged (and counted) before the count says "at least"
MAX_GAPS_COUNTED = 1024
#: comparisons per piece the overlap sweep may make before it leaves the decision to the grid
SWEEP_BUDGET = 64

_FIX_HINT = (
    "check each rank's slice offsets and shapes against the sharding plan: "
    "every element must come from exactly one rank"
)


class CoverageError(ValueError):
    """The pieces of a step do not tile their tensors exactly once, or a piece is malformed."""


def _ints(values: Iterable[Any], what: str) -> tuple[int, ...]:
    try:
        return tuple(map(operator.index, values))
    except TypeError:
        raise CoverageError(f"{what} must be a sequence of ints, got {values!r}") from None


def _piece_ints(values: Iterable[Any], rank: int, which: str) -> tuple[int, ...]:
    """:func:`_ints` for a piece's ``which`` (offsets or shape): the message is only made on failure."""
    try:
        return tuple(map(operator.index, values))
    except TypeError:
        raise CoverageError(
            f"rank {rank}'s piece {which} must be a sequence of ints, got {values!r}"
        ) from None


@dataclass(frozen=True, slots=True)
class Piece:
    """One rank's slice of a global tensor: ``[offsets[d], offsets[d] + shape[d])`` in every dim d.

    Offsets and shape are normalised to tuples of plain ints (lists, ``torch.Size`` and numpy ints
    are accepted), so pieces compare and hash by value; ``end`` and ``numel`` are derived once here.
    """

    rank: int
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    #: exclusive upper corner, ``offsets[d] + shape[d]`` per dim (derived; stored because the
    #: overlap sweep reads it for every pair)
    end: tuple[int, ...] = field(init=False, repr=False, compare=False)
    #: number of elements (derived)
    numel: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        offsets = _piece_ints(self.offsets, self.rank, "offsets")
        shape = _piece_ints(self.shape, self.rank, "shape")
        if len(offsets) != len(shape):
            raise CoverageError(
                f"rank {self.rank}'s piece has {len(offsets)} offsets {list(offsets)} but a "
                f"{len(shape)}-d shape {list(shape)}: give one offset per dim"
            )
        object.__setattr__(self, "offsets", offsets)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "end", tuple(map(operator.add, offsets, shape)))
        object.__setattr__(self, "numel", math.prod(shape))

    @classmethod
    def of_ints(cls, rank: int, offsets: tuple[int, ...], shape: tuple[int, ...]) -> Piece:
        """A piece from offsets and shape already checked to be tuples of plain ints of one length
        (a BEGIN row's fast path: no normalisation)."""
        piece = object.__new__(cls)
        setattr_ = object.__setattr__
        setattr_(piece, "rank", rank)
        setattr_(piece, "offsets", offsets)
        setattr_(piece, "shape", shape)
        setattr_(piece, "end", tuple(map(operator.add, offsets, shape)))
        setattr_(piece, "numel", math.prod(shape))
        return piece

    def slices(self) -> tuple[slice, ...]:
        """Index of this piece inside the global tensor: ``full[piece.slices()]`` is the slice."""
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.shape))

    def describe(self) -> str:
        """``rows [a, b) x [c, d)``, the form every coverage message uses for a range."""
        return _rows(self.offsets, self.end)


def format_range(lo: Sequence[int], hi: Sequence[int]) -> str:
    """``[lo0, hi0) x [lo1, hi1) x ...``; ``[]`` for a 0-d tensor."""
    if not lo:
        return "[]"
    return " x ".join(f"[{a}, {b})" for a, b in zip(lo, hi))


def _rows(lo: Sequence[int], hi: Sequence[int]) -> str:
    return f"rows {format_range(lo, hi)}" if lo else "the 0-d value"


def _shape(shape: Sequence[int]) -> str:
    return str(list(shape))


def _global_shape(name: str, global_shape: Sequence[int]) -> tuple[int, ...]:
    try:
        gs = tuple(map(operator.index, global_shape))
    except TypeError:
        gs = _ints(global_shape, f"tensor {name!r}: global shape")  # raises, naming the tensor
    for d, size in enumerate(gs):
        if size < 0:
            raise CoverageError(f"tensor {name!r}: global shape {_shape(gs)} has negative size in dim {d}")
    return gs


def validate_piece(name: str, global_shape: Sequence[int], piece: Piece) -> None:
    """Refuse a piece that cannot be part of an exact cover of ``global_shape``.

    Refused: a different ndim, a negative offset, a zero or negative extent (an empty piece carries
    nothing and would let a plan bug hide: leave it out of the plan instead), and a piece that
    sticks out of the global shape.
    """
    _validate(name, _global_shape(name, global_shape), piece)


def _validate(name: str, gs: tuple[int, ...], piece: Piece) -> None:
    """:func:`validate_piece` for a checked global shape; the message is only built on failure."""
    lo, ext = piece.offsets, piece.shape
    if len(lo) == len(gs):
        for o, e, size in zip(lo, ext, gs):
            if o < 0 or e <= 0 or o + e > size:
                break
        else:
            return
    hi = piece.end
    what = f"tensor {name!r}: rank {piece.rank} sent {_rows(lo, hi)}"
    if len(lo) != len(gs):
        raise CoverageError(
            f"{what}, a {len(lo)}-d piece of a {len(gs)}-d tensor of global shape {_shape(gs)}: "
            "offsets and shape need one entry per dim of the global tensor"
        )
    for d in range(len(gs)):
        if lo[d] < 0:
            raise CoverageError(
                f"{what}, with negative offset {lo[d]} in dim {d}: offsets count from 0 in the global tensor"
            )
        if ext[d] <= 0:
            raise CoverageError(
                f"{what}, with extent {ext[d]} in dim {d}: zero-size pieces are refused, "
                "leave an empty slice out of the plan instead of sending it"
            )
        if hi[d] > gs[d]:
            raise CoverageError(
                f"{what}, outside its global shape {_shape(gs)} in dim {d}: "
                "check the slice offsets against the sharding plan"
            )


def check_cover(name: str, global_shape: Sequence[int], pieces: Iterable[Piece]) -> None:
    """Raise :class:`CoverageError` unless ``pieces`` cover every element of the tensor exactly once.

    Every piece is validated first (see :func:`validate_piece`). A tensor with zero elements is
    covered by no pieces at all. The error lists each overlap (both ranks and the shared range) and
    each gap (an uncovered range), up to :data:`MAX_LISTED` of each.
    """
    gs = global_shape if type(global_shape) is tuple else tuple(global_shape)
    if type(pieces) is not list and type(pieces) is not tuple:
        pieces = list(pieces)
    # fast path: one full piece, the shape of a step with many small unsharded tensors
    if len(pieces) == 1:
        p = pieces[0]
        if p.shape == gs and len(p.offsets) == len(gs) and not any(p.offsets) and all(d > 0 for d in gs):
            return
    gs = _global_shape(name, gs)
    for p in pieces:
        _validate(name, gs, p)
    if not _covers(gs, pieces):
        raise CoverageError(_explain(name, gs, pieces))


def _covers(gs: tuple[int, ...], pieces: Sequence[Piece]) -> bool:
    """Whether valid ``pieces`` tile ``gs`` exactly once: volumes add up and no two intersect."""
    if sum(p.numel for p in pieces) != math.prod(gs):
        return False
    count, _, exact = _overlaps(pieces, keep=0, first_only=True)
    if exact:
        return count == 0
    counts = _grid_counts(gs, pieces)  # the sweep ran out of budget: decide on the grid
    return counts is not None and bool((counts[0] == 1).all())


def _overlaps(
    pieces: Sequence[Piece], keep: int, first_only: bool = False
) -> tuple[int, list[tuple[int, int]], bool]:
    """Pieces overlapping an earlier one: (how many, up to ``keep`` index pairs ``(i, j)``, exact).

    A sweep along the dim with the most distinct start offsets: pieces sorted by their start there,
    each compared with the earlier pieces still open at that start (a heap retires the closed ones),
    stopping at the first one it intersects. A piece overlapping several earlier ones counts once,
    so a BEGIN of n identical pieces costs O(n log n), not n^2 pairs. A TP or EP split keeps one
    piece open, a 2-D block grid one row. Adversarial boxes that stay open without intersecting
    could still cost n^2 comparisons: past :data:`SWEEP_BUDGET` per piece the sweep stops and says
    its count is not ``exact`` (the caller decides on the grid). ``first_only`` stops at the first
    overlap (enough to refuse the fast path).
    """
    n = len(pieces)
    if n < 2:
        return 0, [], True
    los = [p.offsets for p in pieces]
    his = [p.end for p in pieces]
    ndim = len(los[0])
    if ndim == 0:  # every 0-d piece is the whole value: each later one overlaps the first
        return (1 if first_only else n - 1), [(0, j) for j in range(1, min(n, keep + 1))], True
    d = max(range(ndim), key=lambda k: len({lo[k] for lo in los})) if n > 8 else 0
    order = sorted(range(n), key=lambda i: los[i][d])
    count, kept = 0, []
    active: dict[int, None] = {}  # open pieces, in sweep order
    closing: list[tuple[int, int]] = []  # (end along d, index) of the open pieces
    budget = SWEEP_BUDGET * n + 1024
    for i in order:
        lo_i, hi_i = los[i], his[i]
        start = lo_i[d]
        while closing and closing[0][0] <= start:
            del active[heapq.heappop(closing)[1]]
        for j in active:
            budget -= 1
            lo_j, hi_j = los[j], his[j]
            for k in range(ndim):
                if lo_i[k] >= hi_j[k] or lo_j[k] >= hi_i[k]:
                    break
            else:
                count += 1
                if first_only:
                    return count, kept, True
                if len(kept) < keep:
                    kept.append((min(i, j), max(i, j)))
                break
        if budget < 0:
            return count, sorted(kept), False
        active[i] = None
        heapq.heappush(closing, (hi_i[d], i))
    return count, sorted(kept), True


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _explain(name: str, gs: tuple[int, ...], pieces: Sequence[Piece]) -> str:
    """The error text for pieces that are valid one by one but do not tile ``gs`` exactly once."""
    if not pieces:
        return f"tensor {name!r}: no rank sent any part of it (global shape {_shape(gs)})"
    n_overlaps, overlap_pairs, exact = _overlaps(pieces, keep=MAX_LISTED)
    grid = _grid_counts(gs, pieces)
    if not exact and grid is not None and n_overlaps == 0 and bool((grid[0] > 1).any()):
        n_overlaps = 1  # the sweep stopped before its first overlap: the grid shows one
    lines = []
    for i, j in overlap_pairs:
        a, b = pieces[i], pieces[j]
        lo = tuple(max(x, y) for x, y in zip(a.offsets, b.offsets))
        hi = tuple(min(x, y) for x, y in zip(a.end, b.end))
        who = f"rank {a.rank} sent" if a.rank == b.rank else f"ranks {a.rank} and {b.rank} both sent"
        again = " in two pieces" if a.rank == b.rank else ""
        lines.append(f"  overlap: {who} {_rows(lo, hi)}{again}")
    at_least = "" if exact else "at least "
    if n_overlaps > len(overlap_pairs):
        lines.append(f"  ... and {at_least}{_plural(n_overlaps - len(overlap_pairs), 'more overlap')}")

    gaps = None if grid is None else _gaps(gs, grid)
    counts = [at_least + _plural(n_overlaps, "overlap")] if n_overlaps else []
    if gaps is None:  # too fragmented for a grid: say how much is sent, not where it is missing
        held = sum(p.numel for p in pieces)
        counts.append(f"pieces hold {held} elements for {math.prod(gs)}")
        lines.append("  gaps: too many piece boundaries to list the uncovered ranges")
    else:
        n_gaps, gap_boxes, uncovered, all_gaps = gaps
        more = "" if all_gaps else "at least "
        for lo, hi in gap_boxes:
            lines.append(f"  gap: no rank sent {_rows(lo, hi)}")
        if n_gaps > len(gap_boxes):
            lines.append(f"  ... and {more}{_plural(n_gaps - len(gap_boxes), 'more gap')}")
        if n_gaps:
            counts.append(
                f"{more}{_plural(n_gaps, 'gap')}, {uncovered} of {math.prod(gs)} elements uncovered"
            )
    ranks = sorted({p.rank for p in pieces})
    sent_by = f"its {_plural(len(pieces), 'piece')} from rank{'s' if len(ranks) > 1 else ''} "
    sent_by += ", ".join(map(str, ranks))
    head = f"tensor {name!r}: global shape {_shape(gs)} is not covered exactly once by {sent_by} ({'; '.join(counts)}):"
    return "\n".join([head, *lines, _FIX_HINT])


def _grid_counts(gs: tuple[int, ...], pieces: Sequence[Piece]) -> tuple[Any, list[list[int]]] | None:
    """How many pieces hold each cell of the coordinate-compressed grid, and the grid's bounds.

    Each dim is cut at 0, its size and every piece boundary. The counts come from a difference
    array (+1/-1 at each piece's 2^ndim corners, then a prefix sum per dim): O(n 2^ndim + cells),
    vectorised, whatever the pieces overlap. None when the grid would exceed :data:`MAX_GRID_CELLS`.
    """
    import numpy as np

    nd = len(gs)
    bounds = [
        sorted({0, size, *(p.offsets[d] for p in pieces), *(p.end[d] for p in pieces)})
        for d, size in enumerate(gs)
    ]
    grid = tuple(len(b) - 1 for b in bounds)
    if math.prod(grid) > MAX_GRID_CELLS:
        return None
    if nd == 0:
        return np.array(len(pieces), dtype=np.int64), bounds
    lo = np.array([p.offsets for p in pieces], dtype=np.int64).reshape(len(pieces), nd)
    hi = np.array([p.end for p in pieces], dtype=np.int64).reshape(len(pieces), nd)
    lo_i = [np.searchsorted(np.asarray(bounds[d]), lo[:, d]) for d in range(nd)]
    hi_i = [np.searchsorted(np.asarray(bounds[d]), hi[:, d]) for d in range(nd)]
    diff = np.zeros([g + 1 for g in grid], dtype=np.int64)
    for corner in itertools.product((0, 1), repeat=nd):
        index = tuple(hi_i[d] if c else lo_i[d] for d, c in enumerate(corner))
        np.add.at(diff, index, -1 if sum(corner) % 2 else 1)
    for d in range(nd):
        diff = np.cumsum(diff, axis=d)
    return diff[tuple(slice(0, g) for g in grid)], bounds


def _gaps(
    gs: tuple[int, ...], grid: tuple[Any, list[list[int]]]
) -> tuple[int, list[tuple[tuple[int, ...], tuple[int, ...]]], int, bool]:
    """Uncovered boxes on the coordinate-compressed grid: (count, first few (lo, hi), elements, and
    whether the count is complete: past :data:`MAX_GAPS_COUNTED` boxes it is a lower bound).

    A cell is uncovered when no piece contains it (``grid`` is :func:`_grid_counts`). Uncovered
    cells are merged greedily into boxes, growing along the last dim first and then outward, so a
    missing TP slice prints as one range.
    """
    import numpy as np

    counts, bounds = grid
    shape = tuple(len(b) - 1 for b in bounds)
    free = np.array(counts == 0)  # an array even for a 0-d tensor
    widths = [np.diff(np.asarray(b, dtype=np.int64)) for b in bounds]
    cell_volume = np.ones(shape, dtype=np.int64)
    for d, w in enumerate(widths):
        cell_volume = cell_volume * w.reshape([-1 if k == d else 1 for k in range(len(gs))])
    uncovered = int(cell_volume[free].sum())

    n_gaps, boxes = 0, []
    for flat in np.flatnonzero(free):
        if n_gaps == MAX_GAPS_COUNTED:
            return n_gaps, boxes, uncovered, False
        start = np.unravel_index(int(flat), shape) if shape else ()
        if not free[tuple(start)]:
            continue  # already merged into an earlier box
        lo = [int(k) for k in start]
        hi = [k + 1 for k in lo]
        for d in reversed(range(len(gs))):
            while hi[d] < shape[d]:
                slab = tuple(
                    slice(hi[d], hi[d] + 1) if k == d else slice(lo[k], hi[k]) for k in range(len(gs))
                )
                if not free[slab].all():
                    break
                hi[d] += 1
        free[tuple(slice(a, b) for a, b in zip(lo, hi))] = False
        n_gaps += 1
        if len(boxes) < MAX_LISTED:
            boxes.append(
                (tuple(bounds[d][a] for d, a in enumerate(lo)), tuple(bounds[d][b] for d, b in enumerate(hi)))
            )
    return n_gaps, boxes, uncovered, True


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
    """What the tracker knows about one tensor: its shape, element size and declared pieces."""

    global_shape: tuple[int, ...]
    itemsize: int
    first_rank: int
    pieces: list[Piece] = field(default_factory=list)
    arrived: list[_Ranges] = field(default_factory=list)  # elements received per piece, by position
    pending: int = 0  # pieces not yet complete


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
        for name, piece in checked:
            t = self._tensors[name]
            t.pieces.append(piece)
            t.arrived.append(_Ranges())
            t.pending += 1
            ids.append(len(t.pieces) - 1)
        return ids

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
        t, piece = self._piece(name, piece_id)
        ranges = t.arrived[piece_id]
        whole = offsets is None or shape is None
        if whole:
            lo, hi = 0, piece.numel
        else:
            lo, hi = self.block_range(name, piece_id, offsets, shape)
        clash = ranges.add(lo, hi)
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
            t.pending -= 1
            return True
        return False

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
        t = self._tensors.get(name)
        return t is not None and t.pending == 0

    def incomplete(self, rank: int | None = None) -> list[str]:
        """One line per declared piece still missing elements (of ``rank``, or of every rank), by rank,
        e.g. for a stall report."""
        rows = []
        for name, t in self._tensors.items():
            if not t.pending:
                continue
            for piece, ranges in zip(t.pieces, t.arrived):
                if ranges.held < piece.numel and (rank is None or piece.rank == rank):
                    rows.append((piece.rank, name, piece, ranges.held * t.itemsize, piece.numel * t.itemsize))
        rows.sort(key=lambda r: (r[0], r[1]))
        return [
            f"rank {rank}: {name!r} {piece.describe()} ({have} of {want} bytes)"
            for rank, name, piece, have, want in rows
        ]


def _show(values: Any) -> str:
    """A wire value for a message, bounded: a list of ints as is, anything else by type and length."""
    if isinstance(values, (list, tuple)) and len(values) <= 8 and all(type(v) is int for v in values):
        return str(list(values))
    return f"<{type(values).__name__}>"
