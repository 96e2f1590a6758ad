"""Hostile and broken trainer ranks, spoken to the daemon as raw ZeroMQ messages (issue 11).

The daemon runs in a thread of the test process (its real serve loop, sockets and shared memory).
Rank 0 is a raw DEALER socket that follows the wire protocol exactly as far as each test wants and
then misbehaves: a data block sent twice and another never, PIECE_DONE from a peer that never got
the staging arena, a BEGIN of thousands of overlapping pieces, a BEGIN refused half-way, fields of
the wrong type. Rank 1 is an honest ``RefitClient``. After each fault: every rank of the step got
the same error at once (not the step timeout), the last good generation is still live and intact,
the daemon still serves, and the next honest step publishes byte-exact against ``convert()``.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
import torch
import zmq
from support.daemons import daemon_factory
from support.net import free_port
from support.waiting import wait_until

from adapters.base import RefitReader
from sidecar.cli.demo.synthetic import make_hf_config, make_state_dict
from sidecar.client.client import RefitClient, Shard
from sidecar.errors import ErrorKind, RefitError
from sidecar.plan.build import RefitSpec
from sidecar.plan.run import convert
from transport.wire import Kind, Limits, Message, decode, encode

MODEL = dict(num_layers=2, num_experts=4)
CONFIG = make_hf_config("qwen3_5_moe", **MODEL)
SPEC = RefitSpec(model_type="qwen3_5_moe", fmt="block_fp8")
#: long enough that a rank left waiting for the step timeout would fail the test's own timeout
STEP_TIMEOUT_S = 600.0
WAIT_S = 60.0
BIG = Limits(max_header_bytes=256 << 20, max_frame_bytes=1 << 30, max_frames=1024)

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs POSIX shared memory")


@pytest.fixture
def start(tmp_path):
    factory = daemon_factory(tmp_path, hf_config=CONFIG, world_size=2, step_timeout_s=STEP_TIMEOUT_S)
    yield next(factory)
    next(factory, None)


@pytest.fixture(scope="module")
def pool():
    with ThreadPoolExecutor(4) as executor:
        yield executor


def weights(seed: int) -> dict[str, torch.Tensor]:
    return make_state_dict("qwen3_5_moe", seed=seed, **MODEL)


def rank_part(
    sd: dict[str, torch.Tensor], rank: int, world: int = 2
) -> list[tuple[str, torch.Tensor, tuple]]:
    """(name, slice, offsets) of rank ``rank``: tensors with enough rows split along dim 0, the rest
    alternately whole."""
    out = []
    for i, (name, t) in enumerate(sd.items()):
        if t.dim() >= 1 and t.shape[0] >= world:
            a, b = t.shape[0] * rank // world, t.shape[0] * (rank + 1) // world
            out.append((name, t[a:b].contiguous(), (a,) + (0,) * (t.dim() - 1)))
        elif i % world == rank:
            out.append((name, t.contiguous(), (0,) * t.dim()))
    return out


def client_items(sd, rank: int) -> list:
    return [(n, Shard(s, tuple(sd[n].shape), off)) for n, s, off in rank_part(sd, rank)]


def rows_of(sd, part) -> list[list[Any]]:
    return [[n, "bfloat16", list(sd[n].shape), list(off), list(s.shape)] for n, s, off in part]


class RawRank:
    """A trainer rank as bare wire messages on a DEALER socket; every receive has a deadline."""

    def __init__(self, endpoint: str, rank: int = 0, world: int = 2):
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.rank, self.world = rank, world

    def send(self, kind: Kind, fields: dict[str, Any], frames=()) -> None:
        self.sock.send_multipart(encode(Message(kind, fields, list(frames))))

    def recv(self, timeout: float = WAIT_S) -> Message:
        if not self.sock.poll(int(timeout * 1000)):
            raise TimeoutError(f"raw rank {self.rank}: no reply within {timeout:.0f} s")
        return decode(self.sock.recv_multipart(), BIG)

    def expect(self, kind: Kind, timeout: float = WAIT_S) -> Message:
        """The next message that is not flow control (CREDIT, or PONG unless asked for); it must be ``kind``."""
        deadline = time.monotonic() + timeout
        while True:
            msg = self.recv(max(0.0, deadline - time.monotonic()))
            if msg.kind is not kind and msg.kind in (Kind.CREDIT, Kind.PONG):
                continue
            assert msg.kind is kind, f"expected {kind.name}, got {msg.kind.name} {msg.fields}"
            return msg

    def error(self, timeout: float = WAIT_S) -> RefitError:
        return RefitError.from_wire(self.expect(Kind.ERROR, timeout).fields)

    def hello(self, local: bool = False, *, attempt: int = 1, step: int = 0) -> dict[str, Any]:
        fields = {"rank": self.rank, "world_size": self.world, "pid": os.getpid(), "local": local}
        self.send(Kind.HELLO, {**fields, "attempt": attempt, "step": step})
        return self.expect(Kind.WELCOME).fields

    def shard(self, step: int, pid: int, offsets, block: torch.Tensor) -> None:
        data = block.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        fields = {"step": step, "piece": pid, "offsets": list(offsets), "shape": list(block.shape)}
        self.send(Kind.SHARD, fields, [data])

    def close(self) -> None:
        self.sock.close(linger=0)


def push(pool, client: RefitClient, step: int, sd) -> Future:
    return pool.submit(client.push_step, step, client_items(sd, client.rank))


def failure(future: Future) -> RefitError:
    exc = future.exception(timeout=WAIT_S)
    assert isinstance(exc, RefitError), f"expected the step to fail, got {future.result()!r}"
    return exc


def assert_published(endpoint: str, step: int, sd) -> None:
    """The live generation is ``step`` and holds ``convert(sd)`` byte for byte."""
    expected = convert(sd, SPEC)
    with RefitReader(endpoint, name="check") as reader:
        gen = reader.wait(min_step=step, timeout=WAIT_S)
        try:
            assert gen.step == step
            bad = [
                n
                for n, v in expected.items()
                if not torch.equal(
                    gen.tensors[n].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)
                )
            ]
            assert bad == [] and len(gen.tensors) == len(expected)
        finally:
            reader.release(gen)


def honest_step(pool, d, step: int, seed: int) -> dict[str, torch.Tensor]:
    """Both ranks as RefitClients: the step publishes and is byte-exact."""
    sd = weights(seed)
    with (
        RefitClient(d.endpoint, 0, 2, timeout=WAIT_S) as c0,
        RefitClient(d.endpoint, 1, 2, timeout=WAIT_S) as c1,
    ):
        futures = [push(pool, c0, step, sd), push(pool, c1, step, sd)]
        assert [f.result(timeout=WAIT_S).step for f in futures] == [step, step]
    assert_published(d.endpoint, step, sd)
    return sd


def assert_intact(pool, d, live_step: int, live_sd, next_step: int) -> None:
    """After a fault: no step in flight, the last good generation live and intact, the daemon
    serving, and an honest next step byte-exact."""
    status = d.status()
    assert status["live"]["step"] == live_step and status["step_in_progress"] is None
    assert_published(d.endpoint, live_step, live_sd)
    honest_step(pool, d, next_step, seed=100 + next_step)


def wait_begun(d, step: int, ranks: list[int]) -> None:
    """Until ``ranks`` began ``step`` (so a failure of the step reaches them at once)."""

    def begun() -> bool:
        progress = d.status()["step_in_progress"]
        return progress is not None and progress["step"] == step and progress["begun"] == ranks

    wait_until(f"ranks {ranks} to begin step {step}", begun, timeout=WAIT_S)


def begin_raw(d, step: int, sd, *, local: bool = False) -> tuple[RawRank, list, list[list[Any]]]:
    raw = RawRank(d.endpoint)
    raw.hello(local=local)
    part = rank_part(sd, 0)
    rows = rows_of(sd, part)
    raw.send(Kind.BEGIN, {"step": step, "pieces": rows})
    return raw, part, rows


# --------------------------------------------------------------------------------------------------
# defect 1: data tracked by position


@pytest.mark.timeout(120)
def test_a_block_sent_twice_and_another_never_fails_the_step_on_every_rank(start, pool):
    """Rank 0 streams one piece as two blocks of the same size but sends the first twice: as many
    bytes as the piece holds arrive, yet half of it never did. Counting bytes published stale
    staging; by position the duplicate is a PROTOCOL error on both ranks, and nothing is published."""
    d = start()
    good = honest_step(pool, d, 1, seed=1)
    sd = weights(2)
    with RefitClient(d.endpoint, 1, 2, timeout=WAIT_S) as c1:
        honest = push(pool, c1, 2, sd)
        raw, part, _ = begin_raw(d, 2, sd)
        ids = raw.expect(Kind.READY).fields["pieces"]
        slab = next(k for k, (n, _, _) in enumerate(part) if n.endswith("experts.gate_up_proj"))
        for k, (_, block, offsets) in enumerate(part):
            if k != slab:
                raw.shard(2, ids[k], offsets, block)
        name, block, offsets = part[slab]
        half = block.shape[0] // 2
        assert half >= 1 and block.shape[0] == 2 * half
        raw.shard(2, ids[slab], offsets, block[:half])
        raw.shard(2, ids[slab], offsets, block[:half])  # again; rows [half, 2 * half) never come
        raw.send(Kind.COMMIT, {"step": 2})  # counting bytes, this published stale staging rows
        err = raw.error()
        assert err.kind is ErrorKind.PROTOCOL and err.rank == 0 and err.step == 2
        assert (
            f"tensor {name!r}: rank 0 sent the block at" in err.message and "already arrived" in err.message
        )
        other = failure(honest)
        assert other.kind is ErrorKind.PROTOCOL and other.message == err.message
        raw.close()
    assert_intact(pool, d, 1, good, 3)


@pytest.mark.timeout(120)
def test_a_block_outside_its_piece_or_not_contiguous_is_refused_on_every_rank(start, pool):
    d = start()
    good = honest_step(pool, d, 1, seed=1)
    for step, bad in [(2, "outside"), (3, "strided")]:
        sd = weights(step)
        with RefitClient(d.endpoint, 1, 2, timeout=WAIT_S) as c1:
            honest = push(pool, c1, step, sd)
            raw, part, _ = begin_raw(d, step, sd)
            ids = raw.expect(Kind.READY).fields["pieces"]
            k = next(k for k, (n, _, _) in enumerate(part) if n.endswith("experts.down_proj"))
            name, block, offsets = part[k]
            if bad == "outside":  # rank 0 holds experts [0, 2): expert 2 is rank 1's
                raw.shard(step, ids[k], [2, 0, 0], block[:1])
                words = "is not a non-empty box inside the piece it declared"
            else:  # column 0 of every row of expert 0: a box inside the piece, but strided in it
                raw.shard(step, ids[k], offsets, block[:1, :, :1])
                words = "is not one contiguous run"
            err = raw.error()
            assert err.kind is ErrorKind.PROTOCOL and words in err.message and name in err.message
            assert failure(honest).message == err.message
            raw.close()
    assert_intact(pool, d, 1, good, 4)


# --------------------------------------------------------------------------------------------------
# defect 2: PIECE_DONE only from a rank handed the staging arena


@pytest.mark.timeout(120)
@pytest.mark.parametrize("listen", ["ipc", "tcp"])
def test_piece_done_from_a_remote_peer_fails_the_step_on_every_rank(start, pool, listen):
    """Rank 0 says PIECE_DONE for every piece without sending a byte. Over ipc:// it asked to be
    remote; over tcp:// it claims to be local, but over tcp:// every peer is remote. Either way it
    was never handed the staging arena, so it cannot have written there."""
    d = start(**({"listen": f"tcp://127.0.0.1:{free_port()}"} if listen == "tcp" else {}))
    good = honest_step(pool, d, 1, seed=1)
    sd = weights(2)
    with RefitClient(d.endpoint, 1, 2, local=False, timeout=WAIT_S) as c1:
        honest = push(pool, c1, 2, sd)
        raw, _, _ = begin_raw(d, 2, sd, local=listen == "tcp")
        ready = raw.expect(Kind.READY).fields
        assert "staging" not in ready
        raw.send(Kind.PIECE_DONE, {"step": 2, "pieces": ready["pieces"]})
        raw.send(Kind.COMMIT, {"step": 2})  # without the check, this published whatever staging held
        err = raw.error()
        assert err.kind is ErrorKind.PROTOCOL and err.rank == 0
        assert "said PIECE_DONE, but this daemon never handed it the staging arena" in err.message
        assert failure(honest).message == err.message
        raw.close()
    assert_intact(pool, d, 1, good, 3)


@pytest.mark.timeout(120)
def test_piece_done_twice_from_a_local_rank_is_a_protocol_error(start, pool):
    """A local rank handed staging may say PIECE_DONE, once per piece."""
    d = start()
    good = honest_step(pool, d, 1, seed=1)
    sd = weights(2)
    with RefitClient(d.endpoint, 1, 2, timeout=WAIT_S) as c1:
        honest = push(pool, c1, 2, sd)
        raw, _, _ = begin_raw(d, 2, sd, local=True)
        ready = raw.expect(Kind.READY).fields
        assert "staging" in ready
        first = ready["pieces"][0]
        raw.send(Kind.PIECE_DONE, {"step": 2, "pieces": [first, first]})
        err = raw.error()
        assert (
            err.kind is ErrorKind.PROTOCOL
            and "reported all of" in err.message
            and "already arrived" in err.message
        )
        assert failure(honest).message == err.message
        raw.close()
    assert_intact(pool, d, 1, good, 3)


# --------------------------------------------------------------------------------------------------
# defect 4: a BEGIN of many overlapping pieces


@pytest.mark.timeout(180)
def test_begins_of_8k_and_64k_overlapping_pieces_are_refused_with_a_capped_report(start, pool):
    """Every piece of rank 0's BEGIN is the same expert slab: the overlap report lists five and
    counts the rest, both ranks hear it, and the daemon keeps serving (status answers at once)."""
    d = start()
    good = honest_step(pool, d, 1, seed=1)
    sd = weights(2)
    part = rank_part(sd, 0)
    k = next(k for k, (n, _, _) in enumerate(part) if n.endswith("experts.gate_up_proj"))
    rows = rows_of(sd, part)
    seconds = {}
    for step, copies in [(2, 8 << 10), (3, 64 << 10)]:
        with RefitClient(d.endpoint, 1, 2, timeout=WAIT_S) as c1:
            honest = push(pool, c1, step, sd)
            raw = RawRank(d.endpoint)
            raw.hello()
            t0 = time.perf_counter()
            raw.send(Kind.BEGIN, {"step": step, "pieces": rows + [rows[k]] * copies})
            err = raw.error()
            seconds[copies] = time.perf_counter() - t0
            assert err.kind is ErrorKind.COVERAGE
            assert f"({copies} overlaps)" in err.message and err.message.count("  overlap: rank 0 sent") == 5
            assert f"  ... and {copies - 5} more overlaps" in err.message
            assert len(err.message) < 4096
            assert failure(honest).message == err.message
            raw.close()
    print(f"overlapping BEGIN: 8k pieces {seconds[8 << 10]:.3f} s, 64k pieces {seconds[64 << 10]:.3f} s")
    assert_intact(pool, d, 1, good, 4)


@pytest.mark.timeout(120)
def test_a_begin_over_max_step_pieces_is_refused_naming_the_setting(start, pool):
    d = start(max_step_pieces=200)
    good = honest_step(pool, d, 1, seed=1)
    sd = weights(2)
    with RefitClient(d.endpoint, 1, 2, timeout=WAIT_S) as c1:
        honest = push(pool, c1, 2, sd)
        rows = rows_of(sd, rank_part(sd, 0))
        raw = RawRank(d.endpoint)
        raw.hello()
        wait_begun(d, 2, [1])
        raw.send(Kind.BEGIN, {"step": 2, "pieces": rows * 10})
        err = raw.error()
        assert err.kind is ErrorKind.INVALID and "over max_step_pieces=200" in err.message
        assert "--max-step-pieces" in err.message
        assert failure(honest).message == err.message
        raw.close()
    assert_intact(pool, d, 1, good, 3)


# --------------------------------------------------------------------------------------------------
# defect 5: a refused BEGIN declares nothing


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("spoil", "words"),
    [
        (lambda row: [*row[:4], [2, "x"]], "shape is a list of 2, expected a list of ints"),
        (lambda row: 7, "is a int, expected a list [name, dtype, global_shape, offsets, shape]"),
        (lambda row: [row[0], ["bfloat16"], *row[2:]], "dtype is a list of 1, expected a str"),
        (lambda row: [*row[:3], [True, *row[3][1:]], row[4]], "offsets is a list of"),
    ],
)
def test_a_refused_begin_declares_nothing_and_the_corrected_one_publishes(start, pool, spoil, words):
    """Rank 0's BEGIN has a malformed last row: it alone is told (it has not joined the step), and
    none of its rows stay declared, so its corrected BEGIN joins the step, which publishes exactly."""
    d = start()
    good = honest_step(pool, d, 1, seed=1)
    sd = weights(2)
    with RefitClient(d.endpoint, 1, 2, timeout=WAIT_S) as c1:
        honest = push(pool, c1, 2, sd)
        raw = RawRank(d.endpoint)
        raw.hello()
        part = rank_part(sd, 0)
        rows = rows_of(sd, part)
        raw.send(Kind.BEGIN, {"step": 2, "pieces": [*rows[:-1], spoil(rows[-1])]})
        err = raw.error()
        assert err.kind is ErrorKind.PROTOCOL and f"rank 0: BEGIN piece {len(rows) - 1}" in err.message
        assert words in err.message
        assert not honest.done()
        raw.send(Kind.BEGIN, {"step": 2, "pieces": rows})
        ids = raw.expect(Kind.READY).fields["pieces"]
        for pid, (_, block, offsets) in zip(ids, part):
            raw.shard(2, pid, offsets, block)
        raw.send(Kind.COMMIT, {"step": 2})
        raw.expect(Kind.ACK)
        assert raw.expect(Kind.RESULT).fields["step"] == 2
        assert honest.result(timeout=WAIT_S).step == 2
        raw.close()
    assert_published(d.endpoint, 2, sd)
    assert_intact(pool, d, 2, sd, 3)
    assert good  # step 1 was replaced by step 2 as it should


# --------------------------------------------------------------------------------------------------
# defects 9 and 10: malformed fields are refused by name, and fail the step on every rank


MALFORMED_AFTER_READY = [
    (
        "SHARD offsets of strs",
        Kind.SHARD,
        {"piece": 0, "offsets": ["0", 0], "shape": [1, 1]},
        1,
        "offsets is a",
    ),
    (
        "SHARD shape with a bool",
        Kind.SHARD,
        {"piece": 0, "offsets": [0, 0], "shape": [True, 1]},
        1,
        "shape is a",
    ),
    (
        "SHARD shape of the wrong rank",
        Kind.SHARD,
        {"piece": 0, "offsets": [0], "shape": [1]},
        1,
        "offsets is a",
    ),
    (
        "SHARD piece as a str",
        Kind.SHARD,
        {"piece": "0", "offsets": [0, 0], "shape": [1, 1]},
        1,
        "'piece' has type",
    ),
    (
        "SHARD piece as a bool",
        Kind.SHARD,
        {"piece": True, "offsets": [0, 0], "shape": [1, 1]},
        1,
        "'piece' has type",
    ),
    ("SHARD of two frames", Kind.SHARD, {"piece": 0, "offsets": [0, 0], "shape": [1, 1]}, 2, "data frames"),
    (
        "SHARD offsets a map",
        Kind.SHARD,
        {"piece": 0, "offsets": {"a": 1}, "shape": [1, 1]},
        1,
        "'offsets' has type",
    ),
    ("PIECE_DONE pieces of bools", Kind.PIECE_DONE, {"pieces": [True]}, 0, "never handed it the staging"),
    ("COMMIT step as a str", Kind.COMMIT, {"step": "2"}, 0, "'step' has type str"),
    ("COMMIT step as a bool", Kind.COMMIT, {"step": True}, 0, "'step' has type bool"),
    ("COMMIT step as a nested list", Kind.COMMIT, {"step": [[[[1]]]]}, 0, "'step' has type list"),
]


@pytest.mark.timeout(240)
def test_malformed_data_and_commit_fields_are_refused_by_name_on_every_rank(start, pool):
    """Each malformed message from rank 0 after READY fails the step on both ranks with a PROTOCOL
    error naming the field, never the internal-error catch-all; the daemon serves on."""
    d = start()
    good = honest_step(pool, d, 1, seed=1)
    step = 2
    for label, kind, fields, n_frames, words in MALFORMED_AFTER_READY:
        sd = weights(step)
        with RefitClient(d.endpoint, 1, 2, timeout=WAIT_S) as c1:
            honest = push(pool, c1, step, sd)
            raw, part, _ = begin_raw(d, step, sd)
            ids = raw.expect(Kind.READY).fields["pieces"]
            k = next(k for k, (_, b, _) in enumerate(part) if b.dim() == 2)  # a 2-d piece for the SHARDs
            fields = {"step": step, **fields}
            if fields.get("piece") == 0:
                fields["piece"] = ids[k]
            raw.send(kind, fields, [b"\0\0"] * n_frames)
            err = raw.error()
            assert err.kind is ErrorKind.PROTOCOL, (label, err)
            assert words in err.message and "internal error" not in err.message, (label, err.message)
            other = failure(honest)
            assert other.kind is ErrorKind.PROTOCOL and other.message == err.message, label
            raw.close()
        status = d.status()
        assert status["live"]["step"] == 1 and status["step_in_progress"] is None, label
        step += 1
    assert_intact(pool, d, 1, good, step)


MALFORMED_HELLO = [
    ({"host": ["a"] * 3}, "host a str (got list of 3)"),
    ({"pid": "12"}, "pid must be an int or absent (got str)"),
    ({"local": 1}, "local a bool (got int)"),
]


@pytest.mark.timeout(120)
def test_malformed_hello_and_abort_fields_are_refused_by_name(start, pool):
    d = start()
    good = honest_step(pool, d, 1, seed=1)
    for extra, words in MALFORMED_HELLO:
        raw = RawRank(d.endpoint)
        raw.send(Kind.HELLO, {"rank": 0, "world_size": 2, "attempt": 1, "step": 2, **extra})
        err = raw.error()
        assert err.kind is ErrorKind.PROTOCOL and words in err.message, err.message
        raw.close()
    sd = weights(2)
    with RefitClient(d.endpoint, 1, 2, timeout=WAIT_S) as c1:
        honest = push(pool, c1, 2, sd)
        raw, _, _ = begin_raw(d, 2, sd)
        raw.expect(Kind.READY)
        nested: Any = "why"
        for _ in range(200):
            nested = [nested]
        raw.send(Kind.ABORT, {"step": 2, "reason": nested})
        err = raw.error()
        assert err.kind is ErrorKind.ABORTED and "(a list of 1 instead of a str reason)" in err.message
        assert failure(honest).message == err.message
        raw.close()
    assert_intact(pool, d, 1, good, 3)


@pytest.mark.timeout(120)
def test_undecodable_message_from_a_rank_of_the_step_fails_it_on_every_rank(start, pool):
    """Not even msgpack: the daemon cannot read the message, but it knows the sender is a rank of the
    step in progress, so the step fails on every rank rather than waiting for the step timeout."""
    d = start()
    good = honest_step(pool, d, 1, seed=1)
    sd = weights(2)
    with RefitClient(d.endpoint, 1, 2, timeout=WAIT_S) as c1:
        honest = push(pool, c1, 2, sd)
        raw, _, _ = begin_raw(d, 2, sd)
        raw.expect(Kind.READY)
        raw.sock.send_multipart([b"\xc1 not msgpack"])
        err = raw.error()
        assert err.kind is ErrorKind.PROTOCOL and "header is not valid msgpack" in err.message
        assert failure(honest).message == err.message
        raw.close()
    assert_intact(pool, d, 1, good, 3)


@pytest.mark.timeout(120)
def test_begins_repeated_for_a_later_step_are_kept_once(start, pool):
    """A rank that BEGINs step 3 five hundred times while step 2 is in progress holds one place in
    the queue, not five hundred; once step 2 ends its BEGIN of step 3 is taken up as usual."""
    d = start()
    good = honest_step(pool, d, 1, seed=1)
    sd = weights(2)
    with RefitClient(d.endpoint, 1, 2, timeout=WAIT_S) as c1:
        honest = push(pool, c1, 2, sd)
        raw, _, rows = begin_raw(d, 2, sd)
        raw.expect(Kind.READY)
        for _ in range(500):
            raw.send(Kind.BEGIN, {"step": 3, "pieces": rows})
        raw.send(Kind.PING, {})
        raw.expect(Kind.PONG)  # every BEGIN before it was handled
        assert len(d.daemon.trainers.pending) == 1
        raw.send(Kind.ABORT, {"step": 2, "reason": "test"})
        assert raw.error().kind is ErrorKind.ABORTED and failure(honest).kind is ErrorKind.ABORTED
        assert d.status()["live"]["step"] == 1
        assert_published(d.endpoint, 1, good)
        nxt = weights(3)
        honest = push(pool, c1, 3, nxt)
        ids = raw.expect(Kind.READY).fields["pieces"]
        for pid, (_, block, offsets) in zip(ids, rank_part(nxt, 0)):
            raw.shard(3, pid, offsets, block)
        raw.send(Kind.COMMIT, {"step": 3})
        raw.expect(Kind.ACK)
        assert raw.expect(Kind.RESULT).fields["step"] == 3 and honest.result(timeout=WAIT_S).step == 3
        raw.close()
    assert_published(d.endpoint, 3, nxt)
