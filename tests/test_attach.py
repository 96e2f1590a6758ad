"""The attach check: the refit plan against an engine's manifest, every mismatch listed at once."""

from __future__ import annotations

import pytest
import torch

from sidecar.cli.demo.synthetic import make_state_dict
from sidecar.plan.attach import check_manifest, engine_bf16_modules
from sidecar.plan.build import RefitPlan, RefitSpec, TensorSpec
from sidecar.protocol.manifest import (
    MAX_LISTED,
    MAX_MANIFEST_TENSORS,
    EngineConstraints,
    EngineKind,
    Manifest,
    ManifestTensor,
)

SPEC = RefitSpec(model_type="qwen3_5_moe", fmt="mxfp8")


@pytest.fixture(scope="module")
def inputs():
    state = make_state_dict("qwen3_5_moe", num_layers=2, num_experts=4, unaligned=True)
    return [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in state.items()]


def manifest_for(plan: RefitPlan, **kw) -> Manifest:
    base = dict(
        engine=EngineKind.REFERENCE,
        engine_version="test",
        moe_backend="ReferenceFusedMoE",
        expert_format=plan.spec.format,
    )
    base.update(kw)
    if isinstance(kw.get("constraints"), dict):  # the constraints' own fields, for this manifest's engine
        base["constraints"] = EngineConstraints(
            engine=base["engine"], expert_format=base["expert_format"], **kw["constraints"]
        )
    tensors = kw.pop("tensors", None) or tuple(
        ManifestTensor(o.name, o.dtype, tuple(o.shape)) for o in plan.outputs
    )
    base["tensors"] = tensors
    return Manifest(**base)


def test_matching_manifest_passes(inputs):
    plan = RefitPlan.build(inputs, SPEC)
    check = check_manifest(inputs, SPEC, manifest_for(plan))
    assert check.ok, check.errors
    assert [o.name for o in check.plan.outputs] == [o.name for o in plan.outputs]


def test_manifest_wins_for_experts_the_engine_holds_in_bf16(inputs):
    """The engine holds layer 1's experts in BF16: the daemon publishes that layer's slabs unchanged."""
    engine_plan = RefitPlan.build(
        inputs, SPEC, keep_bf16=[i.name for i in inputs if ".layers.1.mlp.experts." in i.name]
    )
    manifest = manifest_for(engine_plan)
    keep = engine_bf16_modules(manifest, "qwen3_5_moe")
    assert keep and all(".layers.1.mlp.experts." in k for k in keep)
    check = check_manifest(inputs, SPEC, manifest)
    assert check.ok, check.errors
    slab = next(o for o in check.plan.outputs if o.name.endswith("layers.1.mlp.experts.gate_up_proj"))
    assert slab.dtype == torch.bfloat16


def test_every_mismatch_is_listed(inputs):
    plan = RefitPlan.build(inputs, SPEC)
    tensors = [ManifestTensor(o.name, o.dtype, tuple(o.shape)) for o in plan.outputs]
    q = next(i for i, t in enumerate(tensors) if t.name.endswith("self_attn.q_proj.weight"))
    tensors[q] = ManifestTensor(
        tensors[q].name, torch.float8_e4m3fn, tensors[q].shape
    )  # engine quantized attention
    s = next(i for i, t in enumerate(tensors) if t.name.endswith("experts.0.down_proj.weight"))
    tensors[s] = ManifestTensor(tensors[s].name, tensors[s].dtype, (7, 7))  # a shape that differs
    tensors.append(
        ManifestTensor(
            "model.language_model.layers.0.mlp.experts.99.up_proj.weight", torch.float8_e4m3fn, (96, 160)
        )
    )
    manifest = manifest_for(
        plan, tensors=tuple(tensors), constraints={"mxfp8_align": 128}, moe_backend="CutlassFusedMoE"
    )
    check = check_manifest(inputs, SPEC, manifest)
    text = check.message("engine worker w0")
    assert "self_attn.q_proj.weight: the engine holds float8_e4m3fn" in text
    assert "experts.0.down_proj.weight: the engine holds float8_e4m3fn [7, 7]" in text
    assert "experts.99.up_proj.weight: the engine expects" in text and "does not publish it" in text
    assert "MXFP8 MoE needs hidden_size = 160 to be a multiple of 128" in text
    assert "moe_intermediate_size / tp (96/1) = 96 to be a multiple of 128" in text
    assert "(MoE backend CutlassFusedMoE)" in text
    assert len(check.errors) >= 4


