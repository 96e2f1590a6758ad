"""Small, deterministic, real-looking state dicts for tests and the demo.

Names and layouts are the Hugging Face checkpoint's: Qwen3.5 MoE (``model.language_model.*``, linear
and full attention layers, grouped expert slabs, shared expert and its gate, router, MTP), Qwen3
MoE (per-expert projections), DeepSeek-V3 (MLA, a leading dense layer, shared experts, the FP32
router bias, an MTP layer appended to ``model.layers`` with its own embedding and head, and the
checkpoint's block-FP8 ``quantization_config``) and GLM-4.5 (biased GQA attention with q/k norms,
otherwise DeepSeek-V3's MoE layout, a BF16 checkpoint). The parameter list here is written out independently of
``sidecar.plan.models`` on purpose: a test checks that the two agree, so a slip in either shows up.

``unaligned=True`` picks a hidden size and an expert width that are multiples of 32 (MXFP8 can take
them) but not of 128, so block-FP8 tiles are ragged. Everything runs in well under a second.
"""

from __future__ import annotations

from typing import Any

import torch

from sidecar.plan.models import get_model

__all__ = ["make_hf_config", "make_state_dict"]

#: weights ~ N(0, INIT_STD), like a freshly initialised model
INIT_STD = 0.02
ALIGNED = {"hidden": 128, "intermediate": 128}
UNALIGNED = {"hidden": 160, "intermediate": 96}  # multiples of 32, not of 128
DEFAULT_LAYERS = 4
DEFAULT_EXPERTS = 4
DEFAULT_MTP_LAYERS = 1
DEFAULT_VOCAB = 256
FULL_ATTENTION_INTERVAL = 4
# attention sizes of the synthetic models (small, all multiples of 16)
QWEN3_5_HEADS, QWEN3_5_KV_HEADS, QWEN3_5_HEAD_DIM = 2, 1, 32
QWEN3_5_LINEAR_K_HEADS, QWEN3_5_LINEAR_V_HEADS, QWEN3_5_LINEAR_HEAD_DIM = 2, 4, 16
QWEN3_5_CONV_KERNEL = 4
QWEN3_HEADS, QWEN3_KV_HEADS, QWEN3_HEAD_DIM = 4, 2, 32
# MLA of the synthetic DeepSeek-V3: latent ranks and head dims that block-FP8 tiles evenly
DSV3_HEADS, DSV3_Q_LORA, DSV3_KV_LORA = 2, 128, 128
DSV3_NOPE, DSV3_ROPE, DSV3_V = 64, 32, 64
DSV3_FIRST_DENSE = 1
GLM4_HEADS, GLM4_KV_HEADS, GLM4_HEAD_DIM = 4, 2, 32
#: DeepSeek-V3's own quantization_config: block-FP8 on every linear but router, embeddings, heads
DSV3_QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}


def _sizes(hidden: int | None, intermediate: int | None, unaligned: bool) -> tuple[int, int]:
    base = UNALIGNED if unaligned else ALIGNED
    return hidden or base["hidden"], intermediate or base["intermediate"]


