"""The refitd serve loop: trainer ranks push, the daemon seals, quantizes and publishes generations.

One ROUTER socket carries every peer (trainer clients and engine readers); a message is dispatched
to ``handle_<kind>``. The loop is single-threaded: only the quantization worker runs beside it.

Lifecycle::

    daemon = Daemon(config)      # plan (from hf_config) and arenas allocated here, once
    daemon.start()               # bind the control socket
    daemon.serve_forever()       # until request_stop()
    daemon.close()               # abort any step, unlink every segment, remove the socket

Step protocol (per rank): HELLO -> WELCOME; BEGIN -> READY (once every rank began and the
declarations cover every tensor exactly once); data (local: write into staging, PIECE_DONE; remote:
the daemon READs the pieces READY lists in ``pull`` over NIXL and says PULLED, the rest come as SHARD
frames under credits: sidecar.pull_nixl); COMMIT -> ACK; then RESULT (published) or ERROR (on every
rank). With a staging ring (``staging_regions``) the data of each layer group goes only after the
daemon's SLOT for that group, into the region it names (sidecar.staging).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import zmq

from sidecar import kernels
from sidecar.config import RELOADABLE, ArenaKind, DaemonConfig, DrainMode, NodeRole, default_listen, tcp_host
from sidecar.engines import EngineState, LoadRound, new_round
from sidecar.errors import ErrorKind, RefitError
from sidecar.forward import FORWARD_KINDS, Forwarding, ForwardReceiver, curve_user_id, forward_keys
from sidecar.gcpause import StepHold, freeze_long_lived
from sidecar.generations import Arenas
from sidecar.models import get_model
from sidecar.observers import Observer, notify
from sidecar.plan import RefitPlan, RefitSpec, plan_from_hf_config
from sidecar.pull_nixl import PullSide, keep_signal_handlers
from sidecar.pull_nixl import support as pull_support
from sidecar.quant import NonFiniteError
from sidecar.readers import Peer, ReaderHandlers
from sidecar.step import StepState
from sidecar.trainers import TrainerHandlers
from sidecar.worker import QuantWorker
from transport.gpus import arena_placements, local_gpus
from transport.wire import Kind, Limits, Message, ProtocolError, decode, encode

log = logging.getLogger("refitd.daemon")

MAX_MESSAGES_PER_TICK = 256
MAX_REMEMBERED_FAILURES = 8
CLOSE_LINGER_MS = 500


class Daemon(TrainerHandlers, ReaderHandlers, ForwardReceiver):
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
        self.plan: RefitPlan | None = None
        self.arenas: Arenas | None = None
        self.peers: dict[bytes, Peer] = {}
        self.step: StepState | None = None
        self._gc_hold = StepHold()  # the collector off while a step is in flight (tick)
        self.target = None  # the Generation the step in progress writes
        self.deferred: list = []  # units ready before the target generation was free
        self.pending: list[tuple[bytes, Message]] = []  # BEGINs for a later step
        # step -> (error, ranks told, event number of the failure)
        self.failures: dict[int, tuple[RefitError, set[int], int]] = {}
        self.events = 0  # counts HELLOs and failures, to order them
        self.last_step: int | None = None
        self.history: list[dict[str, Any]] = []  # last few steps, for status
        self._credits: dict[bytes, int] = {}  # frames taken this turn, per remote client
        self.engines: dict[bytes, EngineState] = {}  # attached engine workers, with their manifests
        self.forwarded_steps: dict[str, tuple[str, int]] = {}  # inference node: trainer key -> (source, step)
        self.rounds: dict[int, LoadRound] = {}  # published steps still waiting for engine acks
        self._stop = False
        self._force = False  # a second stop request: no draining
        self._draining = False  # stopping after the step in flight: new steps are refused
        self._reload = None  # SIGHUP: a callable returning the new config, applied on the loop
        self._closed = False
        self.ctx = zmq.Context()
        self.router: zmq.Socket | None = None
        self.wake: zmq.Socket | None = None
        self.worker: QuantWorker | None = None
        self.forwarding: Forwarding | None = None  # trainer node of a disaggregated layout
        self.auth = None  # the ZAP handler enforcing curve_allowed_keys
        self.local_listen: str | None = None  # ipc:// beside a tcp:// listen, for this node's engines
        self.prefix = f"refitd-{os.getuid()}-{self.instance[:8]}"
        self.pull: PullSide | None = None  # NIXL READs of remote trainers' shards (sidecar.pull_nixl)
        self.pull_ok, self.pull_reason = False, "not started"
        self.quantizer: kernels.WarmUp | None = None  # which quantizer runs, and why (status, metrics)
        self.pull_movers: dict[str, dict[str, Any]] = {}  # str(rank) -> mover of its last step, and why
        if config.hf_config is not None:
            self.plan = plan_from_hf_config(hf_config, self.spec)
        regions = 0 if config.role is NodeRole.INFERENCE else config.ring_regions  # no trainers there
        self.parked: dict[int, list] = {}  # staging ring: ready units whose group holds no region yet
        self.ring_ranks: dict[int, set[int]] = {}  # staging ring: group -> ranks holding part of it
        if self.plan is not None:
            self.arenas = Arenas.for_plan(
                self.prefix,
                self.plan,
                staging_bytes=config.staging_bytes,
                publish_bytes=config.publish_bytes,
                kind=config.arena,
                gpu=config.gpu,
                staging_regions=regions,
            )
        elif config.publish_bytes is not None and (
            config.staging_bytes is not None or config.role is NodeRole.INFERENCE
        ):
            self.arenas = Arenas(
                self.prefix,
                staging_bytes=config.staging_bytes or 4096,
                publish_bytes=config.publish_bytes,
                kind=config.arena,
                gpu=config.gpu,
                staging_regions=regions,
            )
        else:
            raise RefitError(
                "the daemon cannot size its arenas: give hf_config (the model's config.json) so it plans at "
                "start, or both staging_bytes and publish_bytes (an inference node of a disaggregated "
                "layout needs only publish_bytes)",
                kind=ErrorKind.CAPACITY,
            )
        self._record_segments()

    # ------------------------------------------------------------------------------------------
    # lifecycle

    def start(self) -> None:
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.LINGER, 0)
        self._bind()
        wake_endpoint = f"inproc://refitd-wake-{self.instance}"
        self.wake = self.ctx.socket(zmq.PULL)
        self.wake.bind(wake_endpoint)
        self.worker = QuantWorker(self.ctx, wake_endpoint)
        self.quantizer = self._warm_up()
        if self.config.role is NodeRole.TRAINER:
            self.forwarding = Forwarding(self.ctx, wake_endpoint, self.config, self.instance)
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
        self.pull_ok, self.pull_reason = pull_support(self.arenas.staging)
        if self.pull_ok and self.arenas.staging_regions:
            self.pull_ok, self.pull_reason = (
                False,
                (
                    f"staging is a ring of {self.arenas.staging_regions} regions (staging_regions): remote shards "
                    "travel as ZeroMQ frames, a layer group at a time"
                ),
            )
        if not self.pull_ok:
            log.info("remote trainer shards travel as ZeroMQ frames: %s", self.pull_reason)
        notify(self.observers, "on_ready", self)

    def _bind(self) -> None:
        """The control endpoint: CURVE with the allow-list on tcp:// when keys are configured, and,
        beside a tcp:// endpoint, ``ipc://<runtime_dir>/control.sock`` for this node's engines."""
        from sidecar import keygen

        cfg = self.config
        tcp = tcp_host(cfg.listen) is not None
        if tcp and cfg.curve_secret_key is not None:
            try:
                public, secret = keygen.own_keypair(cfg.curve_secret_key, cfg.curve_public_key)
                allowed = keygen.allowed_keys(cfg.curve_allowed_keys)
                self.forward_keys = forward_keys(cfg, allowed)
            except (OSError, ValueError) as exc:
                raise RefitError(f"CURVE keys: {exc}", kind=ErrorKind.INVALID) from None
            self.auth = keygen.start_authenticator(self.ctx, allowed)
            keygen.set_server(self.router, public, secret)
            self.router.bind(cfg.listen)
            keygen.unset_server(self.router)
            log.info("CURVE on %s: %d allowed client key(s)", cfg.listen, len(allowed))
        else:
            self.router.bind(cfg.listen)
        if tcp:
            local = default_listen(cfg.runtime_dir)
            try:
                self.router.bind(local)
                self.local_listen = local
            except zmq.ZMQError as exc:
                log.warning("no local endpoint %s beside %s: %s", local, cfg.listen, exc)

    @property
    def ready(self) -> bool:
        return self.router is not None and self.arenas is not None

    def request_stop(self) -> None:
        """First call: stop (draining as configured); a second: stop draining at once."""
        if self._stop:
            self._force = True
        self._stop = True

    def serve_forever(self) -> None:
        freeze_long_lived()  # startup's objects (torch, a configured plan): out of every collection
        while not self._stop:
            self.tick()
            if self._reload is not None:
                load, self._reload = self._reload, None
                self.reload(load)
        self._drain()

    def request_reload(self, load_config) -> None:
        """Re-read the configuration (``load_config() -> DaemonConfig``) on the serve loop (SIGHUP)."""
        self._reload = load_config

    def reload(self, load_config) -> list[str]:
        """Apply what may change safely (timeouts, logging, drain); name what needs a restart."""
        try:
            new = load_config()
        except ValueError as exc:  # ConfigError: keep the running configuration
            log.error("SIGHUP: the new configuration is invalid, keeping the current one:\n%s", exc)
            return []
        old, changed, refused = self.config.to_dict(), [], []
        for key, value in new.to_dict().items():
            if value != old.get(key):
                (changed if key in RELOADABLE else refused).append(key)
        if changed:
            self.config = self.config.replace(**{k: getattr(new, k) for k in changed})
            logging.getLogger("refitd").setLevel(self.config.log_level.level)
            log.info("SIGHUP: reloaded %s", ", ".join(f"{k}={getattr(self.config, k)}" for k in changed))
        if refused:
            log.warning(
                "SIGHUP: %s changed but needs a restart; still running with the old values",
                ", ".join(refused),
            )
        if not changed and not refused:
            log.info("SIGHUP: the configuration is unchanged")
        return changed

    def _drain(self) -> None:
        """On stop: with drain=finish, let the step in flight publish (or fail) within shutdown_timeout_s."""
        if self.step is None or self.config.drain is not DrainMode.FINISH:
            return
        self._draining = True
        deadline = time.monotonic() + self.config.shutdown_timeout_s
        log.info(
            "draining: waiting up to %.0f s for step %d to finish",
            self.config.shutdown_timeout_s,
            self.step.step,
        )
        while self.step is not None and time.monotonic() < deadline and not self._force:
            self.tick()

    def tick(self, timeout_ms: int | None = None) -> None:
        """One turn of the loop: messages, worker results, timers."""
        if timeout_ms is None:
            timeout_ms = int(max(10, min(100, self.config.heartbeat_interval_s * 250)))
        if self._forward_nixl_busy() or (self.pull is not None and self.pull.inflight):
            timeout_ms = min(timeout_ms, 1)  # a NIXL WRITE lands here: progress the endpoint often
        events = dict(self.poller.poll(timeout_ms))
        # A step of many tensors allocates many small objects per turn (pieces, units, results): no
        # collection while a step is in flight, one after it (each walks every object the step keeps).
        with self._gc_hold.turn(lambda: self.step is not None):
            self._turn(events)

    def _turn(self, events: dict) -> None:
        if self.wake in events:
            while True:
                try:
                    self.wake.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
        self._drain_worker()
        if self.router in events:
            for _ in range(MAX_MESSAGES_PER_TICK):
                try:
                    frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._dispatch(frames)
            self._flush_credits()
        self._drain_worker()
        if self.forwarding is not None:
            self.forwarding.drain(self)
        self._forward_progress()
        self._pull_progress()
        now = time.monotonic()
        if self.forwarding is not None:
            # a forwarder thread may have created a UCX backend, which replaces SIGHUP's disposition
            # under Python's handler; only this (main) thread can put it back (sidecar.pull_nixl)
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
            self._fail_step(
                RefitError("the daemon is shutting down", kind=ErrorKind.SHUTDOWN, step=self.step.step)
            )
        if self.worker is not None:
            self.worker.close()
        if self.forwarding is not None:
            self.forwarding.close()
        self._forward_close()
        if self.pull is not None:
            self.pull.close()
            self.pull = None
        if self.arenas is not None:
            self.arenas.close()
        if self.router is not None:
            self.router.close(linger=CLOSE_LINGER_MS)  # the SHUTDOWN errors just queued still go out
        if self.wake is not None:
            self.wake.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
        self._gc_hold.release()
        self.ctx.term()
        for listen in (self.config.listen, self.local_listen or ""):
            if listen.startswith("ipc://"):
                Path(listen.removeprefix("ipc://")).unlink(missing_ok=True)
        self._segments_file().unlink(missing_ok=True)

    # ------------------------------------------------------------------------------------------
    # sending

    def _send(self, identity: bytes, kind: Kind, fields: dict[str, Any] | None = None, frames=()) -> bool:
        """Every reply carries this start's ``instance``: a client that sees a new one knows the daemon
        restarted (and that the step it had in flight was lost)."""
        fields = {**(fields or {}), "instance": self.instance}
        try:
            self.router.send_multipart([identity, *encode(Message(kind, fields, list(frames)))], zmq.NOBLOCK)
            return True
        except zmq.ZMQError as exc:  # the peer is gone (ROUTER_MANDATORY) or not reading
            log.debug("cannot send %s to a peer: %s", kind.name, exc)
            return False

    def _flush_credits(self) -> None:
        """One CREDIT per client per turn of the loop, for every frame taken in that turn."""
        credits, self._credits = self._credits, {}
        if self.step is not None:
            for identity, frames in credits.items():
                self._send(identity, Kind.CREDIT, {"step": self.step.step, "frames": frames})

    def _send_error(self, identity: bytes, err: RefitError) -> None:
        self._send(identity, Kind.ERROR, err.to_wire())

    # ------------------------------------------------------------------------------------------
    # dispatch

    def _dispatch(self, frames: list) -> None:
        identity = frames[0].bytes
        try:
            msg = decode(frames[1:], self.limits)
        except ProtocolError as exc:
            text = str(exc)
            if text.startswith("header of"):  # a BEGIN of very many pieces, most likely
                text += (
                    " (the daemon's max_header_bytes); a BEGIN takes about 40 bytes per piece, 100 with a "
                    "NIXL offer: raise max_header_bytes (--max-header-bytes, REFITD_MAX_HEADER_BYTES) or "
                    "send fewer, larger tensors"
                )
            log.warning("refused a malformed message: %s", text)
            if not self._step_protocol_error(identity, ProtocolError(text)):
                self._send_error(identity, RefitError(text, kind=ErrorKind.PROTOCOL))
            return
        peer = self.peers.get(identity)
        if peer is not None:
            peer.last_seen = time.monotonic()
        if msg.kind in FORWARD_KINDS:  # who sent it: its CURVE key (ZAP User-Id), none over ipc://
            self.sender_key = curve_user_id(frames[1])
        handler = getattr(self, f"handle_{msg.kind.name.lower()}", None)
        if handler is None:
            self._send_error(
                identity, RefitError(f"{msg.kind.name} is not a request", kind=ErrorKind.PROTOCOL)
            )
            return
        self._handle(handler, identity, msg)

    def _handle(self, handler, identity: bytes, msg: Message) -> None:
        """Run one handler; whatever it raises fails at most the step, never the daemon."""
        try:
            handler(identity, msg)
        except ProtocolError as exc:
            if self._step_protocol_error(identity, exc):  # a rank of the step: every rank hears it
                return
            self._send_error(identity, RefitError(str(exc), kind=ErrorKind.PROTOCOL, step=msg.get("step")))
        except RefitError as exc:
            if self.step is not None and exc.step == self.step.step:
                self._fail_step(exc)
            else:
                self._send_error(identity, exc)
        except Exception as exc:  # a bug: report it, fail the step it touched, keep serving
            log.exception("internal error handling %s", msg.kind.name)
            err = RefitError(
                f"internal error handling {msg.kind.name}: {exc!r}; please report it", kind=ErrorKind.INTERNAL
            )
            if self.step is not None and msg.get("step") == self.step.step:
                self._fail_step(RefitError(err.message, kind=err.kind, step=self.step.step))
            else:
                self._send_error(identity, err)

    # ---- readers

    def handle_status(self, identity: bytes, msg: Message) -> None:
        self._send(identity, Kind.STATUS_REPLY, self.status())

    # ------------------------------------------------------------------------------------------
    # pipeline

    def _tensor_complete(self, name: str) -> None:
        if self.arenas.ring is not None:
            self.arenas.ring.tensor_complete(name)
        for unit in self.step.ready_units(self.plan, name):
            if self.target is None:
                self.deferred.append(unit)
            else:
                self._submit(unit)

    def _submit(self, unit) -> None:
        state, ring, target = self.step, self.arenas.ring, self.target.arena
        sync = False
        if ring is not None:
            group = ring.unit_group[unit.index]
            if not ring.granted(group):  # its bytes are all zero-sized: run it once the group is granted
                self.parked.setdefault(group, []).append(unit)
                return
            # the group's last unit waits for the GPU before it reports: the region is then reused
            sync = ring.unit_submitted(unit.index) and self.arenas.kind is ArenaKind.CUDA
        if not state.phases.quant_start:
            state.phases.quant_start = time.monotonic()
        self.worker.submit(
            state.step,
            unit,
            lambda: {n: self._staged(n) for n in unit.inputs},
            lambda: {o.name: target.tensor(o.name) for o in unit.outputs},
            sync=sync,
        )

    def _maybe_claim(self) -> None:
        self._forward_claim()
        if self.step is not None and self.step.ready_sent and self.target is None:
            self.target = self.arenas.claim_target(time.monotonic(), self.config.reader_timeout_s)
            if self.target is not None:
                deferred, self.deferred = self.deferred, []
                for unit in deferred:
                    self._submit(unit)

    def _drain_worker(self) -> None:
        if self.worker is None:
            return
        while True:
            try:
                done = self.worker.results.get_nowait()
            except Exception:
                break
            self.worker.inflight -= 1
            if self.step is None or done.step != self.step.step or done.skipped:
                continue  # a unit of a step that already failed
            self.step.phases.quant_busy += done.seconds
            notify(self.observers, "on_unit_done", self, done.step, done.unit, done.start, done.seconds)
            if done.error is not None:
                kind = ErrorKind.NON_FINITE if isinstance(done.error, NonFiniteError) else ErrorKind.INVALID
                if not isinstance(done.error, ValueError):
                    kind = ErrorKind.INTERNAL
                self._fail_step(RefitError(str(done.error), kind=kind, step=done.step))
                continue
            self.step.units_done.add(done.unit)
            if self.arenas.ring is not None:
                try:
                    self._grant(self.arenas.ring.unit_done(done.unit))
                except ValueError as exc:
                    self._fail_step(RefitError(str(exc), kind=ErrorKind.INTERNAL, step=done.step))
                    continue
            if len(self.step.units_done) == len(self.plan.units):
                self.step.phases.quant_end = time.monotonic()
            self._maybe_publish()
        if self.step is None and self.pending and self.worker.inflight == 0:
            self._start_pending()

    def _maybe_publish(self) -> None:
        state = self.step
        if state is None or self.plan is None or not state.sealed(self.plan):
            return
        state.phases.published = time.monotonic()
        phases = state.phases.seconds()
        record = {
            "step": state.step,
            "generation": self.target.index,
            "bytes_in": state.bytes_in,
            "bytes_out": self.plan.bytes_out,
            "seconds": {k: round(v, 6) for k, v in phases.items()},
        }
        if self.forwarding is not None:  # what each inference node held as this step went live
            record["peers"] = self.forwarding.snapshot()
        log.info(
            "step %d published in generation %d: receive %.3fs validate %.3fs quantize %.3fs (tail %.3fs) "
            "publish %.3fs total %.3fs; %d bytes in, %d bytes out",
            state.step,
            self.target.index,
            phases["receive"],
            phases["validate"],
            phases["quantize"],
            phases["quantize_tail"],
            phases["publish"],
            phases["total"],
            state.bytes_in,
            self.plan.bytes_out,
            extra={"step": state.step, "phase": "publish", "record": record},
        )
        self._go_live(self.target, record, state, list(state.peers.values()))
        if self.forwarding is not None:
            self.forwarding.published(self.target, state.step, state.bytes_in, self.instance)
        self.step, self.target = None, None
        self._start_pending()

    def _go_live(
        self,
        gen,
        record: dict[str, Any],
        state: StepState,
        trainers: list[bytes],
        reply=Kind.RESULT,
        extra=None,
    ) -> None:
        """Publish ``gen`` (a sealed local step, or a forwarded one): flip it live, answer ``trainers``
        (RESULT, or FORWARDED to a forwarder), start the engines' LoadRound, hand it to waiting readers."""
        self.arenas.synchronize()  # GPU arenas: every kernel's writes land before anyone is told
        self.arenas.publish(gen, record["step"])
        self.last_step = record["step"]
        self.history = [*self.history[-9:], record]
        for identity in trainers:
            self._send(identity, reply, {**record, **(extra or {})})
        notify(self.observers, "on_step_published", self, record, state)
        self.rounds[record["step"]] = new_round(
            record["step"], self.engines, trainers, self.config.reader_timeout_s
        )
        self._finish_rounds(time.monotonic())
        for peer in list(self.peers.values()):
            if peer.role == "reader":
                self._serve_waiting(peer)

    def _fail_step(self, err: RefitError) -> None:
        state = self.step
        if state is None:
            return
        if err.step is None:
            err = RefitError(err.message, kind=err.kind, rank=err.rank, step=state.step)
        log.error(
            "step %d failed: %s",
            state.step,
            err,
            extra={"step": state.step, "rank": err.rank, "phase": "fail"},
        )
        notify(self.observers, "on_step_failed", self, err)
        told = set()
        for peer in self.peers.values():
            if peer.role == "trainer" and peer.rank is not None:
                self._send_error(peer.identity, err)
                told.add(peer.rank)
        self.failures[state.step] = (err, told, self._next_event())
        while len(self.failures) > MAX_REMEMBERED_FAILURES:
            self.failures.pop(next(iter(self.failures)))
        self.worker.cancel(state.step)
        if self.pull is not None:
            self.pull.cancel()
        if self.target is not None:
            self.target.step = None  # half-written: never hand it out
        if self.arenas.ring is not None:
            self.arenas.ring.reset()
        self.step, self.target, self.deferred, self.parked = None, None, [], {}
        self._start_pending()

    def _start_pending(self) -> None:
        if self.step is not None or not self.pending or not self._can_start_step():
            return
        pending, self.pending = self.pending, []
        for identity, msg in pending:
            self._handle(self.handle_begin, identity, msg)

    # ------------------------------------------------------------------------------------------
    # timers

    def _check_timers(self, now: float) -> None:
        state = self.step
        if state is not None:
            if now > state.deadline:
                missing = state.missing_ranks()
                why = f"ranks {missing} never began it" if missing else "it was not complete"
                self._fail_step(
                    RefitError(
                        f"step {state.step} timed out after {self.config.step_timeout_s:.1f} s: {why}",
                        kind=ErrorKind.TIMEOUT,
                        step=state.step,
                    )
                )
                return
            for rank, identity in state.peers.items():
                peer = self.peers.get(identity)
                silent = now - peer.last_seen if peer is not None else float("inf")
                if rank not in state.committed and silent > self.config.rank_timeout_s:
                    self._fail_step(
                        RefitError(
                            f"rank {rank} stopped responding mid-step (silent for {silent:.1f} s, "
                            f"rank_timeout_s={self.config.rank_timeout_s}): it died or hung",
                            kind=ErrorKind.RANK_DIED,
                            rank=rank,
                            step=state.step,
                        )
                    )
                    return
            self._maybe_claim()
        if self.rounds:
            self._finish_rounds(now)
        self._forward_timers(now)
        if self.step is None and self.pending:
            self._start_pending()

    def _warm_up(self) -> kernels.WarmUp:
        """Probe the kernels on the arenas' GPU and compile the plan's specialisations there, before
        READY; on host arenas (or when the probe fails) the torch reference quantizes."""
        on_gpu = self.arenas is not None and self.arenas.kind is ArenaKind.CUDA
        device = torch.device("cuda", self.arenas.staging.device) if on_gpu else torch.device("cpu")
        done = kernels.warm_up(self.plan, device)
        log.info("quantizing with %s on %s%s", done.impl, device, f" ({done.reason})" if done.reason else "")
        return done

    # ------------------------------------------------------------------------------------------
    # status and bookkeeping

    def status(self) -> dict[str, Any]:
        live = self.arenas.live_generation() if self.arenas else None
        gpus = local_gpus()
        return {
            "gpus": [g.to_wire() for g in gpus],
            "gpus_reason": getattr(gpus, "reason", None),
            "arenas": arena_placements(self.arenas.all_arenas()) if self.arenas else [],
            "instance": self.instance,
            "pid": os.getpid(),
            "draining": self._draining,
            "settings": {k: v for k, v in self.config.to_dict().items() if k in RELOADABLE},
            "host": socket.gethostname(),
            "listen": self.config.listen,
            "local_listen": self.local_listen,
            "layout": self.config.layout.value,
            "role": None if self.config.role is None else self.config.role.value,
            "peers": None if self.forwarding is None else self.forwarding.snapshot(),
            "inbound": None
            if self.inbound is None
            else {
                "step": self.inbound.step,
                "source": self.inbound.source,
                "bytes": self.inbound.received,
                "mover": self.inbound.mover,
            },
            "pull": {"nixl": self.pull_ok, "reason": self.pull_reason, "ranks": self.pull_movers},
            "format": self.spec.fmt.value,
            "quantizer": None if self.quantizer is None else self.quantizer.to_dict(),
            "world_size": self.config.world_size,
            "last_step": self.last_step,
            "live": None if live is None else {"generation": live.index, "step": live.step},
            "step_in_progress": None
            if self.step is None
            else {
                "step": self.step.step,
                "begun": sorted(self.step.declared),
                "committed": sorted(self.step.committed),
            },
            "generations": [
                {
                    "generation": g.index,
                    "step": g.step,
                    "holders": len(g.holders),
                    "segment": g.arena.name,
                    "bytes": g.arena.size,
                }
                for g in (self.arenas.generations if self.arenas else [])
            ],
            "staging": None
            if self.arenas is None
            else {
                "segment": self.arenas.staging.name,
                "bytes": self.arenas.staging.size,
                "ring": None
                if self.arenas.ring is None
                else {**self.arenas.ring.wire(), "held": self.arenas.ring.held()},
            },
            "trainers": sorted(p.rank for p in self.peers.values() if p.role == "trainer"),
            "readers": [p.name for p in self.peers.values() if p.role == "reader"],
            "engines": [
                {
                    "name": e.name,
                    "engine": e.manifest.engine.value,
                    "version": e.manifest.engine_version,
                    "moe_backend": e.manifest.moe_backend,
                    "expert_format": e.manifest.expert_format.value,
                }
                for e in self.engines.values()
            ],
            "plan": None
            if self.plan is None
            else {
                "inputs": len(self.plan.inputs),
                "outputs": len(self.plan.outputs),
                "bytes_in": self.plan.bytes_in,
                "bytes_out": self.plan.bytes_out,
            },
            "history": self.history,
        }

    def _segments_file(self) -> Path:
        return Path(self.config.runtime_dir) / "segments.json"

    def _record_segments(self) -> None:
        """Write our segment names, after unlinking those a crashed predecessor left behind."""
        path = self._segments_file()
        if path.exists():
            try:
                old = json.loads(path.read_text())
                if not _pid_alive(int(old.get("pid", 0))):
                    for name in old.get("segments", []):
                        Path("/dev/shm", name).unlink(missing_ok=True)
                        log.warning("removed shared-memory segment %s left by a crashed daemon", name)
            except (ValueError, OSError):
                pass
        path.write_text(json.dumps({"pid": os.getpid(), "segments": self.arenas.segment_names()}))


def refit_spec(config: DaemonConfig, hf_config: dict[str, Any] | None = None) -> RefitSpec:
    """The daemon's RefitSpec; the model type comes from the config, else from ``hf_config``."""
    model_type = config.model_type
    if model_type is None and hf_config is not None:
        model_type = hf_config.get("model_type")
    if model_type is None:
        raise RefitError("the daemon needs a model type: set model_type or hf_config", kind=ErrorKind.INVALID)
    get_model(model_type)
    return RefitSpec(
        model_type=model_type,
        fmt=config.format,
        num_hidden_layers=config.num_hidden_layers,
        num_first_layers_in_bf16=config.num_first_layers_in_bf16,
        num_last_layers_in_bf16=config.num_last_layers_in_bf16,
        ignore_patterns=tuple(config.ignore_patterns),
    )


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
