"""The quantization SGLang applies, the ``quantization_config`` that makes it hold in BF16 exactly what
the refit plan keeps in BF16, and the constants of SGLang's loader this adapter mirrors (pure; see
``adapters.sglang``'s docstring for the source files each fact comes from).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from adapters.sglang.fourbit import (
    MXFP4_REFUSAL,
    compressed_tensors_format,
    int4_quantization_config,
    nvfp4_quantization_config,
)
from sidecar.numerics.formats import BLOCK, DEFAULT_FORMAT_PARAMS, Format, FormatParams, Nvfp4Names
from sidecar.plan.build import plan_from_hf_config, with_checkpoint_scheme
from sidecar.plan.models import ModelSpec
from sidecar.plan.spec import RefitSpec

#: the import path to list in ``--custom-weight-loader`` and pass as ``load_format``
LOADER = "adapters.sglang.loader.refit_loader"
#: the one tensor of the control payload ``update_weights_from_tensor`` carries (JSON bytes as uint8)
CONTROL_NAME = "refitd.control"
#: SGLang's packed modules -> their checkpoint shards (``stacked_params_mapping`` of qwen3_moe.py and
#: deepseek_v2.py; ``fused_qkv_a_proj_with_mqa`` only exists when ``q_lora_rank`` is set)
PACKED_MODULES: Mapping[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "fused_qkv_a_proj_with_mqa": ("q_a_proj", "kv_a_proj_with_mqa"),
}
#: ``FusedMoE.make_expert_params_mapping``: engine prefix -> checkpoint projections (no
#: ``routed_experts`` infix in SGLang)
EXPERT_PROJS: Mapping[str, tuple[str, ...]] = {"w13": ("gate_proj", "up_proj"), "w2": ("down_proj",)}
#: engine parameters no refit publishes (attention KV-cache scales)
KV_SCALE_LEAVES = frozenset({"k_scale", "v_scale", "q_scale", "kv_scale"})
#: environment for every SGLang process serving block-FP8: DeepGEMM's UE8M0 requantization on
#: SM100/SM120 would replace the FP32 block scales refitd publishes with powers of two
SGLANG_ENV: Mapping[str, str] = {"SGLANG_ENABLE_JIT_DEEPGEMM": "0"}
MXFP8_ALIGN = 32
BLOCK_FP8_ALIGN = BLOCK


@dataclass(frozen=True, slots=True)
class SglangQuant:
    """What SGLang's quantization config makes of the routed experts."""

    fmt: Format
    method: str | None  # "fp8", "mxfp8", "modelopt", "compressed-tensors" or None (unquantized)
    ignored: tuple[str, ...] = ()
    #: the format's parameters the config says (INT4's group; the manifest adds the scale dtype)
    params: FormatParams = DEFAULT_FORMAT_PARAMS


def resolve_quant(quant_config: Any) -> SglangQuant:
    """The expert format of a quantization config: a ``quantization_config`` dict, SGLang's resolved
    config object (``model.quant_config``: ``Fp8Config``, ``ModelOptFp4Config``,
    ``CompressedTensorsConfig``) or None (BF16)."""
    if quant_config is None or (isinstance(quant_config, Mapping) and not quant_config):
        return SglangQuant(Format.BF16, None)
    if isinstance(quant_config, Mapping):
        method = str(quant_config.get("quant_method", "")).lower()
        if method in ("modelopt", "modelopt_fp4"):
            return _modelopt(quant_config)
        if method == "compressed-tensors":
            groups = [g for g in (quant_config.get("config_groups") or {}).values() if isinstance(g, Mapping)]
            return _compressed(
                [g.get("weights") or {} for g in groups],
                [g.get("input_activations") for g in groups],
                quant_config.get("ignore") or (),
            )
        block = quant_config.get("weight_block_size")
        ignored = quant_config.get("ignored_layers") or quant_config.get("modules_to_not_convert") or ()
        return _fp8(method, block, ignored)
    kind = type(quant_config).__name__
    if kind == "ModelOptFp4Config":
        if not getattr(quant_config, "is_checkpoint_nvfp4_serialized", False):
            raise ValueError(
                "SGLang runs ModelOptFp4Config quantizing BF16 experts at load (not an NVFP4 checkpoint): start "
                "it from sglang_quantization_config() for nvfp4 (quant_algo NVFP4)"
            )
        return SglangQuant(
            Format.NVFP4, "modelopt", tuple(getattr(quant_config, "exclude_modules", ()) or ())
        )
    if kind == "CompressedTensorsConfig":
        schemes = [
            s
            for s in (getattr(quant_config, "target_scheme_map", {}) or {}).values()
            if isinstance(s, Mapping)
        ]
        return _compressed(
            [s.get("weights") for s in schemes],
            [s.get("input_activations") for s in schemes],
            getattr(quant_config, "ignore", ()) or (),
        )
    if kind != "Fp8Config":
        raise ValueError(
            f"SGLang resolved quantization {kind}; refitd's SGLang adapter publishes into Fp8Config (block-FP8, "
            "MXFP8, per-tensor FP8), ModelOptFp4Config (NVFP4), CompressedTensorsConfig (INT4 W4A16) or "
            "unquantized models: write the checkpoint's config.json with sglang_quantization_config() (refitd "
            "convert does)"
        )
    method = "mxfp8" if getattr(quant_config, "use_mxfp8", False) else "fp8"
    block = getattr(quant_config, "weight_block_size", None)
    return _fp8(method, block, getattr(quant_config, "ignored_layers", None) or ())


