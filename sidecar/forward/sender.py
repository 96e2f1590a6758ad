"""Disaggregated layout: a trainer node's daemon forwards every published generation to the inference
nodes' daemons, which publish it to their engines as if they had quantized it (decision 8).

Trainer side: :class:`Forwarding`, owned by the serve loop, runs one :class:`Forwarder` thread per
peer, each with its own DEALER socket. The serve loop never waits on a peer: after each publish it
hands every forwarder the newest generation (a :class:`Job`: immutable metadata, no memory) and goes
on. A forwarder that is busy, or whose peer is down, simply sends the newest one when it can;
intermediate steps are skipped, so a node that fell behind or restarted catches up with the latest.

Holds (queue + wake, not snapshots): the forwarder reads the generation's shared memory directly, so
the generation must not be rewritten under it. Holds are daemon state, touched only on the serve
loop's thread: once its peer answered ``FORWARD_READY`` the forwarder puts a ``hold`` request on a
queue and wakes the loop (a message on the loop's inproc wake socket); the loop takes the hold if
the generation still holds that step and answers with read-only byte views, or refuses (a newer step
reused it). The forwarder posts ``release`` when the peer said ``FORWARDED`` or the transfer failed.
A forwarder holds a generation at most ``forward_timeout_s``, which the config keeps below
``reader_timeout_s``, so the daemon never drops such a hold while the bytes are being read; a dead
peer holds nothing (the hold is asked for only after the peer answered).

Protocol (``transfer`` is a fresh token per attempt, echoed in every reply; stale replies are ignored)::

    forwarder (trainer node)                      inference daemon
    FORWARD_BEGIN {step, source, transfer,   ->   claims its free generation (waiting while one of
                   rows, bytes, movers}           its engines holds it), carves it to ``rows``
                                             <-   FORWARD_READY {transfer, credit_frames,
                                                                 max_frame_bytes, mover,
                                                                 mover_reason, nixl?}
    FORWARD_DATA {transfer, tensor, offset}  ->   (ZeroMQ mover: 1 frame each, in order, under
                 + 1 data frame                    credits)                  <- CREDIT {transfer, frames}
    FORWARD_COMMIT {transfer}                ->   every byte arrived: publish (readers get
                                                  GENERATION, engines load: a LoadRound)
                                             <-   FORWARDED {transfer, step, generation, instance}
                                             <-   LOADED {step, ok, results, message} (its engines)
    FORWARD_ABORT {transfer}                 ->   drop the transfer (a newer step, or giving up)

The bulk bytes move through a :class:`Mover`. :class:`ZmqMover` sends ZeroMQ frames under credits;
``sidecar.forward.movers.NixlMover`` WRITEs them over NIXL (the inference daemon registers its
generation and answers with its metadata and region table; the forwarder WRITEs with a notification,
then commits over ZeroMQ; the inference daemon publishes once the notification arrived). NIXL is
used where both sides have it (``forward_mover = "auto"``), ZeroMQ frames otherwise; each peer's
``mover`` and ``mover_reason`` are in the trainer daemon's status.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
import zmq

from sidecar.cli.keygen import Curve, own_keypair, read_key_file, set_client
from sidecar.errors import ErrorKind, RefitError
from sidecar.forward.movers import (
    NixlFailed,
    NixlMover,
    NixlSetupFailed,
    SourceSide,
    TargetSide,
    shm_region,
    support,
)
from transport.epochs import fence
from transport.shm import Layout, Slot
from transport.wire import Kind, Limits, Message, ProtocolError, decode, dtype_from_name, dtype_name, encode

if TYPE_CHECKING:  # pragma: no cover
    from sidecar.config.settings import DaemonConfig
    from sidecar.daemon.loop import Daemon
    from sidecar.daemon.memory.generations import Generation

log = logging.getLogger("refitd.forward")

RETRY_S = 0.5  # after a failed attempt, before the next one
PING_S = 1.0  # an idle forwarder pings its peer this often: a new instance means it restarted
IDLE_POLL_MS = 50
FRAME_LIMIT = 16 << 20  # forwarder's own cap on a data frame (the peer's max_frame_bytes may be lower)
_LIMITS = Limits(max_header_bytes=64 << 20, max_frames=4)


@dataclass(frozen=True, slots=True)
class Job:
    """One published generation to forward: metadata only; the bytes come with a hold."""

    step: int
    generation: int
    rows: tuple[tuple[str, str, tuple[int, ...], int], ...]  # name, dtype, shape, nbytes
    nbytes: int  # what goes on the wire (FP8 where the plan quantizes)
    bytes_bf16: int  # what the same step weighed in BF16, as the trainer sent it
    source: str  # the trainer daemon's instance
    region: tuple[int, int] | None = None  # the arena's whole segment (address, size), if host shm
    offsets: tuple[int, ...] = ()  # each row's byte offset in the arena

    @classmethod
    def of(cls, gen: Generation, step: int, bytes_bf16: int, source: str) -> Job:
        layout = list(gen.arena.layout)
        rows = tuple((s.name, dtype_name(s.dtype), s.shape, s.nbytes) for s in layout)
        offsets = tuple(s.offset for s in layout)
        nbytes = sum(r[3] for r in rows)
        return cls(step, gen.index, rows, nbytes, bytes_bf16, source, shm_region(gen.arena), offsets)


class ForwardFailed(RuntimeError):
    """One attempt failed; the forwarder retries with the newest generation."""


class Superseded(Exception):
    """A newer generation was published before this one's bytes started moving."""


