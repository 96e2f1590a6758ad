"""The SGLang adapter: the checkpoint's ``quantization_config``, a manifest from SGLang's own
parameters, a custom weight loader run inside SGLang's schedulers, and the driver's refit sequence.

Only ``loader`` imports SGLang, inside its functions, so ``import adapters.sglang`` works without it.

Start SGLang from a checkpoint whose ``config.json`` carries :func:`sglang_quantization_config`
(``refitd convert`` writes one) with ``--custom-weight-loader adapters.sglang.loader.refit_loader``,
``--dp-size 1`` and the environment :data:`SGLANG_ENV`; then, from the driver::

    refit_engine(engine, "ipc:///run/refitd/control.sock", min_step=step)

Facts taken from SGLang 0.5.23 (the wheel; ``make test-sglang`` runs this adapter against it):

* ``managers/scheduler_components/weight_updater.py``: ``update_weights_from_tensor`` and
  ``update_weights_from_distributed`` are refused outside a session opened by
  ``begin_weight_update()`` and closed by ``end_weight_update()``; a successful update marks the
  session loaded, and ``end_weight_update`` then runs ``DefaultModelLoader.postprocess_weights``
  (every quant method's ``process_weights_after_loading``) once for the whole model.
* ``model_executor/model_runner_components/weight_updater.py``: ``begin_weight_update`` ->
  ``DefaultModelLoader.restore_weights_before_loading``; ``update_weights_from_tensor(named_tensors,
  load_format)`` calls ``dynamic_import(load_format)(model, named_tensors)`` when ``load_format`` is
  in ``custom_weight_loaders`` (``--custom-weight-loader``), in every TP scheduler process; its
  return value is ignored, and an exception ends the scheduler (``run_scheduler_process``).
* ``model_loader/loader.py`` ``DefaultModelLoader.load_weights_only``: for ``quant_config.get_name()
  == "mxfp8"`` renames ``*.weight_scale`` to ``*.weight_scale_inv`` (plain ``model.load_weights``
  would skip them silently), then one ``model.load_weights`` call.
* ``models/qwen3_moe.py`` / ``models/deepseek_v2.py`` ``load_weights``: ``stacked_params_mapping``
  ``qkv_proj <- q/k/v_proj``, ``gate_up_proj <- gate/up_proj``; DeepSeek with ``q_lora_rank`` packs
  ``fused_qkv_a_proj_with_mqa <- q_a_proj, kv_a_proj_with_mqa`` and concatenates the pair inside one
  call; unknown names are skipped without a word. ``FusedMoE.make_expert_params_mapping``:
  ``experts.w13_`` <- ``experts.{e}.gate_proj/up_proj``, ``experts.w2_`` <- ``down_proj`` (no
  ``routed_experts`` infix). Qwen3-MoE's router ``mlp.gate`` is a ``ReplicatedLinear`` built
  without the quant config: BF16 under ``Fp8Config``.
* ``layers/quantization/fp8.py``: ``Fp8Config.from_config`` reads ``quant_method`` ("mxfp8" in it:
  MXFP8), ``activation_scheme``, ``ignored_layers`` / ``modules_to_not_convert``,
  ``weight_block_size``; ``utils.is_layer_skipped`` matches module paths, with fallback shards for
  ``qkv_proj`` / ``gate_up_proj`` and prefix matching for experts. Per-tensor ``Fp8MoEMethod``
  replaces ``w13_weight_scale`` in ``process_weights_after_loading`` with a parameter without
  ``weight_loader`` (refused at attach); DeepGEMM on SM100/SM120 requantizes block scales to UE8M0
  (``SGLANG_ENABLE_JIT_DEEPGEMM=0`` avoids it); ``update_weights_from_tensor`` does not support
  ``dp_size > 1``.
* the 4-bit formats (NVFP4 under ModelOpt's names, INT4 W4A16 compressed-tensors ``pack-quantized``;
  MXFP4 refused) and what SGLang cannot reload in them: ``adapters.sglang.fourbit``'s docstring.
"""

from __future__ import annotations

from adapters.sglang.checkpoint import build_manifest, check_sglang_constraints
from adapters.sglang.driver import refit_engine
from adapters.sglang.quant import (
    CONTROL_NAME,
    LOADER,
    SGLANG_ENV,
    SglangQuant,
    bf16_modules,
    resolve_quant,
    sglang_quantization_config,
)

__all__ = [
    "CONTROL_NAME",
    "LOADER",
    "SGLANG_ENV",
    "SglangQuant",
    "bf16_modules",
    "build_manifest",
    "check_sglang_constraints",
    "refit_engine",
    "resolve_quant",
    "sglang_quantization_config",
]
