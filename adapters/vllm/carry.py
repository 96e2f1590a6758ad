"""NVFP4 W4A4's static activation scales, carried over from the engine into every reload (pure torch).

vLLM 0.33.0's ``ModelOptNvFp4FusedMoE`` holds ``w13_input_scale [E, 2]`` / ``w2_input_scale [E]`` at
load time; refitd publishes none (SPEC §2.3), and a layerwise reload that loads no value for them
re-materializes them uninitialised and processes the layer with that. So every reload is given,
per expert, the checkpoint tensors ``{moe}.{e}.{gate|up|down}_proj.input_scale`` that make vLLM's
``process_weights_after_loading`` reproduce the activation scale the engine holds now, read from its
current (processed) parameters. What processing makes of them (``oracle/nvfp4.py
convert_to_nvfp4_moe_kernel_format``) decides the inverse:

* EMULATION: ``1 / max(input_scale)``, a 0-d float32: every expert gets the float32 ``v`` with
  ``1 / v == held`` exactly (checked; the reciprocal is tried, then its neighbours);
* the FlashInfer / CUTLASS / CuteDSL / b12x paths: the maximum over the experts (or per expert),
  repeated ``[E]`` (or 0-d): every expert gets its held value, whose maximum is itself;
* Marlin (W4A16) and other activation-unquantized paths ignore the scale; the held value (or 1.0)
  is given so that nothing is left uninitialised.

The MTP drafter (``get_draft_model()``) holds its own NVFP4 MoE layers with their own activation
scales; :func:`draft_checkpoint_namer` names them as its ``load_weights`` takes them from the
generation (DeepSeek ``model.layers.N.mtp_block.mlp.experts`` <- ``model.layers.N.mlp.experts``,
Qwen3.5 ``model.layers.0.mlp.experts`` <- ``mtp.layers.0.mlp.experts``).

compressed-tensors NVFP4 W4A4 (``CompressedTensorsW4A4Nvfp4MoEMethod`` without ``use_a16``) holds
the reciprocal, ``input_global_scale``; ``adapters.vllm.ct_carry`` inverts its processing, and the
carried tensors are ``{moe}.{e}.{gate|up|down}_proj.input_global_scale``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from adapters.scales import exact_reciprocal_preimage
from adapters.vllm.checkpoint import _draft_checkpoint_name, checkpoint_name
from adapters.vllm.compressed_nvfp4 import CT_NVFP4_MOE_METHOD, INPUT_GLOBAL_SCALE
from adapters.vllm.ct_carry import carried_global_scales
from sidecar.plan.models import get_model, model_type_of, normalize_hf_config

NVFP4_MOE_METHOD = "ModelOptNvFp4FusedMoE"
#: vLLM's NVFP4 MoE backends whose processing stores ``1 / max(input_scale)`` (oracle/nvfp4.py)
RECIPROCAL_BACKENDS = frozenset({"EMULATION"})


def _per_expert(held: torch.Tensor | None, experts: int, backend: str) -> torch.Tensor:
    """``[E]`` float32 load-time input scales reproducing ``held`` under ``backend``'s processing."""
    if held is None or held.numel() == 0:
        return torch.ones(experts, dtype=torch.float32)
    held = held.detach().to("cpu", torch.float32)
    if backend in RECIPROCAL_BACKENDS:
        return exact_reciprocal_preimage(held.reshape(-1)[:1]).expand(experts).clone()
    flat = held.reshape(-1)
    if flat.numel() == 1:
        return flat.expand(experts).clone()
    if flat.numel() == experts:
        return flat.clone()
    if held.dim() == 2 and held.shape[0] == experts:  # [E, 2]: gate and up's, the maximum taken
        return held.amax(dim=1)
    raise ValueError(f"an NVFP4 MoE input scale of shape {tuple(held.shape)} for {experts} experts")


def _backend_name(method: Any) -> str:
    backend = getattr(method, "nvfp4_backend", None)
    return str(getattr(backend, "name", backend or ""))


def _global_ids(module: torch.nn.Module, experts: int) -> list[int]:
    """The checkpoint expert index of each local expert: vLLM's ``expert_map`` (global -> local,
    -1 elsewhere) under expert parallelism, else the identity."""
    expert_map = getattr(module, "expert_map", None)
    if expert_map is None:
        return list(range(experts))
    local = {int(loc): g for g, loc in enumerate(expert_map.tolist()) if int(loc) >= 0}
    return [local[e] for e in range(experts)]


def draft_checkpoint_namer(hf_config: Mapping[str, Any]) -> Callable[[str], str]:
    """The drafter's engine module name -> the checkpoint name its ``load_weights`` reads (the
    mapping ``build_manifest`` lists the drafter's parameters under)."""
    in_layers = get_model(model_type_of(normalize_hf_config(hf_config))).mtp_in_layers
    return lambda name: _draft_checkpoint_name(name, {}, in_layers)


def carried_input_scales(
    modules: Iterable[tuple[str, torch.nn.Module]], to_checkpoint: Callable[[str], str] = checkpoint_name
) -> dict[str, torch.Tensor]:
    """``{checkpoint name: float32 0-d}`` for every NVFP4 MoE layer among ``modules``
    (``model.named_modules()``), naming each expert as refitd's generation names its weights;
    ``to_checkpoint`` maps a module name (:func:`draft_checkpoint_namer` for the MTP drafter)."""
    out: dict[str, torch.Tensor] = {}
    for name, module in modules:
        method = getattr(module, "quant_method", None)
        kind = type(method).__name__
        if kind == CT_NVFP4_MOE_METHOD and not getattr(method, "use_a16", True):
            out.update(_compressed_tensors(name, module, _backend_name(method), to_checkpoint))
            continue
        if kind != NVFP4_MOE_METHOD or not hasattr(module, "w13_weight"):
            continue
        experts = int(module.w13_weight.shape[0])
        backend = _backend_name(method)
        a13 = _per_expert(getattr(module, "w13_input_scale", None), experts, backend)
        a2 = _per_expert(getattr(module, "w2_input_scale", None), experts, backend)
        moe = to_checkpoint(name.replace(".routed_experts", ""))
        for e, x in enumerate(_global_ids(module, experts)):
            out[f"{moe}.{x}.gate_proj.input_scale"] = a13[e].clone()
            out[f"{moe}.{x}.up_proj.input_scale"] = a13[e].clone()
            out[f"{moe}.{x}.down_proj.input_scale"] = a2[e].clone()
    return out


def _compressed_tensors(
    name: str, module: torch.nn.Module, backend: str, to_checkpoint: Callable[[str], str]
) -> dict[str, torch.Tensor]:
    """One compressed-tensors NVFP4 W4A4 MoE layer's carried ``input_global_scale`` per expert."""
    g13, g2 = carried_global_scales(name, module, backend)
    moe = to_checkpoint(name.replace(".routed_experts", ""))
    out: dict[str, torch.Tensor] = {}
    for e, x in enumerate(_global_ids(module, int(g13.shape[0]))):
        out[f"{moe}.{x}.gate_proj.{INPUT_GLOBAL_SCALE}"] = g13[e, 0].clone()
        out[f"{moe}.{x}.up_proj.{INPUT_GLOBAL_SCALE}"] = g13[e, 1].clone()
        out[f"{moe}.{x}.down_proj.{INPUT_GLOBAL_SCALE}"] = g2[e].clone()
    return out
