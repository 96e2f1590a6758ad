"""Coverage of global tensors by rank pieces: exact covers pass, gaps and overlaps are named precisely."""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.daemon import coverage
from sidecar.daemon.coverage import CoverageError, Piece, check_cover, validate_piece
from sidecar.daemon.tracker import CoverageTracker, FrameError

SLAB = "model.layers.3.mlp.experts.gate_up_proj"
HINT = (
    "check each rank's slice offsets and shapes against the sharding plan: "
    "every element must come from exactly one rank"
)


def tp(shape: tuple[int, ...], dim: int, ranks: int) -> list[Piece]:
    """One piece per rank, an even split of ``shape`` along ``dim`` (tensor parallelism)."""
    step = shape[dim] // ranks
    pieces = []
    for r in range(ranks):
        offsets = tuple(r * step if d == dim else 0 for d in range(len(shape)))
        extent = tuple(step if d == dim else n for d, n in enumerate(shape))
        pieces.append(Piece(r, offsets, extent))
    return pieces


def error(name: str, shape: tuple[int, ...], pieces: list[Piece]) -> str:
    with pytest.raises(CoverageError) as info:
        check_cover(name, shape, pieces)
    return str(info.value)


# --- pieces --------------------------------------------------------------------------------------


def test_piece_derives_end_numel_and_slices() -> None:
    """A piece is a box; its slices index exactly that box of the global tensor."""
    p = Piece(3, [4, 0], (2, 5))
    assert p.offsets == (4, 0) and p.end == (6, 5) and p.numel == 10
    full = np.arange(8 * 5).reshape(8, 5)
    assert full[p.slices()].shape == p.shape
    assert full[p.slices()][0, 0] == full[4, 0]
    assert Piece(0, np.array([1, 2]), (3, 4)) == Piece(0, (1, 2), (3, 4))  # numpy ints normalised
    assert Piece(0, (), ()).numel == 1 and Piece(0, (), ()).slices() == ()


def test_piece_refuses_mismatched_offsets_and_shape() -> None:
    with pytest.raises(CoverageError, match=r"rank 1's piece has 3 offsets \[0, 0, 0\] but a 2-d shape"):
        Piece(1, (0, 0, 0), (4, 4))
    with pytest.raises(CoverageError, match="piece offsets must be a sequence of ints"):
        Piece(1, (0.5, 0), (4, 4))


# --- exact covers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_tensor_parallel_split_along_any_dim_is_exact(dim: int) -> None:
    """Eight TP ranks, each with one even slice along ``dim``, tile a 3-D slab."""
    shape = (256, 1024, 2048)
    check_cover(SLAB, shape, tp(shape, dim, 8))
    check_cover(SLAB, shape, list(reversed(tp(shape, dim, 8))))  # arrival order does not matter


