"""Inputs whose bytes the generation holds unchanged, written there directly: no staging copy.

A passthrough (an attention weight, a norm, a routed expert kept in BF16) is published bit for bit.
When the generation's layout holds an input's bytes in one contiguous run, in the input's own order
(a whole tensor under its own name, or a BF16 expert slab whose per-expert ``gate_proj``/``up_proj``
/ ``down_proj`` outputs lie back to back), the step's data can land there straight away, from a
local rank's copy or a remote rank's frames, instead of in staging and then copied again by the
worker. That copy was a second pass over every passthrough byte, run while the ranks were still
writing and contending with them for memory bandwidth (bench/ingest.py, "local ingest").

This module only finds those inputs, from names and shapes: :func:`direct_offsets`. The serve loop
decides per step whether to use them (the target generation is claimed before READY, the arenas are
host shared memory, staging is not a ring, no rank is pulled over NIXL); the worker's passthrough
then finds its output already is its input and copies nothing (``sidecar.plan.run``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from sidecar.plan.build import RefitPlan
from transport.layout import Layout

__all__ = ["direct_offsets"]


def direct_offsets(plan: RefitPlan, outputs: Layout) -> dict[str, int]:
    """``{input name: byte offset in a generation}`` of every input the generation holds verbatim.

    An input qualifies when every unit reading it is a passthrough and its outputs, each a
    contiguous part of the input of the input's dtype, tile it exactly and sit in ``outputs`` at
    the same distances from one another as in the input. The offset is where the input's first
    byte goes; writing the input's bytes there writes every one of its outputs.
    """
    slots: Mapping[str, object] = outputs.slots
    by_source: dict[str, list] = {}
    quantized: set[str] = set()
    for unit in plan.units:
        if unit.fmt is not None:
            quantized.update(unit.inputs)
            continue
        for o in unit.outputs:
            by_source.setdefault(o.source, []).append(o)
    found: dict[str, int] = {}
    for spec in plan.inputs:
        outs = by_source.get(spec.name)
        if not outs or spec.name in quantized or spec.numel == 0:
            continue
        base = _tiling_base(spec, outs, slots)
        if base is not None:
            found[spec.name] = base
    return found


def _tiling_base(spec, outs, slots) -> int | None:
    """The generation offset of ``spec``'s first byte if ``outs`` lay it out verbatim, else None."""
    meta = torch.empty(spec.shape, dtype=spec.dtype, device="meta")
    item = spec.dtype.itemsize
    runs = []
    for o in outs:
        slot = slots.get(o.name)
        if slot is None or o.dtype != spec.dtype or slot.dtype != spec.dtype:
            return None
        view = o.source_view(meta)
        if tuple(view.shape) != tuple(slot.shape) or not view.is_contiguous():
            return None
        runs.append((view.storage_offset(), view.numel(), slot.offset))
    runs.sort()
    base = runs[0][2] - runs[0][0] * item
    expect = 0
    for start, numel, offset in runs:
        if start != expect or offset != base + start * item:
            return None  # a gap, an overlap, or outputs not back to back in the generation
        expect = start + numel
    if expect != spec.numel or base < 0:
        return None
    return base
