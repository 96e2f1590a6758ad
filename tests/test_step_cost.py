"""The per-tensor paths of a step of many small tensors (issue 36): the client's strided copy of
evenly spaced small pieces into shared-memory staging, the daemon's PIECE_DONE of sole whole pieces
recorded at once, the units they make ready, and the span table's split reused. Behaviour only: the
same bytes and the same errors as the one-by-one paths (no timing assertions)."""

from __future__ import annotations

import pytest
import torch

from sidecar.client import local as local_mod
from sidecar.client import pieces as pieces_mod
from sidecar.daemon import pipeline as pipeline_mod
from sidecar.daemon.spans import SpanTable
from sidecar.daemon.step import StepState
from sidecar.daemon.tracker import CoverageTracker
from sidecar.errors import ErrorKind, RefitError
from sidecar.plan.build import RefitPlan, RefitSpec, TensorSpec
from transport.layout import Layout
from transport.shm import ShmArena, segment_name
from transport.wire import Kind

N = 40


# ---- the client: evenly spaced small pieces in one strided copy


@pytest.fixture
def staging():
    layout = Layout.build((f"w{i}", torch.bfloat16, (4, 4)) for i in range(N))
    arena = ShmArena.create(segment_name("refitd-test", "stepcost"), layout)
    try:
        yield arena
    finally:
        arena.close()
        arena.unlink()


def writer_into(arena, sent):
    def send(kind, fields, frames=()):
        assert kind is Kind.PIECE_DONE
        sent.extend(fields["pieces"])

    link = pieces_mod.Link(
        send=send, keepalive=lambda *a: None, poll=lambda step, timeout: None, heartbeat=lambda: 1.0
    )
    writer = local_mod.StagingWriter(link)
    writer.arena = arena
    writer.open = lambda handle: None
    return writer


@pytest.fixture
def foreach_count(monkeypatch):
    """How many tensors went through torch._foreach_copy_."""
    counted = [0]
    real = torch._foreach_copy_

    def counting(dsts, srcs):
        counted[0] += len(dsts)
        return real(dsts, srcs)

    monkeypatch.setattr(torch, "_foreach_copy_", counting)
    return counted


def test_views_of_one_buffer_go_as_one_strided_copy(staging, foreach_count):
    """Views of one flat buffer into their 256-byte-aligned staging slots (32 bytes each): no
    foreach copy, one strided copy, the same bytes in every slot; a second step the same."""
    flat = torch.randn(N * 16).bfloat16()
    named = {f"w{i}": flat[i * 16 : (i + 1) * 16].view(4, 4) for i in range(N)}
    pieces = pieces_mod.pieces(named)
    sent: list[int] = []
    writer = writer_into(staging, sent)
    writer.write_step(0, pieces, list(range(N)), {}, float("inf"))
    assert foreach_count[0] == 0
    assert sent == list(range(N))
    for name, t in named.items():
        assert torch.equal(staging.tensor(name), t), name
    flat.copy_(torch.randn(N * 16).bfloat16())  # the trainer's next values, in place
    writer.write_step(1, pieces, list(range(N)), {}, float("inf"))
    assert foreach_count[0] == 0
    for name, t in named.items():
        assert torch.equal(staging.tensor(name), t), name


def test_a_source_moved_since_the_plan_is_copied_one_by_one(staging, foreach_count):
    """The plan is kept across steps; a trainer that swapped one tensor's storage (``p.data =``) or
    made it a transposed view of the same bytes gets that run copied tensor by tensor, right."""
    flat = torch.randn(N * 16).bfloat16()
    params = [
        torch.nn.Parameter(flat[i * 16 : (i + 1) * 16].view(4, 4), requires_grad=False) for i in range(N)
    ]
    named = {f"w{i}": p for i, p in enumerate(params)}
    pieces = pieces_mod.pieces(named)
    writer = writer_into(staging, [])
    writer.write_step(0, pieces, list(range(N)), {}, float("inf"))
    assert foreach_count[0] == 0
    params[3].data = torch.randn(4, 4).bfloat16()  # elsewhere now
    params[7].data = params[7].data.t()  # the same first byte, not contiguous
    writer.write_step(1, pieces, list(range(N)), {}, float("inf"))
    assert foreach_count[0] == N  # the run held both: all of it one by one
    for i, p in enumerate(params):
        assert torch.equal(staging.tensor(f"w{i}"), p.data), i


def test_uneven_or_mixed_sources_keep_the_foreach_copy(staging, foreach_count):
    """Separate tensors (no common pitch in one storage) go through the foreach copy as before."""
    named = {f"w{i}": torch.randn(4, 4).bfloat16() for i in range(N)}
    pieces = pieces_mod.pieces(named)
    writer_into(staging, []).write_step(0, pieces, list(range(N)), {}, float("inf"))
    for name, t in named.items():
        assert torch.equal(staging.tensor(name), t), name
    assert foreach_count[0] == N


