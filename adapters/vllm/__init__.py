"""The vLLM adapter: a manifest from vLLM's parameters, the ``LLM(...)`` arguments, and a worker extension.

Three parts, and only the last one imports vLLM (inside its functions, so ``import adapters.vllm``
works on a machine without vLLM). Modules: ``quant`` (the quantization config in force, the loader's
constants), ``checkpoint`` (part 1), ``checks`` (the constraint check), ``backends`` (the 4-bit MoE
backends per GPU the check applies), ``carry`` (NVFP4's carried activation scales), ``args`` (part 2),
``worker`` (part 3); this package re-exports the public names.

1. :func:`build_manifest` (pure): vLLM's load-time parameters ``(name, dtype, shape)``, the model's
   Hugging Face config and the quantization config in force -> the :class:`Manifest` of checkpoint
   tensors the engine's loader expects. It inverts what vLLM's loader does with checkpoint names:
   ``experts.w13_* <- experts.{e}.gate_proj (shard w1) + experts.{e}.up_proj (shard w3)``,
   ``experts.w2_* <- experts.{e}.down_proj``, packed linears (``qkv_proj <- q/k/v_proj``,
   ``gate_up_proj <- gate/up_proj``, Qwen3.5's ``in_proj_qkvz <- in_proj_qkv/z`` and
   ``in_proj_ba <- in_proj_b/a``, DeepSeek's ``fused_qkv_a_proj <- q_a_proj/kv_a_proj_with_mqa``), and the Qwen3.5 ``hf_to_vllm_mapper`` prefixes. Shapes are the
   GLOBAL checkpoint shapes whatever the tensor/expert parallelism (vLLM's loader slices), so every
   worker of one engine sends the same tensor list. :func:`check_vllm_constraints` lists what vLLM's
   MoE kernels cannot take.
2. :func:`vllm_engine_args` (pure): the one place the engine's quantization is decided. It returns
   the ``LLM(...)`` keyword arguments whose quantization config keeps in BF16 exactly what the refit
   plan keeps in BF16, and :data:`VLLM_ENV` holds the environment that keeps FP32 block scales.
3. :class:`RefitWorkerExtension` and :func:`refit_engine`: the engine-touching surface, driven by
   ``llm.collective_rpc``. Loading goes through vLLM's own loader (layerwise reload), never by
   writing kernel layouts.

Facts taken from vLLM's source (stored copies of vllm-project/vllm; commit of the copy read):

* ``models/qwen3_moe.py`` @2e0831b: packed ``qkv_proj <- q/k/v_proj``; router ``mlp.gate`` is a
  ``ReplicatedLinear`` built WITH the quant config (so Fp8Config quantizes it unless ignored);
  experts through ``make_expert_params_mapping(gate_proj, down_proj, up_proj)``.
* ``models/qwen3_5.py`` @00def4f and ``models/qwen3_next.py`` @6365b38: Qwen3.5 MoE packs
  ``in_proj_qkvz <- in_proj_qkv, in_proj_z`` and ``in_proj_ba <- in_proj_b, in_proj_a``; full
  attention ``qkv_proj`` carries the output gate; ``mlp.gate`` (quantized unless ignored),
  ``mlp.shared_expert_gate`` (never quantized), ``mlp.shared_expert.gate_up_proj/down_proj``; MTP
  names (``mtp.``) are skipped by the main model's loader; grouped slabs ``experts.gate_up_proj`` /
  ``experts.down_proj`` load through a fused mapping that, once one slab was seen in a
  ``load_weights`` call, stays in force for the rest of the call (per-expert names after it are
  skipped with a warning): :func:`ordered_weights` sends slabs last.
* ``models/qwen3_vl.py`` (``Qwen3VLForConditionalGeneration.hf_to_vllm_mapper``):
  ``model.language_model. -> language_model.model.``, ``model.visual. -> visual.``,
  ``lm_head. -> language_model.lm_head.``.
* ``layers/fused_moe`` ``make_expert_params_mapping``: params ``experts.[routed_experts.][base_layer.]
  w13_`` / ``w2_``, weight names ``experts.{e}.{gate|up|down}_proj.``, shards w1/w3/w2 (the
  ``routed_experts`` infix is in the newer ``RoutedExperts`` copy; older copies have none).
* ``layers/quantization/fp8.py`` @1436674: ``Fp8Config.from_config`` reads ``quant_method``,
  ``activation_scheme``, ``ignored_layers`` (else ``modules_to_not_convert``), ``weight_block_size``;
  block quantization needs ``activation_scheme == "dynamic"``; ``apply_vllm_mapper`` maps
  ``ignored_layers`` through the model's ``hf_to_vllm_mapper``. ``Fp8MoEMethod.create_weights``:
  ``w13_weight [E, 2I/tp, H]``, ``w2_weight [E, H, I/tp]``, block scales
  ``w13_weight_scale_inv [E, 2*ceil(I/tp/128), ceil(H/128)]``, ``w2_weight_scale_inv
  [E, ceil(H/128), ceil(I/tp/128)]``; per-tensor ``w13_weight_scale [E, 2]``, ``w2_weight_scale
  [E]``; static activations add ``w13_input_scale`` / ``w2_input_scale``; block quantization raises
  unless ``(I/tp) % 128 == 0``.
* ``layers/quantization/utils/quant_utils.py`` @4de0dd6 ``is_layer_skipped``: exact membership of
  the module name (no wildcards); a packed module is skipped when all its shards are listed (some but
  not all is an error); an experts module is skipped when an ignored name containing ``experts``
  contains its name.
* ``layers/quantization/modelopt.py`` (@c9a5990 and a newer stored copy): ModelOpt configs read
  ``quant_algo`` and ``ignore`` (``quantization.exclude_modules`` in the legacy file), matched exactly,
  by substring and by ``fnmatch``; ``ModelOptMxFp8Config.get_name() == "modelopt_mxfp8"``; the MXFP8
  MoE holds ``w13_weight_scale`` uint8 ``[E, 2I, H/32]`` and ``w2_weight_scale [E, H, I/32]``.
* ``model_executor/model_loader/reload/layerwise.py`` @fc26ee2 and ``reload/__init__.py`` @ceb32e7:
  ``record_metadata_for_reloading(model)``, ``initialize_layerwise_reload(model)``,
  ``finalize_layerwise_reload(model, model_config)``; per-module ``restore_metadata`` keeps the
  load-time parameters as meta tensors. vLLM's own worker runs ``initialize_layerwise_reload`` ->
  ``model.load_weights`` -> ``finalize_layerwise_reload`` under ``torch.device(self.device)``;
  ``GPUModelRunner.reload_weights(weights_iterator=..., is_checkpoint_format=True)`` wraps it.
* vLLM 0.33.0 (the wheel; ``make test-engines`` runs this module against it): ``reload/layerwise.py``
  exports ``get_layerwise_info(module)`` (its ``restore_metadata`` are the load-time parameters);
  ``v1/worker/gpu_worker.py`` ``start_weight_update`` / ``update_weights`` / ``finish_weight_update``
  and ``reload_weights`` run under ``with set_current_vllm_config(self.vllm_config)``, and
  ``config/vllm.py`` ``get_current_vllm_config()`` raises outside it (PR #31747); workers reach the
  model through ``model_runner.get_model()``; MoE parameters live on ``mlp.experts.routed_experts``
  (``MoERunner.routed_experts``); ``utils/deep_gemm.py`` ``is_deep_gemm_e8m0_used()`` is True on any
  DeepGEMM-capable GPU (Hopper or Blackwell) unless ``VLLM_USE_DEEP_GEMM_E8M0=0``.
* vLLM 0.33.0, run on CPU with its real model classes (``tests/test_engine_vllm_models.py``):
  ``models/deepseek_v2.py`` packs ``fused_qkv_a_proj <- q_a_proj, kv_a_proj_with_mqa`` when
  ``q_lora_rank`` is set, and MLA's processing adds ``W_UV`` / ``W_UK_T`` (no checkpoint tensor);
  ``reload/meta.py SKIP_TENSORS`` (``bias``, ``e_score_correction_bias``) are never in the layerwise
  metadata; ``QwenGatedDeltaNetAttention`` holds ``A_log`` in FP32 (the loader upcasts BF16);
  ``ModelConfig.language_model_only`` drops Qwen3.5's vision tower (still constructed, so its
  linears stay in the quant config's ignore list); ``GPUModelRunner.reload_weights`` resets the
  LoRA, encoder and multimodal caches after a reload; ``Worker.start_draft_weight_update`` reloads
  ``get_draft_model()`` with ``speculative_config.draft_model_config``; ``oracle/fp8.py
  resolve_fp8_moe_weight_block_shape`` refines a block-FP8 MoE block to ``gcd(128, I/tp, H)`` (>= 32)
  and upsamples the scales at load; transformers 5.x writes ``num_local_experts`` for Qwen3-MoE.
* ``vllm/envs.py``: ``VLLM_USE_DEEP_GEMM_E8M0`` (default 1: "use E8M0 scaling when DeepGEMM is used
  on Blackwell GPUs"), ``VLLM_USE_DEEP_GEMM``, ``VLLM_MOE_USE_DEEP_GEMM``.
* ``vllm/config/parallel.py``: ``worker_extension_cls`` is "dynamically inherited by the worker
  class ... for use in collective_rpc calls"; ``vllm/engine/arg_utils.py``: ``quantization``,
  ``hf_overrides``, ``load_format``, ``dtype``.
"""

