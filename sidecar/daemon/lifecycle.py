"""How a step ends: published, failed, or timed out (the serve loop's step lifecycle).

A step begins when every rank's BEGIN is in (sidecar.daemon.trainers calls ``begin_step``) and ends
here, nowhere else: ``publish`` flips a sealed generation live and answers the ranks, ``fail`` tells
every rank and rolls back streaming engines, ``check`` fails a step past its deadline or one whose
rank went silent. The step itself, the plan, the arenas, the worker and the history stay on the
daemon (the shared context, sidecar.daemon.context); this component holds no state of its own.
"""

from __future__ import annotations

import logging
from typing import Any

from sidecar.daemon.step import StepState
from sidecar.errors import ErrorKind, RefitError
from sidecar.ops.observers import notify
from transport.wire import Kind

log = logging.getLogger("refitd.daemon")


class StepLifecycle:
    """Publishes, fails and times out the daemon's step in progress (serve-loop thread only)."""

    def __init__(self, ctx):
        self.ctx = ctx  # the daemon (sidecar.daemon.loop.Daemon): observers are handed it

    def publish(
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
        ctx = self.ctx
        ctx.arenas.synchronize()  # GPU arenas: every kernel's writes land before anyone is told
        ctx.arenas.publish(gen, record["step"])
        ctx.last_step = record["step"]
        ctx.history = [*ctx.history[-9:], record]
        for identity in trainers:
            ctx.send(identity, reply, {**record, **(extra or {})})
        notify(ctx.observers, "on_step_published", ctx, record, state)
        ctx.streams.published(record["step"])
        ctx.engine_side.published(record["step"], trainers)

    def fail(self, err: RefitError) -> None:
        """Fail the step in progress (if any) on every rank; the last good generation stays live."""
        ctx = self.ctx
        state = ctx.step
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
        rolled_back = ctx.streams.failed(state, err)  # streaming engines return to the live step at once
        if rolled_back:
            err = RefitError(
                f"{err.message} (engine workers that had loaded part of step {state.step} reload it from the "
                f"last good generation: {', '.join(rolled_back)})",
                kind=err.kind,
                rank=err.rank,
                step=err.step,
                rolled_back=rolled_back,
            )
        notify(ctx.observers, "on_step_failed", ctx, err)
        ctx.trainers.tell_failed(state, err)
        ctx.worker.cancel(state.step)
        pulling = ctx.pulls.busy
        ctx.pulls.cancel()
        if state.target is not None:
            state.target.step = None  # half-written: never hand it out
        if state.staged or pulling:
            # ranks of this step hold staging mapped writable, and one the daemon gave up on (frozen,
            # timed out) may write into it later; a NIXL READ UCX could not cancel may still land in
            # it: it is replaced before the next step (Trainers)
            ctx.arenas.staging_tainted = True
        if ctx.arenas.ring is not None:
            ctx.arenas.ring.reset()
        ctx.end_step()
        ctx.start_pending()

    def check(self, now: float) -> bool:
        """Fail the step in progress if it is past its deadline or a rank that has not committed went
        silent for longer than rank_timeout_s; True if it was failed."""
        ctx = self.ctx
        state = ctx.step
        if state is None:
            return False
        if now > state.deadline:
            missing = state.missing_ranks()
            why = f"ranks {missing} never began it" if missing else "it was not complete"
            if not missing and state.target is None and state.blocked is not None:
                why = (
                    f"its generation {state.blocked['generation']} was still held by "
                    f"{', '.join(state.blocked['readers'])}"
                )
            self.fail(
                RefitError(
                    f"step {state.step} timed out after {ctx.config.step_timeout_s:.1f} s: {why}",
                    kind=ErrorKind.TIMEOUT,
                    step=state.step,
                )
            )
            return True
        for rank, identity in state.peers.items():
            peer = ctx.peers.get(identity)
            silent = now - peer.last_seen if peer is not None else float("inf")
            if rank not in state.committed and silent > ctx.config.rank_timeout_s:
                self.fail(
                    RefitError(
                        f"rank {rank} stopped responding mid-step (silent for {silent:.1f} s, "
                        f"rank_timeout_s={ctx.config.rank_timeout_s}): it died or hung",
                        kind=ErrorKind.RANK_DIED,
                        rank=rank,
                        step=state.step,
                    )
                )
                return True
        return False
