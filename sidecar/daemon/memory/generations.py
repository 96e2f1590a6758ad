"""The daemon's memory: one staging arena and two publish generations, and who holds what.

A step is written into the generation no reader can be handed (never the live one), sealed, then
published by flipping ``live``. Readers hold the generation they were given until they release it;
the daemon reuses a generation only when nobody holds it, or after ``reader_timeout_s`` has passed
since it first needed it, dropping the holds of readers that vanished or hung (and saying so).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from sidecar.config.settings import ArenaKind
from sidecar.daemon.memory.staging import ArenaTooSmall, RingStaging, region_size, ring_groups
from sidecar.plan.build import RefitPlan
from transport.shm import Arena, Layout, ShmArena, segment_name

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
        self.generations: list[Generation] = []
        self.staging = self._create("staging", staging_bytes)
        try:
            for i in range(N_GENERATIONS):
                self.generations.append(Generation(i, self._create(f"gen{i}", publish_bytes)))
        except BaseException:
            self.close()
            raise
        self.live: int | None = None

    def _create(self, role: str, size: int) -> Arena:
        name = segment_name(self.prefix, role)
        if self.kind is ArenaKind.CUDA:
            from transport.cuda_ipc import CudaIpcArena  # cuda-bindings only where GPU arenas are asked for

            gpu = int(self.gpu) if isinstance(self.gpu, str) and self.gpu.isdigit() else self.gpu
            return CudaIpcArena.create(name, Layout([]), size=size, gpu=gpu)
        return ShmArena.create(name, Layout([]), size=size)

    def synchronize(self) -> None:
        """Make every write into GPU arenas visible before a generation goes live (no-op on shm)."""
        if self.kind is ArenaKind.CUDA:
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

    def invalidate(self) -> None:
        """Forget every published generation (the layout changed): nothing is live until the next step."""
        for g in self.generations:
            g.step = None
        self.live = None

    def segment_names(self) -> list[str]:
        """The POSIX shared-memory segments (crash clean-up of /dev/shm); GPU memory dies with us."""
        arenas = [self.staging, *(g.arena for g in self.generations)]
        return [a.name for a in arenas if getattr(a, "kind", "shm") == "shm"]

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
        """The target generation if it is free (dropping holds that timed out), else None."""
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
            gen.holders.clear()
        gen.needed_since = None
        gen.step = None  # from here on it is being written: nobody may be handed it
        return gen

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


def layouts(plan: RefitPlan) -> tuple[Layout, Layout]:
    """(staging layout of the plan's inputs, generation layout of its outputs)."""
    staging = Layout.build((i.name, i.dtype, i.shape) for i in plan.inputs)
    outputs = Layout.build((o.name, o.dtype, o.shape) for o in plan.outputs)
    return staging, outputs
