"""The trainer side of the serve loop: ranks say HELLO, BEGIN a step, send their data, COMMIT.

A component of the serve loop (sidecar.daemon.loop), built with its :class:`LoopContext`; the loop
routes trainer requests here once it checked the peer is a trainer rank. It owns what outlives one
step on the trainer side: BEGINs kept for a later step, recent failures (told to ranks that missed
them), the frames taken this turn per remote rank (CREDIT). Data arrives three ways: written by
local ranks straight into staging (PIECE_DONE), as ZeroMQ frames from remote ranks (SHARD), or READ
over NIXL from a remote rank's registered memory (sidecar.daemon.pull). With a staging ring
(sidecar.daemon.memory.staging) each layer group is written (or READ) only once the daemon grants it
a region (SLOT); data for a group without one is a protocol error. Once every rank has begun, the
plan the step runs under is fixed by sidecar.daemon.step_plan.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from typing import TYPE_CHECKING, Any

import msgpack
import torch

from sidecar.config.settings import NodeRole
from sidecar.daemon.faults import stop_on_sticky
from sidecar.daemon.peers import Peer
from sidecar.daemon.setup import record_segments
from sidecar.daemon.step import Skeleton, StepState, begin_rows, wire_type
from sidecar.daemon.step_plan import plan_from_declarations, plan_in_trainer_form
from sidecar.errors import ErrorKind, RefitError
from sidecar.protocol.enums import PeerRole
from transport.wire import Kind, Message, ProtocolError, safe_repr

if TYPE_CHECKING:  # pragma: no cover
    from sidecar.daemon.context import LoopContext
    from sidecar.daemon.engines import Engines
    from sidecar.daemon.pipeline import Pipeline
    from sidecar.daemon.pull import Pulls

log = logging.getLogger("refitd.daemon")

MAX_REMEMBERED_FAILURES = 8
_INT = frozenset({int})  # the type of every id of a well-formed PIECE_DONE


def staging_for(peer: Peer, handle: dict[str, Any]) -> dict[str, Any]:
    """READY's ``staging`` for a local rank: the whole handle, or only its name and layout id
    when a READY on this connection already gave the rank that very arena and layout (a step of
    10,000 tensors otherwise packs, sends and decodes 10,000 layout rows every step)."""
    if peer.staging == (handle["name"], handle["layout_id"]):
        return {"kind": handle["kind"], "name": handle["name"], "layout_id": handle["layout_id"]}
    return handle


class Trainers:
    """Trainer requests (the loop routes them here), and the step's set-up up to READY."""

    def __init__(self, ctx: LoopContext, pipeline: Pipeline, pulls: Pulls, engines: Engines):
        self.ctx, self.pipeline, self.pulls, self.engines = ctx, pipeline, pulls, engines
        self.pending: list[tuple[bytes, Message]] = []  # BEGINs for a later step
        # step -> (error, ranks told, event number of the failure)
        self.failures: dict[int, tuple[RefitError, set[int], int]] = {}
        self.credits: dict[bytes, int] = {}  # frames taken this turn, per remote client
        #: the last step's declarations, checked against the plan: a step whose ranks declare the
        #: same pieces takes them over (sidecar.daemon.step.Skeleton)
        self.skeleton: Skeleton | None = None
        self._layout: tuple[Any, str] | None = None  # (the staging layout, its layout_id)
        self._direct: tuple[tuple, dict[str, int]] | None = None  # see _direct_inputs
        self._last_rows: dict[int, tuple[bytes, list[Any]]] = {}  # see _offer_rows

    def _peer(self, identity: bytes) -> Peer:
        return self.ctx.peers[identity]  # the loop checked it is a trainer rank

    def routes(self) -> dict[Kind, tuple[PeerRole | None, object]]:
        """The requests this component answers: ``{kind: (the role a peer must have, handler)}``."""
        t, same = PeerRole.TRAINER, self._of_current_attempt
        return {
            Kind.HELLO: (None, self.handle_hello),  # introduces a trainer rank, opens an attempt
            Kind.BEGIN: (t, same(self.handle_begin)),
            Kind.PIECE_DONE: (t, same(self.handle_piece_done)),
            Kind.SHARD: (t, same(self.handle_shard)),
            Kind.COMMIT: (t, same(self.handle_commit)),
            Kind.ABORT: (t, same(self.handle_abort)),
            Kind.PING: (None, self.handle_ping),  # anyone: ranks, readers, forwarders
        }

    def _of_current_attempt(self, handler):
        """``handler``, run only for a message that names no attempt or its connection's current
        one: a rank's messages after a HELLO belong to the attempt it opened (ZeroMQ keeps them in
        order), so one claiming another is forged or from a confused client. A PROTOCOL error (that
        fails the step in progress on every rank if the sender is one of its ranks)."""

        def checked(identity: bytes, msg: Message) -> None:
            claimed = msg.get("attempt")
            peer = self._peer(identity)
            if claimed is not None and (type(claimed) is not int or claimed != peer.attempt):
                raise ProtocolError(
                    f"rank {peer.rank}'s {msg.kind.name} names attempt {safe_repr(claimed, 40)}, but its "
                    f"connection's HELLO opened attempt {peer.attempt}: every message after a HELLO belongs "
                    "to the attempt it opened; run the same refitd version on the client and the daemon"
                )
            handler(identity, msg)

        return checked

    def handle_hello(self, identity: bytes, msg: Message) -> None:
        rank = msg.require("rank", int)
        world = msg.require("world_size", int)
        attempt, step = hello_attempt(rank, msg)
        known = self.ctx.peers.get(identity)  # every push says HELLO: the same connection
        if known is not None and known.role is PeerRole.TRAINER:
            known.attempt, known.attempt_step = attempt, step  # a refusal below answers this attempt
        if self.ctx.config.role is NodeRole.INFERENCE:
            raise RefitError(
                "this daemon is an inference node of a disaggregated layout: trainers push to the trainer "
                "node's daemon, which forwards each generation here",
                kind=ErrorKind.INVALID,
                rank=rank,
            )
        if world != self.ctx.config.world_size:
            raise RefitError(
                f"rank {rank} says world_size {world} but this daemon serves {self.ctx.config.world_size} ranks; "
                "start the daemon with the trainer's world size (--world-size)",
                kind=ErrorKind.INVALID,
                rank=rank,
            )
        if not 0 <= rank < world:
            raise RefitError(f"rank {rank} is outside [0, {world})", kind=ErrorKind.INVALID, rank=rank)
        for other in list(self.ctx.peers.values()):
            if other.role is PeerRole.TRAINER and other.rank == rank and other.identity != identity:
                del self.ctx.peers[other.identity]  # a restarted rank replaces its old connection
        pid, host, asked_local = msg.get("pid"), msg.get("host", ""), msg.get("local", False)
        if (
            not (pid is None or type(pid) is int)
            or not isinstance(host, str)
            or type(asked_local) is not bool
        ):
            raise ProtocolError(
                f"HELLO of rank {rank}: pid must be an int or absent (got {wire_type(pid)}), host a str "
                f"(got {wire_type(host)}), local a bool (got {wire_type(asked_local)}): send them with those types"
            )
        local = asked_local and self.ctx.config.listen.startswith("ipc://")
        self.ctx.peers[identity] = Peer(
            identity,
            PeerRole.TRAINER,
            time.monotonic(),
            rank=rank,
            pid=pid,
            host=host,
            local=local,
            hello_seq=self.ctx.next_event(),
            staging=known.staging if known is not None and known.local == local else None,
            attempt=attempt,
            attempt_step=step,
        )
        self.ctx.send(
            identity,
            Kind.WELCOME,
            {
                "instance": self.ctx.instance,
                "world_size": self.ctx.config.world_size,
                "local": local,
                "max_frame_bytes": self.ctx.config.max_frame_bytes,
                "credit_frames": self.ctx.config.credit_frames,
                "heartbeat_interval_s": self.ctx.config.heartbeat_interval_s,
                "rank_timeout_s": self.ctx.config.rank_timeout_s,
                "last_step": self.ctx.last_step,
                **({"pull": ["nixl"]} if self.pulls.ok and not local else {}),
            },
        )

    def handle_begin(self, identity: bytes, msg: Message) -> None:
        peer = self._peer(identity)
        step = msg.require("step", int)
        rows = msg.require("pieces", (list, bytes))  # rows, or msgpack of them (step.begin_rows)
        peer.attempt_step = step  # a failure of this step is news for this attempt
        failed = self.failures.get(step)
        if failed is not None:
            err, told, failed_at = failed
            if peer.rank not in told:
                told.add(peer.rank)
                self.ctx.send_error(identity, err)
                return
            if peer.hello_seq < failed_at:
                # This BEGIN crossed the ERROR we sent: the client raises it before anything else, and
                # a retry would say HELLO again first. Starting a step with it would hold every later
                # step until the step timeout.
                log.info(
                    "ignored rank %d's BEGIN of step %d, which failed before it arrived", peer.rank, step
                )
                return
        if self.ctx.last_step is not None and step <= self.ctx.last_step:
            raise RefitError(
                f"step {step} does not increase: step {self.ctx.last_step} is already published; push a later step",
                kind=ErrorKind.STEP_ORDER,
                rank=peer.rank,
                step=step,
            )
        if self.ctx.draining and (self.ctx.step is None or step != self.ctx.step.step):
            raise RefitError(
                "the daemon is shutting down; push to it again once it is back",
                kind=ErrorKind.SHUTDOWN,
                rank=peer.rank,
                step=step,
            )
        if self.ctx.step is None:
            if not self._can_start_step():
                self._park_begin(identity, msg)
                return
            if self.ctx.arenas.staging_tainted:
                self._retire_staging(step)
            self.ctx.begin_step(
                StepState(
                    step,
                    self.ctx.config.world_size,
                    time.monotonic() + self.ctx.config.step_timeout_s,
                    max_pieces=self.ctx.config.max_step_pieces,
                    skeleton=self.skeleton,
                )
            )
            self.failures.pop(step, None)
            if self.ctx.worker is not None:
                self.ctx.worker.forget_cancelled()  # nothing in flight; a retried step number must run
        elif step != self.ctx.step.step:
            if step < self.ctx.step.step:
                raise RefitError(
                    f"step {step} does not increase: step {self.ctx.step.step} is in progress",
                    kind=ErrorKind.STEP_ORDER,
                    rank=peer.rank,
                    step=step,
                )
            self._park_begin(identity, msg)
            return
        state = self.ctx.step
        try:
            state.begin(peer.rank, rows)
        except Exception:
            if not state.declared:  # a refused first BEGIN starts nothing: later steps must not wait on it
                self.ctx.end_step()
            raise
        state.peers[peer.rank] = identity
        offer = msg.get("nixl")
        if isinstance(offer, dict) and not peer.local:
            state.nixl_offers[peer.rank] = (offer, self._offer_rows(peer.rank, rows))
        if state.all_begun:
            self._all_begun()

    def _offer_rows(self, rank: int, pieces: Any) -> list[Any]:
        """A NIXL-offering rank's BEGIN rows, decoded (read only: the pull set-up's). The same bytes
        as its last BEGIN give the same list back, not decoded again: the pull set-up then knows
        them by identity (``Pulls.start``)."""
        last = self._last_rows.get(rank)
        if last is not None and type(pieces) is bytes and last[0] == pieces:
            return last[1]
        rows = begin_rows(rank, pieces)
        if type(pieces) is bytes:
            self._last_rows[rank] = (pieces, rows)
        return rows

    def _retire_staging(self, step: int) -> None:
        """The last step failed after its local ranks were handed staging: replace the arena before
        this one starts (nothing runs from staging now: no step, no unit in flight)."""
        for arena in self.ctx.arenas.stagings:
            self.pipeline.forget(arena)
        self.pulls.forget()  # a NIXL registration of it goes before its memory does
        try:
            self.ctx.arenas.retire_staging()
        except Exception as exc:  # a full GPU or /dev/shm: the next BEGIN tries again
            if stop_on_sticky(self.ctx, exc):  # no CUDA call can succeed again: the daemon exits
                raise RefitError(
                    f"the daemon stops for a restart: {self.ctx.fatal}", kind=ErrorKind.SHUTDOWN, step=step
                ) from None
            log.exception("could not make a fresh staging arena")
            raise RefitError(
                f"the daemon retired its staging arena after a failed step and could not make a new one "
                f"({type(exc).__name__}: {exc}); free GPU or /dev/shm memory, then push again",
                kind=ErrorKind.CAPACITY,
                step=step,
            ) from None
        record_segments(self.ctx.config, self.ctx.arenas.segment_names())  # crash clean-up lists it

    def _park_begin(self, identity: bytes, msg: Message) -> None:
        """Keep a BEGIN of a later step until the step in progress ends: the latest one per peer (a
        rank waits for each step before it begins the next, so an earlier one is superseded), so
        a peer repeating BEGINs cannot grow the queue."""
        self.pending = [(i, m) for i, m in self.pending if i != identity]
        self.pending.append((identity, msg))

    def _can_start_step(self) -> bool:
        return self.ctx.worker is None or self.ctx.worker.inflight == 0

    def _all_begun(self) -> None:
        state = self.ctx.step
        state.phases.all_begun = time.monotonic()
        state.settle(self.ctx.plan)
        if self.ctx.plan is None:
            plan_from_declarations(self.ctx, list(self.engines.engines.values()), state)
        elif not state.settled:
            plan_in_trainer_form(self.ctx, state)
        t0 = time.monotonic()
        state.validate_against(self.ctx.plan)
        self.skeleton = state.skeleton_for(self.ctx.plan)
        state.phases.validate = time.monotonic() - t0
        state.target = self.ctx.arenas.claim_target(time.monotonic(), self.ctx.config.reader_timeout_s)
        arenas = self.ctx.arenas
        staging = self._staging_handle()
        ring = arenas.ring
        # remote frames of passthrough inputs land in the generation itself, not staging
        # (sidecar.daemon.memory.direct), when it is claimed now and no rank is pulled over NIXL
        # (that READ lands in staging); never an input a local rank writes: it goes to staging
        if state.target is not None and arenas.direct and not state.nixl_offers:
            state.direct = self._direct_inputs(state)
        for rank, identity in state.peers.items():
            peer = self.ctx.peers.get(identity)
            fields = {
                "step": state.step,
                "pieces": state.piece_ids(rank),
                "credit_frames": self.ctx.config.credit_frames,
            }
            if skip := state.skipped_ids(rank):
                fields["skip"] = skip  # pieces outside this node's share: the rank does not send them
            if peer is not None and peer.local:
                fields["staging"] = staging_for(peer, staging)
                if arenas.lanes > 1:  # every GPU's staging arena, indexed as placement and SLOT name them
                    fields["stagings"] = self._staging_handles()
                state.staged.add(rank)  # only a rank handed the staging handle may say PIECE_DONE
            elif peer is not None and ring is None:
                fields.update(self.pulls.start(state, rank, identity, fields["pieces"]))
            elif peer is not None:
                fields.update(self.pulls.ring(state, rank, fields["pieces"], ring))
            if ring is not None:
                fields["ring"] = ring.wire()
                fields["placement"] = [
                    list(ring.placement(state.pieces[pid][1]))
                    for pid in fields["pieces"]
                    if pid not in state.skipped
                ]
            if self.ctx.send(identity, Kind.READY, fields) and "layout" in fields.get("staging", ()):
                peer.staging = (staging["name"], staging["layout_id"])  # it maps this one now
        state.ready_sent = True
        if ring is not None:
            self.pipeline.start_ring(state, ring)
        zero = state.tracker.complete()  # before any data: nothing, unless a tensor needs none
        if zero:
            self.pipeline.tensors_complete(zero)  # zero-byte tensors complete at once

    def _staging_handle(self) -> dict[str, Any]:
        """The staging arena's handle with a ``layout_id`` (a digest of its layout, made once per
        layout): a READY names an arena the rank already mapped by it (:func:`staging_for`)."""
        arena = self.ctx.arenas.staging
        if self._layout is None or self._layout[0] is not arena.layout:
            rows = msgpack.packb(arena.layout.to_wire(), use_bin_type=True)
            self._layout = (arena.layout, hashlib.blake2b(rows, digest_size=8).hexdigest())
        return {**arena.handle(), "layout_id": self._layout[1]}

    def _staging_handles(self) -> list[dict[str, Any]]:
        """Several GPUs: each GPU's staging arena handle, by lane (a ring's arenas carry no
        layout: the handles are small, sent whole each step)."""
        return [arena.handle() for arena in self.ctx.arenas.stagings]

    def _direct_inputs(self, state: StepState) -> dict[str, int]:
        """The passthrough inputs whose frames this step writes straight into its generation:
        those of ``Arenas.direct`` no local rank holds a piece of (a local rank writes staging,
        and the daemon copies it out). The same dict object while the pieces, the local ranks and
        the arenas' offsets stay (the span table is made once per such dict)."""
        local = frozenset(
            rank
            for rank, identity in state.peers.items()
            if (peer := self.ctx.peers.get(identity)) is not None and peer.local
        )
        key = (state.pieces if state.settled else None, local, self.ctx.arenas.direct)
        held = self._direct
        if (
            held is not None
            and key[0] is not None
            and held[0][0] is key[0]
            and held[0][1] == key[1]
            and held[0][2] is key[2]
        ):
            return held[1]
        direct = self.ctx.arenas.direct
        if local:
            staged = {name for rank, name, _ in state.pieces if rank in local}
            direct = {name: at for name, at in direct.items() if name not in staged}
        self._direct = (key, direct)
        return direct

    def handle_piece_done(self, identity: bytes, msg: Message) -> None:
        peer, state = self._peer(identity), self._current(msg)
        if not peer.local or peer.rank not in state.staged:
            raise RefitError(
                f"rank {peer.rank} said PIECE_DONE, but this daemon never handed it the staging arena "
                "(a remote peer: it did not say local in HELLO, or it came over tcp://, where every peer is "
                "remote): only a local rank that READY gave the staging handle writes pieces in place; send "
                "the data as SHARD frames",
                kind=ErrorKind.PROTOCOL,
                rank=peer.rank,
                step=state.step,
            )
        ids = msg.require("pieces", list)
        # the ids' types in one pass in C (a batch names hundreds); the first odd one found only then
        odd = ids and set(map(type, ids)) != _INT
        bad = next((pid for pid in ids if type(pid) is not int), None) if odd else None
        if odd or not ids:
            raise RefitError(
                f"rank {peer.rank}'s PIECE_DONE: pieces must be a non-empty list of ints (the ids READY "
                f"listed), got {'an empty list' if not ids else 'a ' + wire_type(bad) + ' in it'}",
                kind=ErrorKind.PROTOCOL,
                rank=peer.rank,
                step=state.step,
            )
        if self.ctx.arenas.ring is not None:
            for pid in ids:
                self.pipeline.check_granted(peer.rank, state.piece(peer.rank, pid)[0], state)
        complete = state.pieces_done(peer.rank, ids)  # submitted together: small passthroughs as spans
        if complete:
            self.pipeline.tensors_complete(complete)

    def handle_shard(self, identity: bytes, msg: Message) -> None:
        peer, state = self._peer(identity), self._current(msg)
        pid = msg.require("piece", int)
        offsets, shape = msg.require("offsets", list), msg.require("shape", list)
        name, _ = state.piece(peer.rank, pid)
        if len(msg.frames) != 1:
            raise RefitError(
                f"rank {peer.rank}: SHARD of {name!r} carries {len(msg.frames)} data frames: send exactly one",
                kind=ErrorKind.PROTOCOL,
                rank=peer.rank,
                step=state.step,
            )
        self.pipeline.check_granted(peer.rank, name, state)
        if pid in state.pulling:
            # its READ may still be writing: taking frames for it could let its group's region go
            # to another group under that READ
            raise RefitError(
                f"rank {peer.rank} sent a SHARD of {name!r}, a piece READY listed under pull: the daemon "
                "READs it over NIXL; send frames only for pieces not pulled, or whose PULLED said failed",
                kind=ErrorKind.PROTOCOL,
                rank=peer.rank,
                step=state.step,
            )
        dest_full = self.pipeline.staged(name)
        for field_name, v in (("offsets", offsets), ("shape", shape)):
            if len(v) != dest_full.dim() or any(type(d) is not int or d < 0 for d in v):
                raise RefitError(
                    f"rank {peer.rank}: SHARD of {name!r}: {field_name} is a {wire_type(v)}, expected a "
                    f"list of {dest_full.dim()} non-negative ints (global coordinates of the block)",
                    kind=ErrorKind.PROTOCOL,
                    rank=peer.rank,
                    step=state.step,
                )
        data = msg.frames[0].buffer if hasattr(msg.frames[0], "buffer") else memoryview(msg.frames[0])
        nbytes = len(data)
        expected = dest_full.element_size() * math.prod(shape)
        if nbytes != expected:
            raise RefitError(
                f"rank {peer.rank}: SHARD of {name!r} at {offsets} shape {shape} carries {nbytes} bytes, "
                f"expected {expected}",
                kind=ErrorKind.PROTOCOL,
                rank=peer.rank,
                step=state.step,
            )
        # by position, before a byte is written: a block outside its piece or sent twice fails the step
        done = state.piece_received(peer.rank, pid, offsets, shape)
        if not any(offsets) and list(dest_full.shape) == shape:
            dest = dest_full  # the whole tensor
        else:
            dest = dest_full[tuple(slice(o, o + s) for o, s in zip(offsets, shape))]
        if nbytes:
            src = torch.frombuffer(data, dtype=torch.uint8).view(dest.dtype).view(shape)
            dest.copy_(src)
        self.credits[identity] = self.credits.get(identity, 0) + 1
        if done:
            self.pipeline.tensor_complete(done)

    def handle_commit(self, identity: bytes, msg: Message) -> None:
        peer, state = self._peer(identity), self._current(msg)
        state.commit(peer.rank)
        self.ctx.send(identity, Kind.ACK, {"step": state.step, "of": "commit"})
        self.pipeline.local_committed()
        self.pipeline.maybe_publish()

    def handle_abort(self, identity: bytes, msg: Message) -> None:
        peer = self._peer(identity)
        step = msg.require("step", int)
        if self.ctx.step is not None and self.ctx.step.step == step:
            reason = msg.get("reason", "no reason given")
            if not isinstance(reason, str):
                reason = f"(a {wire_type(reason)} instead of a str reason)"
            self.ctx.fail_step(
                RefitError(
                    f"rank {peer.rank} aborted the step: {reason}",
                    kind=ErrorKind.ABORTED,
                    rank=peer.rank,
                    step=step,
                )
            )

    def handle_ping(self, identity: bytes, msg: Message) -> None:
        fields: dict[str, Any] = {"instance": self.ctx.instance}
        state = self.ctx.step
        if state is not None and not state.all_begun and identity in state.peers.values():
            # a rank waiting for READY: which ranks have not begun (named in its error if it times out)
            fields.update(step=state.step, waiting_for=state.missing_ranks())
        self.ctx.send(identity, Kind.PONG, fields)

    def step_protocol_error(self, identity: bytes, exc: ProtocolError) -> bool:
        """A ProtocolError from a rank taking part in the step in progress fails that step on every
        rank at once (they would otherwise wait for the step timeout); True if it did."""
        state, peer = self.ctx.step, self.ctx.peers.get(identity)
        if (
            state is None
            or peer is None
            or peer.role is not PeerRole.TRAINER
            or state.peers.get(peer.rank) != identity
        ):
            return False
        self.ctx.fail_step(RefitError(str(exc), kind=ErrorKind.PROTOCOL, rank=peer.rank, step=state.step))
        return True

    def _current(self, msg: Message) -> StepState:
        step = msg.require("step", int)
        if self.ctx.step is None or self.ctx.step.step != step or not self.ctx.step.ready_sent:
            raise ProtocolError(
                f"{msg.kind.name} for step {step}, which is not in progress (failed or not begun)"
            )
        return self.ctx.step

    # ---- the loop's questions

    def take_pending(self) -> list[tuple[bytes, Message]]:
        """The BEGINs kept for a later step, if a step may start now (the loop runs them again)."""
        if self.ctx.step is not None or not self.pending or not self._can_start_step():
            return []
        pending, self.pending = self.pending, []
        return pending

    def flush_credits(self) -> None:
        """One CREDIT per client per turn of the loop, for every frame taken in that turn."""
        credits, self.credits = self.credits, {}
        state = self.ctx.step
        if state is not None:
            for identity, frames in credits.items():
                self.ctx.send(identity, Kind.CREDIT, {"step": state.step, "frames": frames})

    def tell_failed(self, state: StepState, err: RefitError) -> None:
        """Step ``state`` failed: every trainer rank hears ``err``; ranks that did not are told when
        they BEGIN it again. A rank whose current attempt pushes this step hears it as an answer to
        that attempt (a retry it opens later ignores it); any other rank hears it naming no attempt:
        its attempt at this step, whose HELLO is not here yet, has failed too (the other ranks'
        did), and must not BEGIN a step of one rank that holds every later step until the timeout."""
        told = set()
        for peer in self.ctx.peers.of_role(PeerRole.TRAINER):
            if peer.rank is not None:
                self.ctx.send_error(peer.identity, err, untagged=peer.attempt_step != state.step)
                told.add(peer.rank)
        self.failures[state.step] = (err, told, self.ctx.next_event())
        while len(self.failures) > MAX_REMEMBERED_FAILURES:
            self.failures.pop(next(iter(self.failures)))


#: the largest attempt a HELLO may name: msgpack's int64
MAX_ATTEMPT = (1 << 63) - 1


def hello_attempt(rank: int, msg: Message) -> tuple[int, int]:
    """HELLO's ``attempt`` (the client numbers its pushes; the daemon names it in every answer, so the
    client can tell a late answer to an attempt it gave up from one to its retry of the same step)
    and ``step`` (the step that attempt pushes). Absent or not a plain non-negative int: a client of
    another refitd version, or a forged HELLO; a ProtocolError naming the field."""
    if "attempt" not in msg.fields:
        raise ProtocolError(
            f"HELLO of rank {rank} lacks its attempt (an int the client numbers its pushes with, named in "
            "every answer): a client older than attempts; run the same refitd version on the client and the daemon"
        )
    for name in ("attempt", "step"):
        value = msg.get(name)
        if type(value) is not int or not 0 <= value <= MAX_ATTEMPT:
            raise ProtocolError(
                f"HELLO of rank {rank}: {name} must be a non-negative int (at most {MAX_ATTEMPT}), got "
                f"{wire_type(value)} {safe_repr(value, 40)}; run the same refitd version on the client and the daemon"
            )
    return msg.fields["attempt"], msg.fields["step"]
