"""What one planned input publishes (SPEC §2.3): the output tensors a quantized weight becomes (values,
scale, a 4-bit format's third output) with their names, dtypes, shapes and sizes, and the per-expert
split of a grouped slab."""

from __future__ import annotations

from typing import Any

import torch

from sidecar.numerics.formats import FP8_DTYPE, Format, FormatParams, Nvfp4Names
from sidecar.plan.classify import Routed
from sidecar.plan.spec import (
    WEIGHT_SUFFIX,
    ExpertProj,
    OutputSpec,
    Role,
    _module_name,
)


def _output(
    name: str, dtype: torch.dtype, shape: tuple[int, ...], role: Role, source: str, **where: Any
) -> OutputSpec:
    numel = 1
    for d in shape:
        numel *= d
    return OutputSpec(
        name=name, dtype=dtype, shape=shape, nbytes=numel * dtype.itemsize, role=role, source=source, **where
    )


#: a 4-bit weight's third output (SPEC §2.3): its dtype and shape. NVFP4's global scale is ModelOpt's
#: 0-d ``weight_scale_2``, or under compressed-tensors' names ``weight_global_scale`` ``[1]``, as
#: compressed-tensors makes it (its ``initialize_qparams``: a one-element tensor per module)
_EXTRA_OUTPUT = {
    (Format.NVFP4, Nvfp4Names.MODELOPT): (torch.float32, ()),
    (Format.NVFP4, Nvfp4Names.COMPRESSED_TENSORS): (torch.float32, (1,)),
    (Format.INT4_W4A16, None): (torch.int64, (2,)),
}


def _extra_output(fmt: Format, params: FormatParams) -> tuple[str, torch.dtype, tuple[int, ...]] | None:
    if fmt is Format.NVFP4:
        return (params.global_scale_leaf(), *_EXTRA_OUTPUT[(fmt, params.nvfp4_names)])
    if fmt is Format.INT4_W4A16:
        return ("weight_shape", *_EXTRA_OUTPUT[(fmt, None)])
    return None


def _four_bit_outputs(
    name: str, shape: tuple[int, int], fmt: Format, params: FormatParams, source: str, **where: Any
) -> tuple[OutputSpec, ...]:
    """SPEC §2.3's names for a 4-bit weight: packed values (``.weight`` for NVFP4 under ModelOpt's
    names; ``.weight_packed`` for compressed-tensors' MXFP4, INT4 and NVFP4), ``.weight_scale``, and
    NVFP4's ``.weight_scale_2`` (``.weight_global_scale``) or INT4's ``.weight_shape``; INT4's scales
    per ``params.int4_group`` in ``params.int4_scale_dtype``."""
    module = _module_name(name)
    scale_name = f"{module}.{fmt.scale_suffix}"
    extra = _extra_output(fmt, params)
    extra_name = None if extra is None else f"{module}.{extra[0]}"
    weight = _output(
        f"{module}.{params.weight_suffix(fmt)}",
        fmt.weight_dtype,
        fmt.weight_shape(shape),
        Role.WEIGHT,
        source,
        scale_name=scale_name,
        extra_name=extra_name,
        **where,
    )
    scale_dtype, scale_shape = params.scale_dtype(fmt), params.scale_shape(fmt, shape)
    outputs = [weight, _output(scale_name, scale_dtype, scale_shape, Role.SCALE, source, **where)]
    if extra is not None:
        outputs.append(_output(extra_name, extra[1], extra[2], Role.SCALE, source, **where))
    return tuple(outputs)


def _weight_and_scale(
    name: str, shape: tuple[int, int], fmt: Format, source: str, params: FormatParams, **where: Any
) -> tuple[OutputSpec, ...]:
    if fmt.four_bit:
        return _four_bit_outputs(name, shape, fmt, params, source, **where)
    scale_name = f"{_module_name(name)}.{fmt.scale_suffix}"
    scale_shape = fmt.scale_shape(shape)
    numel = shape[0] * shape[1]
    weight = OutputSpec(
        name=name,
        dtype=FP8_DTYPE,
        shape=shape,
        nbytes=numel * FP8_DTYPE.itemsize,
        role=Role.WEIGHT,
        source=source,
        scale_name=scale_name,
        **where,
    )
    scale_numel = 1
    for d in scale_shape:
        scale_numel *= d
    scale = OutputSpec(
        name=scale_name,
        dtype=fmt.scale_dtype,
        shape=scale_shape,
        nbytes=scale_numel * fmt.scale_dtype.itemsize,
        role=Role.SCALE,
        source=source,
        **where,
    )
    return weight, scale


def _slab_outputs(
    r: Routed, fmt: Format, params: FormatParams, held: range | None = None
) -> tuple[list[OutputSpec], list[tuple[str, ...]]]:
    """One slab split per expert: gate rows [0, I) and up rows [I, 2I) of gate_up, or down; only
    the experts in ``held`` (a node's share) when given."""
    outputs: list[OutputSpec] = []
    groups: list[tuple[str, ...]] = []
    num_experts, rows, cols = r.spec.shape
    if r.proj == "gate_up_proj":
        i = rows // 2
        parts = ((ExpertProj.GATE, (0, i)), (ExpertProj.UP, (i, rows)))
    else:
        i = rows
        parts = ((ExpertProj.DOWN, None),)
    for e in range(num_experts) if held is None else held:
        names = []
        for proj, span in parts:
            name = f"{r.prefix}.{e}.{proj.value}{WEIGHT_SUFFIX}"
            made = _weight_and_scale(
                name, (i, cols), fmt, r.spec.name, params, expert=e, rows=span, proj=proj
            )
            outputs += made
            names.append(made[0].name)
        groups += [tuple(names)] if fmt in _SHARED_SCALE_FORMATS else [(n,) for n in names]
    return outputs, groups


def _slab_split_outputs(r: Routed, dtype: torch.dtype, held: range | None = None) -> list[OutputSpec]:
    """A slab kept unquantized, published per expert under the checkpoint's names (gate rows
    [0, I) and up rows [I, 2I) of gate_up, or down), each a view of the slab copied as it is: what a
    plan made from a config lists when a trainer pushes transformers 5's fused experts in BF16."""
    num_experts, rows, cols = r.spec.shape
    if r.proj == "gate_up_proj":
        i = rows // 2
        parts = ((ExpertProj.GATE, (0, i)), (ExpertProj.UP, (i, rows)))
    else:
        i = rows
        parts = ((ExpertProj.DOWN, None),)
    return [
        _output(
            f"{r.prefix}.{e}.{proj.value}{WEIGHT_SUFFIX}",
            dtype,
            (i, cols),
            Role.PASSTHROUGH,
            r.spec.name,
            expert=e,
            rows=span,
            proj=proj,
        )
        for e in (range(num_experts) if held is None else held)
        for proj, span in parts
    ]


#: formats whose gate_proj and up_proj of one expert share a scale (SPEC §2.3): per-tensor FP8's
#: scale, NVFP4's global scale
_SHARED_SCALE_FORMATS = (Format.FP8_PER_TENSOR, Format.NVFP4)