# --------------------------------------------------------------------------------------------------
# movers


class Mover(Protocol):
    """Moves one generation's bytes into the peer's claimed generation, after FORWARD_READY.

    Small on purpose: the forwarder owns the control channel (BEGIN, COMMIT, errors, timeouts); a
    mover only moves bytes and reports how many crossed the wire.
    """

    name: str

    def send(
        self, link: Forwarder, job: Job, views: Mapping[str, torch.Tensor], ready: Message, deadline: float
    ) -> int: ...


class ZmqMover:
    """Bytes as ZeroMQ frames on the control channel, in row order, under the peer's credits."""

    name = "zmq"

    def send(
        self, link: Forwarder, job: Job, views: Mapping[str, torch.Tensor], ready: Message, deadline: float
    ) -> int:
        credits = int(ready.get("credit_frames", 1))
        limit = min(FRAME_LIMIT, int(ready.get("max_frame_bytes", FRAME_LIMIT)))
        sent = 0
        for index, (name, _dtype, _shape, nbytes) in enumerate(job.rows):
            flat = views[name]
            for offset in range(0, nbytes, limit):
                while credits <= 0:
                    credits += link.await_credit(deadline)
                chunk = flat[offset : offset + limit].numpy()
                fields = {"transfer": link.transfer, "tensor": index, "offset": offset}
                link.send(Kind.FORWARD_DATA, fields, [chunk], copy=True)
                credits -= 1
                sent += len(chunk)
                credits += link.poll_credit()
        return sent


def choose_mover(
    ready: Message, offered: list[str] | tuple[str, ...] = ("zmq",), nixl: SourceSide | None = None
) -> Mover:
    """The mover the peer agreed to in FORWARD_READY, among those this forwarder offered."""
    name = ready.get("mover", "zmq")
    if name not in offered:
        raise ForwardFailed(
            f"the peer chose mover {name!r}, but this forwarder offered {list(offered)}"
            + (f" (the peer: {ready.get('mover_reason')})" if ready.get("mover_reason") else "")
        )
    if name == "nixl" and nixl is not None:
        return NixlMover(nixl)
    if name != "zmq":
        raise ForwardFailed(f"the peer chose mover {name!r}, which this forwarder does not speak")
    return ZmqMover()


# --------------------------------------------------------------------------------------------------
# trainer side: the manager (serve-loop thread) and one forwarder thread per peer


class Forwarding:
    """Every forwarder of a trainer daemon, and what each peer holds. Serve-loop thread only,
    except that forwarder threads put requests on ``inbox`` (and wake the loop)."""

    def __init__(self, ctx: zmq.Context, wake_endpoint: str, config: DaemonConfig, instance: str):
        curve: Curve | None = None
        if config.curve_server_key is not None:
            public, secret = own_keypair(config.curve_secret_key, config.curve_public_key)
            curve = (read_key_file(config.curve_server_key)[0], public, secret)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.peers: dict[str, dict[str, Any]] = {
            ep: {
                "last_step": None,
                "in_flight": None,
                "error": None,
                "mover": None,
                "mover_reason": None,
                "bytes": 0,
                "bytes_bf16": 0,
                "seconds": None,
                "instance": None,
                "loaded": None,
                "failures": 0,
                "curve": curve is not None,
            }
            for ep in config.peers
        }
        self.forwarders = [
            Forwarder(
                ep,
                ctx,
                wake_endpoint,
                self.inbox,
                curve,
                config.forward_timeout_s,
                instance,
                mover=config.forward_mover.value,
                nixl_name=f"refitd-{instance}-forward{i}",
            )
            for i, ep in enumerate(config.peers)
        ]

    def start(self) -> None:
        for f in self.forwarders:
            f.start()
        log.info("forwarding every published generation to %s", ", ".join(self.peers))

    def published(self, gen: Generation, step: int, bytes_bf16: int, source: str) -> None:
        job = Job.of(gen, step, bytes_bf16, source)
        for f in self.forwarders:
            f.offer(job)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        return {ep: dict(state) for ep, state in self.peers.items()}

    def drain(self, daemon: Daemon) -> None:
        """Answer hold requests, take releases and state changes from the forwarder threads."""
        released = False
        while True:
            try:
                what, fwd, payload = self.inbox.get_nowait()
            except queue.Empty:
                break
            if what == "hold":
                request, job = payload
                fwd.grant(request, self._hold(daemon, fwd, job))
            elif what == "release":
                released |= daemon.arenas.release(fwd.identity, payload.generation, payload.step)
            elif what == "state":
                self.peers[fwd.endpoint].update(payload)
        if released:
            daemon._maybe_claim()

    @staticmethod
    def _hold(daemon: Daemon, fwd: Forwarder, job: Job) -> dict[str, torch.Tensor] | None:
        gen = daemon.arenas.generations[job.generation]
        if gen.step != job.step:
            return None  # reused by a newer step: the forwarder moves on to it
        daemon.arenas.hold(fwd.identity, gen)
        page, epoch = daemon.arenas.epochs, daemon.arenas.epoch(gen)
        fwd.hold_intact = lambda: page.read(gen.index) == epoch  # read by its thread after the grant
        return {name: t.reshape(-1).view(torch.uint8) for name, t in gen.arena.tensors().items()}

    def close(self) -> None:
        for f in self.forwarders:
            f.stop()
        for f in self.forwarders:
            f.join()


