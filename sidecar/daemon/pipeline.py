"""The step's pipeline on the serve loop: complete inputs become units for the quantization worker,
finished units seal the step, a sealed step is published.

A component of the serve loop (sidecar.daemon.loop), built with its :class:`LoopContext`. It keeps
no step state of its own: what a step needs (its target generation, the units waiting for it or for
a staging-ring region, who holds which ring group) lives in the ``StepState``, so ending a step is
dropping that one object. The worker is handed resolved tensors (views made here, on the loop
thread), never a callable of the daemon: the arenas' view caches are touched by this thread only.
"""

from __future__ import annotations

import logging
import operator
import queue
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from sidecar.config.settings import ArenaKind
from sidecar.daemon.faults import stop_on_sticky
from sidecar.daemon.spans import Span, SpanTable
from sidecar.daemon.worker import Done, run_spans
from sidecar.errors import ErrorKind, RefitError
from sidecar.numerics.reference import NonFiniteError
from sidecar.ops.observers import notify
from sidecar.plan.build import RefitPlan, Unit
from transport.wire import Kind

if TYPE_CHECKING:  # pragma: no cover
    from sidecar.daemon.context import LoopContext
    from sidecar.daemon.memory.staging import RingStaging
    from sidecar.daemon.pull import Pulls
    from sidecar.daemon.step import StepState
    from sidecar.forward.sender import Forwarding

log = logging.getLogger("refitd.daemon")

#: spans of at most this many bytes in all (in shared memory) are checked and copied on the serve
#: loop itself: handing them to the worker (a queue, GIL hand-offs with this busy thread, a wake-up,
#: a drain) costs more than the copy, and kept the step's tail waiting on the worker
INLINE_SPAN_BYTES = 1 << 20


