"""Which vLLM 0.33.0 MoE backend takes refitd's 4-bit experts on a given GPU, and what no backend can
run (pure; ``check_vllm_constraints`` calls :func:`four_bit_gpu_problems` at attach).

The GPU is the worker's ``current_platform.get_device_capability().to_int()`` (``major * 10 +
minor``: 80 = A100, 90 = H100/H200, 100 = B200, 103 = B300, 120 = RTX 50), recorded by
``RefitWorkerExtension.refit_manifest`` as ``manifest.info["device_capability"]`` (None off CUDA: no
per-GPU rule applies). Each rule below is transcribed from the vLLM 0.33.0 wheel's source, file named:

* **NVFP4** (``ModelOptNvFp4FusedMoE``, ``fused_moe/oracle/nvfp4.py select_nvfp4_moe_backend``):
  W4A4 kernels (FlashInfer TRT-LLM / CuteDSL / CUTLASS, vLLM CUTLASS) need SM100+; Marlin (SM75+,
  ``marlin_moe.py MarlinExpertsBase._supports_current_device``) and the Triton EMULATION experts take
  it below. Not refused on SM75+ (:data:`adapters.vllm.quant.NVFP4_MOE_BACKENDS`).
* **INT4 W4A16** (``CompressedTensorsWNA16MoEMethod``, ``fused_moe/oracle/int_wna16.py
  _get_priority_backends`` on CUDA): FLASHINFER_TRTLLM (``TrtLlmMxint4ExpertsMonolithic``: capability
  family 100, FlashInfer's MXINT4 MoE importable, ``kInt4Static32`` without zero points or bias) >
  MARLIN (SM75+, and ``marlin_utils.check_moe_marlin_supports_config``: ``hidden_size % 128 == 0``,
  ``I/tp % max(64, group) == 0``, group in -1/32/64/128) > BATCHED_MARLIN > TRITON
  (``TritonWNA16Experts``: any CUDA GPU) > HUMMING > EMULATION (``Int4EmulationTritonExperts``: any
  CUDA GPU). Triton WNA16 runs wherever Marlin does not, so INT4 W4A16 is never refused for the GPU.
* **MXFP4** (``CompressedTensorsW4A4Mxfp4MoEMethod.__init__``, no oracle call unless ``moe_backend``
  is b12x or a FlashInfer MoE-EP megakernel): ``CutlassExpertsMxfp4`` (W4A4, activations quantized
  to MXFP4 on the fly) where ``ops.mxfp4_experts_quant_supported(capability)``, which is
  ``100 <= capability < 120`` in a CUDA >= 12.9 build (``csrc/quantization/fp4/mxfp4_experts_quant.cu
  mxfp4_experts_quant_sm_supported``); XPU; else ``MarlinExperts`` (W4A16) after
  ``prepare_moe_fp4_layer_for_marlin``, whose ``gptq_marlin_repack`` checks a 16 x 64 tile
  (``csrc/quantization/marlin/gptq_marlin_repack.cu``: ``size_k % 16``, ``size_n % 64``; w13 is
  ``[2I/tp, H]``, w2 ``[H, I/tp]``), and ``make_mxfp4_moe_kernel`` refuses Marlin below SM75
  (``MarlinExperts does not support this MoE deployment``). So: below SM75 no backend; on a Marlin GPU
  ``hidden_size`` must be a multiple of 64.
"""

from __future__ import annotations

from sidecar.numerics.formats import INT4_GROUP, Format

#: ``MarlinExpertsBase._supports_current_device``: ``has_device_capability((7, 5))``
MARLIN_MIN_CAPABILITY = 75
#: ``mxfp4_experts_quant_sm_supported``: CUTLASS MXFP4 W4A4 experts on ``[100, 120)``
CUTLASS_MXFP4_CAPABILITIES = range(100, 120)
#: ``gptq_marlin_repack``'s tile: ``size_n % 64`` (``size_k % 16`` is implied by the 4-bit K multiples)
MARLIN_TILE_N = 64
#: ``check_moe_marlin_supports_config`` (WNA16 Marlin): ``hidden_size % 128``, ``I/tp % max(64, group)``
WNA16_MARLIN_HIDDEN, WNA16_MARLIN_INTERMEDIATE = 128, max(64, INT4_GROUP)


