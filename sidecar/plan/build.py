"""The refit plan: what a published generation holds, worked out from names and shapes alone (SPEC §2).

A plan never touches weights. From the input tensors (name, dtype, shape) and a :class:`RefitSpec`
it classifies every input (a routed-expert slab, one expert's projection, or anything else), applies
the BF16 exclusions of §2.2, validates the routed experts (§2.3; every problem in one error) and cuts
the work into **units**: the inputs one piece of work reads and the outputs it writes. The daemon
allocates every output from the plan up front (in shared memory), then runs each unit with
:func:`sidecar.plan.run.run_unit` as soon as its inputs have arrived; ``sidecar.plan.run.convert``
and ``iter_convert`` are the in-process forms of the same loop. The spec and plan-data types live in
``sidecar.plan.spec`` and are re-exported here, the plan's vocabulary in one import.

Usage::

    spec = RefitSpec(model_type="qwen3_5_moe", fmt="block_fp8", num_last_layers_in_bf16=1)
    plan = RefitPlan.build(specs, spec, keep_bf16=manifest_bf16_modules)
    outputs = plan.allocate()                       # or buffers in shared memory
    for unit in plan.units:                         # in any order, as inputs complete
        run_unit(unit, inputs, outputs)
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
from collections import Counter, defaultdict
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from sidecar.numerics.formats import FLOAT_DTYPES, FP8_DTYPE, MX_BLOCK, Format
from sidecar.plan.models import ModelSpec, get_model, model_type_of
from sidecar.plan.spec import (
    WEIGHT_SUFFIX,
    ExpertProj,
    KeepReason,
    Layer,
    OutputSpec,
    RefitSpec,
    Role,
    TensorSpec,
    Unit,
    UnitKind,
    _module_name,
    layer_of_name,
)

__all__ = [
    "ExpertProj",
    "KeepReason",
    "Layer",
    "OutputSpec",
    "RefitPlan",
    "RefitSpec",
    "Role",
    "TensorSpec",
    "Unit",
    "UnitKind",
    "layer_of_name",
    "meta_state_dict",
    "plan_from_hf_config",
]

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------
# classification and validation


@dataclass(frozen=True, slots=True)
class _Routed:
    """A routed-expert input: a slab (``expert`` None) or one expert's projection."""

    spec: TensorSpec
    prefix: str
    proj: str  # gate_up_proj | down_proj | gate_proj | up_proj
    expert: int | None
    layer: Layer


def _classify(inp: TensorSpec, model: ModelSpec) -> _Routed | None:
    if model.slab_re is not None and (m := model.slab_re.match(inp.name)):
        return _Routed(inp, m.group("prefix"), m.group("proj"), None, layer_of_name(inp.name))
    if m := model.per_expert_re.match(inp.name):
        expert = int(m.group("expert"))
        return _Routed(inp, m.group("prefix"), m.group("proj"), expert, layer_of_name(inp.name))
    return None


