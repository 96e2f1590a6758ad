"""refitd's 4-bit experts in SGLang 0.5.23: the quantization configs that load SPEC §2.3's names, and
what SGLang cannot reload (pure; no SGLang import). Line numbers are the 0.5.23 wheel's
(``sglang/srt/layers/...``).

* **NVFP4** (ModelOpt names): ``quant_method modelopt, quant_algo NVFP4`` resolves to
  ``ModelOptFp4Config`` (``quantization/modelopt_quant.py`` ``from_config``: ``group_size``, and
  ``ignore`` / ``modules_to_not_convert`` / ``exclude_modules``); the routed experts are
  ``ModelOptNvFp4FusedMoEMethod``: ``w13/w2_weight`` uint8 ``[E, N, K/2]``, ``w13/w2_weight_scale``
  float8_e4m3fn ``[E, N, K/16]``, ``w13_weight_scale_2 [E, 2]`` / ``w2_weight_scale_2 [E]`` float32,
  loaded from ``experts.{e}.{gate,up,down}_proj.{weight,weight_scale,weight_scale_2}``
  (``moe/fused_moe_triton/layer.py``: ``weight_scale_2`` per tensor for the FP4 variant). Its
  ``w13_input_scale [E, 2]`` / ``w2_input_scale [E]`` (created filled with 1.0, or the checkpoint's
  calibrated values) are never touched by processing (``process_weights_after_loading`` reads them
  into ``g1_alphas`` / ``w13_input_scale_quant``) and the method has no
  ``restore_weights_before_loading``: an update that names no ``input_scale`` keeps the held ones,
  and the next ``end_weight_update`` processes with them. So refitd carries them over by not
  publishing them (unlike vLLM's layerwise reload, nothing re-materializes them).
  The backend: on CUDA SM80-SM99 the ``auto`` backend is Marlin (``modelopt_quant.py:2379``), and on
  any GPU ``--moe-runner-backend marlin``; ``prepare_moe_nvfp4_layer_for_marlin``
  (``quantization/marlin_utils_fp4.py:530``) replaces ``w13_weight`` and the scales with new
  ``torch.nn.Parameter`` objects without a ``weight_loader``, and nothing restores them, so the next
  update cannot load: refused. Blackwell's FlashInfer TRT-LLM / CUTLASS / CuteDSL paths keep the
  parameters (``copy_or_rebind_param``, ``alias_or_bind_derived_param``: "update_weights_from_disk can
  keep refilling" them, ``layers/utils/common.py``).
* **INT4 W4A16** (compressed-tensors ``pack-quantized``, the config vLLM loads): SGLang's
  ``CompressedTensorsWNA16MoE`` (Marlin, ``compressed_tensors.py:950``) holds the experts transposed:
  ``w13_weight_packed`` int32 ``[E, H/8, 2I]``, ``w13_weight_scale`` in the model dtype ``[E, H/g, 2I]``,
  ``w13_weight_shape [E, 2]``; its loader transposes ``experts.{e}.*.weight_packed [N, K/8]`` in
  (``is_transposed``). It repacks for Marlin in place (``resize_`` + ``copy_``) and
  ``restore_weights_before_loading`` resizes back (``compressed_tensors_wNa16_moe.py:406``): reloadable.
  On SM100/SM103 the ``auto`` backend picks ``CompressedTensorsWNA16TritonMoE`` instead
  (``compressed_tensors.py:927-949``, group 32 or 128), whose processing replaces the packed weights and
  scales with new ``uint8`` parameters without a ``weight_loader`` and marks the layer converted
  (``compressed_tensors_wNa16_moe.py:507-531``): refused, ``--moe-runner-backend marlin`` works.
* **MXFP4**: SGLang 0.5.23 routes a compressed-tensors MXFP4 MoE (``"mxfp4"`` in the format, or 4-bit
  float group-32 weights) off NPUs to ``Mxfp4MoEMethod`` (``compressed_tensors.py:236-242``), gpt-oss's
  method: ``w13_weight`` / ``w13_weight_scale`` uint8 plus ``w13_weight_bias`` (``mxfp4.py:566-595``),
  loaded through ``FusedMoE.make_expert_params_mapping`` from ``experts.{e}.gate_proj.weight`` /
  ``.weight_scale``; SPEC §2.3's ``.weight_packed`` maps to ``w13_weight_packed``, which does not exist,
  and is skipped without a word. Its processing needs ``triton_kernels`` / FlashInfer / Marlin, and the
  MXFP4 backend wrappers "cannot restore" before a reload (``model_loader/loader.py:1097``): refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sidecar.numerics.formats import (
    DEFAULT_FORMAT_PARAMS,
    INT4_PACK,
    NVFP4_BLOCK,
    Format,
    FormatParams,
    Nvfp4Names,
)

#: SGLang's MoE methods for refitd's 4-bit experts
NVFP4_MOE_METHOD = "ModelOptNvFp4FusedMoEMethod"
INT4_MOE_METHOD = "CompressedTensorsWNA16MoE"
#: the routed-expert parameter leaves a refit loads (the ones whose ``weight_loader`` must survive
#: processing); SGLang's other 4-bit expert parameters are engine state no checkpoint fills: NVFP4's
#: activation scales (kept as held: the carry-over), WNA16's activation-order indices (no ``actorder``
#: in refitd's config), the swizzled / derived copies processing makes
LOADED_LEAVES = frozenset(
    {"weight", "weight_packed", "weight_scale", "weight_scale_inv", "weight_scale_2", "weight_shape"}
)
#: ``manifest.info`` keys the 4-bit attach rules read (recorded by ``adapters.sglang.loader``)
INFO_NO_LOADER = "expert_params_without_weight_loader"
INFO_MOE_BACKEND = "moe_runner_backend"
INFO_CAPABILITY = "device_capability"

MXFP4_REFUSAL = (
    "SGLang 0.5.23 cannot load refitd's MXFP4 experts: it serves a compressed-tensors MXFP4 MoE with gpt-oss's "
    "Mxfp4MoEMethod (layers/quantization/compressed_tensors/compressed_tensors.py:236-242), whose w13_weight / "
    "w13_weight_scale / w13_weight_bias (quantization/mxfp4.py:566-595) load from experts.{e}.gate_proj.weight, "
    "so SPEC §2.3's .weight_packed would be skipped without a word, and whose backend wrappers cannot restore "
    "their weights before an update (model_loader/loader.py:1097): refit SGLang in nvfp4, int4_w4a16 or an FP8 "
    "format"
)


def nvfp4_quantization_config(ignored: Sequence[str]) -> dict[str, Any]:
    """ModelOpt NVFP4 in ``config.json``'s flat form (``ModelOptFp4Config.from_config``), the same dict
    vLLM's ``modelopt_fp4`` reads; ``ignored`` stay BF16 (``exclude_modules``)."""
    return {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "group_size": NVFP4_BLOCK,
        "exclude_modules": list(ignored),
        "kv_cache_quant_algo": None,
    }


