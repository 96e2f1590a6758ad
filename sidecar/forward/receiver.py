"""Disaggregated layout, the inference side: a trainer node's forwarder sends each published
generation here (protocol: sidecar.forward.sender), and this daemon publishes it to its engines as
if it had quantized it.

A component of the serve loop (sidecar.daemon.loop), built with its :class:`LoopContext`; the loop
routes every FORWARD_* message here. Forwarding is accepted only from this node's trainer daemons,
identified by their CURVE public key over ``tcp://`` (``curve_trainer_keys``, by default every key of
``curve_allowed_keys``): never from the local ``ipc://`` socket (engine readers) nor from a listener
without CURVE. The loop sets ``sender_key`` (the ZAP User-Id of the message being handled) before
each FORWARD_* handler. Step order is kept per trainer key: what one sender claims never moves
another's.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from sidecar.config.settings import NodeRole
from sidecar.daemon.peers import Peer
from sidecar.daemon.step import StepState
from sidecar.errors import ErrorKind, RefitError
from sidecar.forward.movers import NixlSetupFailed, TargetSide, support
from sidecar.forward.types import Inbound
from sidecar.protocol.enums import Mover, PeerRole
from transport.layout import Layout
from transport.wire import Kind, Message, ProtocolError, dtype_from_name

if TYPE_CHECKING:  # pragma: no cover
    from sidecar.daemon.context import LoopContext

log = logging.getLogger("refitd.forward")


class Receiver:
    """The transfer in progress (at most one: a newer one replaces it) and what was published."""

    def __init__(self, ctx: LoopContext):
        self.ctx = ctx
        self.inbound: Inbound | None = None
        self.forward_source: str | None = None  # the source (trainer daemon instance) of the latest step
        self.forward_keys: frozenset[str] = frozenset()  # z85 public keys allowed to forward here
        self.sender_key: str | None = None  # the CURVE key of the FORWARD_* message being handled
        self.nixl_target: TargetSide | None = None  # made on the first transfer NIXL may carry
        self.forwarded_steps: dict[str, tuple[str, int]] = {}  # trainer key -> (source, step)

    def routes(self) -> dict[Kind, tuple[PeerRole | None, object]]:
        """The requests this component answers: ``{kind: (the role a peer must have, handler)}``;
        forwarders are identified by their CURVE key (``_forwarder``), not by a role."""
        return {
            Kind.FORWARD_BEGIN: (None, self.handle_forward_begin),
            Kind.FORWARD_DATA: (None, self.handle_forward_data),
            Kind.FORWARD_COMMIT: (None, self.handle_forward_commit),
            Kind.FORWARD_ABORT: (None, self.handle_forward_abort),
        }

    def status(self) -> dict[str, Any] | None:
        inbound = self.inbound
        if inbound is None:
            return None
        return {
            "step": inbound.step,
            "source": inbound.source,
            "bytes": inbound.received,
            "mover": inbound.mover.value,
        }

    def _inference_node(self) -> bool:
        return self.ctx.config.role is NodeRole.INFERENCE

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
        live = self.ctx.arenas.live_generation()
        done = self.forwarded_steps.get(sender)  # (source, step) this sender last published here
        if done is not None and done[0] == source and step <= done[1]:
            self.ctx.send(
                identity,
                Kind.FORWARDED,
                {
                    "transfer": transfer,
                    "step": done[1],
                    "generation": None if live is None else live.index,
                    "instance": self.ctx.instance,
                    "already": True,
                },
            )
            return
        try:
            layout = Layout.build((str(n), dtype_from_name(d), tuple(s)) for n, d, s in rows)
        except (TypeError, ValueError) as exc:
            raise ProtocolError(f"FORWARD_BEGIN rows are not [name, dtype, shape]: {exc}") from None
        capacity = min(g.arena.size for g in self.ctx.arenas.generations)
        if layout.size > capacity:
            raise RefitError(
                f"forwarded step {step} needs {layout.size} bytes per generation but this daemon's publish "
                f"arenas hold {capacity}: restart it with a larger --publish-bytes",
                kind=ErrorKind.CAPACITY,
                step=step,
            )
        now = time.monotonic()
        old = self.inbound
        offered = msg.get("movers", [Mover.ZMQ.value])
        offered = (
            tuple(m for m in map(Mover.parse, offered) if m) if isinstance(offered, list) else (Mover.ZMQ,)
        )
        self.inbound = Inbound(
            identity, transfer, step, source, layout, list(layout), now, now, sender=sender, offered=offered
        )
        if old is not None:
            log.info("forwarded step %d replaces the unfinished transfer of step %d", step, old.step)
            self.inbound.target = old.target  # still claimed, still unpublished
            if old.target is not None:
                self._carve(self.inbound)
        self.ctx.peers[identity] = Peer(identity, PeerRole.FORWARDER, now, name=f"forwarder of {source}")
        self.claim()

    def claim(self) -> None:
        """Claim the free generation for the transfer in progress; FORWARD_READY once it is."""
        inbound = self.inbound
        if inbound is None or inbound.target is not None:
            return
        inbound.target = self.ctx.arenas.claim_target(time.monotonic(), self.ctx.config.reader_timeout_s)
        if inbound.target is not None:
            self._carve(inbound)

    def _carve(self, inbound: Inbound) -> None:
        inbound.target.step = None
        inbound.target.arena.relayout(inbound.layout)
        inbound.flat = {n: t.reshape(-1).view(torch.uint8) for n, t in inbound.target.arena.tensors().items()}
        fields: dict[str, Any] = {
            "transfer": inbound.transfer,
            "step": inbound.step,
            "credit_frames": self.ctx.config.credit_frames,
            "max_frame_bytes": self.ctx.config.max_frame_bytes,
        }
        inbound.mover, inbound.mover_reason, offer = self._choose_mover(inbound)
        fields.update(mover=inbound.mover.value, mover_reason=inbound.mover_reason)
        if offer is not None:
            fields["nixl"] = offer
        self.ctx.send(inbound.identity, Kind.FORWARD_READY, fields)

    def _choose_mover(self, inbound: Inbound) -> tuple[Mover, str, dict[str, Any] | None]:
        """``(mover, why, READY's nixl field)``: NIXL when the forwarder offers it and it works here."""
        if Mover.NIXL not in inbound.offered:
            return Mover.ZMQ, "the forwarder did not offer NIXL", None
        ok, why = support(self.ctx.config.forward_mover.value)
        if ok and self.nixl_target is not None and self.nixl_target.broken is not None:
            ok, why = False, f"NIXL set-up failed earlier on the inference daemon: {self.nixl_target.broken}"
        if not ok:
            return Mover.ZMQ, f"inference daemon: {why}", None
        if self.nixl_target is None:
            self.nixl_target = TargetSide(f"refitd-{self.ctx.instance}")
        try:
            offer = self.nixl_target.offer(inbound.target.arena)
        except NixlSetupFailed as exc:
            self.nixl_target.broken = str(exc)
            log.warning("NIXL set-up failed, taking forwarded bytes as ZeroMQ frames: %s", exc)
            return Mover.ZMQ, f"NIXL set-up failed on the inference daemon: {exc}", None
        return Mover.NIXL, "NIXL on both sides", offer

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
        if inbound.unacked >= max(1, self.ctx.config.credit_frames // 2):
            self.ctx.send(
                inbound.identity, Kind.CREDIT, {"transfer": inbound.transfer, "frames": inbound.unacked}
            )
            inbound.unacked = 0

    def handle_forward_commit(self, identity: bytes, msg: Message) -> None:
        inbound = self._inbound(identity, msg)
        if inbound.mover is Mover.NIXL and inbound.received == 0:
            inbound.committer = identity  # published by _forward_progress once the WRITE's notification is in
            self.progress()
            return
        self._publish_inbound(identity, inbound)

    def progress(self) -> None:
        """Progress the NIXL endpoint while a NIXL transfer is in flight (the serve loop, each tick);
        publish a committed one once its WRITE notification arrived."""
        inbound = self.inbound
        if inbound is None or inbound.mover is not Mover.NIXL or self.nixl_target is None:
            return
        self.nixl_target.progress()
        if inbound.committer is not None and self.nixl_target.take(inbound.transfer):
            inbound.received = inbound.layout.size
            inbound.index, inbound.offset = len(inbound.slots), 0
            self._publish_inbound(inbound.committer, inbound)

    def busy(self) -> bool:
        inbound = self.inbound
        return inbound is not None and inbound.mover is Mover.NIXL and inbound.target is not None

    def close(self) -> None:
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
            "mover": inbound.mover.value,
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
        state = StepState(inbound.step, 0, now)
        state.phases.first_begin = state.phases.all_begun = inbound.started
        state.phases.all_received = state.phases.published = now
        state.bytes_in = inbound.received
        self.ctx.publish(
            inbound.target,
            record,
            state,
            [identity],
            Kind.FORWARDED,
            {"transfer": inbound.transfer, "instance": self.ctx.instance},
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

    def timers(self, now: float) -> None:
        inbound = self.inbound
        if inbound is None:
            return
        if now - inbound.last_seen > self.ctx.config.forward_timeout_s:
            self._drop_inbound(f"the forwarder was silent for {self.ctx.config.forward_timeout_s:g} s")
        else:
            self.claim()
