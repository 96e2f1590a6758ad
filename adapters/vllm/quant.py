"""The quantization vLLM applies and the constants of vLLM's loader this adapter mirrors (see
``adapters.vllm``'s docstring for the source files each fact comes from).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from adapters.vllm.compressed_nvfp4 import compressed_tensors_scheme, nvfp4_w4a4
from sidecar.numerics.formats import (
    BLOCK,
    DEFAULT_FORMAT_PARAMS,
    INT4_GROUP,
    MXFP4_BLOCK,
    NVFP4_BLOCK,
    Format,
    FormatParams,
)

WORKER_EXTENSION = "adapters.vllm.RefitWorkerExtension"
#: environment for every vLLM process (set before the engine starts): DeepGEMM on Blackwell would
#: otherwise requantize block scales to UE8M0 powers of two, losing the FP32 scales refitd publishes
VLLM_ENV: Mapping[str, str] = {"VLLM_USE_DEEP_GEMM_E8M0": "0"}
#: vLLM's packed modules -> their checkpoint shards (models' ``packed_modules_mapping``)
PACKED_MODULES: Mapping[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),
    "in_proj_ba": ("in_proj_b", "in_proj_a"),
    # DeepSeek-V2/V3 MLA with q_lora_rank (deepseek_v2.py packed_modules_mapping / load_weights)
    "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
}
#: Qwen3.5's ``hf_to_vllm_mapper`` inverted: engine prefix -> checkpoint prefix (first match wins)
ENGINE_TO_CHECKPOINT = (
    ("language_model.model.", "model.language_model."),
    ("language_model.lm_head.", "lm_head."),
    ("visual.", "model.visual."),
)
#: attention KV-cache scales: engine parameters no refit publishes
KV_SCALE_LEAVES = frozenset(
    # compressed-tensors' attention adds zero points (CompressedTensorsKVCacheMethod), no checkpoint's
    {
        "k_scale",
        "v_scale",
        "q_scale",
        "prob_scale",
        "kv_scale",
        "q_zero_point",
        "k_zero_point",
        "v_zero_point",
    }
)
EXPERT_PROJS = {"w13": ("gate_proj", "up_proj"), "w2": ("down_proj",)}
SCALE_LEAVES = (
    "weight_scale_inv",
    "weight_scale",
    "input_scale",
    "weight_scale_2",
    "weight_shape",
    # compressed-tensors' NVFP4 (adapters.vllm.compressed_nvfp4): 1 / weight_scale_2, and the activations'
    "weight_global_scale",
    "input_global_scale",
)
MXFP8_ALIGN = 32  # vLLM ModelOpt MXFP8 MoE: H and I/tp multiples of 32
BLOCK_FP8_ALIGN = BLOCK  # vLLM Fp8MoEMethod: the whole I a multiple of block_n = 128
#: vLLM 0.33.0 refines the 128-block of a TP shard to gcd(128, I/tp, H) when that is at least 32
#: (``oracle/fp8.py refine_fp8_moe_block_shape``; scales upsampled at load, Triton MoE kernels)
BLOCK_FP8_REFINE = 32
#: the K multiple each 4-bit MoE layer needs, of H (w13's K) and of I / moe_tp (w2's K): one scale
#: block per 16 (NVFP4 ``group_size``), 32 (MXFP4) or the INT4 group along K, never straddling a rank's
#: shard (vLLM 0.33.0 ``ModelOptNvFp4FusedMoE.create_weights`` sizes ``hidden_size // group_size`` scale
#: columns, silently dropping a remainder; compressed-tensors' MoE methods the same per group)
FOUR_BIT_K_MULTIPLE: Mapping[Format, int] = {
    Format.NVFP4: NVFP4_BLOCK,
    Format.MXFP4: MXFP4_BLOCK,
    Format.INT4_W4A16: INT4_GROUP,
}
#: vLLM 0.33.0's NVFP4 MoE backends by GPU (``fused_moe/oracle/nvfp4.py select_nvfp4_moe_backend``,
#: each kernel class's ``_supports_current_device`` / ``_supports_quant_scheme``): W4A4 (NVFP4
#: activations, the static ``input_scale`` used) needs SM100+; on SM90 the auto choice lands on
#: Marlin (``marlin_moe.py``: SM75+, NVFP4 weights with BF16 activations, ``input_scale`` unused) or
#: the Triton EMULATION experts (dequantize on the fly)
NVFP4_MOE_BACKENDS: Mapping[str, tuple[str, ...]] = {
    "SM90": ("MARLIN", "EMULATION"),
    "SM100": (
        "FLASHINFER_TRTLLM",
        "FLASHINFER_CUTEDSL",
        "FLASHINFER_CUTLASS",
        "VLLM_CUTLASS",
        "MARLIN",
        "EMULATION",
    ),
}
#: where a manifest's parameter list came from (``adapters.vllm.worker.engine_parameters_and_source``)
PARAM_SOURCE_LAYERWISE = "layerwise_metadata"
PARAM_SOURCE_LIVE = "live_parameters"


#: what an attach of a compressed-tensors (MXFP4 / INT4 W4A16 / NVFP4) engine is refused with
COMPRESSED_TENSORS_REFUSAL = (
    "vLLM runs a compressed-tensors scheme refitd does not publish (refitd's are int4_w4a16 "
    "pack-quantized with one group size, mxfp4-pack-quantized and nvfp4-pack-quantized); start the "
    "engine with vllm_engine_args() for nvfp4, int4_w4a16, mxfp4 or an FP8 format"
)


# --------------------------------------------------------------------------------------------------
# the quantization config in force


@dataclass(frozen=True, slots=True)
class VllmQuant:
    """The quantization vLLM applies: the routed experts' format and the modules it leaves alone."""

    fmt: Format
    method: str | None  # "fp8", "modelopt" or None (unquantized)
    ignored: tuple[str, ...] = ()
    static_activations: bool = False
    #: the format's parameters the config says (INT4 group, NVFP4 names; the manifest adds the
    #: INT4 scale dtype the engine's parameters hold)
    params: FormatParams = DEFAULT_FORMAT_PARAMS