def int4_quantization_config(
    ignored: Sequence[str], params: FormatParams = DEFAULT_FORMAT_PARAMS
) -> dict[str, Any]:
    """compressed-tensors ``pack-quantized`` symmetric INT4, one group size, BF16 activations
    (SGLang's ``_is_wNa16_group_channel``: no ``input_activations``, static, int); ``ignored`` stay BF16."""
    weights = {
        "num_bits": 4,
        "type": "int",
        "symmetric": True,
        "strategy": "group",
        "group_size": params.int4_group,
        "dynamic": False,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "ignore": list(ignored),
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
    }


def _field(args: Any, key: str) -> str | None:
    """A weights field of a config group (a dict's key or a ``QuantizationArgs`` attribute), as text."""
    value = args.get(key) if isinstance(args, Mapping) else getattr(args, key, None)
    value = getattr(value, "value", value)
    return None if value is None else str(value).lower().rsplit(".", 1)[-1]


def compressed_tensors_format(
    weights: Sequence[Any], input_activations: Sequence[Any]
) -> tuple[Format, FormatParams]:
    """The expert format of compressed-tensors config groups (``weights`` and ``input_activations``
    of each): INT4 W4A16 with one group size, or ValueError saying what SGLang would run instead."""
    if any(_field(w, "type") == "float" and _field(w, "num_bits") == "4" for w in weights):
        strategies = {_field(w, "strategy") for w in weights}
        if "tensor_group" in strategies:
            raise ValueError(
                "SGLang runs compressed-tensors NVFP4 (CompressedTensorsW4A4Nvfp4MoE / W4A16Nvfp4MoE); refitd's "
                "SGLang adapter publishes NVFP4 under ModelOpt's names: start SGLang from "
                "sglang_quantization_config() (quant_method modelopt, quant_algo NVFP4)"
            )
        raise ValueError(MXFP4_REFUSAL)
    groups = set()
    for w, a in zip(weights, input_activations, strict=True):
        kind, strategy, group = _field(w, "type"), _field(w, "strategy"), _field(w, "group_size")
        if kind != "int" or _field(w, "num_bits") != "4" or strategy != "group" or a is not None:
            raise ValueError(
                f"SGLang runs a compressed-tensors scheme refitd does not publish ({kind} {_field(w, 'num_bits')}-bit, "
                f"{strategy}, activations {'quantized' if a is not None else 'BF16'}); refitd's is symmetric INT4 "
                "pack-quantized per group with BF16 activations: start SGLang from sglang_quantization_config()"
            )
        if _field(w, "symmetric") not in (None, "true") or _field(w, "actorder") not in (
            None,
            "false",
            "none",
        ):
            raise ValueError(
                "SGLang's INT4 config is asymmetric or has an activation order (zero points / g_idx); refitd "
                "publishes symmetric INT4 without one: start SGLang from sglang_quantization_config()"
            )
        groups.add(int(group or 0))
    if len(groups) != 1:
        raise ValueError(f"compressed-tensors INT4 with group sizes {sorted(groups)}: refitd publishes one")
    return Format.INT4_W4A16, FormatParams(int4_group=groups.pop())