def make_hf_config(
    model_type: str,
    *,
    num_layers: int = DEFAULT_LAYERS,
    hidden: int | None = None,
    intermediate: int | None = None,
    num_experts: int = DEFAULT_EXPERTS,
    mtp_layers: int = DEFAULT_MTP_LAYERS,
    vocab: int = DEFAULT_VOCAB,
    unaligned: bool = False,
) -> dict[str, Any]:
    """A ``config.json``-style dict describing the model :func:`make_state_dict` builds."""
    model = get_model(model_type).model_type
    h, inter = _sizes(hidden, intermediate, unaligned)
    if model in ("deepseek_v3", "glm4_moe"):
        return _deepseek_family_config(model, h, inter, num_layers, num_experts, mtp_layers, vocab)
    if model == "qwen3_moe":
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "hidden_size": h,
            "intermediate_size": 2 * inter,
            "moe_intermediate_size": inter,
            "num_hidden_layers": num_layers,
            "num_attention_heads": QWEN3_HEADS,
            "num_key_value_heads": QWEN3_KV_HEADS,
            "head_dim": QWEN3_HEAD_DIM,
            "num_experts": num_experts,
            "num_experts_per_tok": min(2, num_experts),
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "vocab_size": vocab,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
        }
    layer_types = [
        "full_attention" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention"
        for i in range(num_layers)
    ]
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": "qwen3_5_moe_text",
            "hidden_size": h,
            "num_hidden_layers": num_layers,
            "layer_types": layer_types,
            "full_attention_interval": FULL_ATTENTION_INTERVAL,
            "num_attention_heads": QWEN3_5_HEADS,
            "num_key_value_heads": QWEN3_5_KV_HEADS,
            "head_dim": QWEN3_5_HEAD_DIM,
            "attn_output_gate": True,
            "linear_num_key_heads": QWEN3_5_LINEAR_K_HEADS,
            "linear_num_value_heads": QWEN3_5_LINEAR_V_HEADS,
            "linear_key_head_dim": QWEN3_5_LINEAR_HEAD_DIM,
            "linear_value_head_dim": QWEN3_5_LINEAR_HEAD_DIM,
            "linear_conv_kernel_dim": QWEN3_5_CONV_KERNEL,
            "num_experts": num_experts,
            "num_experts_per_tok": min(2, num_experts),
            "moe_intermediate_size": inter,
            "shared_expert_intermediate_size": inter,
            "mtp_num_hidden_layers": mtp_layers,
            "vocab_size": vocab,
            "tie_word_embeddings": False,
        },
    }


def _deepseek_family_config(
    model: str, h: int, inter: int, layers: int, experts: int, mtp: int, vocab: int
) -> dict[str, Any]:
    common = {
        "model_type": model,
        "hidden_size": h,
        "intermediate_size": 2 * inter,
        "moe_intermediate_size": inter,
        "num_hidden_layers": layers,
        "first_k_dense_replace": DSV3_FIRST_DENSE,
        "moe_layer_freq": 1,
        "n_routed_experts": experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": min(2, experts),
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "num_nextn_predict_layers": mtp,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    if model == "glm4_moe":
        return {
            "architectures": ["Glm4MoeForCausalLM"],
            **common,
            "num_attention_heads": GLM4_HEADS,
            "num_key_value_heads": GLM4_KV_HEADS,
            "head_dim": GLM4_HEAD_DIM,
            "attention_bias": True,
            "use_qk_norm": True,
            "partial_rotary_factor": 0.5,
        }
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        **common,
        "num_attention_heads": DSV3_HEADS,
        "num_key_value_heads": DSV3_HEADS,
        "q_lora_rank": DSV3_Q_LORA,
        "kv_lora_rank": DSV3_KV_LORA,
        "qk_nope_head_dim": DSV3_NOPE,
        "qk_rope_head_dim": DSV3_ROPE,
        "v_head_dim": DSV3_V,
        "attention_bias": False,
        "quantization_config": dict(DSV3_QUANTIZATION_CONFIG),
    }


