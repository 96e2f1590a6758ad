"""A plan's units as kernel launches: the seam between the plan and ``sidecar.numerics.kernels``.

The kernels take slabs (``[E, parts * rows, cols]``) and per-expert output tensors; they know nothing
of roles, units or experts. This module arranges a plan unit's outputs in the order a slab launch
writes them (experts in order, gate before up), decides whether a unit can run on the kernels at all,
and lists the launches a plan will make so the daemon can compile them before READY.

Usage::

    from sidecar.plan import launch

    if not launch.try_run_unit(unit, inputs, outputs):  # what sidecar.plan.run.run_unit calls first
        ...  # the torch reference
    done = launch.warm_up(plan, "cuda:0")               # probe + compile, before READY
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from sidecar.numerics import kernels
from sidecar.numerics.kernels import LaunchSpec, WarmUp
from sidecar.numerics.kernels.slab import SlabGeometry, check_slab, prepare_outputs
from sidecar.plan.build import RefitPlan
from sidecar.plan.spec import Role, Unit, UnitKind

__all__ = ["plan_launches", "slab_outs", "try_run_unit", "warm_up"]

log = logging.getLogger("sidecar.numerics.kernels")  # the kernels' logger: one place to turn on


#: slab unit -> output order, by identity: hashing a frozen Unit rehashes its 2E outputs every call
_ORDERS: OrderedDict[int, tuple[Unit, tuple | None]] = OrderedDict()
_ORDERS_SIZE = 1024


def _slab_order(unit: Unit) -> tuple[tuple[tuple[str, str], ...], ...] | None:
    """(weight name, scale name) per expert in order, parts by row offset (gate before up); None if
    the unit's experts are not 0..E-1 with the same number of parts each."""
    hit = _ORDERS.get(id(unit))
    if hit is not None and hit[0] is unit:
        return hit[1]
    by_expert: dict[int, list] = {}
    for o in unit.outputs:
        if o.role is Role.WEIGHT:
            by_expert.setdefault(o.expert, []).append(o)
    experts = sorted(by_expert, key=lambda e: -1 if e is None else e)
    order = None
    if experts == list(range(len(experts))) and len({len(v) for v in by_expert.values()}) <= 1:
        order = tuple(
            tuple(
                (w.name, w.scale_name) for w in sorted(by_expert[e], key=lambda o: o.rows[0] if o.rows else 0)
            )
            for e in experts
        )
    _ORDERS[id(unit)] = (unit, order)
    while len(_ORDERS) > _ORDERS_SIZE:
        _ORDERS.popitem(last=False)
    return order


def slab_outs(unit: Unit, outputs: Mapping[str, torch.Tensor]):
    """(outs, names) for a SLAB unit; None if its outputs are irregular."""
    order = _slab_order(unit)
    if order is None:
        return None
    outs = [[(outputs[w], outputs[s]) for w, s in row] for row in order]
    return outs, [[w for w, _ in row] for row in order]


def try_run_unit(unit: Unit, inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor]) -> bool:
    """Run a quantizing ``unit`` with the kernels when its input is a CUDA tensor; False when the
    caller should use the torch reference instead (passthrough, CPU, no Triton, a buffer the
    kernels cannot write, fp8_per_tensor gate+up from two separate tensors).

    Slab units are one launch each; per-expert units one launch per projection. The outputs are
    checked in full the first time a set of output tensors is seen, then recognised by identity.
    """
    if unit.fmt is None or unit.fmt.four_bit or not unit.inputs:
        return False  # no Triton kernels for the 4-bit formats yet: the reference runs on any device
    if not kernels.available(inputs[unit.inputs[0]].device):
        return False
    if unit.kind is UnitKind.SLAB:
        slab = inputs[unit.inputs[0]]
        arranged = slab_outs(unit, outputs)
        if arranged is None or slab.dim() != 3:
            return False
        jobs = [(slab, *arranged)]
    elif unit.kind in (UnitKind.EXPERT, UnitKind.LINEAR):
        if any(len(g) > 1 for g in unit.scale_groups):
            return False  # one shared scale over two input tensors: the reference does it
        jobs = []
        for o in unit.outputs:
            if o.role is Role.WEIGHT:
                src = inputs[o.source]
                if src.dim() != 2:
                    return False
                jobs.append((src.unsqueeze(0), [[(outputs[o.name], outputs[o.scale_name])]], [[o.name]]))
    else:
        return False
    for slab, outs, names in jobs:
        try:
            check_slab(slab, unit.fmt, len(outs[0]) if outs else 1, names[0][0] if names else "slab")
        except ValueError as err:
            log.debug("unit %s runs on the torch reference: %s", unit.index, err)
            return False
        if prepare_outputs(slab, unit.fmt, outs, lambda names=names: names, strict=False) is None:
            log.debug(
                "unit %s runs on the torch reference: its output buffers do not fit the kernels", unit.index
            )
            return False
    for slab, outs, names in jobs:
        kernels.quantize_slab(slab, unit.fmt, outs, names=names)
    return True


def plan_launches(plan: RefitPlan) -> Iterator[LaunchSpec]:
    """Every launch :func:`try_run_unit` makes for ``plan``'s quantizing units, one per slab or
    per-expert projection (repeats included)."""
    specs = {t.name: t for t in plan.inputs}
    for unit in plan.units:
        if unit.fmt is None or unit.fmt.four_bit or not unit.inputs:
            continue
        if unit.kind is UnitKind.SLAB:
            order = _slab_order(unit)
            src = specs[unit.inputs[0]]
            if order is None or len(src.shape) != 3 or not order or src.shape[1] % len(order[0]):
                continue
            yield LaunchSpec(unit.fmt, src.dtype, SlabGeometry.contiguous(src.shape, len(order[0])))
        elif unit.kind is UnitKind.EXPERT and not any(len(g) > 1 for g in unit.scale_groups):
            for o in unit.outputs:
                src = specs.get(o.source)
                if o.role is Role.WEIGHT and src is not None and len(src.shape) == 2:
                    yield LaunchSpec(unit.fmt, src.dtype, SlabGeometry.contiguous((1, *src.shape), 1))


def warm_up(
    plan: RefitPlan | None, device: torch.device | str, *, compile: Callable[[list], Any] | None = None
) -> WarmUp:
    """:func:`sidecar.numerics.kernels.warm_up` for ``plan``'s launches (``None``: no plan yet, probe only)."""
    return kernels.warm_up(None if plan is None else list(plan_launches(plan)), device, compile=compile)