class Pipeline:
    """Units to the worker, results back, the step claimed its generation and published."""

    def __init__(self, ctx: LoopContext, forwarding: Forwarding | None = None):
        self.ctx = ctx
        self.forwarding = forwarding  # trainer node of a disaggregated layout: forward each publish
        self._spans: dict[bool, SpanTable] = {}  # per plan and layouts: staged or direct steps
        self._sole: tuple[RefitPlan, dict[str, Unit]] | None = None  # see _sole_units
        #: (first name, count) -> (names, their units, the units' indices): see _sole_batch
        self._sole_batches = _Remembered()
        self._bytes_out: tuple[RefitPlan, int] | None = None  # the plan's, summed once
        self._flat: dict[int, tuple[Any, torch.Tensor]] = {}  # id(arena) -> (arena, its bytes)
        self.pulls: Pulls | None = None  # NIXL: READs each granted ring group's remote pieces

    # ---- inputs complete: units run

    def tensor_complete(self, name: str) -> None:
        self.tensors_complete((name,))

    def tensors_complete(self, names: Iterable[str]) -> None:
        """Inputs ``names`` just completed (a PIECE_DONE batch, say): submit the units they make
        ready. Small passthroughs go to the worker as byte spans (sidecar.daemon.spans)."""
        ctx = self.ctx
        state, ring, plan = ctx.step, ctx.arenas.ring, ctx.plan
        sole, submitted = self._sole_units(plan), state.units_submitted
        units = self._sole_batch(sole, submitted, names) if ring is None else None
        if units is not None:  # each name its own unit's only input: no loop in Python
            self._ready(state, units)
            return
        units = []
        for name in names:
            if ring is not None:
                ring.tensor_complete(name)
            unit = sole.get(name)
            if unit is None:
                units += state.ready_units(plan, name)
            elif unit.index not in submitted:  # its only input just completed: it is ready
                submitted.add(unit.index)
                units.append(unit)
        self._ready(state, units)

    def _ready(self, state: StepState, units: list[Unit]) -> None:
        if not units:
            return
        if state.target is None:
            state.deferred += units
            return
        self.submit_all(units)

    def submit_all(self, units: list[Unit]) -> None:
        """Submit ``units`` (their target generation is claimed): small passthroughs as spans when
        the whole step is staged (not a ring), the rest one by one."""
        ctx = self.ctx
        state = ctx.step
        ring = ctx.arenas.ring
        if state.staged and ring is None and not state.staged <= state.committed:
            # A passthrough's work is a copy out of staging and a finiteness check of the copy: one
            # read and one write of bytes local ranks are still copying in. Run meanwhile it only
            # takes memory bandwidth from their copies (measured: the local ingest of a 255 MiB
            # BF16 step 44 -> 60 ms), and a trainer waits for COMMIT, not for the generation; after
            # it, the copy runs at full speed. (A ring must free regions to let the ranks go on.)
            fmts = list(map(_FMT, units))
            passthroughs = fmts.count(None)
            if passthroughs == len(units):  # the usual batch of small passthroughs: all of it waits
                state.after_local += units
                units = []
            elif passthroughs:
                now = []
                for unit, fmt in zip(units, fmts):
                    (now if fmt is not None else state.after_local).append(unit)
                units = now
        if ring is None and len(units) > 1:
            spans, units = self._span_table().spans(units)
            if spans:
                self._submit_spans(spans)
                if ctx.step is not state:  # a span run on the loop failed the step: nothing more of it
                    return
        for unit in units:
            self.submit(unit)

    def _sole_batch(
        self, sole: dict[str, Unit], submitted: set[int], names: Iterable[str]
    ) -> list[Unit] | None:
        """:func:`_sole_ready`, remembered per batch of names: a later step completing the very same
        names (the client sends the same PIECE_DONE batches every step) only asks whether one of
        their units went already."""
        if type(names) is not list or not names:
            return _sole_ready(sole, submitted, names)
        key = (names[0], len(names))
        batches = self._sole_batches
        known = batches.get(key)
        if known is not None and known[0] == names:
            if not submitted.isdisjoint(known[2]):
                return None
            submitted.update(known[2])
            return list(known[1])
        units = _sole_ready(sole, submitted, names)
        if units is not None:
            if batches.held + len(names) > REMEMBERED_NAMES_PER_INPUT * len(sole):
                batches.clear()
                batches.held = 0
            batches[key] = (list(names), tuple(units), list(map(_INDEX, units)))
            batches.held += len(names)
        return units

    def _sole_units(self, plan: RefitPlan) -> dict[str, Unit]:
        """Inputs read by one unit that reads nothing else (every passthrough): ready the moment
        that input completes, without asking StepState.ready_units. Made once per plan."""
        if self._sole is None or self._sole[0] is not plan:
            sole = {}
            for inp in plan.inputs:
                units = plan.units_for_input(inp.name)
                if len(units) == 1 and units[0].inputs == (inp.name,):
                    sole[inp.name] = units[0]
            self._sole = (plan, sole)
            self._sole_batches = _Remembered()
        return self._sole[1]

    def _span_table(self) -> SpanTable:
        """This step's span table: its inputs in staging, or, those the daemon wrote straight into
        the generation (remote frames of a direct step), there. Made once per plan and kind of step."""
        ctx = self.ctx
        staging, outputs = ctx.arenas.staging.layout, ctx.step.target.arena.layout
        direct = ctx.step.direct or None
        table = self._spans.get(direct is not None)
        if table is None or not table.fits(ctx.plan, staging, outputs, direct):
            table = self._spans[direct is not None] = SpanTable(ctx.plan, staging, outputs, direct)
        return table

    def _submit_spans(self, spans: list[Span]) -> None:
        state = self.ctx.step
        if not state.phases.quant_start:
            state.phases.quant_start = time.monotonic()
        staging, dst = self._bytes_of(self.ctx.arenas.staging), self._bytes_of(state.target.arena)
        views = [
            (s, (dst if s.direct else staging)[s.src : s.src + s.nbytes], dst[s.dst : s.dst + s.nbytes])
            for s in spans
        ]
        if self.ctx.arenas.kind is ArenaKind.SHM and sum(s.nbytes for s in spans) <= INLINE_SPAN_BYTES:
            self._unit_done(run_spans(state.step, views))  # no worker round trip for a few KiB
        else:
            self.ctx.worker.submit_spans(state.step, views)

    def forget(self, arena: Any) -> None:
        """Drop every view of ``arena`` this component keeps (a staging arena being retired: its
        memory goes once no view of it is left)."""
        self._flat.pop(id(arena), None)

    def _bytes_of(self, arena: Any) -> torch.Tensor:
        """All of ``arena`` as one uint8 tensor, made once per arena (spans are slices of it)."""
        held = self._flat.get(id(arena))
        if held is None or held[0] is not arena:
            held = self._flat[id(arena)] = (arena, arena.view(0, torch.uint8, (arena.size,)))
        return held[1]

    def local_committed(self) -> None:
        """A rank committed: once every local rank has, run the passthroughs that waited for them."""
        state = self.ctx.step
        if state is None or not state.after_local or not state.staged <= state.committed:
            return
        waiting, state.after_local = state.after_local, []
        self.submit_all(waiting)

    def submit(self, unit: Unit) -> None:
        ctx = self.ctx
        state, ring = ctx.step, ctx.arenas.ring
        target = state.target.arena
        sync, outputs, copies, lane = False, None, (), 0
        if ring is not None:
            group = ring.unit_group[unit.index]
            lane = ring.lane_of(group)  # the GPU the group is placed on: its worker thread runs it
            if not ring.granted(group):  # its bytes are all zero-sized: run it once the group is granted
                state.parked.setdefault(group, []).append(unit)
                return
            # the group's last unit waits for the GPU before it reports: the region is then reused
            last = ring.unit_submitted(unit.index)
            sync = last and ctx.arenas.kind is ArenaKind.CUDA_IPC
            if ctx.arenas.publish_ring is not None:  # host generations: into the device publish ring
                region = ring.grants[group].slot.index  # the staging region's twin
                views = ctx.arenas.publish_outputs(group, region)  # quantized outputs only
                outputs = {
                    o.name: views[o.name] if o.name in views else target.tensor(o.name) for o in unit.outputs
                }
                if last:  # then copied to the host generation, before the group counts as written
                    copies = ctx.arenas.publish_copies(group, region, state.target)
        if not state.phases.quant_start:
            state.phases.quant_start = time.monotonic()
        ctx.worker.submit(
            state.step,
            unit,
            {n: self.staged(n) for n in unit.inputs},
            {o.name: target.tensor(o.name) for o in unit.outputs} if outputs is None else outputs,
            sync=sync,
            copies=copies,
            lane=lane,
        )

    def staged(self, name: str) -> torch.Tensor:
        """Input ``name`` in staging: its slot there, or its group's region of the staging ring."""
        arenas = self.ctx.arenas
        ring = arenas.ring
        state = self.ctx.step
        if state is not None and name in state.direct:  # a remote rank's frames, the daemon's own writes
            return arenas.direct_view(state.target, name)
        return arenas.staging.tensor(name) if ring is None else ring.view(arenas.stagings, name)

    def check_granted(self, rank: int, name: str, state: StepState) -> None:
        ring = self.ctx.arenas.ring
        if ring is not None and not ring.granted(ring.group_of[name]):
            group = ring.groups[ring.group_of[name]]
            raise RefitError(
                f"rank {rank} sent data of {name!r} ({group.label}) before the daemon granted that group a "
                "staging region (SLOT): a client must write a group only after its SLOT",
                kind=ErrorKind.PROTOCOL,
                rank=rank,
                step=state.step,
            )

    def grant(self, grants) -> None:
        """Staging ring: tell every rank holding part of each newly granted group where to write it."""
        state, ring = self.ctx.step, self.ctx.arenas.ring
        for gi, slot in grants:
            fields = {"step": state.step, "group": gi, "offset": slot.offset}
            if ring.lanes > 1:  # several GPUs: the staging arena (READY's index) the region is in
                fields["arena"] = ring.lane_of(gi)
            for rank in sorted(state.ring_ranks.get(gi, ())):
                self.ctx.send(state.peers[rank], Kind.SLOT, fields)
            if self.pulls is not None and gi in state.ring_pulls:
                self.pulls.granted(state, gi, ring)
            ring.preload(gi, state.complete)
            for unit in state.parked.pop(gi, ()):
                self.submit(unit)

    def start_ring(self, state: StepState, ring: RingStaging) -> None:
        """READY went out: note which ranks write each ring group, and grant the first regions."""
        for pid, (rank, name, _) in enumerate(state.pieces):
            if pid not in state.skipped:
                state.ring_ranks.setdefault(ring.group_of[name], set()).add(rank)
        self.grant(ring.start())

    # ---- worker results

    def drain_worker(self) -> None:
        ctx = self.ctx
        worker = ctx.worker
        if worker is None:
            return
        while True:
            try:
                done = worker.results.get_nowait()
            except queue.Empty:
                break
            worker.inflight -= 1
            self._unit_done(done)
        if ctx.step is None and worker.inflight == 0:
            ctx.start_pending()

    def _unit_done(self, done: Done) -> None:
        """A result of the worker (or of spans run on the loop): record it, fail the step on its
        error, publish once the step is sealed."""
        ctx = self.ctx
        state = ctx.step
        if state is None or done.step != state.step or done.skipped:
            return  # a unit of a step that already failed
        state.phases.quant_busy += done.seconds
        units = done.units or (done.unit,)
        share = done.seconds / len(units)
        for k, unit in enumerate(units if ctx.observers else ()):
            notify(ctx.observers, "on_unit_done", ctx, done.step, unit, done.start + k * share, share)
        if done.error is not None:
            if stop_on_sticky(ctx, done.error):  # the GPU context is gone: the daemon exits for a restart
                return
            kind = ErrorKind.NON_FINITE if isinstance(done.error, NonFiniteError) else ErrorKind.INVALID
            if not isinstance(done.error, ValueError):
                kind = ErrorKind.INTERNAL
            ctx.fail_step(RefitError(str(done.error), kind=kind, step=done.step))
            return
        ctx.streams.units_done(state, units)  # streaming engines may read the groups these completed
        state.units_done.update(units)
        if ctx.arenas.ring is not None:
            try:
                self.grant(ctx.arenas.ring.unit_done(done.unit))
            except ValueError as exc:
                ctx.fail_step(RefitError(str(exc), kind=ErrorKind.INTERNAL, step=done.step))
                return
        if len(state.units_done) == len(ctx.plan.units):
            state.phases.quant_end = time.monotonic()
        self.maybe_publish()

    def maybe_publish(self) -> None:
        ctx = self.ctx
        state, plan = ctx.step, ctx.plan
        if state is None or plan is None or not state.sealed(plan):
            return
        state.phases.published = time.monotonic()
        phases = state.phases.seconds()
        if self._bytes_out is None or self._bytes_out[0] is not plan:  # a sum over every output
            self._bytes_out = (plan, plan.bytes_out)
        bytes_out = self._bytes_out[1]
        record: dict[str, Any] = {
            "step": state.step,
            "generation": state.target.index,
            "bytes_in": state.bytes_in,
            "bytes_out": bytes_out,
            "seconds": {k: round(v, 6) for k, v in phases.items()},
        }
        if self.forwarding is not None:  # what each inference node held as this step went live
            record["peers"] = self.forwarding.snapshot()
        log.info(
            "step %d published in generation %d: receive %.3fs validate %.3fs quantize %.3fs (tail %.3fs) "
            "publish %.3fs total %.3fs; %d bytes in, %d bytes out",
            state.step,
            state.target.index,
            phases["receive"],
            phases["validate"],
            phases["quantize"],
            phases["quantize_tail"],
            phases["publish"],
            phases["total"],
            state.bytes_in,
            bytes_out,
            extra={"step": state.step, "phase": "publish", "record": record},
        )
        ctx.publish(state.target, record, state, list(state.peers.values()))
        if self.forwarding is not None:
            self.forwarding.published(state.target, state.step, state.bytes_in, ctx.instance)
        ctx.end_step()
        ctx.start_pending()

    # ---- the step's output generation, held by readers (see sidecar.daemon.memory.generations)

    def claim(self, now: float) -> None:
        """Once READY went out: claim the step's target generation if it is free, and submit the
        units that were waiting for it."""
        state = self.ctx.step
        if state is None or not state.ready_sent or state.target is not None:
            return
        self.claim_target(now)  # may fail the step: readers hold its generation
        state = self.ctx.step
        if state is not None and state.target is not None:
            deferred, state.deferred = state.deferred, []
            self.submit_all(deferred)

    def claim_target(self, now: float) -> None:
        """Claim the generation the step in progress writes, if no reader holds it.

        While readers hold it the step waits, at most ``reader_timeout_s`` from when the step first
        needed it (then the holds are dropped, as documented). The moment the step is found blocked,
        the log and ``status`` ("blocked") name each holder and the generation; if the holds would
        only be dropped after the step's own deadline, the step cannot finish and fails at once on
        every rank (BUSY), naming them, instead of timing out later as "not complete"."""
        ctx = self.ctx
        state, gen = ctx.step, ctx.arenas.target()
        holders = [ctx.peers.holder_label(i) for i in gen.holders]
        held_step = gen.step
        state.target = ctx.arenas.claim_target(now, ctx.config.reader_timeout_s)
        if state.target is not None:
            if holders:
                log.warning(
                    "step %d: dropped the hold of %s on generation %d (step %s) after reader_timeout_s=%g",
                    state.step,
                    ", ".join(holders),
                    gen.index,
                    held_step,
                    ctx.config.reader_timeout_s,
                    extra={"step": state.step, "phase": "claim"},
                )
            state.blocked = None
            return
        if state.blocked is not None:
            state.blocked["readers"] = holders
            return
        drop_at = gen.needed_since + ctx.config.reader_timeout_s
        state.blocked = {
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
            ctx.fail_step(
                RefitError(
                    f"{what}; their hold would be dropped only after reader_timeout_s="
                    f"{ctx.config.reader_timeout_s:g} s, later than this step's timeout (step_timeout_s="
                    f"{ctx.config.step_timeout_s:g}). Release the generation in the reader (RefitReader.release), "
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
            ctx.config.reader_timeout_s,
            extra={"step": state.step, "phase": "claim"},
        )


_INDEX, _FMT = operator.attrgetter("index"), operator.attrgetter("fmt")

#: the batches Pipeline._sole_batch remembers hold at most this many names per sole input in all
#: (other batches every step cannot grow them further: they start over)
REMEMBERED_NAMES_PER_INPUT = 2


class _Remembered(dict):
    """Pipeline._sole_batch's batches; ``held``: their names in all."""

    held = 0


def _sole_ready(sole: dict[str, Unit], submitted: set[int], names: Iterable[str]) -> list[Unit] | None:
    """The units ``names`` make ready when each is the only input of its own unit and none of those
    was submitted yet (marked submitted now), without a Python loop; None (nothing marked) otherwise."""
    units = list(map(sole.get, names))
    if not all(units):  # a name with no sole unit (None); a Unit is always true: no __eq__ per unit
        return None
    indices = list(map(_INDEX, units))
    if not submitted.isdisjoint(indices) or len(set(indices)) != len(indices):
        return None
    submitted.update(indices)
    return units