# ---- the daemon: PIECE_DONE of sole whole pieces at once


def begun(n: int = N, world_size: int = 1) -> StepState:
    state = StepState(0, world_size, float("inf"))
    state.begin(0, [[f"w{i}", "bfloat16", [4, 4], [0, 0], [4, 4]] for i in range(n)])
    return state


def test_a_batch_of_sole_pieces_is_recorded_without_the_per_piece_loop(monkeypatch):
    state = begun()

    def per_piece(*a):
        raise AssertionError("the per-piece loop ran")

    monkeypatch.setattr(CoverageTracker, "received_whole", per_piece)
    assert state.pieces_done(0, list(range(10))) == [f"w{i}" for i in range(10)]
    assert state.pieces_done(0, list(range(10, N))) == [f"w{i}" for i in range(10, N)]
    assert state.bytes_in == N * 32 and state.complete == {f"w{i}" for i in range(N)}
    assert state.phases.all_received and not state.tracker.incomplete()


@pytest.mark.parametrize(
    "ids, match, kind, recorded",
    [
        ([0, 1, 1], r"elements \[0, 16\) of that piece .* already arrived", ErrorKind.PROTOCOL, 2),
        ([0, 1, N], f"piece {N}, which it did not declare", ErrorKind.PROTOCOL, 2),
        ([0, -1], "piece -1, which it did not declare", ErrorKind.PROTOCOL, 1),
        ([0, True], "piece <bool>, which it did not declare", ErrorKind.PROTOCOL, 1),
        ([0, None], "piece <NoneType>, which it did not declare", ErrorKind.PROTOCOL, 1),
    ],
)
def test_a_refused_batch_records_the_pieces_before_and_says_what_is_wrong(ids, match, kind, recorded):
    state = begun()
    with pytest.raises(RefitError, match=match) as info:
        state.pieces_done(0, ids)
    assert info.value.kind is kind
    assert state.tracker.complete() == [f"w{i}" for i in range(recorded)]  # the step fails next


def test_a_piece_named_again_in_a_later_batch_is_refused():
    state = begun()
    state.pieces_done(0, [0, 1, 2])
    with pytest.raises(RefitError, match=r"w2.*already arrived") as info:
        state.pieces_done(0, [3, 2])
    assert info.value.kind is ErrorKind.PROTOCOL
    assert state.tracker.complete() == ["w0", "w1", "w2", "w3"]


def test_pieces_of_another_rank_are_refused():
    state = StepState(0, 2, float("inf"))
    state.begin(0, [[f"w{i}", "bfloat16", [4, 4], [0, 0], [4, 4]] for i in range(4)])
    state.begin(1, [[f"v{i}", "bfloat16", [4, 4], [0, 0], [4, 4]] for i in range(4)])
    with pytest.raises(RefitError, match="rank 0 sent data for piece 5, which it did not declare"):
        state.pieces_done(0, [0, 5])
    assert state.tracker.complete() == ["w0"]


def test_a_later_step_following_the_skeleton_reuses_its_rows():
    plan = RefitPlan.build(
        [TensorSpec(f"w{i}", torch.bfloat16, (4, 4)) for i in range(N)],
        RefitSpec(model_type="qwen3_moe", fmt="bf16"),
    )
    first = begun()
    first.validate_against(plan)
    first.pieces_done(0, list(range(N)))
    skeleton = first.skeleton_for(plan)
    second = StepState(1, 1, float("inf"), skeleton=skeleton)
    second.begin(0, first.keys[0][1])
    second.settle(plan)
    assert second.settled and second.done_rows is first.done_rows
    assert second.pieces_done(0, list(range(N))) == [f"w{i}" for i in range(N)]
    with pytest.raises(RefitError, match="already arrived"):
        second.pieces_done(0, [0])


# ---- the units they make ready, and their spans


def test_sole_ready_marks_units_only_when_all_are_fresh():
    plan = RefitPlan.build(
        [TensorSpec(f"w{i}", torch.bfloat16, (4, 4)) for i in range(4)],
        RefitSpec(model_type="qwen3_moe", fmt="bf16"),
    )
    sole = {inp.name: plan.units_for_input(inp.name)[0] for inp in plan.inputs}
    submitted: set[int] = set()
    units = pipeline_mod._sole_ready(sole, submitted, ["w0", "w1"])
    assert [u.inputs for u in units] == [("w0",), ("w1",)] and submitted == {u.index for u in units}
    assert pipeline_mod._sole_ready(sole, submitted, ["w1", "w2"]) is None  # w1's unit went already
    assert pipeline_mod._sole_ready(sole, submitted, ["w2", "nope"]) is None  # not a sole input
    assert pipeline_mod._sole_ready(sole, submitted, ["w2", "w2"]) is None  # named twice
    assert submitted == {u.index for u in units}  # nothing marked by a refused call


