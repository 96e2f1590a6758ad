"""A trainer rank's session with the daemon: the DEALER socket, sends that never block past the
step's deadline, HELLO/WELCOME, waits with heartbeats, and the messages that may arrive at any time
(credits, SLOT grants, PULLED, errors, a restarted daemon).

Everything here runs on the client's one worker thread (ZeroMQ sockets are not thread-safe).
``StepGrants`` is the per-step state the session fills as messages come (deadline, SLOT grants,
the ranks still missing) and the ring writer (``sidecar.client.ring``) reads.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from sidecar.errors import DaemonRestarted, ErrorKind, RefitError
from sidecar.ops.gcpause import gc_paused
from transport.curve import curve_hint, set_client
from transport.wire import Kind, Limits, Message, decode, encode

log = logging.getLogger("refitd.client")

#: a send the socket cannot take at once (no connection yet: e.g. a server refusing our CURVE key)
#: is retried this often until the step's deadline, never blocked on
SEND_RETRY_S = 0.05
#: on close, queued messages (an ABORT) get this long to leave; close() never waits longer
CLOSE_LINGER_MS = 100


@dataclass
class StepGrants:
    """What the daemon tells one push as it runs; a new one per push."""

    #: the step in flight's: every wait and send ends by it
    deadline: float = float("inf")
    #: staging ring: group -> region offset granted this step
    slots: dict[int, int] = field(default_factory=dict)
    #: several GPUs: group -> the staging arena (index) its SLOT named; absent: arena 0
    slot_arenas: dict[int, int] = field(default_factory=dict)
    #: while waiting for READY: the ranks the daemon last said have not begun (its PONGs)
    waiting_for: list[int] = field(default_factory=list)


class Session:
    """One rank's connection to the daemon. ``local`` (the staging writer) and ``remote`` (the
    remote sender) are set by the client once built: the session closes the first when the daemon
    changes, and hands the second its credits and PULLED reports, and progresses its NIXL pulls."""

    def __init__(self, endpoint: str, rank: int, world_size: int, *, want_local: bool, curve=None):
        self.endpoint, self.rank, self.world_size = endpoint, rank, world_size
        self.want_local, self.curve = want_local, curve
        self.ctx = zmq.Context()
        self.sock: zmq.Socket | None = None  # created and used on the worker thread only
        self.welcome: dict[str, Any] = {}
        self.instance: str | None = None  # the daemon instance of the latest WELCOME
        self.step_instance: str | None = None  # this step's daemon (None until its WELCOME)
        #: this push's number, in its HELLO and every message after it; the daemon names it in every
        #: answer, and answers naming another (a late answer to a push that failed) are ignored
        self.attempt = 0
        self.step = StepGrants()
        self.last_heard = 0.0
        self.last_sent = 0.0
        self.closed = False
        self.local: Any = None
        self.remote: Any = None

    def begin(self, deadline: float) -> StepGrants:
        """A new push: fresh grants, until ``deadline``."""
        self.step = StepGrants(deadline=deadline)
        return self.step

    def drop(self) -> None:
        """Forget the daemon this client talked to: its socket (and anything queued on it either
        way) and its staging mapping. The next push says HELLO on a fresh socket."""
        self.local.close()
        if self.sock is not None:
            self.sock.close(linger=CLOSE_LINGER_MS)
            self.sock = None
        self.welcome, self.step.slots, self.remote.credits = {}, {}, 0

    def term(self) -> None:
        self.ctx.term()

    def socket(self) -> zmq.Socket:
        if self.sock is None:
            self.sock = self.ctx.socket(zmq.DEALER)
            self.sock.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)
            set_client(self.sock, self.curve)
            self.sock.connect(self.endpoint)
        return self.sock

    # ---- sending

    def send(self, kind: Kind, fields: dict[str, Any], frames=()) -> None:
        """Send without ever blocking past the step's deadline. A socket that cannot take the message
        (no connection: a server refusing our CURVE key never completes the handshake) is retried
        until then, and the step fails with TIMEOUT."""
        self._send_within(kind, fields, frames, wait=True)

    def try_send(self, kind: Kind, fields: dict[str, Any]) -> None:
        """A courtesy message (PING, ABORT): dropped if the socket cannot take it at once."""
        self._send_within(kind, fields, (), wait=False)

    def _send_within(self, kind: Kind, fields: dict[str, Any], frames, *, wait: bool) -> None:
        if "attempt" not in fields:
            fields = {**fields, "attempt": self.attempt}
        sock, parts = self.socket(), encode(Message(kind, fields, list(frames)))
        while True:
            try:
                sock.send_multipart(parts, zmq.NOBLOCK, copy=False)
                break
            except zmq.Again:
                left = self.step.deadline - time.monotonic()
                if not wait:
                    return
                if left <= 0:
                    step = fields.get("step")
                    raise RefitError(
                        f"rank {self.rank} could not send {kind.name} to {self.endpoint} within the step's "
                        "timeout: no connection to the daemon came up" + curve_hint(self.curve),
                        kind=ErrorKind.TIMEOUT,
                        rank=self.rank,
                        step=step if isinstance(step, int) else None,
                    ) from None
                if self.closed:
                    raise self.closed_error(fields.get("step")) from None
                sock.poll(int(min(left, SEND_RETRY_S) * 1000) + 1, zmq.POLLOUT)
        self.last_sent = time.monotonic()

    def closed_error(self, step: Any) -> RefitError:
        return RefitError(
            "the client was closed while the step was in flight",
            kind=ErrorKind.UNAVAILABLE,
            rank=self.rank,
            step=step if isinstance(step, int) else None,
        )

    def abort(self, step: int, reason: str) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.try_send(Kind.ABORT, {"step": step, "rank": self.rank, "reason": reason})

    def hello(self, step: int, deadline: float, send=None) -> None:
        """Open a new attempt: what the daemon still sends about an earlier one is ignored from now on.
        ``send``: the client's send (tests hook it), else this session's."""
        self.attempt += 1
        self.step.waiting_for = []
        (send or self.send)(
            Kind.HELLO,
            {
                "rank": self.rank,
                "world_size": self.world_size,
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "local": self.want_local,
                "attempt": self.attempt,
                "step": step,
            },
        )
        self.last_heard = time.monotonic()
        self.step_instance = None  # until WELCOME: stale replies to an earlier connection are ignored
        welcome = self.wait_for(step, deadline, {Kind.WELCOME}, silence_ok=True).fields
        instance = welcome.get("instance")
        if self.instance is not None and instance != self.instance:
            log.warning(
                "rank %d: the daemon at %s restarted between steps (instance %s -> %s); reconnected",
                self.rank,
                self.endpoint,
                self.instance,
                instance,
                extra={"step": step, "rank": self.rank},
            )
            self.local.close()  # the old daemon's segment: never written again
        self.welcome, self.instance = welcome, instance
        self.step_instance = instance if isinstance(instance, str) else None

    # ---- waiting

    def keepalive(self, step: int, deadline: float, what: str, *, silence_ok: bool = False) -> None:
        """Raise on a passed deadline (aborting the step) or a silent daemon; ping when one is due."""
        if self.closed:
            raise self.closed_error(step)
        now = time.monotonic()
        if now > deadline:
            hint = curve_hint(self.curve) if "WELCOME" in what else ""  # never heard from the daemon
            if "READY" in what and self.step.waiting_for:
                hint = (
                    f": rank(s) {self.step.waiting_for} of {self.world_size} never began step {step} (no "
                    "BEGIN reached the daemon); every rank must call push_step for every step, at the same "
                    "point (a gathered export: the same call on every rank, with replicated=True)"
                )
            self.abort(step, f"rank {self.rank} timed out {what}{hint}")
            raise RefitError(
                f"rank {self.rank} timed out {what}{hint}", kind=ErrorKind.TIMEOUT, rank=self.rank, step=step
            )
        if not silence_ok and now - self.last_heard > self.silence_limit():
            raise RefitError(
                f"the daemon at {self.endpoint} stopped answering ({now - self.last_heard:.1f} s of silence)"
                + curve_hint(self.curve),
                kind=ErrorKind.UNAVAILABLE,
                rank=self.rank,
                step=step,
            )
        if now - self.last_sent > self.heartbeat():
            self.try_send(Kind.PING, {"step": step, "rank": self.rank})

    def heartbeat(self) -> float:
        return float(self.welcome.get("heartbeat_interval_s", 1.0))

    def frame_limit(self) -> int:
        return int(self.welcome.get("max_frame_bytes", 64 << 20))

    def silence_limit(self) -> float:
        return max(3 * self.heartbeat(), float(self.welcome.get("rank_timeout_s", 10.0)))

    def wait_for(self, step: int, deadline: float, kinds: set[Kind], *, silence_ok: bool = False) -> Message:
        """The next message of ``kinds`` for ``step``; raises on an ERROR for it, a timeout or a silent daemon."""
        sock = self.socket()
        what = "waiting for " + "/".join(k.name for k in kinds)
        while True:
            self.keepalive(step, deadline, what, silence_ok=silence_ok)
            wait = min(self.heartbeat(), max(0.001, deadline - time.monotonic()))
            if self.remote.pulling:  # the daemon READs from this process: progress the endpoint meanwhile
                self.remote.progress()
                wait = 0.001
            if not sock.poll(int(wait * 1000)):
                continue
            msg = self._recv(sock)
            self.last_heard = time.monotonic()
            if self.handle_async(msg, step):
                continue
            if msg.kind in kinds and msg.get("step", step) == step:
                return msg

    def _recv(self, sock: zmq.Socket) -> Message:
        frames = sock.recv_multipart(copy=False)
        with gc_paused():  # a READY lists every piece (and the staging layout): many small objects
            return decode(frames, Limits(max_header_bytes=256 << 20))

    def handle_async(self, msg: Message, step: int) -> bool:
        """Credits and errors that may arrive at any time; True if consumed. Raises DaemonRestarted
        when a reply comes from another daemon instance than this step's, or the daemon no longer
        knows this client. A message naming an attempt other than this push's answers an earlier
        push (its late COMMIT, say) and is ignored, an ERROR included; one naming none (a step's
        failure told before this push's HELLO reached the daemon) is taken as before."""
        attempt = msg.get("attempt")
        if attempt is not None and attempt != self.attempt:
            log.debug(
                "rank %d ignored %s answering its attempt %r (now %d): %s",
                self.rank,
                msg.kind.name,
                attempt,
                self.attempt,
                msg.get("message", ""),
            )
            return True
        instance = msg.get("instance")
        unknown = msg.kind is Kind.ERROR and msg.get("kind") == ErrorKind.UNKNOWN_PEER.value
        if self.step_instance is None:  # waiting for WELCOME: replies to what an earlier step sent
            if unknown:
                log.debug("rank %d ignored a stale reply before WELCOME: %s", self.rank, msg.get("message"))
                return True
        elif unknown or (isinstance(instance, str) and instance != self.step_instance):
            self._restarted(step, instance if isinstance(instance, str) else None)
        if msg.kind is Kind.CREDIT:
            if msg.get("step") == step:
                self.remote.credits += int(msg.get("frames", 1))
            return True
        if msg.kind is Kind.SLOT:
            if msg.get("step") == step:
                group = int(msg.require("group", int))
                self.step.slots[group] = int(msg.require("offset", int))
                if "arena" in msg.fields:  # several GPUs: the staging arena of the region
                    self.step.slot_arenas[group] = int(msg.require("arena", int))
            return True
        if msg.kind is Kind.PULLED:
            if msg.get("step") == step:
                self.remote.pulled.append(msg.fields)
            return True
        if msg.kind is Kind.ERROR:
            err = RefitError.from_wire(msg.fields)
            if err.step in (None, step):
                raise err
            return True  # a stale error about an earlier step
        if msg.kind is Kind.PONG:
            waiting = msg.get("waiting_for")
            if msg.get("step") == step and isinstance(waiting, list):
                self.step.waiting_for = [r for r in waiting if type(r) is int]
            return True
        return False

    def _restarted(self, step: int, new: str | None) -> None:
        """The step's daemon is gone (or forgot this client): drop the connection, fail the step once."""
        old = self.step_instance
        self.step_instance = None
        if new is not None:
            self.instance = new  # the next WELCOME from it is no news
        self.drop()
        if new is None or new == old:
            what = f"the daemon (instance {old}) no longer knows this client"
        else:
            what = f"daemon restarted (instance {old} -> {new})"
        log.warning(
            "rank %d: %s; step %d was lost", self.rank, what, step, extra={"step": step, "rank": self.rank}
        )
        raise DaemonRestarted(
            f"{what}; step {step} was lost, push again", old=old, new=new, rank=self.rank, step=step
        )

    def poll(self, step: int, timeout: float = 0.0) -> None:
        """Take in what the daemon sent (credits, grants, errors: raised), waiting up to ``timeout``
        seconds for the first message; progresses a NIXL pull first."""
        self.remote.progress()
        sock = self.socket()
        wait = int(timeout * 1000)
        while sock.poll(wait):
            msg = self._recv(sock)
            self.last_heard = time.monotonic()
            self.handle_async(msg, step)
            wait = 0
