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
from typing import TYPE_CHECKING, Any, Protocol

import torch
import zmq

from sidecar.config.settings import ForwardMover
from sidecar.errors import RefitError
from sidecar.forward.movers import NixlFailed, NixlMover, SourceSide, shm_region, support
from sidecar.forward.types import ForwardFailed, Job, Link, Request, Superseded
from sidecar.protocol.enums import Mover as MoverName
from transport.curve import Curve, own_keypair, read_key_file, set_client
from transport.epochs import fence
from transport.wire import Kind, Limits, Message, ProtocolError, decode, encode, safe_repr

if TYPE_CHECKING:  # pragma: no cover
    from sidecar.config.settings import DaemonConfig
    from sidecar.daemon.memory.generations import Arenas, Generation

log = logging.getLogger("refitd.forward")

RETRY_S = 0.5  # after a failed attempt, before the next one
PING_S = 1.0  # an idle forwarder pings its peer this often: a new instance means it restarted
IDLE_POLL_MS = 50
FRAME_LIMIT = 16 << 20  # forwarder's own cap on a data frame (the peer's max_frame_bytes may be lower)
_LIMITS = Limits(max_header_bytes=64 << 20, max_frames=4)


# --------------------------------------------------------------------------------------------------
# movers


class HoldContext(Protocol):
    """What the forwarders need of the serve loop: its arenas (holds are taken and released on the
    loop thread only) and a nudge when a release may let a waiting step claim its generation."""

    @property
    def arenas(self) -> Arenas: ...

    def maybe_claim(self) -> None: ...


class Mover(Protocol):
    """Moves one generation's bytes into the peer's claimed generation, after FORWARD_READY.

    Small on purpose: the forwarder owns the control channel (BEGIN, COMMIT, errors, timeouts); a
    mover only moves bytes and reports how many crossed the wire.
    """

    name: str

    def send(
        self, link: Link, job: Job, views: Mapping[str, torch.Tensor], ready: Message, deadline: float
    ) -> int: ...


def peer_count(msg: Message, key: str, default: int, *, least: int) -> int:
    """Field ``key`` of the inference daemon's ``msg``, an integer >= ``least``; anything else is a
    ProtocolError naming it, which fails this transfer (retried) and never the forwarder's thread."""
    value = msg.get(key, default)
    if type(value) is not int or value < least:
        raise ProtocolError(
            f"{msg.kind.name} from the inference daemon has {key}={safe_repr(value, 60)}: expected an integer "
            f">= {least}; is it a refitd of another version?"
        )
    return value