def test_the_span_split_of_the_same_units_is_worked_out_once(monkeypatch):
    specs = [TensorSpec(f"w{i}", torch.bfloat16, (4, 4)) for i in range(8)]
    plan = RefitPlan.build(specs, RefitSpec(model_type="qwen3_moe", fmt="bf16"))
    layout = Layout.build((s.name, s.dtype, s.shape) for s in specs)
    table = SpanTable(plan, layout, layout)
    calls = []
    real = SpanTable._spans
    monkeypatch.setattr(SpanTable, "_spans", lambda self, units: calls.append(1) or real(self, units))
    spans, rest = table.spans(plan.units)
    again, rest2 = table.spans(list(plan.units))
    assert again == spans and rest2 == rest and len(calls) == 1
    assert [m.name for s in spans for m in s.members] == [f"w{i}" for i in range(8)]
    table.spans(plan.units[:4])  # other units: split afresh
    assert len(calls) == 2


# ---- the remote path: one NIXL registration per buffer


def test_views_of_one_buffer_are_registered_as_one_span():
    from sidecar.client.remote import registered_spans

    flat = torch.randn(N * 16).bfloat16()
    views = [flat[i * 16 : (i + 1) * 16] for i in range(N)][::-1]  # any order
    rows = [(t.data_ptr(), t.nbytes) for t in views]
    assert registered_spans(views, rows) == [(flat.data_ptr(), flat.nbytes)]
    apart = [torch.randn(16).bfloat16() for _ in range(3)] + [torch.empty(0)]
    rows = [(t.data_ptr(), t.nbytes) for t in apart]
    assert sorted(registered_spans(apart, rows)) == sorted(rows[:3])  # the empty one: nothing


def test_row_shards_of_one_tensor_past_an_unaligned_batch_start(monkeypatch, foreach_count):
    """Shards of one staged tensor, a batch starting mid-tensor (not on a layout boundary): every
    row lands where it belongs, runs or not."""
    monkeypatch.setattr(pieces_mod, "DONE_BATCH_PIECES", 16)
    layout = Layout.build([("w", torch.bfloat16, (N, 12))])
    arena = ShmArena.create(segment_name("refitd-test", "stepcost"), layout)
    try:
        full = torch.randn(N, 12).bfloat16()
        shards = [pieces_mod.Shard(full[i : i + 1], global_shape=(N, 12), offsets=(i, 0)) for i in range(N)]
        pieces = pieces_mod.pieces({"w": shards})
        sent: list[int] = []
        writer_into(arena, sent).write_step(0, pieces, list(range(N)), {}, float("inf"))
        assert torch.equal(arena.tensor("w"), full) and sent == list(range(N))
        assert foreach_count[0] == 0  # three runs: rows 0-15, 16-31 (from byte 384), 32-39
    finally:
        arena.close()
        arena.unlink()


def test_fresh_views_in_the_same_places_keep_the_strided_copy(staging, foreach_count):
    """A trainer handing over new tensor objects each step (a fresh ``state_dict()``, here views of
    another buffer) in the same places: the kept plan copies them, one strided copy still."""
    writer = writer_into(staging, [])
    for step in range(2):
        flat = torch.randn(N * 16).bfloat16()
        named = {f"w{i}": flat[i * 16 : (i + 1) * 16].view(4, 4) for i in range(N)}
        writer.write_step(step, pieces_mod.pieces(named), list(range(N)), {}, float("inf"))
        for name, t in named.items():
            assert torch.equal(staging.tensor(name), t), (step, name)
    assert foreach_count[0] == 0


# ---- the same batches every step: remembered once


def settled_second(n: int = N) -> tuple[StepState, StepState]:
    """A first step of ``n`` sole pieces checked against its plan, every piece in, and a second
    step that follows it (the usual RL step: the same declarations)."""
    plan = RefitPlan.build(
        [TensorSpec(f"w{i}", torch.bfloat16, (4, 4)) for i in range(n)],
        RefitSpec(model_type="qwen3_moe", fmt="bf16"),
    )
    first = begun(n)
    first.validate_against(plan)
    half = n // 2
    assert first.pieces_done(0, list(range(half))) == [f"w{i}" for i in range(half)]
    first.pieces_done(0, list(range(half, n)))
    second = StepState(1, 1, float("inf"), skeleton=first.skeleton_for(plan))
    second.begin(0, first.keys[0][1])
    second.settle(plan)
    assert second.settled
    return first, second


