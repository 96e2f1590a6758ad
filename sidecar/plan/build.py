"""The refit plan: what a published generation holds, worked out from names and shapes alone (SPEC §2).

A plan never touches weights. From the input tensors (name, dtype, shape) and a :class:`RefitSpec`
it classifies every input (a routed-expert slab, one expert's projection, or anything else), applies
the BF16 exclusions of §2.2, validates the routed experts (§2.3; every problem in one error) and cuts
the work into **units**: the inputs one piece of work reads and the outputs it writes. The daemon
allocates every output from the plan up front (in shared memory), then runs each unit with
:func:`sidecar.plan.run.run_unit` as soon as its inputs have arrived; ``sidecar.plan.run.convert``
and ``iter_convert`` are the in-process forms of the same loop. The spec and plan-data types live in
``sidecar.plan.spec`` (re-exported here: the plan's vocabulary in one import), the classification of
inputs and its checks in ``sidecar.plan.classify``.

Beyond the routed experts, a block-FP8 checkpoint's linears (DeepSeek-V3: attention projections,
dense MLPs, shared experts; ``ModelSpec.linear_re``) become ``LINEAR`` units when
``RefitSpec.quantize_linears`` (or the config's ``quantization_config``) says so. Every input keeps
its own dtype (the FP32 router bias passes through as FP32). ``share=(EngineLayout, node)`` plans
the part one node of a multi-node engine holds.

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

from sidecar.numerics.formats import DEFAULT_FORMAT_PARAMS, FP8_DTYPE, Format, FormatParams, Nvfp4Names
from sidecar.plan.classify import (
    Routed,
    check_experts,
    check_quantizable,
    check_slabs,
    classify,
    raise_problems,
)
from sidecar.plan.models import ExpertForm, get_model, model_type_of
from sidecar.plan.models.registry import checkpoint_dtype
from sidecar.plan.spec import (
    _APPENDED_MTP_RE,
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
    _layer_in,
    _module_name,
    layer_of_name,
)

__all__ = [
    "EngineLayout",
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
    "quantize_linears_of",
    "with_checkpoint_scheme",
]

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------------
# units


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


#: formats whose gate_proj and up_proj of one expert share a scale (SPEC §2.3): per-tensor FP8's
#: scale, NVFP4's global scale
_SHARED_SCALE_FORMATS = (Format.FP8_PER_TENSOR, Format.NVFP4)


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
) -> list[Unit]:
    """Units in input order; a unit reading two inputs sits where the first of them is."""
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
    #: a node's share: the engine layout and the node this plan publishes for (None: the whole model)
    share: tuple[EngineLayout, int] | None = None
    #: inputs outside the node's share: per-expert tensors of other nodes' experts, not planned
    dropped: frozenset[str] = frozenset()
    #: every input given to :meth:`build`, the dropped ones included: what a re-plan of the same
    #: share starts from (the attach check re-plans for an engine's BF16 modules)
    source: tuple[TensorSpec, ...] = ()
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
        share: tuple[EngineLayout, int] | None = None,
    ) -> RefitPlan:
        """Plan a refit of ``specs`` (TensorSpec, ``(name, shape, dtype)`` or ``(name, tensor)``).

        Each input keeps its own dtype: a non-BF16 input that is not quantized (the FP32 router bias)
        passes through bit for bit, and staging and wire sizes follow it. ``keep_bf16`` are module
        names the engine's manifest holds in BF16 (the tensor name without ``.weight``; a slab's own
        name); a routed expert or linear listed there passes through whatever else the spec says.
        ``share=(layout, node)`` plans only what ``node`` of an :class:`EngineLayout` holds: routed
        experts outside its expert-parallel share are left out (per-expert inputs are ``dropped``,
        slabs publish only the node's experts). Raises ValueError listing every problem found.
        """
        inputs = source = tuple(TensorSpec.coerce(s) for s in specs)
        dupes = sorted(n for n, c in Counter(i.name for i in inputs).items() if c > 1)
        if dupes:
            raise ValueError(f"input names must be unique; repeated: {dupes}")
        fmt, model = spec.format, spec.model
        keep = frozenset(_module_name(n) for n in keep_bf16)
        num_layers = cls._resolve_layers(inputs, spec)
        layers = {i.name: _layer_in(i.name, model, num_layers) for i in inputs}

        routed = {i.name: r for i in inputs if (r := classify(i, model, layers[i.name])) is not None}
        reasons = {n: cls._keep_reason(n, r.layer, spec, num_layers, keep) for n, r in routed.items()}
        candidates = {
            i.name: i
            for i in inputs
            if spec.quantize_linears
            and model.linear_re is not None
            and i.name not in routed
            and len(i.shape) == 2
            and model.linear_re.match(i.name)
        }
        linears = {
            n: t
            for n, t in candidates.items()
            if cls._keep_reason(n, layers[n], spec, num_layers, keep) is None
        }
        _validate(routed, reasons, fmt, linears, spec.params)
        held, dropped = None, frozenset()
        if share is not None:
            held, dropped = _node_share(routed, *share)
            inputs = tuple(i for i in inputs if i.name not in dropped)
        units = _make_units(inputs, routed, reasons, fmt, layers, linears, held, spec)
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
            share=share,
            dropped=dropped,
            source=source,
        )

    @staticmethod
    def _resolve_layers(inputs: tuple[TensorSpec, ...], spec: RefitSpec) -> int:
        seen = [lay for i in inputs if isinstance(lay := layer_of_name(i.name), int)]
        if spec.model.mtp_in_layers:  # MTP layers follow the decoder layers: the first holds eh_proj
            mtp = [int(m.group(1)) for i in inputs if (m := _APPENDED_MTP_RE.search(i.name))]
            if spec.num_hidden_layers is None and mtp:
                seen = [lay for lay in seen if lay < min(mtp)]
            elif spec.num_hidden_layers is not None:
                seen = [lay for lay in seen if lay < spec.num_hidden_layers]
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
    def _keep_reason(
        name: str, layer: Layer, spec: RefitSpec, num_layers: int, keep: frozenset[str]
    ) -> KeepReason | None:
        module = _module_name(name)
        if spec.format is Format.BF16:
            return KeepReason.FORMAT_BF16
        if module in keep:
            return KeepReason.MANIFEST
        if isinstance(layer, int):  # MTP layers are not counted by first/last
            if layer < spec.num_first_layers_in_bf16:
                return KeepReason.FIRST_LAYERS
            if layer >= num_layers - spec.num_last_layers_in_bf16:
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

    def rebuild_for(self, specs: Iterable[TensorSpec | tuple[Any, ...]]) -> RefitPlan | None:
        """This plan for other inputs that publish exactly its outputs, or None when they do not.

        A plan made from a config lists the checkpoint's inputs: per-expert names (Qwen3, DeepSeek-V3,
        GLM-4.5) in the checkpoint's dtype. A trainer may push the same model otherwise: transformers
        5.x holds the routed experts fused (``mlp.experts.gate_up_proj [E, 2I, H]`` and
        ``down_proj [E, H, I]``), an FP32 master holds FP32 tensors. When ``specs`` plan to the very
        same outputs (names, dtypes, shapes), the plan for them is returned, its outputs in this
        plan's order: a generation laid out for this plan holds it unchanged. ``self`` when ``specs``
        are this plan's inputs; None when they publish anything else (or do not plan at all): the
        caller reports what differs, against this plan.
        """
        specs = tuple(TensorSpec.coerce(s) for s in specs)
        if set(specs) == set(self.source or self.inputs):
            return self
        try:
            other = RefitPlan.build(specs, self.spec, keep_bf16=self.keep_bf16, share=self.share)
        except ValueError:
            return None
        mine = {o.name: o for o in self.outputs}
        theirs = {o.name: o for o in other.outputs}
        if mine.keys() != theirs.keys() or any(
            (o.dtype, o.shape) != (mine[n].dtype, mine[n].shape) for n, o in theirs.items()
        ):
            return None
        return dataclasses.replace(other, outputs=tuple(theirs[o.name] for o in self.outputs))

    def allocate(self, *, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """An empty tensor for every output, in plan order (tests and the CPU path; the daemon
        allocates these in shared memory itself)."""
        return {o.name: torch.empty(o.shape, dtype=o.dtype, device=device) for o in self.outputs}


# --------------------------------------------------------------------------------------------------
# from a Hugging Face config


#: the block shape of refitd's block_fp8, as a checkpoint's quantization_config writes it
CHECKPOINT_BLOCK = [128, 128]


def quantize_linears_of(config: Mapping[str, Any]) -> tuple[bool, tuple[str, ...]]:
    """What a checkpoint's own ``quantization_config`` says: ``(True, modules_to_not_convert)`` for a
    block-FP8 checkpoint (``quant_method: fp8`` with ``weight_block_size``), else ``(False, ())``."""
    model = get_model(model_type_of(config))
    q = config.get("quantization_config")
    if q is None:
        q = model.text_config(config).get("quantization_config")
    if not isinstance(q, Mapping) or q.get("quant_method") != "fp8" or not q.get("weight_block_size"):
        return False, ()
    block = list(q["weight_block_size"])
    if block != CHECKPOINT_BLOCK:
        raise ValueError(
            f"the config's quantization_config has weight_block_size {block}; refitd's block_fp8 is "
            f"{CHECKPOINT_BLOCK}: set RefitSpec.quantize_linears explicitly to plan anyway"
        )
    skip = q.get("modules_to_not_convert") or q.get("ignored_layers") or ()
    return True, tuple(str(m) for m in skip)


def with_checkpoint_scheme(spec: RefitSpec, config: Mapping[str, Any]) -> RefitSpec:
    """``spec`` with what the checkpoint says filled in where it is unset: ``quantize_linears`` from
    its ``quantization_config`` (and its ``modules_to_not_convert`` added to the ignore patterns),
    ``dtype`` from its ``dtype``/``torch_dtype`` (passthroughs are published in it). The daemon
    resolves its spec with this once, so every plan it builds (from the config, from a step's
    declarations, at attach) follows the same scheme."""
    if spec.dtype is None and (dtype := checkpoint_dtype(config)) is not None:
        spec = dataclasses.replace(spec, dtype=dtype)
    if spec.quantize_linears is not None:
        return spec
    follow, skip = quantize_linears_of(config)
    if not follow or spec.model.linear_re is None:
        return dataclasses.replace(spec, quantize_linears=False)
    ignore = tuple(spec.ignore_patterns) + tuple(p for p in skip if p not in spec.ignore_patterns)
    return dataclasses.replace(spec, quantize_linears=True, ignore_patterns=ignore)


def plan_from_hf_config(
    config: Mapping[str, Any],
    spec: RefitSpec,
    *,
    keep_bf16: Collection[str] = (),
    include_vision: bool = False,
    share: tuple[EngineLayout, int] | None = None,
) -> RefitPlan:
    """Plan a refit of the model ``config`` (a ``config.json`` dict) describes, without weights.

    The layer count comes from the config (MTP layers not counted), not from the names. With
    ``spec.quantize_linears`` unset, the checkpoint's ``quantization_config`` decides whether the
    registry's linear layers are quantized too (and its ``modules_to_not_convert`` stay BF16).
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
    spec = with_checkpoint_scheme(dataclasses.replace(spec, num_hidden_layers=layers), config)
    params = model.parameters(config, include_vision=include_vision)
    return RefitPlan.build(params, spec, keep_bf16=keep_bf16, share=share)


def meta_state_dict(
    config: Mapping[str, Any],
    *,
    include_mtp: bool = True,
    include_vision: bool = False,
    experts: ExpertForm | str | None = None,
) -> dict[str, torch.Tensor]:
    """Every parameter of the model ``config`` describes as a meta tensor (shape and dtype, no data);
    ``experts="fused"`` lists the routed experts as transformers 5.x modules hold them."""
    model = get_model(model_type_of(config))
    params = model.parameters(config, include_mtp=include_mtp, include_vision=include_vision, experts=experts)
    return {name: torch.empty(shape, dtype=dtype, device="meta") for name, shape, dtype in params}