class ZmqMover:
    """Bytes as ZeroMQ frames on the control channel, in row order, under the peer's credits."""

    name = MoverName.ZMQ.value

    def send(
        self, link: Link, job: Job, views: Mapping[str, torch.Tensor], ready: Message, deadline: float
    ) -> int:
        credits = peer_count(ready, "credit_frames", 1, least=0)
        limit = min(FRAME_LIMIT, peer_count(ready, "max_frame_bytes", FRAME_LIMIT, least=1))
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
    ready: Message, offered: list[str] | tuple[str, ...] = (MoverName.ZMQ,), nixl: SourceSide | None = None
) -> Mover:
    """The mover the peer agreed to in FORWARD_READY, among those this forwarder offered."""
    said = ready.get("mover", MoverName.ZMQ.value)
    name = MoverName.parse(said) if isinstance(said, str) else None
    if name is None or name not in offered:
        raise ForwardFailed(
            f"the peer chose mover {said!r}, but this forwarder offered {[MoverName(m).value for m in offered]}"
            + (f" (the peer: {ready.get('mover_reason')})" if ready.get("mover_reason") else "")
        )
    if name is MoverName.NIXL and nixl is not None:
        return NixlMover(nixl)
    if name is not MoverName.ZMQ:
        raise ForwardFailed(f"the peer chose mover {said!r}, which this forwarder does not speak")
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
                mover=config.forward_mover,
                nixl_name=f"refitd-{instance}-forward{i}",
            )
            for i, ep in enumerate(config.peers)
        ]

    def start(self) -> None:
        for f in self.forwarders:
            f.start()
        log.info("forwarding every published generation to %s", ", ".join(self.peers))

    def published(self, gen: Generation, step: int, bytes_bf16: int, source: str) -> None:
        job = Job.of(gen, step, bytes_bf16, source, shm_region(gen.arena))
        for f in self.forwarders:
            f.offer(job)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        return {ep: dict(state) for ep, state in self.peers.items()}

    def drain(self, loop: HoldContext) -> None:
        """Answer hold requests, take releases and state changes from the forwarder threads."""
        released = False
        while True:
            try:
                what, fwd, payload = self.inbox.get_nowait()
            except queue.Empty:
                break
            if what is Request.HOLD:
                request, job = payload
                fwd.grant(request, self._hold(loop.arenas, fwd, job))
            elif what is Request.RELEASE:
                released |= loop.arenas.release(fwd.identity, payload.generation, payload.step)
            elif what is Request.STATE:
                self.peers[fwd.endpoint].update(payload)
        if released:
            loop.maybe_claim()

    @staticmethod
    def _hold(arenas: Arenas, fwd: Forwarder, job: Job) -> dict[str, torch.Tensor] | None:
        gen = arenas.generations[job.generation]
        if gen.step != job.step:
            return None  # reused by a newer step: the forwarder moves on to it
        arenas.hold(fwd.identity, gen)
        page, epoch = arenas.epochs, arenas.epoch(gen)
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
        mover: ForwardMover = ForwardMover.AUTO,
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
                except Exception as exc:  # expected failures, and any other: never the end of this thread
                    expected = isinstance(exc, (ForwardFailed, RefitError, ProtocolError, zmq.ZMQError))
                    if not expected:
                        log.exception("forwarder for %s met an unexpected error; it retries", self.endpoint)
                    if job is not None:
                        log.warning("forwarding step %d to %s failed: %s", job.step, self.endpoint, exc)
                        self._failures += 1
                        state = {"in_flight": None, "error": str(exc), "failures": self._failures}
                        self._post(Request.STATE, state)
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

    def _post(self, what: Request, payload: Any) -> None:
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
            self._post(Request.STATE, {"loaded": {k: msg.get(k) for k in ("step", "ok", "message")}})
        elif msg.kind is Kind.PONG:
            instance = msg.get("instance")
            if self._peer_instance is not None and instance != self._peer_instance:
                log.warning(
                    "%s restarted (instance %s): sending it the latest generation", self.endpoint, instance
                )
                self._done, self._peer_instance = None, None
                self._post(Request.STATE, {"instance": instance, "last_step": None})
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
        return peer_count(self._await({Kind.CREDIT}, deadline), "frames", 1, least=0)

    def poll_credit(self) -> int:
        credits = 0
        sock = self._socket()
        while sock.poll(0):
            msg = self._recv()
            if msg.kind is Kind.CREDIT and msg.get("transfer") == self.transfer:
                credits += peer_count(msg, "frames", 1, least=0)
            elif msg.kind is Kind.ERROR:
                raise ForwardFailed(f"{self.endpoint} refused it: {RefitError.from_wire(msg.fields)}")
            else:
                self._other(msg)
        return credits

    def _hold(self, job: Job, deadline: float) -> dict[str, torch.Tensor] | None:
        """Ask the serve loop for a hold on ``job``'s generation: its byte views, or None."""
        self._requests += 1
        request = self._requests
        self._post(Request.HOLD, (request, job))
        while True:
            try:
                got, views = self._grants.get(timeout=max(0.001, deadline - time.monotonic()))
            except queue.Empty:
                raise ForwardFailed("the serve loop did not answer a hold request in time") from None
            if got == request:
                return views
            if views is not None:  # the answer to a request that timed out: give it back
                self._post(Request.RELEASE, job)

    def _offer(self, job: Job) -> tuple[list[str], str]:
        """The movers to offer the peer (wire strings), and why NIXL is not among them."""
        ok, why = support(self.mover.value)
        if ok and job.region is None:
            ok, why = False, "this daemon's generation arenas are not host shared memory"
        if ok and self.mover is not ForwardMover.NIXL and (earlier := self._nixl.why_not()):
            ok, why = False, earlier
        if ok:
            try:
                self._nixl.endpoint()  # made before BEGIN: the peer's READY deadline is not spent on it
            except Exception as exc:
                self._nixl.fail(f"{type(exc).__name__}: {exc}")
                ok, why = False, f"NIXL set-up failed: {self._nixl.broken}"
        nixl, zmq_frames = MoverName.NIXL.value, MoverName.ZMQ.value
        if self.mover is ForwardMover.NIXL:
            if not ok:
                raise ForwardFailed(f"forward_mover=nixl, but {why}")
            return [nixl], ""
        return ([nixl, zmq_frames], "") if ok else ([zmq_frames], why)

    def _report_mover(self, mover: str, reason: str) -> None:
        if self._reported != (mover, reason):
            self._reported = (mover, reason)
            log.info("forwarding to %s over %s%s", self.endpoint, mover, f" ({reason})" if reason else "")
        self._post(Request.STATE, {"mover": mover, "mover_reason": reason})

    def _forward(self, job: Job) -> None:
        self.transfer = secrets.token_hex(6)
        offered, why_not = self._offer(job)
        deadline = time.monotonic() + self.timeout_s
        self._post(Request.STATE, {"in_flight": job.step})
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
        if mover.name == MoverName.NIXL.value:
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
            self._post(Request.RELEASE, job)
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
        self._post(Request.STATE, state)
