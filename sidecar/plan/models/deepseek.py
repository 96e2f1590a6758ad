"""The DeepSeek-V3 family (DeepSeek-V3/R1/V3.1, Kimi-K2) and GLM-4.5/4.6 MoE listers: per-expert names,
a sigmoid router with an FP32 bias, shared experts, leading dense layers, MTP layers appended to
``model.layers``.

They follow transformers' module registration order (``modeling_deepseek_v3.py``,
``modeling_glm4_moe.py``), so a listing reads like ``model.state_dict().keys()``. The MTP layers are
``model.layers.{num_hidden_layers + n}`` (``ModelSpec.mtp_in_layers``), with their own
``embed_tokens`` and ``shared_head`` copies as the checkpoints hold them. :data:`DEEPSEEK_LINEAR_RE`
names the linear layers a block-FP8 checkpoint (``quantization_config.weight_block_size``) stores in
FP8 besides the routed experts: attention projections, dense MLPs and shared experts, never the
router, embeddings, heads, norms or the MTP ``eh_proj``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from sidecar.plan.models.params import PARAM_DTYPE, ROUTER_BIAS_DTYPE, Param, _int, _layer_norms, _mlp


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
