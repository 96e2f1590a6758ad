"""The model registry against transformers 5.x itself: for every family, a tiny model built from
transformers' own config class lists exactly what refitd's registry lists from the ``config.json``
that ``save_pretrained`` writes (5.x field names), in both forms: the module's run-time state dict
(routed experts fused) and the checkpoint file (experts one by one)."""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip(
    "transformers", minversion="5.0", reason="the test extra: pip install -e '.[test]'"
)

from safetensors import safe_open  # noqa: E402

from sidecar.plan.models import MODELS, ExpertForm, get_model  # noqa: E402

SMALL = dict(
    vocab_size=128, hidden_size=64, num_attention_heads=4, moe_intermediate_size=32, num_experts_per_tok=2
)


def tiny(model: str):
    """(model class, config) of ``model``, tiny, from transformers' own classes."""
    if model == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            **SMALL,
            intermediate_size=96,
            num_hidden_layers=2,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=4,
        )
        return transformers.Qwen3MoeForCausalLM, cfg
    if model == "qwen3_5_moe":
        cfg = transformers.Qwen3_5MoeTextConfig(
            **SMALL, num_hidden_layers=2, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            shared_expert_intermediate_size=32, num_experts=4, layer_types=["linear_attention", "full_attention"],
        )  # fmt: skip
        return transformers.Qwen3_5MoeForCausalLM, cfg
    common = dict(
        **SMALL, intermediate_size=96, num_hidden_layers=3, n_routed_experts=4, n_group=1, topk_group=1,
        first_k_dense_replace=1, n_shared_experts=1, num_nextn_predict_layers=0,
    )  # fmt: skip
    if model == "deepseek_v3":
        cfg = transformers.DeepseekV3Config(
            **common, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16,
        )  # fmt: skip
        return transformers.DeepseekV3ForCausalLM, cfg
    cfg = transformers.Glm4MoeConfig(**common, num_key_value_heads=2, head_dim=16)
    return transformers.Glm4MoeForCausalLM, cfg


@pytest.mark.parametrize("model", sorted(MODELS))
def test_the_registry_lists_what_transformers_builds_and_saves(model, tmp_path):
    cls, cfg = tiny(model)
    module = cls(cfg)
    module.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    spec = get_model(config["model_type"])
    assert spec.model_type == model
    run_time = {n: tuple(t.shape) for n, t in module.state_dict().items()}
    listed = {n: s for n, s, _ in spec.parameters(config, experts=ExpertForm.FUSED)}
    assert listed == run_time
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        saved = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}  # noqa: SIM118
    assert {n: s for n, s, _ in spec.parameters(config, experts=ExpertForm.PER_EXPERT)} == saved
