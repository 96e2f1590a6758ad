"""The Qwen MoE listers: Qwen3 MoE (per-expert names, flat config) and Qwen3.5 MoE (grouped slabs,
hybrid linear/full attention, shared expert, MTP, optional vision tower).

They follow transformers' module registration order (``modeling_qwen3_moe.py``,
``modeling_qwen3_5_moe.py``), so a listing reads like ``model.state_dict().keys()``. Each takes a
config as :func:`~sidecar.plan.models.registry.normalize_hf_config` returns it
(``ModelSpec.parameters`` normalizes before listing).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sidecar.plan.models.params import PARAM_DTYPE, Param, _int, _layer_norms, _mlp

#: Qwen3.5 default: every 4th layer is full attention (transformers' Qwen3_5MoeTextConfig)
QWEN3_5_FULL_ATTENTION_INTERVAL = 4
LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"


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
    text = config["text_config"] if isinstance(config.get("text_config"), Mapping) else config
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
