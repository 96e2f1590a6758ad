"""The model registry: routed-expert regexes, parameter listings from configs, and the real models."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from sidecar.cli.demo.synthetic import make_hf_config, make_state_dict
from sidecar.plan.models import MODELS, PER_EXPERT_RE, SLAB_RE, get_model, model_type_of

DATA = Path(__file__).parent / "data"
QWEN3_30B = json.loads((DATA / "qwen3-30b-a3b.config.json").read_text())
QWEN3_5_35B = json.loads((DATA / "qwen3.5-35b-a3b.config.json").read_text())


def _params(listing) -> int:
    return sum(math.prod(shape) for _, shape, _ in listing)


def _shapes(listing) -> dict[str, tuple[int, ...]]:
    return {name: shape for name, shape, _ in listing}


# ---- registry


def test_unknown_model_type_lists_the_known_ones():
    with pytest.raises(ValueError) as err:
        get_model("llama")
    for known in MODELS:
        assert known in str(err.value)


def test_aliases_and_nested_configs_resolve_to_the_family():
    assert get_model("qwen3_5_moe_text").model_type == "qwen3_5_moe"
    assert model_type_of(QWEN3_5_35B) == "qwen3_5_moe"
    assert model_type_of({"text_config": {"model_type": "qwen3_5_moe_text"}}) == "qwen3_5_moe"
    assert model_type_of(QWEN3_30B) == "qwen3_moe"
    with pytest.raises(ValueError, match="model_type"):
        model_type_of({"hidden_size": 8})


# ---- SPEC §2.1 regexes


@pytest.mark.parametrize(
    "name, prefix, proj",
    [
        ("model.language_model.layers.3.mlp.experts.gate_up_proj", "model.language_model.layers.3.mlp.experts", "gate_up_proj"),
        ("model.layers.0.mlp.experts.down_proj", "model.layers.0.mlp.experts", "down_proj"),
        ("layers.12.mlp.experts.down_proj", "layers.12.mlp.experts", "down_proj"),
        ("language_model.layers.1.mlp.experts.gate_up_proj", "language_model.layers.1.mlp.experts", "gate_up_proj"),
        ("mtp.layers.0.mlp.experts.gate_up_proj", "mtp.layers.0.mlp.experts", "gate_up_proj"),
    ],
)  # fmt: skip
def test_slab_regex_matches_grouped_slabs(name, prefix, proj):
    m = SLAB_RE.match(name)
    assert m and m.group("prefix") == prefix and m.group("proj") == proj


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.mlp.experts.gate_up_proj.weight",  # slabs carry no .weight
        "model.language_model.layers.0.mlp.shared_expert.gate_proj.weight",
        "model.language_model.layers.0.mlp.gate.weight",
        "model.visual.blocks.0.mlp.linear_fc1.weight",
        "x.model.layers.0.mlp.experts.down_proj",  # anchored at the start
        "model.mtp.layers.0.mlp.experts.down_proj",
    ],
)
def test_slab_regex_rejects_everything_else(name):
    assert SLAB_RE.match(name) is None


def test_per_expert_regex():
    m = PER_EXPERT_RE.match("model.layers.47.mlp.experts.127.down_proj.weight")
    assert m and (m.group("prefix"), m.group("expert"), m.group("proj")) == (
        "model.layers.47.mlp.experts",
        "127",
        "down_proj",
    )
    assert PER_EXPERT_RE.match("mtp.layers.0.mlp.experts.3.up_proj.weight")
    assert PER_EXPERT_RE.match("model.layers.0.mlp.shared_expert.up_proj.weight") is None
    assert PER_EXPERT_RE.match("model.layers.0.mlp.experts.3.up_proj.bias") is None


# ---- listings agree with the independently written synthetic state dicts


@pytest.mark.parametrize("model_type", sorted(MODELS))
@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"unaligned": True},
        {"num_layers": 9, "num_experts": 3, "mtp_layers": 2, "vocab": 77},
        {"mtp_layers": 0},
    ],
)
def test_listing_from_config_equals_synthetic_state_dict(model_type, kwargs):
    """The config -> parameter listing of models.py and the hand-written synthetic model agree on
    every name, shape, dtype and on the order."""
    listing = get_model(model_type).parameters(make_hf_config(model_type, **kwargs))
    state = make_state_dict(model_type, **kwargs)
    assert listing == [(n, tuple(t.shape), t.dtype) for n, t in state.items()]


def test_qwen3_5_layer_types_follow_full_attention_interval_when_not_listed():
    config = make_hf_config("qwen3_5_moe", num_layers=8)
    del config["text_config"]["layer_types"]
    names = _shapes(get_model("qwen3_5_moe").parameters(config))
    full = {i for i in range(8) if f"model.language_model.layers.{i}.self_attn.q_proj.weight" in names}
    linear = {
        i for i in range(8) if f"model.language_model.layers.{i}.linear_attn.in_proj_qkv.weight" in names
    }
    assert full == {3, 7} and linear == {0, 1, 2, 4, 5, 6}


def test_bad_layer_types_are_refused():
    config = make_hf_config("qwen3_5_moe", num_layers=4)
    config["text_config"]["layer_types"] = ["full_attention"] * 3
    with pytest.raises(ValueError, match="layer_types"):
        get_model("qwen3_5_moe").parameters(config)


def test_missing_config_key_is_named():
    config = make_hf_config("qwen3_moe")
    del config["num_experts"]
    with pytest.raises(ValueError, match="num_experts"):
        get_model("qwen3_moe").parameters(config)


def test_text_only_qwen3_5_config_uses_model_prefix():
    text = make_hf_config("qwen3_5_moe")["text_config"]
    names = _shapes(get_model("qwen3_5_moe_text").parameters(text))
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    assert "model.embed_tokens.weight" in names


# ---- the real models (research/fp8_formats.md §7)


def test_qwen3_5_35b_a3b_listing():
    model = get_model("qwen3_5_moe")
    listing = model.parameters(QWEN3_5_35B)
    shapes = _shapes(listing)
    p = "model.language_model.layers"
    assert model.num_hidden_layers(QWEN3_5_35B) == 40
    assert shapes[f"{p}.0.mlp.experts.gate_up_proj"] == (256, 1024, 2048)
    assert shapes[f"{p}.0.mlp.experts.down_proj"] == (256, 2048, 512)
    assert shapes[f"{p}.0.linear_attn.in_proj_qkv.weight"] == (8192, 2048)
    assert shapes[f"{p}.0.linear_attn.in_proj_z.weight"] == (4096, 2048)
    assert shapes[f"{p}.0.linear_attn.in_proj_b.weight"] == (32, 2048)
    assert shapes[f"{p}.0.linear_attn.conv1d.weight"] == (8192, 1, 4)
    assert shapes[f"{p}.0.linear_attn.out_proj.weight"] == (2048, 4096)
    assert shapes[f"{p}.3.self_attn.q_proj.weight"] == (8192, 2048)  # 16 heads x 256 x (query + gate)
    assert shapes[f"{p}.3.self_attn.k_proj.weight"] == (512, 2048)
    assert shapes[f"{p}.0.mlp.shared_expert_gate.weight"] == (1, 2048)
    assert shapes["mtp.fc.weight"] == (2048, 4096)
    assert shapes["mtp.layers.0.mlp.experts.gate_up_proj"] == (256, 1024, 2048)
    assert shapes["lm_head.weight"] == (248320, 2048)
    full = sorted(
        int(n.split(".")[3]) for n in shapes if n.startswith(p) and n.endswith("self_attn.q_proj.weight")
    )
    assert full == [3, 7, 11, 15, 19, 23, 27, 31, 35, 39]
    assert all(dtype == torch.bfloat16 for _, _, dtype in listing)
    text = model.parameters(QWEN3_5_35B, include_mtp=False)
    assert round(_params(text) / 1e9, 2) == 34.66  # §7: text total ~34.66 B
    assert round((_params(listing) - _params(text)) / 1e9, 2) == 0.84  # §7: +0.84 B MTP


def test_qwen3_5_vision_tower_is_listed_on_request():
    listing = get_model("qwen3_5_moe").parameters(QWEN3_5_35B, include_vision=True)
    shapes = _shapes(listing)
    assert sum(n.startswith("model.visual.blocks.") and n.endswith("attn.qkv.weight") for n in shapes) == 27
    assert shapes["model.visual.blocks.0.mlp.linear_fc1.weight"] == (4304, 1152)
    assert shapes["model.visual.merger.linear_fc2.weight"] == (2048, 4608)
    assert len(listing) > len(get_model("qwen3_5_moe").parameters(QWEN3_5_35B))


def test_qwen3_30b_a3b_listing():
    model = get_model("qwen3_moe")
    listing = model.parameters(QWEN3_30B)
    shapes = _shapes(listing)
    assert model.num_hidden_layers(QWEN3_30B) == 48
    assert shapes["model.layers.47.mlp.experts.127.gate_proj.weight"] == (768, 2048)
    assert shapes["model.layers.47.mlp.experts.127.down_proj.weight"] == (2048, 768)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (4096, 2048)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (512, 2048)
    assert round(_params(listing) / 1e9, 2) == 30.53  # §7: total 30.53 B