def resolve_quant(quant_config: Any) -> VllmQuant:
    """The expert format of a quantization config: a ``quantization_config`` dict, a vLLM
    ``QuantizationConfig`` object (dispatched on its resolved class) or None (BF16)."""
    if quant_config is None or (isinstance(quant_config, Mapping) and not quant_config):
        return VllmQuant(Format.BF16, None)
    if isinstance(quant_config, Mapping):
        return _quant_from_dict(quant_config)
    kind = type(quant_config).__name__
    if kind == "Fp8Config":
        return _fp8(
            getattr(quant_config, "weight_block_size", None),
            getattr(quant_config, "ignored_layers", None) or (),
            getattr(quant_config, "activation_scheme", "dynamic"),
        )
    if kind == "ModelOptMxFp8Config":
        return VllmQuant(Format.MXFP8, "modelopt", tuple(getattr(quant_config, "exclude_modules", ()) or ()))
    if kind == "CompressedTensorsConfig":
        schemes = [s for s in (getattr(quant_config, "target_scheme_map", {}) or {}).values()]
        groups = [s for s in schemes if isinstance(s, Mapping)]
        return _compressed_tensors(
            [s.get("weights") for s in groups],
            getattr(quant_config, "ignore", ()) or (),
            [s.get("input_activations") for s in groups],
        )
    if kind == "ModelOptNvFp4Config":
        # W4A4: the experts hold static activation scales (w13/w2_input_scale), carried over per reload
        ignored = tuple(getattr(quant_config, "exclude_modules", ()) or ())
        return VllmQuant(Format.NVFP4, "modelopt", ignored, static_activations=True)
    raise ValueError(
        f"vLLM resolved quantization {kind}; refitd publishes Fp8Config (block-FP8 or per-tensor FP8), "
        "ModelOpt MXFP8 or NVFP4, or unquantized experts: start the engine with vllm_engine_args()"
    )


def _quant_from_dict(cfg: Mapping[str, Any]) -> VllmQuant:
    method = str(cfg.get("quant_method", "")).lower()
    if method == "fp8":
        ignored = cfg.get("ignored_layers") or cfg.get("modules_to_not_convert") or ()
        return _fp8(cfg.get("weight_block_size"), ignored, cfg.get("activation_scheme", "dynamic"))
    if method == "modelopt":
        inner = cfg.get("quantization") if isinstance(cfg.get("quantization"), Mapping) else cfg
        algo = str(inner.get("quant_algo", "")).upper()
        if algo not in ("MXFP8", "NVFP4"):
            raise ValueError(f"ModelOpt quant_algo {algo!r}: refitd publishes MXFP8 and NVFP4 for ModelOpt")
        ignored = tuple(inner.get("ignore", inner.get("exclude_modules", ())))
        if algo == "NVFP4":
            return VllmQuant(Format.NVFP4, "modelopt", ignored, static_activations=True)
        return VllmQuant(Format.MXFP8, "modelopt", ignored)
    if method == "compressed-tensors":
        groups = [g for g in (cfg.get("config_groups") or {}).values() if isinstance(g, Mapping)]
        weights = [g.get("weights") or {} for g in groups]
        return _compressed_tensors(
            weights, cfg.get("ignore") or (), [g.get("input_activations") for g in groups]
        )
    raise ValueError(
        f"quantization_config quant_method {method!r}: refitd's vLLM adapter knows fp8 and modelopt"
    )


def _compressed_tensors(weights: list[Any], ignored: Iterable[str], activations: list[Any] = ()) -> VllmQuant:
    """compressed-tensors: INT4 W4A16 (``pack-quantized``, its group size), MXFP4
    (``mxfp4-pack-quantized``) or NVFP4 under compressed-tensors' names (``nvfp4-pack-quantized``),
    NVFP4 W4A4 (NVFP4 ``input_activations``) holding static activation global scales."""
    scheme = compressed_tensors_scheme(weights) if weights else None
    if scheme is None:
        raise ValueError(COMPRESSED_TENSORS_REFUSAL)
    fmt, params = scheme
    static = fmt is Format.NVFP4 and nvfp4_w4a4(activations)
    return VllmQuant(fmt, "compressed-tensors", tuple(ignored), static_activations=static, params=params)


def _fp8(block: Any, ignored: Iterable[str], activation_scheme: str) -> VllmQuant:
    static = str(activation_scheme).lower() == "static"
    if block is None:
        return VllmQuant(Format.FP8_PER_TENSOR, "fp8", tuple(ignored), static)
    if list(block) != [BLOCK, BLOCK]:
        raise ValueError(f"weight_block_size {list(block)}: refitd publishes {BLOCK}x{BLOCK} blocks only")
    return VllmQuant(Format.BLOCK_FP8, "fp8", tuple(ignored), static)


# --------------------------------------------------------------------------------------------------
# config.json as transformers 5.x writes it
