"""The memory tiers (DESIGN decision 10): what goes on a GPU, within a budget, and what stays in host memory.

With ``arena = "cuda"`` and ``generation_residency = "host"`` (the default) the two generations, the
never-torn pair, live in host shared memory, page-locked; the GPU holds only two rings, each of
``regions`` regions:

- the **staging ring** (``sidecar.daemon.memory.staging``): a layer group's BF16 inputs, written by
  the trainer ranks;
- the **publish ring** (:class:`PublishRing`): the same group's quantized outputs, written by the
  GPU kernels, then copied device to host into the generation (one copy per run of outputs that lie
  back to back there) and synchronized before the group counts as written. Passthroughs (norms,
  embeddings, BF16-kept experts) are copied from staging straight into the generation.

Group ``g`` uses the publish region with the index of its staging region, so both free together and
the publish ring needs no bookkeeping of its own. :func:`fit_device_tier` chooses the region count
and, where a whole layer does not fit, cuts layers into parts (``ring_groups(max_bytes=...)``) so
that ``regions x (staging region + publish region)`` stays within ``device_budget`` whatever the
model's size; it refuses (:class:`BudgetTooSmall`, naming the group and the bytes) a plan whose
smallest indivisible group cannot fit even one region. With ``generation_residency = "device"`` the
kernels write straight into device generations: the budget must then hold both of them as well.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sidecar.daemon.memory.staging import (
    ArenaTooSmall,
    Group,
    RingStaging,
    group_atoms,
    lane_regions,
    layer_groups,
    pack,
    region_size,
    ring_groups,
)
from sidecar.plan.build import RefitPlan
from transport.layout import ALIGN, Layout

__all__ = [
    "BudgetTooSmall",
    "DeviceTier",
    "PublishRing",
    "copy_out",
    "fit_device_tier",
    "least_budget_for",
    "publish_region_size",
]

#: the never-torn pair: the live generation and the one the next step writes (memory.generations)
N_GENERATIONS = 2
#: bisection steps of fit_device_tier's part size (2**40 > any budget / ALIGN)
_FIT_ROUNDS = 40


class BudgetTooSmall(ArenaTooSmall):
    """The device budget cannot hold the rings a plan needs (a configuration error: EX_CONFIG)."""


def output_layout(plan: RefitPlan) -> Layout:
    """A generation's layout: the plan's outputs in order (as ``memory.generations.layouts`` carves it)."""
    return Layout.build((o.name, o.dtype, o.shape) for o in plan.outputs)


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


# --------------------------------------------------------------------------------------------------
# the publish ring's layout


@dataclass(frozen=True, slots=True)
class Run:
    """Outputs lying back to back in the generation: one device-to-host copy."""

    gen_offset: int
    region_offset: int
    nbytes: int


class PublishLayout:
    """One group's quantized outputs in a publish region: where each lands, and the runs to copy
    out. Passthrough outputs take no room: their units copy them from staging straight into the
    host generation (one device-to-host copy, nothing to compute), so a 2 GiB embedding needs
    its staging region only."""

    def __init__(self, group: Group, plan: RefitPlan, outputs: Layout):
        names = [o.name for u in group.units if plan.units[u].fmt is not None for o in plan.units[u].outputs]
        slots = sorted((outputs.slots[n] for n in names), key=lambda s: s.offset)
        runs: list[list] = []  # [gen_offset, end]
        for s in slots:
            if runs and s.offset <= runs[-1][1] + (-runs[-1][1] % ALIGN):
                runs[-1][1] = max(runs[-1][1], s.offset + s.nbytes)
            else:
                runs.append([s.offset, s.offset + s.nbytes])
        placed, at = [], 0
        for start, end in runs:
            placed.append(Run(start, at, end - start))
            at += -(-(end - start) // ALIGN) * ALIGN
        self.runs: tuple[Run, ...] = tuple(placed)
        self.size = at
        where, k = {}, 0
        for s in slots:  # both in generation order
            while k + 1 < len(placed) and placed[k + 1].gen_offset <= s.offset:
                k += 1
            where[s.name] = (placed[k].region_offset + s.offset - placed[k].gen_offset, s)
        self.where = where


def publish_region_size(groups: list[Group], plan: RefitPlan, outputs: Layout) -> int:
    return max(ALIGN, max((PublishLayout(g, plan, outputs).size for g in groups), default=0))


class PublishRing:
    """The device ring the kernels quantize into: ``regions`` regions of ``region_bytes``."""

    def __init__(self, groups: list[Group], plan: RefitPlan, outputs: Layout, *, regions: int, capacity: int):
        self.layouts = [PublishLayout(g, plan, outputs) for g in groups]
        self.regions = regions
        self.region_bytes = (capacity // max(regions, 1)) // ALIGN * ALIGN
        largest = max(range(len(groups)), key=lambda i: self.layouts[i].size, default=None)
        if largest is not None and self.layouts[largest].size > self.region_bytes:
            raise ArenaTooSmall(
                f"the publish ring holds {capacity} bytes: {regions} regions of {self.region_bytes} bytes, "
                f"but {groups[largest].label!r} publishes {self.layouts[largest].size} bytes; raise "
                "device_budget, or leave the arena sizes unset so the daemon sizes itself"
            )

    def outputs(self, arena, group: int, region: int):
        """``{output name: its device view}`` in ``region`` for ``group``'s units."""
        base = region * self.region_bytes
        return {
            name: arena.view(base + off, s.dtype, s.shape)
            for name, (off, s) in self.layouts[group].where.items()
        }

    def copies(self, arena, group: int, region: int, generation) -> list:
        """``(device bytes, host bytes)`` pairs that move ``group``'s outputs into ``generation``."""
        base = region * self.region_bytes
        return [
            (
                arena.view(base + r.region_offset, torch.uint8, (r.nbytes,)),
                generation.view(r.gen_offset, torch.uint8, (r.nbytes,)),
            )
            for r in self.layouts[group].runs
            if r.nbytes
        ]


