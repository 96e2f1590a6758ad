"""The serve loop composed (issue 12): one routing table with the role checked once before any
handler, decisions by exception type (not by error text), per-step state dropped with the step."""

from __future__ import annotations

import msgpack
import pytest
import torch
import zmq
from support.daemons import RunningDaemon

from sidecar.cli.demo.synthetic import make_hf_config, make_state_dict
from sidecar.client.client import RefitClient
from sidecar.daemon import step_plan
from sidecar.daemon.memory.generations import Arenas
from sidecar.daemon.memory.staging import ArenaTooSmall
from sidecar.errors import ErrorKind, RefitError
from sidecar.plan.build import RefitPlan, RefitSpec, plan_from_hf_config
from sidecar.protocol.enums import Mover, PeerRole, WaitMode
from transport.wire import PROTOCOL_VERSION, HeaderTooLarge, Kind, Limits, Message, decode, encode

MODEL = dict(num_layers=2, num_experts=2)
REPLY_S = 20.0


def ask(endpoint: str, kind: Kind, fields: dict) -> Message:
    """One request from a peer that never introduced itself; its answer, within REPLY_S."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        header = msgpack.packb(
            {"v": PROTOCOL_VERSION, "k": int(kind), "n": 0, "f": fields}, use_bin_type=True
        )
        sock.send_multipart([header])
        if not sock.poll(int(REPLY_S * 1000)):
            raise AssertionError(f"no answer to {kind.name} within {REPLY_S:.0f} s")
        return decode(sock.recv_multipart(copy=False), Limits(max_header_bytes=64 << 20))
    finally:
        sock.close(linger=0)
        ctx.term()


@pytest.fixture
def daemon(tmp_path):
    d = RunningDaemon(tmp_path, hf_config=make_hf_config("qwen3_5_moe", **MODEL), world_size=1)
    yield d
    d.close()


def test_every_request_has_one_route_and_no_reply_kind_has_one(daemon):
    routes = daemon.daemon.routes
    replies = {
        Kind.WELCOME, Kind.READY, Kind.CREDIT, Kind.ACK, Kind.RESULT, Kind.LOADED, Kind.PULLED,
        Kind.SLOT, Kind.ERROR, Kind.PONG, Kind.ATTACHED, Kind.GENERATION, Kind.STATUS_REPLY,
        Kind.FORWARD_READY, Kind.FORWARDED, Kind.REVOKED,
        Kind.STREAM, Kind.GROUP, Kind.STREAM_FAILED,  # the daemon's streamed-refit notices to readers
    }  # fmt: skip
    assert set(routes) == set(Kind) - replies
    assert {k for k, (role, _) in routes.items() if role is PeerRole.READER} == {Kind.WAIT, Kind.RELEASE}
    assert {k for k, (role, _) in routes.items() if role is PeerRole.TRAINER} == {
        Kind.BEGIN, Kind.PIECE_DONE, Kind.SHARD, Kind.COMMIT, Kind.ABORT,
    }  # fmt: skip


@pytest.mark.timeout(60)
def test_release_from_a_peer_that_never_attached_is_unknown_peer_like_wait(daemon):
    """RELEASE used to check nothing (a silent no-op) while WAIT asked the peer to attach: both now
    need an attached reader, checked once by the loop, and both say ATTACH first."""
    for kind, fields in ((Kind.WAIT, {"min_step": 1}), (Kind.RELEASE, {"generation": 0, "step": 0})):
        reply = ask(daemon.endpoint, kind, fields)
        assert reply.kind is Kind.ERROR, (kind, reply)
        err = RefitError.from_wire(reply.fields)
        assert err.kind is ErrorKind.UNKNOWN_PEER and "ATTACH first" in err.message, (kind, err)
    assert daemon.status()["message_errors"].get("unknown_peer") == 2


@pytest.mark.timeout(60)
def test_a_reader_cannot_begin_a_step(daemon):
    reply = ask(daemon.endpoint, Kind.BEGIN, {"step": 0, "rank": 0, "pieces": []})
    err = RefitError.from_wire(reply.fields)
    assert err.kind is ErrorKind.UNKNOWN_PEER and "say HELLO first" in err.message


@pytest.mark.timeout(60)
def test_a_plan_error_that_mentions_an_arena_is_invalid_not_capacity(tmp_path, monkeypatch):
    """The kind comes from the exception's type: a plan-building ValueError is INVALID whatever it
    says (it used to be CAPACITY whenever its text held the word "arena")."""

    def refuse(*args, **kwargs):
        raise ValueError("tensor 'model.arena_embed.weight' has no rule in the model's plan")

    monkeypatch.setattr(step_plan.RefitPlan, "build", refuse)
    d = RunningDaemon(tmp_path, model_type="qwen3_5_moe", staging_bytes=1 << 20, publish_bytes=1 << 20)
    try:
        with RefitClient(d.endpoint, 0, 1, timeout=REPLY_S) as c, pytest.raises(RefitError) as err:
            c.push_step(0, {"model.arena_embed.weight": torch.zeros(4, dtype=torch.bfloat16)})
        assert err.value.kind is ErrorKind.INVALID, err.value
        assert d.status()["step_in_progress"] is None and d.status()["plan"] is None  # asked of the loop
    finally:
        d.close()


@pytest.mark.timeout(60)
def test_arenas_too_small_for_the_plan_is_capacity(tmp_path):
    """Arenas too small for the plan the first step fixes: CAPACITY, from ArenaTooSmall."""
    d = RunningDaemon(tmp_path, model_type="qwen3_5_moe", staging_bytes=4096, publish_bytes=4096)
    try:
        with RefitClient(d.endpoint, 0, 1, timeout=REPLY_S) as c, pytest.raises(RefitError) as err:
            c.push_step(0, make_state_dict("qwen3_5_moe", seed=1, **MODEL))
        assert err.value.kind is ErrorKind.CAPACITY and "arena" in err.value.message, err.value
        assert d.status()["step_in_progress"] is None  # asked of the loop, after it dropped the step
    finally:
        d.close()


def test_apply_plan_raises_arena_too_small_for_arenas_and_for_ring_regions():
    plan = plan_from_hf_config(
        make_hf_config("qwen3_5_moe", **MODEL), RefitSpec(model_type="qwen3_5_moe", fmt="block_fp8")
    )
    for regions in (0, 2):
        arenas = Arenas(
            f"refitd-test-small-{regions}", staging_bytes=4096, publish_bytes=4096, staging_regions=regions
        )
        try:
            with pytest.raises(ArenaTooSmall, match="bytes"):
                arenas.apply_plan(plan)
        finally:
            arenas.close()
    assert issubclass(ArenaTooSmall, ValueError) and isinstance(plan, RefitPlan)


def test_a_header_over_the_limit_is_its_own_protocol_error():
    frames = encode(Message(Kind.PING, {"pad": "x" * 4096}))
    with pytest.raises(HeaderTooLarge, match="exceeds the limit of 1024"):
        decode(frames, Limits(max_header_bytes=1024))


def test_wait_modes_and_movers_are_converted_once_at_the_edge():
    assert WaitMode.of({}) == (WaitMode.LATEST, None)
    assert WaitMode.of({"min_step": 3}) == (WaitMode.AT_LEAST, 3)
    assert WaitMode.of({"min_step": 3, "cancel": True}) == (WaitMode.CANCEL, None)
    with pytest.raises(ValueError, match="min_step must be an integer or nil"):
        WaitMode.of({"min_step": "3"})
    assert Mover.parse("nixl+zmq") is Mover.NIXL_ZMQ and Mover.parse("carrier pigeon") is None
    assert Mover.parse([1]) is None


@pytest.mark.timeout(60)
def test_a_failed_step_leaves_no_step_state_behind_and_the_next_publishes(daemon):
    """Ending a step is dropping its StepState: target, deferred and parked units go with it."""
    sd = make_state_dict("qwen3_5_moe", seed=3, **MODEL)
    with RefitClient(daemon.endpoint, 0, 1, timeout=REPLY_S) as c:
        bad = dict(sd)
        name = next(n for n, t in bad.items() if t.is_floating_point() and t.dim() == 2)
        bad[name] = torch.full_like(bad[name], float("nan"))
        with pytest.raises(RefitError) as err:
            c.push_step(1, bad)
        assert err.value.kind is ErrorKind.NON_FINITE
        assert daemon.status()["step_in_progress"] is None
        assert c.push_step(2, sd).step == 2
    status = daemon.status()
    assert status["step_in_progress"] is None and status["last_step"] == 2