def _deepseek_family_shapes(
    model: str, h: int, inter: int, layers: int, experts: int, vocab: int, mtp: int
) -> list:
    """(name, shape, dtype) of the synthetic DeepSeek-V3 / GLM-4.5, written out from the checkpoints."""
    bf16, fp32 = torch.bfloat16, torch.float32
    out: list = [("model.embed_tokens.weight", (vocab, h), bf16)]
    for layer in range(layers + mtp):
        p = f"model.layers.{layer}"
        a = f"{p}.self_attn"
        if layer >= layers:
            out += [
                (f"{p}.embed_tokens.weight", (vocab, h), bf16),
                (f"{p}.enorm.weight", (h,), bf16),
                (f"{p}.hnorm.weight", (h,), bf16),
                (f"{p}.eh_proj.weight", (h, 2 * h), bf16),
            ]
        if model == "deepseek_v3":
            qk = DSV3_NOPE + DSV3_ROPE
            out += [
                (f"{a}.q_a_proj.weight", (DSV3_Q_LORA, h), bf16),
                (f"{a}.q_a_layernorm.weight", (DSV3_Q_LORA,), bf16),
                (f"{a}.q_b_proj.weight", (DSV3_HEADS * qk, DSV3_Q_LORA), bf16),
                (f"{a}.kv_a_proj_with_mqa.weight", (DSV3_KV_LORA + DSV3_ROPE, h), bf16),
                (f"{a}.kv_a_layernorm.weight", (DSV3_KV_LORA,), bf16),
                (f"{a}.kv_b_proj.weight", (DSV3_HEADS * (DSV3_NOPE + DSV3_V), DSV3_KV_LORA), bf16),
                (f"{a}.o_proj.weight", (h, DSV3_HEADS * DSV3_V), bf16),
            ]
        else:
            q, kv, hd = GLM4_HEADS * GLM4_HEAD_DIM, GLM4_KV_HEADS * GLM4_HEAD_DIM, GLM4_HEAD_DIM
            out += [
                (f"{a}.q_proj.weight", (q, h), bf16),
                (f"{a}.q_proj.bias", (q,), bf16),
                (f"{a}.k_proj.weight", (kv, h), bf16),
                (f"{a}.k_proj.bias", (kv,), bf16),
                (f"{a}.v_proj.weight", (kv, h), bf16),
                (f"{a}.v_proj.bias", (kv,), bf16),
                (f"{a}.o_proj.weight", (h, q), bf16),
                (f"{a}.q_norm.weight", (hd,), bf16),
                (f"{a}.k_norm.weight", (hd,), bf16),
            ]
        if layer < DSV3_FIRST_DENSE:
            d = 2 * inter
            out += [
                (f"{p}.mlp.gate_proj.weight", (d, h), bf16),
                (f"{p}.mlp.up_proj.weight", (d, h), bf16),
                (f"{p}.mlp.down_proj.weight", (h, d), bf16),
            ]
        else:
            for e in range(experts):
                out += [
                    (f"{p}.mlp.experts.{e}.gate_proj.weight", (inter, h), bf16),
                    (f"{p}.mlp.experts.{e}.up_proj.weight", (inter, h), bf16),
                    (f"{p}.mlp.experts.{e}.down_proj.weight", (h, inter), bf16),
                ]
            out += [
                (f"{p}.mlp.gate.weight", (experts, h), bf16),
                (f"{p}.mlp.gate.e_score_correction_bias", (experts,), fp32),
                (f"{p}.mlp.shared_experts.gate_proj.weight", (inter, h), bf16),
                (f"{p}.mlp.shared_experts.up_proj.weight", (inter, h), bf16),
                (f"{p}.mlp.shared_experts.down_proj.weight", (h, inter), bf16),
            ]
        out += [
            (f"{p}.input_layernorm.weight", (h,), bf16),
            (f"{p}.post_attention_layernorm.weight", (h,), bf16),
        ]
        if layer >= layers:
            out += [
                (f"{p}.shared_head.norm.weight", (h,), bf16),
                (f"{p}.shared_head.head.weight", (vocab, h), bf16),
            ]
    return [*out, ("model.norm.weight", (h,), bf16), ("lm_head.weight", (vocab, h), bf16)]


