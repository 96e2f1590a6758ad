"""A step whose ranks declare exactly what the last checked step declared takes that step's
declarations over (sidecar.daemon.step.Skeleton): no row parsed or checked again, every arrival
still tracked per step, and anything that differs (a row, the rank order, the plan, a lowered
max_step_pieces) declares and checks for real, with the same errors as without it."""

from __future__ import annotations

import msgpack
import pytest
import torch

from sidecar.daemon.step import StepState, begin_rows
from sidecar.daemon.tracker import CoverageTracker
from sidecar.errors import ErrorKind, RefitError
from sidecar.plan.build import RefitPlan, RefitSpec, TensorSpec
from transport.wire import ProtocolError

N = 6


def rows_of(rank: int, world: int = 2, n: int = N, rows: int = 8) -> list:
    """Rank ``rank``'s rows: ``n`` tensors [rows, 4] bf16, split by rows across ``world`` ranks."""
    part = rows // world
    return [[f"t.{i}.weight", "bfloat16", [rows, 4], [rank * part, 0], [part, 4]] for i in range(n)]


def plan_of(n: int = N, rows: int = 8) -> RefitPlan:
    specs = [TensorSpec(f"t.{i}.weight", torch.bfloat16, (rows, 4)) for i in range(n)]
    return RefitPlan.build(specs, RefitSpec(model_type="qwen3_moe", fmt="bf16"))


def packed(rows: list) -> bytes:
    return msgpack.packb(rows, use_bin_type=True)


def run_step(step: int, begins: list, plan: RefitPlan, skeleton=None, max_pieces: int = 1 << 20) -> StepState:
    """A step's BEGINs (``(rank, pieces)`` in order), settled and checked like Trainers._all_begun."""
    state = StepState(step, 2, float("inf"), max_pieces=max_pieces, skeleton=skeleton)
    for rank, pieces in begins:
        state.begin(rank, pieces)
    state.settle(plan)
    state.validate_against(plan)
    return state


def receive_all(state: StepState) -> list[str]:
    done = []
    for rank in (0, 1):
        for pid in state.piece_ids(rank):
            name = state.piece_received(rank, pid)
            if name:
                done.append(name)
    return done


def test_the_same_begins_take_the_skeleton_over_with_arrivals_of_their_own():
    plan = plan_of()
    begins = [(0, packed(rows_of(0))), (1, packed(rows_of(1)))]
    first = run_step(1, begins, plan)
    assert not first.settled
    skeleton = first.skeleton_for(plan)
    assert receive_all(first) == [f"t.{i}.weight" for i in range(N)]

    second = run_step(2, [(0, packed(rows_of(0))), (1, packed(rows_of(1)))], plan, skeleton)
    assert second.settled and second.skeleton_for(plan) is skeleton
    assert second.piece_ids(0) == first.piece_ids(0) and second.pieces == first.pieces
    assert second.tracker is not first.tracker
    assert not second.tracker.tensor_complete("t.0.weight")  # nothing arrived in this step yet
    assert second.tracker.incomplete(1)  # every piece of rank 1 still missing
    assert second.tracker.complete() == []
    assert receive_all(second) == [f"t.{i}.weight" for i in range(N)]
    assert second.tracker.complete() == [f"t.{i}.weight" for i in range(N)]
    assert second.bytes_in == first.bytes_in == N * 8 * 4 * 2
    with pytest.raises(RefitError, match="already arrived") as err:
        second.piece_received(0, second.piece_ids(0)[0])  # said twice: refused as ever
    assert err.value.kind is ErrorKind.PROTOCOL
    third = run_step(3, begins, plan, skeleton)  # the template was not touched by step 2
    assert third.settled and not third.tracker.tensor_complete("t.0.weight")
    with pytest.raises(RuntimeError, match="shares its declarations"):
        third.tracker.declare("x", (1,), first.tracker._tensors["t.0.weight"].pieces[0], 2)


def test_rows_sent_as_lists_follow_too_but_never_match_bytes():
    plan = plan_of()
    skeleton = run_step(1, [(0, rows_of(0)), (1, rows_of(1))], plan).skeleton_for(plan)
    assert run_step(2, [(0, rows_of(0)), (1, rows_of(1))], plan, skeleton).settled
    mixed = run_step(3, [(0, packed(rows_of(0))), (1, rows_of(1))], plan, skeleton)
    assert not mixed.settled and receive_all(mixed)  # declared and checked for real


@pytest.mark.parametrize(
    "swap, message",
    [
        (lambda v: float(v), "offsets is a list of 2, expected a list of ints"),  # 0 -> 0.0: 0.0 == 0
        (lambda v: bool(v), "offsets is a list of 2, expected a list of ints"),  # 0 -> False, 1 -> True
    ],
    ids=["float-offset", "bool-offset"],
)
def test_list_rows_equal_by_value_but_not_by_type_are_checked_for_real(swap, message):
    """Rows sent as lists follow the skeleton only when they are the same type for type: an offset
    of ``0.0`` (or ``False``) equals ``0`` by ``==``, and a first step refuses it; a following step
    must refuse it too (issue 21, case 4)."""
    plan = plan_of()
    first = run_step(1, [(0, rows_of(0)), (1, rows_of(1))], plan)
    skeleton = first.skeleton_for(plan)
    bad = rows_of(0)
    bad[0][3] = [swap(v) for v in bad[0][3]]  # rank 0's offsets are [0, 0]
    assert bad == rows_of(0)  # equal by value: what the skeleton compared
    with pytest.raises(ProtocolError, match=message):
        run_step(2, [(0, bad), (1, rows_of(1))], plan, skeleton)
    with pytest.raises(ProtocolError, match=message):  # as on a first step
        run_step(2, [(0, bad), (1, rows_of(1))], plan)