def test_a_batch_sent_again_next_step_is_recorded_from_the_remembered_one(monkeypatch):
    _, second = settled_second()
    half = N // 2

    def per_batch(*a):
        raise AssertionError("the batch was looked up piece by piece again")

    with monkeypatch.context() as m:
        m.setattr(CoverageTracker, "received_sole", per_batch)
        m.setattr(CoverageTracker, "received_whole", per_batch)
        assert second.pieces_done(0, list(range(half))) == [f"w{i}" for i in range(half)]
    assert second.bytes_in == half * 32 and second.complete == {f"w{i}" for i in range(half)}
    # the same batch again in the same step: refused as before, naming the piece
    with pytest.raises(RefitError, match=r"w0.*already arrived") as info:
        second.pieces_done(0, list(range(half)))
    assert info.value.kind is ErrorKind.PROTOCOL
    # ids that compare equal but are not ints, or another batch under the same first id and
    # length: never taken for the remembered one
    with pytest.raises(RefitError, match="piece <bool>, which it did not declare"):
        second.pieces_done(0, [half, True, *range(half + 2, N)])
    third = StepState(2, 1, float("inf"), skeleton=second.skeleton)
    third.begin(0, second.keys[0][1])
    third.settle(second.skeleton.plan)
    other = [0, *range(half, N)][:half]  # first id 0, length half: the key of a remembered batch
    assert third.pieces_done(0, other) == [f"w{i}" for i in other]
    rest = [i for i in range(N) if i not in other]
    assert third.pieces_done(0, rest) == [f"w{i}" for i in rest]
    assert third.tracker.incomplete() == [] and len(third.complete) == N


def test_remembered_batches_stay_bounded():
    from sidecar.daemon.sole_batches import REMEMBERED_IDS_PER_PIECE, SoleBatches

    batches, n = SoleBatches(), 10
    rows = [(0, f"w{i}", 0, (f"w{i}", 0), 32, True) for i in range(n)]
    for start in range(n):
        for length in range(1, n - start + 1):
            ids = list(range(start, start + length))
            batches.remember(
                (0, start, length), ids, [rows[i] for i in ids], (32 * length, [f"w{i}" for i in ids]), n
            )
            assert batches.held == sum(len(b.ids) for b in batches.values()) <= REMEMBERED_IDS_PER_PIECE * n


def test_the_units_a_batch_makes_ready_are_remembered(monkeypatch):
    plan = RefitPlan.build(
        [TensorSpec(f"w{i}", torch.bfloat16, (4, 4)) for i in range(8)],
        RefitSpec(model_type="qwen3_moe", fmt="bf16"),
    )
    pipe = pipeline_mod.Pipeline(ctx=None)
    sole = pipe._sole_units(plan)
    names = [f"w{i}" for i in range(4)]
    first: set[int] = set()
    units = pipe._sole_batch(sole, first, names)
    assert [u.inputs for u in units] == [(n,) for n in names] and first == {u.index for u in units}

    def per_name(*a):
        raise AssertionError("the batch's units were looked up name by name again")

    monkeypatch.setattr(pipeline_mod, "_sole_ready", per_name)
    second: set[int] = set()
    assert pipe._sole_batch(sole, second, list(names)) == units and second == first
    assert pipe._sole_batch(sole, second, list(names)) is None  # its units went already
    third = {units[2].index}
    assert pipe._sole_batch(sole, third, list(names)) is None and third == {units[2].index}
    monkeypatch.undo()
    other = ["w0", "w5", "w6", "w7"]  # the same first name and length, other names
    assert [u.inputs for u in pipe._sole_batch(sole, set(), other)] == [(n,) for n in other]


def test_sole_ready_compares_no_unit(monkeypatch):
    """A batch's units are told from None by truth, not ``==`` (a dataclass ``__eq__`` in
    Python per unit: most of the time of a PIECE_DONE of small pieces)."""
    from sidecar.plan.build import Unit

    plan = RefitPlan.build(
        [TensorSpec(f"w{i}", torch.bfloat16, (4, 4)) for i in range(4)],
        RefitSpec(model_type="qwen3_moe", fmt="bf16"),
    )
    sole = {inp.name: plan.units_for_input(inp.name)[0] for inp in plan.inputs}

    def compared(self, other):
        raise AssertionError("a unit was compared")

    monkeypatch.setattr(Unit, "__eq__", compared)
    submitted: set[int] = set()
    assert len(pipeline_mod._sole_ready(sole, submitted, ["w0", "w1"])) == 2
    assert pipeline_mod._sole_ready(sole, submitted, ["w2", "nope"]) is None