class Forwarder:
    """One peer's forwarding thread: its own DEALER socket, its own progress."""

    def __init__(
        self,
        endpoint: str,
        ctx: zmq.Context,
        wake_endpoint: str,
        inbox: queue.SimpleQueue,
        curve: Curve | None,
        timeout_s: float,
        instance: str,
        *,
        mover: str = "auto",
        nixl_name: str | None = None,
    ):
        self.endpoint, self.identity = endpoint, f"forward:{endpoint}".encode()
        self._ctx, self._wake_endpoint, self._inbox, self._curve = ctx, wake_endpoint, inbox, curve
        self.timeout_s, self.instance, self.mover = timeout_s, instance, mover
        self._lock = threading.Lock()
        self._latest: Job | None = None
        self._grants: queue.SimpleQueue = queue.SimpleQueue()
        self._requests = 0
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"refitd-forward-{endpoint}", daemon=True)
        # thread-owned from here on
        self._sock: zmq.Socket | None = None
        self._wake: zmq.Socket | None = None
        self._done: Job | None = None  # the newest job the peer acknowledged
        self._peer_instance: str | None = None
        self._last_ping = 0.0
        self._failures = 0
        self._nixl = SourceSide(nixl_name or f"refitd-{instance}-{secrets.token_hex(4)}")
        self._reported: tuple[str, str] | None = None  # the mover (and why) last logged
        self.transfer = ""
        #: set by the serve loop with each granted hold: whether the generation's epoch is unchanged
        self.hold_intact: Callable[[], bool] = lambda: True

    # ---- any thread

    def start(self) -> None:
        self._thread.start()

    def offer(self, job: Job) -> None:
        with self._lock:
            self._latest = job

    def grant(self, request: int, views: dict[str, torch.Tensor] | None) -> None:
        self._grants.put((request, views))

    def stop(self) -> None:
        self._stopping.set()

    def join(self) -> None:
        self._thread.join(timeout=self.timeout_s + 5)

    # ---- the thread

    def _run(self) -> None:
        self._wake = self._ctx.socket(zmq.PUSH)
        self._wake.connect(self._wake_endpoint)
        try:
            while not self._stopping.is_set():
                job = self._pending()
                try:
                    if job is None:
                        self._idle()
                    else:
                        self._forward(job)
                except Superseded:
                    continue
                except (ForwardFailed, RefitError, ProtocolError, zmq.ZMQError) as exc:
                    if job is not None:
                        log.warning("forwarding step %d to %s failed: %s", job.step, self.endpoint, exc)
                        self._failures += 1
                        state = {"in_flight": None, "error": str(exc), "failures": self._failures}
                        self._post("state", state)
                    self._reset()
                    self._stopping.wait(RETRY_S)
        finally:
            self._reset()
            self._nixl.close()
            self._wake.close(linger=0)

    def _pending(self) -> Job | None:
        with self._lock:
            job = self._latest
        if job is None or (self._done is not None and self._done.step == job.step):
            return None
        return job

    def _newer(self, job: Job) -> bool:
        with self._lock:
            return self._latest is not None and self._latest.step != job.step

    def _post(self, what: str, payload: Any) -> None:
        self._inbox.put((what, self, payload))
        with contextlib.suppress(zmq.Again):
            self._wake.send(b"", zmq.NOBLOCK)

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            set_client(sock, self._curve)
            sock.connect(self.endpoint)
            self._sock = sock
        return self._sock

    def _reset(self) -> None:
        """Drop the socket: queued frames and stale replies go with it."""
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def send(self, kind: Kind, fields: dict[str, Any], frames=(), *, copy: bool = False) -> None:
        """Never blocks: a peer that is not connected (down, or refusing our CURVE key) fails the attempt."""
        try:
            self._socket().send_multipart(encode(Message(kind, fields, list(frames))), zmq.NOBLOCK, copy=copy)
        except zmq.Again:
            raise ForwardFailed(
                f"cannot send to {self.endpoint}: not connected"
                + (" (CURVE: is this daemon's key in the peer's curve_allowed_keys?)" if self._curve else "")
            ) from None

    def _recv(self) -> Message:
        return decode(self._socket().recv_multipart(copy=False), _LIMITS)

    def _idle(self) -> None:
        """Between jobs: take LOADED reports, and ping so that a restarted peer gets the latest again."""
        sock = self._socket()
        now = time.monotonic()
        if self._done is not None and now - self._last_ping > PING_S:
            self.send(Kind.PING, {})
            self._last_ping = now
        if sock.poll(IDLE_POLL_MS):
            self._other(self._recv())

    def _other(self, msg: Message) -> None:
        """A message that is not the reply being waited for."""
        if msg.kind is Kind.LOADED:
            self._post("state", {"loaded": {k: msg.get(k) for k in ("step", "ok", "message")}})
        elif msg.kind is Kind.PONG:
            instance = msg.get("instance")
            if self._peer_instance is not None and instance != self._peer_instance:
                log.warning(
                    "%s restarted (instance %s): sending it the latest generation", self.endpoint, instance
                )
                self._done, self._peer_instance = None, None
                self._post("state", {"instance": instance, "last_step": None})
        elif msg.kind is Kind.ERROR:
            log.warning("%s: %s", self.endpoint, RefitError.from_wire(msg.fields))

    def _await(self, kinds: set[Kind], deadline: float, job: Job | None = None) -> Message:
        """The next reply of ``kinds`` to this transfer; ForwardFailed on an ERROR or the deadline.
        With ``job``, Superseded as soon as a newer generation is waiting."""
        sock = self._socket()
        while True:
            if self._stopping.is_set():
                raise ForwardFailed("the daemon is stopping")
            if job is not None and self._newer(job):
                self.send(Kind.FORWARD_ABORT, {"transfer": self.transfer, "reason": "a newer step"})
                raise Superseded
            left = deadline - time.monotonic()
            if left <= 0:
                raise ForwardFailed(
                    f"no {'/'.join(k.name for k in kinds)} from {self.endpoint} within forward_timeout_s="
                    f"{self.timeout_s:g}: the inference daemon is down, stopped or too slow"
                    + (
                        "; check the CURVE keys (curve_server_key, its curve_allowed_keys)"
                        if self._curve
                        else ""
                    )
                )
            if not sock.poll(int(min(left, 0.1) * 1000)):
                continue
            msg = self._recv()
            if msg.kind is Kind.ERROR:
                raise ForwardFailed(f"{self.endpoint} refused it: {RefitError.from_wire(msg.fields)}")
            if msg.kind in kinds and msg.get("transfer") == self.transfer:
                return msg
            self._other(msg)

    def await_credit(self, deadline: float) -> int:
        return int(self._await({Kind.CREDIT}, deadline).get("frames", 1))

    def poll_credit(self) -> int:
        credits = 0
        sock = self._socket()
        while sock.poll(0):
            msg = self._recv()
            if msg.kind is Kind.CREDIT and msg.get("transfer") == self.transfer:
                credits += int(msg.get("frames", 1))
            elif msg.kind is Kind.ERROR:
                raise ForwardFailed(f"{self.endpoint} refused it: {RefitError.from_wire(msg.fields)}")
            else:
                self._other(msg)
        return credits

    def _hold(self, job: Job, deadline: float) -> dict[str, torch.Tensor] | None:
        """Ask the serve loop for a hold on ``job``'s generation: its byte views, or None."""
        self._requests += 1
        request = self._requests
        self._post("hold", (request, job))
        while True:
            try:
                got, views = self._grants.get(timeout=max(0.001, deadline - time.monotonic()))
            except queue.Empty:
                raise ForwardFailed("the serve loop did not answer a hold request in time") from None
            if got == request:
                return views
            if views is not None:  # the answer to a request that timed out: give it back
                self._post("release", job)

    def _offer(self, job: Job) -> tuple[list[str], str]:
        """The movers to offer the peer, and why NIXL is not among them."""
        ok, why = support(self.mover)
        if ok and job.region is None:
            ok, why = False, "this daemon's generation arenas are not host shared memory"
        if ok and self.mover != "nixl" and (earlier := self._nixl.why_not()):
            ok, why = False, earlier
        if ok:
            try:
                self._nixl.endpoint()  # made before BEGIN: the peer's READY deadline is not spent on it
            except Exception as exc:
                self._nixl.fail(f"{type(exc).__name__}: {exc}")
                ok, why = False, f"NIXL set-up failed: {self._nixl.broken}"
        if self.mover == "nixl":
            if not ok:
                raise ForwardFailed(f"forward_mover=nixl, but {why}")
            return ["nixl"], ""
        return (["nixl", "zmq"], "") if ok else (["zmq"], why)

    def _report_mover(self, mover: str, reason: str) -> None:
        if self._reported != (mover, reason):
            self._reported = (mover, reason)
            log.info("forwarding to %s over %s%s", self.endpoint, mover, f" ({reason})" if reason else "")
        self._post("state", {"mover": mover, "mover_reason": reason})

    def _forward(self, job: Job) -> None:
        self.transfer = secrets.token_hex(6)
        offered, why_not = self._offer(job)
        deadline = time.monotonic() + self.timeout_s
        self._post("state", {"in_flight": job.step})
        self.send(
            Kind.FORWARD_BEGIN,
            {
                "step": job.step,
                "source": job.source,
                "transfer": self.transfer,
                "rows": [[n, d, list(s)] for n, d, s, _ in job.rows],
                "bytes": job.nbytes,
                "bytes_bf16": job.bytes_bf16,
                "movers": offered,
            },
        )
        ready = self._await({Kind.FORWARD_READY, Kind.FORWARDED}, deadline, job)
        if ready.kind is Kind.FORWARDED:  # it already has this step (or a later one)
            self._acknowledged(job, ready, 0, 0.0, None)
            return
        mover = choose_mover(ready, offered, self._nixl)
        if mover.name == "nixl":
            reason = "NIXL on both sides"
        else:
            reason = why_not or str(ready.get("mover_reason") or "the peer chose ZeroMQ frames")
        self._report_mover(mover.name, reason)
        views = self._hold(job, deadline)
        if views is None:
            self.send(Kind.FORWARD_ABORT, {"transfer": self.transfer, "reason": "the generation was reused"})
            with self._lock:
                if self._latest is job:
                    self._done = job  # nothing newer will come of it; wait for the next publish
            raise Superseded
        t0 = time.monotonic()
        deadline = t0 + self.timeout_s  # how long the hold may last
        try:
            try:
                sent = mover.send(self, job, views, ready, deadline)
            except NixlFailed as exc:
                self._nixl.fail(str(exc))  # the next attempt offers ZeroMQ frames only (auto)
                with contextlib.suppress(ForwardFailed):
                    self.send(Kind.FORWARD_ABORT, {"transfer": self.transfer, "reason": "NIXL failed"})
                raise ForwardFailed(f"NIXL to {self.endpoint} failed: {exc}") from exc
            self._check_intact(job)
            self.send(Kind.FORWARD_COMMIT, {"transfer": self.transfer, "step": job.step})
            done = self._await({Kind.FORWARDED}, deadline)
        finally:
            del views
            self._post("release", job)
        self._acknowledged(job, done, sent, time.monotonic() - t0, mover.name)

    def _check_intact(self, job: Job) -> None:
        """Before COMMIT: if the daemon dropped this forwarder's hold and rewrote the generation while
        its bytes were being sent (the epoch moved), what the peer received may be torn: abort the
        transfer instead of letting the peer publish it (the next attempt sends what is live then)."""
        fence()  # the epoch re-read may not pass the sends' reads of the generation
        if self.hold_intact():
            return
        with contextlib.suppress(ForwardFailed, zmq.ZMQError):
            self.send(
                Kind.FORWARD_ABORT,
                {"transfer": self.transfer, "reason": "the generation was rewritten meanwhile"},
            )
        raise ForwardFailed(
            f"generation {job.generation} (step {job.step}) was rewritten while it was being sent: the daemon "
            "dropped the forwarder's hold (reader_timeout_s) and a newer step was written into it, so the bytes "
            "sent may be torn; the transfer was aborted, not committed. Keep forward_timeout_s below "
            "reader_timeout_s"
        )

    def _acknowledged(self, job: Job, reply: Message, sent: int, seconds: float, mover: str | None) -> None:
        self._done, self._peer_instance = job, reply.get("instance")
        self._last_ping = time.monotonic()
        state: dict[str, Any] = {
            "last_step": int(reply.get("step", job.step)),
            "in_flight": None,
            "error": None,
            "instance": self._peer_instance,
        }
        if mover is not None:
            state.update(mover=mover, bytes=sent, bytes_bf16=job.bytes_bf16, seconds=round(seconds, 6))
            log.info(
                "step %d forwarded to %s: %d bytes over %s in %.3fs (%d in BF16)",
                job.step,
                self.endpoint,
                sent,
                mover,
                seconds,
                job.bytes_bf16,
                extra={"step": job.step, "phase": "forward"},
            )
        self._post("state", state)


