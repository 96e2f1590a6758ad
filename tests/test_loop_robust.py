"""The serve loop against hostile or broken peers (issue 11): one message can neither kill the daemon
nor hold its loop; readers that vanish expire; the control socket is private; a held generation
blocking a step is named at once.

The daemon runs in a thread of the test process (its real serve loop, sockets and shared memory);
hostile peers are raw ZeroMQ DEALER sockets speaking the wire protocol, honest ones are the real
``RefitClient`` and ``RefitReader``.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import msgpack
import pytest
import torch
import zmq
from support.daemons import daemon_factory
from support.waiting import wait_until

from adapters.base import Generation, RefitReader
from sidecar.cli.demo.synthetic import make_hf_config, make_state_dict
from sidecar.client.client import RefitClient
from sidecar.errors import ErrorKind, RefitError
from sidecar.plan.build import RefitSpec
from sidecar.plan.run import convert
from transport.wire import PROTOCOL_VERSION, Kind, Limits, decode

MODEL = dict(num_layers=2, num_experts=2)
CONFIG = make_hf_config("qwen3_5_moe", **MODEL)
REPLY_S = 20.0  # a deadline for any answer; an answer that never comes fails the test, it does not hang
DEEP = 1000  # how deep a hostile field nests: deeper than Python's repr and msgpack's packer go
#: an honest HELLO of rank 0 (attempt 1, for step 0)
HELLO = {"rank": 0, "world_size": 1, "pid": 1, "host": "x", "local": False, "attempt": 1, "step": 0}


@pytest.fixture
def start(tmp_path):
    factory = daemon_factory(tmp_path, hf_config=CONFIG, world_size=1)
    yield next(factory)
    next(factory, None)


def nested(depth: int = DEEP) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


class RawPeer:
    """A DEALER socket that sends hand-made headers and reads the daemon's answers with deadlines."""

    def __init__(self, endpoint: str):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send(self, kind: int, fields: object, *, frames: int = 0, version: int = PROTOCOL_VERSION) -> None:
        header = msgpack.packb({"v": version, "k": int(kind), "n": frames, "f": fields}, use_bin_type=True)
        self.sock.send_multipart([header, *([b"x"] * frames)])

    def send_raw(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def recv(self, timeout: float = REPLY_S):
        if not self.sock.poll(int(timeout * 1000)):
            raise AssertionError(f"no answer from the daemon within {timeout:.0f} s (is it still alive?)")
        return decode(self.sock.recv_multipart(copy=False), Limits(max_header_bytes=64 << 20))

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def weights(seed: int) -> dict[str, torch.Tensor]:
    return make_state_dict("qwen3_5_moe", seed=seed, **MODEL)


def publish_and_check(endpoint: str, step: int, seed: int) -> None:
    """An honest rank pushes ``step`` and a reader finds it published byte for byte."""
    sd = weights(seed)
    with RefitClient(endpoint, 0, 1, timeout=REPLY_S) as client:
        result = client.push_step(step, sd)
    assert result.step == step
    expected = convert(sd, RefitSpec(model_type="qwen3_5_moe", fmt="block_fp8"))
    with RefitReader(endpoint, name="check", timeout=REPLY_S) as reader:
        gen = reader.wait(min_step=step)
        try:
            assert gen.step == step and set(gen.tensors) == set(expected)
            for name, value in expected.items():
                got = gen.tensors[name].reshape(-1).view(torch.uint8)
                assert torch.equal(got, value.reshape(-1).view(torch.uint8)), name
        finally:
            reader.release(gen)


# --------------------------------------------------------------------------------------------------
# defect 3: no message kills the daemon


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("kind", "fields"),
    [
        (Kind.BEGIN, {"step": nested(), "rank": 0, "pieces": [["x", "bfloat16", [1], [0], [1]]]}),
        (Kind.COMMIT, {"step": nested()}),
        (Kind.PIECE_DONE, {"step": nested(), "pieces": [0]}),
        (Kind.PING, {"step": nested(), "rank": nested()}),
        (Kind.RELEASE, {"generation": 0, "step": nested()}),
        (Kind.ABORT, {"step": nested(), "reason": nested()}),
        (Kind.HELLO, {"rank": nested(), "world_size": 1}),
        (Kind.HELLO, {**HELLO, "attempt": nested()}),
        (Kind.ATTACH, {"name": nested(), "pid": nested()}),
        (Kind.WAIT, {"min_step": nested()}),
        (Kind.FORWARD_BEGIN, {"step": nested(), "source": nested()}),
    ],
    ids=lambda v: v.name if isinstance(v, Kind) else "",
)
def test_a_deeply_nested_field_is_refused_and_the_daemon_serves_on(start, kind, fields):
    """A ~1 KiB message whose ``step`` (or another field) is a list nested 1000 deep used to make the
    error formatting raise RecursionError inside the serve loop's ``except ProtocolError``, which
    took the daemon down. Now it is answered with an ERROR, the daemon stays up, and an honest step
    publishes byte for byte."""
    d = start()
    publish_and_check(d.endpoint, 1, seed=1)
    peer = RawPeer(d.endpoint)
    try:
        if kind in (Kind.WAIT, Kind.RELEASE):  # a reader's messages: attach first
            peer.send(Kind.ATTACH, {"name": "hostile", "pid": 1})
            assert peer.recv().kind is Kind.ATTACHED
        elif kind not in (Kind.HELLO, Kind.ATTACH):  # a rank's: say HELLO first
            peer.send(Kind.HELLO, HELLO)
            assert peer.recv().kind is Kind.WELCOME
        peer.send(kind, fields)
        reply = peer.recv()
        assert reply.kind is Kind.ERROR, reply
        err = RefitError.from_wire(reply.fields)
        assert err.kind in (ErrorKind.PROTOCOL, ErrorKind.INVALID, ErrorKind.INTERNAL), err
        assert len(err.message) < 2000, "an error quoting a hostile field must be bounded"
        assert reply.fields["step"] is None or isinstance(reply.fields["step"], int)
    finally:
        peer.close()
    assert d.thread.is_alive(), "the serve loop died"
    publish_and_check(d.endpoint, 2, seed=2)
    assert d.status()["live"]["step"] == 2


