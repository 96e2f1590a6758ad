"""A TRT-LLM model's parameters -> the manifest of checkpoint tensors it expects (pure)."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from adapters.trtllm.backends import (
    BLOCK_FP8_MOE_ALIGN,
    MXFP8_MOE_ALIGN,
    NVFP4_CUTLASS_SCALES_PER_WORD,
    _unsupported_formats,
)
from sidecar.numerics.formats import FLOAT_DTYPES, FP8_DTYPE, NVFP4_BLOCK, Format
from sidecar.plan.build import Layer, layer_of_name
from sidecar.plan.models import PER_EXPERT_RE, SLAB_RE, get_model, model_type_of
from sidecar.protocol.manifest import EngineConstraints, EngineKind, Manifest, ManifestTensor

EngineParam = tuple[str, torch.dtype, tuple[int, ...]]
#: a fused MoE module's parameters: ``<module>.experts[.backend].<param>``
_MOE_PARAM_RE = re.compile(r"^(?P<module>.+\.experts)(?:\.backend)?\.(?P<param>[A-Za-z0-9_]+)$")
_MOE_WEIGHTS = ("w3_w1_weight", "w2_weight")
#: a checkpoint module fused by TRT-LLM: checkpoint suffix -> engine module suffix
_FUSED_MODULES = (
    ("self_attn.q_proj", "self_attn.qkv_proj"),
    ("self_attn.k_proj", "self_attn.qkv_proj"),
    ("self_attn.v_proj", "self_attn.qkv_proj"),
    ("linear_attn.in_proj_qkv", "linear_attn.in_proj_qkvz"),
    ("linear_attn.in_proj_z", "linear_attn.in_proj_qkvz"),
    ("linear_attn.in_proj_b", "linear_attn.in_proj_ba"),
    ("linear_attn.in_proj_a", "linear_attn.in_proj_ba"),
    ("shared_expert.gate_proj", "shared_expert.gate_up_proj"),
    ("shared_expert.up_proj", "shared_expert.gate_up_proj"),
    ("mlp.gate_proj", "mlp.gate_up_proj"),
    ("mlp.up_proj", "mlp.gate_up_proj"),
)
_LM_PREFIX = "model.language_model."


def _dtype(value: torch.dtype | str) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {value!r} in the engine's parameter list")
    return dtype


def _coerce_params(params: Iterable[Any]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    out = {}
    for item in params:
        name, rest = item[0], item[1:]
        if len(rest) == 1 and isinstance(rest[0], torch.Tensor):
            dtype, shape = rest[0].dtype, tuple(rest[0].shape)
        elif len(rest) == 2:
            dtype, shape = _dtype(rest[0]), tuple(int(d) for d in rest[1])
        else:
            raise ValueError(f"cannot read an engine parameter from {item!r}: give (name, dtype, shape)")
        out[str(name)] = (dtype, shape)
    return out


#: bits per element of a packed NVFP4 MoE tensor: CUTLASS packs 16 E2M1 values per int64 and 4 float8
#: scales per int32, TRTLLM-Gen 2 values per uint8 and 1 scale per float8 (NVFP4*FusedMoEMethod)
_PACKED_BITS = {torch.int64: 64, torch.uint8: 8, torch.int32: 32, FP8_DTYPE: 8}


def _nvfp4_group(params: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> int | None:
    """Elements of K per block scale of an NVFP4-shaped MoE module (16 for NVFP4, 32 for TRT-LLM's
    W4A8_NVFP4_FP8), from ``w3_w1_weight`` and ``w3_w1_weight_scale``'s last dims; None if unreadable."""
    (wd, ws), (sd, ss) = params["w3_w1_weight"], params["w3_w1_weight_scale"]
    if wd not in _PACKED_BITS or sd not in _PACKED_BITS or not ws or not ss or not ss[-1]:
        return None
    k = ws[-1] * _PACKED_BITS[wd] // 4
    if sd == torch.int32:  # CUTLASS: hidden_size // 16 // 4 words, floored (checks.py refuses K % 64)
        return NVFP4_BLOCK if k // NVFP4_BLOCK // NVFP4_CUTLASS_SCALES_PER_WORD == ss[-1] else None
    scales = ss[-1] * _PACKED_BITS[sd] // 8
    return k // scales if k % scales == 0 else None