# --------------------------------------------------------------------------------------------------
# inference side: a mixin of the Daemon


@dataclass(slots=True)
class Inbound:
    """The transfer an inference daemon is receiving (at most one: a newer one replaces it)."""

    identity: bytes
    transfer: str
    step: int
    source: str
    layout: Layout
    slots: list[Slot]
    started: float
    last_seen: float
    sender: str = ""  # the forwarder's CURVE public key (z85): who may continue this transfer
    target: Generation | None = None
    flat: dict[str, torch.Tensor] = field(default_factory=dict)
    index: int = 0  # next tensor expected
    offset: int = 0  # next byte of it
    received: int = 0
    unacked: int = 0
    offered: tuple[str, ...] = ("zmq",)  # the movers the forwarder offered
    mover: str = "zmq"
    mover_reason: str = ""
    committer: bytes | None = None  # NIXL: FORWARD_COMMIT came, publish once the notification did

    def skip_empty(self) -> None:
        while self.index < len(self.slots) and self.offset >= self.slots[self.index].nbytes:
            self.index, self.offset = self.index + 1, 0

    @property
    def complete(self) -> bool:
        self.skip_empty()
        return self.index == len(self.slots)


FORWARD_KINDS = frozenset({Kind.FORWARD_BEGIN, Kind.FORWARD_DATA, Kind.FORWARD_COMMIT, Kind.FORWARD_ABORT})