@pytest.mark.timeout(60)
def test_a_non_integer_step_is_refused_by_type_before_any_handler_uses_it(start):
    """The generic fields are checked before a handler sees them: a step that is not an integer
    (a string, a float, a bool, a map) is a PROTOCOL error that says what the field must be."""
    d = start()
    peer = RawPeer(d.endpoint)
    try:
        peer.send(Kind.HELLO, HELLO)
        assert peer.recv().kind is Kind.WELCOME
        for bad in ("7", 7.0, True, {"a": 1}, [1]):
            peer.send(Kind.COMMIT, {"step": bad})
            reply = peer.recv()
            assert reply.kind is Kind.ERROR
            err = RefitError.from_wire(reply.fields)
            assert (
                err.kind is ErrorKind.PROTOCOL
                and "'step' has type" in err.message
                and "must be an integer" in err.message
            ), err
            assert err.step is None
    finally:
        peer.close()
    publish_and_check(d.endpoint, 1, seed=3)


class _Unprintable(Exception):
    """A bug whose own repr and str fail: the catch-all must still answer."""

    def __repr__(self) -> str:
        raise RecursionError("maximum recursion depth exceeded while getting the repr of an object")

    __str__ = __repr__


@pytest.mark.timeout(60)
def test_a_handler_bug_is_answered_as_internal_counted_and_the_loop_serves_on(start):
    """A handler that raises something whose repr raises too (what a RecursionError in error
    formatting looks like) is answered as an INTERNAL error to the sender, logged with its
    traceback, counted in ``status`` (message_errors), and the loop keeps serving."""
    d = start()
    calls = []

    def broken(identity, msg):
        calls.append(msg.kind)
        raise _Unprintable()

    real = d.daemon.routes[Kind.WAIT]
    d.daemon.routes[Kind.WAIT] = (None, broken)  # any peer: this raw one never attached
    peer = RawPeer(d.endpoint)
    try:
        peer.send(Kind.WAIT, {"min_step": 1})
        reply = peer.recv()
        assert reply.kind is Kind.ERROR
        err = RefitError.from_wire(reply.fields)
        assert err.kind is ErrorKind.INTERNAL and "WAIT" in err.message, err
    finally:
        peer.close()
    d.daemon.routes[Kind.WAIT] = real  # the engines component's own handler again
    assert calls == [Kind.WAIT] and d.thread.is_alive()
    counts = d.status()["message_errors"]
    assert counts.get("internal") == 1, counts
    publish_and_check(d.endpoint, 1, seed=4)