def int4_params_from_engine(
    scale: tuple[Any, tuple[int, ...]] | None, hidden: int, config_params: FormatParams
) -> tuple[FormatParams, str | None]:
    """INT4's format parameters as SGLang holds them: the group from ``w13_weight_scale [E, H/g, 2I]``
    (checked against the config's), the scale dtype from that parameter's (the model dtype)."""
    if scale is None or len(scale[1]) != 3:
        return config_params, f"an INT4 MoE layer without a 3-D w13_weight_scale: {scale}"
    dtype, rows = scale[0], scale[1][1]
    group = config_params.int4_group
    if rows * group != hidden:
        return config_params, (
            f"w13_weight_scale has {rows} groups along H = {hidden}, not one per {group} (the config's group_size)"
        )
    name = str(dtype).removeprefix("torch.")
    try:
        return FormatParams(int4_group=group, int4_scale_dtype=name), None
    except ValueError:
        return config_params, (
            f"SGLang holds the INT4 group scales in {name} (the model dtype); refitd publishes bfloat16 or float32 "
            "scales: start SGLang with --dtype bfloat16"
        )


def unpacked_k(fmt: Format, packed: int) -> int:
    """K of a packed 4-bit expert weight's packed dim (two E2M1 codes a byte, eight nibbles an int32)."""
    return packed * (INT4_PACK if fmt is Format.INT4_W4A16 else 2)


def four_bit_problems(
    fmt: Format, params: FormatParams, h: int | None, part: int | None, info: Mapping[str, Any]
) -> list[str]:
    """What SGLang 0.5.23 cannot reload for a 4-bit expert format, one line each with SGLang's reason:
    the K multiples (``h``: H; ``part``: I per rank), parameters that lost their ``weight_loader`` to
    processing, and MXFP4 (never loadable)."""
    if not fmt.four_bit:
        return []
    if fmt is Format.MXFP4:
        return [MXFP4_REFUSAL]
    if fmt is Format.NVFP4 and params.nvfp4_names is not Nvfp4Names.MODELOPT:
        return ["SGLang's refitd adapter publishes NVFP4 under ModelOpt's names only"]
    out = []
    multiple = params.k_multiple(fmt)
    what = "one scale per 16 along K (ModelOptNvFp4FusedMoEMethod: hidden_size // group_size scale columns)"
    if fmt is Format.INT4_W4A16:
        what = f"one scale per group of {multiple} along K (CompressedTensorsWNA16MoE: hidden_size // group_size)"
    if multiple and h is not None and h % multiple:
        out.append(
            f"SGLang's {fmt.value} MoE needs hidden_size = {h} to be a multiple of {multiple} ({what}); this model "
            f"cannot run in {fmt.value} in SGLang: pick an FP8 format"
        )
    if multiple and part is not None and part % multiple:
        out.append(
            f"SGLang's {fmt.value} MoE needs moe_intermediate_size / tp = {part} to be a multiple of {multiple} "
            f"({what}, within a rank's shard): pick a --tp-size that keeps it aligned, or set --ep-size"
        )
    lost = list(info.get(INFO_NO_LOADER) or ())
    if lost:
        backend = info.get(INFO_MOE_BACKEND) or "auto"
        cap = info.get(INFO_CAPABILITY)
        gpu = f" on SM{cap}" if cap else ""
        if fmt is Format.NVFP4:
            why = (
                f"SGLang runs NVFP4 MoE through Marlin{gpu} (moe_runner_backend {backend}; the auto choice on "
                "SM80-SM99, modelopt_quant.py:2379), whose prepare_moe_nvfp4_layer_for_marlin "
                "(marlin_utils_fp4.py:530) replaced them with parameters without a weight_loader and "
                "ModelOptNvFp4FusedMoEMethod has no restore_weights_before_loading, so no update can load them: "
                "serve NVFP4 on SM100+ with --moe-runner-backend flashinfer_trtllm / flashinfer_cutlass / "
                "flashinfer_cutedsl, or publish int4_w4a16 (Marlin, reloadable) or block_fp8 on this GPU"
            )
        else:
            why = (
                f"SGLang picked CompressedTensorsWNA16TritonMoE{gpu} (moe_runner_backend {backend}; the auto "
                "choice on SM100/SM103, compressed_tensors.py:927), whose processing replaced them with uint8 "
                "parameters without a weight_loader and marks the layer converted (compressed_tensors_wNa16_moe.py"
                ":507-531), so no update can load them: start SGLang with --moe-runner-backend marlin "
                "(CompressedTensorsWNA16MoE repacks in place and restores before each update)"
            )
        out.append(
            f"SGLang cannot reload its {fmt.value} experts ({len(lost)} parameters, e.g. {lost[0]}): {why}"
        )
    return out
