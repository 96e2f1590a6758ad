"""The engine side of the serve loop: readers and engine workers attach, wait, release, detach.

A component of the serve loop (sidecar.daemon.loop), built with its :class:`LoopContext`; the loop
routes reader requests here once it checked the peer attached. Engine workers attach with a manifest
that is checked against the plan (``sidecar.plan.attach``); a routed expert the engine holds in BF16
re-plans the daemon so it is published in BF16. After each publish a ``LoadRound`` collects every
engine worker's acknowledgement and reports it to the step's trainers as ``LOADED``.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from sidecar.daemon.load_rounds import EngineState, LoadRound, new_round
from sidecar.daemon.memory.staging import ArenaTooSmall
from sidecar.daemon.peers import Peer
from sidecar.daemon.step import wire_type
from sidecar.errors import ErrorKind, RefitError
from sidecar.ops.observers import notify
from sidecar.plan.attach import check_manifest, engine_bf16_modules
from sidecar.plan.build import RefitPlan
from sidecar.protocol.enums import PeerRole, WaitMode
from sidecar.protocol.manifest import Manifest
from transport.wire import Kind, Message, ProtocolError, safe_repr

if TYPE_CHECKING:  # pragma: no cover
    from sidecar.daemon.context import LoopContext

log = logging.getLogger("refitd.daemon")

MAX_LOAD_ERROR_CHARS = 2000  # how much of an engine worker's load error is kept and reported


class Engines:
    """Attached engine workers (with their manifests), reader requests, and the load rounds."""

    def __init__(self, ctx: LoopContext):
        self.ctx = ctx
        self.engines: dict[bytes, EngineState] = {}  # attached engine workers, with their manifests
        self.rounds: dict[int, LoadRound] = {}  # published steps still waiting for engine acks
        self.next_reader_check = 0.0  # when to look for readers silent past reader_timeout_s next

    def routes(self) -> dict[Kind, tuple[PeerRole | None, object]]:
        """The requests this component answers: ``{kind: (the role a peer must have, handler)}``."""
        return {
            Kind.ATTACH: (None, self.handle_attach),  # introduces a reader
            Kind.WAIT: (PeerRole.READER, self.handle_wait),
            Kind.RELEASE: (PeerRole.READER, self.handle_release),
            Kind.DETACH: (None, self.handle_detach),  # a goodbye: idempotent, from anyone
        }

    def handle_attach(self, identity: bytes, msg: Message) -> None:
        name, pid = msg.get("name", ""), msg.get("pid")
        if type(name) is not str or not (pid is None or type(pid) is int):
            raise ProtocolError(
                f"ATTACH: name must be a str (got {wire_type(name)}) and pid an int or absent (got "
                f"{wire_type(pid)}): send the engine worker's name as a str and its process id as an int"
            )
        warnings: list[str] = []
        if msg.get("manifest") is not None:
            try:
                manifest = Manifest.from_wire(msg.require("manifest", dict))
            except ValueError as exc:
                raise RefitError(f"engine worker {name!r}: {exc}", kind=ErrorKind.ENGINE) from None
            warnings = self._attach_engine(identity, name, manifest)
        self.ctx.peers[identity] = Peer(identity, PeerRole.READER, time.monotonic(), pid=pid, name=name)
        stream = self.ctx.streams.attached(identity, msg)  # streamed refit, if the reader asked for it
        live = self.ctx.arenas.live_generation()
        self.ctx.send(
            identity,
            Kind.ATTACHED,
            {
                **({} if stream is None else {"stream": stream}),
                "instance": self.ctx.instance,
                "live_step": None if live is None else live.step,
                "format": self.ctx.spec.fmt.value,
                "checked": self.ctx.plan is not None,
                "warnings": warnings,
                # a reader pings this often while attached; one silent for reader_timeout_s is dropped
                "heartbeat_interval_s": self.reader_ping_interval(),
                "reader_timeout_s": self.ctx.config.reader_timeout_s,
                "epochs": self.ctx.arenas.epochs.handle(),  # map read-only: Generation.intact() reads it
            },
        )

    def reader_ping_interval(self) -> float:
        """How often an attached reader pings: the rank heartbeat, and at least 4 times per reader timeout."""
        return min(self.ctx.config.heartbeat_interval_s, self.ctx.config.reader_timeout_s / 4)

    def expire_readers(self, now: float) -> None:
        """Drop readers silent for longer than ``reader_timeout_s``: they ping while attached
        (adapters.base.RefitReader), so silence means the process died or hung without DETACH. An
        expired reader loses its holds (a step waiting for its generation goes on), its engine
        registration and its place in ``status``; if it comes back, the daemon says UNKNOWN_PEER and
        it attaches again."""
        if now < self.next_reader_check:
            return
        self.next_reader_check = now + self.reader_ping_interval()
        limit = self.ctx.config.reader_timeout_s
        gone = [p for p in self.ctx.peers.of_role(PeerRole.READER) if now - p.last_seen > limit]
        for peer in gone:
            held = [g.index for g in self.ctx.arenas.generations if peer.identity in g.holders]
            log.warning(
                "reader %r (pid %s) silent for %.1f s (reader_timeout_s=%g): it went away without DETACH; "
                "dropping it%s",
                peer.name,
                peer.pid,
                now - peer.last_seen,
                limit,
                f" and its hold on generation(s) {held}" if held else "",
            )
            self.drop_engine(
                peer.identity, f"stopped responding (silent for more than {limit:g} s): it died or hung"
            )
        if gone:
            self.finish_rounds(now)
            self.ctx.maybe_claim()

    def _attach_engine(self, identity: bytes, name: str, manifest: Manifest) -> list[str]:
        """Check ``manifest`` against the plan (re-planning for the engine's BF16 experts); the
        worker is registered only if it passes. Returns warnings for the worker."""
        for other_id, other in list(self.engines.items()):
            if other.name == name and other_id != identity:  # a restarted worker replaces itself
                self.drop_engine(other_id, f"re-attached as a new process ({name})")
        if self.ctx.plan is None:  # no plan before the first step: checked when the step fixes it
            self.engines[identity] = EngineState(
                identity, name, manifest, engine_bf16_modules(manifest, self.ctx.spec.model_type)
            )
            return ["no plan yet: the manifest is checked when the first step fixes the plan"]
        # the plan's own spec: its checkpoint dtype may have come from the first engine's manifest
        check = check_manifest(self.ctx.plan.source, self.ctx.plan.spec, manifest, share=self.ctx.plan.share)
        if not check.ok:
            raise RefitError(check.message(f"engine worker {name!r}"), kind=ErrorKind.ENGINE)
        if (check.plan.keep_bf16, check.plan.spec.params) != (
            self.ctx.plan.keep_bf16,
            self.ctx.plan.spec.params,
        ):
            self._replan_for(name, check.plan)
        self.engines[identity] = EngineState(identity, name, manifest, check.plan.keep_bf16)
        if check.warnings:
            log.warning("engine worker %s attached: %s", name, "; ".join(check.warnings))
        return check.warnings

    def _replan_for(self, name: str, plan: RefitPlan) -> None:
        """Publish in BF16 what engine ``name`` holds in BF16, and in the format parameters it holds
        (INT4 group and scale dtype, NVFP4's names): the manifest wins, if nothing forbids it."""
        if plan.spec.params != self.ctx.plan.spec.params:
            self._replan_params(name, plan)
            if plan.keep_bf16 == self.ctx.plan.keep_bf16:
                return
        if _published(plan) == _published(self.ctx.plan):
            return  # the engine's BF16 experts are published BF16 already (--format bf16): nothing changes
        kept = sorted(plan.keep_bf16 - self.ctx.plan.keep_bf16)
        disagree = [e.name for e in self.engines.values() if e.keep_bf16 != plan.keep_bf16]
        if disagree:
            raise RefitError(
                f"engine worker {name!r} holds {len(kept)} routed-expert tensors in BF16 (e.g. {kept[:2]}) that "
                f"engine workers {disagree} hold in {self.ctx.spec.fmt.value}; every engine must agree on one plan",
                kind=ErrorKind.ENGINE,
            )
        if self.ctx.step is not None:
            raise RefitError(
                f"engine worker {name!r} needs a different plan (BF16 experts) but step {self.ctx.step.step} is in "
                "progress; attach again after it",
                kind=ErrorKind.BUSY,
            )
        try:
            self.ctx.adopt_plan(plan, invalidate=True)
        except ArenaTooSmall as exc:
            raise RefitError(
                f"engine worker {name!r} holds {len(kept)} routed-expert tensors in BF16 that the plan would "
                f"quantize (e.g. {kept[:2]}), and publishing them in BF16 does not fit: {exc}. Start the daemon "
                "with the same BF16 exclusions as the engine (--ignore / --first-bf16 / --last-bf16) or a larger "
                "--publish-bytes",
                kind=ErrorKind.CAPACITY,
            ) from None
        log.warning(
            "engine worker %s holds %d routed-expert tensors in BF16: publishing them in BF16 from the next step",
            name,
            len(kept),
        )

    def _replan_params(self, name: str, plan: RefitPlan) -> None:
        """Publish in the format parameters engine ``name`` holds (its manifest decides, SPEC §1.7 and
        §2.3), if no attached engine holds others and no step is in progress."""
        fmt, want = plan.spec.format, plan.spec.params
        held = f"{fmt.value} with {want.describe(fmt)}"
        disagree = [e.name for e in self.engines.values() if e.manifest.format_params.for_format(fmt) != want]
        if disagree:
            raise RefitError(
                f"engine worker {name!r} holds {held}, engine workers {disagree} hold "
                f"{self.ctx.plan.spec.params.describe(fmt)}; every engine must agree on one plan: start them with "
                "the same engine arguments (adapters.vllm.vllm_engine_args from one RefitSpec)",
                kind=ErrorKind.ENGINE,
            )
        if self.ctx.step is not None:
            raise RefitError(
                f"engine worker {name!r} holds {held}, the plan publishes "
                f"{self.ctx.plan.spec.params.describe(fmt)}, and step {self.ctx.step.step} is in progress; "
                "attach again after it",
                kind=ErrorKind.BUSY,
            )
        try:
            self.ctx.adopt_plan(plan, invalidate=True)
        except ArenaTooSmall as exc:
            raise RefitError(
                f"engine worker {name!r} holds {held}, and publishing it does not fit: {exc}. Start the daemon "
                "with a larger --publish-bytes",
                kind=ErrorKind.CAPACITY,
            ) from None
        log.warning("engine worker %s holds %s: publishing it from the next step", name, held)

    def drop_engine(self, identity: bytes, why: str) -> None:
        self.engines.pop(identity, None)
        self.ctx.streams.forget(identity)
        self.ctx.arenas.drop_reader(identity)
        self.ctx.peers.pop(identity, None)
        for rnd in self.rounds.values():
            rnd.forget(identity, why)

    def handle_wait(self, identity: bytes, msg: Message) -> None:
        peer = self.ctx.peers[identity]  # the loop checked it is a reader
        try:
            mode, min_step = WaitMode.of(msg.fields)
        except ValueError as exc:
            raise ProtocolError(str(exc)) from None
        if mode is WaitMode.CANCEL:
            peer.waiting, peer.min_step = None, None
            return
        peer.waiting, peer.min_step = mode, min_step
        self.serve_waiting(peer)
        if peer.waiting is not None:  # not answered yet: a streaming reader may join the step in progress
            self.ctx.streams.waiting(peer, msg)

    def handle_release(self, identity: bytes, msg: Message) -> None:
        index = msg.require("generation", int)
        step = msg.get("step")
        if self.ctx.streams.engine_failed(identity, msg):  # a group of the step in progress failed
            return
        if not self.ctx.arenas.release(identity, index, step):
            log.debug("release of generation %d by a reader that no longer held it", index)
        rnd = self.rounds.get(step) if isinstance(step, int) else None
        if rnd is not None and "ok" in msg.fields:
            # what a worker reports is quoted to the trainers (LOADED) and the metrics: plain and bounded
            error, seconds = msg.get("error"), msg.get("seconds")
            if error is not None:
                error = error[:MAX_LOAD_ERROR_CHARS] if isinstance(error, str) else safe_repr(error)
            if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not 0 <= seconds < 1e9:
                seconds = None
            rnd.record(identity, msg.get("ok") is True, error, seconds)
            self.finish_rounds(time.monotonic())
        elif msg.get("ok") is False:  # its step's round already closed (it timed out): say it here
            self._late_load_failure(identity, step, msg.get("error"))
        self.ctx.maybe_claim()

    def _late_load_failure(self, identity: bytes, step, error) -> None:
        """An engine worker's failed load of a step whose LOADED round already closed (it took longer
        than reader_timeout_s: the round reported it as not acknowledged in time), e.g. a load found
        torn because its hold was revoked: logged with the worker's own error."""
        error = error[:MAX_LOAD_ERROR_CHARS] if isinstance(error, str) else safe_repr(error)
        log.error(
            "%s failed to load step %s after its load round closed: %s",
            self.ctx.peers.holder_label(identity),
            safe_repr(step),
            error,
            extra={"step": step if isinstance(step, int) else None, "phase": "load"},
        )

    def handle_detach(self, identity: bytes, msg: Message) -> None:
        name = self.ctx.peers[identity].name if identity in self.ctx.peers else "?"
        self.drop_engine(identity, f"{name} detached before acknowledging")
        self.finish_rounds(time.monotonic())
        self.ctx.maybe_claim()

    def serve_waiting(self, peer: Peer) -> None:
        gen = self.ctx.arenas.live_generation()
        if peer.waiting is None or gen is None or gen.step is None:
            return
        if peer.waiting is WaitMode.AT_LEAST and gen.step < peer.min_step:
            return
        arenas = self.ctx.arenas
        fields = {"generation": gen.index, "step": gen.step, "arena": gen.arena.handle()}
        fields |= {"epoch": arenas.epoch(gen), "epochs": arenas.epochs.handle()}
        if self.ctx.send(peer.identity, Kind.GENERATION, fields):
            arenas.hold(peer.identity, gen)
        peer.waiting, peer.min_step = None, None

    def hold_revoked(self, identity: bytes, gen, held_step: int | None) -> None:
        """A step claimed ``gen`` although ``identity`` still held it (``Arenas.on_revoke``): tell
        the reader at once (REVOKED), before a byte of the new step is written, and count it. The
        reader's copy, if it was still copying, may be torn; ``Generation.intact()`` says so too."""
        ctx = self.ctx
        label = ctx.peers.holder_label(identity)
        log.warning(
            "revoked the hold of %s on generation %d (step %s) after reader_timeout_s=%g: a step is "
            "overwriting it; a copy still in progress there may be torn and the reader is told",
            label,
            gen.index,
            held_step,
            ctx.config.reader_timeout_s,
        )
        notify(ctx.observers, "on_hold_revoked", ctx, label, gen.index, held_step)
        if identity in ctx.peers:
            ctx.send(
                identity,
                Kind.REVOKED,
                {
                    "instance": ctx.instance,
                    "generation": gen.index,
                    "step": held_step,
                    "reader_timeout_s": ctx.config.reader_timeout_s,
                },
            )

    def published(self, step: int, trainers: list[bytes]) -> None:
        """Step ``step`` went live: its load round starts; waiting readers get the generation."""
        self.rounds[step] = new_round(step, self.engines, trainers, self.ctx.config.reader_timeout_s)
        self.finish_rounds(time.monotonic())
        for peer in self.ctx.peers.of_role(PeerRole.READER):
            self.serve_waiting(peer)

    def finish_rounds(self, now: float) -> None:
        """Tell each finished round's trainers which engine workers loaded the step (LOADED)."""
        for step, rnd in list(self.rounds.items()):
            if not rnd.complete(now):
                continue
            del self.rounds[step]
            report = rnd.report()
            if rnd.expected:
                level = logging.INFO if report["ok"] else logging.ERROR
                log.log(level, "%s", report["message"], extra={"step": step, "phase": "load"})
            for identity in rnd.trainers:
                self.ctx.send(identity, Kind.LOADED, report)
            notify(self.ctx.observers, "on_step_loaded", self, report)


def _published(plan: RefitPlan) -> set[tuple[str, torch.dtype, tuple[int, ...]]]:
    """What ``plan`` publishes, whatever the order and the form of its inputs."""
    return {(o.name, o.dtype, tuple(o.shape)) for o in plan.outputs}
