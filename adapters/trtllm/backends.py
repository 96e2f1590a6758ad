"""TRT-LLM's MoE backend rules: which backend resolves for a format on a GPU, and which ones refitd
refuses (one source of truth for the code and docs/engines.md's table).
"""

from __future__ import annotations

from sidecar.numerics.formats import BLOCK, FP8_FORMATS, NVFP4_BLOCK, Format

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
#: NVFP4 MoE kernels (W4A4) of CutlassFusedMoE: SM100/103/120/121 (MOE_DEVELOPER_GUIDE.md@04c2347b,
#: "Backend Capability Matrix", row NVFP4); TRTLLMGenFusedMoE's are SM100f only
NVFP4_CUTLASS_SMS = frozenset({100, 103, 120, 121})
#: NVFP4 MoE K granularity: one float8 block scale per 16 along K (``scaling_vector_size=16``)
NVFP4_MOE_K_MULTIPLE = NVFP4_BLOCK
#: NVFP4 scales per int32 word in CutlassFusedMoE (``block_scales_vec_size = 32 // 8``): it allocates
#: ``hidden_size // 16 // 4`` words per row (floored, quantization.py@a98a9061 ``NVFP4FusedMoEMethod.
#: create_weights``) and loads each scale with ``.view(int32)``, so K must be a multiple of 64 there
NVFP4_CUTLASS_SCALES_PER_WORD = 4
NVFP4_CUTLASS_K_MULTIPLE = NVFP4_BLOCK * NVFP4_CUTLASS_SCALES_PER_WORD
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
    the quant mode and never at the GPU: TRTLLM -> TRTLLMGenFusedMoE for fp8_block_scales or nvfp4 on
    any SM (else CutlassFusedMoE with a warning); CUTEDSL -> CuteDslFusedMoE for fp8_block_scales or
    nvfp4 (else Cutlass); DEEPGEMM -> DeepGemmFusedMoE whatever the format; AUTO is ``model_config.
    resolve_moe_backend`` (@008e0af8): TRTLLM for FP8_BLOCK_SCALES on SM100f, else CUTLASS (NVFP4
    included; only W4A16_NVFP4, which refitd does not configure, goes elsewhere). Whether
    the resolved class can keep what refitd publishes is :func:`backend_refusal`'s question.
    Raises ValueError for a backend refitd has no rule for.
    """
    fmt = Format.parse(expert_format)
    req = str(requested).strip().upper()
    if req == "AUTO":
        req = "TRTLLM" if fmt is Format.BLOCK_FP8 and sm in SM100F else "CUTLASS"
    if req == "CUTLASS":
        return MoeBackend.CUTLASS
    if req == "TRTLLM":  # has_fp8_block_scales() or has_nvfp4() (or TRT-LLM's other 4-bit algos)
        return MoeBackend.TRTLLM_GEN if fmt in (Format.BLOCK_FP8, Format.NVFP4) else MoeBackend.CUTLASS
    if req == "CUTEDSL":  # has_fp8_block_scales() or has_nvfp4()
        return MoeBackend.CUTEDSL if fmt in (Format.BLOCK_FP8, Format.NVFP4) else MoeBackend.CUTLASS
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
        return _four_bit_refusal(fmt, backend, sm)
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


#: TRT-LLM's MXFP4 MoE methods and the checkpoint names they read (quantization.py@a98a9061)
_MXFP4_REFUSAL = (
    "TensorRT-LLM cannot load refitd's mxfp4 experts: refitd publishes compressed-tensors names "
    "(.weight_packed uint8, .weight_scale E8M0 bytes; SPEC §2.3), but TRT-LLM's MXFP4 MoE methods read "
    "'{e}.w1.weight' with '{e}.w1.weight_scale_inv' (WFP4A16FusedMoEMethod.load_quant_scales, W4A16_MXFP4, "
    "SM90 only) or '{e}.w1.weight' with '{e}.w1.weight_scale' quantizing the activations too "
    "(MXFP4WeightFusedMoEMethod / W4A8_MXFP4_*, which ModelConfig.get_mxfp4_quant_algo picks on SM100+): "
    "refit TensorRT-LLM in nvfp4 (Blackwell) or block_fp8 instead (set the daemon's format to one of them)"
)
_INT4_REFUSAL = (
    "TensorRT-LLM has no MoE that loads refitd's int4_w4a16 experts: its only INT4 MoE method is "
    "WInt4AFP8FusedMoEMethod (W4A8 AWQ: FP8 activations, SM89/SM90, reads ModelOpt's '{e}.w1.weight' int8-"
    "packed with .weight_scale, .weight_scale_2, .pre_quant_scale and .input_scale; quantization.py@a98a9061), "
    "and MOE_DEVELOPER_GUIDE.md@04c2347b lists no backend for INT4 weight-only MoE; refitd publishes "
    "compressed-tensors pack-quantized (.weight_packed int32, .weight_scale, .weight_shape): refit "
    "TensorRT-LLM in nvfp4 (Blackwell) or block_fp8 instead (set the daemon's format to one of them)"
)


def _four_bit_refusal(fmt: Format, backend: str, sm: int | None) -> str | None:
    """Why ``backend`` on ``sm`` cannot run refitd's 4-bit ``fmt`` experts (None: it can).

    NVFP4 (W4A4, ModelOpt names, which TRT-LLM's NVFP4 MoE methods read): MOE_DEVELOPER_GUIDE.md
    @04c2347b's capability matrix gives Cutlass SM100/103/120/121, TRTLLMGen SM100/103, DeepGemm none,
    CuteDSL SM100/103/120/121 (CuteDslB12xFusedMoE on SM120/121), Marlin SM89-SM99 (W4A16 dequant);
    refitd allows the two whose reload it has read: NVFP4CutlassFusedMoEMethod and
    NVFP4TRTLLMGenFusedMoEMethod (quantization.py). MXFP4 and INT4 W4A16: no TRT-LLM loader reads
    refitd's compressed-tensors names (the refusals quote what TRT-LLM reads instead).
    """
    if fmt is Format.MXFP4:
        return _MXFP4_REFUSAL
    if fmt is Format.INT4_W4A16:
        return _INT4_REFUSAL
    if sm is not None and sm not in NVFP4_CUTLASS_SMS:
        hopper = (
            "on SM89-SM99 TRT-LLM runs NVFP4 MoE only as MarlinFusedMoE (FP4 weights, BF16 activations), "
            "whose repacked reload refitd has not verified"
            if 89 <= sm < 100
            else "TRT-LLM has no NVFP4 MoE kernel for it"
        )
        return (
            f"TRT-LLM's NVFP4 MoE kernels need SM100/SM103/SM120/SM121 (CUTLASS) or SM100/SM103 (TRTLLM-Gen), "
            f"not sm={sm} ({hopper}; MOE_DEVELOPER_GUIDE.md@04c2347b); serve nvfp4 on Blackwell or set the "
            "daemon's format to block_fp8"
        )
    if backend == MoeBackend.CUTLASS:
        return None
    if backend == MoeBackend.TRTLLM_GEN:
        if sm is not None and sm not in SM100F:
            return (
                f"{backend} NVFP4 kernels exist only for SM100/SM103, not sm={sm} (it raises on SM >= 120); set "
                "moe_config backend='CUTLASS'"
            )
        return None
    if backend == MoeBackend.DEEPGEMM:
        return (
            f"{backend} has no NVFP4 kernel (FP8 block scales only; MOE_DEVELOPER_GUIDE.md@04c2347b); set "
            "moe_config backend='CUTLASS' (or 'TRTLLM' on SM100/SM103)"
        )
    return (
        f"refitd has not verified the NVFP4 reload of {backend} (its quant method keeps its own scale layout); "
        "set moe_config backend='CUTLASS' (or 'TRTLLM' on SM100/SM103)"
    )


def backend_table() -> list[tuple[str, str, int, str, str | None]]:
    """Every (format, requested backend, SM) -> (resolved class, refusal or None): the table
    docs/engines.md shows (``tests/test_adapter_trtllm.py`` checks the doc against it)."""
    rows = []
    for fmt in (Format.BLOCK_FP8, Format.FP8_PER_TENSOR, Format.MXFP8, Format.NVFP4):
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
    """The expert formats the resolved class cannot hold at all (the daemon checks the manifest's
    list; refitd's MXFP4 and INT4 names have no TRT-LLM loader, see :func:`_four_bit_refusal`)."""
    quantized = [f.value for f in Format if f.quantized]
    nvfp4 = Format.NVFP4.value
    supported = {
        MoeBackend.CUTLASS: [f.value for f in FP8_FORMATS] + [nvfp4],
        MoeBackend.TRTLLM_GEN: [Format.BLOCK_FP8.value, nvfp4],
        MoeBackend.CUTEDSL: [Format.BLOCK_FP8.value],
        MoeBackend.DEEPGEMM: [Format.BLOCK_FP8.value],
    }.get(moe_backend, [f.value for f in FP8_FORMATS])
    return [f for f in quantized if f not in supported]