def _family(capability: int) -> int:
    """``is_device_capability_family(100)``: the same major (100 and 103)."""
    return capability // 10 * 10


def four_bit_moe_backends(fmt: Format, capability: int, hidden: int, intermediate_per_rank: int) -> list[str]:
    """The MoE backends vLLM 0.33.0 can pick for ``fmt`` on this GPU and shape, in its priority order
    (the first one is the automatic choice when it is available); empty when none can run."""
    if fmt is Format.INT4_W4A16:
        out = []
        if _family(capability) == 100:
            out.append("FLASHINFER_TRTLLM")  # when FlashInfer's MXINT4 MoE is installed
        if (
            capability >= MARLIN_MIN_CAPABILITY
            and hidden % WNA16_MARLIN_HIDDEN == 0
            and intermediate_per_rank % WNA16_MARLIN_INTERMEDIATE == 0
        ):
            out += ["MARLIN", "BATCHED_MARLIN"]
        return [*out, "TRITON", "EMULATION"]
    if fmt is Format.MXFP4:
        if capability in CUTLASS_MXFP4_CAPABILITIES:
            return ["CUTLASS_MXFP4_MXFP4"]  # CutlassExpertsMxfp4 (in a CUDA >= 12.9 build)
        if capability >= MARLIN_MIN_CAPABILITY and hidden % MARLIN_TILE_N == 0:
            return ["MARLIN"]
        return []
    if fmt is Format.NVFP4:
        w4a4 = ["FLASHINFER_TRTLLM", "FLASHINFER_CUTEDSL", "FLASHINFER_CUTLASS", "VLLM_CUTLASS"]
        below = ["MARLIN"] if capability >= MARLIN_MIN_CAPABILITY else []
        return [*(w4a4 if capability >= 100 else []), *below, "EMULATION"]
    return []


def four_bit_gpu_problems(
    fmt: Format, capability: int | None, hidden: int | None, intermediate_per_rank: int | None
) -> list[str]:
    """What vLLM cannot run for ``fmt`` on this GPU, one line each with vLLM's reason and what works
    instead; empty when a backend exists or the GPU or shape is unknown."""
    if capability is None or hidden is None or intermediate_per_rank is None or not fmt.four_bit:
        return []
    if four_bit_moe_backends(fmt, capability, hidden, intermediate_per_rank):
        return []
    sm = f"SM{capability}"
    if fmt is Format.MXFP4 and capability < MARLIN_MIN_CAPABILITY:
        return [
            f"vLLM has no MXFP4 MoE backend on {sm}: compressed-tensors MXFP4 runs CUTLASS W4A4 on SM100-SM119 "
            f"(mxfp4_experts_quant_supported) and Marlin W4A16 elsewhere, which needs SM75+ ('MarlinExperts does "
            "not support this MoE deployment since kernel does not support current device'); publish int4_w4a16 "
            "or an FP8 format for this GPU"
        ]
    if fmt is Format.MXFP4:
        return [
            f"vLLM's MXFP4 MoE on {sm} is Marlin W4A16, whose repack (gptq_marlin_repack, a 16 x 64 tile) needs "
            f"hidden_size = {hidden} to be a multiple of {MARLIN_TILE_N} ('size_n = {hidden} is not divisible by "
            f"tile_n_size = {MARLIN_TILE_N}' for down_proj); serve MXFP4 on SM100-SM119 (CUTLASS W4A4), or "
            "publish int4_w4a16 or an FP8 format"
        ]
    return [f"vLLM 0.33.0 has no {fmt.value} MoE backend on {sm}; publish an FP8 format"]
