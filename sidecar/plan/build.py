"""The refit plan: what a published generation holds, worked out from names and shapes alone (SPEC §2).

A plan never touches weights. From the input tensors (name, dtype, shape) and a :class:`RefitSpec`
it classifies every input (a routed-expert slab, one expert's projection, or anything else), applies
the BF16 exclusions of §2.2, validates the routed experts (§2.3; every problem in one error) and cuts
the work into **units**: the inputs one piece of work reads and the outputs it writes. The daemon
allocates every output from the plan up front (in shared memory), then runs each unit with
:func:`sidecar.plan.run.run_unit` as soon as its inputs have arrived; ``sidecar.plan.run.convert``
and ``iter_convert`` are the in-process forms of the same loop. The spec and plan-data types live in
``sidecar.plan.spec`` (re-exported here: the plan's vocabulary in one import), the classification of
inputs and its checks in ``sidecar.plan.classify``, what each input publishes in ``sidecar.plan.outputs``,
the units in ``sidecar.plan.units``, the :class:`RefitPlan` class in ``sidecar.plan.refit_plan``
(re-exported here); this module makes plans from a Hugging Face config.

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
from collections.abc import Collection, Mapping
from typing import Any

import torch

from sidecar.plan.models import ExpertForm, get_model, model_type_of
from sidecar.plan.models.registry import checkpoint_dtype
from sidecar.plan.refit_plan import RefitPlan
from sidecar.plan.spec import (
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