def _modelopt(cfg: Mapping[str, Any]) -> SglangQuant:
    inner = cfg.get("quantization") if isinstance(cfg.get("quantization"), Mapping) else cfg
    algo = str(inner.get("quant_algo", "")).upper()
    if algo != "NVFP4":
        raise ValueError(
            f"ModelOpt quant_algo {algo!r}: refitd's SGLang adapter publishes NVFP4 for ModelOpt"
        )
    ignored = inner.get("ignore", inner.get("modules_to_not_convert", inner.get("exclude_modules", ()))) or ()
    return SglangQuant(Format.NVFP4, "modelopt", tuple(ignored))


def _compressed(weights: list[Any], activations: list[Any], ignored: Iterable[str]) -> SglangQuant:
    if not weights:
        raise ValueError(
            "a compressed-tensors config without config_groups: refitd publishes INT4 W4A16 there"
        )
    fmt, params = compressed_tensors_format(weights, activations)
    return SglangQuant(fmt, "compressed-tensors", tuple(ignored), params)


def _fp8(method: str, block: Any, ignored: Iterable[str]) -> SglangQuant:
    if method == "mxfp8" or "mxfp8" in method:
        return SglangQuant(Format.MXFP8, "mxfp8", tuple(ignored))
    if method != "fp8":
        raise ValueError(
            f"quantization_config quant_method {method!r}: refitd's SGLang adapter knows fp8 and mxfp8"
        )
    if block is None:
        return SglangQuant(Format.FP8_PER_TENSOR, "fp8", tuple(ignored))
    if list(block) != [BLOCK, BLOCK]:
        raise ValueError(f"weight_block_size {list(block)}: refitd publishes {BLOCK}x{BLOCK} blocks only")
    return SglangQuant(Format.BLOCK_FP8, "fp8", tuple(ignored))


def bf16_modules(spec: RefitSpec, hf_config: Mapping[str, Any]) -> list[str]:
    """Checkpoint module names the plan publishes in BF16 that a quantization config would otherwise
    quantize (:func:`bf16_modules_of` over the plan's outputs)."""
    plan = plan_from_hf_config(hf_config, with_checkpoint_scheme(spec, hf_config))
    return bf16_modules_of(((o.name, o.dtype, o.shape) for o in plan.outputs), spec.model)


def bf16_modules_of(
    outputs: Iterable[tuple[str, torch.dtype, tuple[int, ...]]], model: ModelSpec
) -> list[str]:
    """From published tensors ``(name, dtype, shape)``: linear weights held in BF16 (attention, dense
    MLPs, shared experts, router), whole routed-expert modules (``…mlp.experts``: SGLang and vLLM hold
    a layer's experts all one way), and DeepSeek's ``fused_qkv_a_proj_with_mqa`` when both its shards
    stay BF16 (SGLang's fallback packed mapping does not know it)."""
    out: dict[str, None] = {}
    quantized_experts: set[str] = set()
    bf16_experts: set[str] = set()
    for name, dtype, shape in outputs:
        if not name.endswith(".weight") or len(shape) != 2:
            continue
        module = name.removesuffix(".weight")
        wide = dtype.is_floating_point and dtype.itemsize >= 2
        r = model.per_expert_re.match(name) or (model.slab_re.match(name) if model.slab_re else None)
        if r is not None:
            (bf16_experts if wide else quantized_experts).add(r["prefix"])
            continue
        leaf = module.rsplit(".", 1)[-1]
        if "norm" in leaf or leaf in ("embed_tokens", "enorm", "hnorm"):
            continue
        if wide:
            out.setdefault(module)
    mixed = bf16_experts & quantized_experts
    if mixed:
        raise ValueError(
            f"the plan keeps only some experts of {sorted(mixed)[0]} in BF16; SGLang holds a layer's experts all "
            "in BF16 or all quantized: widen ignore_patterns to the layer"
        )
    for prefix in sorted(bf16_experts):
        out.setdefault(prefix)
    for name in list(out):
        head = name.removesuffix("q_a_proj")
        if name.endswith(".q_a_proj") and f"{head}kv_a_proj_with_mqa" in out:
            out.setdefault(f"{head}fused_qkv_a_proj_with_mqa")
    return sorted(out)