def _qwen3_moe_shapes(h: int, inter: int, layers: int, experts: int, vocab: int) -> list:
    q, kv, hd = QWEN3_HEADS * QWEN3_HEAD_DIM, QWEN3_KV_HEADS * QWEN3_HEAD_DIM, QWEN3_HEAD_DIM
    out: list = [("model.embed_tokens.weight", (vocab, h))]
    for layer in range(layers):
        p = f"model.layers.{layer}"
        out += [
            (f"{p}.self_attn.q_proj.weight", (q, h)),
            (f"{p}.self_attn.k_proj.weight", (kv, h)),
            (f"{p}.self_attn.v_proj.weight", (kv, h)),
            (f"{p}.self_attn.o_proj.weight", (h, q)),
            (f"{p}.self_attn.q_norm.weight", (hd,)),
            (f"{p}.self_attn.k_norm.weight", (hd,)),
            (f"{p}.mlp.gate.weight", (experts, h)),
        ]
        for e in range(experts):
            out += [
                (f"{p}.mlp.experts.{e}.gate_proj.weight", (inter, h)),
                (f"{p}.mlp.experts.{e}.up_proj.weight", (inter, h)),
                (f"{p}.mlp.experts.{e}.down_proj.weight", (h, inter)),
            ]
        out += [(f"{p}.input_layernorm.weight", (h,)), (f"{p}.post_attention_layernorm.weight", (h,))]
    return [*out, ("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]


def _qwen3_5_layer(p: str, h: int, inter: int, experts: int, full: bool) -> list:
    if full:
        q, kv, hd = QWEN3_5_HEADS * QWEN3_5_HEAD_DIM, QWEN3_5_KV_HEADS * QWEN3_5_HEAD_DIM, QWEN3_5_HEAD_DIM
        mixer = [
            (f"{p}.self_attn.q_proj.weight", (2 * q, h)),  # query and output gate
            (f"{p}.self_attn.k_proj.weight", (kv, h)),
            (f"{p}.self_attn.v_proj.weight", (kv, h)),
            (f"{p}.self_attn.o_proj.weight", (h, q)),
            (f"{p}.self_attn.q_norm.weight", (hd,)),
            (f"{p}.self_attn.k_norm.weight", (hd,)),
        ]
    else:
        key = QWEN3_5_LINEAR_K_HEADS * QWEN3_5_LINEAR_HEAD_DIM
        value = QWEN3_5_LINEAR_V_HEADS * QWEN3_5_LINEAR_HEAD_DIM
        heads = QWEN3_5_LINEAR_V_HEADS
        mixer = [
            (f"{p}.linear_attn.conv1d.weight", (2 * key + value, 1, QWEN3_5_CONV_KERNEL)),
            (f"{p}.linear_attn.dt_bias", (heads,)),
            (f"{p}.linear_attn.A_log", (heads,)),
            (f"{p}.linear_attn.norm.weight", (QWEN3_5_LINEAR_HEAD_DIM,)),
            (f"{p}.linear_attn.out_proj.weight", (h, value)),
            (f"{p}.linear_attn.in_proj_qkv.weight", (2 * key + value, h)),
            (f"{p}.linear_attn.in_proj_z.weight", (value, h)),
            (f"{p}.linear_attn.in_proj_b.weight", (heads, h)),
            (f"{p}.linear_attn.in_proj_a.weight", (heads, h)),
        ]
    return [
        *mixer,
        (f"{p}.mlp.gate.weight", (experts, h)),
        (f"{p}.mlp.experts.gate_up_proj", (experts, 2 * inter, h)),
        (f"{p}.mlp.experts.down_proj", (experts, h, inter)),
        (f"{p}.mlp.shared_expert.gate_proj.weight", (inter, h)),
        (f"{p}.mlp.shared_expert.up_proj.weight", (inter, h)),
        (f"{p}.mlp.shared_expert.down_proj.weight", (h, inter)),
        (f"{p}.mlp.shared_expert_gate.weight", (1, h)),
        (f"{p}.input_layernorm.weight", (h,)),
        (f"{p}.post_attention_layernorm.weight", (h,)),
    ]


def _qwen3_5_moe_shapes(h: int, inter: int, layers: int, experts: int, vocab: int, mtp: int) -> list:
    root = "model.language_model"
    out: list = [(f"{root}.embed_tokens.weight", (vocab, h))]
    for layer in range(layers):
        full = (layer + 1) % FULL_ATTENTION_INTERVAL == 0
        out += _qwen3_5_layer(f"{root}.layers.{layer}", h, inter, experts, full)
    out += [(f"{root}.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
    if mtp:
        out.append(("mtp.fc.weight", (h, 2 * h)))
        for n in range(mtp):
            out += _qwen3_5_layer(f"mtp.layers.{n}", h, inter, experts, full=True)
        out += [
            ("mtp.norm.weight", (h,)),
            ("mtp.pre_fc_norm_embedding.weight", (h,)),
            ("mtp.pre_fc_norm_hidden.weight", (h,)),
        ]
    return out


def make_state_dict(
    model_type: str,
    *,
    num_layers: int = DEFAULT_LAYERS,
    hidden: int | None = None,
    intermediate: int | None = None,
    num_experts: int = DEFAULT_EXPERTS,
    mtp_layers: int = DEFAULT_MTP_LAYERS,
    vocab: int = DEFAULT_VOCAB,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    unaligned: bool = False,
) -> dict[str, torch.Tensor]:
    """A state dict of ``model_type`` with values ~ N(0, 0.02) drawn from ``torch.Generator(seed)``.

    Same arguments, same tensors, on every machine. ``mtp_layers`` applies to the families with
    MTP. ``dtype`` is that of the BF16 parameters; the FP32 router bias stays FP32 (as checkpoints
    hold it) and is drawn around zero like the others.
    """
    model = get_model(model_type).model_type
    h, inter = _sizes(hidden, intermediate, unaligned)
    if model == "qwen3_moe":
        shapes = [(n, s, dtype) for n, s in _qwen3_moe_shapes(h, inter, num_layers, num_experts, vocab)]
    elif model in ("deepseek_v3", "glm4_moe"):
        shapes = [
            (n, s, dtype if d is torch.bfloat16 else d)
            for n, s, d in _deepseek_family_shapes(
                model, h, inter, num_layers, num_experts, vocab, mtp_layers
            )
        ]
    else:
        shapes = [
            (n, s, dtype)
            for n, s in _qwen3_5_moe_shapes(h, inter, num_layers, num_experts, vocab, mtp_layers)
        ]
    gen = torch.Generator().manual_seed(seed)
    # DeepSeek-V3 and GLM-4.5 scale by the RMSNorm weight itself (Qwen3.5 by 1 + weight): start them at 1
    one = 1.0 if model in ("deepseek_v3", "glm4_moe") else 0.0
    return {
        name: (
            torch.randn(shape, generator=gen, dtype=torch.float32) * INIT_STD
            + (one if name.endswith("norm.weight") else 0.0)
        ).to(d)
        for name, shape, d in shapes
    }


def shard_for_rank(state: dict[str, torch.Tensor], rank: int, world_size: int) -> dict[str, Any]:
    """What trainer ``rank`` of ``world_size`` would push of ``state``, the way real trainers shard.

    Routed-expert slabs are split expert-parallel (each rank its run of experts, along dim 0); other
    2-D weights whose first dim divides evenly are split tensor-parallel along dim 0; everything else
    goes whole to one rank, round-robin. The union over ranks covers every tensor exactly once.
    """
    from sidecar.client.client import Shard  # the client is only needed here, not by the rest of this module

    model = get_model("qwen3_5_moe")  # the expert regexes are the same for every family
    out: dict[str, Any] = {}
    for i, (name, t) in enumerate(state.items()):
        routed = model.slab_re.match(name) or model.per_expert_re.match(name)
        if routed and model.slab_re.match(name) and t.shape[0] % world_size == 0:
            n = t.shape[0] // world_size
            out[name] = Shard(t[rank * n : (rank + 1) * n], tuple(t.shape), (rank * n, *(0,) * (t.dim() - 1)))
        elif not routed and t.dim() == 2 and t.shape[0] % world_size == 0 and t.shape[0] >= world_size:
            n = t.shape[0] // world_size
            out[name] = Shard(t[rank * n : (rank + 1) * n], tuple(t.shape), (rank * n, 0))
        elif i % world_size == rank:
            out[name] = t
    return out
