"""The plan's units of work: the classified inputs cut into passthrough, linear, expert and slab units,
each reading its inputs and writing its outputs; the routed experts' checks (every problem in one
error); and a multi-node engine's share of the routed experts."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Mapping

import torch

from sidecar.numerics.formats import DEFAULT_FORMAT_PARAMS, Format, FormatParams
from sidecar.plan.classify import Routed, check_experts, check_quantizable, check_slabs, raise_problems
from sidecar.plan.outputs import _SHARED_SCALE_FORMATS, _slab_outputs, _slab_split_outputs, _weight_and_scale
from sidecar.plan.spec import (
    WEIGHT_SUFFIX,
    EngineLayout,
    ExpertProj,
    KeepReason,
    Layer,
    OutputSpec,
    RefitSpec,
    Role,
    TensorSpec,
    Unit,
    UnitKind,
)


def _passthrough_unit(
    index: int, inp: TensorSpec, reason: KeepReason | None, layer: Layer, dtype: torch.dtype
) -> Unit:
    """One input published as it is, in ``dtype`` (RefitSpec.published_dtype: the checkpoint's)."""
    out = OutputSpec(
        name=inp.name,
        dtype=dtype,
        shape=inp.shape,
        nbytes=inp.numel * dtype.itemsize,
        role=Role.PASSTHROUGH,
        source=inp.name,
    )
    return Unit(
        index=index,
        kind=UnitKind.PASSTHROUGH,
        inputs=(inp.name,),
        outputs=(out,),
        layer=layer,
        bytes_in=inp.nbytes,
        keep_reason=reason,
    )


def _linear_unit(index: int, inp: TensorSpec, fmt: Format, layer: Layer, params: FormatParams) -> Unit:
    """A non-expert linear weight ``[out, in]`` quantized on its own (its own scale in every format)."""
    outputs = _weight_and_scale(inp.name, (inp.shape[0], inp.shape[1]), fmt, inp.name, params)
    return Unit(
        index=index,
        kind=UnitKind.LINEAR,
        inputs=(inp.name,),
        outputs=outputs,
        layer=layer,
        bytes_in=inp.nbytes,
        fmt=fmt,
        scale_groups=((outputs[0].name,),),
        params=params,
    )


def _expert_unit(index: int, members: list[Routed], fmt: Format, params: FormatParams) -> Unit:
    outputs: list[OutputSpec] = []
    names: list[str] = []
    for r in members:
        shape = (r.spec.shape[0], r.spec.shape[1])
        made = _weight_and_scale(r.spec.name, shape, fmt, r.spec.name, params, proj=ExpertProj(r.proj))
        outputs += made
        names.append(made[0].name)
    names = tuple(names)
    inputs = tuple(r.spec.name for r in members)
    return Unit(
        index=index,
        kind=UnitKind.EXPERT,
        inputs=inputs,
        outputs=tuple(outputs),
        layer=members[0].layer,
        bytes_in=sum(r.spec.nbytes for r in members),
        fmt=fmt,
        scale_groups=(names,) if len(names) > 1 else ((names[0],),),
        params=params,
    )


def _validate(
    routed: dict[str, Routed],
    reasons: dict[str, KeepReason | None],
    fmt: Format,
    linears: Mapping[str, TensorSpec] | None = None,
    params: FormatParams = DEFAULT_FORMAT_PARAMS,
) -> None:
    """Every structural problem of the routed experts, and every format problem of those to be
    quantized, raised together."""
    slabs: dict[str, dict[str, Routed]] = defaultdict(dict)
    experts: dict[tuple[str, int], dict[str, Routed]] = defaultdict(dict)
    for r in routed.values():
        if r.expert is None:
            slabs[r.prefix][r.proj] = r
        else:
            experts[(r.prefix, r.expert)][r.proj] = r
    problems: list[str] = []
    check_slabs(slabs, problems)
    check_experts(experts, problems)
    for name, r in routed.items():
        if reasons[name] is None:
            check_quantizable(r.spec, fmt, problems, params)
    for t in (linears or {}).values():
        check_quantizable(t, fmt, problems, params)
    raise_problems(problems)


def _make_units(
    inputs: tuple[TensorSpec, ...],
    routed: dict[str, Routed],
    reasons: dict[str, KeepReason | None],
    fmt: Format,
    layers: Mapping[str, Layer],
    linears: Collection[str] = (),
    held: Mapping[str, range] | None = None,
    spec: RefitSpec | None = None,
    split_slabs: bool = False,
) -> list[Unit]:
    """Units in input order; a unit reading two inputs sits where the first of them is.
    ``split_slabs``: a slab kept unquantized is published per expert (:func:`_slab_split_outputs`)
    rather than as the slab."""
    params = DEFAULT_FORMAT_PARAMS if spec is None else spec.params
    units: list[Unit] = []
    done: set[str] = set()
    for inp in inputs:
        if inp.name in done:
            continue
        r = routed.get(inp.name)
        if inp.name in linears:
            units.append(_linear_unit(len(units), inp, fmt, layers[inp.name], params))
            done.add(inp.name)
        elif split_slabs and r is not None and r.expert is None and reasons[inp.name] is not None:
            dtype = inp.dtype if spec is None else spec.published_dtype(inp.name, inp.dtype)
            outs = _slab_split_outputs(r, dtype, None if held is None else held[r.prefix])
            units.append(
                Unit(
                    index=len(units),
                    kind=UnitKind.PASSTHROUGH,
                    inputs=(inp.name,),
                    outputs=tuple(outs),
                    layer=r.layer,
                    bytes_in=inp.nbytes,
                    keep_reason=reasons[inp.name],
                )
            )
            done.add(inp.name)
        elif r is None or reasons[inp.name] is not None:
            dtype = inp.dtype if spec is None else spec.published_dtype(inp.name, inp.dtype)
            units.append(_passthrough_unit(len(units), inp, reasons.get(inp.name), layers[inp.name], dtype))
            done.add(inp.name)
        elif r.expert is None:
            outs, groups = _slab_outputs(r, fmt, params, None if held is None else held[r.prefix])
            units.append(
                Unit(
                    index=len(units),
                    kind=UnitKind.SLAB,
                    inputs=(inp.name,),
                    outputs=tuple(outs),
                    layer=r.layer,
                    bytes_in=inp.nbytes,
                    fmt=fmt,
                    scale_groups=tuple(groups),
                    params=params,
                )
            )
            done.add(inp.name)
        else:
            members = [r]
            if fmt in _SHARED_SCALE_FORMATS and r.proj != ExpertProj.DOWN.value:
                # gate and up of one expert share one scale: one unit reads both (those quantized)
                partners = (
                    f"{r.prefix}.{r.expert}.{p.value}{WEIGHT_SUFFIX}"
                    for p in (ExpertProj.GATE, ExpertProj.UP)
                )
                members = [routed[n] for n in partners if reasons[n] is None]
            units.append(_expert_unit(len(units), members, fmt, params))
            done.update(m.spec.name for m in members)
    return units


def _node_share(
    routed: Mapping[str, Routed], layout: EngineLayout, node: int
) -> tuple[dict[str, range], frozenset[str]]:
    """Each routed prefix's experts held on ``node``, and the per-expert inputs outside them."""
    layout.check_node(node)
    counts: dict[str, int] = defaultdict(int)
    for r in routed.values():
        n = r.spec.shape[0] if r.expert is None and r.spec.shape else (r.expert or 0) + 1
        counts[r.prefix] = max(counts[r.prefix], n)
    held = {prefix: layout.experts_of_node(n, node) for prefix, n in counts.items()}
    dropped = frozenset(
        n for n, r in routed.items() if r.expert is not None and r.expert not in held[r.prefix]
    )
    return held, dropped