def test_expert_format_the_backend_holds_must_match(inputs):
    plan = RefitPlan.build(inputs, SPEC)
    check = check_manifest(inputs, SPEC, manifest_for(plan, expert_format="fp8_per_tensor"))
    assert any("routed experts are fp8_per_tensor" in e for e in check.errors)


def test_unsupported_format_constraint(inputs):
    plan = RefitPlan.build(inputs, SPEC)
    check = check_manifest(inputs, SPEC, manifest_for(plan, constraints={"unsupported_formats": {"mxfp8"}}))
    assert any("cannot take mxfp8" in e for e in check.errors)


def test_extra_published_tensors_are_warnings(inputs):
    plan = RefitPlan.build(inputs, SPEC)
    tensors = tuple(
        ManifestTensor(o.name, o.dtype, tuple(o.shape)) for o in plan.outputs if not o.name.startswith("mtp.")
    )
    check = check_manifest(inputs, SPEC, manifest_for(plan, tensors=tensors))
    assert check.ok and check.warnings and "not in the engine's manifest" in check.warnings[0]


def test_manifest_round_trips_and_refuses_duplicates(inputs):
    plan = RefitPlan.build(inputs, SPEC)
    m = manifest_for(plan, constraints={"moe_tp_size": 2, "block_fp8_align": 128}, info={"device": "cpu"})
    again = Manifest.from_wire(m.to_wire())
    assert again == m
    with pytest.raises(ValueError, match="more than once"):
        manifest_for(plan, tensors=(m.tensors[0], m.tensors[0]))
    with pytest.raises(ValueError, match="malformed manifest"):
        Manifest.from_wire({"engine": "vllm"})


def _wire_rows(rows) -> dict:
    return {
        "engine": "reference",
        "engine_version": "test",
        "moe_backend": "ReferenceFusedMoE",
        "expert_format": "block_fp8",
        "tensors": rows,
    }


@pytest.mark.timeout(60)
def test_duplicate_names_are_found_in_linear_time_and_listed_capped():
    """100k entries naming 50k tensors twice each: counting each name with ``list.count`` was
    quadratic (24k entries held the serve loop 9.3 s; this would take many minutes); a Counter
    takes about a second. The error counts the duplicates and lists a few of them, not all."""
    rows = [
        [f"model.layers.{i % 50}.mlp.experts.{i % 50_000}.down_proj.weight", "bfloat16", [8, 8]]
        for i in range(100_000)
    ]
    with pytest.raises(ValueError) as excinfo:
        Manifest.from_wire(_wire_rows(rows))
    text = str(excinfo.value)
    assert "50000 tensor name(s) more than once" in text and "list each tensor once" in text
    assert text.count("down_proj.weight") == MAX_LISTED and len(text) < 1000


def test_a_manifest_longer_than_any_model_needs_is_refused_before_it_is_parsed():
    """The entry count is checked first, against a limit generous for a 1T-parameter MoE."""
    row = ["x.weight", "bfloat16", [1]]
    with pytest.raises(ValueError) as excinfo:
        Manifest.from_wire(_wire_rows([row] * (MAX_MANIFEST_TENSORS + 1)))
    assert f"lists {MAX_MANIFEST_TENSORS + 1} tensors, more than the {MAX_MANIFEST_TENSORS}" in str(
        excinfo.value
    )