def test_expert_parallel_one_piece_per_expert_is_exact() -> None:
    """128 experts over 8 EP ranks, each rank sending its 16 experts as 16 separate pieces."""
    shape = (128, 64, 32)
    pieces = [Piece(e // 16, (e, 0, 0), (1, 64, 32)) for e in range(128)]
    random.Random(0).shuffle(pieces)
    check_cover(SLAB, shape, pieces)


def test_expert_parallel_with_tensor_parallel_inside_each_expert() -> None:
    """EP over experts, then TP=2 along the intermediate dim inside each rank's experts."""
    shape = (16, 64, 32)
    pieces = [Piece(2 * (e // 4) + t, (e, 32 * t, 0), (1, 32, 32)) for e in range(16) for t in range(2)]
    check_cover(SLAB, shape, pieces)


def test_one_rank_holding_several_disjoint_pieces() -> None:
    """Rank 0 holds rows [0, 64) and [128, 192); rank 1 holds the rows between and after."""
    pieces = [
        Piece(0, (0, 0), (64, 16)),
        Piece(1, (64, 0), (64, 16)),
        Piece(0, (128, 0), (64, 16)),
        Piece(1, (192, 0), (64, 16)),
    ]
    check_cover("w", (256, 16), pieces)


def test_block_grid_of_pieces_is_exact() -> None:
    """A 2-D 16x16 grid of blocks spread over 4 ranks (the sweep keeps one row of blocks open)."""
    pieces = [Piece((i + j) % 4, (16 * i, 16 * j), (16, 16)) for i in range(16) for j in range(16)]
    check_cover("w", (256, 256), pieces)


def test_one_dim_and_zero_dim_tensors() -> None:
    """A 1-D bias split in three uneven parts; a 0-d scalar sent whole by one rank."""
    check_cover("bias", (10,), [Piece(0, (0,), (3,)), Piece(1, (3,), (5,)), Piece(2, (8,), (2,))])
    check_cover("scale", (), [Piece(0, (), ())])
    check_cover("scale", [], (p for p in [Piece(0, (), ())]))  # any iterable of pieces, any shape sequence


def test_zero_element_tensor_needs_no_piece() -> None:
    check_cover("empty", (0, 4), [])


# --- gaps and overlaps ----------------------------------------------------------------------------


def test_missing_tp_rank_is_one_gap_with_its_range() -> None:
    """Rank 3 of 8 never sent its rows: one gap, printed as a single merged box."""
    shape = (256, 1024, 2048)
    pieces = [p for p in tp(shape, 0, 8) if p.rank != 3]
    assert error(SLAB, shape, pieces) == "\n".join(
        [
            f"tensor '{SLAB}': global shape [256, 1024, 2048] is not covered exactly once by its 7 pieces "
            "from ranks 0, 1, 2, 4, 5, 6, 7 (1 gap, 67108864 of 536870912 elements uncovered):",
            "  gap: no rank sent rows [96, 128) x [0, 1024) x [0, 2048)",
            HINT,
        ]
    )


def test_gap_along_a_middle_dim_merges_into_one_range() -> None:
    shape = (4, 64, 8)
    pieces = [p for p in tp(shape, 1, 4) if p.rank != 2]
    assert "  gap: no rank sent rows [0, 4) x [32, 48) x [0, 8)\n" in error("w", shape, pieces)


def test_overlap_names_both_ranks_and_the_shared_range() -> None:
    """Rank 1 starts 16 rows early: it overlaps rank 0, and the rows it should have ended on are a gap."""
    pieces = [Piece(0, (0, 0), (64, 32)), Piece(1, (48, 0), (64, 32))]
    pieces.append(Piece(2, (128, 0), (128, 32)))
    assert error("attn.q_proj.weight", (256, 32), pieces) == "\n".join(
        [
            "tensor 'attn.q_proj.weight': global shape [256, 32] is not covered exactly once by its 3 pieces "
            "from ranks 0, 1, 2 (1 overlap; 1 gap, 512 of 8192 elements uncovered):",
            "  overlap: ranks 0 and 1 both sent rows [48, 64) x [0, 32)",
            "  gap: no rank sent rows [112, 128) x [0, 32)",
            HINT,
        ]
    )


def test_same_rank_sending_a_range_twice() -> None:
    pieces = [Piece(5, (0,), (8,)), Piece(5, (4,), (8,))]
    msg = error("bias", (16,), pieces)
    assert "by its 2 pieces from rank 5 (1 overlap; 1 gap, 4 of 16 elements uncovered):" in msg
    assert "  overlap: rank 5 sent rows [4, 8) in two pieces\n" in msg
    assert "  gap: no rank sent rows [12, 16)\n" in msg


def test_zero_dim_overlap_and_missing() -> None:
    msg = error("scale", (), [Piece(0, (), ()), Piece(1, (), ())])
    assert "(1 overlap):\n  overlap: ranks 0 and 1 both sent the 0-d value\n" in msg
    assert error("scale", (), []) == "tensor 'scale': no rank sent any part of it (global shape [])"


def test_many_gaps_and_overlaps_are_truncated_with_a_count() -> None:
    """Eight gaps and eight overlaps: five of each are listed, the rest counted."""
    gaps = [Piece(0, (i,), (1,)) for i in range(0, 16, 2)]
    msg = error("bias", (16,), gaps)
    assert msg.count("  gap: no rank sent rows") == 5
    assert "  gap: no rank sent rows [1, 2)\n" in msg
    assert "  ... and 3 more gaps\n" in msg
    assert "(8 gaps, 8 of 16 elements uncovered)" in msg

    dups = [Piece(r, (0,), (4,)) for r in range(8)]  # each piece after the first overlaps: 7, not 28 pairs
    msg = error("bias", (4,), dups)
    assert "(7 overlaps):" in msg
    assert msg.count("  overlap: ranks") == 5
    assert "  overlap: ranks 0 and 1 both sent rows [0, 4)\n" in msg
    assert "  ... and 2 more overlaps\n" in msg


def test_too_fragmented_grid_still_reports_without_ranges(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(coverage, "MAX_GRID_CELLS", 4)
    msg = error("w", (16, 16), [Piece(0, (i, i), (1, 1)) for i in range(8)])
    assert "(pieces hold 8 elements for 256):" in msg
    assert "  gaps: too many piece boundaries to list the uncovered ranges\n" in msg


# --- malformed pieces -----------------------------------------------------------------------------


def test_piece_outside_global_shape_is_refused_with_its_range() -> None:
    with pytest.raises(CoverageError) as info:
        validate_piece(SLAB, (256, 1024, 2048), Piece(2, (256, 0, 0), (128, 1024, 2048)))
    assert str(info.value) == (
        f"tensor '{SLAB}': rank 2 sent rows [256, 384) x [0, 1024) x [0, 2048), outside its global shape "
        "[256, 1024, 2048] in dim 0: check the slice offsets against the sharding plan"
    )
    with pytest.raises(CoverageError, match=r"rows \[0, 4\) x \[30, 34\), outside .* in dim 1"):
        check_cover("w", (4, 32), [Piece(0, (0, 30), (4, 4))])


def test_wrong_ndim_negative_offset_and_empty_pieces_are_refused() -> None:
    with pytest.raises(CoverageError, match=r"rank 1 sent rows \[0, 4\), a 1-d piece of a 2-d tensor"):
        validate_piece("w", (4, 4), Piece(1, (0,), (4,)))
    with pytest.raises(CoverageError, match="rank 0 sent the 0-d value, a 0-d piece of a 1-d tensor"):
        validate_piece("w", (4,), Piece(0, (), ()))
    with pytest.raises(CoverageError, match=r"rows \[-2, 2\) x \[0, 4\), with negative offset -2 in dim 0"):
        validate_piece("w", (4, 4), Piece(0, (-2, 0), (4, 4)))
    with pytest.raises(CoverageError, match="with extent 0 in dim 1: zero-size pieces are refused"):
        validate_piece("w", (4, 4), Piece(0, (0, 2), (4, 0)))
    with pytest.raises(CoverageError, match="with extent -1 in dim 0"):
        validate_piece("w", (4, 4), Piece(0, (2, 0), (-1, 4)))
    with pytest.raises(CoverageError, match=r"global shape \[4, -4\] has negative size in dim 1"):
        check_cover("w", (4, -4), [])


# --- the tracker ----------------------------------------------------------------------------------


def test_tracker_tracks_blocks_by_position_until_each_piece_and_tensor_is_complete() -> None:
    """Two ranks announce halves of a bf16 tensor; blocks land out of order; a block sent twice is
    refused even though as many bytes as the piece holds would then have arrived."""
    t = CoverageTracker()
    a = t.declare("x", (4, 8), Piece(0, (0, 0), (2, 8)), itemsize=2)
    b = t.declare("x", (4, 8), Piece(1, (2, 0), (2, 8)), 2)
    assert (a, b) == (0, 1)
    t.check_declared(["x"])
    assert t.incomplete() == [
        "rank 0: 'x' rows [0, 2) x [0, 8) (0 of 32 bytes)",
        "rank 1: 'x' rows [2, 4) x [0, 8) (0 of 32 bytes)",
    ]
    assert t.received("x", a, [1, 0], [1, 8]) is False  # the second row first
    assert t.incomplete(rank=0) == ["rank 0: 'x' rows [0, 2) x [0, 8) (16 of 32 bytes)"]
    with pytest.raises(FrameError) as info:
        t.received("x", a, [1, 4], [1, 4])  # half of that row again: 16 + 8 bytes would fit
    assert str(info.value) == (
        "tensor 'x': rank 0 sent the block at [1, 4] shape [1, 4], but elements [12, 16) of that piece "
        "(rows [0, 2) x [0, 8), flattened) already arrived: every element must be sent exactly once; "
        "a duplicated or overlapping frame means the sender's split is wrong"
    )
    assert t.received("x", a, [0, 0], [1, 8]) is True
    assert not t.tensor_complete("x")
    assert t.incomplete() == [
        "rank 1: 'x' rows [2, 4) x [0, 8) (0 of 32 bytes)"
    ]  # refused blocks not counted
    assert t.received("x", b) is True  # the whole piece at once (written into staging)
    assert t.tensor_complete("x") and t.incomplete() == []
    with pytest.raises(
        FrameError, match=r"reported all of rows \[2, 4\) x \[0, 8\) written, but elements \[0, 16\)"
    ):
        t.received("x", b)
    assert not t.tensor_complete("never-declared")


def test_tracker_refuses_blocks_outside_the_piece_or_not_contiguous_in_it() -> None:
    t = CoverageTracker()
    p = t.declare("w", (4, 6, 8), Piece(0, (0, 0, 0), (4, 6, 8)), itemsize=2)
    for offsets, shape in [
        ([0, 0, 0], [5, 6, 8]),  # sticks out
        ([0, 0], [4, 6]),  # wrong rank
        ([0, 0, 0], [1, 0, 8]),  # empty
        ([0, 0, True], [1, 1, 1]),  # a bool is not an index
        ((0, 0, 0.0), [1, 1, 1]),
    ]:
        with pytest.raises(FrameError, match="is not a non-empty box inside the piece it declared"):
            t.received("w", p, offsets, shape)
    for offsets, shape in [([0, 0, 0], [2, 1, 8]), ([0, 0, 0], [1, 2, 4]), ([0, 1, 0], [1, 3, 1])]:
        with pytest.raises(FrameError, match="is not one contiguous run"):
            t.received("w", p, offsets, shape)
    assert t.incomplete() == ["rank 0: 'w' rows [0, 4) x [0, 6) x [0, 8) (0 of 384 bytes)"]
    assert t.block_range("w", p, [1, 2, 0], [1, 3, 8]) == (64, 88)
    assert t.block_range("w", p, [2, 0, 0], [2, 6, 8]) == (96, 192)
    assert t.block_range("w", p, [3, 5, 2], [1, 1, 3]) == (186, 189)
    assert t.contains("w", p, [3, 5, 2], [1, 1, 3]) and not t.contains("w", p, [3, 5, 2], [1, 1, 7])


def test_tracker_ranges_merge_and_complete_in_any_order() -> None:
    """Random splits of a piece into contiguous runs, sent shuffled: complete exactly at the last;
    any run sent again is refused."""
    rng = random.Random(7)
    for _ in range(50):
        t = CoverageTracker()
        p = t.declare("v", (64,), Piece(0, (0,), (64,)), itemsize=4)
        cuts = sorted(rng.sample(range(1, 64), rng.randrange(0, 10)))
        runs = list(zip([0, *cuts], [*cuts, 64]))
        rng.shuffle(runs)
        for k, (lo, hi) in enumerate(runs):
            assert t.received("v", p, [lo], [hi - lo]) is (k == len(runs) - 1)
        lo, hi = rng.choice(runs)
        with pytest.raises(FrameError, match="already arrived"):
            t.received("v", p, [lo], [hi - lo])


def test_tracker_refuses_unknown_tensors_and_ids() -> None:
    t = CoverageTracker()
    t.declare("x", (4,), Piece(0, (0,), (4,)), itemsize=4)
    with pytest.raises(CoverageError, match="tensor 'y', which no rank declared: declare"):
        t.received("y", 0)
    with pytest.raises(CoverageError, match=r"piece id 1, but only ids 0..0 were declared"):
        t.received("x", 1)
    with pytest.raises(CoverageError, match=r"piece id True, but only ids 0..0 were declared"):
        t.received("x", True)


def test_a_refused_declaration_declares_nothing() -> None:
    """declare_all checks every piece first: the third is out of bounds, so none of them is recorded
    and the corrected set declares cleanly."""
    t = CoverageTracker()
    good = [("a", (4,), Piece(0, (0,), (4,)), 2), ("b", (2, 2), Piece(0, (0, 0), (2, 2)), 2)]
    with pytest.raises(CoverageError, match="outside its global shape"):
        t.declare_all([*good, ("c", (4,), Piece(0, (2,), (4,)), 2)])
    with pytest.raises(CoverageError, match="declared global shape \\[8\\], but rank 0 declared \\[4\\]"):
        t.declare_all([*good, ("a", (8,), Piece(0, (4,), (4,)), 2)])
    assert len(t) == 0 and t.incomplete() == []
    assert t.declare_all([*good, ("c", (4,), Piece(0, (0,), (4,)), 2)]) == [0, 0, 0]
    t.check_declared(["a", "b", "c"])


def test_tracker_refuses_disagreeing_declarations() -> None:
    """Ranks must agree on a tensor's global shape and dtype; malformed pieces fail at declare time."""
    t = CoverageTracker()
    t.declare("x", (4, 8), Piece(0, (0, 0), (2, 8)), itemsize=2)
    with pytest.raises(
        CoverageError, match=r"rank 1 declared global shape \[8, 8\], but rank 0 declared \[4, 8\]"
    ):
        t.declare("x", (8, 8), Piece(1, (2, 0), (2, 8)), itemsize=2)
    with pytest.raises(CoverageError, match="rank 1 declared itemsize 4, but rank 0 declared 2"):
        t.declare("x", (4, 8), Piece(1, (2, 0), (2, 8)), itemsize=4)
    with pytest.raises(CoverageError, match="itemsize 0: give the element size in bytes"):
        t.declare("y", (4,), Piece(1, (0,), (4,)), itemsize=0)
    with pytest.raises(CoverageError, match=r"rank 3 sent rows \[2, 6\) x \[0, 8\), outside"):
        t.declare("x", (4, 8), Piece(3, (2, 0), (4, 8)), itemsize=2)


def test_check_declared_names_every_broken_tensor() -> None:
    """A missing tensor, a gappy tensor and an unexpected tensor are all reported in one error."""
    t = CoverageTracker()
    t.declare("ok", (4,), Piece(0, (0,), (4,)), itemsize=2)
    t.declare("gappy", (4,), Piece(1, (0,), (2,)), itemsize=2)
    t.declare("extra", (4,), Piece(2, (0,), (4,)), itemsize=2)
    with pytest.raises(CoverageError) as info:
        t.check_declared(["ok", "gappy", "missing"])
    lines = str(info.value).splitlines()
    assert lines[0] == "step coverage check failed (3 problems):"
    assert (
        "tensor 'gappy': global shape [4] is not covered exactly once by its 1 piece from rank 1" in lines[1]
    )
    assert "  gap: no rank sent rows [2, 4)" in lines
    assert "tensor 'missing': no rank sent any part of it" in lines
    assert lines[-1].startswith("tensor 'extra': sent by ranks [2] but not expected this step")
    with pytest.raises(CoverageError, match=r"\(2 problems\)"):
        t.check_declared(["ok", "gappy", "missing"], allow_extra=True)
    t.check_declared(["ok", "extra"], allow_extra=True)


def test_check_declared_truncates_a_flood_of_missing_tensors() -> None:
    with pytest.raises(CoverageError) as info:
        CoverageTracker().check_declared(f"t{i}" for i in range(100))
    msg = str(info.value)
    assert msg.count("no rank sent any part of it") == coverage.MAX_LISTED_TENSORS
    assert msg.endswith("... and 80 more problems")


# --- many tensors ---------------------------------------------------------------------------------


def test_many_small_tensors_and_tp_slab() -> None:
    """A step of 10,000 small whole tensors and an 8-way TP slab check cleanly (no timing asserted:
    bench/ingest.py measures the per-step overhead)."""
    t = CoverageTracker()
    names = [f"model.layers.{i}.norm.weight" for i in range(10_000)]
    for name in names:
        t.declare(name, (2048,), Piece(0, (0,), (2048,)), itemsize=2)
    t.check_declared(names)
    check_cover(SLAB, (256, 1024, 2048), [Piece(0, (0, 0, 0), (256, 1024, 2048))])
    check_cover(SLAB, (256, 1024, 2048), tp((256, 1024, 2048), 0, 8))


# --- property: random partitions -----------------------------------------------------------------


@st.composite
def partitions(draw: st.DrawFn) -> tuple[tuple[int, ...], list[Piece]]:
    """A random box cut by random guillotine cuts into sub-boxes, each owned by a random rank."""
    ndim = draw(st.integers(0, 4))
    shape = tuple(draw(st.lists(st.integers(1, 12), min_size=ndim, max_size=ndim)))
    boxes = [((0,) * ndim, shape)]
    for _ in range(draw(st.integers(0, 12))):
        k = draw(st.integers(0, len(boxes) - 1))
        lo, ext = boxes[k]
        cuttable = [d for d in range(ndim) if ext[d] > 1]
        if not cuttable:
            continue
        d = draw(st.sampled_from(cuttable))
        cut = draw(st.integers(1, ext[d] - 1))
        left = (lo, (*ext[:d], cut, *ext[d + 1 :]))
        right = ((*lo[:d], lo[d] + cut, *lo[d + 1 :]), (*ext[:d], ext[d] - cut, *ext[d + 1 :]))
        boxes[k : k + 1] = [left, right]
    pieces = [Piece(draw(st.integers(0, 7)), lo, ext) for lo, ext in boxes]
    return shape, draw(st.permutations(pieces))


@settings(max_examples=150, deadline=None)
@given(partitions(), st.data())
def test_random_partitions_pass_and_fail_when_a_piece_is_dropped_or_doubled(
    case: tuple[tuple[int, ...], list[Piece]], data: st.DataObject
) -> None:
    """Any partition is an exact cover; dropping one piece leaves exactly that box as the one gap;
    sending one piece twice is exactly one overlap over that box and leaves no gap."""
    shape, pieces = case
    counts = np.zeros(shape, dtype=np.int32)  # the oracle: materialise the (small) tensor
    for p in pieces:
        counts[p.slices()] += 1
    assert (counts == 1).all()
    check_cover("w", shape, pieces)

    k = data.draw(st.integers(0, len(pieces) - 1))
    p = pieces[k]
    where = coverage.format_range(p.offsets, p.end)
    dropped = pieces[:k] + pieces[k + 1 :]
    msg = error("w", shape, dropped)
    if dropped:
        assert f"(1 gap, {p.numel} of {counts.size} elements uncovered):" in msg
        assert msg.splitlines()[1] == f"  gap: no rank sent {'rows ' + where if shape else 'the 0-d value'}"
        assert "overlap" not in msg
    else:
        assert msg == f"tensor 'w': no rank sent any part of it (global shape {list(shape)})"

    doubled = [*pieces, p]
    msg = error("w", shape, doubled)
    assert "(1 overlap):" in msg
    what = f"rows {where}" if shape else "the 0-d value"
    assert msg.splitlines()[1] == f"  overlap: rank {p.rank} sent {what} in two pieces"
    assert "gap" not in msg


# --- cost: no pairwise work on a hostile declaration ---------------------------------------------


def lines_run(fn: Callable[[], object]) -> int:
    """How many Python lines of sidecar/ ran while ``fn`` ran: a count of work that the machine's
    load cannot skew (C code, sorting and heaps, is not counted: it is n log n)."""
    root = str(Path(coverage.__file__).resolve().parents[1])
    count = 0

    def local(frame, event, arg):
        nonlocal count
        count += event == "line"
        return local

    def calls(frame, event, arg):
        return local if frame.f_code.co_filename.startswith(root) else None

    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        fn()
    finally:
        sys.settrace(previous)
    return count


def test_many_identical_pieces_cost_n_log_n_and_the_report_stays_short() -> None:
    """n copies of one piece: each overlaps the first one open, so the sweep makes about n
    comparisons (the pairwise report made n^2 / 2: 8k pieces held the serve loop 13.4 s). Counted
    in lines of Python run: 8x the pieces may cost at most 16x the work (quadratic would be 64x)."""
    work = {}
    for n in (2048, 16384):
        pieces = [Piece(0, (0, 0), (4, 8))] * n + [Piece(1, (4, 0), (4, 8))]
        count, pairs, exact = coverage._overlaps(pieces, keep=coverage.MAX_LISTED)
        assert (count, exact) == (n - 1, True) and pairs == [(0, j) for j in range(1, 6)]
        msgs = []
        work[n] = lines_run(lambda: msgs.append(error("w", (8, 8), pieces)))  # noqa: B023 (run at once)
        (msg,) = msgs
        assert f"({n - 1} overlaps):" in msg and msg.count("  overlap: rank 0 sent") == 5
        assert f"  ... and {n - 6} more overlaps\n" in msg and len(msg) < 1024
    assert work[16384] < 16 * work[2048], work


def staircase(n: int) -> list[Piece]:
    """An exact cover of (n, n) by columns cut at the diagonal: along dim 0 every upper piece stays
    open while the lower ones start, without touching them (n^2 / 2 comparisons for a plain sweep)."""
    lower = [Piece(0, (i, i), (n - i, 1)) for i in range(n)]
    upper = [Piece(1, (0, j), (j, 1)) for j in range(1, n)]
    return upper + lower


def test_a_sweep_over_budget_decides_on_the_grid() -> None:
    n = 1000
    pieces = staircase(n)
    count, _, exact = coverage._overlaps(pieces, keep=0)
    assert (count, exact) == (0, False)  # stopped at its budget, not after n^2 / 2 comparisons
    check_cover("w", (n, n), pieces)  # decided exactly on the grid instead
    doubled = [*pieces, Piece(2, (0, 5), (3, 1))]
    msg = error("w", (n, n), [p for p in doubled if p.offsets != (0, 7)])
    assert "(at least 1 overlap; 1 gap, 7 of 1000000 elements uncovered):" in msg
    assert "  gap: no rank sent rows [0, 7) x [7, 8)\n" in msg
