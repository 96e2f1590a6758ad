"""Running a plan: :func:`run_unit` into caller buffers, and the in-process :func:`convert` /
:func:`iter_convert`."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from sidecar.numerics import cpu
from sidecar.numerics.formats import DEFAULT_FORMAT_PARAMS, Format, FormatParams, Nvfp4Names
from sidecar.plan import reuse
from sidecar.plan.build import EngineLayout, OutputSpec, RefitPlan, RefitSpec, Role, TensorSpec, Unit
from sidecar.plan.launch import try_run_unit

__all__ = ["convert", "iter_convert", "run_passthroughs", "run_quantized_units", "run_unit"]

# --------------------------------------------------------------------------------------------------
# running units


def _quantize_groups(
    fmt: Format,
    groups: Sequence[tuple[OutputSpec, ...]],
    inputs: Mapping[str, torch.Tensor],
    outputs: Mapping[str, torch.Tensor],
    params: FormatParams = DEFAULT_FORMAT_PARAMS,
    units: Sequence[Unit] = (),
) -> None:
    """Quantize a unit's scale groups (a slab's experts: gate and up share a group): the shared scales
    of every group as one split across the threads, then every projection's kernel as another
    (``cpu.run_prepared``), rather than one hand-off to the threads per projection. ``units``: the
    units the groups are of, whose kernel calls are kept for their next run on the same buffers
    (sidecar.plan.reuse)."""
    key = reuse.key_of(units, inputs, outputs) if units else None
    if reuse.run_again(key, outputs):
        return
    views = [[w.source_view(inputs[w.source]) for w in group] for group in groups]
    label = [" + ".join(w.name for w in group) for group in groups]
    ran: list[cpu.Prepared] = []  # a group pipeline's call, if one ran
    if fmt is Format.NVFP4:  # one global scale over a group (an expert's gate and up)
        _nvfp4_groups(groups, views, label, outputs, params, ran)
        reciprocal = params.nvfp4_names is Nvfp4Names.COMPRESSED_TENSORS
        targets = [[(w.quantized_outputs[2], reciprocal) for w in group] for group in groups]
        reuse.remember(
            key, units, ran, scale_fills=[(n, g, r) for g, ts in enumerate(targets) for n, r in ts]
        )
        return
    if fmt is Format.FP8_PER_TENSOR:  # a group's scale reads every member (and names them all)
        # a scale passed in clamps, which a tensor's own scale makes a no-op (reference.py): same bytes
        jobs = []
        for group, vs, name in zip(groups, views, label, strict=True):
            jobs.append(
                (vs, [(outputs[w.name], outputs[w.scale_name]) for w in group], [w.name for w in group], name)
            )
        cpu.quantize_fp8_per_tensor_groups(jobs, ran)
        fills = [(w.scale_name, g, False) for g, group in enumerate(groups) for w in group]
        reuse.remember(key, units, ran, scale_fills=fills)
        return
    calls: list[cpu.Prepared] = []
    fills: list[tuple[str, torch.Tensor]] = []  # what the kept calls leave to do: INT4's weight_shape
    # INT4 in the engine's group and scale dtype
    int4 = {"group": params.int4_group, "scale_dtype": params.int4_scale_torch_dtype}
    for group, vs in zip(groups, views, strict=True):
        for w, view in zip(group, vs, strict=True):
            out = tuple(outputs[n] for n in (w.quantized_outputs if fmt.four_bit else (w.name, w.scale_name)))
            if fmt is Format.INT4_W4A16:
                calls.append(cpu.prepare_int4(view, out=out, name=w.name, **int4))  # type: ignore[arg-type]
                fills.append((w.quantized_outputs[2], torch.tensor(view.shape[-2:], dtype=torch.int64)))
            else:
                calls.append(cpu.prepare(view, fmt, out=out, name=w.name))
    cpu.run_prepared(calls)
    reuse.remember(key, units, calls, fills)


def _nvfp4_groups(
    groups: Sequence[tuple[OutputSpec, ...]],
    views: list[list[torch.Tensor]],
    label: list[str],
    outputs: Mapping[str, torch.Tensor],
    params: FormatParams,
    ran: list[cpu.Prepared],
) -> None:
    """NVFP4's groups through ``cpu.quantize_nvfp4_groups`` (``ran``: its pipeline's call, if one ran);
    under compressed-tensors' names the published ``weight_global_scale`` is float32(1 / gs) (SPEC §2.3),
    written after."""
    reciprocal = params.nvfp4_names is Nvfp4Names.COMPRESSED_TENSORS
    jobs, extras = [], []
    for group, vs, name in zip(groups, views, label, strict=True):
        outs = []
        for w in group:
            q, s, extra = (outputs[n] for n in w.quantized_outputs)
            if reciprocal:  # the kernel's own copy of gs goes elsewhere
                extras.append((extra, len(jobs)))
                extra = torch.empty((), dtype=torch.float32)
            outs.append((q, s, extra))
        jobs.append((vs, outs, [w.name for w in group], name))
    scales = cpu.quantize_nvfp4_groups(jobs, ran)
    for extra, k in extras:
        extra.copy_(torch.reciprocal(scales[k]).reshape(extra.shape))


def run_unit(unit: Unit, inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor]) -> None:
    """Compute ``unit`` into the caller's ``outputs`` (a buffer for each of the unit's outputs).

    This is how the daemon writes straight into shared memory. Slab experts are views of the slab,
    never copies; each projection goes through ``sidecar.numerics.cpu`` (the native CPU kernels,
    else the torch reference) with ``out=`` and ``name=`` set to its checkpoint name. A passthrough
    is copied bit for bit (nothing is done if the output buffer already is the input's memory: an
    input written straight into the generation).
    """
    lacking = [n for n in unit.inputs if n not in inputs]
    lacking += [o.name for o in unit.outputs if o.name not in outputs]
    if lacking:
        raise ValueError(f"unit {unit.index} ({unit.kind.value}) cannot run: no tensor for {lacking}")
    if try_run_unit(unit, inputs, outputs):  # CUDA tensors with Triton: one launch per slab
        return
    if unit.fmt is None:
        for o in unit.outputs:
            src, dst = o.source_view(inputs[o.source]), outputs[o.name]  # a kept slab: one expert's rows
            if dst.dtype != o.dtype or tuple(src.shape) != tuple(dst.shape):
                raise ValueError(
                    f"passthrough {o.name!r}: the input is {src.dtype} {tuple(src.shape)} but its output "
                    f"buffer is {dst.dtype} {tuple(dst.shape)} (the plan publishes {o.dtype}); allocate "
                    "outputs from the plan"
                )
            if not _same_memory(src, dst):
                dst.copy_(src)  # in the published dtype (RefitSpec.published_dtype): round to nearest even
        return
    weights = {o.name: o for o in unit.outputs if o.role is Role.WEIGHT}
    groups = [tuple(weights[n] for n in group) for group in unit.scale_groups]
    _quantize_groups(unit.fmt, groups, inputs, outputs, unit.params, (unit,))


def run_quantized_units(
    units: Sequence[Unit],
    inputs: Sequence[Mapping[str, torch.Tensor]],
    outputs: Sequence[Mapping[str, torch.Tensor]],
) -> bool:
    """:func:`run_unit` for several quantizing units of one format on the CPU (``inputs[k]`` /
    ``outputs[k]`` are unit k's): every scale group of every unit as one split across the quantizer
    threads per pass, rather than a hand-off or two per unit (per-expert models: a unit is one expert's
    gate and up, a few MiB).

    Returns False, having run nothing, when the units do not all qualify (another format or
    parameters, a tensor off the CPU, a missing buffer): :func:`run_unit` on each then runs them and
    names the problem. An error while running (NaN, a mismatched buffer) is raised without saying which
    unit: run them one by one to report it against its unit.
    """
    if not units or any(u.fmt is None or u.fmt != units[0].fmt or u.params != units[0].params for u in units):
        return False
    merged_in: dict[str, torch.Tensor] = {}
    merged_out: dict[str, torch.Tensor] = {}
    groups: list[tuple[OutputSpec, ...]] = []
    for unit, ins, outs in zip(units, inputs, outputs, strict=True):
        if any(n not in ins or ins[n].device.type != "cpu" for n in unit.inputs) or any(
            o.name not in outs or outs[o.name].device.type != "cpu" for o in unit.outputs
        ):
            return False
        merged_in.update((n, ins[n]) for n in unit.inputs)
        merged_out.update((o.name, outs[o.name]) for o in unit.outputs)
        weights = {o.name: o for o in unit.outputs if o.role is Role.WEIGHT}
        groups.extend(tuple(weights[n] for n in group) for group in unit.scale_groups)
    _quantize_groups(units[0].fmt, groups, merged_in, merged_out, units[0].params, units)  # type: ignore[arg-type]
    return True


def run_passthroughs(
    units: Sequence[Unit],
    inputs: Sequence[Mapping[str, torch.Tensor]],
    outputs: Sequence[Mapping[str, torch.Tensor]],
) -> bool:
    """:func:`run_unit` for many passthrough units at once (``inputs[k]``/``outputs[k]`` are unit
    k's), with one foreach copy: for many small tensors, where torch's per-call cost dominates.

    Returns False, having copied nothing, when any unit is not a plain passthrough whose buffers
    match: :func:`run_unit` on each then does the work and names the problem.
    """
    srcs, dsts = [], []
    for unit, ins, outs in zip(units, inputs, outputs, strict=True):
        if unit.fmt is not None:
            return False
        for o in unit.outputs:
            src, dst = ins.get(o.source), outs.get(o.name)
            if src is None or dst is None or src.dtype != dst.dtype or src.shape != dst.shape:
                return False
            if src.device != dst.device:
                return False
            if not _same_memory(src, dst):
                srcs.append(src)
                dsts.append(dst)
    if srcs:
        torch._foreach_copy_(dsts, srcs)
    return True


def _same_memory(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """``dst`` is ``src``'s very bytes (an input written straight into its output: nothing to copy)."""
    return dst is src or (
        dst.data_ptr() == src.data_ptr()
        and dst.dtype == src.dtype
        and dst.device == src.device
        and dst.stride() == src.stride()
        and dst.shape == src.shape
    )


def _run_allocating(unit: Unit, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Run ``unit`` into fresh tensors on its input's device; a passthrough returns its input."""
    if unit.fmt is None:  # the input itself, or its cast to the published dtype
        return {o.name: o.source_view(tensors[o.source]).to(o.dtype) for o in unit.outputs}
    device = tensors[unit.inputs[0]].device
    out = {o.name: torch.empty(o.shape, dtype=o.dtype, device=device) for o in unit.outputs}
    run_unit(unit, tensors, out)
    return out


# --------------------------------------------------------------------------------------------------
# in-process conversion


def _pairs(named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]):
    return named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors


def convert(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    spec: RefitSpec,
    *,
    keep_bf16: Collection[str] = (),
    share: tuple[EngineLayout, int] | None = None,
) -> dict[str, torch.Tensor]:
    """Convert a whole state dict; returns every output in plan order.

    Passthrough outputs are the input tensors themselves (aliases, not copies): clone them if the
    source will be modified while the result is in use. ``share=(layout, node)`` converts only what
    that node publishes (``RefitPlan.build``); the inputs it drops are not read.
    """
    tensors = dict(_pairs(named_tensors))
    plan = RefitPlan.build(list(tensors.items()), spec, keep_bf16=keep_bf16, share=share)
    out: dict[str, torch.Tensor] = {}
    for unit in plan.units:
        out.update(_run_allocating(unit, tensors))
    return {o.name: out[o.name] for o in plan.outputs}


def iter_convert(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    spec: RefitSpec,
    *,
    specs: Iterable[TensorSpec | tuple[Any, ...]] | None = None,
    keep_bf16: Collection[str] = (),
) -> Iterator[tuple[str, torch.Tensor]]:
    """Convert tensors as they arrive, in any order, yielding each unit's outputs once its inputs
    are all in (layer by layer, as the trainer sends them); an input is dropped once used.

    ``specs`` lists every input (TensorSpec or ``(name, shape, dtype)``) up front: that is what tells
    which inputs make a unit. Without it the whole input is read into a list first, and nothing is
    streamed. Passthrough outputs are the input tensors themselves. After the last input, raises a
    ValueError naming inputs that never arrived and arrivals that were not in ``specs``.
    """
    source: Iterable[tuple[str, torch.Tensor]] = named_tensors
    if specs is None:
        source = list(named_tensors)
        specs = source
    plan = RefitPlan.build(specs, spec, keep_bf16=keep_bf16)
    expected = {i.name: i for i in plan.inputs}
    waiting = {u.index: set(u.inputs) for u in plan.units}
    held: dict[str, torch.Tensor] = {}
    arrived: set[str] = set()
    unknown: list[str] = []
    for name, tensor in source:
        want = expected.get(name)
        if want is None:
            unknown.append(name)
            continue
        if name in arrived:
            raise ValueError(f"input {name!r} arrived twice; send each tensor once per step")
        if tensor.dtype != want.dtype or tuple(tensor.shape) != want.shape:
            raise ValueError(
                f"input {name!r} arrived as {tensor.dtype} {tuple(tensor.shape)} but the plan expects "
                f"{want.dtype} {want.shape}; rebuild the plan from the trainer's real shapes"
            )
        arrived.add(name)
        held[name] = tensor
        for unit in plan.units_for_input(name):
            waiting[unit.index].discard(name)
            if waiting[unit.index]:
                continue
            outputs = _run_allocating(unit, held)
            for n in unit.inputs:
                if all(not waiting[u.index] for u in plan.units_for_input(n)):
                    held.pop(n, None)
            yield from outputs.items()
    missing = [i.name for i in plan.inputs if i.name not in arrived]
    if missing or unknown:
        parts = []
        if missing:
            parts.append(f"{len(missing)} input(s) never arrived: {missing[:10]}")
        if unknown:
            parts.append(f"{len(unknown)} input(s) arrived that are not in the plan: {unknown[:10]}")
        raise ValueError("; ".join(parts) + " (the trainer and the plan disagree on the state dict)")
