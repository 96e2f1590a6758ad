"""The model registry, as data: which tensors are routed experts and what a model's checkpoint holds.

Each supported ``model_type`` is one :class:`ModelSpec` row in :data:`MODELS`. A row says how to find
the text settings inside a Hugging Face ``config.json`` (Qwen3.5 nests them under ``text_config``),
which regexes pick out the routed experts (SPEC §2.1), and how to list every parameter of the
checkpoint from the config alone (names, shapes and each tensor's dtype as Hugging Face writes them:
BF16, except the FP32 router ``e_score_correction_bias`` of the DeepSeek-V3 and GLM-4.5 families).

The listers follow transformers' module registration order (``modeling_qwen3_moe.py``,
``modeling_qwen3_5_moe.py``, ``modeling_deepseek_v3.py``, ``modeling_glm4_moe.py``), so a listing
reads like ``model.state_dict().keys()``. DeepSeek-V3 and GLM-4.5 append their MTP layers as
``model.layers.{num_hidden_layers + n}`` (``ModelSpec.mtp_in_layers``), with their own ``embed_tokens``
and ``shared_head`` copies as the checkpoints hold them. ``ModelSpec.linear_re`` names the linear
layers a block-FP8 checkpoint (``quantization_config.weight_block_size``) stores in FP8 besides the
routed experts: attention projections, dense MLPs and shared experts, never the router, embeddings,
heads, norms or the MTP ``eh_proj``.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "EXPERT_PREFIX",
    "MODELS",
    "PER_EXPERT_RE",
    "SLAB_RE",
    "ExpertForm",
    "ModelSpec",
    "Param",
    "checkpoint_dtype",
    "get_model",
    "model_type_of",
    "normalize_hf_config",
    "with_expert_form",
]

#: SPEC §2.1, verbatim: group 1 is a decoder layer index, group 2 an MTP layer index.
EXPERT_PREFIX = r"(?:(?:model\.)?(?:language_model\.)?layers\.(\d+)|mtp\.layers\.(\d+))\.mlp\.experts"
#: grouped slabs ``{prefix}.gate_up_proj [E, 2I, H]`` / ``{prefix}.down_proj [E, H, I]`` (no ``.weight``)
SLAB_RE = re.compile(rf"^(?P<prefix>{EXPERT_PREFIX})\.(?P<proj>gate_up_proj|down_proj)$")
#: one expert's projection ``{prefix}.{e}.{gate_proj|up_proj|down_proj}.weight``
PER_EXPERT_RE = re.compile(
    rf"^(?P<prefix>{EXPERT_PREFIX})\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)

#: the dtype of a checkpoint parameter unless its lister says otherwise
PARAM_DTYPE = torch.bfloat16
#: the sigmoid router's bias (DeepSeek-V3, GLM-4.5): FP32 in the checkpoints and in the engines
#: (vLLM deepseek_v2.py / glm4_moe.py create it with ``dtype=torch.float32``)
ROUTER_BIAS_DTYPE = torch.float32
#: Qwen3.5 default: every 4th layer is full attention (transformers' Qwen3_5MoeTextConfig)
QWEN3_5_FULL_ATTENTION_INTERVAL = 4
LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"

#: (name, shape, dtype): one checkpoint parameter, as ``RefitPlan.build`` accepts it
Param = tuple[str, tuple[int, ...], torch.dtype]


def _get(cfg: Mapping[str, Any], key: str, default: Any = None, *, model: str) -> Any:
    value = cfg.get(key, default)
    if value is None:
        raise ValueError(f"{model} config has no {key!r}; pass the model's full config.json")
    return value


def _int(cfg: Mapping[str, Any], key: str, default: int | None = None, *, model: str) -> int:
    value = _get(cfg, key, default, model=model)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{model} config {key!r} = {value!r}: expected a non-negative integer")
    return value


# --------------------------------------------------------------------------------------------------
# config field names: transformers writes some fields under other names than the ones refitd reads

#: the field refitd reads -> the other names a ``config.json`` may carry it under. transformers 5.x
#: renames through each config class's ``attribute_map``: ``Qwen3MoeConfig`` maps ``num_experts`` to
#: ``num_local_experts`` (and ``save_pretrained`` writes the latter); ``DeepseekV3Config`` and
#: ``Glm4MoeConfig`` map ``num_local_experts`` to ``n_routed_experts`` and ``num_mtp_layers`` to
#: ``num_nextn_predict_layers``; every 5.x config writes ``dtype`` where 4.x wrote ``torch_dtype``.
CONFIG_ALIASES: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "qwen3_moe": (("num_experts", ("num_local_experts",)),),
    "qwen3_5_moe": (("num_experts", ("num_local_experts",)), ("mtp_num_hidden_layers", ("num_mtp_layers",))),
    "deepseek_v3": (
        ("n_routed_experts", ("num_local_experts", "num_experts")),
        ("num_nextn_predict_layers", ("num_mtp_layers",)),
    ),
    "glm4_moe": (
        ("n_routed_experts", ("num_local_experts", "num_experts")),
        ("num_nextn_predict_layers", ("num_mtp_layers",)),
    ),
}
#: every family: the checkpoint's dtype (read as ``dtype``; 4.x configs say ``torch_dtype``)
DTYPE_ALIASES: tuple[str, tuple[str, ...]] = ("dtype", ("torch_dtype",))
#: nested configs that carry the text model's fields (Qwen3.5, Kimi-K2.5)
NESTED_CONFIG_KEYS = ("text_config",)


def normalize_hf_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` (a ``config.json`` dict, transformers 4.x or 5.x) with the field names refitd reads.

    A field refitd reads (``num_experts``, ``n_routed_experts``, ``num_nextn_predict_layers``,
    ``dtype``) that the config holds only under one of its aliases (:data:`CONFIG_ALIASES`:
    ``num_local_experts``, ``num_mtp_layers``, ``torch_dtype``) is copied to refitd's name, at the
    top level and inside ``text_config``; nothing else changes, and the input is not modified. Two
    names that disagree raise ValueError naming both. Idempotent: every reader of a config calls
    it (the registry's listers, the daemon's plan, the engine adapters' manifests), so a config as
    transformers 5.x ``save_pretrained`` writes it reads the same as a 4.x one.
    """
    if not isinstance(config, Mapping):
        raise ValueError(f"a Hugging Face config must be a dict (config.json), got {type(config).__name__}")
    out = dict(config)
    model_type = config.get("model_type")
    for key in NESTED_CONFIG_KEYS:
        nested = out.get(key)
        if isinstance(nested, Mapping):
            out[key] = _normalized_fields(nested, nested.get("model_type") or model_type, f"{key}.")
    return _normalized_fields(out, model_type, "")