def with_fused_names(modules: Iterable[str]) -> list[str]:
    """``modules`` plus SGLang's fused module (``gate_up_proj``, ``qkv_proj``) wherever all its shards
    are listed: compressed-tensors' ``should_ignore_layer`` only expands a fused name into its shards
    through the model's ``packed_modules_mapping``, which DeepSeek-V2/V3's lacks for its dense MLPs'
    ``gate_up_proj`` (their INT4 scheme would be looked up, and the layer quantized, otherwise)."""
    out = dict.fromkeys(modules)
    for fused, shards in PACKED_MODULES.items():
        for name in list(out):
            parent, _, leaf = name.rpartition(".")
            if leaf == shards[0] and all(f"{parent}.{s}" in out for s in shards):
                out.setdefault(f"{parent}.{fused}")
    return sorted(out)


def sglang_quantization_config(
    spec: RefitSpec, hf_config: Mapping[str, Any], *, skip: list[str] | None = None
) -> dict[str, Any] | None:
    """The ``quantization_config`` for the model's ``config.json`` (or ``--json-model-override-args``)
    that makes SGLang hold in BF16 exactly what the refit plan publishes in BF16; None for BF16.

    Block-FP8: ``quant_method fp8``, ``weight_block_size [128, 128]``, dynamic activations (SGLang's
    ``Fp8Config``; vLLM and transformers' ``FineGrainedFP8Config`` read the same keys). MXFP8:
    ``quant_method mxfp8`` (SGLang's ``Fp8Config(use_mxfp8=True)``: ``.weight_scale`` uint8 renamed to
    ``weight_scale_inv`` at load). Per-tensor FP8: ``quant_method fp8`` without a block size.
    NVFP4: ModelOpt's ``quant_algo NVFP4`` (``ModelOptFp4Config``); INT4 W4A16: compressed-tensors
    ``pack-quantized`` with the spec's group (``adapters.sglang.fourbit``); MXFP4: ValueError (SGLang
    0.5.23 cannot load it). ``skip``: the BF16 modules, when known from the published tensors
    (``bf16_modules_of``)."""
    fmt = spec.format
    if fmt is Format.BF16:
        return None
    skip = bf16_modules(spec, hf_config) if skip is None else skip
    if fmt is Format.NVFP4:
        if spec.params.nvfp4_names is Nvfp4Names.COMPRESSED_TENSORS:
            # ModelOptFp4Config loads .weight / .weight_scale_2 (gs), not .weight_packed / .weight_global_scale (1 / gs)
            raise ValueError(
                "refitd's SGLang NVFP4 quantization_config is ModelOpt's (ModelOptFp4Config), which loads "
                "ModelOpt's names, not compressed-tensors' (.weight_packed, .weight_global_scale): plan with "
                "nvfp4_names='modelopt' (--nvfp4-names modelopt) for SGLang, or --engine vllm for compressed-tensors' names"
            )
        return nvfp4_quantization_config(skip)
    if fmt is Format.INT4_W4A16:
        if spec.params.int4_scale_dtype != "bfloat16":
            raise ValueError(
                f"int4_w4a16 with {spec.params.int4_scale_dtype} scales: SGLang 0.5.23's "
                "CompressedTensorsWNA16MoEMethod holds the group scales in the model dtype (create_weights: "
                "params_dtype, compressed_tensors_wNa16_moe.py), bfloat16 for this BF16 model, and its weight "
                "loader would round them to it; plan with int4_scale_dtype='bfloat16' (--int4-scale-dtype bfloat16)"
            )
        return int4_quantization_config(with_fused_names(skip), spec.params)
    if fmt is Format.MXFP4:
        raise ValueError(MXFP4_REFUSAL)
    if fmt is Format.MXFP8:
        return {"quant_method": "mxfp8", "activation_scheme": "dynamic", "modules_to_not_convert": skip}
    qc: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    if fmt is Format.BLOCK_FP8:
        qc["weight_block_size"] = [BLOCK, BLOCK]
    qc["modules_to_not_convert"] = skip
    return qc
