"""The ``LLM(...)`` keyword arguments from the daemon's RefitSpec (pure)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from adapters.trtllm.backends import EXTENSION_QUALNAME, SM100F, backend_refusal, resolve_moe_backend
from sidecar.numerics.formats import BLOCK, NVFP4_BLOCK, Format
from sidecar.plan.build import Layer, RefitSpec, UnitKind, plan_from_hf_config
from sidecar.plan.models import get_model, model_type_of

#: modules TRT-LLM must keep BF16 besides the routed experts, in TRT-LLM module names (fnmatch);
#: Qwen3.5 from NeMo-RL PR #3677 (nemo_rl/models/generation/trtllm/quantization/fp8.py)
_NOT_CONVERT = {
    "qwen3_moe": (
        "model.layers.*.self_attn*",
        "model.layers.*.mlp.gate",
        "model.embed_tokens",
        "model.norm",
        "lm_head",
    ),
    "qwen3_5_moe": (
        "model.layers.*.self_attn*",
        "model.layers.*.linear_attn*",
        "model.layers.*.mlp.gate",
        "model.layers.*.mlp.shared_expert*",
        "model.embed_tokens",
        "model.norm",
        "lm_head",
    ),
}
_MTP_NOT_CONVERT = ("self_attn*", "linear_attn*", "mlp.gate", "mlp.shared_expert*")
_MTP_TOP_NOT_CONVERT = ("mtp.fc*", "mtp.norm*", "mtp.pre_fc_norm_embedding*", "mtp.pre_fc_norm_hidden*")


def _layer_key(layer: Layer) -> tuple[int, int]:
    return (1, layer[1]) if isinstance(layer, tuple) else (0, layer if layer is not None else -1)


def _engine_layer(layer: Layer) -> str:
    return f"mtp.layers.{layer[1]}" if isinstance(layer, tuple) else f"model.layers.{layer}"


def _kept_expert_modules(hf_config: Mapping[str, Any], spec: RefitSpec) -> list[str]:
    """TRT-LLM MoE modules whose experts the refit plan keeps BF16; whole layers only."""
    plan = plan_from_hf_config(hf_config, spec)
    kept: dict[Layer, set[bool]] = defaultdict(set)
    for unit in plan.units:
        if unit.kind is UnitKind.PASSTHROUGH and unit.keep_reason is None:
            continue
        kept[unit.layer].add(unit.kind is UnitKind.PASSTHROUGH)
    mixed = [lay for lay, kinds in kept.items() if len(kinds) > 1]
    if mixed:
        raise ValueError(
            f"the refit plan keeps only part of the routed experts of layer(s) {mixed} in BF16; TRT-LLM "
            "quantizes a whole MoE module, so ignore_patterns must cover whole layers' experts"
        )
    layers = sorted((lay for lay, kinds in kept.items() if kinds == {True}), key=_layer_key)
    return [f"{_engine_layer(lay)}.mlp.experts" for lay in layers]


def _modules_to_not_convert(hf_config: Mapping[str, Any], spec: RefitSpec) -> list[str]:
    model = spec.model
    out = list(_NOT_CONVERT[model.model_type])
    mtp = int(model.text_config(hf_config).get("mtp_num_hidden_layers", 0) or 0) if model.has_mtp else 0
    for n in range(mtp):
        out += [f"mtp.layers.{n}.{p}" for p in _MTP_NOT_CONVERT]
    if mtp:
        out += list(_MTP_TOP_NOT_CONVERT)
    return out + _kept_expert_modules(hf_config, spec)


def trtllm_llm_args(
    spec: RefitSpec,
    hf_config: Mapping[str, Any],
    *,
    sm: int | None = None,
    moe_backend: str | None = None,
    load_format: str = "dummy",
    extension_cls: str = EXTENSION_QUALNAME,
) -> dict[str, Any]:
    """``LLM(...)`` keyword arguments that make TRT-LLM hold exactly what refitd publishes for ``spec``.

    The quantization config is the Hugging Face form TRT-LLM reads from ``model_kwargs``; it lists in
    ``modules_to_not_convert`` every non-expert module and every MoE module the refit plan keeps in
    BF16. The MoE backend keeps FP32 block scales (TRTLLM on Blackwell, else CUTLASS; never DEEPGEMM).
    ``load_format='dummy'`` leaves the weights for the first refit to fill; per-tensor FP8 and NVFP4
    need a calibrated checkpoint instead (their static input scales are not published by refitd).
    NVFP4 is ModelOpt's ``quant_algo: NVFP4`` (``model_config.py`` @008e0af8
    ``_build_modelopt_quant_config``), on CUTLASS unless asked (AUTO's choice there); MXFP4 and INT4
    W4A16 are refused, naming what TRT-LLM reads instead.
    """
    fmt = spec.format
    if fmt in (Format.MXFP4, Format.INT4_W4A16):
        raise ValueError(backend_refusal(fmt, "", sm))
    if spec.model.model_type != get_model(model_type_of(hf_config)).model_type:
        raise ValueError(f"the spec is for {spec.model_type} but the config describes another model")
    if fmt in (Format.FP8_PER_TENSOR, Format.NVFP4) and load_format == "dummy":
        what, ckpt = (
            ("per-tensor FP8", "a per-tensor FP8 checkpoint")
            if fmt is Format.FP8_PER_TENSOR
            else ("NVFP4 (W4A4) MoE", "a ModelOpt NVFP4 checkpoint")
        )
        raise ValueError(
            f"{what} needs calibrated static input scales that refitd does not publish: load "
            f"{ckpt} (load_format='auto'), whose input_scale tensors the adapter carries "
            "over on every refit"
        )
    requested = (moe_backend or ("TRTLLM" if fmt is Format.BLOCK_FP8 and sm in SM100F else "CUTLASS")).upper()
    why = backend_refusal(fmt, resolve_moe_backend(requested, fmt, sm), sm)
    if why is not None:
        raise ValueError(f"moe_config backend {requested!r} with {fmt.value} experts: {why}")
    args: dict[str, Any] = {
        "load_format": load_format,
        "dtype": "bfloat16",
        "moe_config": {"backend": requested},
        "orchestrator_type": "ray",
        "ray_worker_extension_cls": extension_cls,
    }
    if not fmt.quantized:
        return args
    not_convert = _modules_to_not_convert(hf_config, spec)
    quant: dict[str, Any]
    if fmt is Format.BLOCK_FP8:
        quant = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [BLOCK, BLOCK],
            "modules_to_not_convert": not_convert,
        }
    elif fmt is Format.MXFP8:
        quant = {"quant_method": "mxfp8", "weight_block_size": [1, 32], "modules_to_not_convert": not_convert}
    elif fmt is Format.NVFP4:
        # ModelOpt's flat form (read_modelopt_quant_config keeps quant_algo, group_size, exclude_modules,
        # kv_cache_quant_algo): NVFP4 experts, one float8 scale per 16, BF16 KV cache (refitd
        # publishes no KV scales), every module the plan keeps BF16 excluded
        quant = {
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "group_size": NVFP4_BLOCK,
            "exclude_modules": not_convert,
            "kv_cache_quant_algo": None,
        }
    else:
        quant = {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": not_convert}
    args["model_kwargs"] = {"quantization_config": quant}
    return args
