"""One source of truth: the ``LLM(...)`` arguments whose quantization keeps in BF16 exactly what the
refit plan keeps in BF16 (pure).
"""

from __future__ import annotations

import fnmatch
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from adapters.vllm.fourbit import four_bit_quantization
from adapters.vllm.quant import WORKER_EXTENSION
from sidecar.numerics.formats import BLOCK, Format
from sidecar.plan.build import RefitSpec
from sidecar.plan.models import get_model, model_type_of, normalize_hf_config


def bf16_modules(spec: RefitSpec, hf_config: Mapping[str, Any], *, include_vision: bool = True) -> list[str]:
    """Checkpoint module names the engine must leave unquantized so that it holds in BF16 exactly
    what the refit plan publishes in BF16: every module that is not a routed expert (attention,
    linear attention, router, shared expert and its gate, embeddings, lm_head, vision tower), plus
    the routed experts of the first/last BF16 layers and of ``ignore_patterns``, as whole
    ``…mlp.experts`` modules (vLLM keeps experts BF16 per layer, not per expert)."""
    hf_config = normalize_hf_config(hf_config)
    model = get_model(model_type_of(hf_config))
    if model.model_type != spec.model.model_type:
        raise ValueError(f"the config describes {model.model_type} but the spec says {spec.model_type}")
    layers = model.num_hidden_layers(hf_config)
    spec.check_layer_counts(layers)
    out: dict[str, None] = {}
    routed: dict[str, list[tuple[str, int | None]]] = defaultdict(list)
    vision = include_vision and isinstance(hf_config.get("vision_config"), Mapping)
    for name, _, _ in model.parameters(hf_config, include_mtp=True, include_vision=vision):
        r = model.slab_re.match(name) if model.slab_re is not None else None
        r = r or model.per_expert_re.match(name)
        if r is not None:  # EXPERT_PREFIX's group 2: a decoder layer (None for an MTP layer)
            layer = int(r[2]) if r[2] else None
            if layer is not None and model.mtp_layer(layer, layers) is not None:
                layer = None  # DeepSeek's model.layers.{N}: an MTP layer, not counted by first/last
            routed[r["prefix"]].append((name.removesuffix(".weight"), layer))
        elif name.endswith(".weight") and "norm" not in name.rsplit(".", 2)[-2]:
            out.setdefault(name.removesuffix(".weight"))
    for prefix, members in routed.items():
        kept = [_kept(spec, layer, layers, module) for module, layer in members]
        if all(kept):
            out.setdefault(prefix)
        elif any(kept):
            raise ValueError(
                f"ignore_patterns {list(spec.ignore_patterns)} keep only some experts of {prefix}; vLLM "
                "holds a layer's experts all in BF16 or all quantized: widen the pattern to the layer"
            )
    return list(out)


def with_vllm_aliases(ignored: list[str]) -> list[str]:
    """``ignored`` plus the names vLLM matches a quantization config's exclusions against where they
    differ from the checkpoint's: DeepSeekMTP builds an MTP layer's ``shared_head.head`` under the
    prefix ``model.layers.{N}.head`` (deepseek_mtp.py SharedHead); ModelOpt would quantize that head
    otherwise (vLLM 0.33.0, run on CPU in tests/test_engine_vllm_models.py)."""
    return ignored + [
        m.replace(".shared_head.head", ".head") for m in ignored if m.endswith(".shared_head.head")
    ]


def _kept(spec: RefitSpec, layer: int | None, layers: int, module: str) -> bool:
    if spec.format is Format.BF16:
        return True
    if layer is not None and (
        layer < spec.num_first_layers_in_bf16 or layer >= layers - spec.num_last_layers_in_bf16
    ):
        return True
    return any(fnmatch.fnmatchcase(module, p) for p in spec.ignore_patterns)


def vllm_engine_args(
    spec: RefitSpec, hf_config: Mapping[str, Any], *, include_vision: bool = True, nvfp4_w4a4: bool = False
) -> dict[str, Any]:
    """The ``LLM(...)`` keyword arguments for an engine that refitd refits with ``spec``.

    ``include_vision=False`` for a text-only trainer of a multimodal model (Qwen3.5): the engine is
    started with ``language_model_only=True`` and builds no vision tower. Start every engine process
    with :data:`VLLM_ENV` in its environment too. ``nvfp4_w4a4=True`` with NVFP4 under compressed-tensors'
    names starts W4A4 (its calibrated activation global scales then come from the engine's first load,
    a calibrated checkpoint rather than ``dummy``, and are carried over). ``load_format="dummy"``:
    the first refit fills the engine, so wait for it before serving.
    """
    # the vision tower stays BF16 either way: with language_model_only vLLM still constructs it
    # (then drops it), and the quant config's create_weights runs for every linear constructed
    ignored = with_vllm_aliases(bf16_modules(spec, hf_config, include_vision=True))
    args: dict[str, Any] = {
        "load_format": "dummy",
        "dtype": "bfloat16",
        "worker_extension_cls": WORKER_EXTENSION,
    }
    if not include_vision and isinstance(hf_config.get("vision_config"), Mapping):
        # vLLM builds a multimodal model's vision tower unless told not to; a text-only trainer
        # sends none of model.visual.*, so the engine must not expect them (EngineArgs /
        # ModelConfig.language_model_only, vLLM 0.33.0)
        args["language_model_only"] = True
    fmt = spec.format
    if fmt is Format.INT4_W4A16 and spec.params.int4_scale_dtype != "bfloat16":
        raise ValueError(
            f"int4_w4a16 with {spec.params.int4_scale_dtype} scales: vLLM 0.33.0's CompressedTensorsWNA16MoEMethod "
            "holds the group scales in the model dtype (create_weights: params_dtype), bfloat16 here, so it "
            "cannot hold them; plan with int4_scale_dtype='bfloat16' (the engine's manifest says so at attach)"
        )
    if nvfp4_w4a4 and not fmt.four_bit:
        raise ValueError(f"nvfp4_w4a4 is an NVFP4 choice; the experts are {fmt.value}")
    if fmt.four_bit:
        quantization, qc4 = four_bit_quantization(fmt, ignored, spec.params, nvfp4_w4a4=nvfp4_w4a4)
        return {**args, "quantization": quantization, "hf_overrides": {"quantization_config": qc4}}
    if fmt is Format.BF16:
        return {**args, "quantization": None}
    if fmt is Format.MXFP8:
        qc: dict[str, Any] = {"quant_method": "modelopt", "quant_algo": "MXFP8", "ignore": ignored}
        return {**args, "quantization": "modelopt_mxfp8", "hf_overrides": {"quantization_config": qc}}
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "ignored_layers": ignored}
    if fmt is Format.BLOCK_FP8:
        qc["weight_block_size"] = [BLOCK, BLOCK]
    return {**args, "quantization": "fp8", "hf_overrides": {"quantization_config": qc}}
