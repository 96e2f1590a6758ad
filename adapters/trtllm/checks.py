"""Every reason a TRT-LLM engine cannot take refitd's generations: the backend rules, the manifest's
EngineConstraints, static input scales, FP8 non-expert modules. ``EngineWorker.attach`` runs it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from adapters.trtllm.backends import (
    backend_refusal,
)
from sidecar.numerics.formats import FP8_DTYPE, Format
from sidecar.plan.models import PER_EXPERT_RE, SLAB_RE, get_model, model_type_of
from sidecar.protocol.manifest import Manifest


def _routed_weight(name: str) -> bool:
    base = re.sub(r"\.(weight_scale_inv|weight_scale|input_scale)$", ".weight", name)
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
    if fmt is Format.FP8_PER_TENSOR and manifest.info.get("input_scales") is not True:
        problems.append(
            "per-tensor FP8 MoE needs a static input_scale for every expert, which refitd does not "
            "publish: load a calibrated per-tensor FP8 checkpoint (load_format='auto') so the engine "
            "holds them, or pass input_scale= to refit_attach"
        )
    fp8_modules = sorted(
        {
            t.name.removesuffix(".weight")
            for t in manifest.tensors
            if t.dtype == FP8_DTYPE and not _routed_weight(t.name)
        }
    )
    if fp8_modules:
        shown = ", ".join(fp8_modules[:8]) + (
            f" and {len(fp8_modules) - 8} more" if len(fp8_modules) > 8 else ""
        )
        problems.append(
            f"the engine holds {len(fp8_modules)} non-expert modules in FP8 ({shown}), but refitd publishes "
            "everything outside the routed experts in BF16; list them in modules_to_not_convert "
            "(trtllm_llm_args does)"
        )
    return problems
