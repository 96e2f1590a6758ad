"""Attempts: every push of a rank is one attempt, numbered in its HELLO, and every answer of the
daemon names the attempt it answers, so a late answer to a failed attempt never fails its retry.

A rank sends PIECE_DONE and COMMIT without waiting for answers. When a step fails while they are on
their way (NaN in an early unit), the daemon answers the late COMMIT too ("COMMIT for step 2, which
is not in progress"), after the failure the client raised. On one connection, in order, that answer
reaches the retry of the same step number. Before attempts, nothing told it from the retry's own
failure. A failure of the step the daemon tells a rank that has not begun it yet must still reach
that rank's attempt at it (tests/test_daemon.py::test_begin_crossing_a_failure_does_not_wedge_the_next_step).

Also: a HELLO without an attempt, or with a forged one, and a message that claims an attempt other
than its connection's, are clear PROTOCOL errors; the last good generation stays live.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from support.waiting import wait_until
from test_hostile_trainers import (
    WAIT_S,
    RawRank,
    assert_intact,
    assert_published,
    begin_raw,
    client_items,
    failure,
    honest_step,
    pool,  # noqa: F401  (a fixture)
    push,
    start,  # noqa: F401  (a fixture)
    weights,
)

from sidecar.client.client import RefitClient
from sidecar.errors import ErrorKind, RefitError
from transport.wire import Kind

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs POSIX shared memory")


def commit_after_failure(client: RefitClient, d, step: int) -> None:
    """Hold ``client``'s COMMIT of ``step`` until the daemon has failed that step: the COMMIT then
    reaches it after the failure, as one on its way when a unit found NaN does."""
    own = client._send

    def send(kind, fields, frames=()):
        if kind is Kind.COMMIT and fields.get("step") == step:
            del client._send  # once
            wait_until(
                f"the daemon to fail step {step}",
                lambda: d.status()["step_in_progress"] is None,
                timeout=WAIT_S,
            )
        return own(kind, fields, frames)

    client._send = send


@pytest.mark.timeout(120)
def test_a_late_answer_to_a_failed_attempt_does_not_fail_its_retry(start):  # noqa: F811
    """Step 2's first attempt has a NaN in an expert slab: its unit runs once the slab is written
    (before COMMIT) and fails the step. Its COMMIT leaves after that failure, so the daemon answers
    it with a PROTOCOL error about step 2 after the NON_FINITE one the client raised. The retry of
    step 2 must not take that answer for its own: it publishes."""
    d = start(world_size=1)
    with RefitClient(d.endpoint, 0, 1, timeout=WAIT_S) as client:
        client.push_step(1, weights(1), timeout=WAIT_S)
        bad = weights(2)
        slab = next(n for n in bad if ".mlp.experts." in n)
        bad[slab].view(-1)[0] = float("nan")
        commit_after_failure(client, d, 2)
        with pytest.raises(RefitError) as err:
            client.push_step(2, bad, timeout=WAIT_S)
        assert err.value.kind is ErrorKind.NON_FINITE, err.value
        result = client.push_step(2, weights(3), timeout=WAIT_S)
    assert result.step == 2
    assert d.status()["live"]["step"] == 2


@pytest.mark.timeout(180)
def test_a_failure_told_before_the_ranks_hello_still_fails_its_attempt(start, pool):  # noqa: F811
    """Step 2 fails (rank 0 aborts it) before rank 1 starts pushing it: the daemon tells rank 1 at
    once, naming no attempt (rank 1's is at step 1), and the ERROR waits in rank 1's socket. Rank 1's
    push of step 2 reads it before its WELCOME and raises it: it must not BEGIN a step 2 of its own,
    which would hold step 3 until the step timeout. Step 3 then publishes on both ranks."""
    d = start()
    one, two = weights(1), weights(2)
    with RefitClient(d.endpoint, 1, 2, timeout=WAIT_S) as c1:
        with RefitClient(d.endpoint, 0, 2, timeout=WAIT_S) as c0:
            futures = [push(pool, c0, 1, one), push(pool, c1, 1, one)]
            assert [f.result(timeout=WAIT_S).step for f in futures] == [1, 1]
        raw, _, _ = begin_raw(d, 2, two)
        raw.send(Kind.ABORT, {"step": 2, "reason": "test"})
        told = raw.error()
        assert told.kind is ErrorKind.ABORTED
        with pytest.raises(RefitError) as err:
            c1.push_step(2, client_items(two, 1), timeout=WAIT_S)
        assert (err.value.kind, err.value.message) == (told.kind, told.message)
        raw.close()
        assert d.status()["step_in_progress"] is None
        three = weights(3)
        with RefitClient(d.endpoint, 0, 2, timeout=WAIT_S) as c0:
            futures = [push(pool, c0, 3, three), push(pool, c1, 3, three)]
            assert [f.result(timeout=WAIT_S).step for f in futures] == [3, 3]
    assert_published(d.endpoint, 3, three)


def test_every_answer_names_the_attempt_it_answers(start):  # noqa: F811
    """WELCOME, an ERROR answering a message and PONG carry the attempt of the HELLO that opened
    the connection's current attempt; a new HELLO opens a new one."""
    d = start(world_size=1)
    raw = RawRank(d.endpoint, world=1)
    assert raw.hello(attempt=7, step=1)["attempt"] == 7
    raw.send(Kind.COMMIT, {"step": 1})
    err = raw.expect(Kind.ERROR)
    assert err.fields["attempt"] == 7 and "not in progress" in err.fields["message"], err.fields
    assert raw.hello(attempt=8, step=1)["attempt"] == 8
    raw.send(Kind.PING, {})
    assert raw.expect(Kind.PONG).fields["attempt"] == 8
    raw.close()


ABSENT_OR_FORGED = [
    ({}, "lacks its attempt"),
    ({"attempt": "3"}, "attempt must be a non-negative int"),
    ({"attempt": True}, "attempt must be a non-negative int"),
    ({"attempt": -1}, "attempt must be a non-negative int"),
    ({"attempt": 1 << 63}, "attempt must be a non-negative int"),
    ({"attempt": [[[[1]]]]}, "attempt must be a non-negative int"),
    ({"attempt": 1, "step": -1}, "step must be a non-negative int"),
    ({"attempt": 1, "step": None}, "step must be a non-negative int"),
]


@pytest.mark.timeout(180)
def test_an_absent_or_forged_attempt_is_a_protocol_error(start, pool):  # noqa: F811
    """A HELLO without an attempt (a client older than attempts) or with one that is not a plain
    non-negative int is refused by name; so is a message of a rank of the step in progress that
    claims another attempt than its connection's (its step fails on every rank). The last good
    generation stays live and the next honest step publishes."""
    d = start()
    good = honest_step(pool, d, 1, seed=1)
    for extra, words in ABSENT_OR_FORGED:
        raw = RawRank(d.endpoint)
        fields: dict[str, Any] = {"rank": 0, "world_size": 2, "pid": os.getpid(), "host": "h", "local": False}
        raw.send(Kind.HELLO, {**fields, "step": 2, **extra})
        err = raw.error()
        assert err.kind is ErrorKind.PROTOCOL and words in err.message, (extra, err.message)
        assert "same refitd version" in err.message, err.message
        raw.close()
    assert d.status()["live"]["step"] == 1

    sd = weights(2)
    with RefitClient(d.endpoint, 1, 2, timeout=WAIT_S) as c1:
        honest = push(pool, c1, 2, sd)
        raw, _, _ = begin_raw(d, 2, sd)
        raw.expect(Kind.READY)
        raw.send(Kind.COMMIT, {"step": 2, "attempt": 99})  # its connection's attempt is 1
        err = raw.error()
        assert err.kind is ErrorKind.PROTOCOL and "attempt 99" in err.message, err.message
        assert failure(honest).message == err.message
        raw.close()
    assert_intact(pool, d, 1, good, 3)