def _moe_format(module: str, params: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> Format:
    """The expert format a fused MoE module holds, from its parameter names and dtypes.

    NVFP4 (``NVFP4FusedMoEMethod.create_weights``): packed ``w3_w1_weight`` / ``w2_weight`` (int64 in
    CUTLASS, uint8 in TRTLLM-Gen), ``w3_w1_weight_scale`` / ``w2_weight_scale``, 0-d
    ``fc31_input_scale`` / ``fc2_input_scale`` and per-expert ``fc31_alpha`` / ``fc2_alpha``, one block
    scale per 16 along K.
    """
    lacking = [p for p in _MOE_WEIGHTS if p not in params]
    if lacking:
        raise ValueError(f"{module}: no {lacking} among its parameters; is it a TRT-LLM fused MoE module?")
    dtype = params["w3_w1_weight"][0]
    if dtype in FLOAT_DTYPES:
        return Format.BF16
    if "fc31_alpha" in params and "fc31_input_scale" in params and "w3_w1_weight_scale" in params:
        group = _nvfp4_group(params)
        if group == NVFP4_BLOCK:
            return Format.NVFP4
        raise ValueError(
            f"{module}: NVFP4-style experts with one scale per {group} along K (TRT-LLM's W4A8_NVFP4_FP8 "
            "uses 32): refitd publishes NVFP4 with one scale per 16; configure quant_algo NVFP4 "
            "(trtllm_llm_args does)"
        )
    if dtype != FP8_DTYPE:
        raise ValueError(
            f"{module}.w3_w1_weight is {dtype} with {sorted(params)}: refitd's TRT-LLM adapter handles bf16, "
            "float8_e4m3fn and NVFP4 experts only (TRT-LLM's MXFP4 / INT4 MoE methods read other names than "
            "refitd publishes)"
        )
    if "w3_w1_weight_scaling_factor" in params:
        return Format.BLOCK_FP8
    if "fc31_dequant" in params or "fc31_input_dequant" in params:
        return Format.FP8_PER_TENSOR
    if "w3_w1_weight_scale" in params:
        return Format.MXFP8
    raise ValueError(f"{module}: float8 experts with scales {sorted(params)} that refitd does not know")


def _linear_format(scales: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> Format:
    """The format of a quantized linear (non-expert) from its parameters: NVFP4LinearMethod holds a
    uint8 ``weight`` [out, in/2] with ``alpha`` and ``input_scale`` (linear.py); FP8 ones a float8 one."""
    if scales.get("weight", (None,))[0] == torch.uint8 and "alpha" in scales:
        return Format.NVFP4
    if "weight_scale_inv" in scales:
        return Format.BLOCK_FP8
    dtype = scales.get("weight_scale", (torch.float32, ()))[0]
    if dtype in (torch.uint8, torch.int32):
        return Format.MXFP8
    return Format.FP8_PER_TENSOR


def _engine_module(ckpt_module: str) -> str:
    """The TRT-LLM module a checkpoint module loads into (Qwen3.5 strips ``language_model``)."""
    name = "model." + ckpt_module[len(_LM_PREFIX) :] if ckpt_module.startswith(_LM_PREFIX) else ckpt_module
    for ckpt_suffix, engine_suffix in _FUSED_MODULES:
        if name.endswith("." + ckpt_suffix):
            return name[: -len(ckpt_suffix)] + engine_suffix
    return name


def _quantized(name: str, shape: tuple[int, ...], fmt: Format) -> list[ManifestTensor]:
    """A quantized weight's checkpoint tensors (SPEC §2.3): the values, the scale, NVFP4's
    ``.weight_scale_2`` (ModelOpt's names, which TRT-LLM's NVFP4 loaders read)."""
    module = name.removesuffix(".weight")
    out = [
        ManifestTensor(f"{module}.{fmt.weight_suffix}", fmt.weight_dtype, fmt.weight_shape(shape)),
        ManifestTensor(f"{module}.{fmt.scale_suffix}", fmt.scale_dtype, fmt.scale_shape(shape)),
    ]
    if fmt is Format.NVFP4:
        out.append(ManifestTensor(f"{module}.weight_scale_2", torch.float32, ()))
    return out


def _expand_slab(name: str, shape: tuple[int, ...], fmt: Format) -> list[ManifestTensor]:
    """A grouped slab as the per-expert FP8 tensors refitd publishes for it (SPEC §2.3)."""
    m = SLAB_RE.match(name)
    prefix, proj = m.group("prefix"), m.group("proj")
    experts, rows, cols = shape
    projs = ("gate_proj", "up_proj") if proj == "gate_up_proj" else ("down_proj",)
    out_rows = rows // 2 if proj == "gate_up_proj" else rows
    out: list[ManifestTensor] = []
    for e in range(experts):
        for p in projs:
            out += _quantized(f"{prefix}.{e}.{p}.weight", (out_rows, cols), fmt)
    return out


def build_manifest(
    params: Iterable[Any],
    hf_config: Mapping[str, Any],
    *,
    moe_backend: str,
    requested_backend: str = "",
    sm: int | None = None,
    tp_size: int = 1,
    moe_tp_size: int | None = None,
    moe_ep_size: int = 1,
    engine_version: str = "",
    input_scales: bool | None = None,
    quant_method: str = "",
    mxfp8_reload_path: bool | None = None,
) -> Manifest:
    """The manifest of a TRT-LLM model: the *checkpoint* tensors it expects, in global shapes.

    ``params`` is the model's ``named_parameters()`` as ``(name, dtype, shape)`` (or ``(name,
    tensor)``); ``moe_backend`` the resolved MoE class name. Fused MoE modules (``w3_w1_weight``,
    ``w2_weight`` and their scales) are mapped back to one tensor per expert and projection as refitd
    publishes them; a module held in BF16 keeps the checkpoint's own expert tensors (a Qwen3.5 slab
    stays a slab). Everything else is the checkpoint's BF16 tensor, unless the engine holds its
    module in FP8 (then the manifest says so, and :func:`check_trtllm_constraints` objects).
    Per-tensor FP8 and NVFP4 ``input_scale`` tensors are not listed: refitd does not publish them; the
    worker extension carries the engine's own static input scales into every reload (``input_scales``
    says whether it has usable ones; :func:`check_trtllm_constraints` refuses without).
    Layers the engine does not hold (pipeline parallelism, no MTP) are left out. ``quant_method`` is
    the MoE modules' resolved quant method class and ``mxfp8_reload_path`` whether the build has the
    MXFP8 reload path (both recorded in ``info``; :func:`backend_refusal` reads them).
    """
    engine = _coerce_params(params)
    model = get_model(model_type_of(hf_config))
    moe_params: dict[str, dict[str, tuple[torch.dtype, tuple[int, ...]]]] = defaultdict(dict)
    linear_params: dict[str, dict[str, tuple[torch.dtype, tuple[int, ...]]]] = defaultdict(dict)
    for name, value in engine.items():
        if m := _MOE_PARAM_RE.match(name):
            moe_params[m.group("module")][m.group("param")] = value
        else:
            module, _, leaf = name.rpartition(".")
            linear_params[module][leaf] = value
    moe_format: dict[Layer, Format] = {
        layer_of_name(mod + "."): _moe_format(mod, p) for mod, p in moe_params.items()
    }
    quantized = sorted({f.value for f in moe_format.values() if f.quantized})
    if len(quantized) > 1:
        raise ValueError(f"the engine's routed experts mix formats {quantized}; refitd publishes one format")
    expert_format = Format(quantized[0]) if quantized else Format.BF16
    fp8_linears = {
        mod: _linear_format(p)
        for mod, p in linear_params.items()
        if p.get("weight", (None,))[0] == FP8_DTYPE
        or (p.get("weight", (None,))[0] == torch.uint8 and "alpha" in p)
    }
    held_layers = {layer_of_name(n) for n in engine} | {None}
    include_mtp = any(isinstance(layer, tuple) for layer in held_layers)

    tensors: list[ManifestTensor] = []
    for name, shape, dtype in model.parameters(hf_config, include_mtp=include_mtp):
        layer = layer_of_name(name)
        if layer not in held_layers:
            continue
        routed = SLAB_RE.match(name) or PER_EXPERT_RE.match(name)
        if routed:
            fmt = moe_format.get(layer, Format.BF16)
            if not fmt.quantized:
                tensors.append(ManifestTensor(name, dtype, shape))
            elif SLAB_RE.match(name):
                tensors += _expand_slab(name, shape, fmt)
            else:
                tensors += _quantized(name, shape, fmt)
            continue
        module = name.removesuffix(".weight")
        fmt = fp8_linears.get(_engine_module(module)) if name.endswith(".weight") else None
        tensors += _quantized(name, shape, fmt) if fmt else [ManifestTensor(name, dtype, shape)]

    text = model.text_config(hf_config)
    moe_tp = tp_size if moe_tp_size is None else moe_tp_size
    constraints = EngineConstraints(
        engine=EngineKind.TRTLLM,
        expert_format=expert_format,
        hidden_size=int(text["hidden_size"]) if text.get("hidden_size") else None,
        intermediate_size=int(text["moe_intermediate_size"]) if text.get("moe_intermediate_size") else None,
        moe_tp_size=moe_tp,
        moe_ep_size=moe_ep_size,
        block_fp8_align=BLOCK_FP8_MOE_ALIGN,
        mxfp8_align=MXFP8_MOE_ALIGN,
        unsupported_formats=frozenset(Format(f) for f in _unsupported_formats(moe_backend)),
    )
    info = {
        "model_type": model.model_type,
        "requested_moe_backend": requested_backend,
        "sm": sm,
        "tp_size": tp_size,
        "hidden_size": text.get("hidden_size"),
        "moe_intermediate_size": text.get("moe_intermediate_size"),
        "moe_modules": len(moe_params),
        "bf16_moe_modules": sum(not f.quantized for f in moe_format.values()),
        "input_scales": None if input_scales is None else bool(input_scales),
        "moe_quant_method": quant_method,
        "mxfp8_reload_path": mxfp8_reload_path,
    }
    return Manifest(
        engine=EngineKind.TRTLLM,
        engine_version=engine_version,
        moe_backend=moe_backend,
        expert_format=expert_format,
        tensors=tuple(tensors),
        constraints=constraints,
        info=info,
    )
