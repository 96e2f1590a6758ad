"""Small, deterministic, real-looking state dicts for tests and the demo.

Names and layouts are the Hugging Face checkpoint's: Qwen3.5 MoE (``model.language_model.*``, linear
and full attention layers, grouped expert slabs, shared expert and its gate, router, MTP) and Qwen3
MoE (per-expert projections). The parameter list here is written out independently of
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

    Same arguments, same tensors, on every machine. ``mtp_layers`` applies to qwen3_5_moe only.
    """
    model = get_model(model_type).model_type
    h, inter = _sizes(hidden, intermediate, unaligned)
    if model == "qwen3_moe":
        shapes = _qwen3_moe_shapes(h, inter, num_layers, num_experts, vocab)
    else:
        shapes = _qwen3_5_moe_shapes(h, inter, num_layers, num_experts, vocab, mtp_layers)
    gen = torch.Generator().manual_seed(seed)
    return {
        name: (torch.randn(shape, generator=gen, dtype=torch.float32) * INIT_STD).to(dtype)
        for name, shape in shapes
    }


def shard_for_rank(state: dict[str, torch.Tensor], rank: int, world_size: int) -> dict[str, Any]:
    """What trainer ``rank`` of ``world_size`` would push of ``state``, the way real trainers shard.

    Routed-expert slabs are split expert-parallel (each rank its run of experts, along dim 0); other
    2-D weights whose first dim divides evenly are split tensor-parallel along dim 0; everything else
    goes whole to one rank, round-robin. The union over ranks covers every tensor exactly once.
    """
    from sidecar.client.client import Shard  # the client is only needed here, not by the rest of this module

    model = get_model("qwen3_5_moe")
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
