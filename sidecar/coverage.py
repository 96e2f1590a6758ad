"""Does every element of every expected tensor arrive exactly once? Shard bookkeeping for one step.

Trainer ranks push slices ("pieces") of global weight tensors: tensor-parallel slices along a dim,
expert-parallel slices of an expert slab, sometimes several slices of one tensor from one rank. A
step may only be sealed when the pieces of each tensor tile its global shape exactly: a gap means
the engine would load stale or uninitialised weights, an overlap means two ranks disagree about
the sharding plan and one of them silently wins. Both are plan bugs that should fail loudly, with a
message naming the tensor, the ranks and the element ranges, not surface later as a bad eval.

The check never materialises a tensor. The common case (the pieces' volumes add up to the tensor's
and no two pieces intersect) is decided with a few integer comparisons per pair. Only when that
fails is the coordinate-compressed grid built (one cell per interval between consecutive piece
boundaries, in every dim) to name the gaps; overlaps are named from the pairwise intersections.

Ranges print half-open per dim, joined with `` x ``: ``[0, 128) x [0, 1024)``.

numpy is imported lazily, only to explain a failure, so the fast path is pure Python.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CoverageError",
    "CoverageTracker",
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
    volume = math.prod(gs)
    if sum(p.numel for p in pieces) == volume and _overlaps(pieces, keep=0, first_only=True)[0] == 0:
        return
    raise CoverageError(_explain(name, gs, pieces))


def _overlaps(
    pieces: Sequence[Piece], keep: int, first_only: bool = False
) -> tuple[int, list[tuple[int, int]]]:
    """Number of intersecting pairs, and up to ``keep`` of them as sorted index pairs ``(i, j)``, i < j.

    A sweep along the dim with the most distinct start offsets: pieces sorted by their start there,
    each compared only with the earlier pieces still open at that start. A TP or EP split along one
    dim keeps one piece open, so the usual case is O(n log n); a 2-D block grid keeps one row open.
    ``first_only`` stops at the first overlap (enough to refuse the fast path).
    """
    n = len(pieces)
    if n < 2:
        return 0, []
    los = [p.offsets for p in pieces]
    his = [p.end for p in pieces]
    ndim = len(los[0])
    if ndim == 0:  # every 0-d piece is the whole value
        pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
        return (1 if first_only else len(pairs)), pairs[:keep]
    d = max(range(ndim), key=lambda k: len({lo[k] for lo in los})) if n > 8 else 0
    order = sorted(range(n), key=lambda i: los[i][d])
    count, kept = 0, []
    active: list[int] = []
    for i in order:
        lo_i, hi_i = los[i], his[i]
        start = lo_i[d]
        active = [j for j in active if his[j][d] > start]
        for j in active:
            lo_j, hi_j = los[j], his[j]
            for k in range(ndim):
                if lo_i[k] >= hi_j[k] or lo_j[k] >= hi_i[k]:
                    break
            else:
                count += 1
                if first_only:
                    return count, kept
                if len(kept) < keep:
                    kept.append((min(i, j), max(i, j)))
        active.append(i)
    return count, sorted(kept)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _explain(name: str, gs: tuple[int, ...], pieces: Sequence[Piece]) -> str:
    """The error text for pieces that are valid one by one but do not tile ``gs`` exactly once."""
    if not pieces:
        return f"tensor {name!r}: no rank sent any part of it (global shape {_shape(gs)})"
    n_overlaps, overlap_pairs = _overlaps(pieces, keep=MAX_LISTED)
    lines = []
    for i, j in overlap_pairs:
        a, b = pieces[i], pieces[j]
        lo = tuple(max(x, y) for x, y in zip(a.offsets, b.offsets))
        hi = tuple(min(x, y) for x, y in zip(a.end, b.end))
        who = f"rank {a.rank} sent" if a.rank == b.rank else f"ranks {a.rank} and {b.rank} both sent"
        again = " in two pieces" if a.rank == b.rank else ""
        lines.append(f"  overlap: {who} {_rows(lo, hi)}{again}")
    if n_overlaps > len(overlap_pairs):
        lines.append(f"  ... and {_plural(n_overlaps - len(overlap_pairs), 'more overlap')}")

    gaps = _gaps(gs, pieces)
    counts = [_plural(n_overlaps, "overlap")] if n_overlaps else []
    if gaps is None:  # too fragmented for a grid: say how much is sent, not where it is missing
        held = sum(p.numel for p in pieces)
        counts.append(f"pieces hold {held} elements for {math.prod(gs)}")
        lines.append("  gaps: too many piece boundaries to list the uncovered ranges")
    else:
        n_gaps, gap_boxes, uncovered = gaps
        for lo, hi in gap_boxes:
            lines.append(f"  gap: no rank sent {_rows(lo, hi)}")
        if n_gaps > len(gap_boxes):
            lines.append(f"  ... and {_plural(n_gaps - len(gap_boxes), 'more gap')}")
        if n_gaps:
            counts.append(f"{_plural(n_gaps, 'gap')}, {uncovered} of {math.prod(gs)} elements uncovered")
    ranks = sorted({p.rank for p in pieces})
    sent_by = f"its {_plural(len(pieces), 'piece')} from rank{'s' if len(ranks) > 1 else ''} "
    sent_by += ", ".join(map(str, ranks))
    head = f"tensor {name!r}: global shape {_shape(gs)} is not covered exactly once by {sent_by} ({'; '.join(counts)}):"
    return "\n".join([head, *lines, _FIX_HINT])


def _gaps(
    gs: tuple[int, ...], pieces: Sequence[Piece]
) -> tuple[int, list[tuple[tuple[int, ...], tuple[int, ...]]], int] | None:
    """Uncovered boxes on the coordinate-compressed grid: (count, first few (lo, hi), elements).

    Each dim is cut at 0, its size and every piece boundary; a cell is uncovered when no piece
    contains it. Uncovered cells are merged greedily into boxes, growing along the last dim first
    and then outward, so a missing TP slice prints as one range. None when the grid would exceed
    :data:`MAX_GRID_CELLS`.
    """
    import numpy as np

    bounds = [
        sorted({0, size, *(p.offsets[d] for p in pieces), *(p.end[d] for p in pieces)})
        for d, size in enumerate(gs)
    ]
    grid = tuple(len(b) - 1 for b in bounds)
    if math.prod(grid) > MAX_GRID_CELLS:
        return None
    index = [{v: k for k, v in enumerate(b)} for b in bounds]
    counts = np.zeros(grid, dtype=np.int32)
    for p in pieces:
        counts[tuple(slice(index[d][a], index[d][b]) for d, (a, b) in enumerate(zip(p.offsets, p.end)))] += 1
    free = np.array(counts == 0)  # an array even for a 0-d tensor
    widths = [np.diff(np.asarray(b, dtype=np.int64)) for b in bounds]
    cell_volume = np.ones(grid, dtype=np.int64)
    for d, w in enumerate(widths):
        cell_volume = cell_volume * w.reshape([-1 if k == d else 1 for k in range(len(gs))])
    uncovered = int(cell_volume[free].sum())

    n_gaps, boxes = 0, []
    for flat in np.flatnonzero(free):
        start = np.unravel_index(int(flat), grid) if grid else ()
        if not free[tuple(start)]:
            continue  # already merged into an earlier box
        lo = [int(k) for k in start]
        hi = [k + 1 for k in lo]
        for d in reversed(range(len(gs))):
            while hi[d] < grid[d]:
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
    return n_gaps, boxes, uncovered


@dataclass(slots=True)
class _Tensor:
    """What the tracker knows about one tensor: its shape, element size and declared pieces."""

    global_shape: tuple[int, ...]
    itemsize: int
    first_rank: int
    pieces: list[Piece] = field(default_factory=list)
    expected: list[int] = field(default_factory=list)  # bytes per piece
    received: list[int] = field(default_factory=list)  # bytes so far per piece


class CoverageTracker:
    """Per-step bookkeeping: which pieces were announced, whether they tile, how many bytes arrived.

    One tracker per step; the daemon throws it away when the step seals or aborts. Piece ids are
    per tensor (0, 1, 2, ... in declaration order), so a ``(name, piece_id)`` pair names a piece::

        tracker = CoverageTracker()
        pid = tracker.declare("w", (256, 1024), Piece(rank=1, offsets=(128, 0), shape=(128, 1024)), itemsize=2)
        ...                                    # every rank's announcements arrive
        tracker.check_declared(expected_names)  # raises CoverageError naming gaps / overlaps
        tracker.received("w", pid, nbytes)      # as data frames land; True once the piece is full
        if not tracker.incomplete(): seal()
    """

    def __init__(self) -> None:
        self._tensors: dict[str, _Tensor] = {}

    def declare(self, name: str, global_shape: Sequence[int], piece: Piece, itemsize: int) -> int:
        """Record that ``piece.rank`` will send ``piece`` of tensor ``name``; return its piece id.

        The piece is validated now, so a malformed announcement fails at once with the rank named.
        Every piece of one tensor must agree on the global shape and the element size.
        """
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
        t = self._tensors.get(name)
        if t is None:
            t = self._tensors[name] = _Tensor(gs, size, piece.rank)
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
        t.pieces.append(piece)
        t.expected.append(piece.numel * size)
        t.received.append(0)
        return len(t.pieces) - 1

    def check_declared(self, names: Iterable[str], *, allow_extra: bool = False) -> None:
        """Raise :class:`CoverageError` unless every tensor in ``names`` is tiled exactly once.

        A tensor nobody declared is a gap. A declared tensor outside ``names`` is an error too (a
        rank is sending something this step does not expect) unless ``allow_extra``. All problems
        are collected into one error, so one run shows every broken tensor.
        """
        problems = []
        expected = dict.fromkeys(names)
        for name in expected:
            t = self._tensors.get(name)
            if t is None:
                problems.append(f"tensor {name!r}: no rank sent any part of it")
                continue
            try:
                check_cover(name, t.global_shape, t.pieces)
            except CoverageError as exc:
                problems.append(str(exc))
        if not allow_extra:
            for name, t in self._tensors.items():
                if name not in expected:
                    ranks = sorted({p.rank for p in t.pieces})
                    problems.append(
                        f"tensor {name!r}: sent by ranks {ranks} but not expected this step; "
                        "check the trainer's parameter names against the model's"
                    )
        if not problems:
            return
        shown = problems[:MAX_LISTED_TENSORS]
        more = len(problems) - len(shown)
        tail = [f"... and {_plural(more, 'more problem')}"] if more else []
        raise CoverageError(
            "\n".join([f"step coverage check failed ({_plural(len(problems), 'problem')}):", *shown, *tail])
        )

    def received(self, name: str, piece_id: int, nbytes: int) -> bool:
        """Add ``nbytes`` to a piece; True once it holds all its bytes. Over-receiving is refused."""
        t = self._tensors.get(name)
        if t is None:
            raise CoverageError(
                f"received {nbytes} bytes for tensor {name!r}, which no rank declared: declare() its pieces first"
            )
        if not 0 <= piece_id < len(t.pieces):
            raise CoverageError(
                f"tensor {name!r}: received bytes for piece id {piece_id}, but only ids "
                f"0..{len(t.pieces) - 1} were declared"
            )
        piece = t.pieces[piece_id]
        if nbytes < 0:
            raise CoverageError(
                f"tensor {name!r}: rank {piece.rank} reported {nbytes} bytes, a negative count"
            )
        have, want = t.received[piece_id], t.expected[piece_id]
        if have + nbytes > want:
            raise CoverageError(
                f"tensor {name!r}: rank {piece.rank} sent {have + nbytes} bytes for {piece.describe()}, "
                f"which holds only {want} ({piece.numel} elements x {t.itemsize} bytes): "
                "the rank's dtype or slice shape differs from what it declared"
            )
        t.received[piece_id] = have + nbytes
        return have + nbytes == want

    def piece_nbytes(self, name: str, piece_id: int) -> int:
        """Bytes piece ``piece_id`` of ``name`` holds (what a local writer reports when done)."""
        return self._tensors[name].expected[piece_id]

    def contains(self, name: str, piece_id: int, offsets: Sequence[int], shape: Sequence[int]) -> bool:
        """Whether the sub-block ``offsets``/``shape`` (global coordinates) lies inside the piece."""
        piece = self._tensors[name].pieces[piece_id]
        if len(offsets) != len(piece.offsets) or len(shape) != len(piece.offsets):
            return False
        return all(
            lo <= o and o + s <= hi and s >= 0
            for o, s, lo, hi in zip(offsets, shape, piece.offsets, piece.end)
        )

    def tensor_complete(self, name: str) -> bool:
        """True when every declared piece of ``name`` holds all its bytes (False if none declared).

        Byte completeness only: whether the pieces tile the tensor is :meth:`check_declared`'s job.
        """
        t = self._tensors.get(name)
        return t is not None and t.received == t.expected

    def incomplete(self) -> list[str]:
        """One line per declared piece still missing bytes, by rank, e.g. for a stall report."""
        rows = []
        for name, t in self._tensors.items():
            for piece, have, want in zip(t.pieces, t.received, t.expected):
                if have < want:
                    rows.append((piece.rank, name, piece, have, want))
        rows.sort(key=lambda r: (r[0], r[1]))
        return [
            f"rank {rank}: {name!r} {piece.describe()} ({have} of {want} bytes)"
            for rank, name, piece, have, want in rows
        ]
