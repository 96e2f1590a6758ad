"""The trainer side of the serve loop: ranks say HELLO, BEGIN a step, send their data, COMMIT.

A mixin of :class:`sidecar.daemon.Daemon` (it uses the daemon's state: ``peers``, ``step``,
``arenas``, ``plan``, ``config``, ``pull``, ``failures``, ``pending``). Data arrives three ways:
written by local ranks straight into staging (PIECE_DONE), as ZeroMQ frames from remote ranks
(SHARD), or READ over NIXL from a remote rank's registered memory (sidecar.pull_nixl). With a
staging ring (sidecar.staging) each layer group is written only once the daemon grants it a region
(SLOT); data for a group without one is a protocol error.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from sidecar.attach import check_manifest
from sidecar.config import NodeRole
from sidecar.errors import ErrorKind, RefitError
from sidecar.gcpause import freeze_long_lived
from sidecar.plan import RefitPlan
from sidecar.pull_nixl import PullSide
from sidecar.readers import Peer
from sidecar.step import StepState, wire_type
from transport.wire import Kind, Message, ProtocolError

log = logging.getLogger("refitd.daemon")


class TrainerHandlers:
    """``handle_<kind>`` for trainer ranks, and the step's set-up up to READY and its grants."""

    def _trainer(self, identity: bytes) -> Peer:
        peer = self.peers.get(identity)
        if peer is None or peer.role != "trainer":
            raise RefitError(
                "say HELLO first (the daemon restarted, or this peer never introduced itself)",
                kind=ErrorKind.UNKNOWN_PEER,
            )
        return peer

    # ---- trainers

    def handle_hello(self, identity: bytes, msg: Message) -> None:
        rank = msg.require("rank", int)
        world = msg.require("world_size", int)
        if self.config.role is NodeRole.INFERENCE:
            raise RefitError(
                "this daemon is an inference node of a disaggregated layout: trainers push to the trainer "
                "node's daemon, which forwards each generation here",
                kind=ErrorKind.INVALID,
                rank=rank,
            )
        if world != self.config.world_size:
            raise RefitError(
                f"rank {rank} says world_size {world} but this daemon serves {self.config.world_size} ranks; "
                "start the daemon with the trainer's world size (--world-size)",
                kind=ErrorKind.INVALID,
                rank=rank,
            )
        if not 0 <= rank < world:
            raise RefitError(f"rank {rank} is outside [0, {world})", kind=ErrorKind.INVALID, rank=rank)
        for other in list(self.peers.values()):
            if other.role == "trainer" and other.rank == rank and other.identity != identity:
                del self.peers[other.identity]  # a restarted rank replaces its old connection
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
        local = asked_local and self.config.listen.startswith("ipc://")
        self.peers[identity] = Peer(
            identity,
            "trainer",
            time.monotonic(),
            rank=rank,
            pid=pid,
            host=host,
            local=local,
            hello_seq=self._next_event(),
        )
        self._send(
            identity,
            Kind.WELCOME,
            {
                "instance": self.instance,
                "world_size": self.config.world_size,
                "local": local,
                "max_frame_bytes": self.config.max_frame_bytes,
                "credit_frames": self.config.credit_frames,
                "heartbeat_interval_s": self.config.heartbeat_interval_s,
                "rank_timeout_s": self.config.rank_timeout_s,
                "last_step": self.last_step,
                **({"pull": ["nixl"]} if self.pull_ok and not local else {}),
            },
        )

    def handle_begin(self, identity: bytes, msg: Message) -> None:
        peer = self._trainer(identity)
        step = msg.require("step", int)
        rows = msg.require("pieces", list)
        failed = self.failures.get(step)
        if failed is not None:
            err, told, failed_at = failed
            if peer.rank not in told:
                told.add(peer.rank)
                self._send_error(identity, err)
                return
            if peer.hello_seq < failed_at:
                # This BEGIN crossed the ERROR we sent: the client raises it before anything else, and
                # a retry would say HELLO again first. Starting a step with it would hold every later
                # step until the step timeout.
                log.info(
                    "ignored rank %d's BEGIN of step %d, which failed before it arrived", peer.rank, step
                )
                return
        if self.last_step is not None and step <= self.last_step:
            raise RefitError(
                f"step {step} does not increase: step {self.last_step} is already published; push a later step",
                kind=ErrorKind.STEP_ORDER,
                rank=peer.rank,
                step=step,
            )
        if self._draining and (self.step is None or step != self.step.step):
            raise RefitError(
                "the daemon is shutting down; push to it again once it is back",
                kind=ErrorKind.SHUTDOWN,
                rank=peer.rank,
                step=step,
            )
        if self.step is None:
            if not self._can_start_step():
                self._park_begin(identity, msg)
                return
            self.step = StepState(
                step,
                self.config.world_size,
                time.monotonic() + self.config.step_timeout_s,
                max_pieces=self.config.max_step_pieces,
            )
            self.failures.pop(step, None)
            if self.worker is not None:
                self.worker.forget_cancelled()  # nothing in flight; a retried step number must run
        elif step != self.step.step:
            if step < self.step.step:
                raise RefitError(
                    f"step {step} does not increase: step {self.step.step} is in progress",
                    kind=ErrorKind.STEP_ORDER,
                    rank=peer.rank,
                    step=step,
                )
            self._park_begin(identity, msg)
            return
        state = self.step
        state.begin(peer.rank, rows)
        state.peers[peer.rank] = identity
        offer = msg.get("nixl")
        if isinstance(offer, dict) and not peer.local:
            state.nixl_offers[peer.rank] = (offer, rows)
        if state.all_begun:
            self._all_begun()

    def _park_begin(self, identity: bytes, msg: Message) -> None:
        """Keep a BEGIN of a later step until the step in progress ends: the latest one per peer (a
        rank waits for each step before it begins the next, so an earlier one is superseded), so
        a peer repeating BEGINs cannot grow the queue."""
        self.pending = [(i, m) for i, m in self.pending if i != identity]
        self.pending.append((identity, msg))

    def _next_event(self) -> int:
        self.events += 1
        return self.events

    def _can_start_step(self) -> bool:
        return self.worker is None or self.worker.inflight == 0

    def _all_begun(self) -> None:
        state = self.step
        state.phases.all_begun = time.monotonic()
        if self.plan is None:
            self._plan_from_declarations(state)
        t0 = time.monotonic()
        state.validate_against(self.plan)
        state.phases.validate = time.monotonic() - t0
        self.target = self.arenas.claim_target(time.monotonic(), self.config.reader_timeout_s)
        staging = self.arenas.staging.handle()
        ring = self.arenas.ring
        for rank, identity in state.peers.items():
            peer = self.peers.get(identity)
            fields = {
                "step": state.step,
                "pieces": state.piece_ids(rank),
                "credit_frames": self.config.credit_frames,
            }
            if peer is not None and peer.local:
                fields["staging"] = staging
                state.staged.add(rank)  # only a rank handed the staging handle may say PIECE_DONE
            elif peer is not None and ring is None:
                fields.update(self._pull_start(state, rank, identity, fields["pieces"]))
            elif peer is not None:
                self.pull_movers[str(rank)] = {"mover": "zmq", "reason": self.pull_reason}
                fields.update({"pull": [], "mover_reason": self.pull_reason})
            if ring is not None:
                fields["ring"] = ring.wire()
                fields["placement"] = [list(ring.placement(state.pieces[pid][1])) for pid in fields["pieces"]]
            self._send(identity, Kind.READY, fields)
        state.ready_sent = True
        self.parked = {}
        if ring is not None:
            self.ring_ranks = {}
            for rank, name, _ in state.pieces:
                self.ring_ranks.setdefault(ring.group_of[name], set()).add(rank)
            self._grant(ring.start())
        for name in [i.name for i in self.plan.inputs if state.tracker.tensor_complete(i.name)]:
            self._tensor_complete(name)  # zero-byte tensors complete at once

    def _grant(self, grants) -> None:
        """Staging ring: tell every rank holding part of each newly granted group where to write it."""
        state, ring = self.step, self.arenas.ring
        for gi, slot in grants:
            for rank in sorted(self.ring_ranks.get(gi, ())):
                self._send(
                    state.peers[rank], Kind.SLOT, {"step": state.step, "group": gi, "offset": slot.offset}
                )
            ring.preload(gi, state.complete)
            for unit in self.parked.pop(gi, ()):
                self._submit(unit)

    def _plan_from_declarations(self, state: StepState) -> None:
        keeps = {e.keep_bf16 for e in self.engines.values()}
        if len(keeps) > 1:
            raise RefitError(
                f"the attached engine workers disagree on which routed experts are BF16: "
                f"{sorted(e.name for e in self.engines.values())}; every engine must agree on one plan",
                kind=ErrorKind.ENGINE,
                step=state.step,
            )
        for e in self.engines.values():
            check = check_manifest(state.specs(), self.spec, e.manifest)
            if not check.ok:
                raise RefitError(
                    check.message(f"engine worker {e.name!r}"), kind=ErrorKind.ENGINE, step=state.step
                )
        try:
            plan = RefitPlan.build(state.specs(), self.spec, keep_bf16=next(iter(keeps), ()))
            self.arenas.apply_plan(plan)
        except ValueError as exc:
            raise RefitError(
                str(exc),
                kind=ErrorKind.CAPACITY if "arena" in str(exc) else ErrorKind.INVALID,
                step=state.step,
            ) from None
        self.plan = plan
        freeze_long_lived()  # the plan lives as long as the daemon: no collection walks it again
        log.info(
            "plan fixed from step %d: %d inputs, %d outputs, %d units",
            state.step,
            len(plan.inputs),
            len(plan.outputs),
            len(plan.units),
        )

    def handle_piece_done(self, identity: bytes, msg: Message) -> None:
        peer, state = self._trainer(identity), self._current(msg)
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
        bad = next((pid for pid in ids if type(pid) is not int), None)
        if bad is not None or not ids:
            raise RefitError(
                f"rank {peer.rank}'s PIECE_DONE: pieces must be a non-empty list of ints (the ids READY "
                f"listed), got {'an empty list' if not ids else 'a ' + wire_type(bad) + ' in it'}",
                kind=ErrorKind.PROTOCOL,
                rank=peer.rank,
                step=state.step,
            )
        ring = self.arenas.ring
        for pid in ids:
            name, _ = state.piece(peer.rank, pid)
            if ring is not None:
                self._check_granted(peer.rank, name, state)
            done = state.piece_received(peer.rank, pid)
            if done:
                self._tensor_complete(done)

    def handle_shard(self, identity: bytes, msg: Message) -> None:
        peer, state = self._trainer(identity), self._current(msg)
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
        self._check_granted(peer.rank, name, state)
        dest_full = self._staged(name)
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
        expected = dest_full.element_size() * _prod(shape)
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
        self._credits[identity] = self._credits.get(identity, 0) + 1
        if done:
            self._tensor_complete(done)

    def _staged(self, name: str) -> torch.Tensor:
        """Input ``name`` in staging: its slot there, or its group's region of the staging ring."""
        ring = self.arenas.ring
        return self.arenas.staging.tensor(name) if ring is None else ring.view(self.arenas.staging, name)

    def _check_granted(self, rank: int, name: str, state: StepState) -> None:
        ring = self.arenas.ring
        if ring is not None and not ring.granted(ring.group_of[name]):
            group = ring.groups[ring.group_of[name]]
            raise RefitError(
                f"rank {rank} sent data of {name!r} ({group.label}) before the daemon granted that group a "
                "staging region (SLOT): a client must write a group only after its SLOT",
                kind=ErrorKind.PROTOCOL,
                rank=rank,
                step=state.step,
            )

    def handle_commit(self, identity: bytes, msg: Message) -> None:
        peer, state = self._trainer(identity), self._current(msg)
        state.commit(peer.rank)
        self._send(identity, Kind.ACK, {"step": state.step, "of": "commit"})
        self._maybe_publish()

    def handle_abort(self, identity: bytes, msg: Message) -> None:
        peer = self._trainer(identity)
        step = msg.require("step", int)
        if self.step is not None and self.step.step == step:
            reason = msg.get("reason", "no reason given")
            if not isinstance(reason, str):
                reason = f"(a {wire_type(reason)} instead of a str reason)"
            self._fail_step(
                RefitError(
                    f"rank {peer.rank} aborted the step: {reason}",
                    kind=ErrorKind.ABORTED,
                    rank=peer.rank,
                    step=step,
                )
            )

    def handle_ping(self, identity: bytes, msg: Message) -> None:
        self._send(identity, Kind.PONG, {"instance": self.instance})

    def _step_protocol_error(self, identity: bytes, exc: ProtocolError) -> bool:
        """A ProtocolError from a rank taking part in the step in progress fails that step on every
        rank at once (they would otherwise wait for the step timeout); True if it did."""
        state, peer = self.step, self.peers.get(identity)
        if state is None or peer is None or peer.role != "trainer" or state.peers.get(peer.rank) != identity:
            return False
        self._fail_step(RefitError(str(exc), kind=ErrorKind.PROTOCOL, rank=peer.rank, step=state.step))
        return True

    def _current(self, msg: Message) -> StepState:
        step = msg.require("step", int)
        if self.step is None or self.step.step != step or not self.step.ready_sent:
            raise ProtocolError(
                f"{msg.kind.name} for step {step}, which is not in progress (failed or not begun)"
            )
        return self.step

    # ---- remote shards over NIXL (sidecar.pull_nixl)

    def _pull_start(self, state: StepState, rank: int, identity: bytes, ids: list[int]) -> dict[str, Any]:
        """READY's ``pull`` fields for a remote rank: post the READ of its pieces whose staging
        destination is contiguous; anything else (or any failure) travels as ZeroMQ frames."""
        offer, rows = state.nixl_offers.get(rank, (None, None))
        if offer is None:
            why = self.pull_reason if not self.pull_ok else "the client did not offer NIXL"
            self.pull_movers[str(rank)] = {"mover": "zmq", "reason": why}
            return {"pull": [], "mover_reason": why}
        try:
            regions = offer["regions"]
            if len(regions) != len(ids) or len(rows) != len(ids):
                raise ValueError(f"{len(regions)} regions for {len(ids)} pieces")
            views = self.arenas.staging.tensors()
            targets = []
            for index, (pid, row) in enumerate(zip(ids, rows)):
                name, offsets, shape = row[0], row[3], row[4]
                view = views[name]
                if any(offsets) or list(view.shape) != shape:  # a part of the tensor, not all of it
                    view = view[tuple(slice(int(o), int(o) + int(s)) for o, s in zip(offsets, shape))]
                if view.numel() and view.is_contiguous() and int(regions[index][1]):
                    targets.append((pid, view, index))
            if not targets:
                raise ValueError("no piece has a contiguous staging destination")
            if self.pull is None:
                self.pull = PullSide(f"refitd-{self.instance}-pull")
            pull = self.pull.start(self.arenas.staging, rank, identity, offer, targets, b"")
        except Exception as exc:  # NixlError, a malformed offer: frames instead
            why = f"NIXL pull set-up failed: {type(exc).__name__}: {exc}"
            log.warning("rank %d step %d: %s; ZeroMQ frames", rank, state.step, why)
            self.pull_movers[str(rank)] = {"mover": "zmq", "reason": why}
            return {"pull": [], "mover_reason": why}
        streamed = len(ids) - len(pull.pieces)
        why = f"{streamed} piece(s) without a contiguous staging destination go as frames" if streamed else ""
        self.pull_movers[str(rank)] = {"mover": "nixl" if not streamed else "nixl+zmq", "reason": why}
        return {"pull": pull.pieces, "mover_reason": why}

    def _pull_progress(self) -> None:
        if self.pull is None or not self.pull.inflight:
            return
        for pull, failed in self.pull.poll():
            state = self.step
            if state is None:
                continue
            if failed is not None:
                why = f"NIXL READ failed: {failed}"
                log.warning(
                    "rank %d step %d: %s; the client sends frames instead", pull.rank, state.step, why
                )
                self.pull_movers[str(pull.rank)] = {"mover": "zmq", "reason": why}
                self._send(
                    pull.identity,
                    Kind.PULLED,
                    {"step": state.step, "pieces": [], "failed": pull.pieces, "reason": why},
                )
                continue
            try:
                for pid in pull.pieces:
                    done = state.piece_received(pull.rank, pid)
                    if done:
                        self._tensor_complete(done)
            except RefitError as exc:
                self._fail_step(exc)
                return
            self._send(pull.identity, Kind.PULLED, {"step": state.step, "pieces": pull.pieces})


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
