"""What vLLM's MoE kernels cannot take (SPEC §2.4): the manifest's EngineConstraints plus vLLM's own
rules; ``EngineWorker.attach`` runs :func:`check_vllm_constraints` before the daemon is contacted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from adapters.vllm.backends import four_bit_gpu_problems
from adapters.vllm.quant import FOUR_BIT_K_MULTIPLE, PARAM_SOURCE_LIVE
from sidecar.numerics.formats import Format
from sidecar.plan.build import RefitPlan
from sidecar.plan.models import get_model, model_type_of, normalize_hf_config
from sidecar.protocol.manifest import Manifest


def _moe_dims(plan_or_config: RefitPlan | Mapping[str, Any]) -> tuple[int, int]:
    """(H, I) of the routed experts, from a plan's inputs or a config.json dict."""
    if isinstance(plan_or_config, RefitPlan):
        model = plan_or_config.spec.model
        for i in plan_or_config.inputs:
            if (
                model.slab_re is not None
                and (m := model.slab_re.match(i.name))
                and m["proj"] == "gate_up_proj"
            ):
                return i.shape[2], i.shape[1] // 2
            if (m := model.per_expert_re.match(i.name)) and m["proj"] == "gate_proj":
                return i.shape[1], i.shape[0]
        raise ValueError("the plan has no routed experts")
    text = get_model(model_type_of(plan_or_config)).text_config(normalize_hf_config(plan_or_config))
    return int(text["hidden_size"]), int(text["moe_intermediate_size"])


def check_vllm_constraints(
    manifest: Manifest, plan_or_config: RefitPlan | Mapping[str, Any] | None = None
) -> list[str]:
    """What vLLM's MoE kernels cannot take (SPEC §2.4), one line each naming the engine setting that
    would work; empty when all is well. ``EngineWorker.attach`` runs it before contacting the daemon.

    The alignment rules are the manifest's :class:`EngineConstraints` (the daemon runs the same
    ones); H and I come from ``plan_or_config`` when given, else from what the manifest recorded.
    """
    h, i = _moe_dims(plan_or_config) if plan_or_config is not None else (None, None)
    fmt = manifest.expert_format
    problems = manifest.constraints.problems(hidden=h, intermediate=i)
    if fmt is Format.BLOCK_FP8 and manifest.info.get("deep_gemm_e8m0") is True:
        problems.append(
            "vLLM reports is_deep_gemm_e8m0_used() = True: DeepGEMM would round the FP32 block scales refitd "
            "publishes to UE8M0 powers of two (Hopper too: the flag alone decides); start every vLLM process "
            "with VLLM_USE_DEEP_GEMM_E8M0=0 (adapters.vllm.VLLM_ENV)"
        )
    problems += _four_bit_k_problems(fmt, h, i, manifest)
    problems += _four_bit_gpu_problems(fmt, h, i, manifest)
    static = sorted(t.name for t in manifest.tensors if t.name.endswith(".input_scale"))
    if static:
        problems.append(
            f"the engine expects static activation scales ({len(static)} tensors, e.g. {static[0]}); "
            "refitd publishes none: set activation_scheme 'dynamic' in the quantization config "
            "(vllm_engine_args does)"
        )
    return problems


def fallback_note(manifest: Manifest) -> str:
    """What an attach refusal must add when the manifest was read from live parameters: shapes after
    ``process_weights_after_loading``, which may differ from what the loader takes."""
    if manifest.info.get("param_source") != PARAM_SOURCE_LIVE:
        return ""
    return (
        " (note: this vLLM exposes no layerwise-reload metadata (reload.layerwise.get_layerwise_info), so "
        "the manifest was read from the live, post-processing parameters and a shape mismatch may be "
        "spurious; use a vLLM with model_loader/reload, e.g. 0.33.0)"
    )


def _four_bit_gpu_problems(fmt: Format, h: int | None, i: int | None, manifest: Manifest) -> list[str]:
    """No vLLM MoE backend for this 4-bit format on the worker's GPU (``info["device_capability"]``,
    recorded by ``refit_manifest``; :mod:`adapters.vllm.backends`)."""
    c = manifest.constraints
    h = h if h is not None else c.hidden_size
    i = i if i is not None else c.intermediate_size
    tp = c.moe_tp_size or 1
    capability = manifest.info.get("device_capability")
    per_rank = i // tp if i is not None else None
    return four_bit_gpu_problems(fmt, int(capability) if capability is not None else None, h, per_rank)


def _four_bit_k_problems(fmt: Format, h: int | None, i: int | None, manifest: Manifest) -> list[str]:
    """4-bit MoE K multiples (:data:`FOUR_BIT_K_MULTIPLE`, INT4's the manifest's group): H for w13,
    each rank's I for w2."""
    multiple = FOUR_BIT_K_MULTIPLE.get(fmt) and manifest.format_params.k_multiple(fmt)
    if multiple is None:
        return []
    c = manifest.constraints
    h = h if h is not None else c.hidden_size
    i = i if i is not None else c.intermediate_size
    tp = c.moe_tp_size or 1
    problems = []
    if h is not None and h % multiple:
        problems.append(
            f"vLLM's {fmt.value} MoE needs hidden_size = {h} to be a multiple of {multiple} (one scale per "
            f"{multiple} along K of gate/up_proj); this model cannot run in {fmt.value}: pick an FP8 format"
        )
    if i is not None and (i % tp or (i // tp) % multiple):
        problems.append(
            f"vLLM's {fmt.value} MoE needs moe_intermediate_size / tp = {i}/{tp} to be a multiple of "
            f"{multiple} (one scale per {multiple} along K of down_proj, within a rank's shard): pick a "
            "tensor_parallel_size that keeps it aligned, or set enable_expert_parallel=True"
        )
    return problems
