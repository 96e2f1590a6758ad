"""Streamed refit on the daemon side: engine workers load each layer group of a step while later
groups are still arriving, and a failed step leaves them on the last good generation.

A component of the serve loop (sidecar.daemon.loop), built with its :class:`LoopContext`. A reader
that asked for it at ATTACH (``"stream": STREAM_VERSION``) and whose WAIT says which step its engine
holds whole (``"loaded": k``) is streamed a later step when ``k`` is the live step (the only
generation it can roll back to):

* ``STREAM``: step ``s`` is being written into generation ``G`` (its arena and epoch), the plan's
  groups (lists of output names, one per layer group, ``sidecar.daemon.memory.staging.ring_groups``;
  sent once per reader and plan), and the live generation, which the reader holds from here on;
* ``GROUP``: groups whose every unit ran are readable (their bytes in ``G`` are final);
* the generation is sealed and published exactly as for whole readers: the streaming reader, still
  waiting, gets ``GENERATION`` of ``G`` and acknowledges with ``RELEASE`` as any engine does;
* ``STREAM_FAILED``: the step failed; the reader reloads the groups it took from the live
  generation (intact: a step never writes the live generation) and releases it.

Nothing here ever makes the daemon wait on a reader: a step fails on its own schedule, every
streaming reader is told at once, and the trainers' error names the engines that had taken part of
it (``RefitError.rolled_back``). Per-step stream state lives here, keyed by the step, and is dropped
when the step is published or fails.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sidecar.config.settings import ArenaKind
from sidecar.daemon.memory.staging import ring_groups
from sidecar.errors import ErrorKind, RefitError
from sidecar.plan.build import RefitPlan
from sidecar.protocol.enums import WaitMode
from transport.wire import STREAM_VERSION, Kind, Message

if TYPE_CHECKING:  # pragma: no cover
    from sidecar.daemon.context import LoopContext
    from sidecar.daemon.memory.generations import Generation
    from sidecar.daemon.peers import Peer
    from sidecar.daemon.step import StepState

log = logging.getLogger("refitd.daemon")


@dataclass(slots=True)
class StreamGroups:
    """A plan's layer groups as streamed: each group's output names, and which group a unit feeds."""

    plan: RefitPlan
    key: int  # changes with the plan: a reader is sent the names once per key
    names: list[list[str]]
    unit_group: dict[int, int]
    units: list[int]  # units per group

    @classmethod
    def of(cls, plan: RefitPlan, key: int) -> StreamGroups:
        groups = ring_groups(plan)
        unit_group = {u: g.index for g in groups for u in g.units}
        by_index = {u.index: u for u in plan.units}
        names = [[o.name for u in g.units for o in by_index[u].outputs] for g in groups]
        return cls(plan, key, names, unit_group, [len(g.units) for g in groups])


@dataclass(slots=True)
class StepStream:
    """One step being streamed: which groups are readable, and who was told what."""

    step: int
    generation: int
    live: Generation  # the generation every streaming reader rolls back to
    left: list[int]  # units still to run, per group
    ready: list[int] = field(default_factory=list)  # readable groups, in the order they became so
    readers: dict[bytes, int] = field(default_factory=dict)  # identity -> groups sent to it


class Streams:
    """Which readers stream, the step being streamed, and what they are told."""

    def __init__(self, ctx: LoopContext):
        self.ctx = ctx
        self.readers: dict[bytes, int | None] = {}  # streaming readers -> the step their engine holds whole
        self.current: StepStream | None = None
        self._groups: StreamGroups | None = None
        self._keys = 0
        self._sent_key: dict[bytes, int] = {}  # reader -> the groups key it was sent

    # ---- readers

    def attached(self, identity: bytes, msg: Message) -> int | None:
        """An ATTACH: the stream version this daemon speaks with the reader (None: whole generations)."""
        self.forget(identity)
        if msg.get("stream") == STREAM_VERSION:
            self.readers[identity] = None
            return STREAM_VERSION
        return None

    def forget(self, identity: bytes) -> None:
        """A reader detached, expired or re-attached: it is streamed nothing more."""
        self.readers.pop(identity, None)
        self._sent_key.pop(identity, None)
        if self.current is not None:
            self.current.readers.pop(identity, None)

    def waiting(self, peer: Peer, msg: Message) -> None:
        """A WAIT from ``peer``: note the step its engine holds whole; stream it the step in progress."""
        if peer.identity not in self.readers:
            return
        loaded = msg.get("loaded")
        self.readers[peer.identity] = loaded if type(loaded) is int else None
        stream = self.current
        if stream is not None and peer.identity not in stream.readers and self._eligible(peer, stream.step):
            self._start(peer.identity, stream)

    def _eligible(self, peer: Peer, step: int) -> bool:
        """Stream ``step`` to ``peer`` only if it waits for it and its engine holds the live step whole:
        that is the whole generation it returns to if the step fails."""
        live = self.ctx.arenas.live_generation()
        if live is None or live.step is None or peer.waiting is not WaitMode.AT_LEAST:
            return False
        return self.readers.get(peer.identity) == live.step and live.step < peer.min_step <= step

    # ---- the step

    def units_done(self, state: StepState, units: tuple[int, ...]) -> None:
        """Units (indices) of the step in progress ran, before ``state.units_done`` has them:
        announce the groups they completed."""
        if not self.readers or state.target is None:
            return
        stream = self.current
        if stream is None or stream.step != state.step:
            stream = self._begin(state)
            if stream is None:
                return
        done = []
        for unit in units:
            g = self._groups.unit_group.get(unit)
            if g is not None:
                stream.left[g] -= 1
                if stream.left[g] == 0:
                    done.append(g)
        if done:
            if self.ctx.arenas.kind is ArenaKind.CUDA_IPC:  # kernels' writes land before anyone reads
                self.ctx.arenas.synchronize()
            stream.ready += done
            for identity in list(stream.readers):
                self._send_groups(identity, stream, done)

    def _begin(self, state: StepState) -> StepStream | None:
        ctx = self.ctx
        live = ctx.arenas.live_generation()
        self.current = None
        if live is None or live.step is None or ctx.plan is None:
            return None  # nothing to return to: the first step is loaded whole
        groups = self._groups
        if groups is None or groups.plan is not ctx.plan:
            self._keys += 1
            groups = self._groups = StreamGroups.of(ctx.plan, self._keys)
        stream = StepStream(state.step, state.target.index, live, list(groups.units))
        for u in state.units_done:  # units that ran before the first reader could be streamed
            g = groups.unit_group.get(u)
            if g is not None:
                stream.left[g] -= 1
        stream.ready = [g for g, n in enumerate(stream.left) if n == 0]
        self.current = stream
        for identity in list(self.readers):
            peer = ctx.peers.get(identity)
            if peer is not None and self._eligible(peer, state.step):
                self._start(identity, stream)
        return stream

    def _start(self, identity: bytes, stream: StepStream) -> None:
        """Tell ``identity`` the step streams: the target's arena, the groups, the live generation
        (held for it until it releases it); then every group already readable."""
        ctx, arenas = self.ctx, self.ctx.arenas
        target, live, groups = arenas.generations[stream.generation], stream.live, self._groups
        fields: dict[str, Any] = {
            "v": STREAM_VERSION,
            "step": stream.step,
            "generation": target.index,
            "arena": target.arena.handle(),
            "epoch": arenas.epoch(target),
            "epochs": arenas.epochs.handle(),
            "groups_key": groups.key,
            "live": {
                "generation": live.index,
                "step": live.step,
                "arena": live.arena.handle(),
                "epoch": arenas.epoch(live),
            },
        }
        if self._sent_key.get(identity) != groups.key:
            fields["groups"] = groups.names
        if not ctx.send(identity, Kind.STREAM, fields):
            return
        self._sent_key[identity] = groups.key
        arenas.hold(identity, live)
        stream.readers[identity] = 0
        if stream.ready:
            self._send_groups(identity, stream, stream.ready)

    def _send_groups(self, identity: bytes, stream: StepStream, groups: list[int]) -> None:
        fields = {"step": stream.step, "generation": stream.generation, "ready": list(groups)}
        if self.ctx.send(identity, Kind.GROUP, fields):
            stream.readers[identity] += len(groups)

    def published(self, step: int) -> None:
        """``step`` went live: its stream is over (its readers get GENERATION as every waiting reader)."""
        if self.current is not None and self.current.step == step:
            self.current = None

    def failed(self, state: StepState, err: RefitError) -> list[str]:
        """Step ``state`` failed: every reader streamed it hears so at once (it reloads the groups it
        took from the live generation). Returns the names of those that had taken any."""
        stream, self.current = self.current, None
        if stream is None or stream.step != state.step:
            return []
        rolled = []
        fields = {
            "step": stream.step,
            "generation": stream.generation,
            "live_step": stream.live.step,
            "error": err.to_wire(),
        }
        for identity, sent in stream.readers.items():
            self.ctx.send(identity, Kind.STREAM_FAILED, fields)
            peer = self.ctx.peers.get(identity)
            if sent and peer is not None:
                rolled.append(peer.name)
        if rolled:
            log.warning(
                "step %d failed after engine workers %s loaded part of it: they reload those parts from "
                "step %s (generation %d)",
                stream.step,
                rolled,
                stream.live.step,
                stream.live.index,
                extra={"step": stream.step, "phase": "fail"},
            )
        return sorted(rolled)

    def engine_failed(self, identity: bytes, msg: Message) -> bool:
        """A streaming reader's RELEASE with ``stream`` and ``ok: false``: its engine failed a group
        of the step in progress. The step fails everywhere (every engine returns to the live step).
        False when it is not about the step being streamed."""
        stream = self.current
        if not msg.get("stream") or stream is None or msg.get("step") != stream.step:
            return False
        if identity not in stream.readers or msg.get("ok") is not False:
            return False
        error = msg.get("error")
        error = error[:2000] if isinstance(error, str) else "no reason given"
        name = self.ctx.peers.holder_label(identity)
        self.ctx.fail_step(
            RefitError(
                f"engine worker {name} failed to load part of step {stream.step} while it streamed: {error}",
                kind=ErrorKind.ENGINE,
                step=stream.step,
            )
        )
        return True