def _normalized_fields(cfg: Mapping[str, Any], model_type: Any, where: str) -> dict[str, Any]:
    out = dict(cfg)
    family = None
    if isinstance(model_type, str):
        family = next((s for s in MODELS.values() if model_type in (s.model_type, *s.aliases)), None)
    pairs = (*CONFIG_ALIASES.get(family.model_type, ()), DTYPE_ALIASES) if family else (DTYPE_ALIASES,)
    for name, aliases in pairs:
        for alias in aliases:
            if out.get(alias) is None:
                continue
            if out.get(name) is None:
                out[name] = out[alias]
            elif out[name] != out[alias]:
                raise ValueError(
                    f"config {where}{name} = {out[name]!r} but {where}{alias} = {out[alias]!r}: they name the "
                    "same setting; keep one (or make them agree)"
                )
    return out


#: ``dtype`` strings a config may give -> torch dtypes
_CONFIG_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def checkpoint_dtype(config: Mapping[str, Any]) -> torch.dtype | None:
    """The dtype the checkpoint stores its parameters in (``dtype``/``torch_dtype``, top level, else
    ``text_config``'s), or None when the config names none. ValueError for one refitd cannot hold."""
    cfg = normalize_hf_config(config)
    value = cfg.get("dtype")
    if value is None and isinstance(cfg.get("text_config"), Mapping):
        value = cfg["text_config"].get("dtype")
    if value is None:
        return None
    name = str(value).removeprefix("torch.")
    if name not in _CONFIG_DTYPES:
        raise ValueError(
            f"config dtype {value!r}: refitd publishes checkpoints in {sorted(_CONFIG_DTYPES)}; fix the config"
        )
    return _CONFIG_DTYPES[name]


# --------------------------------------------------------------------------------------------------
# shared pieces of the Qwen listers


