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
from typing import TYPE_CHECKING

from sidecar.daemon.memory.direct import direct_offsets
from sidecar.daemon.memory.staging import ArenaTooSmall, RingStaging, lane_regions, region_size, ring_groups
from sidecar.daemon.memory.tiers import (
    N_GENERATIONS,
    BudgetTooSmall,
    PublishRing,
    fit_device_tier,
    output_layout,
)
from sidecar.plan.build import RefitPlan
from transport.arena import Arena, ArenaKind
from transport.epochs import EpochPage
from transport.layout import ALIGN, Layout
from transport.shm import ShmArena, segment_name

if TYPE_CHECKING:
    from transport.host_pins import BackgroundPins

log = logging.getLogger("refitd.generations")

__all__ = ["N_GENERATIONS", "Arenas", "Generation", "check_budget", "layouts"]


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
        host_generations: bool = False,
        publish_ring_bytes: int | None = None,
        max_group_bytes: int | None = None,
        budget: int | None = None,
        gpus: list[str | int | None] | None = None,
    ):
        """``staging_regions``: 0 stages a whole step; N > 0 streams it through a ring of N regions
        (sidecar.daemon.memory.staging), carved once the plan is known.

        GPU arenas (``kind`` CUDA_IPC) with ``host_generations``: the generations are host shm,
        page-locked, and a publish ring of ``publish_ring_bytes`` (default: staging's size) on the
        GPU takes each group's outputs before they are copied there (sidecar.daemon.memory.tiers);
        ``max_group_bytes`` cuts layers into parts that fit a region. ``budget``: refuse
        (BudgetTooSmall) to allocate more device memory than this, on each GPU.

        ``gpus`` (GPU arenas, host generations, a ring): the GPUs layer groups are spread over
        bytes balanced (docs/multi_gpu.md, "Per-GPU work"), each with a staging ring and a publish
        ring of its own, of the same sizes; default ``[gpu]``, one GPU as before."""
        self.prefix, self.kind, self.gpu = prefix, ArenaKind(kind), gpu
        self.staging_regions = staging_regions
        on_gpu = self.kind is ArenaKind.CUDA_IPC
        #: where the generations live: host shm on shm arenas, and on GPU arenas unless device-resident
        self.gen_kind = ArenaKind.SHM if host_generations or not on_gpu else ArenaKind.CUDA_IPC
        #: the lanes: one GPU each (index or UUID; None: CUDA's current device), in placement order
        self.gpus: list[str | int | None] = [gpu] if not gpus else list(gpus)
        if len(self.gpus) > 1 and not (on_gpu and self.gen_kind is ArenaKind.SHM and staging_regions):
            raise ValueError(
                f"several GPUs ({self.gpus}) need GPU arenas, host-resident generations and a staging "
                "ring: give one GPU otherwise"
            )
        self.max_group_bytes = max_group_bytes
        self.ring: RingStaging | None = None
        #: the device publish rings' memory, one per GPU (GPU arenas, host generations)
        self.publish_arenas: list[Arena] = []
        self.publish_ring: PublishRing | None = None  # its layout for the plan (the same on every GPU)
        #: page-locking the host generations, on a thread (transport.host_pins: READY does not wait)
        self.pinning: BackgroundPins | None = None
        self._publish_views: dict[tuple[int, int], dict] = {}
        #: inputs whose remote frames the daemon may write straight into the step's generation
        #: (sidecar.daemon.memory.direct): byte offsets there; empty on GPU arenas and with a
        #: staging ring, where every input is staged
        self.direct: dict[str, int] = {}
        self._direct_views: dict[tuple[int, str], object] = {}
        self._direct_specs: dict[str, tuple] = {}
        #: a failed step handed this staging arena to ranks the daemon no longer trusts: it is
        #: replaced (:meth:`retire_staging`) before the next step reads anything from staging
        self.staging_tainted = False
        self.retired_staging = 0  # staging retirements so far (logs, tests)
        self._staging_retired: set[int] = set()  # lanes closed and unlinked, their successor not made yet
        #: GPU staging retired after a failed step, one per lane, kept allocated: a rank may still map
        #: it, and CUDA leaves a cudaFree before the importer's cudaIpcCloseMemHandle undefined (the
        #: memory may come back from the next cudaMalloc). The lane's next retirement makes it the
        #: fresh staging again (zeroed) instead of allocating: at most two stagings per GPU, ever
        self.quarantine: dict[int, Arena] = {}
        self.stagings: list[Arena] = []  # one per GPU (lane); one on shm
        self.generations: list[Generation] = []
        self.epochs: EpochPage | None = None
        #: called with (reader identity, generation, step it held) for each hold dropped by a claim
        self.on_revoke: Callable[[bytes, Generation, int | None], None] | None = None
        self.revoked_holds = 0  # holds dropped because a step needed the generation (status, metrics)
        publish_ring = 0
        if on_gpu and self.gen_kind is ArenaKind.SHM and staging_regions:
            publish_ring = staging_bytes if publish_ring_bytes is None else publish_ring_bytes
        if budget is not None and on_gpu:
            check_budget(
                budget, staging_bytes, publish_ring, 0 if self.gen_kind is ArenaKind.SHM else publish_bytes
            )
        try:
            for lane in range(len(self.gpus)):
                self.stagings.append(self._create(_role("staging", lane), staging_bytes, lane=lane))
                if publish_ring:
                    self.publish_arenas.append(self._create(_role("publish", lane), publish_ring, lane=lane))
            self.epochs = EpochPage.create(segment_name(prefix, "epochs"), N_GENERATIONS)
            for i in range(N_GENERATIONS):
                self.generations.append(
                    Generation(i, self._create(f"gen{i}", publish_bytes, self.gen_kind, sealed=True))
                )
            if on_gpu and self.gen_kind is ArenaKind.SHM:
                from transport.host_pins import BackgroundPins

                self.pinning = BackgroundPins(
                    [g.arena for g in self.generations], self._pin, what="host generations"
                )
        except BaseException:
            self.close()
            raise
        self.live: int | None = None

    @property
    def staging(self) -> Arena:
        """The (first GPU's) staging arena: the only one on shm and on one GPU."""
        return self.stagings[0]

    @property
    def publish_arena(self) -> Arena | None:
        """The (first GPU's) publish ring, or None (no device publish ring)."""
        return self.publish_arenas[0] if self.publish_arenas else None

    @property
    def lanes(self) -> int:
        """GPUs the layer groups are spread over (1: one GPU, or host memory)."""
        return len(self.gpus)

    def _create(
        self, role: str, size: int, kind: ArenaKind | None = None, *, sealed: bool = False, lane: int = 0
    ) -> Arena:
        """A fresh arena of ``kind`` (default: the arenas' own), on GPU ``lane`` when it is a GPU
        arena; ``sealed``: its shm segment is read-only on disk once mapped here (a generation: no
        other process may open it for writing)."""
        name = segment_name(self.prefix, role)
        if (kind or self.kind) is ArenaKind.CUDA_IPC:
            from transport.cuda_ipc import CudaIpcArena  # cuda-bindings only where GPU arenas are asked for

            gpu = self.gpus[lane]
            gpu = int(gpu) if isinstance(gpu, str) and gpu.isdigit() else gpu
            return CudaIpcArena.create(name, Layout([]), size=size, gpu=gpu)
        return ShmArena.create(name, Layout([]), size=size, read_only_on_disk=sealed)

    def retire_staging(self) -> None:
        """Replace the staging arena with a fresh one of the same size and layout, after unlinking
        the old one (shm; on a GPU the old one is kept allocated instead: :meth:`_retire_gpu_staging`).

        Called before a step starts when the last one failed (:attr:`staging_tainted`): a rank the
        daemon stopped trusting (declared dead while frozen, timed out, or part of a failed step)
        may still hold the old arena mapped writable and write into it later; those writes now land
        in memory nobody reads. READY then names the new arena (another name), and clients remap
        and close the old one. Nothing may run from staging meanwhile (no step, no unit in flight).
        On shm the old segment goes first (the caller drops its views of it first). If the new one
        cannot be made, the error propagates and :attr:`staging_tainted` stays set: the next call
        tries again, and no step starts before one succeeds. With several GPUs every GPU's staging
        arena is retired (all were handed to the step's ranks)."""
        if self.kind is ArenaKind.CUDA_IPC:
            self._retire_gpu_staging()
            return
        if not self._staging_retired:
            for old in self.stagings:
                old.close()
                old.unlink()
                log.info("staging arena %s retired after a failed step", old.name)
            self._staging_retired = set(range(len(self.stagings)))
        for lane in sorted(self._staging_retired):
            old = self.stagings[lane]
            fresh = self._create(_role("staging", lane), old.size, lane=lane)
            try:
                fresh.relayout(old.layout)
            except BaseException:
                fresh.close()
                fresh.unlink()
                raise
            self.stagings[lane] = fresh
            self._staging_retired.discard(lane)
            log.info("staging is now %s", fresh.name)
        self.staging_tainted = False
        self.retired_staging += 1

    def _retire_gpu_staging(self) -> None:
        """Swap each GPU's staging with the one retired before (zeroed), or a fresh allocation at
        the lane's first failure; the failed step's arena waits in :attr:`quarantine`, still
        allocated, so a rank's late write lands in memory no step reads and nothing is freed under
        an importer. Without room for the fresh one the error propagates (:attr:`staging_tainted`
        stays set: no step starts on the failed staging; the next call tries again, lane by lane)."""
        if not self._staging_retired:
            self._staging_retired = set(range(len(self.stagings)))
        for lane in sorted(self._staging_retired):
            old = self.stagings[lane]
            fresh = self.quarantine.pop(lane, None)
            if fresh is None:
                fresh = self._create(_role("staging", lane), old.size, lane=lane)
            fresh.zero()
            fresh.relayout(old.layout)
            self.quarantine[lane], self.stagings[lane] = old, fresh
            self._staging_retired.discard(lane)
            log.info("staging arena %s retired after a failed step; staging is now %s", old.name, fresh.name)
        self.staging_tainted = False
        self.retired_staging += 1

    @property
    def pins(self) -> list:
        """The host generations page-locked so far (transport.cuda_ipc.HostPin)."""
        return [] if self.pinning is None else self.pinning.pins

    def _pin(self, arena: Arena):
        """Page-lock a host generation on the arenas' GPU (on the pinning thread), so copies into
        it (and engines' copies out of it, from their own pinned mappings) are DMAs."""
        from transport.cuda_ipc import pin_shm_arena

        return pin_shm_arena(arena, driver=self.staging.driver, device=self.staging.device, read_only=False)

    def synchronize(self) -> None:
        """Make every write into GPU arenas visible before a generation goes live (no-op on shm):
        on every GPU the groups were spread over."""
        if self.kind is ArenaKind.CUDA_IPC:
            for staging in self.stagings:
                staging.synchronize()

    @classmethod
    def for_plan(
        cls, prefix: str, plan: RefitPlan, *, staging_bytes=None, publish_bytes=None, **kw
    ) -> Arenas:
        staging, outputs = layouts(plan)
        regions, groups = kw.get("staging_regions", 0), ring_groups(plan)
        lanes = max(1, len(kw.get("gpus") or ()))
        need = lane_regions(regions, len(groups), lanes) * region_size(groups) if regions else staging.size
        budget = kw.get("budget")
        on_gpu = ArenaKind(kw.get("kind", ArenaKind.SHM)) is ArenaKind.CUDA_IPC
        if on_gpu and budget is not None and regions and staging_bytes is None:
            tier = fit_device_tier(
                plan,
                regions=regions,
                budget=budget,
                host_generations=kw.get("host_generations", False),
                gpus=lanes,
            )
            need, kw["staging_regions"] = tier.staging, tier.regions
            kw.setdefault("publish_ring_bytes", tier.publish)
            kw.setdefault("max_group_bytes", tier.max_group_bytes)
            log.info(
                "device tier: %d ring region(s) of %d B staging + %d B publish, %d groups, %d B of %d B "
                "budget, on each of %d GPU(s)",
                tier.regions,
                tier.staging_region,
                tier.publish_region,
                tier.groups,
                tier.device_bytes,
                budget,
                lanes,
            )
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
            cap = self.max_group_bytes
            if cap is None and self.kind is ArenaKind.CUDA_IPC:  # cut layers that would not fit a region
                regions = lane_regions(self.staging_regions, len(ring_groups(plan)), self.lanes)
                cap = (self.staging.size // regions) // ALIGN * ALIGN
            self.ring = RingStaging(
                plan,
                regions=self.staging_regions,
                capacity=self.staging.size,
                max_group_bytes=cap,
                lanes=self.lanes,
            )
            self._publish_views = {}
            if self.publish_arena is not None:
                self.publish_ring = PublishRing(
                    self.ring.groups,
                    plan,
                    outputs,
                    regions=self.ring.regions,
                    capacity=self.publish_arena.size,
                )
        try:
            for arena in self.stagings:  # a ring places its own
                arena.relayout(Layout([]) if self.staging_regions else staging)
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

    def publish_outputs(self, group: int, region: int) -> dict:
        """Host generations on a GPU: ``group``'s outputs in publish region ``region``, where its
        units write (views made once per group and region)."""
        key = (group, region)
        views = self._publish_views.get(key)
        if views is None:
            arena = self.publish_arenas[self.ring.lane_of(group)]  # the GPU its group is placed on
            views = self._publish_views[key] = self.publish_ring.outputs(arena, group, region)
        return views

    def publish_copies(self, group: int, region: int, gen: Generation) -> list:
        """The ``(device, host)`` byte pairs that copy ``group``'s outputs from ``region`` into ``gen``."""
        arena = self.publish_arenas[self.ring.lane_of(group)]
        return self.publish_ring.copies(arena, group, region, gen.arena)

    def device_bytes(self) -> int:
        """Device memory these arenas hold, on every GPU together (status, tests)."""
        return sum(self.device_bytes_per_gpu())

    def device_bytes_per_gpu(self) -> list[int]:
        """Device memory on each GPU (lane) of :attr:`gpus`: what ``device_budget`` bounds, GPU by GPU.
        Device-resident generations count on the first (the only one then)."""
        from transport.cuda_ipc import allocation_size

        per = [0] * self.lanes
        for lane, arenas in enumerate(zip(self.stagings, self.publish_arenas or [None] * self.lanes)):
            per[lane] = sum(
                allocation_size(a.size) for a in arenas if a is not None and a.kind is ArenaKind.CUDA_IPC
            )
        for lane, arena in self.quarantine.items():
            per[lane] += allocation_size(arena.size)
        per[0] += sum(
            allocation_size(g.arena.size) for g in self.generations if g.arena.kind is ArenaKind.CUDA_IPC
        )
        return per

    def segment_names(self) -> list[str]:
        """The POSIX shared-memory segments (crash clean-up of /dev/shm); GPU memory dies with us."""
        arenas = [*self.stagings, *(g.arena for g in self.generations)]
        page = [] if self.epochs is None else [self.epochs.name]
        return [a.name for a in arenas if a.kind is ArenaKind.SHM] + page

    def all_arenas(self) -> list[Arena]:
        gens = (g.arena for g in self.generations)
        return [*self.stagings, *self.quarantine.values(), *self.publish_arenas, *gens]

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
        """Unmap and unlink every segment (idempotent); page-locked ones are unregistered first."""
        if self.pinning is not None:
            self.pinning.release()
        self._publish_views = {}  # device memory is freed once no view of it is left
        for arena in self.all_arenas():
            arena.close()
            arena.unlink()
        if self.epochs is not None:
            self.epochs.close()
            self.epochs.unlink()


def _role(role: str, lane: int) -> str:
    """An arena's role in its name: ``staging`` on the first GPU (as on one), ``staging-gpu1`` ..."""
    return role if lane == 0 else f"{role}-gpu{lane}"


def check_budget(budget: int, staging: int, publish_ring: int, generation: int) -> None:
    """Refuse (BudgetTooSmall, naming the sizes) device arenas beyond ``budget``, counted as they
    are allocated (whole 2 MiB granules); ``generation``: each device-resident generation's bytes."""
    from transport.cuda_ipc import allocation_size

    parts = {"staging ring": staging, "publish ring": publish_ring}
    parts.update({f"generation {i}": generation for i in range(N_GENERATIONS)})
    sizes = {k: allocation_size(n) for k, n in parts.items() if n}
    if sum(sizes.values()) > budget:
        listed = ", ".join(f"{k} {n} B" for k, n in sizes.items())
        raise BudgetTooSmall(
            f"the device arenas need {sum(sizes.values())} B ({listed}) but device_budget is {budget} B: "
            "raise device_budget, lower staging_bytes or staging_regions, or keep the generations in host "
            "memory (generation_residency = 'host')"
        )


def layouts(plan: RefitPlan) -> tuple[Layout, Layout]:
    """(staging layout of the plan's inputs, generation layout of its outputs)."""
    staging = Layout.build((i.name, i.dtype, i.shape) for i in plan.inputs)
    return staging, output_layout(plan)
