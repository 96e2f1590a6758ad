"""TensorRT-LLM (PyTorch backend) adapter: manifest, MoE backend rules, LLM kwargs, Ray worker extension.

TensorRT-LLM is never imported at module level: ``import adapters.trtllm`` works without it, and only
the worker extension's methods (which run inside TRT-LLM's Ray workers) import it. Everything else
is pure and tested against facts transcribed from TRT-LLM's source (``tests/data/manifests/``).

Wiring (one source of truth: the daemon's :class:`~sidecar.plan.build.RefitSpec`)::

    from tensorrt_llm import LLM
    from adapters.trtllm import refit_engine, trtllm_llm_args

    llm = LLM(model=model_dir, **trtllm_llm_args(spec, hf_config, sm=100))
    llm._collective_rpc("refit_attach", args=(endpoint,))   # refused, listing mismatches, if plans differ
    for step in range(steps):
        refit_engine(llm, min_step=step)                     # RefitError naming every failed worker

Facts this module relies on, by source file (NVIDIA/TensorRT-LLM as stored; commits where known):

* ``_torch/modules/fused_moe/create_moe.py`` (01f8de52) ``get_moe_cls``: CUTLASS -> CutlassFusedMoE;
  TRTLLM -> TRTLLMGenFusedMoE only for fp8_block_scales (and FP4 modes), otherwise a warning and
  CutlassFusedMoE; CUTEDSL -> CuteDslFusedMoE only for fp8_block_scales/nvfp4; DEEPGEMM ->
  DeepGemmFusedMoE. With ``ENABLE_CONFIGURABLE_MOE=1`` (default) the layer is a ``ConfigurableMoE``
  whose ``backend`` is the implementation; ``_torch/modules/fused_moe/moe_resolution.py`` (newer)
  ``resolve_moe_cls`` does the same per layer, Cutlass being the fallback of every family.
* ``fused_moe_trtllm_gen.py``: TRTLLMGenFusedMoE raises on SM >= 120; its kernels are Blackwell-only.
* ``_torch/model_config.py`` (008e0af8) ``resolve_moe_backend``: AUTO -> TRTLLM for FP8_BLOCK_SCALES on
  SM100f, else CUTLASS. ``load_hf_quant_config``: ``quant_method == "fp8"`` with ``weight_block_size``
  -> FP8_BLOCK_SCALES (``modules_to_not_convert`` become ``exclude_modules``); ``quant_method ==
  "mxfp8"`` with ``weight_block_size [1, 32]`` -> MXFP8; a ModelOpt config (``quant_method:
  "modelopt"``, ``quant_algo``, ``ignore``; ``quantization/modelopt_config.py``) gives per-tensor FP8.
  ``model_kwargs`` are set on the pretrained config before the quant config is read.
* ``_torch/modules/fused_moe/quantization.py`` (newest stored): ``DeepSeekFP8BlockScalesFusedMoEMethod``
  holds ``w3_w1_weight`` fp8 [E_local, 2*I_part, H] (W31: rows [0, I_part) = w3 = up_proj),
  ``w3_w1_weight_scaling_factor`` fp32 [E_local, 2*ceil(I_part/128), ceil(H/128)], ``w2_weight`` fp8
  [E_local, H, I_part], ``w2_weight_scaling_factor`` fp32 [E_local, ceil(H/128), ceil(I_part/128)];
  it reads ``{e}.w1/w3/w2.weight_scale_inv`` and asserts ``I_part % 128 == 0``.
  ``FP8QDQFusedMoEMethod`` holds ``fc31_dequant``/``fc2_dequant`` fp32 [E_local], ``fc2_quant`` and
  ``fc31_input_dequant`` fp32 0-d; it reads ``{e}.w{1,3,2}.weight_scale`` and, for *every* expert,
  ``{e}.w{1,3,2}.input_scale`` into ``torch.empty`` buffers (missing ones stay garbage), then sets
  ``fc31_input_dequant = max(w1/w3 input scales)`` and ``fc2_quant = 1 / max(w2 input scales)``.
  ``DeepSeekFP8BlockScalesFusedMoEMethodDeepGemm`` resmooths scales to UE8M0 when
  ``is_sm_100f() or sm == 120``. Partial loading is accepted for unquantized, FP8QDQ, block-FP8
  (incl. DeepGemm) and NVFP4 methods only. ``MXFP8CutlassFusedMoEMethod`` (per a TRT-LLM unit test
  of it; path not resolved) holds int32-packed scales [E, 2*I_part, H/128] and
  [E, H, I_part/128] and needs SM100+.
* NVFP4 (``quantization.py``@a98a9061; ``MOE_DEVELOPER_GUIDE.md``@04c2347b): ``NVFP4FusedMoEMethod``
  holds packed ``w3_w1_weight`` / ``w2_weight`` (CUTLASS int64, 16 values each; TRTLLM-Gen uint8),
  ``w3_w1_weight_scale`` / ``w2_weight_scale`` (CUTLASS int32, 4 float8 each; TRTLLM-Gen float8), 0-d
  ``fc31_input_scale`` / ``fc2_input_scale`` (``max(input_scale).reciprocal()`` over every expert, whose
  ``{e}.w1/w3/w2.input_scale`` it reads) and ``fc31_alpha`` / ``fc2_alpha`` [E]; it reads
  ``{e}.w{1,3,2}.weight / weight_scale / weight_scale_2``. NVFP4 MoE kernels: CUTLASS SM100/103/120/121,
  TRTLLM-Gen SM100/103, none in DeepGEMM; Marlin (W4A16) on SM89-99. ``NVFP4LinearMethod``
  (``linear.py``) holds a uint8 ``weight`` [out, in/2] with ``input_scale`` and ``alpha``.
* ``_torch/models/checkpoints/hf/qwen2_moe_weight_mapper.py`` (Qwen3 MoE) and
  ``qwen3_5_weight_mapper.py`` / ``qwen3_5_moe_weight_mapper.py``: per-expert names are renamed
  ``gate_proj -> w1``, ``up_proj -> w3``, ``down_proj -> w2`` (scale and input_scale suffixes ride
  along); a module whose weights contain ``gate_up_proj`` loads as FUSED_GATE_UP_PROJ; Qwen3.5 strips
  ``model.language_model.`` to ``model.``, drops ``model.visual.*`` and packs ``in_proj_qkv + z`` /
  ``in_proj_b + a`` (all parts must arrive in one reload call).
* ``_torch/pyexecutor/model_loader.py``: ``ModelLoader.reload(model, weights, allow_partial_loading)``;
  ``load_format="dummy"`` fills every float parameter uniformly in [-1e-3, 1e-3] (no usable input
  scales). ``llmapi/rlhf_utils.py`` ``WorkerExtension.update_weights``: ``pre_reload_weights()`` once per
  cycle, ``reload(..., allow_partial_loading=True)``, then finalize: ``process_weights_after_loading()``
  and ``post_load_weights()`` on every module not ``_weights_removed``, MoE load balancer
  ``register_weight_slots_after_to_cuda()`` + ``finalize_model()``, ``reset_prefix_cache()``, then
  synchronize / gc / ``ipc_collect`` / ``empty_cache``. The Ray GPU worker's ``_inject_worker_extension``: an
  extension class is mixed into the worker; any non-dunder attribute the worker already has is an error.
  ``llmapi/llm.py``: ``LLM._collective_rpc(method, args=(), kwargs=None, ...) -> list``.
"""

from __future__ import annotations

from adapters.trtllm.args import trtllm_llm_args
from adapters.trtllm.backends import (
    BLOCK_FP8_MOE_ALIGN,
    EXTENSION_QUALNAME,
    MXFP8_MOE_ALIGN,
    REQUESTED_BACKENDS,
    MoeBackend,
    backend_refusal,
    backend_table,
    backend_table_markdown,
    resolve_moe_backend,
)
from adapters.trtllm.checkpoint import build_manifest
from adapters.trtllm.checks import check_trtllm_constraints
from adapters.trtllm.worker import RefitWorkerExtension, refit_engine

__all__ = [
    "BLOCK_FP8_MOE_ALIGN",
    "EXTENSION_QUALNAME",
    "MXFP8_MOE_ALIGN",
    "REQUESTED_BACKENDS",
    "MoeBackend",
    "RefitWorkerExtension",
    "backend_refusal",
    "backend_table",
    "backend_table_markdown",
    "build_manifest",
    "check_trtllm_constraints",
    "refit_engine",
    "resolve_moe_backend",
    "trtllm_llm_args",
]