@pytest.mark.timeout(60)
def test_garbage_frames_are_refused_and_counted_by_kind(start):
    """Undecodable headers are PROTOCOL errors, counted by kind; the daemon serves on."""
    d = start()
    peer = RawPeer(d.endpoint)
    try:
        for frames in (
            [b"\xc1"],
            [b""],
            [msgpack.packb([1, 2])],
            [msgpack.packb({"v": 1, "k": 999, "n": 0})],
        ):
            peer.send_raw(*frames)
            reply = peer.recv()
            assert reply.kind is Kind.ERROR
            assert RefitError.from_wire(reply.fields).kind is ErrorKind.PROTOCOL
    finally:
        peer.close()
    assert d.status()["message_errors"].get("protocol") == 4
    publish_and_check(d.endpoint, 1, seed=5)


# --------------------------------------------------------------------------------------------------
# defect 12: the control socket is private whatever the umask


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tcp", [False, True], ids=["ipc", "tcp+local-ipc"])
def test_control_socket_is_0600_under_umask_0(start, tcp, free_tcp_port):
    """Under ``umask 0`` bind(2) makes the socket file 0777; the daemon narrows it to 0600 (both
    the ipc:// listen socket and the local ipc:// socket beside a tcp:// listen)."""
    old = os.umask(0)
    try:
        d = start(listen=f"tcp://127.0.0.1:{free_tcp_port}") if tcp else start()
    finally:
        os.umask(old)
    path = Path(d.config.runtime_dir) / "control.sock"
    st = os.lstat(path)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600, oct(stat.S_IMODE(st.st_mode))
    publish_and_check(d.endpoint, 1, seed=6)


@pytest.fixture
def free_tcp_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------------------
# defect 11: readers heartbeat; one that vanishes without DETACH expires


def _status_without(d, reader: str) -> dict | None:
    status = d.status()
    return None if reader in status["readers"] else status


@pytest.mark.timeout(90)
def test_a_reader_that_vanishes_without_detach_expires_and_loses_its_hold(start):
    """A reader attaches, is handed step 1's generation and holds it, then its socket closes without
    DETACH (the process died). After reader_timeout_s of silence the daemon drops it: the hold goes,
    it leaves ``status``, and the steps that need its generation publish. A real RefitReader that
    attached first and then sat idle all along keeps its place: it heartbeats from a thread."""
    d = start(reader_timeout_s=1.0, heartbeat_interval_s=0.2)
    publish_and_check(d.endpoint, 1, seed=11)
    alive = RefitReader(d.endpoint, name="idle-engine", timeout=REPLY_S)
    peer = RawPeer(d.endpoint)
    try:
        alive.attach()
        assert alive.attach_info["heartbeat_interval_s"] <= 0.25
        peer.send(Kind.ATTACH, {"name": "vanishing", "pid": 4242})
        assert peer.recv().kind is Kind.ATTACHED
        peer.send(Kind.WAIT, {"min_step": 1})
        handed = peer.recv()
        assert handed.kind is Kind.GENERATION
        held = handed.fields["generation"]
        status = d.status()
        assert set(status["readers"]) == {"idle-engine", "vanishing"}
        assert status["generations"][held]["holders"] == 1
        peer.close()  # gone, without a DETACH

        status = wait_until(
            "the vanished reader expired", lambda: _status_without(d, "vanishing"), timeout=REPLY_S
        )
        assert status["generations"][held]["holders"] == 0
        assert status["readers"] == ["idle-engine"], "an idle reader that heartbeats must not expire"
        for step in (2, 3):  # step 3 is written into the generation the vanished reader held
            publish_and_check(d.endpoint, step, seed=10 + step)
        gen = alive.wait(min_step=3)
        assert gen.step == 3
        alive.release(gen)
        assert "idle-engine" in d.status()["readers"]
    finally:
        alive.close()