from __future__ import annotations

from adapters.vllm.args import bf16_modules, vllm_engine_args
from adapters.vllm.checkpoint import build_manifest, routed_bf16_modules
from adapters.vllm.checks import check_vllm_constraints, fallback_note
from adapters.vllm.quant import (
    BLOCK_FP8_ALIGN,
    MXFP8_ALIGN,
    PARAM_SOURCE_LAYERWISE,
    PARAM_SOURCE_LIVE,
    VLLM_ENV,
    WORKER_EXTENSION,
    VllmQuant,
    resolve_quant,
)
from adapters.vllm.serving import ServingRefit, refit_serving_engine
from adapters.vllm.worker import (
    RefitWorkerExtension,
    engine_parameters,
    engine_parameters_and_source,
    load_generation,
    ordered_weights,
    refit_engine,
)

__all__ = [
    "BLOCK_FP8_ALIGN",
    "MXFP8_ALIGN",
    "PARAM_SOURCE_LAYERWISE",
    "PARAM_SOURCE_LIVE",
    "VLLM_ENV",
    "WORKER_EXTENSION",
    "RefitWorkerExtension",
    "ServingRefit",
    "VllmQuant",
    "bf16_modules",
    "build_manifest",
    "check_vllm_constraints",
    "engine_parameters",
    "engine_parameters_and_source",
    "fallback_note",
    "load_generation",
    "ordered_weights",
    "refit_engine",
    "refit_serving_engine",
    "resolve_quant",
    "routed_bf16_modules",
    "vllm_engine_args",
]