def _deep(depth: int = 1000) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"tensors": [[_deep(), "bfloat16", [1]]]}, "tensor 0: the name must be a non-empty string"),
        ({"tensors": [["a" * 5000, "bfloat16", [1]]]}, "at most 1024 characters"),
        ({"tensors": [["a", 7, [1]]]}, "the dtype must be a name"),
        ({"tensors": [["a", "bfloat16", [-1]]]}, "holds -1, not a size"),
        ({"tensors": [["a", "bfloat16", [1.5]]]}, "holds 1.5, not a size"),
        ({"tensors": [["a", "bfloat16", [1] * 17]]}, "at most 16 sizes"),
        ({"tensors": [["a", "bfloat16"]]}, "tensor 0 is not [name, dtype, shape]"),
        ({"tensors": {"a": 1}}, "'tensors' is a list"),
        ({"engine": _deep()}, "'engine' must be a string"),
        ({"constraints": {"moe_tp_size": "2"}}, "constraint 'moe_tp_size' must be a positive integer"),
        ({"constraints": {"tp_size": 2}}, "unknown engine constraint(s) ['tp_size']"),
        ({"constraints": {"mxfp8_align": 0}}, "constraint 'mxfp8_align' must be a positive integer"),
        ({"constraints": {"unsupported_formats": "mxfp8"}}, "'unsupported_formats' must be a list"),
        ({"constraints": [1]}, "'constraints' must be a map"),
    ],
)
def test_malformed_manifest_fields_are_refused_saying_which(change, needle):
    """Each field a peer sends is type- and bound-checked with a message naming it; a hostile
    value (a list nested 1000 deep) is quoted in bounded form, never by a recursive repr."""
    with pytest.raises(ValueError) as excinfo:
        Manifest.from_wire({**_wire_rows([["a.weight", "bfloat16", [2, 2]]]), **change})
    text = str(excinfo.value)
    assert text.startswith("malformed manifest: ") and needle in text, text
    assert len(text) < 400


def _dsv3_inputs_and_spec():
    spec = RefitSpec(model_type="deepseek_v3", fmt="block_fp8", num_hidden_layers=2, quantize_linears=True)
    state = make_state_dict("deepseek_v3", num_layers=2, num_experts=4)
    return [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in state.items()], spec


def test_manifest_narrows_the_checkpoint_scheme_for_linears_it_holds_in_bf16():
    """An engine running DeepSeek-V3's attention in BF16 (its q_a_proj listed as bfloat16) gets it
    published in BF16 while the routed experts and other linears stay block-FP8."""
    inputs, spec = _dsv3_inputs_and_spec()
    plan = RefitPlan.build(inputs, spec)
    bf16 = "model.layers.0.self_attn.q_a_proj"
    tensors = [
        ManifestTensor(o.name, o.dtype, tuple(o.shape)) for o in plan.outputs if not o.name.startswith(bf16)
    ]
    tensors.append(
        ManifestTensor(
            f"{bf16}.weight", torch.bfloat16, next(i.shape for i in inputs if i.name == f"{bf16}.weight")
        )
    )
    manifest = manifest_for(plan, tensors=tuple(tensors))
    assert bf16 in engine_bf16_modules(manifest, "deepseek_v3")
    check = check_manifest(inputs, spec, manifest)
    assert check.ok, check.errors
    published = {o.name: o for o in check.plan.outputs}
    assert published[f"{bf16}.weight"].dtype == torch.bfloat16 and f"{bf16}.weight_scale_inv" not in published
    assert published["model.layers.1.self_attn.q_a_proj.weight"].dtype != torch.bfloat16


def test_fp32_router_bias_mismatch_says_to_send_it_in_the_engines_dtype():
    inputs, spec = _dsv3_inputs_and_spec()
    plan = RefitPlan.build(inputs, spec)
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    tensors = tuple(
        ManifestTensor(o.name, torch.bfloat16 if o.name == bias else o.dtype, tuple(o.shape))
        for o in plan.outputs
    )
    check = check_manifest(inputs, spec, manifest_for(plan, tensors=tensors))
    assert not check.ok
    assert any(bias in e and "send it as bfloat16 from the trainer" in e for e in check.errors), check.errors
