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
from sidecar.numerics.formats import Format
from sidecar.numerics.kernels import LaunchSpec, WarmUp
from sidecar.numerics.kernels.fourbit_slab import (
    amax_slab,
    fourbit_problems,
    probe,
    quantize_slab_fourbit,
    supports,
    warm_up_calls,
)
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
    kernels cannot write, fp8_per_tensor gate+up from two separate tensors, an INT4 group that is
    not a power of two). The 4-bit formats go to the 4-bit slab kernels (:func:`_try_run_fourbit`).

    Slab units are one launch each; per-expert units one launch per projection. The outputs are
    checked in full the first time a set of output tensors is seen, then recognised by identity.
    """
    if unit.fmt is None or not unit.inputs:
        return False
    if not kernels.available(inputs[unit.inputs[0]].device):
        return False
    if unit.fmt.four_bit:
        return _try_run_fourbit(unit, inputs, outputs)
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


def _fourbit_jobs(unit: Unit, inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor]):
    """``(jobs, slots)`` for a 4-bit unit: each job ``(slab, outs, names, amax slot)``, where the
    jobs of one NVFP4 scale group share an amax slot (``slots`` of them); None when the unit's shape
    is not one the kernels take (the reference then runs it)."""
    weights = {o.name: o for o in unit.outputs if o.role is Role.WEIGHT}

    def bufs(name: str) -> tuple[torch.Tensor, ...]:
        return tuple(outputs[n] for n in weights[name].quantized_outputs)

    if unit.kind is UnitKind.SLAB:
        slab, order = inputs[unit.inputs[0]], _slab_order(unit)
        if order is None or slab.dim() != 3:
            return None
        names = [[w for w, _ in row] for row in order]
        # NVFP4: one global scale per expert over all its parts (gate + up), as the amax pass computes
        if unit.fmt is Format.NVFP4 and {frozenset(g) for g in unit.scale_groups} != {
            frozenset(row) for row in names
        }:
            return None
        return [(slab, [[bufs(w) for w in row] for row in names], names, 0)], len(names)
    if unit.kind not in (UnitKind.EXPERT, UnitKind.LINEAR):
        return None
    jobs = []
    for slot, group in enumerate(unit.scale_groups):
        for name in group:
            view = weights[name].source_view(inputs[weights[name].source])
            if view.dim() != 2:
                return None
            jobs.append((view.unsqueeze(0), [[bufs(name)]], [[name]], slot))
    return (jobs, len(unit.scale_groups)) if jobs else None


def _try_run_fourbit(
    unit: Unit, inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor]
) -> bool:
    """The 4-bit formats on the kernels (``sidecar.numerics.kernels.fourbit_slab``): one launch per
    slab or projection, plus NVFP4's global amax pass (one per slab, one per member of a per-expert
    gate + up pair, both into the pair's int32 of scratch). Every job is checked before the first
    launch, so a unit the kernels cannot take runs whole on the reference."""
    made = _fourbit_jobs(unit, inputs, outputs)
    if made is None:
        log.debug(
            "unit %s runs on the torch reference: its 4-bit layout does not fit the kernels", unit.index
        )
        return False
    jobs, slots = made
    for slab, outs, names, _ in jobs:
        problems = fourbit_problems(slab, unit.fmt, outs, names, unit.params)
        if problems:
            log.debug("unit %s runs on the torch reference: %s", unit.index, problems[0])
            return False
    device = jobs[0][0].device
    if probe(device, unit.fmt, unit.params) is not None:  # said once in the log
        return False
    flags = kernels.flags_in_use()
    with kernels.device_scope(device):
        amax = None
        if unit.fmt is Format.NVFP4:
            amax = kernels.scratch(device, slots)[:slots]
            amax.zero_()
            for slab, _, _, slot in jobs:
                amax_slab(slab, amax[slot : slot + slab.shape[0]])
        for slab, outs, names, slot in jobs:
            quantize_slab_fourbit(
                slab,
                unit.fmt,
                outs,
                names=names,
                params=unit.params,
                amax=None if amax is None else amax[slot : slot + slab.shape[0]],
                flags=flags,
            )
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
    """:func:`sidecar.numerics.kernels.warm_up` for ``plan``'s launches (``None``: no plan yet, probe only).

    A 4-bit plan's kernels are probed for its format and parameters too (compiled and checked on a
    tiny slab: :func:`sidecar.numerics.kernels.fourbit_slab.probe`), so that status and metrics say
    before READY whether the kernels or the torch reference quantize, and the distinct
    specialisations of its launches are compiled (:func:`_warm_up_fourbit`)."""
    done = kernels.warm_up(None if plan is None else list(plan_launches(plan)), device, compile=compile)
    fmt = None if plan is None else plan.spec.fmt
    if done.impl == "triton" and fmt is not None and fmt.four_bit:
        reason = probe(device, fmt, plan.spec.params)
        if reason is not None:
            return WarmUp(done.device, "torch", reason, done.compiled, done.seconds)
        done.compiled += _warm_up_fourbit(plan, device, compile)
    return done


def _fourbit_launches(plan: RefitPlan) -> Iterator[tuple[torch.dtype, tuple[int, int, int], int]]:
    """(dtype, slab shape, parts) of every 4-bit launch :func:`_try_run_fourbit` makes for ``plan``."""
    specs = {t.name: t for t in plan.inputs}
    for unit in plan.units:
        if unit.fmt is None or not unit.fmt.four_bit or not unit.inputs:
            continue
        if unit.kind is UnitKind.SLAB:
            order, src = _slab_order(unit), specs[unit.inputs[0]]
            if order and len(src.shape) == 3 and not src.shape[1] % len(order[0]):
                yield src.dtype, tuple(src.shape), len(order[0])
        elif unit.kind in (UnitKind.EXPERT, UnitKind.LINEAR):
            for o in unit.outputs:
                src = specs.get(o.source)
                if o.role is Role.WEIGHT and src is not None and len(src.shape) == 2 and o.rows is None:
                    yield src.dtype, (1, *src.shape), 1


def _warm_up_fourbit(
    plan: RefitPlan, device: torch.device | str, compile: Callable[[list], Any] | None
) -> int:
    """Compile the distinct specialisations of a 4-bit plan's launches on ``device`` before READY
    (else the first step compiles each); how many. A failure is logged and left to the first step."""
    fmt, params = plan.spec.fmt, plan.spec.params
    if supports(fmt, params) is not None:
        return 0
    from sidecar.numerics.kernels import triton_quant

    compile = compile or triton_quant.compile_only
    seen: dict[tuple, Any] = {}
    for dtype, shape, parts in dict.fromkeys(_fourbit_launches(plan)):
        for call in warm_up_calls(fmt, params, dtype, shape, parts):
            args = tuple(kernels._int_traits(a) if isinstance(a, int) else str(a) for a in call.args)
            seen.setdefault((call.kernel.fn.__name__, args, tuple(sorted(call.kwargs.items()))), call)
    try:
        with kernels.device_scope(device):
            for call in seen.values():
                compile([call])
    except Exception as err:  # the probe passed: the first step compiles (and reports) instead
        log.warning(
            "compiling the %s kernels before READY failed: %s: %s", fmt.value, type(err).__name__, err
        )
        return 0
    return len(seen)
