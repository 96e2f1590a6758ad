"""The refitd serve loop: trainer ranks push, the daemon seals, quantizes and publishes generations.

One ROUTER socket carries every peer (trainer clients, engine readers, forwarders). The loop owns
the sockets and one routing table ``{Kind: (PeerRole, handler)}``: a request's role is checked once,
before any handler runs. The handlers live in components built with the loop as their narrow
context (sidecar.daemon.context): trainers (sidecar.daemon.trainers), engines and readers
(sidecar.daemon.engines), the step's pipeline (sidecar.daemon.pipeline), NIXL pulls
(sidecar.daemon.pull) and inbound forwarding (sidecar.forward.receiver). How a step ends (publish,
fail, time out) is sidecar.daemon.lifecycle; SIGHUP's reload and the drain on stop are
sidecar.daemon.control; the quantizer's warm-up is sidecar.daemon.warmup. The step, plan, arenas,
worker and history stay here, the state those components share. The loop is single-threaded:
only the quantization worker (and, on a trainer node, the forwarders) run beside it.

Lifecycle::

    daemon = Daemon(config)      # plan (from hf_config) and arenas allocated here, once
    daemon.start()               # bind the control socket
    daemon.serve_forever()       # until request_stop()
    daemon.close()               # abort any step, unlink every segment, remove the socket

Step protocol (per rank): HELLO -> WELCOME; BEGIN -> READY (once every rank began and the
declarations cover every tensor exactly once); data (local: write into staging, PIECE_DONE; remote:
the daemon READs the pieces READY lists in ``pull`` over NIXL and says PULLED, the rest come as SHARD
frames under credits: sidecar.daemon.pull); COMMIT -> ACK; then RESULT (published) or ERROR (on every
rank). With a staging ring (``staging_regions``) the data of each layer group goes only after the
daemon's SLOT for that group, into the region it names (sidecar.daemon.memory.staging).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import zmq

from sidecar.config.settings import (
    ArenaKind,  # noqa: F401 (tests reach it here)
    DaemonConfig,
    NodeRole,
)
from sidecar.daemon import control
from sidecar.daemon import status as status_report
from sidecar.daemon.engines import Engines
from sidecar.daemon.faults import stop_on_sticky
from sidecar.daemon.lifecycle import StepLifecycle
from sidecar.daemon.memory.generations import Arenas
from sidecar.daemon.peers import Peers
from sidecar.daemon.pipeline import Pipeline
from sidecar.daemon.pull import Pulls
from sidecar.daemon.setup import bind, make_arenas, record_segments, refit_spec, segments_file
from sidecar.daemon.step import StepState
from sidecar.daemon.streams import Streams
from sidecar.daemon.trainers import Trainers
from sidecar.daemon.warmup import warm_up
from sidecar.daemon.worker import QuantWorker
from sidecar.daemon.workers import QuantWorkers, make_worker
from sidecar.errors import ErrorKind, RefitError
from sidecar.forward.receiver import Receiver
from sidecar.forward.sender import Forwarding
from sidecar.forward.types import FORWARD_KINDS, curve_user_id
from sidecar.numerics import kernels
from sidecar.ops.gcpause import StepHold, freeze_long_lived
from sidecar.ops.observers import Observer, notify
from sidecar.plan.build import RefitPlan, plan_from_hf_config
from sidecar.protocol.enums import PeerRole
from transport.nixl import keep_signal_handlers
from transport.wire import HeaderTooLarge, Kind, Limits, Message, ProtocolError, decode, encode, safe_repr

log = logging.getLogger("refitd.daemon")

MAX_MESSAGES_PER_TICK = 256
CLOSE_LINGER_MS = 500
MAX_ERROR_CHARS = 16384  # the longest error message sent to a peer (a manifest mismatch lists many names)
MAX_QUOTE_CHARS = 300  # how much of an exception's repr an INTERNAL error quotes
GENERIC_INT_FIELDS = ("step", "rank")  # integers (or nil) in whichever message carries them
#: what a peer without the role a request needs is told, per role
INTRODUCE = {
    PeerRole.TRAINER: "say HELLO first (the daemon restarted, or this peer never introduced itself)",
    PeerRole.READER: "ATTACH first (the daemon restarted, or this reader never attached)",
}

Handler = Callable[[bytes, Message], None]


class Daemon:
    """The serve loop: sockets, the routing table, ticks and the shared state; the rest in components."""

    def __init__(self, config: DaemonConfig, *, observers: Iterable[Observer] = ()):
        self.config = config
        self.observers: list[Observer] = list(observers)
        self.instance = secrets.token_hex(8)
        self.limits = Limits(
            max_header_bytes=config.max_header_bytes,
            max_frame_bytes=config.max_frame_bytes,
            max_frames=max(4, config.credit_frames),
        )
        hf_config = json.loads(Path(config.hf_config).read_text()) if config.hf_config is not None else None
        self.spec = refit_spec(config, hf_config)
        self.plan: RefitPlan | None = None  # set here or by adopt_plan, nowhere else
        self.arenas: Arenas | None = None
        self.peers = Peers()
        self.step: StepState | None = None  # the step in progress: ending it is dropping this object
        self._gc_hold = StepHold()  # the collector off while a step is in flight (tick)
        self.events = 0  # counts HELLOs and failures, to order them
        self.last_step: int | None = None
        self.history: list[dict[str, Any]] = []  # last few steps, for status
        self.message_errors: dict[str, int] = {}  # messages answered with an error, by ErrorKind value
        self._stop = False
        self._force = False  # a second stop request: no draining
        self.fatal: str | None = None  # a sticky CUDA error stopped the daemon (sidecar.daemon.faults)
        self.draining = False  # stopping after the step in flight: new steps are refused
        self._reload = None  # SIGHUP: a callable returning the new config, applied on the loop
        self._closed = False
        self.zmq_ctx = zmq.Context()  # (the components' ``ctx`` is this loop itself)
        self.router: zmq.Socket | None = None
        self.wake: zmq.Socket | None = None
        self.worker: QuantWorker | QuantWorkers | None = None
        self.forwarding: Forwarding | None = None  # trainer node of a disaggregated layout
        self.auth = None  # the ZAP handler enforcing curve_allowed_keys
        self.local_listen: str | None = None  # ipc:// beside a tcp:// listen, for this node's engines
        self.prefix = f"refitd-{os.getuid()}-{self.instance[:8]}"
        self.quantizer: kernels.WarmUp | None = None  # which quantizer runs, and why (status, metrics)
        # the components, each given this loop as its narrow context (sidecar.daemon.context)
        self.lifecycle = StepLifecycle(self)  # publishes, fails and times out the step
        self.pipeline = Pipeline(self)
        self.pulls = Pulls(self)
        self.pipeline.pulls = self.pulls  # a granted ring group's remote pieces are READ at once
        self.streams = Streams(self)  # streamed refit: engines load each layer group as it is written
        self.engine_side = Engines(self)
        self.engines = self.engine_side.engines  # attached engine workers (observers read it)
        self.trainers = Trainers(self, self.pipeline, self.pulls, self.engine_side)
        self.receiver = Receiver(self)
        self.routes: dict[Kind, tuple[PeerRole | None, Handler]] = {
            **self.trainers.routes(),
            **self.engine_side.routes(),
            **self.receiver.routes(),
            Kind.STATUS: (None, self._status),
        }

        if config.hf_config is not None:
            self.plan = plan_from_hf_config(hf_config, self.spec, share=config.share)
        self.arenas = make_arenas(self.prefix, config, self.plan)
        self.arenas.on_revoke = self.engine_side.hold_revoked  # tell a reader whose hold a step drops
        record_segments(config, self.arenas.segment_names())

    def start(self) -> None:
        self.router = self.zmq_ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.LINGER, 0)
        self.auth, self.local_listen, self.receiver.forward_keys = bind(
            self.router, self.zmq_ctx, self.config
        )
        wake_endpoint = f"inproc://refitd-wake-{self.instance}"
        self.wake = self.zmq_ctx.socket(zmq.PULL)
        self.wake.bind(wake_endpoint)
        self.worker = make_worker(self.zmq_ctx, wake_endpoint, self.arenas.lanes)  # one per GPU
        self.quantizer = self._warm_up()
        if self.config.role is NodeRole.TRAINER:
            self.forwarding = Forwarding(self.zmq_ctx, wake_endpoint, self.config, self.instance)
            self.pipeline.forwarding = self.forwarding
            self.forwarding.start()
        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)
        self.poller.register(self.wake, zmq.POLLIN)
        log.info(
            "refitd listening on %s (instance %s, world_size %d, format %s)",
            self.config.listen,
            self.instance,
            self.config.world_size,
            self.spec.fmt.value,
        )
        self.pulls.probe(self.arenas.staging, self.arenas.staging_regions)
        notify(self.observers, "on_ready", self)

    @property
    def ready(self) -> bool:
        return self.router is not None and self.arenas is not None

    def request_stop(self) -> None:
        """First call: stop (draining as configured); a second: stop draining at once."""
        if self._stop:
            self._force = True
        self._stop = True

    def serve_forever(self, poll: Callable[[Daemon], None] | None = None) -> None:
        """Tick until stopped; ``poll(self)`` after every tick (the CLI's signal flags, cli.serve.Signals)."""
        freeze_long_lived()  # startup's objects (torch, a configured plan): out of every collection
        while not self._stop:
            self.tick()
            if poll is not None:
                poll(self)
            if self._reload is not None:
                load, self._reload = self._reload, None
                self.reload(load)
        control.drain(self, poll)

    def request_reload(self, load_config) -> None:
        """Re-read the configuration (``load_config() -> DaemonConfig``) on the serve loop (SIGHUP)."""
        self._reload = load_config

    def reload(self, load_config) -> list[str]:
        """Apply what may change safely (timeouts, logging, drain); name what needs a restart
        (sidecar.daemon.control)."""
        return control.reload(self, load_config)

    def tick(self, timeout_ms: int | None = None) -> None:
        """One turn of the loop: messages, worker results, timers."""
        if timeout_ms is None:
            timeout_ms = int(max(10, min(100, self.config.heartbeat_interval_s * 250)))
        if self.receiver.busy() or self.pulls.busy:
            timeout_ms = min(timeout_ms, 1)  # a NIXL WRITE lands here: progress the endpoint often
        events = dict(self.poller.poll(timeout_ms))
        # A step of many tensors allocates many small objects per turn (pieces, units, results): no
        # collection while a step is in flight, one after it (each walks every object the step keeps).
        with self._gc_hold.turn(lambda: self.step is not None):
            try:
                self._turn(events)
            except Exception as exc:  # a bug outside any one message (timers, results): fail the step, go on
                self._internal_error(
                    None, "a turn of the serve loop", exc, None if self.step is None else self.step.step
                )

    def _turn(self, events: dict) -> None:
        if self.wake in events:
            while True:
                try:
                    self.wake.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
        self.pipeline.drain_worker()
        if self.router in events:
            for _ in range(MAX_MESSAGES_PER_TICK):
                try:
                    frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._serve_message(frames)
            self.trainers.flush_credits()
        self.pipeline.drain_worker()
        if self.forwarding is not None:
            self.forwarding.drain(self)
        self.receiver.progress()
        self.pulls.progress()
        now = time.monotonic()
        if self.forwarding is not None:
            # a forwarder thread may have created a UCX backend, which replaces SIGHUP's disposition
            # under Python's handler; only this (main) thread can put it back (transport.nixl)
            keep_signal_handlers()
        self._check_timers(now)
        notify(self.observers, "on_tick", self, now)

    def close(self) -> None:
        """Abort the step in flight, free every segment, close sockets (idempotent)."""
        if self._closed:
            return
        self._closed = True
        notify(self.observers, "on_stopping", self)
        if self.step is not None:
            self.fail_step(
                RefitError("the daemon is shutting down", kind=ErrorKind.SHUTDOWN, step=self.step.step)
            )
        if self.worker is not None:
            self.worker.close()
        if self.forwarding is not None:
            self.forwarding.close()
        self.receiver.close()
        self.pulls.close()
        if self.arenas is not None:
            self.arenas.close()
        if self.router is not None:
            self.router.close(linger=CLOSE_LINGER_MS)  # the SHUTDOWN errors just queued still go out
        if self.wake is not None:
            self.wake.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
        self._gc_hold.release()
        self.zmq_ctx.term()
        for listen in (self.config.listen, self.local_listen or ""):
            if listen.startswith("ipc://"):
                Path(listen.removeprefix("ipc://")).unlink(missing_ok=True)
        segments_file(self.config).unlink(missing_ok=True)

    def send(self, identity: bytes, kind: Kind, fields: dict[str, Any] | None = None, frames=()) -> bool:
        """Every reply carries this start's ``instance``: a client that sees a new one knows the daemon
        restarted (and that the step it had in flight was lost). A reply to a trainer rank also carries
        its connection's current ``attempt`` (the one its latest HELLO opened; ``fields`` may name
        another, or None for none): messages on a connection are handled in order and answered at
        once, so that is the attempt whose message is answered, and the rank ignores answers to an
        attempt it gave up (a late COMMIT's)."""
        fields = {**(fields or {}), "instance": self.instance}
        if "attempt" not in fields:
            peer = self.peers.get(identity)
            fields["attempt"] = peer.attempt if peer is not None else None
        if fields["attempt"] is None:
            del fields["attempt"]
        try:
            self.router.send_multipart([identity, *encode(Message(kind, fields, list(frames)))], zmq.NOBLOCK)
            return True
        except zmq.ZMQError as exc:  # the peer is gone (ROUTER_MANDATORY) or not reading
            log.debug("cannot send %s to a peer: %s", kind.name, exc)
            return False

    def send_error(self, identity: bytes, err: RefitError, *, untagged: bool = False) -> None:
        """Answer ``identity`` with ``err``; never raises (it runs inside error handling).
        ``untagged``: name no attempt (a step failure told a rank that has no attempt at the step yet)."""
        try:
            fields = {**err.to_wire(), **({"attempt": None} if untagged else {})}
            if len(fields["message"]) > MAX_ERROR_CHARS:
                cut = len(fields["message"]) - MAX_ERROR_CHARS
                fields["message"] = fields["message"][:MAX_ERROR_CHARS] + f"... ({cut} more characters)"
            self.send(identity, Kind.ERROR, fields)
        except Exception:
            log.exception("could not send an error to a peer")

    # ------------------------------------------------------------------------------------------
    # dispatch: one routing table, the role checked once

    def _serve_message(self, frames: list) -> None:
        """Handle one message; nothing it raises leaves the serve loop: a bug is logged with its
        traceback, counted, and answered to the sender as an INTERNAL error."""
        try:
            self._dispatch(frames)
        except Exception as exc:
            identity = frames[0].bytes if frames else None
            self._internal_error(identity, "a message", exc, None)

    def _dispatch(self, frames: list) -> None:
        identity = frames[0].bytes
        try:
            msg = decode(frames[1:], self.limits)
            _check_generic_fields(msg)
        except ProtocolError as exc:
            text = str(exc)
            if isinstance(exc, HeaderTooLarge):  # a BEGIN of very many pieces, most likely
                text += (
                    " (the daemon's max_header_bytes); a BEGIN takes about 40 bytes per piece, 100 with a "
                    "NIXL offer: raise max_header_bytes (--max-header-bytes, REFITD_MAX_HEADER_BYTES) or "
                    "send fewer, larger tensors"
                )
            log.warning("refused a malformed message: %s", text)
            self._message_error(ErrorKind.PROTOCOL)
            if not self.trainers.step_protocol_error(identity, ProtocolError(text)):
                self.send_error(identity, RefitError(text, kind=ErrorKind.PROTOCOL))
            return
        peer = self.peers.get(identity)
        if peer is not None:
            peer.last_seen = time.monotonic()
        route = self.routes.get(msg.kind)
        if route is None:
            self._message_error(ErrorKind.PROTOCOL)
            self.send_error(
                identity, RefitError(f"{msg.kind.name} is not a request", kind=ErrorKind.PROTOCOL)
            )
            return
        role, handler = route
        if role is not None and (peer is None or peer.role is not role):
            self._message_error(ErrorKind.UNKNOWN_PEER)
            self.send_error(identity, RefitError(INTRODUCE[role], kind=ErrorKind.UNKNOWN_PEER))
            return
        if msg.kind in FORWARD_KINDS:  # who sent it: its CURVE key (ZAP User-Id), none over ipc://
            self.receiver.sender_key = curve_user_id(frames[1])
        self._handle(handler, identity, msg)

    def _handle(self, handler: Handler, identity: bytes, msg: Message) -> None:
        """Run one handler; whatever it raises fails at most the step, never the daemon."""
        try:
            try:
                handler(identity, msg)
            except ProtocolError as exc:
                self._message_error(ErrorKind.PROTOCOL)
                if self.trainers.step_protocol_error(
                    identity, exc
                ):  # a rank of the step: every rank hears it
                    return
                self.send_error(identity, RefitError(str(exc), kind=ErrorKind.PROTOCOL, step=msg.get("step")))
            except RefitError as exc:
                self._message_error(exc.kind)
                if self.step is not None and exc.step == self.step.step:
                    self.fail_step(exc)
                else:
                    self.send_error(identity, exc)
        except Exception as exc:  # a bug (in the handler or in answering it): report it, keep serving
            self._internal_error(identity, msg.kind.name, exc, msg.get("step"))

    def _internal_error(self, identity: bytes | None, what: str, exc: BaseException, step) -> None:
        """A bug met while handling ``what``: log it with its traceback, count it, fail the step the
        message belongs to (or answer its sender) with an INTERNAL error. Never raises."""
        try:
            if stop_on_sticky(self, exc):
                return
            log.error("internal error handling %s: %s", what, safe_repr(exc), exc_info=exc)
            self._message_error(ErrorKind.INTERNAL)
            err = RefitError(
                f"internal error handling {what}: {safe_repr(exc, MAX_QUOTE_CHARS)}; please report it",
                kind=ErrorKind.INTERNAL,
            )
            if self.step is not None and isinstance(step, int) and step == self.step.step:
                self.fail_step(RefitError(err.message, kind=err.kind, step=self.step.step))
            elif identity is not None:
                self.send_error(identity, err)
        except Exception:  # even the report failed (a bug in fail_step?): the loop must go on
            log.critical("internal error while reporting an internal error", exc_info=True)

    def _message_error(self, kind: ErrorKind) -> None:
        """Count a message answered with an error (by kind: status and the metrics show them)."""
        self.message_errors[kind.value] = self.message_errors.get(kind.value, 0) + 1
        notify(self.observers, "on_message_error", self, kind)

    def _status(self, identity: bytes, msg: Message) -> None:
        self.send(identity, Kind.STATUS_REPLY, self.status())

    def status(self) -> dict[str, Any]:
        """What ``refitd status`` shows (sidecar.daemon.status)."""
        return status_report.status(self)

    # ------------------------------------------------------------------------------------------
    # the step: begun by a trainer BEGIN, ended by the lifecycle (published or failed), nowhere else

    def begin_step(self, state: StepState) -> None:
        self.step = state

    def end_step(self) -> None:
        """Drop the step in progress: its target, deferred and parked units go with it."""
        self.step = None

    def tensor_complete(self, name: str) -> None:
        self.pipeline.tensor_complete(name)

    def tensors_complete(self, names: list[str]) -> None:
        self.pipeline.tensors_complete(names)

    def adopt_plan(self, plan: RefitPlan, *, invalidate: bool = False) -> None:
        """Carve the arenas for ``plan`` (ArenaTooSmall when they cannot hold it), then use it;
        ``invalidate``: forget every published generation (the layout changed)."""
        self.arenas.apply_plan(plan)
        before = None if self.plan is None else (self.plan.spec.fmt, self.plan.spec.params)
        self.plan = plan
        freeze_long_lived()  # the plan lives as long as the daemon: no collection walks it again
        if invalidate:
            self.arenas.invalidate()
        changed = before is not None and before != (plan.spec.fmt, plan.spec.params)
        if changed and getattr(self, "quantizer", None) is not None:
            # an engine's format parameters (INT4 group, NVFP4 names): their 4-bit kernels are probed and
            # compiled now, no step in progress, so status says which quantizer runs them (the torch
            # reference, with the reason, when the probe fails or the kernels cannot take them). A first
            # plan (from the first push) is left to the step, as before.
            self.quantizer = self._warm_up()

    def next_event(self) -> int:
        self.events += 1
        return self.events

    def maybe_claim(self) -> None:
        """A generation may have been released: the inbound transfer, then the step, claim theirs."""
        self.receiver.claim()
        self.pipeline.claim(time.monotonic())

    def start_pending(self) -> None:
        """Run the BEGINs kept for a later step again, once no step is in progress."""
        for identity, msg in self.trainers.take_pending():
            self._handle(self.trainers.handle_begin, identity, msg)

    def publish(
        self,
        gen,
        record: dict[str, Any],
        state: StepState,
        trainers: list[bytes],
        reply=Kind.RESULT,
        extra=None,
    ) -> None:
        """Flip ``gen`` live and answer ``trainers`` (sidecar.daemon.lifecycle)."""
        self.lifecycle.publish(gen, record, state, trainers, reply, extra)

    def fail_step(self, err: RefitError) -> None:
        """Fail the step in progress on every rank (sidecar.daemon.lifecycle)."""
        self.lifecycle.fail(err)

    # ------------------------------------------------------------------------------------------
    # timers

    def _check_timers(self, now: float) -> None:
        self.engine_side.expire_readers(now)  # first: a dead reader's holds must not hold up the step below
        if self.step is not None:
            if self.lifecycle.check(now):  # failed: past its deadline, or a rank went silent
                return
            self.pipeline.claim(now)
        if self.engine_side.rounds:
            self.engine_side.finish_rounds(now)
        self.receiver.timers(now)
        if self.step is None:
            self.start_pending()

    def _warm_up(self) -> kernels.WarmUp:
        """Probe and compile the quantizer where the arenas live (sidecar.daemon.warmup)."""
        return warm_up(self.plan, self.arenas)


def _check_generic_fields(msg: Message) -> None:
    """The fields any message may carry are checked before a handler (or an error path) uses them:
    ``step`` and ``rank`` are integers, or nil."""
    for key in GENERIC_INT_FIELDS:
        value = msg.fields.get(key)
        if value is not None and type(value) is not int:
            raise ProtocolError(
                f"{msg.kind.name} field {key!r} has type {type(value).__name__} ({safe_repr(value, 60)}): "
                "it must be an integer, or nil"
            )