# --------------------------------------------------------------------------------------------------
# defect 14: a held generation blocking a step is named at once


def push_ranks(endpoint: str, step: int, sd: dict, world: int, timeout: float = REPLY_S) -> list:
    """Each rank pushes every ``world``-th tensor at once; its StepResult or RefitError, by rank."""
    names = sorted(sd)
    clients = [RefitClient(endpoint, r, world, timeout=timeout) for r in range(world)]
    try:
        futures = [
            c.push_step_async(step, {n: sd[n] for n in names[c.rank :: world]}, timeout=timeout)
            for c in clients
        ]
        out = []
        for f in futures:
            try:
                out.append(f.result(timeout=timeout + 10))
            except RefitError as exc:
                out.append(exc)
        return out
    finally:
        for c in clients:
            c.close()


def hold_two_generations(d, reader: RefitReader) -> Generation:
    """Step 1 published and held by ``reader``; step 2 published into the other generation. The
    next step must be written into the held one; returns the held generation."""
    assert all(not isinstance(r, Exception) for r in push_ranks(d.endpoint, 1, weights(21), 2))
    gen = reader.wait(min_step=1)
    assert all(not isinstance(r, Exception) for r in push_ranks(d.endpoint, 2, weights(22), 2))
    assert d.status()["live"]["generation"] != gen.index
    return gen


@pytest.mark.timeout(120)
def test_a_held_generation_that_would_outlast_the_step_fails_it_at_once_naming_the_reader(start):
    """A live reader holds step 1's generation; step 2 went into the other one. Step 3 needs the held
    one, and the hold would be dropped only after reader_timeout_s (120 s), past the step's own
    timeout (60 s). Both ranks used to wait the whole step timeout for "it was not complete"; now
    both fail at once with BUSY naming the reader and the generation. Released, step 4 publishes."""
    d = start(world_size=2, step_timeout_s=60.0, reader_timeout_s=120.0)
    with RefitReader(d.endpoint, name="slow-engine", timeout=REPLY_S) as reader:
        gen = hold_two_generations(d, reader)
        results = push_ranks(d.endpoint, 3, weights(23), 2, timeout=20.0)
        for err in results:
            assert isinstance(err, RefitError) and err.kind is ErrorKind.BUSY, err
            assert "'slow-engine'" in err.message and f"generation {gen.index}" in err.message, err.message
            assert "reader_timeout_s=120" in err.message and "step_timeout_s=60" in err.message
        reader.release(gen)
        assert all(not isinstance(r, Exception) for r in push_ranks(d.endpoint, 4, weights(24), 2))
    assert d.status()["live"]["step"] == 4