def copy_out(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Move a group's outputs from the device publish ring into the host generation (page-locked):
    asynchronous copies on a stream of their own (after the kernels that wrote them), then a sync,
    so the group counts as written only once its bytes are in host memory. Host memory on both
    sides (CPU arenas; the tests' fake driver) is a plain copy."""
    if not copies:
        return
    if not copies[0][0].is_cuda:
        for src, dst in copies:
            dst.copy_(src)
        return
    device = copies[0][0].device
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for src, dst in copies:
            dst.copy_(src, non_blocking=True)
    stream.synchronize()


# --------------------------------------------------------------------------------------------------
# fitting a plan into the budget


@dataclass(frozen=True, slots=True)
class DeviceTier:
    """What one GPU holds for a plan: ``regions`` x (staging region + publish region), plus the
    generations when they are device-resident; ``max_group_bytes`` cuts layers (None: whole)."""

    regions: int
    max_group_bytes: int | None
    groups: int
    staging_region: int
    publish_region: int
    generations: int  # bytes of the two generations on the device (0: they are in host memory)
    budget: int

    @property
    def staging(self) -> int:
        return self.regions * self.staging_region

    @property
    def publish(self) -> int:
        return self.regions * self.publish_region

    @property
    def device_bytes(self) -> int:
        """As allocated: each arena rounded up to whole 2 MiB granules (transport.cuda_ipc)."""
        from transport.cuda_ipc import allocation_size

        rings = sum(allocation_size(n) for n in (self.staging, self.publish) if n)
        return rings + (2 * allocation_size(self.generations // 2) if self.generations else 0)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class _Sizer:
    """The rings' region sizes for a part size, from sizes taken once (a plan of DeepSeek-V3's
    size has ~50k tensors: its groups are built once, each candidate size is arithmetic). Region
    sizes are upper bounds of what ``ring_groups(max_bytes=...)`` and PublishLayout then carve."""

    def __init__(self, plan: RefitPlan, outputs: Layout, host: bool):
        self.host = host
        atoms = {n: g for g in layer_groups(plan, by_layer=False) for n in g.inputs}
        self.layers = []  # (label, staging bytes, publish bytes, [(atom in, atom out, first input)])
        #: the distinct layer shapes (a model's MoE layers are alike), how many of each
        self.shapes: dict[tuple, int] = {}
        for group in layer_groups(plan):
            members = group_atoms(group, atoms)
            rows = [(a.nbytes, self._out(plan, outputs, a.units), a.inputs[0]) for a in members]
            self.layers.append((group.label, group.nbytes, sum(r[1] for r in rows), rows))
            shape = (group.nbytes, sum(r[1] for r in rows), tuple((r[0], r[1]) for r in rows))
            self.shapes[shape] = self.shapes.get(shape, 0) + 1

    def _out(self, plan, outputs, units) -> int:
        if not self.host:
            return 0
        quantized = (plan.units[u] for u in units if plan.units[u].fmt is not None)
        return sum(_aligned(outputs.slots[o.name].nbytes) for unit in quantized for o in unit.outputs)

    def regions(self, cap: int | None) -> tuple[int, int, int]:
        """(groups, staging region, publish region) with layers cut at ``cap`` input bytes."""
        groups, staging, publish = 0, ALIGN, ALIGN if self.host else 0
        for (nin, nout, rows), count in self.shapes.items():
            if cap is None or nin <= cap:
                groups, staging, publish = groups + count, max(staging, _aligned(nin)), max(publish, nout)
                continue
            parts = pack([r[0] for r in rows], cap)
            groups += count * len(parts)
            staging = max(staging, max(sum(_aligned(rows[i][0]) for i in part) for part in parts))
            publish = max(publish, max(sum(rows[i][1] for i in part) for part in parts))
        return groups, staging, publish

    def worst_atom(self) -> tuple[str, str, int, int]:
        """(layer label, first input, in bytes, out bytes) of the atom needing the most device memory."""
        return max(
            ((label, first, nin, nout) for label, _i, _o, rows in self.layers for nin, nout, first in rows),
            key=lambda t: t[2] + t[3],
        )


def _tier(
    sizer: _Sizer, regions: int, cap: int | None, generations: int, budget: int, gpus: int = 1
) -> DeviceTier:
    groups, staging, publish = sizer.regions(cap)
    regions = lane_regions(regions, groups, gpus)
    return DeviceTier(regions, cap, groups, staging, publish, generations, budget)


def fit_device_tier(
    plan: RefitPlan, *, regions: int, budget: int, host_generations: bool, gpus: int = 1
) -> DeviceTier:
    """The device tier for ``plan`` within ``budget`` bytes: ``regions`` regions of whole layer
    groups where they fit, else layers cut into parts small enough, else fewer regions (more
    regions first: they let the ranks fill one region while the kernels drain another).
    BudgetTooSmall names the part that cannot fit even alone and the bytes it needs.

    ``gpus``: the groups are spread over that many GPUs (bytes balanced) (docs/multi_gpu.md), each with
    rings of its own: the tier is then what EACH of them holds (regions sized for the largest
    group, which bounds every GPU's share; no more regions than one GPU's share of groups), each
    within ``budget``; ``DeviceTier.groups`` still counts every group of the node."""
    if gpus < 1:
        raise ValueError(f"fit_device_tier: gpus must be at least 1, got {gpus}")
    if not host_generations and gpus > 1:
        raise ValueError("device-resident generations live on one GPU: fit them with gpus=1")
    outputs = output_layout(plan)
    generations = 0 if host_generations else N_GENERATIONS * outputs.size
    if generations >= budget:
        raise BudgetTooSmall(
            f"generation_residency = 'device' puts {N_GENERATIONS} generations of {_gib(outputs.size)} on the "
            f"GPU, more than device_budget = {_gib(budget)}: set generation_residency = 'host' (the "
            f"default), or raise device_budget above {_gib(generations)} plus the rings"
        )
    sizer = _Sizer(plan, outputs, host_generations)
    for r in range(max(1, regions), 0, -1):
        tier = _tier(sizer, r, None, generations, budget, gpus)
        if tier.device_bytes <= budget:
            return tier
        if _tier(sizer, r, ALIGN, generations, budget, gpus).device_bytes > budget:
            continue  # not even the smallest parts fit r regions
        lo, hi, best = ALIGN, budget // r, None  # the largest part size that fits: bisect
        for _ in range(_FIT_ROUNDS):
            if lo > hi:
                break
            mid = (lo + hi) // 2
            tier = _tier(sizer, r, mid, generations, budget, gpus)
            if tier.device_bytes <= budget:
                best, lo = tier, mid + 1
            else:
                hi = mid - 1
        if best is not None:
            return best
    label, first, nin, nout = sizer.worst_atom()
    need = nin + nout + generations
    gens = f" + {_gib(generations)} of device-resident generations" if generations else ""
    raise BudgetTooSmall(
        f"device_budget = {_gib(budget)} ({budget} B) cannot hold one ring region for {label!r}: its "
        f"tensors read together from {first!r} stage {_gib(nin)} and publish {_gib(nout)}{gens}, "
        f"{_gib(need)} ({need} B) in all, as 2 MiB allocations more. Raise device_budget to at least "
        f"{_gib(need + (4 << 20))}" + (", or set generation_residency = 'host'" if generations else "")
    )


def least_budget_for(
    start_plan: RefitPlan,
    plan: RefitPlan,
    *,
    regions: int,
    budget: int,
    host_generations: bool,
    gpus: int = 1,
) -> int:
    """The least ``device_budget`` (a whole MiB) with which a daemon that sizes its device tier for
    ``start_plan`` (the config's, at start) can also carve its rings for ``plan`` (the trainer's
    inputs, e.g. FP32 masters: twice the staging bytes): what a capacity error on GPU arenas
    advises, checked the way the daemon carves them (:func:`fit_device_tier`, then the staging and
    publish rings), so that following it works."""
    outputs = output_layout(plan)

    def fits(b: int) -> bool:
        try:
            tier = fit_device_tier(
                start_plan, regions=regions, budget=b, host_generations=host_generations, gpus=gpus
            )
            cap = tier.max_group_bytes
            if cap is None:  # as Arenas.apply_plan cuts groups on GPU arenas: to what a region holds
                held = lane_regions(tier.regions, len(ring_groups(plan)), gpus)
                cap = (tier.staging // held) // ALIGN * ALIGN
            ring = RingStaging(
                plan, regions=tier.regions, capacity=tier.staging, max_group_bytes=cap, lanes=gpus
            )
            if host_generations:
                PublishRing(ring.groups, plan, outputs, regions=ring.regions, capacity=tier.publish)
        except ArenaTooSmall:
            return False
        return True

    mib = 1 << 20
    lo, hi = max(budget // mib, 1), max(budget // mib, 1) * 2
    while not fits(hi * mib):
        lo, hi = hi, hi * 2
        if hi > 1 << 20:  # a TiB: the tier is sized to the config's layers, whatever the budget
            raise ArenaTooSmall(f"no device_budget holds this step's inputs' rings (tried up to {hi} MiB)")
    while hi - lo > 1:  # the boundary, to a MiB (hi always fits)
        mid = (lo + hi) // 2
        if fits(mid * mib):
            hi = mid
        else:
            lo = mid
    return hi * mib


def staging_for(start_plan: RefitPlan, plan: RefitPlan, *, regions: int, gpus: int = 1) -> tuple[int, int]:
    """``(staging_bytes, device_budget)`` with which GPU arenas (host generations) hold both plans'
    rings whole-layer: where no budget alone does (a trainer's FP32 expert slab can outgrow the
    config's whole BF16 layer, and the daemon sizes its tier to the config's layers). Checked the
    way ``Arenas`` carves them: the staging ring, then a publish ring of the same size."""
    from transport.cuda_ipc import allocation_size

    staging = max(
        lane_regions(regions, len(groups), gpus) * region_size(groups)
        for groups in (ring_groups(start_plan), ring_groups(plan))
    )
    for p in (start_plan, plan):  # ArenaTooSmall if this reasoning missed a case
        held = lane_regions(regions, len(ring_groups(p)), gpus)
        ring = RingStaging(
            p,
            regions=regions,
            capacity=staging,
            max_group_bytes=(staging // held) // ALIGN * ALIGN,
            lanes=gpus,
        )
        PublishRing(ring.groups, p, output_layout(p), regions=ring.regions, capacity=staging)
    mib = 1 << 20
    return staging, -(-2 * allocation_size(staging) // mib) * mib