def test_a_later_rank_that_differs_declares_the_followed_ones_for_real():
    plan = plan_of()
    skeleton = run_step(1, [(0, packed(rows_of(0))), (1, packed(rows_of(1)))], plan).skeleton_for(plan)
    other = rows_of(1)
    other[2][1] = "float32"  # a dtype the plan does not expect
    with pytest.raises(RefitError) as err:
        run_step(2, [(0, packed(rows_of(0))), (1, packed(other))], plan, skeleton)
    assert err.value.kind is ErrorKind.INVALID
    assert "tensor 't.2.weight'" in str(err.value)


def test_another_rank_order_declares_for_real_and_still_publishes():
    plan = plan_of()
    skeleton = run_step(1, [(0, packed(rows_of(0))), (1, packed(rows_of(1)))], plan).skeleton_for(plan)
    swapped = run_step(2, [(1, packed(rows_of(1))), (0, packed(rows_of(0)))], plan, skeleton)
    assert not swapped.settled
    assert swapped.piece_ids(1) == list(range(N))  # ids in this step's BEGIN order
    assert receive_all(swapped) == [f"t.{i}.weight" for i in range(N)]
    # the skeleton of that order is the one the next step follows
    again = run_step(3, [(1, packed(rows_of(1))), (0, packed(rows_of(0)))], plan, swapped.skeleton_for(plan))
    assert again.settled


def test_a_coverage_problem_is_found_even_when_one_rank_followed():
    plan = plan_of()
    skeleton = run_step(1, [(0, packed(rows_of(0))), (1, packed(rows_of(1)))], plan).skeleton_for(plan)
    overlapping = rows_of(1)
    overlapping[4][3] = [2, 0]  # rows [2, 6) of t.4: overlaps rank 0's [0, 4)
    with pytest.raises(RefitError, match=r"t\.4\.weight") as err:
        run_step(2, [(0, packed(rows_of(0))), (1, packed(overlapping))], plan, skeleton)
    assert err.value.kind is ErrorKind.COVERAGE


def test_another_plan_or_a_lower_max_step_pieces_checks_again():
    plan = plan_of()
    begins = [(0, packed(rows_of(0))), (1, packed(rows_of(1)))]
    skeleton = run_step(1, begins, plan).skeleton_for(plan)
    bigger = plan_of(N + 1)  # one tensor more: nobody sent it
    with pytest.raises(RefitError, match=r"'t\.6\.weight': no rank sent any part of it"):
        run_step(2, begins, bigger, skeleton)
    with pytest.raises(RefitError, match="over max_step_pieces=10") as err:
        run_step(3, begins, plan, skeleton, max_pieces=10)
    assert err.value.kind is ErrorKind.INVALID


def test_a_refused_begin_is_not_a_key_and_the_corrected_one_follows():
    plan = plan_of()
    skeleton = run_step(1, [(0, packed(rows_of(0))), (1, packed(rows_of(1)))], plan).skeleton_for(plan)
    state = StepState(2, 2, float("inf"), skeleton=skeleton)
    state.begin(0, packed(rows_of(0)))
    bad = rows_of(1)
    bad[0][2] = [8, "4"]
    with pytest.raises(ProtocolError, match="global_shape is a list of 2, expected a list of ints"):
        state.begin(1, packed(bad))
    assert list(state.declared) == [0] and state.followed == 0  # rank 0 declared for real now
    state.begin(1, packed(rows_of(1)))
    state.settle(plan)
    state.validate_against(plan)
    assert not state.settled and receive_all(state) == [f"t.{i}.weight" for i in range(N)]


@pytest.mark.parametrize(
    ("pieces", "message"),
    [
        (b"\xc1", "BEGIN pieces holds 1 bytes that are not msgpack"),
        (msgpack.packb({"a": 1}), "BEGIN pieces packs a dict, expected a list of"),
        (7, "BEGIN pieces is a int, expected a list of"),
        ("rows", "BEGIN pieces is a str, expected a list of"),
    ],
)
def test_begin_rows_refuses_what_is_not_rows(pieces, message):
    with pytest.raises(ProtocolError, match=message):
        begin_rows(3, pieces)
    assert begin_rows(3, packed(rows_of(0))) == rows_of(0)


def test_a_fresh_tracker_shares_declarations_but_not_arrivals_or_forgets():
    state = run_step(1, [(0, packed(rows_of(0))), (1, packed(rows_of(1)))], plan_of())
    template = state.tracker.fresh()
    one, two = template.fresh(), template.fresh()
    one.received("t.0.weight", 0)
    assert one.incomplete(0) != two.incomplete(0)
    one.forget(["t.1.weight"])
    assert two.tensor_complete("t.1.weight") is False and "t.1.weight" in str(two.incomplete())
    assert isinstance(template, CoverageTracker) and len(template) == len(two) == 2 * N
