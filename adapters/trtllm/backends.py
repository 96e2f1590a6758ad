"""TRT-LLM's MoE backend rules: which backend resolves for a format on a GPU, and which ones refitd
refuses (one source of truth for the code and docs/engines.md's table).
"""

from __future__ import annotations

from sidecar.numerics.formats import BLOCK, FOUR_BIT_ENGINE_REFUSAL, FP8_FORMATS, Format

#: what ``LLM(ray_worker_extension_cls=...)`` names
EXTENSION_QUALNAME = "adapters.trtllm.RefitWorkerExtension"
#: CUTLASS MXFP8 MoE packs 4 UE8M0 bytes per int32 along K (MXFP8CutlassFusedMoEMethod)
MXFP8_MOE_ALIGN = 128
#: DeepSeekFP8BlockScalesFusedMoEMethod asserts intermediate_size_per_partition % 128 == 0
BLOCK_FP8_MOE_ALIGN = BLOCK
#: SM100f: the Blackwell family TRTLLM-Gen MoE kernels and TRT-LLM's ``is_sm_100f()`` cover
SM100F = frozenset({100, 103})
#: CUTLASS MXFP8 MoE kernels: SM100/SM103 only (SM107 is served by CuteDSL)
MXFP8_CUTLASS_SMS = frozenset({100, 103})
#: the GPU generations the backend table covers (docs/engines.md)
TABLE_SMS = (90, 100, 103, 107, 120)
_NO_INPUT_SCALES = "static input scales"


class MoeBackend:
    """Resolved MoE implementation class names, as ``type(module).__name__`` reports them."""

    CUTLASS = "CutlassFusedMoE"
    TRTLLM_GEN = "TRTLLMGenFusedMoE"
    CUTEDSL = "CuteDslFusedMoE"
    DEEPGEMM = "DeepGemmFusedMoE"


#: the ``moe_config.backend`` values refitd has a rule for (get_moe_cls's other branches are refused)
REQUESTED_BACKENDS = ("AUTO", "CUTLASS", "TRTLLM", "CUTEDSL", "DEEPGEMM")
#: the block-FP8 quant method that rounds FP32 block scales to UE8M0 on SM100f / SM120
_DEEPGEMM_METHOD = "DeepSeekFP8BlockScalesFusedMoEMethodDeepGemm"


# --------------------------------------------------------------------------------------------------
# backend resolution and the backend table (one source of truth for the code and docs/engines.md)


def resolve_moe_backend(requested: str, expert_format: Format | str, sm: int | None) -> str:
    """The MoE class TRT-LLM builds for ``requested`` (``MoeConfig.backend``) and the experts' format.

    Transcribes ``get_moe_cls`` (``_torch/modules/fused_moe/create_moe.py`` @01f8de52), which looks at
    the quant mode and never at the GPU: TRTLLM -> TRTLLMGenFusedMoE for fp8_block_scales on any SM
    (else CutlassFusedMoE with a warning); CUTEDSL -> CuteDslFusedMoE for fp8_block_scales (else
    Cutlass); DEEPGEMM -> DeepGemmFusedMoE whatever the format; AUTO is ``model_config.
    resolve_moe_backend`` (@008e0af8): TRTLLM for FP8_BLOCK_SCALES on SM100f, else CUTLASS. Whether
    the resolved class can keep what refitd publishes is :func:`backend_refusal`'s question.
    Raises ValueError for a backend refitd has no rule for.
    """
    fmt = Format.parse(expert_format)
    req = str(requested).strip().upper()
    if req == "AUTO":
        req = "TRTLLM" if fmt is Format.BLOCK_FP8 and sm in SM100F else "CUTLASS"
    if req == "CUTLASS":
        return MoeBackend.CUTLASS
    if req == "TRTLLM":
        return MoeBackend.TRTLLM_GEN if fmt is Format.BLOCK_FP8 else MoeBackend.CUTLASS
    if req == "CUTEDSL":
        return MoeBackend.CUTEDSL if fmt is Format.BLOCK_FP8 else MoeBackend.CUTLASS
    if req == "DEEPGEMM":
        return MoeBackend.DEEPGEMM
    raise ValueError(
        f"refitd has no verified rule for TRT-LLM MoE backend {requested!r} with {fmt.value} experts; "
        f"set moe_config backend to one of {', '.join(REQUESTED_BACKENDS)}"
    )


