"""Every reason a TRT-LLM engine cannot take refitd's generations: the backend rules, the manifest's
EngineConstraints, NVFP4's K multiples, static input scales, quantized non-expert modules.
``EngineWorker.attach`` runs it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from adapters.trtllm.backends import (
    NVFP4_CUTLASS_K_MULTIPLE,
    NVFP4_MOE_K_MULTIPLE,
    MoeBackend,
    backend_refusal,
)
from sidecar.numerics.formats import FP8_DTYPE, Format
from sidecar.plan.models import PER_EXPERT_RE, SLAB_RE, get_model, model_type_of
from sidecar.protocol.manifest import Manifest


def _routed_weight(name: str) -> bool:
    base = re.sub(r"\.(weight_scale_inv|weight_scale_2|weight_scale|input_scale)$", ".weight", name)
    return bool(SLAB_RE.match(base) or PER_EXPERT_RE.match(base))


def check_trtllm_constraints(manifest: Manifest, config: Mapping[str, Any] | None = None) -> list[str]:
    """Every reason this TRT-LLM engine cannot take refitd's generations; empty means fine.

    ``config`` is the model's Hugging Face config (for H and I; default: what the manifest recorded).
    Checks the resolved MoE backend against the expert format, the kernels' alignment per
    tensor-parallel rank (the manifest's :class:`EngineConstraints`, which the daemon runs too),
    static input scales for per-tensor FP8, and non-expert modules the engine holds in FP8 (refitd
    publishes them BF16). ``EngineWorker.attach`` runs it before contacting the daemon.
    """
    problems: list[str] = []
    fmt, backend = manifest.expert_format, manifest.moe_backend
    sm = manifest.info.get("sm")
    hidden = inter = None
    if config is not None:
        text = get_model(model_type_of(config)).text_config(config)
        hidden, inter = int(text["hidden_size"]), int(text["moe_intermediate_size"])
    backends = [b for b in str(backend).split(",") if b] or [""]
    for one in backends:  # a model whose layers resolved differently lists every class
        why = backend_refusal(
            fmt,
            one,
            sm,
            quant_method=str(manifest.info.get("moe_quant_method") or ""),
            mxfp8_reload=manifest.info.get("mxfp8_reload_path"),
        )
        if why is not None:
            problems.append(why)
    # backend_refusal names the backend that cannot hold the format, with the setting that can
    shared = replace(manifest.constraints, unsupported_formats=frozenset())
    problems += shared.problems(hidden=hidden, intermediate=inter)
    if fmt is Format.NVFP4:
        problems += _nvfp4_k_problems(manifest, hidden, inter)
    if fmt in (Format.FP8_PER_TENSOR, Format.NVFP4) and manifest.info.get("input_scales") is not True:
        what = "per-tensor FP8" if fmt is Format.FP8_PER_TENSOR else "NVFP4 (W4A4)"
        problems.append(
            f"{what} MoE needs a static input_scale for every expert, which refitd does not "
            f"publish: load a calibrated {what} checkpoint (load_format='auto') so the engine "
            "holds them, or pass input_scale= to refit_attach"
        )
    for label, dtype in (("FP8", FP8_DTYPE), ("NVFP4", torch.uint8)):
        modules = sorted(
            {
                t.name.removesuffix(".weight")
                for t in manifest.tensors
                if t.dtype == dtype and t.name.endswith(".weight") and not _routed_weight(t.name)
            }
        )
        if modules:
            shown = ", ".join(modules[:8]) + (f" and {len(modules) - 8} more" if len(modules) > 8 else "")
            problems.append(
                f"the engine holds {len(modules)} non-expert modules in {label} ({shown}), but refitd "
                "publishes everything outside the routed experts in BF16; list them in "
                "modules_to_not_convert / exclude_modules (trtllm_llm_args does)"
            )
    return problems


def _nvfp4_k_problems(manifest: Manifest, hidden: int | None, inter: int | None) -> list[str]:
    """NVFP4 MoE K multiples after TP slicing: one block scale per 16 along K, so H (gate/up's K) and
    each rank's I (down_proj's K) must be multiples of 16. TRT-LLM allocates ``hidden_size //
    scaling_vector_size // block_scales_vec_size`` and ``intermediate_size_per_partition //
    scaling_vector_size // block_scales_vec_size`` scale elements (``NVFP4FusedMoEMethod.create_weights``
    @a98a9061, floored) and row-splits the checkpoint's [H, I/16] down_proj scale across the MoE TP ranks
    (``load_weight_shard``); expert parallelism splits no K. CutlassFusedMoE packs 4 float8 scales per
    int32 (``block_scales_vec_size = 4``, loaded with ``.view(int32)``): K a multiple of 64 there;
    TRTLLM-Gen keeps one float8 per scale: 16."""
    c = manifest.constraints
    h = hidden if hidden is not None else c.hidden_size
    i = inter if inter is not None else c.intermediate_size
    cutlass = MoeBackend.CUTLASS in str(manifest.moe_backend).split(",")
    k = NVFP4_CUTLASS_K_MULTIPLE if cutlass else NVFP4_MOE_K_MULTIPLE
    why = (
        f"{MoeBackend.CUTLASS} packs 4 float8 block scales (one per {NVFP4_MOE_K_MULTIPLE}) per int32 word "
        "along K"
        if cutlass
        else f"one float8 block scale per {k} along K"
    )
    fix = " (or moe_config backend='TRTLLM' on SM100/SM103, which needs 16)" if cutlass else ""
    tp, problems = c.moe_tp_size or 1, []
    if h is not None and h % k:
        problems.append(
            f"TRT-LLM's NVFP4 MoE needs hidden_size = {h} to be a multiple of {k} ({why}, gate/up_proj); "
            f"this model cannot run in nvfp4 here: set the daemon's format to block_fp8{fix}"
        )
    if i is not None and i % tp == 0 and (i // tp) % k:  # a ragged split: EngineConstraints says so
        problems.append(
            f"TRT-LLM's NVFP4 MoE needs moe_intermediate_size / tp = {i}/{tp} to be a multiple of {k} ({why}, "
            "down_proj, within a rank's shard): set moe_tensor_parallel_size (or moe_expert_parallel_size, "
            f"which keeps I whole) so that it is{fix}"
        )
    return problems
