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

Data is tracked by position (sidecar.daemon.tracker): each piece keeps the ranges of its flattened
elements received so far, so a block sent twice is refused (``FrameError``) even when as many bytes
as the piece holds have arrived, and a piece completes only when its blocks tile it.

Ranges print half-open per dim, joined with `` x ``: ``[0, 128) x [0, 1024)``.

numpy is imported lazily, only to explain a failure, so the fast path is pure Python.
"""

from __future__ import annotations

import heapq
import itertools
import math
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CoverageError",
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