def backend_refusal(
    expert_format: Format | str,
    backend: str,
    sm: int | None,
    *,
    quant_method: str = "",
    mxfp8_reload: bool | None = True,
) -> str | None:
    """Why TRT-LLM's resolved MoE class ``backend`` on SM ``sm`` cannot take refitd's ``expert_format``
    experts, naming the engine setting that would work; None when it can.

    ``sm`` None (unknown) applies only the rules that hold on every GPU. ``quant_method`` is the MoE
    module's resolved quant method class when known: the DeepGEMM block-FP8 method is refused whatever
    class holds it. ``mxfp8_reload`` says whether this TRT-LLM build has the MXFP8 reload path
    (None: unknown, refused; the worker probes it). Facts: ``CutlassFusedMoE._get_quant_method`` picks
    ``DeepSeekFP8BlockScalesFusedMoEMethodDeepGemm`` on SM100f, whose ``_needs_e8m0_resmooth``
    (``is_sm_100f() or sm == 120``) rounds FP32 block scales to UE8M0; ``TRTLLMGenFusedMoE`` kernels
    exist for SM100f and raise on SM >= 120; NeMo-RL's block-FP8 recipe allows only TRTLLM; per-tensor
    FP8 runs as ``FP8QDQFusedMoEMethod`` in CUTLASS; MXFP8 is ``MXFP8CutlassFusedMoEMethod``, SM100/SM103.
    """
    fmt = Format.parse(expert_format)
    where = f"sm={sm}" if sm is not None else "this GPU"
    if not fmt.quantized:
        return None
    if fmt.four_bit:
        return FOUR_BIT_ENGINE_REFUSAL.format(fmt=fmt.value, engine="TensorRT-LLM")
    if fmt is Format.BLOCK_FP8:
        if quant_method == _DEEPGEMM_METHOD and (sm is None or sm in SM100F or sm >= 120):
            return (
                f"{backend} runs block-FP8 through {_DEEPGEMM_METHOD}, which rounds the FP32 block scales "
                f"refitd publishes to UE8M0 on {where}; set moe_config backend='TRTLLM' on SM100/SM103"
            )
        if sm is not None and (sm >= 120 or sm == 107):
            why = (
                "TRTLLMGenFusedMoE raises on SM >= 120, CUTLASS/DeepGEMM resmooth to UE8M0"
                if sm >= 120
                else "TRTLLM-Gen kernels are SM100/SM103 only; refitd has verified no other path there"
            )
            return (
                f"no TRT-LLM MoE backend keeps block-FP8's FP32 scales on sm={sm} ({why}); serve block-FP8 on "
                "SM90 (moe_config backend='CUTLASS') or SM100/SM103 (backend='TRTLLM'), or publish bf16"
            )
        if backend == MoeBackend.TRTLLM_GEN:
            if sm is not None and sm not in SM100F:
                return (
                    f"{backend} kernels exist only for SM100/SM103, not sm={sm}; set moe_config "
                    "backend='CUTLASS' on Hopper"
                )
            return None
        if sm in SM100F:
            return (
                f"{backend} on sm={sm} does not keep block-FP8's FP32 scales (CutlassFusedMoE and DeepGEMM "
                "resmooth them to UE8M0 on Blackwell; NeMo-RL allows only TRTLLM for block-FP8): set "
                "moe_config backend='TRTLLM' (a TRT-LLM that fell back from TRTLLM to CUTLASS lands here too)"
            )
        if backend in (MoeBackend.CUTLASS, MoeBackend.DEEPGEMM):
            return None  # Hopper (or unknown SM): DeepSeekFP8BlockScalesFusedMoEMethod, FP32 scales
        return (
            f"refitd has no verified rule for block-FP8 through {backend}; set moe_config backend='CUTLASS' "
            "on Hopper or 'TRTLLM' on SM100/SM103"
        )
    if backend != MoeBackend.CUTLASS:
        what = "FP8QDQFusedMoEMethod" if fmt is Format.FP8_PER_TENSOR else "MXFP8CutlassFusedMoEMethod"
        return (
            f"{fmt.value} MoE runs only as {what} in {MoeBackend.CUTLASS}, not {backend}; set moe_config "
            "backend='CUTLASS'"
        )
    if fmt is Format.MXFP8:
        if sm is not None and sm not in MXFP8_CUTLASS_SMS:
            hint = (
                "SM107 is served by CuteDSL MXFP8, which refitd has not verified"
                if sm == 107
                else "there are no MXFP8 MoE kernels for it"
            )
            return (
                f"CUTLASS MXFP8 MoE runs on SM100/SM103 only, not sm={sm} ({hint}); serve MXFP8 on SM100/SM103 "
                "or set the daemon's format to block_fp8"
            )
        if mxfp8_reload is not True:
            return (
                "this TensorRT-LLM build has no MXFP8 MoE reload path (MXFP8CutlassFusedMoEMethod with its "
                "scale swizzle in process_weights_after_loading): upgrade TensorRT-LLM, or set the daemon's "
                "format to block_fp8"
            )
    return None


def backend_table() -> list[tuple[str, str, int, str, str | None]]:
    """Every (format, requested backend, SM) -> (resolved class, refusal or None): the table
    docs/engines.md shows (``tests/test_adapter_trtllm.py`` checks the doc against it)."""
    rows = []
    for fmt in (Format.BLOCK_FP8, Format.FP8_PER_TENSOR, Format.MXFP8):
        for req in REQUESTED_BACKENDS:
            for sm in TABLE_SMS:
                resolved = resolve_moe_backend(req, fmt, sm)
                rows.append((fmt.value, req, sm, resolved, backend_refusal(fmt, resolved, sm)))
    return rows


def backend_table_markdown() -> str:
    """:func:`backend_table` as the markdown table in docs/engines.md."""
    lines = [
        "| format | moe_config.backend | SM | resolved class | refitd |",
        "|---|---|---|---|---|",
    ]
    for fmt, req, sm, resolved, why in backend_table():
        verdict = "allowed" if why is None else "refused: " + why.replace("|", "/")
        lines.append(f"| {fmt} | {req} | {sm} | {resolved} | {verdict} |")
    return "\n".join(lines)


def _unsupported_formats(moe_backend: str) -> list[str]:
    quantized = [f.value for f in FP8_FORMATS]
    supported = {
        MoeBackend.CUTLASS: quantized,
        MoeBackend.TRTLLM_GEN: [Format.BLOCK_FP8.value],
        MoeBackend.CUTEDSL: [Format.BLOCK_FP8.value],
        MoeBackend.DEEPGEMM: [Format.BLOCK_FP8.value],
    }.get(moe_backend, quantized)
    return [f for f in quantized if f not in supported]
