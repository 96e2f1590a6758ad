"""vLLM 0.33.0's Marlin weight repack on CPU, for the MXFP4 engine tests (``make test-engines`` only).

compressed-tensors MXFP4 (``CompressedTensorsW4A4Mxfp4MoEMethod``) has no backend choice to replace:
its constructor takes CUTLASS on GPUs where ``mxfp4_experts_quant_supported`` (SM100), else Marlin,
and its ``process_weights_after_loading`` then runs ``marlin_utils_fp4.prepare_moe_fp4_layer_for_marlin``.
Two parts of that cannot run against the CPU torch, and are replaced here:

* ``torch.ops._C.gptq_marlin_repack`` (``csrc/quantization/marlin/gptq_marlin_repack.cu``, a
  ``vllm._C`` op that does not load): registered under that name, in this process only, as vLLM's
  OWN pure-torch reference of the Marlin layout, ``quantization/utils/marlin_utils_test.py``
  ``marlin_weights(q_w, size_k, size_n, num_bits, get_weight_perm(num_bits, is_a_8bit))``, applied
  to the GPTQ-packed input unpacked (the inverse of ``quant_utils.pack_rows``). vLLM's own
  ``tests/kernels/quantization/test_marlin_gemm.py::test_gptq_marlin_repack`` asserts on GPU that
  the CUDA op equals exactly this (``gptq_pack(q_w)`` in, ``marlin_weights(q_w, ...)`` expected).
  Only the layout is reproduced: 4- and 8-bit, no act-order permutation (0.33.0's op takes none).
* ``MarlinExpertsBase._supports_current_device`` (``p.is_cuda() and has_device_capability((7, 5))``)
  answers True, so that ``make_mxfp4_moe_kernel`` builds ``MarlinExperts`` on a CPU; its quant
  scheme, activation and parallel-config checks stay vLLM's. No Marlin kernel ever runs here.

Everything else of the MXFP4 processing is vLLM's (``marlin_permute_scales``,
``mxfp4_marlin_process_scales``, ``replace_parameter``, ``MarlinExperts`` and its
``process_weights_after_loading``).
"""

from __future__ import annotations

import torch

#: the Marlin tile the CUDA repack checks size_k and size_n against (``marlin::tile_k_size`` = 16,
#: ``marlin::tile_n_size`` = 64: ``STD_TORCH_CHECK``s at the top of ``gptq_marlin_repack``), raised alike here
TILE_K, TILE_N = 16, 64
_SCHEMA = "gptq_marlin_repack(Tensor b_q_weight, SymInt size_k, SymInt size_n, int num_bits, bool is_a_8bit=False) -> Tensor"
_LIBRARY: torch.library.Library | None = None


def unpack_rows(packed: torch.Tensor, num_bits: int, size_k: int, size_n: int) -> torch.Tensor:
    """``[size_k / (32 / num_bits), size_n]`` int32 -> ``[size_k, size_n]`` int32 codes: the inverse of
    vLLM's ``quant_utils.pack_rows`` (row ``j`` of each group of ``32 / num_bits`` in bits ``num_bits * j``)."""
    factor = 32 // num_bits
    if tuple(packed.shape) != (size_k // factor, size_n) or size_k % factor:
        raise ValueError(
            f"a GPTQ-packed [{size_k}/{factor}, {size_n}] int32 tensor, got {tuple(packed.shape)}"
        )
    words = packed.to(torch.int64) & 0xFFFFFFFF
    mask = (1 << num_bits) - 1
    rows = torch.stack([(words >> (num_bits * j)) & mask for j in range(factor)], dim=1)
    return rows.reshape(size_k, size_n).to(torch.int32)


def gptq_marlin_repack(
    b_q_weight: torch.Tensor, size_k: int, size_n: int, num_bits: int, is_a_8bit: bool = False
) -> torch.Tensor:
    """vLLM's reference Marlin layout of a GPTQ-packed weight (see the module docstring)."""
    from vllm.model_executor.layers.quantization.utils.marlin_utils_test import (
        get_weight_perm,
        marlin_weights,
    )

    if num_bits not in (4, 8):
        raise ValueError(f"gptq_marlin_repack: num_bits {num_bits}, Marlin packs 4 or 8")
    if b_q_weight.dtype != torch.int32 or not b_q_weight.is_contiguous():
        raise ValueError(
            "gptq_marlin_repack: b_q_weight must be a contiguous int32 tensor (as the CUDA op checks)"
        )
    if size_k % TILE_K or size_n % TILE_N:
        raise ValueError(
            f"gptq_marlin_repack: size_k {size_k} % {TILE_K} and size_n {size_n} % {TILE_N} must be 0"
        )
    q_w = unpack_rows(b_q_weight, num_bits, size_k, size_n)
    perm = get_weight_perm(num_bits, is_a_8bit)
    return marlin_weights(q_w, size_k, size_n, num_bits, perm, is_a_8bit=is_a_8bit).to(b_q_weight.device)


def install() -> None:
    """Register the repack under ``torch.ops._C`` (when ``vllm._C`` did not) and let ``MarlinExperts``
    be built on CPU. Idempotent; the engines venv's test processes only."""
    global _LIBRARY
    if not hasattr(torch.ops._C, "gptq_marlin_repack") and _LIBRARY is None:
        lib = torch.library.Library("_C", "FRAGMENT")
        lib.define(_SCHEMA)
        lib.impl("gptq_marlin_repack", gptq_marlin_repack, "CPU")
        _LIBRARY = lib
    from vllm.model_executor.layers.fused_moe.experts.marlin_moe import MarlinExpertsBase

    MarlinExpertsBase._supports_current_device = staticmethod(lambda: True)
