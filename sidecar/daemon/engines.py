"""The engine side of the serve loop: readers and engine workers attach, wait, release, detach.

A mixin of :class:`sidecar.daemon.loop.Daemon` (it uses the daemon's state: ``peers``, ``arenas``,
``engines``, ``rounds``, ``plan``, ``spec``, ``config``). Engine workers attach with a manifest that is
checked against the plan (``sidecar.plan.attach``); a routed expert the engine holds in BF16 re-plans the
daemon so it is published in BF16. After each publish a ``LoadRound`` collects every engine worker's
acknowledgement and reports it to the step's trainers as ``LOADED``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from adapters.manifest import Manifest
from sidecar.daemon.load_rounds import EngineState
from sidecar.errors import ErrorKind, RefitError
from sidecar.ops.observers import notify
from sidecar.plan.attach import check_manifest, engine_bf16_modules
from sidecar.plan.build import RefitPlan
from transport.wire import Kind, Message, ProtocolError, safe_repr

log = logging.getLogger("refitd.daemon")

MAX_LOAD_ERROR_CHARS = 2000  # how much of an engine worker's load error is kept and reported


@dataclass(slots=True)
class Peer:
    identity: bytes
    role: str  # "trainer" | "reader" | "forwarder" (a trainer node's daemon, on an inference node)
    last_seen: float
    rank: int | None = None
    pid: int | None = None
    host: str = ""
    name: str = ""
    local: bool = False
    waiting: int | None = None  # reader: min_step of an outstanding WAIT
    hello_seq: int = 0  # trainer: when (in daemon events) its latest HELLO arrived


class ReaderHandlers:
    """``handle_attach`` / ``handle_wait`` / ``handle_release`` / ``handle_detach`` and what they need."""

    def handle_attach(self, identity: bytes, msg: Message) -> None:
        name = str(msg.get("name", ""))
        warnings: list[str] = []
        if msg.get("manifest") is not None:
            try:
                manifest = Manifest.from_wire(msg.require("manifest", dict))
            except ValueError as exc:
                raise RefitError(f"engine worker {name!r}: {exc}", kind=ErrorKind.ENGINE) from None
            warnings = self._attach_engine(identity, name, manifest)
        self.peers[identity] = Peer(identity, "reader", time.monotonic(), pid=msg.get("pid"), name=name)
        live = self.arenas.live_generation()
        self._send(
            identity,
            Kind.ATTACHED,
            {
                "instance": self.instance,
                "live_step": None if live is None else live.step,
                "format": self.spec.fmt.value,
                "checked": self.plan is not None,
                "warnings": warnings,
                # a reader pings this often while attached; one silent for reader_timeout_s is dropped
                "heartbeat_interval_s": self.reader_ping_interval(),
                "reader_timeout_s": self.config.reader_timeout_s,
                "epochs": self.arenas.epochs.handle(),  # map read-only: Generation.intact() reads it
            },
        )

    def reader_ping_interval(self) -> float:
        """How often an attached reader pings: the rank heartbeat, and at least 4 times per reader timeout."""
        return min(self.config.heartbeat_interval_s, self.config.reader_timeout_s / 4)

    def _expire_readers(self, now: float) -> None:
        """Drop readers silent for longer than ``reader_timeout_s``: they ping while attached
        (adapters.base.RefitReader), so silence means the process died or hung without DETACH. An
        expired reader loses its holds (a step waiting for its generation goes on), its engine
        registration and its place in ``status``; if it comes back, the daemon says UNKNOWN_PEER and
        it attaches again."""
        if now < self.next_reader_check:
            return
        self.next_reader_check = now + self.reader_ping_interval()
        limit = self.config.reader_timeout_s
        gone = [p for p in self.peers.values() if p.role == "reader" and now - p.last_seen > limit]
        for peer in gone:
            held = [g.index for g in self.arenas.generations if peer.identity in g.holders]
            log.warning(
                "reader %r (pid %s) silent for %.1f s (reader_timeout_s=%g): it went away without DETACH; "
                "dropping it%s",
                peer.name,
                peer.pid,
                now - peer.last_seen,
                limit,
                f" and its hold on generation(s) {held}" if held else "",
            )
            self._drop_engine(
                peer.identity, f"stopped responding (silent for more than {limit:g} s): it died or hung"
            )
        if gone:
            self._finish_rounds(now)
            self._maybe_claim()

    def _attach_engine(self, identity: bytes, name: str, manifest: Manifest) -> list[str]:
        """Check ``manifest`` against the plan (re-planning for the engine's BF16 experts); the
        worker is registered only if it passes. Returns warnings for the worker."""
        for other_id, other in list(self.engines.items()):
            if other.name == name and other_id != identity:  # a restarted worker replaces itself
                self._drop_engine(other_id, f"re-attached as a new process ({name})")
        if self.plan is None:  # no plan before the first step: checked when the step fixes it
            self.engines[identity] = EngineState(
                identity, name, manifest, engine_bf16_modules(manifest, self.spec.model_type)
            )
            return ["no plan yet: the manifest is checked when the first step fixes the plan"]
        check = check_manifest(self.plan.source, self.spec, manifest, share=self.plan.share)
        if not check.ok:
            raise RefitError(check.message(f"engine worker {name!r}"), kind=ErrorKind.ENGINE)
        if check.plan.keep_bf16 != self.plan.keep_bf16:
            self._replan_for(name, check.plan)
        self.engines[identity] = EngineState(identity, name, manifest, check.plan.keep_bf16)
        if check.warnings:
            log.warning("engine worker %s attached: %s", name, "; ".join(check.warnings))
        return check.warnings

    def _replan_for(self, name: str, plan: RefitPlan) -> None:
        """Publish in BF16 what engine ``name`` holds in BF16 (the manifest wins), if nothing forbids it."""
        kept = sorted(plan.keep_bf16 - self.plan.keep_bf16)
        disagree = [e.name for e in self.engines.values() if e.keep_bf16 != plan.keep_bf16]
        if disagree:
            raise RefitError(
                f"engine worker {name!r} holds {len(kept)} routed-expert tensors in BF16 (e.g. {kept[:2]}) that "
                f"engine workers {disagree} hold in {self.spec.fmt.value}; every engine must agree on one plan",
                kind=ErrorKind.ENGINE,
            )
        if self.step is not None:
            raise RefitError(
                f"engine worker {name!r} needs a different plan (BF16 experts) but step {self.step.step} is in "
                "progress; attach again after it",
                kind=ErrorKind.BUSY,
            )
        try:
            self.arenas.apply_plan(plan)
        except ValueError as exc:
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
        self.plan = plan
        self.arenas.invalidate()

    # ---- a step's output generation, held by readers (see sidecar.daemon.memory.generations)

    def _claim_step_target(self, now: float) -> None:
        """Claim the generation the step in progress writes, if no reader holds it.

        While readers hold it the step waits, at most ``reader_timeout_s`` from when the step first
        needed it (then the holds are dropped, as documented). The moment the step is found blocked,
        the log and ``status`` ("blocked") name each holder and the generation; if the holds would
        only be dropped after the step's own deadline, the step cannot finish and fails at once on
        every rank (BUSY), naming them, instead of timing out later as "not complete"."""
        state, gen = self.step, self.arenas.target()
        holders = [self._holder_label(i) for i in gen.holders]
        held_step = gen.step
        self.target = self.arenas.claim_target(now, self.config.reader_timeout_s)
        if self.target is not None:
            if holders:
                log.warning(
                    "step %d: dropped the hold of %s on generation %d (step %s) after reader_timeout_s=%g",
                    state.step,
                    ", ".join(holders),
                    gen.index,
                    held_step,
                    self.config.reader_timeout_s,
                    extra={"step": state.step, "phase": "claim"},
                )
            self.blocked = None
            return
        if self.blocked is not None and self.blocked["step"] == state.step:
            self.blocked["readers"] = holders
            return
        drop_at = gen.needed_since + self.config.reader_timeout_s
        self.blocked = {
            "step": state.step,
            "generation": gen.index,
            "holds_step": held_step,
            "readers": holders,
            "drop_holds_in_s": round(max(0.0, drop_at - now), 3),
        }
        what = (
            f"step {state.step} must be written into generation {gen.index} (it holds step {held_step}), "
            f"which {', '.join(holders)} still hold{'s' if len(holders) == 1 else ''}"
        )
        if drop_at > state.deadline:
            self._fail_step(
                RefitError(
                    f"{what}; their hold would be dropped only after reader_timeout_s="
                    f"{self.config.reader_timeout_s:g} s, later than this step's timeout (step_timeout_s="
                    f"{self.config.step_timeout_s:g}). Release the generation in the reader (RefitReader.release), "
                    "or set reader_timeout_s below step_timeout_s",
                    kind=ErrorKind.BUSY,
                    step=state.step,
                )
            )
            return
        log.warning(
            "%s; waiting up to %.1f s (reader_timeout_s=%g) for them to release it, then dropping their hold",
            what,
            drop_at - now,
            self.config.reader_timeout_s,
            extra={"step": state.step, "phase": "claim"},
        )

    def _holder_label(self, identity: bytes) -> str:
        """Who holds a generation, for logs and errors: a reader's name and pid, or a forwarder."""
        if identity.startswith(b"forward:"):
            return f"the forwarder to {identity.removeprefix(b'forward:').decode(errors='replace')}"
        peer = self.peers.get(identity)
        if peer is None:
            return f"a reader that left (peer {identity.hex()[:16]})"
        return f"reader {peer.name!r} (pid {peer.pid}, peer {identity.hex()[:16]})"

    def _drop_engine(self, identity: bytes, why: str) -> None:
        self.engines.pop(identity, None)
        self.arenas.drop_reader(identity)
        self.peers.pop(identity, None)
        for rnd in self.rounds.values():
            rnd.forget(identity, why)

    def handle_wait(self, identity: bytes, msg: Message) -> None:
        peer = self.peers.get(identity)
        if peer is None or peer.role != "reader":
            raise RefitError(
                "ATTACH first (the daemon restarted, or this reader never attached)",
                kind=ErrorKind.UNKNOWN_PEER,
            )
        min_step = msg.get("min_step")
        if min_step is not None and not isinstance(min_step, int):
            raise ProtocolError("WAIT min_step must be an integer or nil")
        if msg.get("cancel"):
            peer.waiting = None
            return
        peer.waiting = -1 if min_step is None else min_step
        self._serve_waiting(peer)

    def handle_release(self, identity: bytes, msg: Message) -> None:
        index = msg.require("generation", int)
        step = msg.get("step")
        if not self.arenas.release(identity, index, step):
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
            self._finish_rounds(time.monotonic())
        elif msg.get("ok") is False:  # its step's round already closed (it timed out): say it here
            self._late_load_failure(identity, step, msg.get("error"))
        self._maybe_claim()

    def _late_load_failure(self, identity: bytes, step, error) -> None:
        """An engine worker's failed load of a step whose LOADED round already closed (it took longer
        than reader_timeout_s: the round reported it as not acknowledged in time), e.g. a load found
        torn because its hold was revoked: logged with the worker's own error."""
        error = error[:MAX_LOAD_ERROR_CHARS] if isinstance(error, str) else safe_repr(error)
        log.error(
            "%s failed to load step %s after its load round closed: %s",
            self._holder_label(identity),
            safe_repr(step),
            error,
            extra={"step": step if isinstance(step, int) else None, "phase": "load"},
        )

    def handle_detach(self, identity: bytes, msg: Message) -> None:
        name = self.peers[identity].name if identity in self.peers else "?"
        self._drop_engine(identity, f"{name} detached before acknowledging")
        self._finish_rounds(time.monotonic())
        self._maybe_claim()

    def _serve_waiting(self, peer: Peer) -> None:
        gen = self.arenas.live_generation()
        if peer.waiting is None or gen is None or gen.step is None or gen.step < peer.waiting:
            return
        fields = {"generation": gen.index, "step": gen.step, "arena": gen.arena.handle()}
        fields |= {"epoch": self.arenas.epoch(gen), "epochs": self.arenas.epochs.handle()}
        if self._send(peer.identity, Kind.GENERATION, fields):
            self.arenas.hold(peer.identity, gen)
        peer.waiting = None

    def _hold_revoked(self, identity: bytes, gen, held_step: int | None) -> None:
        """A step claimed ``gen`` although ``identity`` still held it (``Arenas.on_revoke``): tell
        the reader at once (REVOKED), before a byte of the new step is written, and count it. The
        reader's copy, if it was still copying, may be torn; ``Generation.intact()`` says so too."""
        label = self._holder_label(identity)
        log.warning(
            "revoked the hold of %s on generation %d (step %s) after reader_timeout_s=%g: a step is "
            "overwriting it; a copy still in progress there may be torn and the reader is told",
            label,
            gen.index,
            held_step,
            self.config.reader_timeout_s,
        )
        notify(self.observers, "on_hold_revoked", self, label, gen.index, held_step)
        if identity in self.peers:
            self._send(
                identity,
                Kind.REVOKED,
                {
                    "instance": self.instance,
                    "generation": gen.index,
                    "step": held_step,
                    "reader_timeout_s": self.config.reader_timeout_s,
                },
            )

    def _finish_rounds(self, now: float) -> None:
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
                self._send(identity, Kind.LOADED, report)
            notify(self.observers, "on_step_loaded", self, report)
