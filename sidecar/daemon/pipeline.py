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
import queue
import time
from typing import TYPE_CHECKING, Any

import torch

from sidecar.config.settings import ArenaKind
from sidecar.errors import ErrorKind, RefitError
from sidecar.numerics.reference import NonFiniteError
from sidecar.ops.observers import notify
from sidecar.plan.build import Unit
from transport.wire import Kind

if TYPE_CHECKING:  # pragma: no cover
    from sidecar.daemon.context import LoopContext
    from sidecar.daemon.memory.staging import RingStaging
    from sidecar.daemon.pull import Pulls
    from sidecar.daemon.step import StepState
    from sidecar.forward.sender import Forwarding

log = logging.getLogger("refitd.daemon")


class Pipeline:
    """Units to the worker, results back, the step claimed its generation and published."""

    def __init__(self, ctx: LoopContext, forwarding: Forwarding | None = None):
        self.ctx = ctx
        self.forwarding = forwarding  # trainer node of a disaggregated layout: forward each publish
        self.pulls: Pulls | None = None  # NIXL: READs each granted ring group's remote pieces

    # ---- inputs complete: units run

    def tensor_complete(self, name: str) -> None:
        ctx = self.ctx
        if ctx.arenas.ring is not None:
            ctx.arenas.ring.tensor_complete(name)
        for unit in ctx.step.ready_units(ctx.plan, name):
            if ctx.step.target is None:
                ctx.step.deferred.append(unit)
            else:
                self.submit(unit)

    def submit(self, unit: Unit) -> None:
        ctx = self.ctx
        state, ring = ctx.step, ctx.arenas.ring
        target = state.target.arena
        sync = False
        if ring is not None:
            group = ring.unit_group[unit.index]
            if not ring.granted(group):  # its bytes are all zero-sized: run it once the group is granted
                state.parked.setdefault(group, []).append(unit)
                return
            # the group's last unit waits for the GPU before it reports: the region is then reused
            sync = ring.unit_submitted(unit.index) and ctx.arenas.kind is ArenaKind.CUDA_IPC
        if not state.phases.quant_start:
            state.phases.quant_start = time.monotonic()
        ctx.worker.submit(
            state.step,
            unit,
            {n: self.staged(n) for n in unit.inputs},
            {o.name: target.tensor(o.name) for o in unit.outputs},
            sync=sync,
        )

    def staged(self, name: str) -> torch.Tensor:
        """Input ``name`` in staging: its slot there, or its group's region of the staging ring."""
        arenas = self.ctx.arenas
        ring = arenas.ring
        return arenas.staging.tensor(name) if ring is None else ring.view(arenas.staging, name)

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
            for rank in sorted(state.ring_ranks.get(gi, ())):
                self.ctx.send(
                    state.peers[rank], Kind.SLOT, {"step": state.step, "group": gi, "offset": slot.offset}
                )
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
            state = ctx.step
            if state is None or done.step != state.step or done.skipped:
                continue  # a unit of a step that already failed
            state.phases.quant_busy += done.seconds
            notify(ctx.observers, "on_unit_done", ctx, done.step, done.unit, done.start, done.seconds)
            if done.error is not None:
                kind = ErrorKind.NON_FINITE if isinstance(done.error, NonFiniteError) else ErrorKind.INVALID
                if not isinstance(done.error, ValueError):
                    kind = ErrorKind.INTERNAL
                ctx.fail_step(RefitError(str(done.error), kind=kind, step=done.step))
                continue
            state.units_done.add(done.unit)
            if ctx.arenas.ring is not None:
                try:
                    self.grant(ctx.arenas.ring.unit_done(done.unit))
                except ValueError as exc:
                    ctx.fail_step(RefitError(str(exc), kind=ErrorKind.INTERNAL, step=done.step))
                    continue
            if len(state.units_done) == len(ctx.plan.units):
                state.phases.quant_end = time.monotonic()
            self.maybe_publish()
        if ctx.step is None and worker.inflight == 0:
            ctx.start_pending()

    def maybe_publish(self) -> None:
        ctx = self.ctx
        state, plan = ctx.step, ctx.plan
        if state is None or plan is None or not state.sealed(plan):
            return
        state.phases.published = time.monotonic()
        phases = state.phases.seconds()
        record: dict[str, Any] = {
            "step": state.step,
            "generation": state.target.index,
            "bytes_in": state.bytes_in,
            "bytes_out": plan.bytes_out,
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
            plan.bytes_out,
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
            for unit in deferred:
                self.submit(unit)

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