def curve_user_id(frame: Any) -> str | None:
    """The CURVE public key (z85) the ZAP handler authenticated for a received frame; None when the
    connection has none (``ipc://``, or a listener without CURVE)."""
    try:
        user = frame.get("User-Id")
    except (zmq.ZMQError, AttributeError):
        return None
    return user or None


def forward_keys(config: DaemonConfig, allowed: set[bytes]) -> frozenset[str]:
    """The z85 public keys that may forward to this inference node: ``curve_trainer_keys`` when
    given, else every key allowed to connect."""
    from sidecar.cli.keygen import allowed_keys

    keys = allowed if config.curve_trainer_keys is None else allowed_keys(config.curve_trainer_keys)
    return frozenset(k.decode() if isinstance(k, bytes) else str(k) for k in keys)


class ForwardReceiver:
    """The inference side of forwarding, mixed into ``Daemon`` (which supplies ``arenas``, ``_send``,
    ``_go_live`` and the rest). Each FORWARD_* message is dispatched to ``handle_forward_*``.

    Forwarding is accepted only from this node's trainer daemons, identified by their CURVE public
    key over ``tcp://`` (``curve_trainer_keys``, by default every key of ``curve_allowed_keys``): never
    from the local ``ipc://`` socket (engine readers) nor from a listener without CURVE. The daemon
    sets ``sender_key`` (the ZAP User-Id of the message being handled) before each FORWARD_* handler.
    Step order is kept per trainer key: what one sender claims never moves another's."""

    inbound: Inbound | None = None
    forward_source: str | None = None  # the source (trainer daemon instance) of the latest forwarded step
    forward_keys: frozenset[str] = frozenset()  # z85 public keys allowed to forward here
    sender_key: str | None = None  # the CURVE key of the FORWARD_* message being handled, if any
    nixl_target: TargetSide | None = None  # made on the first transfer NIXL may carry

    def _inference_node(self) -> bool:
        from sidecar.config.settings import NodeRole

        return self.config.role is NodeRole.INFERENCE

    def _forwarder(self, msg: Message) -> str:
        """The sender's CURVE key if it may forward here; RefitError (UNAUTHORIZED) otherwise."""
        key = self.sender_key
        if key is None:
            raise RefitError(
                f"{msg.kind.name} refused: an inference node takes forwarded generations only from its trainer "
                "daemons, identified by their CURVE key over tcp://; this message came without one (the local "
                "ipc:// socket is for engine readers, and a listener without CURVE identifies nobody)",
                kind=ErrorKind.UNAUTHORIZED,
            )
        if key not in self.forward_keys:
            log.warning("refused %s from CURVE key %s, which is not a trainer daemon's", msg.kind.name, key)
            raise RefitError(
                f"{msg.kind.name} refused: CURVE key {key} may connect but is not a trainer daemon's; add its "
                "NAME.key.pub to this node's curve_trainer_keys if it is one",
                kind=ErrorKind.UNAUTHORIZED,
            )
        return key

    def handle_forward_begin(self, identity: bytes, msg: Message) -> None:
        if not self._inference_node():
            raise RefitError(
                "this daemon is not an inference node: start it with --layout disaggregated --role inference",
                kind=ErrorKind.INVALID,
            )
        sender = self._forwarder(msg)
        step, source = msg.require("step", int), msg.require("source", str)
        transfer, rows = msg.require("transfer", str), msg.require("rows", list)
        live = self.arenas.live_generation()
        done = self.forwarded_steps.get(sender)  # (source, step) this sender last published here
        if done is not None and done[0] == source and step <= done[1]:
            self._send(
                identity,
                Kind.FORWARDED,
                {
                    "transfer": transfer,
                    "step": done[1],
                    "generation": None if live is None else live.index,
                    "instance": self.instance,
                    "already": True,
                },
            )
            return
        try:
            layout = Layout.build((str(n), dtype_from_name(d), tuple(int(x) for x in s)) for n, d, s in rows)
        except (TypeError, ValueError) as exc:
            raise ProtocolError(f"FORWARD_BEGIN rows are not [name, dtype, shape]: {exc}") from None
        capacity = min(g.arena.size for g in self.arenas.generations)
        if layout.size > capacity:
            raise RefitError(
                f"forwarded step {step} needs {layout.size} bytes per generation but this daemon's publish "
                f"arenas hold {capacity}: restart it with a larger --publish-bytes",
                kind=ErrorKind.CAPACITY,
                step=step,
            )
        now = time.monotonic()
        old = self.inbound
        offered = msg.get("movers", ["zmq"])
        offered = tuple(str(m) for m in offered) if isinstance(offered, list) else ("zmq",)
        self.inbound = Inbound(
            identity, transfer, step, source, layout, list(layout), now, now, sender=sender, offered=offered
        )
        if old is not None:
            log.info("forwarded step %d replaces the unfinished transfer of step %d", step, old.step)
            self.inbound.target = old.target  # still claimed, still unpublished
            if old.target is not None:
                self._carve(self.inbound)
        from sidecar.daemon.loop import Peer

        self.peers[identity] = Peer(identity, "forwarder", now, name=f"forwarder of {source}")
        self._forward_claim()

    def _forward_claim(self) -> None:
        """Claim the free generation for the transfer in progress; FORWARD_READY once it is."""
        inbound = self.inbound
        if inbound is None or inbound.target is not None:
            return
        inbound.target = self.arenas.claim_target(time.monotonic(), self.config.reader_timeout_s)
        if inbound.target is not None:
            self._carve(inbound)

    def _carve(self, inbound: Inbound) -> None:
        inbound.target.step = None
        inbound.target.arena.relayout(inbound.layout)
        inbound.flat = {n: t.reshape(-1).view(torch.uint8) for n, t in inbound.target.arena.tensors().items()}
        fields: dict[str, Any] = {
            "transfer": inbound.transfer,
            "step": inbound.step,
            "credit_frames": self.config.credit_frames,
            "max_frame_bytes": self.config.max_frame_bytes,
        }
        inbound.mover, inbound.mover_reason, offer = self._choose_mover(inbound)
        fields.update(mover=inbound.mover, mover_reason=inbound.mover_reason)
        if offer is not None:
            fields["nixl"] = offer
        self._send(inbound.identity, Kind.FORWARD_READY, fields)

    def _choose_mover(self, inbound: Inbound) -> tuple[str, str, dict[str, Any] | None]:
        """``(mover, why, READY's nixl field)``: NIXL when the forwarder offers it and it works here."""
        if "nixl" not in inbound.offered:
            return "zmq", "the forwarder did not offer NIXL", None
        ok, why = support(self.config.forward_mover.value)
        if ok and self.nixl_target is not None and self.nixl_target.broken is not None:
            ok, why = False, f"NIXL set-up failed earlier on the inference daemon: {self.nixl_target.broken}"
        if not ok:
            return "zmq", f"inference daemon: {why}", None
        if self.nixl_target is None:
            self.nixl_target = TargetSide(f"refitd-{self.instance}")
        try:
            offer = self.nixl_target.offer(inbound.target.arena)
        except NixlSetupFailed as exc:
            self.nixl_target.broken = str(exc)
            log.warning("NIXL set-up failed, taking forwarded bytes as ZeroMQ frames: %s", exc)
            return "zmq", f"NIXL set-up failed on the inference daemon: {exc}", None
        return "nixl", "NIXL on both sides", offer

    def _inbound(self, identity: bytes, msg: Message) -> Inbound:
        sender = self._forwarder(msg)
        inbound = self.inbound
        transfer = msg.require("transfer", str)
        if (
            inbound is None
            or inbound.identity != identity
            or inbound.sender != sender
            or inbound.transfer != transfer
        ):
            raise RefitError(
                f"{msg.kind.name} for transfer {transfer}, which is not in progress here (this daemon "
                "restarted, timed it out, or a newer transfer replaced it)",
                kind=ErrorKind.UNKNOWN_PEER,
            )
        if inbound.target is None:
            raise ProtocolError(f"{msg.kind.name} before FORWARD_READY")
        inbound.last_seen = time.monotonic()
        return inbound

    def handle_forward_data(self, identity: bytes, msg: Message) -> None:
        inbound = self._inbound(identity, msg)
        try:
            self._take_frame(inbound, msg)
        except (ProtocolError, RefitError):
            self._drop_inbound("it sent a bad data frame")
            raise

    def _take_frame(self, inbound: Inbound, msg: Message) -> None:
        inbound.skip_empty()
        index, offset = msg.require("tensor", int), msg.require("offset", int)
        if len(msg.frames) != 1 or (index, offset) != (inbound.index, inbound.offset):
            raise ProtocolError(
                f"FORWARD_DATA for tensor {index} at byte {offset}: expected one frame for tensor "
                f"{inbound.index} at byte {inbound.offset}"
            )
        data = msg.frames[0].buffer if hasattr(msg.frames[0], "buffer") else memoryview(msg.frames[0])
        slot = inbound.slots[index]
        if offset + len(data) > slot.nbytes or not len(data):
            raise ProtocolError(f"FORWARD_DATA overruns {slot.name!r} ({slot.nbytes} bytes)")
        inbound.flat[slot.name][offset : offset + len(data)].copy_(torch.frombuffer(data, dtype=torch.uint8))
        inbound.offset += len(data)
        inbound.received += len(data)
        inbound.unacked += 1
        if inbound.unacked >= max(1, self.config.credit_frames // 2):
            self._send(
                inbound.identity, Kind.CREDIT, {"transfer": inbound.transfer, "frames": inbound.unacked}
            )
            inbound.unacked = 0

    def handle_forward_commit(self, identity: bytes, msg: Message) -> None:
        inbound = self._inbound(identity, msg)
        if inbound.mover == "nixl" and inbound.received == 0:
            inbound.committer = identity  # published by _forward_progress once the WRITE's notification is in
            self._forward_progress()
            return
        self._publish_inbound(identity, inbound)

    def _forward_progress(self) -> None:
        """Progress the NIXL endpoint while a NIXL transfer is in flight (the serve loop, each tick);
        publish a committed one once its WRITE notification arrived."""
        inbound = self.inbound
        if inbound is None or inbound.mover != "nixl" or self.nixl_target is None:
            return
        self.nixl_target.progress()
        if inbound.committer is not None and self.nixl_target.take(inbound.transfer):
            inbound.received = inbound.layout.size
            inbound.index, inbound.offset = len(inbound.slots), 0
            self._publish_inbound(inbound.committer, inbound)

    def _forward_nixl_busy(self) -> bool:
        inbound = self.inbound
        return inbound is not None and inbound.mover == "nixl" and inbound.target is not None

    def _forward_close(self) -> None:
        if self.nixl_target is not None:
            self.nixl_target.close()
            self.nixl_target = None

    def _publish_inbound(self, identity: bytes, inbound: Inbound) -> None:
        if not inbound.complete:
            slot = inbound.slots[inbound.index]
            self._drop_inbound("it committed before sending every byte")
            raise RefitError(
                f"FORWARD_COMMIT of step {inbound.step} before every byte arrived (tensor {slot.name!r} "
                f"at byte {inbound.offset} of {slot.nbytes})",
                kind=ErrorKind.COVERAGE,
                step=inbound.step,
            )
        self.inbound = None
        self.forward_source = inbound.source
        self.forwarded_steps[inbound.sender] = (inbound.source, inbound.step)
        now = time.monotonic()
        record = {
            "step": inbound.step,
            "generation": inbound.target.index,
            "bytes_in": inbound.received,
            "bytes_out": inbound.layout.size,
            "seconds": {"receive": round(now - inbound.started, 6), "total": round(now - inbound.started, 6)},
            "forwarded_from": inbound.source,
            "mover": inbound.mover,
        }
        log.info(
            "forwarded step %d published in generation %d: %d bytes received over %s in %.3fs",
            inbound.step,
            inbound.target.index,
            inbound.received,
            inbound.mover,
            now - inbound.started,
            extra={"step": inbound.step, "phase": "publish", "record": record},
        )
        from sidecar.daemon.step import StepState

        state = StepState(inbound.step, 0, now)
        state.phases.first_begin = state.phases.all_begun = inbound.started
        state.phases.all_received = state.phases.published = now
        state.bytes_in = inbound.received
        self._go_live(
            inbound.target,
            record,
            state,
            [identity],
            Kind.FORWARDED,
            {"transfer": inbound.transfer, "instance": self.instance},
        )

    def handle_forward_abort(self, identity: bytes, msg: Message) -> None:
        sender = self._forwarder(msg)
        inbound = self.inbound
        if (
            inbound is not None
            and inbound.identity == identity
            and inbound.sender == sender
            and inbound.transfer == msg.get("transfer")
        ):
            self._drop_inbound(f"the forwarder aborted it: {msg.get('reason', 'no reason given')}")

    def _drop_inbound(self, why: str) -> None:
        inbound, self.inbound = self.inbound, None
        if inbound is not None:
            log.warning("dropped the transfer of forwarded step %d: %s", inbound.step, why)
            if inbound.target is not None:
                inbound.target.step = None  # half-written: never handed out

    def _forward_timers(self, now: float) -> None:
        inbound = self.inbound
        if inbound is None:
            return
        if now - inbound.last_seen > self.config.forward_timeout_s:
            self._drop_inbound(f"the forwarder was silent for {self.config.forward_timeout_s:g} s")
        else:
            self._forward_claim()
