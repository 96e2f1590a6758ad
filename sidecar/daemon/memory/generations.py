"""The daemon's memory: one staging arena and two publish generations, and who holds what.

A step is written into the generation no reader can be handed (never the live one), sealed, then
published by flipping ``live``. Readers hold the generation they were given until they release it;
the daemon reuses a generation only when nobody holds it, or after ``reader_timeout_s`` has passed
since it first needed it, dropping the holds of readers that vanished or hung (and saying so).
Claiming a generation bumps its epoch (transport.epochs) before any byte goes into it, so a reader
whose hold was dropped while it still copied finds out its copy may be torn.

No trainer process ever maps a generation: only the daemon writes one (local ranks write staging,
which the daemon copies out and checks; remote ranks' frames are written by the daemon itself). A
generation's segment is made read-only on disk (0400) once the daemon mapped it, so a process of
the same user that opens it by name for writing gets EACCES. Staging handed to ranks of a step that
failed (a rank that died, timed out or misbehaved may still be writing through its mapping) is
retired before the next step: :meth:`Arenas.retire_staging` replaces it with a fresh segment (or
allocation, on a GPU) and the old one is never read again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sidecar.daemon.memory.direct import direct_offsets
from sidecar.daemon.memory.staging import ArenaTooSmall, RingStaging, region_size, ring_groups
from sidecar.plan.build import RefitPlan
from transport.arena import Arena, ArenaKind
from transport.epochs import EpochPage
from transport.shm import Layout, ShmArena, segment_name

log = logging.getLogger("refitd.generations")

N_GENERATIONS = 2


@dataclass(slots=True)
class Generation:
    index: int
    arena: Arena
    step: int | None = None  # the step it holds when published; None while being written / invalid
    holders: dict[bytes, float] = field(default_factory=dict)  # reader identity -> time handed out
    needed_since: float | None = None  # when a step first wanted to write it while held


class Arenas:
    """Staging + generations for one daemon instance; owns every segment and unlinks them on close."""

    def __init__(
        self,
        prefix: str,
        *,
        staging_bytes: int,
        publish_bytes: int,
        kind: ArenaKind = ArenaKind.SHM,
        gpu: str | int | None = None,
        staging_regions: int = 0,
    ):
        """``staging_regions``: 0 stages a whole step; N > 0 streams it through a ring of N regions
        (sidecar.daemon.memory.staging), carved once the plan is known."""
        self.prefix, self.kind, self.gpu = prefix, ArenaKind(kind), gpu
        self.staging_regions = staging_regions
        self.ring: RingStaging | None = None
        #: inputs whose remote frames the daemon may write straight into the step's generation
        #: (sidecar.daemon.memory.direct): byte offsets there; empty on GPU arenas and with a
        #: staging ring, where every input is staged
        self.direct: dict[str, int] = {}
        self._direct_views: dict[tuple[int, str], object] = {}
        self._direct_specs: dict[str, tuple] = {}
        #: a failed step handed this staging arena to ranks the daemon no longer trusts: it is
        #: replaced (:meth:`retire_staging`) before the next step reads anything from staging
        self.staging_tainted = False
        self.retired_staging = 0  # staging arenas retired so far (logs, tests)
        self._staging_retired = False  # closed and unlinked, its successor not made yet
        self.generations: list[Generation] = []
        self.epochs: EpochPage | None = None
        #: called with (reader identity, generation, step it held) for each hold dropped by a claim
        self.on_revoke: Callable[[bytes, Generation, int | None], None] | None = None
        self.revoked_holds = 0  # holds dropped because a step needed the generation (status, metrics)
        self.staging = self._create("staging", staging_bytes)
        try:
            self.epochs = EpochPage.create(segment_name(prefix, "epochs"), N_GENERATIONS)
            for i in range(N_GENERATIONS):
                self.generations.append(Generation(i, self._create(f"gen{i}", publish_bytes, sealed=True)))
        except BaseException:
            self.close()
            raise
        self.live: int | None = None

    def _create(self, role: str, size: int, *, sealed: bool = False) -> Arena:
        """A fresh arena; ``sealed``: its shm segment is read-only on disk once mapped here (a
        generation: no other process may open it for writing)."""
        name = segment_name(self.prefix, role)
        if self.kind is ArenaKind.CUDA_IPC:
            from transport.cuda_ipc import CudaIpcArena  # cuda-bindings only where GPU arenas are asked for

            gpu = int(self.gpu) if isinstance(self.gpu, str) and self.gpu.isdigit() else self.gpu
            return CudaIpcArena.create(name, Layout([]), size=size, gpu=gpu)
        return ShmArena.create(name, Layout([]), size=size, read_only_on_disk=sealed)

    def retire_staging(self) -> None:
        """Replace the staging arena with a fresh one of the same size and layout, after unlinking
        (shm) or dropping (GPU: freed once no view of it is alive) the old one.

        Called before a step starts when the last one failed (:attr:`staging_tainted`): a rank the
        daemon stopped trusting (declared dead while frozen, timed out, or part of a failed step)
        may still hold the old arena mapped writable and write into it later; those writes now land
        in memory nobody reads. READY then names the new arena (another name), and clients remap
        and close the old one. Nothing may run from staging meanwhile (no step, no unit in flight).
        The old arena goes first, so a GPU needs no room for two (the caller drops its views of it
        first). If the new one cannot be made, the error propagates and :attr:`staging_tainted`
        stays set: the next call tries again, and no step starts before one succeeds."""
        old = self.staging
        if not self._staging_retired:
            old.close()
            old.unlink()
            self._staging_retired = True
            log.info("staging arena %s retired after a failed step", old.name)
        fresh = self._create("staging", old.size)
        try:
            fresh.relayout(old.layout)
        except BaseException:
            fresh.close()
            fresh.unlink()
            raise
        self.staging = fresh
        self._staging_retired = False
        self.staging_tainted = False
        self.retired_staging += 1
        log.info("staging is now %s", fresh.name)

    def synchronize(self) -> None:
        """Make every write into GPU arenas visible before a generation goes live (no-op on shm)."""
        if self.kind is ArenaKind.CUDA_IPC:
            import torch

            torch.cuda.synchronize(self.staging.device)

    @classmethod
    def for_plan(
        cls, prefix: str, plan: RefitPlan, *, staging_bytes=None, publish_bytes=None, **kw
    ) -> Arenas:
        staging, outputs = layouts(plan)
        regions, groups = kw.get("staging_regions", 0), ring_groups(plan)
        need = min(regions, len(groups)) * region_size(groups) if regions else staging.size
        arenas = cls(
            prefix,
            staging_bytes=need if staging_bytes is None else staging_bytes,
            publish_bytes=outputs.size if publish_bytes is None else publish_bytes,
            **kw,
        )
        try:
            arenas.apply_plan(plan)
        except BaseException:
            arenas.close()
            raise
        return arenas

    def apply_plan(self, plan: RefitPlan) -> None:
        """Carve the arenas for ``plan``; ArenaTooSmall (naming sizes) when they are too small."""
        staging, outputs = layouts(plan)
        if self.staging_regions:  # ArenaTooSmall when a region cannot hold the largest group
            self.ring = RingStaging(plan, regions=self.staging_regions, capacity=self.staging.size)
        try:
            self.staging.relayout(Layout([]) if self.staging_regions else staging)  # a ring places its own
            for g in self.generations:
                g.arena.relayout(outputs)
        except ValueError as exc:  # the one ValueError an arena's relayout raises: it is too small
            raise ArenaTooSmall(str(exc)) from None
        self._direct_views = {}
        direct_ok = self.kind is ArenaKind.SHM and not self.staging_regions
        self.direct = direct_offsets(plan, outputs) if direct_ok else {}
        self._direct_specs = {i.name: (i.dtype, i.shape) for i in plan.inputs if i.name in self.direct}

    def direct_view(self, gen: Generation, name: str):
        """Input ``name`` where it lands in ``gen`` when written directly (see :attr:`direct`)."""
        key = (gen.index, name)
        view = self._direct_views.get(key)
        if view is None:
            dtype, shape = self._direct_specs[name]
            view = self._direct_views[key] = gen.arena.view(self.direct[name], dtype, shape)
        return view

    def invalidate(self) -> None:
        """Forget every published generation (the layout changed): nothing is live until the next step."""
        for g in self.generations:
            g.step = None
        self.live = None

    def segment_names(self) -> list[str]:
        """The POSIX shared-memory segments (crash clean-up of /dev/shm); GPU memory dies with us."""
        arenas = [self.staging, *(g.arena for g in self.generations)]
        page = [] if self.epochs is None else [self.epochs.name]
        return [a.name for a in arenas if a.kind is ArenaKind.SHM] + page

    def all_arenas(self) -> list[Arena]:
        return [self.staging, *(g.arena for g in self.generations)]

    # ---- publish cycle

    def live_generation(self) -> Generation | None:
        return None if self.live is None else self.generations[self.live]

    def target(self) -> Generation:
        """The generation the next step writes: never the live one."""
        index = 0 if self.live is None else (self.live + 1) % N_GENERATIONS
        return self.generations[index]

    def claim_target(self, now: float, reader_timeout_s: float) -> Generation | None:
        """The target generation if it is free (dropping holds that timed out), else None.

        Every path that writes a step into a generation (a trainer step, staged whole or through the
        ring, on host or GPU arenas; a forwarded step on an inference node) claims it here first, so
        its epoch is bumped before the first byte is written: a reader still copying out of it
        after its hold was dropped sees the epoch change (``adapters.base.Generation.intact``)."""
        gen = self.target()
        if gen.holders:
            if gen.needed_since is None:
                gen.needed_since = now
            if now - gen.needed_since < reader_timeout_s:
                return None
            log.warning(
                "dropping holds on generation %d (step %s) by %d reader(s) that did not release it within %.1f s",
                gen.index,
                gen.step,
                len(gen.holders),
                reader_timeout_s,
            )
            revoked, held_step = list(gen.holders), gen.step
            gen.holders.clear()
            self.revoked_holds += len(revoked)
            for identity in revoked:
                self._revoked(identity, gen, held_step)
        gen.needed_since = None
        gen.step = None  # from here on it is being written: nobody may be handed it
        self.epochs.bump(gen.index)  # before any byte of the new step: readers can tell
        return gen

    def _revoked(self, identity: bytes, gen: Generation, held_step: int | None) -> None:
        """Tell the owner (the daemon says so to the reader); never let that stop the claim."""
        if self.on_revoke is None:
            return
        try:
            self.on_revoke(identity, gen, held_step)
        except Exception:  # the claim goes on: the epoch still tells the reader
            log.exception(
                "telling reader %s that its hold on generation %d was dropped failed",
                identity.hex()[:16],
                gen.index,
            )

    def epoch(self, gen: Generation) -> int:
        """The epoch ``gen`` is at now: the one a reader handed it is given to compare with later."""
        return self.epochs.read(gen.index)

    def publish(self, gen: Generation, step: int) -> None:
        gen.step = step
        self.live = gen.index

    def hold(self, identity: bytes, gen: Generation) -> None:
        gen.holders[identity] = time.monotonic()

    def release(self, identity: bytes, index: int, step: int | None) -> bool:
        """Drop ``identity``'s hold on generation ``index``; False if it held none there (already dropped)."""
        if not 0 <= index < len(self.generations):
            return False
        gen = self.generations[index]
        if step is not None and gen.step is not None and gen.step != step:
            return False
        return gen.holders.pop(identity, None) is not None

    def drop_reader(self, identity: bytes) -> None:
        for gen in self.generations:
            gen.holders.pop(identity, None)

    def close(self) -> None:
        """Unmap and unlink every segment (idempotent)."""
        for arena in [self.staging, *(g.arena for g in self.generations)]:
            arena.close()
            arena.unlink()
        if self.epochs is not None:
            self.epochs.close()
            self.epochs.unlink()


def layouts(plan: RefitPlan) -> tuple[Layout, Layout]:
    """(staging layout of the plan's inputs, generation layout of its outputs)."""
    staging = Layout.build((i.name, i.dtype, i.shape) for i in plan.inputs)
    outputs = Layout.build((o.name, o.dtype, o.shape) for o in plan.outputs)
    return staging, outputs