def _check_slabs(slabs: dict[str, dict[str, _Routed]], problems: list[str]) -> None:
    """SPEC §2.3: 3-D slabs, even 2I, and a layer's gate_up/down agreeing on E, H and I."""
    for prefix, pair in slabs.items():
        for r in pair.values():
            if len(r.spec.shape) != 3:
                problems.append(f"{r.spec.name}: shape {r.spec.shape} is not 3-D [E, rows, cols]")
        gu, down = pair.get("gate_up_proj"), pair.get("down_proj")
        if gu is None or down is None:
            have, lack = ("gate_up_proj", "down_proj") if down is None else ("down_proj", "gate_up_proj")
            problems.append(f"{prefix}.{have}: no partner slab {prefix}.{lack} in the inputs")
        if gu is not None and len(gu.spec.shape) == 3 and gu.spec.shape[1] % 2:
            problems.append(f"{gu.spec.name}: shape {gu.spec.shape} has an odd 2I = {gu.spec.shape[1]}")
        if gu is None or down is None or len(gu.spec.shape) != 3 or len(down.spec.shape) != 3:
            continue
        (e1, two_i, h1), (e2, h2, i2) = gu.spec.shape, down.spec.shape
        for what, a, b in (("E", e1, e2), ("H", h1, h2), ("I", two_i // 2, i2)):
            if a != b:
                problems.append(
                    f"{gu.spec.name} {gu.spec.shape} and {down.spec.name} {down.spec.shape} disagree "
                    f"on {what} ({a} vs {b})"
                )


def _check_experts(experts: dict[tuple[str, int], dict[str, _Routed]], problems: list[str]) -> None:
    """Per-expert gate/up ``[I, H]`` and down ``[H, I]``: all three present and consistent."""
    for (prefix, e), projs in experts.items():
        for r in projs.values():
            if len(r.spec.shape) != 2:
                problems.append(f"{r.spec.name}: shape {r.spec.shape} is not 2-D [out, in]")
        lacking = [p.value for p in ExpertProj if p.value not in projs]
        if lacking:
            problems.append(f"{prefix}.{e}: expert has no {', '.join(lacking)} in the inputs")
            continue
        gate, up, down = (projs[p.value].spec for p in ExpertProj)
        if any(len(s.shape) != 2 for s in (gate, up, down)):
            continue
        if gate.shape != up.shape:
            problems.append(f"{gate.name} {gate.shape} and {up.name} {up.shape} differ in shape")
        if down.shape != gate.shape[::-1]:
            problems.append(f"{down.name} {down.shape} is not the transpose of {gate.name} {gate.shape}")


def _check_quantizable(r: _Routed, fmt: Format, problems: list[str]) -> None:
    if r.spec.dtype not in FLOAT_DTYPES:
        problems.append(f"{r.spec.name}: dtype {r.spec.dtype} cannot be quantized (bf16/fp16/fp32 only)")
    if fmt is Format.MXFP8 and r.spec.shape and r.spec.shape[-1] % MX_BLOCK:
        problems.append(
            f"{r.spec.name}: mxfp8 needs the input dim to be a multiple of {MX_BLOCK}, got "
            f"{r.spec.shape[-1]}; keep it in bf16 (ignore_patterns) or use block_fp8"
        )


def _raise_problems(problems: list[str]) -> None:
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ValueError(f"{len(problems)} problem(s) in the refit inputs; fix the trainer export:\n{lines}")


# --------------------------------------------------------------------------------------------------
# units


def _weight_and_scale(
    name: str, shape: tuple[int, int], fmt: Format, source: str, **where: Any
) -> tuple[OutputSpec, OutputSpec]:
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


def _slab_outputs(r: _Routed, fmt: Format) -> tuple[list[OutputSpec], list[tuple[str, ...]]]:
    """One slab split per expert: gate rows [0, I) and up rows [I, 2I) of gate_up, or down."""
    outputs: list[OutputSpec] = []
    groups: list[tuple[str, ...]] = []
    num_experts, rows, cols = r.spec.shape
    if r.proj == "gate_up_proj":
        i = rows // 2
        parts = ((ExpertProj.GATE, (0, i)), (ExpertProj.UP, (i, rows)))
    else:
        i = rows
        parts = ((ExpertProj.DOWN, None),)
    for e in range(num_experts):
        names = []
        for proj, span in parts:
            name = f"{r.prefix}.{e}.{proj.value}{WEIGHT_SUFFIX}"
            outputs += _weight_and_scale(name, (i, cols), fmt, r.spec.name, expert=e, rows=span, proj=proj)
            names.append(name)
        groups += [tuple(names)] if fmt is Format.FP8_PER_TENSOR else [(n,) for n in names]
    return outputs, groups


def _passthrough_unit(index: int, inp: TensorSpec, reason: KeepReason | None) -> Unit:
    out = OutputSpec(
        name=inp.name,
        dtype=inp.dtype,
        shape=inp.shape,
        nbytes=inp.nbytes,
        role=Role.PASSTHROUGH,
        source=inp.name,
    )
    return Unit(
        index=index,
        kind=UnitKind.PASSTHROUGH,
        inputs=(inp.name,),
        outputs=(out,),
        layer=layer_of_name(inp.name),
        bytes_in=inp.nbytes,
        keep_reason=reason,
    )


def _expert_unit(index: int, members: list[_Routed], fmt: Format) -> Unit:
    outputs: list[OutputSpec] = []
    for r in members:
        shape = (r.spec.shape[0], r.spec.shape[1])
        outputs += _weight_and_scale(r.spec.name, shape, fmt, r.spec.name, proj=ExpertProj(r.proj))
    names = tuple(r.spec.name for r in members)
    return Unit(
        index=index,
        kind=UnitKind.EXPERT,
        inputs=names,
        outputs=tuple(outputs),
        layer=members[0].layer,
        bytes_in=sum(r.spec.nbytes for r in members),
        fmt=fmt,
        scale_groups=(names,) if len(names) > 1 else ((names[0],),),
    )


def _validate(routed: dict[str, _Routed], reasons: dict[str, KeepReason | None], fmt: Format) -> None:
    """Every structural problem of the routed experts, and every format problem of those to be
    quantized, raised together."""
    slabs: dict[str, dict[str, _Routed]] = defaultdict(dict)
    experts: dict[tuple[str, int], dict[str, _Routed]] = defaultdict(dict)
    for r in routed.values():
        if r.expert is None:
            slabs[r.prefix][r.proj] = r
        else:
            experts[(r.prefix, r.expert)][r.proj] = r
    problems: list[str] = []
    _check_slabs(slabs, problems)
    _check_experts(experts, problems)
    for name, r in routed.items():
        if reasons[name] is None:
            _check_quantizable(r, fmt, problems)
    _raise_problems(problems)


def _make_units(
    inputs: tuple[TensorSpec, ...],
    routed: dict[str, _Routed],
    reasons: dict[str, KeepReason | None],
    fmt: Format,
) -> list[Unit]:
    """Units in input order; a unit reading two inputs sits where the first of them is."""
    units: list[Unit] = []
    done: set[str] = set()
    for inp in inputs:
        if inp.name in done:
            continue
        r = routed.get(inp.name)
        if r is None or reasons[inp.name] is not None:
            units.append(_passthrough_unit(len(units), inp, reasons.get(inp.name)))
            done.add(inp.name)
        elif r.expert is None:
            outs, groups = _slab_outputs(r, fmt)
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
                )
            )
            done.add(inp.name)
        else:
            members = [r]
            if fmt is Format.FP8_PER_TENSOR and r.proj != ExpertProj.DOWN.value:
                # gate and up of one expert share one scale: one unit reads both (those quantized)
                partners = (
                    f"{r.prefix}.{r.expert}.{p.value}{WEIGHT_SUFFIX}"
                    for p in (ExpertProj.GATE, ExpertProj.UP)
                )
                members = [routed[n] for n in partners if reasons[n] is None]
            units.append(_expert_unit(len(units), members, fmt))
            done.update(m.spec.name for m in members)
    return units