@pytest.mark.timeout(120)
def test_a_held_generation_is_named_in_status_while_the_step_waits_then_dropped(start):
    """With reader_timeout_s (1.5 s) inside the step's time, the step waits for the reader as
    documented: meanwhile ``status`` names the blocking reader, the generation and the step it
    holds; after reader_timeout_s the hold is dropped and the step publishes into that generation."""
    d = start(world_size=2, step_timeout_s=60.0, reader_timeout_s=1.5)
    with RefitReader(d.endpoint, name="slow-engine", timeout=REPLY_S) as reader:
        gen = hold_two_generations(d, reader)
        clients = [RefitClient(d.endpoint, r, 2, timeout=REPLY_S) for r in range(2)]
        try:
            sd, names = weights(23), sorted(weights(23))
            futures = [c.push_step_async(3, {n: sd[n] for n in names[c.rank :: 2]}) for c in clients]
            blocked = wait_until(
                "status names the blocking reader", lambda: d.status()["blocked"], timeout=REPLY_S
            )
            assert blocked["step"] == 3 and blocked["generation"] == gen.index and blocked["holds_step"] == 1
            assert any("'slow-engine'" in r for r in blocked["readers"]), blocked
            held_by = d.status()["generations"][gen.index]["held_by"]
            assert any("'slow-engine'" in r for r in held_by) or futures[0].done(), held_by
            results = [f.result(timeout=REPLY_S) for f in futures]
        finally:
            for c in clients:
                c.close()
        assert all(r.generation == gen.index for r in results)
        status = d.status()
        assert status["blocked"] is None and status["generations"][gen.index]["holders"] == 0
        assert "slow-engine" in status["readers"], "the reader is alive: only its hold was dropped"


@pytest.mark.timeout(90)
def test_an_engine_load_report_with_a_hostile_error_is_quoted_bounded(start):
    """An engine worker acknowledges a step with ok=False, an ``error`` nested 1000 deep and a
    ``seconds`` that is not a number. The LOADED report quotes the error in bounded form and names
    the worker (formatting it used to raise inside the serve loop), and the daemon serves on."""
    from concurrent.futures import ThreadPoolExecutor

    from sidecar.protocol.manifest import Manifest

    d = start()
    spec = RefitSpec(model_type="qwen3_5_moe", fmt="block_fp8")
    manifest = Manifest.from_tensors(
        convert(weights(0), spec),
        engine="reference",
        engine_version="test",
        moe_backend="ReferenceFusedMoE",
        expert_format="block_fp8",
    )
    peer = RawPeer(d.endpoint)
    try:
        peer.send(Kind.ATTACH, {"name": "hostile-engine", "pid": 1, "manifest": manifest.to_wire()})
        assert peer.recv().kind is Kind.ATTACHED
        peer.send(Kind.WAIT, {"min_step": 1})
        with RefitClient(d.endpoint, 0, 1, timeout=REPLY_S) as client, ThreadPoolExecutor(1) as pool:
            pushed = pool.submit(client.push_step, 1, weights(1), wait="loaded", timeout=REPLY_S)
            handed = peer.recv()
            while handed.kind is not Kind.GENERATION:  # PONGs and the like
                handed = peer.recv()
            peer.send(
                Kind.RELEASE,
                {
                    "generation": handed.fields["generation"],
                    "step": 1,
                    "ok": False,
                    "error": nested(),
                    "seconds": nested(),
                },
            )
            with pytest.raises(RefitError) as excinfo:
                pushed.result(timeout=REPLY_S + 10)
        err = excinfo.value
        assert err.kind is ErrorKind.ENGINE and "hostile-engine" in err.message and "[[[" in err.message, err
        assert len(err.message) < 2000
        peer.send(Kind.DETACH, {})
    finally:
        peer.close()
    assert d.thread.is_alive()
    publish_and_check(d.endpoint, 2, seed=31)


@pytest.mark.timeout(60)
def test_a_bug_outside_any_message_is_logged_counted_and_the_loop_turns_on(start):
    """A timer that raises once (a bug outside any one message) no longer ends the serve loop: it
    is logged, counted as internal, and the next turn goes on; an honest step then publishes."""
    d = start()
    real, raised = d.daemon.receiver.timers, []

    def broken(now: float) -> None:
        if not raised:
            raised.append(now)
            raise RuntimeError("a bug in a timer")
        real(now)

    d.daemon.receiver.timers = broken
    wait_until("the broken timer ran", lambda: raised, timeout=REPLY_S)
    publish_and_check(d.endpoint, 1, seed=41)
    assert d.thread.is_alive() and d.status()["message_errors"].get("internal") == 1
