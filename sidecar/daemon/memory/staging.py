"""Staging as a ring: a step streams through a few regions, one layer group at a time.

Whole-step staging holds every BF16 input of a step at once: 67 GB for a Qwen3.5-35B-A3B, which
is a GPU's worth of memory on a colocated node. With ``staging_regions = R`` the staging arena is
``R`` regions, each big enough for the largest *group* (the inputs of one decoder layer, or one
non-layer tensor such as the embedding), and the step goes through them in plan order:

    daemon                                     trainer ranks (every rank with pieces in group g)
    READY {ring, placement: [group, rel]}  ->
    SLOT {group g, offset}  (R groups at once) ->  write pieces at offset + rel, PIECE_DONE
    group g complete: its units run from the region
    last unit of g done (GPU: synchronized)
    region freed, SLOT {group g + R, offset} ->  ...

Groups are granted in plan order and every rank that holds part of a granted group is told, so a
granted group can always complete: no rank waits on a region another rank's later group holds.
Staging then needs ``R x largest group`` bytes instead of the whole step (``R = 4``: 7 GB for
Qwen3.5-35B-A3B), and a region is refilled while the daemon quantizes the ones behind it.

Pure bookkeeping over byte offsets (``sidecar.daemon.memory.ring``): the arena turns an offset into a
tensor with ``arena.view``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from sidecar.daemon.memory.ring import RingError, RingSlot, StagingRing
from sidecar.plan.build import RefitPlan
from transport.layout import ALIGN, Layout

__all__ = ["ArenaTooSmall", "Group", "RingStaging", "ring_groups"]


class ArenaTooSmall(ValueError):
    """An arena (or a region of the staging ring) cannot hold what the plan puts in it: a CAPACITY
    problem, fixed by a larger arena, not by different tensors."""


@dataclass(frozen=True, slots=True)
class Group:
    """Inputs staged together: every unit reading one of them reads only inputs of this group."""

    index: int
    label: str  # "layer 3", "mtp.0", or the tensor's name
    inputs: tuple[str, ...]  # plan order
    units: tuple[int, ...]
    layout: Layout  # offsets from the start of the region

    @property
    def nbytes(self) -> int:
        return self.layout.size


def ring_groups(plan: RefitPlan, max_bytes: int | None = None) -> list[Group]:
    """The plan's inputs cut into groups: one per decoder (or MTP) layer, one per other unit,
    merged wherever units share an input; in plan input order.

    ``max_bytes`` (a device budget, sidecar.daemon.memory.tiers): a layer group larger than this is
    cut into parts of at most ``max_bytes`` input bytes, each a run of whole *atoms* (units joined
    by a shared input: one expert's gate and up, a grouped slab), labelled ``layer 3 part 2/7``. An
    atom larger than ``max_bytes`` stays whole (the caller says it cannot fit)."""
    groups = _layer_groups(plan)
    if max_bytes is None or all(g.nbytes <= max_bytes for g in groups):
        return groups
    atoms = {name: g for g in _layer_groups(plan, by_layer=False) for name in g.inputs}
    specs = {i.name: i for i in plan.inputs}
    out: list[Group] = []
    for group in groups:
        if group.nbytes <= max_bytes:
            out.append(group)
            continue
        members_of = group_atoms(group, atoms)
        parts = [[members_of[i] for i in part] for part in pack([a.nbytes for a in members_of], max_bytes)]
        for k, part in enumerate(parts):
            members = set().union(*(a.inputs for a in part))
            names = tuple(n for n in group.inputs if n in members)
            units = tuple(sorted(u for a in part for u in a.units))
            layout = Layout.build((n, specs[n].dtype, specs[n].shape) for n in names)
            label = f"{group.label} part {k + 1}/{len(parts)}"
            out.append(Group(len(out), label, names, units, layout))
    return [Group(i, g.label, g.inputs, g.units, g.layout) for i, g in enumerate(out)]


def group_atoms(group: Group, atoms: dict[str, Group]) -> list[Group]:
    """The atoms (``ring_groups``) of a layer group, in the order their first input comes."""
    out, seen = [], set()
    for name in group.inputs:
        atom = atoms[name]
        if atom.index not in seen:
            seen.add(atom.index)
            out.append(atom)
    return out


def pack(sizes: list[int], max_bytes: int) -> list[list[int]]:
    """Indices of ``sizes`` cut into consecutive runs of at most ``max_bytes`` (each size counted
    ALIGN-rounded, as a layout places it); a size alone above ``max_bytes`` is a run of its own."""
    parts: list[list[int]] = []
    size = 0
    for i, n in enumerate(sizes):
        if not parts or (size + n > max_bytes and parts[-1]):
            parts.append([])
            size = 0
        parts[-1].append(i)
        size += -(-n // ALIGN) * ALIGN
    return parts


def layer_groups(plan: RefitPlan, *, by_layer: bool = True) -> list[Group]:
    """The groups ``ring_groups`` starts from: whole layers (``by_layer``), or atoms."""
    return _layer_groups(plan, by_layer=by_layer)


def _layer_groups(plan: RefitPlan, *, by_layer: bool = True) -> list[Group]:
    """Groups of inputs read together: with ``by_layer``, a decoder layer's units are one group."""
    parent: dict[object, object] = {}

    def find(key: object) -> object:
        while parent.setdefault(key, key) != key:
            parent[key] = parent[parent[key]]
            key = parent[key]
        return key

    unit_key: dict[int, object] = {}
    for unit in plan.units:
        key = ("layer", unit.layer) if unit.layer is not None and by_layer else ("unit", unit.index)
        unit_key[unit.index] = key
        for name in unit.inputs:
            a, b = find(key), find(("input", name))
            if a != b:
                parent[b] = a
    members: dict[object, list[str]] = {}
    order: list[object] = []
    specs = {i.name: i for i in plan.inputs}
    for spec in plan.inputs:
        if ("input", spec.name) not in parent:
            raise ValueError(f"input {spec.name!r} is read by no unit of the plan; it cannot be staged")
        root = find(("input", spec.name))
        if root not in members:
            members[root] = []
            order.append(root)
        members[root].append(spec.name)
    units: dict[object, list[int]] = {}
    for index, key in unit_key.items():
        units.setdefault(find(key), []).append(index)
    groups = []
    for gi, root in enumerate(order):
        names = tuple(members[root])
        layout = Layout.build((n, specs[n].dtype, specs[n].shape) for n in names)
        groups.append(Group(gi, _label(root, names), names, tuple(sorted(units[root])), layout))
    return groups


def _label(root: object, names: tuple[str, ...]) -> str:
    kind, value = root  # type: ignore[misc]
    if kind == "layer":
        return f"layer {value[0]}.{value[1]}" if isinstance(value, tuple) else f"layer {value}"
    return names[0] if len(names) == 1 else f"{names[0]} (+{len(names) - 1})"


def balanced_lanes(sizes: list[int], lanes: int) -> list[int]:
    """Each group's lane (GPU), from the groups' staged bytes in plan order: the lane with the
    fewest bytes so far, the lowest index on a tie. Groups alike (a model's layers) go round-robin
    (group ``g`` on lane ``g mod lanes``); unlike ones (layers cut into parts of different sizes,
    an embedding) do not pile onto one GPU: for Qwen3.5-35B-A3B on 8 GPUs the busiest stages
    13.3% of the bytes (round-robin: 16.9%; even: 12.5%). Plan order is kept within each lane, so
    every GPU works through the step from its first layers to its last, as the ranks write it."""
    load = [0] * lanes
    out = []
    for n in sizes:
        lane = min(range(lanes), key=load.__getitem__)
        load[lane] += n
        out.append(lane)
    return out


def lane_regions(regions: int, groups: int, lanes: int = 1) -> int:
    """Regions per lane: ``regions``, but no more than the groups one lane stages (round-robin:
    at most ``ceil(groups / lanes)``); more would sit idle."""
    return min(regions, max(1, -(-groups // lanes)))


def _lane_arena(arenas, lane: int):
    """``arenas[lane]`` for a list of staging arenas (one per GPU), else the one arena (lane 0)."""
    if isinstance(arenas, (list, tuple)):
        return arenas[lane]
    if lane:
        raise ValueError(f"lane {lane} needs the list of staging arenas, got one arena")
    return arenas


def region_size(groups: Iterable[Group]) -> int:
    """The smallest region that holds every group, rounded up to the arena alignment."""
    largest = max((g.nbytes for g in groups), default=0)
    return max(ALIGN, -(-largest // ALIGN) * ALIGN)


@dataclass(slots=True)
class _Grant:
    slot: RingSlot
    complete: set[str] = field(default_factory=set)  # inputs whose bytes are all in
    submitted: int = 0  # units handed to the worker
    done: int = 0  # units reported back
    filled: bool = False


class RingStaging:
    """One daemon's staging ring for a plan: which group owns which region, and when it frees.

    ``start()`` at READY; then ``tensor_complete``/``unit_submitted``/``unit_done`` as the step
    goes; each call that frees a region returns the new ``(group, slot)`` grants to announce.
    ``reset()`` when a step ends early. Raises ValueError (naming sizes) when a region cannot hold
    the plan's largest group.
    """

    def __init__(
        self,
        plan: RefitPlan,
        *,
        regions: int,
        capacity: int,
        max_group_bytes: int | None = None,
        lanes: int = 1,
    ):
        """``lanes``: GPUs the groups are spread over (docs/multi_gpu.md, "Per-GPU work"): each
        group is staged (and quantized) on one lane (:func:`balanced_lanes`: in plan order, the
        lane with the fewest bytes so far; round-robin where groups are alike), each lane a ring
        of its own of ``regions`` regions of one arena of ``capacity`` bytes, granted in plan
        order among its own groups. One lane is the single-GPU (and host) ring."""
        if regions < 1:
            raise ValueError(f"a staging ring needs at least 1 region, got staging_regions={regions}")
        if lanes < 1:
            raise ValueError(f"a staging ring needs at least 1 lane (GPU), got {lanes}")
        self.groups = ring_groups(plan, max_group_bytes)
        self.lanes = lanes
        self._lane_of = balanced_lanes([g.nbytes for g in self.groups], lanes)
        regions = lane_regions(regions, len(self.groups), lanes)  # a region per group at most: more sit idle
        region_bytes = (capacity // regions) // ALIGN * ALIGN
        largest = max(self.groups, key=lambda g: g.nbytes, default=None)
        if largest is not None and largest.nbytes > region_bytes:
            need = region_size(self.groups) * regions
            raise ArenaTooSmall(
                f"the staging arena holds {capacity} bytes: {regions} regions of {region_bytes} bytes, but "
                f"group {largest.label!r} needs {largest.nbytes} bytes in one region; raise staging_bytes "
                f"to at least {need} (or leave it unset so the daemon sizes itself), or use fewer regions"
            )
        self.regions, self.region_bytes = regions, region_bytes
        #: one ring per lane (GPU): a lane whose groups stall holds only its own regions
        self.rings = [StagingRing(regions=regions, region_bytes=region_bytes) for _ in range(lanes)]
        self.ring = self.rings[0]
        self.group_of = {name: g.index for g in self.groups for name in g.inputs}
        self.unit_group = {u: g.index for g in self.groups for u in g.units}
        self.grants: dict[int, _Grant] = {}
        #: (lane, region index) -> the group whose bytes it last held
        self.residents: dict[tuple[int, int], int] = {}

    @property
    def size(self) -> int:
        return self.ring.size

    def wire(self) -> dict[str, int]:
        """READY's ``ring`` field (``arenas``: the staging arenas, one per GPU, when more than one)."""
        wire = {"regions": self.regions, "region_bytes": self.region_bytes, "groups": len(self.groups)}
        if self.lanes > 1:
            wire["arenas"] = self.lanes
        return wire

    def lane_of(self, group: int) -> int:
        """The lane (index into the daemon's GPUs and staging arenas) group ``group`` is placed on."""
        return self._lane_of[group]

    def lane_groups(self, lane: int) -> int:
        """How many groups are placed on ``lane`` (status)."""
        return sum(k == lane for k in self._lane_of)

    def placement(self, name: str) -> tuple[int, ...]:
        """(group, byte offset of tensor ``name`` from its region's start[, its staging arena]):
        the arena only with several lanes, so one GPU's READY is as before."""
        group = self.groups[self.group_of[name]]
        if self.lanes > 1:
            return group.index, group.layout.slots[name].offset, self.lane_of(group.index)
        return group.index, group.layout.slots[name].offset

    def start(self) -> list[tuple[int, RingSlot]]:
        """A new step: every group queued in plan order on its lane; returns each lane's first
        ``regions`` grants."""
        self.reset()
        grants = []
        for g in self.groups:
            slot = self.rings[self.lane_of(g.index)].claim(owner=g.index)
            if slot is not None:
                grants.append(self._granted(slot))
        return grants

    def reset(self) -> None:
        for ring in self.rings:
            ring.reset()
        self.grants.clear()
        self.residents.clear()

    def resident(self, name: str) -> bool:
        """True while some region holds input ``name``'s bytes of the last step (or the current one)."""
        return self.group_of.get(name) in self.residents.values()

    def resident_view(self, arenas, name: str) -> torch.Tensor:
        """Input ``name`` where its group was last staged (``resident(name)`` must hold); ``arenas``:
        the staging arena, or the list of them by lane."""
        gi = self.group_of[name]
        lane, region = next(k for k, g in self.residents.items() if g == gi)
        return self._at(_lane_arena(arenas, lane), self.rings[lane].slots[region].offset, gi, name)

    def granted(self, group: int) -> bool:
        return group in self.grants

    def held(self, lane: int | None = None) -> list[str]:
        """The groups holding a region now (status), of every lane or of ``lane``."""
        return [self.groups[g].label for g in sorted(self.grants) if lane is None or self.lane_of(g) == lane]

    def view(self, arenas, name: str) -> torch.Tensor:
        """Input ``name`` in its group's region; ValueError if that group holds no region now.
        ``arenas``: the staging arena, or the list of them by lane."""
        gi = self.group_of[name]
        grant = self.grants.get(gi)
        if grant is None:
            raise ValueError(
                f"{name!r} belongs to {self.groups[gi].label}, which holds no staging region now"
            )
        return self._at(_lane_arena(arenas, self.lane_of(gi)), grant.slot.offset, gi, name)

    def _at(self, arena, region_offset: int, gi: int, name: str) -> torch.Tensor:
        s = self.groups[gi].layout.slots[name]
        return arena.view(region_offset + s.offset, s.dtype, s.shape)

    def tensor_complete(self, name: str) -> None:
        """Every byte of input ``name`` arrived: its group is FILLED once all its inputs are."""
        gi = self.group_of[name]
        grant = self.grants.get(gi)
        if grant is None:  # a zero-byte input completes at READY; counted again when granted
            return
        grant.complete.add(name)
        self._maybe_fill(gi, grant)

    def unit_submitted(self, unit: int) -> bool:
        """Count a unit handed to the worker; True if it is the group's last (sync after it)."""
        grant = self.grants[self.unit_group[unit]]
        grant.submitted += 1
        return grant.submitted == len(self.groups[self.unit_group[unit]].units)

    def unit_done(self, unit: int) -> list[tuple[int, RingSlot]]:
        """A unit finished; when it was its group's last, free the region and return new grants."""
        gi = self.unit_group[unit]
        grant = self.grants.get(gi)
        if grant is None:
            return []
        grant.done += 1
        if grant.done < len(self.groups[gi].units):
            return []
        if not grant.filled:  # cannot happen: units run on complete inputs; refuse to free early
            raise ValueError(f"{self.groups[gi].label}: every unit ran before its inputs were complete")
        del self.grants[gi]
        ring = self.rings[self.lane_of(gi)]
        return [self._granted(s) for s in ring.release(grant.slot.index, grant.slot.ticket)]

    def preload(self, gi: int, complete: Iterable[str]) -> None:
        """Inputs of a newly granted group that were already complete (zero bytes)."""
        grant = self.grants[gi]
        grant.complete.update(n for n in complete if self.group_of.get(n) == gi)
        self._maybe_fill(gi, grant)

    # ---- internals

    def _granted(self, slot: RingSlot) -> tuple[int, RingSlot]:
        gi = int(slot.owner)
        self.grants[gi] = _Grant(slot)
        self.residents[(self.lane_of(gi), slot.index)] = gi
        return gi, slot

    def _maybe_fill(self, gi: int, grant: _Grant) -> None:
        if not grant.filled and len(grant.complete) == len(self.groups[gi].inputs):
            grant.filled = True
            ring = self.rings[self.lane_of(gi)]
            ring.fill(grant.slot.index, grant.slot.ticket)
            taken = ring.take()  # the only filled region of its lane: fills are taken at once
            if taken is None or taken.index != grant.slot.index:
                raise RingError(
                    f"{self.groups[gi].label}: region {grant.slot.index} filled but not the next taken"
                )