# --------------------------------------------------------------------------------------------------
# the plan


@dataclass(frozen=True, slots=True, kw_only=True)
class RefitPlan:
    """Every input, every unit of work and every output of one refit, in a deterministic order.

    ``outputs`` follow input order, then expert order, then gate/up/down, each weight before its
    scale. Build with :meth:`build`; a plan is immutable and holds no tensors.
    """

    spec: RefitSpec
    num_hidden_layers: int
    inputs: tuple[TensorSpec, ...]
    units: tuple[Unit, ...]
    outputs: tuple[OutputSpec, ...]
    keep_bf16: frozenset[str]
    _units_of_input: Mapping[str, tuple[int, ...]]
    #: ``units_for_input``'s answers, made once (the daemon asks for every input of every step)
    _input_units: Mapping[str, tuple[Unit, ...]] = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "_input_units",
            {n: tuple(self.units[i] for i in ix) for n, ix in self._units_of_input.items()},
        )

    @classmethod
    def build(
        cls,
        specs: Iterable[TensorSpec | tuple[Any, ...]],
        spec: RefitSpec,
        *,
        keep_bf16: Collection[str] = (),
    ) -> RefitPlan:
        """Plan a refit of ``specs`` (TensorSpec, ``(name, shape, dtype)`` or ``(name, tensor)``).

        ``keep_bf16`` are module names the engine's manifest holds in BF16 (the tensor name without
        ``.weight``; a slab's own name); a routed expert listed there passes through whatever else
        the spec says. Raises ValueError listing every problem found in the inputs.
        """
        inputs = tuple(TensorSpec.coerce(s) for s in specs)
        dupes = sorted(n for n, c in Counter(i.name for i in inputs).items() if c > 1)
        if dupes:
            raise ValueError(f"input names must be unique; repeated: {dupes}")
        fmt, model = spec.format, spec.model
        keep = frozenset(_module_name(n) for n in keep_bf16)
        num_layers = cls._resolve_layers(inputs, spec)

        routed = {i.name: r for i in inputs if (r := _classify(i, model)) is not None}
        reasons = {n: cls._keep_reason(r, spec, num_layers, keep) for n, r in routed.items()}
        _validate(routed, reasons, fmt)
        units = _make_units(inputs, routed, reasons, fmt)
        outputs = tuple(o for u in units for o in u.outputs)
        clashes = sorted(n for n, c in Counter(o.name for o in outputs).items() if c > 1)
        if clashes:
            raise ValueError(
                f"two inputs produce the same output names {clashes[:5]}: a layer holds both grouped "
                "slabs and per-expert tensors; send one form only"
            )
        log.debug(
            "refit plan %s/%s: %d inputs -> %d units -> %d outputs (%d layers)",
            spec.model_type,
            fmt.value,
            len(inputs),
            len(units),
            len(outputs),
            num_layers,
        )
        units_of: dict[str, list[int]] = defaultdict(list)
        for u in units:
            for n in u.inputs:
                units_of[n].append(u.index)
        return cls(
            spec=spec,
            num_hidden_layers=num_layers,
            inputs=inputs,
            units=tuple(units),
            outputs=outputs,
            keep_bf16=keep,
            _units_of_input={n: tuple(ix) for n, ix in units_of.items()},
        )

    @staticmethod
    def _resolve_layers(inputs: tuple[TensorSpec, ...], spec: RefitSpec) -> int:
        seen = [lay for i in inputs if isinstance(lay := layer_of_name(i.name), int)]
        if spec.num_hidden_layers is None:
            num_layers = max(seen) + 1 if seen else 0
            spec.check_layer_counts(num_layers)
            return num_layers
        if seen and max(seen) >= spec.num_hidden_layers:
            raise ValueError(
                f"an input names layer {max(seen)} but num_hidden_layers is {spec.num_hidden_layers}; "
                "give the model's real layer count (or None to infer it from the names)"
            )
        return spec.num_hidden_layers

    @staticmethod
    def _keep_reason(r: _Routed, spec: RefitSpec, num_layers: int, keep: frozenset[str]) -> KeepReason | None:
        module = _module_name(r.spec.name)
        if spec.format is Format.BF16:
            return KeepReason.FORMAT_BF16
        if module in keep:
            return KeepReason.MANIFEST
        if isinstance(r.layer, int):  # MTP layers are not counted by first/last
            if r.layer < spec.num_first_layers_in_bf16:
                return KeepReason.FIRST_LAYERS
            if r.layer >= num_layers - spec.num_last_layers_in_bf16:
                return KeepReason.LAST_LAYERS
        if any(fnmatch.fnmatchcase(module, p) for p in spec.ignore_patterns):
            return KeepReason.IGNORE_PATTERN
        return None

    # ---- queries

    @property
    def bytes_in(self) -> int:
        return sum(i.nbytes for i in self.inputs)

    @property
    def bytes_out(self) -> int:
        return sum(o.nbytes for o in self.outputs)

    def layer_of(self, unit: Unit) -> Layer:
        """The unit's layer: an int, ("mtp", n) for an MTP layer, or None outside any layer."""
        return unit.layer

    def units_for_input(self, name: str) -> tuple[Unit, ...]:
        """The units that read input ``name`` (one, for every input of the Qwen families)."""
        units = self._input_units.get(name)
        if units is None:
            raise ValueError(f"no input named {name!r} in this plan")
        return units

    def allocate(self, *, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """An empty tensor for every output, in plan order (tests and the CPU path; the daemon
        allocates these in shared memory itself)."""
        return {o.name: torch.empty(o.shape, dtype=o.dtype, device=device) for o in self.outputs}


# --------------------------------------------------------------------------------------------------
# from a Hugging Face config


def plan_from_hf_config(
    config: Mapping[str, Any],
    spec: RefitSpec,
    *,
    keep_bf16: Collection[str] = (),
    include_vision: bool = False,
) -> RefitPlan:
    """Plan a refit of the model ``config`` (a ``config.json`` dict) describes, without weights.

    The layer count comes from the config (MTP layers not counted), not from the names.
    """
    model = get_model(model_type_of(config))
    if model.model_type != spec.model.model_type:
        raise ValueError(
            f"the config describes a {model.model_type} model but the spec says {spec.model_type}; "
            "make them agree"
        )
    layers = model.num_hidden_layers(config)
    if spec.num_hidden_layers not in (None, layers):
        raise ValueError(
            f"spec.num_hidden_layers = {spec.num_hidden_layers} but the config has {layers} layers; "
            "leave it None to take the config's"
        )
    spec = dataclasses.replace(spec, num_hidden_layers=layers)
    params = model.parameters(config, include_vision=include_vision)
    return RefitPlan.build(params, spec, keep_bf16=keep_bf16)


def meta_state_dict(
    config: Mapping[str, Any], *, include_mtp: bool = True, include_vision: bool = False
) -> dict[str, torch.Tensor]:
    """Every parameter of the model ``config`` describes as a meta tensor (shape and dtype, no data)."""
    model = get_model(model_type_of(config))
    params = model.parameters(config, include_mtp=include_mtp, include_vision=include_vision)
    return {name: torch.empty(shape, dtype=dtype, device="meta") for name, shape, dtype in params}