def _attention(p: str, cfg: Mapping[str, Any], model: str, *, output_gate: bool) -> list[Param]:
    """Full attention with q/k norms (Qwen3, Qwen3.5); Qwen3.5's q_proj also emits the output gate."""
    h = _int(cfg, "hidden_size", model=model)
    heads = _int(cfg, "num_attention_heads", model=model)
    kv = _int(cfg, "num_key_value_heads", heads, model=model)
    hd = _int(cfg, "head_dim", h // heads if heads else None, model=model)
    q_rows = heads * hd * (2 if output_gate else 1)
    out: list[Param] = []
    for proj, rows in (("q_proj", q_rows), ("k_proj", kv * hd), ("v_proj", kv * hd)):
        out.append((f"{p}.self_attn.{proj}.weight", (rows, h), PARAM_DTYPE))
        if cfg.get("attention_bias"):
            out.append((f"{p}.self_attn.{proj}.bias", (rows,), PARAM_DTYPE))
    out.append((f"{p}.self_attn.o_proj.weight", (h, heads * hd), PARAM_DTYPE))
    if cfg.get("attention_bias"):
        out.append((f"{p}.self_attn.o_proj.bias", (h,), PARAM_DTYPE))
    out.append((f"{p}.self_attn.q_norm.weight", (hd,), PARAM_DTYPE))
    out.append((f"{p}.self_attn.k_norm.weight", (hd,), PARAM_DTYPE))
    return out


def _mlp(p: str, h: int, inter: int, dtype: torch.dtype = PARAM_DTYPE) -> list[Param]:
    return [
        (f"{p}.gate_proj.weight", (inter, h), dtype),
        (f"{p}.up_proj.weight", (inter, h), dtype),
        (f"{p}.down_proj.weight", (h, inter), dtype),
    ]


def _layer_norms(p: str, h: int) -> list[Param]:
    return [
        (f"{p}.input_layernorm.weight", (h,), PARAM_DTYPE),
        (f"{p}.post_attention_layernorm.weight", (h,), PARAM_DTYPE),
    ]


# --------------------------------------------------------------------------------------------------
# Qwen3 MoE: per-expert names, flat config


def _qwen3_moe_params(config: Mapping[str, Any], *, include_mtp: bool, include_vision: bool) -> list[Param]:
    """``Qwen3MoeForCausalLM``: ``model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight``."""
    del include_mtp, include_vision  # Qwen3 MoE has neither
    m = "qwen3_moe"
    h = _int(config, "hidden_size", model=m)
    vocab = _int(config, "vocab_size", model=m)
    layers = _int(config, "num_hidden_layers", model=m)
    experts = _int(config, "num_experts", model=m)
    moe_inter = _int(config, "moe_intermediate_size", model=m)
    sparse_step = _int(config, "decoder_sparse_step", 1, model=m)
    mlp_only = set(config.get("mlp_only_layers") or ())
    out: list[Param] = [("model.embed_tokens.weight", (vocab, h), PARAM_DTYPE)]
    for layer in range(layers):
        p = f"model.layers.{layer}"
        out += _attention(p, config, m, output_gate=False)
        sparse = layer not in mlp_only and experts > 0 and (layer + 1) % max(sparse_step, 1) == 0
        if sparse:
            out.append((f"{p}.mlp.gate.weight", (experts, h), PARAM_DTYPE))
            for e in range(experts):
                out += _mlp(f"{p}.mlp.experts.{e}", h, moe_inter)
        else:
            out += _mlp(f"{p}.mlp", h, _int(config, "intermediate_size", model=m))
        out += _layer_norms(p, h)
    out.append(("model.norm.weight", (h,), PARAM_DTYPE))
    if not config.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", (vocab, h), PARAM_DTYPE))
    return out


# --------------------------------------------------------------------------------------------------
# Qwen3.5 MoE: grouped slabs, hybrid linear/full attention, shared expert, MTP, optional vision


def qwen3_5_layer_types(text: Mapping[str, Any]) -> list[str]:
    """``layer_types`` if the config lists them, else every ``full_attention_interval``-th is full."""
    m = "qwen3_5_moe"
    layers = _int(text, "num_hidden_layers", model=m)
    types = text.get("layer_types")
    if types is None:
        interval = _int(text, "full_attention_interval", QWEN3_5_FULL_ATTENTION_INTERVAL, model=m)
        return [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(layers)]
    if len(types) != layers or any(t not in (LINEAR_ATTENTION, FULL_ATTENTION) for t in types):
        raise ValueError(
            f"{m} config layer_types must list {layers} entries (num_hidden_layers), each "
            f"{LINEAR_ATTENTION!r} or {FULL_ATTENTION!r}; got {types!r}"
        )
    return list(types)


def _gated_delta_net(p: str, cfg: Mapping[str, Any], m: str) -> list[Param]:
    h = _int(cfg, "hidden_size", model=m)
    k_heads = _int(cfg, "linear_num_key_heads", 16, model=m)
    v_heads = _int(cfg, "linear_num_value_heads", 32, model=m)
    key_dim = k_heads * _int(cfg, "linear_key_head_dim", 128, model=m)
    v_head_dim = _int(cfg, "linear_value_head_dim", 128, model=m)
    value_dim = v_heads * v_head_dim
    conv_dim = 2 * key_dim + value_dim
    kernel = _int(cfg, "linear_conv_kernel_dim", 4, model=m)
    a = f"{p}.linear_attn"
    return [
        (f"{a}.conv1d.weight", (conv_dim, 1, kernel), PARAM_DTYPE),
        (f"{a}.dt_bias", (v_heads,), PARAM_DTYPE),
        (f"{a}.A_log", (v_heads,), PARAM_DTYPE),
        (f"{a}.norm.weight", (v_head_dim,), PARAM_DTYPE),
        (f"{a}.out_proj.weight", (h, value_dim), PARAM_DTYPE),
        (f"{a}.in_proj_qkv.weight", (conv_dim, h), PARAM_DTYPE),
        (f"{a}.in_proj_z.weight", (value_dim, h), PARAM_DTYPE),
        (f"{a}.in_proj_b.weight", (v_heads, h), PARAM_DTYPE),
        (f"{a}.in_proj_a.weight", (v_heads, h), PARAM_DTYPE),
    ]


def _qwen3_5_decoder_layer(p: str, cfg: Mapping[str, Any], layer_type: str, m: str) -> list[Param]:
    h = _int(cfg, "hidden_size", model=m)
    experts = _int(cfg, "num_experts", model=m)
    inter = _int(cfg, "moe_intermediate_size", model=m)
    shared = _int(cfg, "shared_expert_intermediate_size", model=m)
    if layer_type == LINEAR_ATTENTION:
        out = _gated_delta_net(p, cfg, m)
    else:
        out = _attention(p, cfg, m, output_gate=bool(cfg.get("attn_output_gate", True)))
    out += [
        (f"{p}.mlp.gate.weight", (experts, h), PARAM_DTYPE),
        (f"{p}.mlp.experts.gate_up_proj", (experts, 2 * inter, h), PARAM_DTYPE),
        (f"{p}.mlp.experts.down_proj", (experts, h, inter), PARAM_DTYPE),
        *_mlp(f"{p}.mlp.shared_expert", h, shared),
        (f"{p}.mlp.shared_expert_gate.weight", (1, h), PARAM_DTYPE),
    ]
    return out + _layer_norms(p, h)


def _qwen3_5_vision(vision: Mapping[str, Any]) -> list[Param]:
    """``model.visual.*`` (Qwen3.5 vision tower); passes through unchanged, listed only on request."""
    m = "qwen3_5_moe vision_config"
    h = _int(vision, "hidden_size", model=m)
    inter = _int(vision, "intermediate_size", model=m)
    patch = _int(vision, "patch_size", model=m)
    temporal = _int(vision, "temporal_patch_size", model=m)
    channels = _int(vision, "in_channels", 3, model=m)
    merged = h * _int(vision, "spatial_merge_size", model=m) ** 2
    v = "model.visual"
    out: list[Param] = [
        (f"{v}.patch_embed.proj.weight", (h, channels, temporal, patch, patch), PARAM_DTYPE),
        (f"{v}.patch_embed.proj.bias", (h,), PARAM_DTYPE),
        (f"{v}.pos_embed.weight", (_int(vision, "num_position_embeddings", model=m), h), PARAM_DTYPE),
    ]
    for b in range(_int(vision, "depth", model=m)):
        p = f"{v}.blocks.{b}"
        for norm in ("norm1", "norm2"):
            out += [(f"{p}.{norm}.weight", (h,), PARAM_DTYPE), (f"{p}.{norm}.bias", (h,), PARAM_DTYPE)]
        for lin, rows, cols in (
            ("attn.qkv", 3 * h, h),
            ("attn.proj", h, h),
            ("mlp.linear_fc1", inter, h),
            ("mlp.linear_fc2", h, inter),
        ):
            out.append((f"{p}.{lin}.weight", (rows, cols), PARAM_DTYPE))
            out.append((f"{p}.{lin}.bias", (rows,), PARAM_DTYPE))
    out_hidden = _int(vision, "out_hidden_size", model=m)
    out += [
        (f"{v}.merger.norm.weight", (h,), PARAM_DTYPE),
        (f"{v}.merger.norm.bias", (h,), PARAM_DTYPE),
        (f"{v}.merger.linear_fc1.weight", (merged, merged), PARAM_DTYPE),
        (f"{v}.merger.linear_fc1.bias", (merged,), PARAM_DTYPE),
        (f"{v}.merger.linear_fc2.weight", (out_hidden, merged), PARAM_DTYPE),
        (f"{v}.merger.linear_fc2.bias", (out_hidden,), PARAM_DTYPE),
    ]
    return out


def _qwen3_5_moe_params(config: Mapping[str, Any], *, include_mtp: bool, include_vision: bool) -> list[Param]:
    """``Qwen3_5MoeForConditionalGeneration`` (``model.language_model.*``), or the text-only
    ``Qwen3_5MoeForCausalLM`` (``model.*``) when the config is a bare ``qwen3_5_moe_text`` one.

    MTP layers (``mtp.layers.N``, full attention + MoE) carry grouped slabs like the decoder layers:
    that is how the trainer exports them. The vision tower is listed only with ``include_vision``.
    """
    m = "qwen3_5_moe"
    text = QWEN3_5_MOE.text_config(config)
    multimodal = "text_config" in config or config.get("model_type") == "qwen3_5_moe"
    root = "model.language_model" if multimodal else "model"
    h = _int(text, "hidden_size", model=m)
    vocab = _int(text, "vocab_size", model=m)
    out: list[Param] = []
    if include_vision and multimodal:
        out += _qwen3_5_vision(config.get("vision_config") or {})
    out.append((f"{root}.embed_tokens.weight", (vocab, h), PARAM_DTYPE))
    for layer, layer_type in enumerate(qwen3_5_layer_types(text)):
        out += _qwen3_5_decoder_layer(f"{root}.layers.{layer}", text, layer_type, m)
    out.append((f"{root}.norm.weight", (h,), PARAM_DTYPE))
    tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    if not tied:
        out.append(("lm_head.weight", (vocab, h), PARAM_DTYPE))
    mtp_layers = _int(text, "mtp_num_hidden_layers", 0, model=m) if include_mtp else 0
    if mtp_layers:
        out.append(("mtp.fc.weight", (h, 2 * h), PARAM_DTYPE))
        for n in range(mtp_layers):
            out += _qwen3_5_decoder_layer(f"mtp.layers.{n}", text, FULL_ATTENTION, m)
        out += [
            ("mtp.norm.weight", (h,), PARAM_DTYPE),
            ("mtp.pre_fc_norm_embedding.weight", (h,), PARAM_DTYPE),
            ("mtp.pre_fc_norm_hidden.weight", (h,), PARAM_DTYPE),
        ]
    return out


# --------------------------------------------------------------------------------------------------
# DeepSeek-V3 family (DeepSeek-V3/R1/V3.1, Kimi-K2) and GLM-4.5/4.6 MoE: per-expert names, a sigmoid
# router with an FP32 bias, shared experts, leading dense layers, MTP layers appended to model.layers


def _mla(p: str, cfg: Mapping[str, Any], m: str) -> list[Param]:
    """Multi-head latent attention (``DeepseekV3Attention``; vLLM ``DeepseekV2MLAAttention``)."""
    h = _int(cfg, "hidden_size", model=m)
    heads = _int(cfg, "num_attention_heads", model=m)
    nope = _int(cfg, "qk_nope_head_dim", model=m)
    rope = _int(cfg, "qk_rope_head_dim", model=m)
    v = _int(cfg, "v_head_dim", model=m)
    kv_lora = _int(cfg, "kv_lora_rank", model=m)
    q_lora = cfg.get("q_lora_rank")  # None: DeepSeek-V2-Lite style, one q_proj
    bias = bool(cfg.get("attention_bias"))
    a = f"{p}.self_attn"
    out: list[Param] = []
    if q_lora is None:
        out.append((f"{a}.q_proj.weight", (heads * (nope + rope), h), PARAM_DTYPE))
    else:
        q_lora = _int(cfg, "q_lora_rank", model=m)
        out.append((f"{a}.q_a_proj.weight", (q_lora, h), PARAM_DTYPE))
        if bias:
            out.append((f"{a}.q_a_proj.bias", (q_lora,), PARAM_DTYPE))
        out += [
            (f"{a}.q_a_layernorm.weight", (q_lora,), PARAM_DTYPE),
            (f"{a}.q_b_proj.weight", (heads * (nope + rope), q_lora), PARAM_DTYPE),
        ]
    out.append((f"{a}.kv_a_proj_with_mqa.weight", (kv_lora + rope, h), PARAM_DTYPE))
    if bias:
        out.append((f"{a}.kv_a_proj_with_mqa.bias", (kv_lora + rope,), PARAM_DTYPE))
    out += [
        (f"{a}.kv_a_layernorm.weight", (kv_lora,), PARAM_DTYPE),
        (f"{a}.kv_b_proj.weight", (heads * (nope + v), kv_lora), PARAM_DTYPE),
        (f"{a}.o_proj.weight", (h, heads * v), PARAM_DTYPE),
    ]
    if bias:
        out.append((f"{a}.o_proj.bias", (h,), PARAM_DTYPE))
    return out


def _glm4_attention(p: str, cfg: Mapping[str, Any], m: str) -> list[Param]:
    """``Glm4MoeAttention``: biased q/k/v (``attention_bias``), unbiased o_proj, optional q/k norms."""
    h = _int(cfg, "hidden_size", model=m)
    heads = _int(cfg, "num_attention_heads", model=m)
    kv = _int(cfg, "num_key_value_heads", heads, model=m)
    hd = _int(cfg, "head_dim", h // heads if heads else None, model=m)
    a = f"{p}.self_attn"
    out: list[Param] = []
    for proj, rows in (("q_proj", heads * hd), ("k_proj", kv * hd), ("v_proj", kv * hd)):
        out.append((f"{a}.{proj}.weight", (rows, h), PARAM_DTYPE))
        if cfg.get("attention_bias"):
            out.append((f"{a}.{proj}.bias", (rows,), PARAM_DTYPE))
    out.append((f"{a}.o_proj.weight", (h, heads * hd), PARAM_DTYPE))
    if cfg.get("use_qk_norm"):
        out += [(f"{a}.q_norm.weight", (hd,), PARAM_DTYPE), (f"{a}.k_norm.weight", (hd,), PARAM_DTYPE)]
    return out


def _deepseek_moe_layer(layer: int, cfg: Mapping[str, Any], m: str) -> bool:
    """A MoE layer (else dense): ``first_k_dense_replace`` leading dense layers, then every
    ``moe_layer_freq``-th layer (transformers ``DeepseekV3DecoderLayer`` / ``Glm4MoeDecoderLayer``)."""
    first_dense = _int(cfg, "first_k_dense_replace", 0, model=m)
    freq = _int(cfg, "moe_layer_freq", 1, model=m)
    return _int(cfg, "n_routed_experts", model=m) > 0 and layer >= first_dense and layer % max(freq, 1) == 0


def _deepseek_mlp(p: str, layer: int, cfg: Mapping[str, Any], m: str) -> list[Param]:
    h = _int(cfg, "hidden_size", model=m)
    if not _deepseek_moe_layer(layer, cfg, m):
        return _mlp(f"{p}.mlp", h, _int(cfg, "intermediate_size", model=m))
    experts = _int(cfg, "n_routed_experts", model=m)
    inter = _int(cfg, "moe_intermediate_size", model=m)
    out: list[Param] = []
    for e in range(experts):
        out += _mlp(f"{p}.mlp.experts.{e}", h, inter)
    out.append((f"{p}.mlp.gate.weight", (experts, h), PARAM_DTYPE))
    if cfg.get("topk_method", "noaux_tc") == "noaux_tc":
        out.append((f"{p}.mlp.gate.e_score_correction_bias", (experts,), ROUTER_BIAS_DTYPE))
    shared = _int(cfg, "n_shared_experts", 0, model=m)
    if shared:
        out += _mlp(f"{p}.mlp.shared_experts", h, inter * shared)
    return out


def _deepseek_family_params(
    config: Mapping[str, Any], *, include_mtp: bool, attention: Callable[..., list[Param]], m: str
) -> list[Param]:
    h = _int(config, "hidden_size", model=m)
    vocab = _int(config, "vocab_size", model=m)
    layers = _int(config, "num_hidden_layers", model=m)
    mtp = _int(config, "num_nextn_predict_layers", 0, model=m) if include_mtp else 0
    out: list[Param] = [("model.embed_tokens.weight", (vocab, h), PARAM_DTYPE)]
    for layer in range(layers + mtp):
        p = f"model.layers.{layer}"
        if layer >= layers:  # an MTP layer (vLLM deepseek_mtp.py / glm4_moe_mtp.py), own embed/head copies
            out += [
                (f"{p}.embed_tokens.weight", (vocab, h), PARAM_DTYPE),
                (f"{p}.enorm.weight", (h,), PARAM_DTYPE),
                (f"{p}.hnorm.weight", (h,), PARAM_DTYPE),
                (f"{p}.eh_proj.weight", (h, 2 * h), PARAM_DTYPE),
            ]
        out += attention(p, config, m)
        out += _deepseek_mlp(p, layer, config, m)
        out += _layer_norms(p, h)
        if layer >= layers:
            out += [
                (f"{p}.shared_head.norm.weight", (h,), PARAM_DTYPE),
                (f"{p}.shared_head.head.weight", (vocab, h), PARAM_DTYPE),
            ]
    out.append(("model.norm.weight", (h,), PARAM_DTYPE))
    if not config.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", (vocab, h), PARAM_DTYPE))
    return out


def _deepseek_v3_params(config: Mapping[str, Any], *, include_mtp: bool, include_vision: bool) -> list[Param]:
    """``DeepseekV3ForCausalLM`` (DeepSeek-V3/R1/V3.1, Kimi-K2): MLA, per-expert routed experts."""
    del include_vision
    return _deepseek_family_params(config, include_mtp=include_mtp, attention=_mla, m="deepseek_v3")


def _glm4_moe_params(config: Mapping[str, Any], *, include_mtp: bool, include_vision: bool) -> list[Param]:
    """``Glm4MoeForCausalLM`` (GLM-4.5/4.6): GQA attention, otherwise DeepSeek-V3's MoE layout."""
    del include_vision
    return _deepseek_family_params(config, include_mtp=include_mtp, attention=_glm4_attention, m="glm4_moe")


#: what a DeepSeek-V3/GLM-4.5 checkpoint keeps in FP32 (:data:`ROUTER_BIAS_DTYPE`)
ROUTER_BIAS_RE = re.compile(r"\.mlp\.gate\.e_score_correction_bias$")

#: linear layers a block-FP8 DeepSeek-V3/GLM-4.5 checkpoint stores in FP8 besides the routed experts
#: (``weight_scale_inv`` beside each); the router ``mlp.gate``, embeddings, heads, norms and the MTP
#: ``eh_proj`` stay BF16 (vLLM builds those without a quant_config)
DEEPSEEK_LINEAR_RE = re.compile(
    r"^model\.layers\.\d+\.(?:self_attn\.(?:q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|k_proj|v_proj"
    r"|o_proj)|mlp\.(?:shared_experts\.)?(?:gate_proj|up_proj|down_proj))\.weight$"
)


# --------------------------------------------------------------------------------------------------
# the two forms of routed experts


class ExpertForm(str, enum.Enum):
    """How a state dict holds the routed experts of a layer (SPEC §2.1)."""

    #: one tensor per expert and projection: ``{prefix}.{e}.{gate,up,down}_proj.weight`` (checkpoints,
    #: ``save_pretrained``, transformers 4.x modules)
    PER_EXPERT = "per_expert"
    #: grouped slabs ``{prefix}.gate_up_proj [E, 2I, H]`` and ``{prefix}.down_proj [E, H, I]``
    #: (transformers 5.x run-time modules; Qwen3.5 checkpoints)
    FUSED = "fused"


def with_expert_form(params: list[Param], form: ExpertForm | str) -> list[Param]:
    """``params`` with every layer's routed experts in ``form``: each layer's group where its first
    expert tensor was, everything else as it was. The same outputs publish from either form."""
    form = ExpertForm(form)
    out: list[Param] = []
    done: set[str] = set()
    by_prefix: dict[str, list[Param]] = {}
    for p in params:
        m = SLAB_RE.match(p[0]) or PER_EXPERT_RE.match(p[0])
        if m:
            by_prefix.setdefault(m.group("prefix"), []).append(p)
    for name, shape, dtype in params:
        m = SLAB_RE.match(name) or PER_EXPERT_RE.match(name)
        if m is None:
            out.append((name, shape, dtype))
            continue
        prefix = m.group("prefix")
        if prefix in done:
            continue
        done.add(prefix)
        out += _experts_in_form(prefix, by_prefix[prefix], form)
    return out


def _experts_in_form(prefix: str, group: list[Param], form: ExpertForm) -> list[Param]:
    slabs = {SLAB_RE.match(n).group("proj"): (s, d) for n, s, d in group if SLAB_RE.match(n)}
    if slabs:
        (e, two_i, h), dtype = slabs["gate_up_proj"]
        inter = two_i // 2
    else:
        experts = {int(PER_EXPERT_RE.match(n).group("expert")) for n, _, _ in group}
        gate = next((s, d) for n, s, d in group if n.endswith(".gate_proj.weight"))
        (inter, h), dtype, e = gate[0], gate[1], max(experts) + 1
    if form is ExpertForm.FUSED:
        return [
            (f"{prefix}.gate_up_proj", (e, 2 * inter, h), dtype),
            (f"{prefix}.down_proj", (e, h, inter), dtype),
        ]
    return [p for x in range(e) for p in _mlp(f"{prefix}.{x}", h, inter, dtype)]


# --------------------------------------------------------------------------------------------------
# the registry

ParamLister = Callable[..., list[Param]]


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """One supported model family. Data, so the plan never branches on a model's name."""

    model_type: str
    description: str
    #: grouped slabs of routed experts (SPEC §2.1); None for a family that never has them
    slab_re: re.Pattern[str] | None
    #: per-expert routed projections (SPEC §2.1)
    per_expert_re: re.Pattern[str]
    #: key under which a multimodal config nests the text settings, or None for flat configs
    text_config_key: str | None
    #: other ``model_type`` strings (e.g. a nested text config's own) that mean this family
    aliases: tuple[str, ...] = ()
    has_mtp: bool = False
    #: MTP layers are ``model.layers.{num_hidden_layers + n}`` (DeepSeek-V3, GLM-4.5), not ``mtp.layers.n``
    mtp_in_layers: bool = False
    #: non-expert linear weights a block-FP8 checkpoint quantizes (``quantization_config``); None: none
    linear_re: re.Pattern[str] | None = None
    #: tensors the checkpoint holds in FP32 whatever its dtype (published in FP32); None: none
    fp32_re: re.Pattern[str] | None = None
    #: ``lister(config, *, include_mtp, include_vision) -> [(name, shape, dtype), ...]``
    lister: ParamLister

    def text_config(self, config: Mapping[str, Any]) -> Mapping[str, Any]:
        """The text model's settings (:func:`normalize_hf_config`'s names): ``config[text_config_key]``
        if present, else ``config``."""
        config = normalize_hf_config(config)
        if self.text_config_key and isinstance(config.get(self.text_config_key), Mapping):
            return config[self.text_config_key]
        return config

    def num_hidden_layers(self, config: Mapping[str, Any]) -> int:
        """Decoder layers of the text model (MTP layers not counted)."""
        return _int(self.text_config(config), "num_hidden_layers", model=self.model_type)

    def mtp_layer(self, layer: int, num_hidden_layers: int) -> int | None:
        """The MTP index of decoder-named ``layers.{layer}`` (None: a decoder layer)."""
        if self.mtp_in_layers and layer >= num_hidden_layers:
            return layer - num_hidden_layers
        return None

    def parameters(
        self,
        config: Mapping[str, Any],
        *,
        include_mtp: bool = True,
        include_vision: bool = False,
        experts: ExpertForm | str | None = None,
    ) -> list[Param]:
        """Every checkpoint parameter as ``(name, shape, dtype)``, in module order, with the names
        and dtypes the checkpoint holds: the config's ``dtype`` (BF16 when it names none), the
        tensors a checkpoint keeps in FP32 (:data:`ROUTER_BIAS_DTYPE`) in FP32. ``experts`` lists
        the routed experts in that form instead of the checkpoint's (:func:`with_expert_form`)."""
        config = normalize_hf_config(config)
        params = self.lister(config, include_mtp=include_mtp, include_vision=include_vision)
        if experts is not None:  # the other form (a trainer's run-time modules): same outputs
            params = with_expert_form(params, experts)
        dtype = checkpoint_dtype(config)
        if dtype is None or dtype == PARAM_DTYPE:
            return params
        return [(n, s, dtype if d == PARAM_DTYPE else d) for n, s, d in params]


QWEN3_MOE = ModelSpec(
    model_type="qwen3_moe",
    description="Qwen3 MoE (e.g. Qwen3-30B-A3B): per-expert projections",
    slab_re=SLAB_RE,  # transformers v5 exports may group Qwen3 MoE experts too
    per_expert_re=PER_EXPERT_RE,
    text_config_key=None,
    lister=_qwen3_moe_params,
)

QWEN3_5_MOE = ModelSpec(
    model_type="qwen3_5_moe",
    description="Qwen3.5 MoE (e.g. Qwen3.5-35B-A3B): grouped expert slabs, hybrid attention, MTP",
    slab_re=SLAB_RE,
    per_expert_re=PER_EXPERT_RE,
    text_config_key="text_config",
    aliases=("qwen3_5_moe_text",),
    has_mtp=True,
    lister=_qwen3_5_moe_params,
)

DEEPSEEK_V3 = ModelSpec(
    model_type="deepseek_v3",
    description="DeepSeek-V3 family (DeepSeek-V3/R1/V3.1, Kimi-K2): MLA, shared experts, FP32 router bias, MTP",
    slab_re=SLAB_RE,  # a trainer may send grouped slabs; the checkpoint names experts one by one
    per_expert_re=PER_EXPERT_RE,
    text_config_key=None,
    aliases=("kimi_k2",),
    has_mtp=True,
    mtp_in_layers=True,
    linear_re=DEEPSEEK_LINEAR_RE,
    fp32_re=ROUTER_BIAS_RE,
    lister=_deepseek_v3_params,
)

GLM4_MOE = ModelSpec(
    model_type="glm4_moe",
    description="GLM-4.5/4.6 MoE: GQA attention with q/k/v bias, shared experts, FP32 router bias, MTP",
    slab_re=SLAB_RE,
    per_expert_re=PER_EXPERT_RE,
    text_config_key=None,
    has_mtp=True,
    mtp_in_layers=True,
    linear_re=DEEPSEEK_LINEAR_RE,
    fp32_re=ROUTER_BIAS_RE,
    lister=_glm4_moe_params,
)

#: model_type -> ModelSpec; add a row to support a new family
MODELS: dict[str, ModelSpec] = {
    spec.model_type: spec for spec in (QWEN3_MOE, QWEN3_5_MOE, DEEPSEEK_V3, GLM4_MOE)
}


def get_model(model_type: str) -> ModelSpec:
    """The registry row for ``model_type`` (or one of its aliases); ValueError lists the known ones."""
    if isinstance(model_type, str):
        for spec in MODELS.values():
            if model_type == spec.model_type or model_type in spec.aliases:
                return spec
    known = ", ".join(sorted(MODELS))
    raise ValueError(f"unknown model type {model_type!r}: refitd knows {known}")


def model_type_of(config: Mapping[str, Any]) -> str:
    """The registry model type a ``config.json`` dict describes (top-level ``model_type`` first)."""
    model_type = config.get("model_type")
    if model_type is None and isinstance(config.get("text_config"), Mapping):
        model_type = config["text_config"].get("model_type")
    if model_type is None:
        raise ValueError("config has no 'model_type'; pass the model's Hugging Face config.json")
    return get_model(model_type).model_type
