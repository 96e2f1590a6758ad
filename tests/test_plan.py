"""The refit plan and conversion (SPEC §2): names, order, exclusions, validation, streaming."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from sidecar.cli.demo.synthetic import make_hf_config, make_state_dict
from sidecar.numerics import reference as quant
from sidecar.numerics.formats import FP8_DTYPE, FP8_FORMATS, Format
from sidecar.plan.build import (
    KeepReason,
    RefitPlan,
    RefitSpec,
    Role,
    TensorSpec,
    UnitKind,
    meta_state_dict,
    plan_from_hf_config,
)
from sidecar.plan.run import convert, iter_convert, run_unit
from sidecar.plan.summary import summarize

DATA = Path(__file__).parent / "data"
FORMATS = [f.value for f in (*FP8_FORMATS, Format.BF16)]  # the 4-bit ones: test_plan_fourbit.py
MODEL_TYPES = ["qwen3_5_moe", "qwen3_moe"]
GIB = 2**30
MIB = 2**20


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (torch.equal is not implemented for fp8)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def expected_outputs(state: dict[str, torch.Tensor], fmt: str, keep: set[str] = frozenset()) -> dict:
    """SPEC §2.3 written out plainly: the outputs in plan order, each quantized with sidecar.numerics.reference."""
    fmt = Format(fmt)
    out: dict[str, torch.Tensor] = {}

    def emit(name: str, w: torch.Tensor, scale: torch.Tensor | None = None) -> None:
        if fmt is Format.FP8_PER_TENSOR:
            q, s = quant.quantize_fp8_per_tensor(w, scale=scale)
        else:
            q, s = quant.quantize(w, fmt)
        out[name] = q
        out[name.removesuffix(".weight") + "." + fmt.scale_suffix] = s

    done = set()
    for name, t in state.items():
        if name in done:
            continue
        routed = ".mlp.experts." in name
        if fmt is Format.BF16 or not routed or name in keep:
            out[name] = t
        elif name.endswith("gate_up_proj"):
            prefix, i = name.removesuffix(".gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                gate, up = t[e, :i], t[e, i:]
                shared = quant.fp8_per_tensor_scale(gate, up) if fmt is Format.FP8_PER_TENSOR else None
                emit(f"{prefix}.{e}.gate_proj.weight", gate, shared)
                emit(f"{prefix}.{e}.up_proj.weight", up, shared)
        elif name.endswith("experts.down_proj"):
            prefix = name.removesuffix(".down_proj")
            for e in range(t.shape[0]):
                emit(f"{prefix}.{e}.down_proj.weight", t[e])
        elif name.endswith("gate_proj.weight") and fmt is Format.FP8_PER_TENSOR:
            up_name = name.replace("gate_proj", "up_proj")
            if up_name in keep:
                emit(name, t)
                continue
            shared = quant.fp8_per_tensor_scale(t, state[up_name])
            emit(name, t, shared)
            emit(up_name, state[up_name], shared)
            done.add(up_name)
        else:
            emit(name, t)
    return out


def assert_outputs_equal(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for name, t in want.items():
        assert same_bytes(got[name], t), name


# ---- conversion equals quantizing each source slice directly


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_convert_matches_direct_quantization(model_type, fmt):
    """Every output equals sidecar.numerics.reference applied to its source slice, names and order per SPEC."""
    state = make_state_dict(model_type, unaligned=True, seed=3)
    got = convert(state, RefitSpec(model_type=model_type, fmt=fmt))
    assert_outputs_equal(got, expected_outputs(state, fmt))
    for name, t in got.items():
        if name.endswith(".weight") and ".mlp.experts." in name and fmt != "bf16":
            assert t.dtype == FP8_DTYPE
        elif name in state:
            assert t is state[name]  # passthrough aliases its input in convert()


def test_output_names_dtypes_and_shapes_follow_the_spec_table():
    state = make_state_dict("qwen3_5_moe", unaligned=True)  # H=160, I=96
    p = "model.language_model.layers.1.mlp.experts"
    block = convert(state, RefitSpec(model_type="qwen3_5_moe", fmt="block_fp8"))
    assert block[f"{p}.2.gate_proj.weight"].shape == (96, 160)
    assert block[f"{p}.2.gate_proj.weight_scale_inv"].dtype == torch.float32
    assert block[f"{p}.2.gate_proj.weight_scale_inv"].shape == (1, 2)
    assert block[f"{p}.2.down_proj.weight_scale_inv"].shape == (2, 1)
    assert f"{p}.gate_up_proj" not in block and f"{p}.down_proj" not in block
    mx = convert(state, RefitSpec(model_type="qwen3_5_moe", fmt="mxfp8"))
    assert mx[f"{p}.0.up_proj.weight_scale"].dtype == torch.uint8
    assert mx[f"{p}.0.up_proj.weight_scale"].shape == (96, 5)
    assert mx[f"{p}.0.down_proj.weight_scale"].shape == (160, 3)
    pt = convert(state, RefitSpec(model_type="qwen3_5_moe", fmt="fp8_per_tensor"))
    assert (
        pt[f"{p}.0.up_proj.weight_scale"].shape == ()
        and pt[f"{p}.0.up_proj.weight_scale"].dtype == torch.float32
    )
    keys = [k for k in block if k.startswith(f"{p}.0.")]
    assert keys == [
        f"{p}.0.gate_proj.weight",
        f"{p}.0.gate_proj.weight_scale_inv",
        f"{p}.0.up_proj.weight",
        f"{p}.0.up_proj.weight_scale_inv",
        f"{p}.0.down_proj.weight",
        f"{p}.0.down_proj.weight_scale_inv",
    ]


def test_mtp_experts_are_quantized():
    state = make_state_dict("qwen3_5_moe")
    out = convert(state, RefitSpec(model_type="qwen3_5_moe", fmt="block_fp8", num_last_layers_in_bf16=1))
    assert out["mtp.layers.0.mlp.experts.3.down_proj.weight"].dtype == FP8_DTYPE
    assert out["mtp.fc.weight"] is state["mtp.fc.weight"]


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_fp8_per_tensor_gate_and_up_share_one_scale_down_has_its_own(model_type):
    state = make_state_dict(model_type, seed=5)
    out = convert(state, RefitSpec(model_type=model_type, fmt="fp8_per_tensor"))
    p = (
        "model.layers.2.mlp.experts.1"
        if model_type == "qwen3_moe"
        else "model.language_model.layers.2.mlp.experts.1"
    )
    gate_s, up_s, down_s = (out[f"{p}.{x}_proj.weight_scale"] for x in ("gate", "up", "down"))
    assert same_bytes(gate_s, up_s)
    if model_type == "qwen3_moe":
        gate, up, down = (state[f"{p}.{x}_proj.weight"] for x in ("gate", "up", "down"))
    else:
        slab = state["model.language_model.layers.2.mlp.experts.gate_up_proj"][1]
        gate, up = slab[: slab.shape[0] // 2], slab[slab.shape[0] // 2 :]
        down = state["model.language_model.layers.2.mlp.experts.down_proj"][1]
    assert same_bytes(gate_s, quant.fp8_per_tensor_scale(gate, up))
    assert same_bytes(down_s, quant.fp8_per_tensor_scale(down))
    plan = RefitPlan.build(list(state.items()), RefitSpec(model_type=model_type, fmt="fp8_per_tensor"))
    if model_type == "qwen3_moe":  # one unit reads gate and up of one expert
        (unit,) = plan.units_for_input(f"{p}.gate_proj.weight")
        assert unit.inputs == (f"{p}.gate_proj.weight", f"{p}.up_proj.weight")


def test_passthrough_is_bit_for_bit_even_for_odd_bit_patterns():
    """run_unit copies a passthrough tensor exactly: NaN payloads, -0.0, subnormals and all."""
    state = make_state_dict("qwen3_5_moe")
    name = "model.language_model.layers.0.linear_attn.A_log"
    state[name] = torch.tensor([0x7FC1, -0x8000, 0x0001, -0x80], dtype=torch.int16).view(torch.bfloat16)
    plan = RefitPlan.build(list(state.items()), RefitSpec(model_type="qwen3_5_moe", fmt="block_fp8"))
    outputs = plan.allocate()
    (unit,) = plan.units_for_input(name)
    run_unit(unit, state, outputs)
    assert outputs[name] is not state[name] and same_bytes(outputs[name], state[name])


def test_run_unit_into_preallocated_buffers_in_any_order_equals_convert():
    """The daemon's path: allocate every output from the plan, then run units as inputs complete."""
    state = make_state_dict("qwen3_moe", unaligned=True)
    spec = RefitSpec(model_type="qwen3_moe", fmt="mxfp8")
    plan = RefitPlan.build(list(state.items()), spec)
    outputs = plan.allocate()
    for unit in reversed(plan.units):
        run_unit(unit, state, outputs)
    assert_outputs_equal(outputs, convert(state, spec))


def test_non_contiguous_slabs_convert_the_same():
    state = make_state_dict("qwen3_5_moe", unaligned=True)
    strided = {
        n: (t.transpose(-1, -2).contiguous().transpose(-1, -2) if t.dim() == 3 else t)
        for n, t in state.items()
    }
    assert not strided["model.language_model.layers.0.mlp.experts.gate_up_proj"].is_contiguous()
    spec = RefitSpec(model_type="qwen3_5_moe", fmt="block_fp8")
    assert_outputs_equal(convert(strided, spec), convert(state, spec))


def test_non_finite_expert_is_refused_naming_the_checkpoint_tensor():
    state = make_state_dict("qwen3_5_moe")
    slab = state["model.language_model.layers.1.mlp.experts.gate_up_proj"]
    slab[2, slab.shape[1] - 1, 0] = float("nan")  # in expert 2's up rows
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts\.2\.up_proj\.weight"):
        convert(state, RefitSpec(model_type="qwen3_5_moe", fmt="block_fp8"))


# ---- exclusions (SPEC §2.2)


def test_first_and_last_layers_stay_bf16_and_mtp_is_not_counted():
    state = make_state_dict("qwen3_5_moe", num_layers=4, mtp_layers=1)
    spec = RefitSpec(
        model_type="qwen3_5_moe", fmt="block_fp8", num_first_layers_in_bf16=1, num_last_layers_in_bf16=1
    )
    plan = RefitPlan.build(list(state.items()), spec)
    assert plan.num_hidden_layers == 4  # inferred from names, MTP not counted
    out = convert(state, spec)
    p = "model.language_model.layers"
    for layer in (0, 3):
        for slab in ("gate_up_proj", "down_proj"):
            assert out[f"{p}.{layer}.mlp.experts.{slab}"] is state[f"{p}.{layer}.mlp.experts.{slab}"]
    assert out[f"{p}.1.mlp.experts.0.gate_proj.weight"].dtype == FP8_DTYPE
    assert out[f"{p}.2.mlp.experts.0.down_proj.weight"].dtype == FP8_DTYPE
    assert out["mtp.layers.0.mlp.experts.0.gate_proj.weight"].dtype == FP8_DTYPE
    keep = {expected: [] for expected in KeepReason}
    for unit in plan.units:
        if unit.keep_reason:
            keep[unit.keep_reason].append(unit.layer)
    assert keep[KeepReason.FIRST_LAYERS] == [0, 0] and keep[KeepReason.LAST_LAYERS] == [3, 3]
    state_keep = {f"{p}.{lay}.mlp.experts.{s}" for lay in (0, 3) for s in ("gate_up_proj", "down_proj")}
    assert_outputs_equal(out, expected_outputs(state, "block_fp8", state_keep))


def test_ignore_patterns_match_module_names_with_fnmatch_case_sensitively():
    state = make_state_dict("qwen3_moe")
    spec = RefitSpec(
        model_type="qwen3_moe", fmt="block_fp8", ignore_patterns=["model.layers.1.mlp.experts.3.*"]
    )
    out = convert(state, spec)
    kept = {n for n in state if n.startswith("model.layers.1.mlp.experts.3.")}
    assert len(kept) == 3
    assert_outputs_equal(out, expected_outputs(state, "block_fp8", kept))
    upper = convert(state, RefitSpec(model_type="qwen3_moe", fmt="block_fp8", ignore_patterns="MODEL.*"))
    assert_outputs_equal(upper, expected_outputs(state, "block_fp8"))


def test_ignore_pattern_on_a_slab_name_keeps_that_slab_only():
    state = make_state_dict("qwen3_5_moe")
    down = "model.language_model.layers.2.mlp.experts.down_proj"
    out = convert(
        state, RefitSpec(model_type="qwen3_5_moe", fmt="mxfp8", ignore_patterns=("*.layers.2.*.down_proj",))
    )
    assert out[down] is state[down]
    assert "model.language_model.layers.2.mlp.experts.0.gate_proj.weight" in out
    assert_outputs_equal(out, expected_outputs(state, "mxfp8", {down}))


def test_manifest_keep_bf16_wins_with_or_without_weight_suffix():
    state = make_state_dict("qwen3_moe")
    gate = "model.layers.0.mlp.experts.1.gate_proj.weight"
    down = "model.layers.2.mlp.experts.0.down_proj.weight"
    keep = [gate.removesuffix(".weight"), down]
    out = convert(state, RefitSpec(model_type="qwen3_moe", fmt="fp8_per_tensor"), keep_bf16=keep)
    assert out[gate] is state[gate] and out[down] is state[down]
    up = gate.replace("gate_proj", "up_proj")  # quantized alone, with its own scale
    assert same_bytes(out[up.replace(".weight", ".weight_scale")], quant.fp8_per_tensor_scale(state[up]))
    assert_outputs_equal(out, expected_outputs(state, "fp8_per_tensor", {gate, down}))
    slab = "model.language_model.layers.1.mlp.experts.gate_up_proj"
    s35 = make_state_dict("qwen3_5_moe")
    plan = RefitPlan.build(
        list(s35.items()), RefitSpec(model_type="qwen3_5_moe", fmt="block_fp8"), keep_bf16=[slab]
    )
    (unit,) = plan.units_for_input(slab)
    assert unit.kind is UnitKind.PASSTHROUGH and unit.keep_reason is KeepReason.MANIFEST


def test_bf16_format_passes_everything_through():
    state = make_state_dict("qwen3_5_moe")
    plan = RefitPlan.build(list(state.items()), RefitSpec(model_type="qwen3_5_moe", fmt="bf16"))
    assert all(u.kind is UnitKind.PASSTHROUGH for u in plan.units)
    assert plan.bytes_out == plan.bytes_in


# ---- the spec validates itself


def test_refit_spec_converts_and_validates():
    spec = RefitSpec(model_type="qwen3_moe", fmt="Block-FP8", ignore_patterns=["a*", "b*"])
    assert spec.fmt is Format.BLOCK_FP8 and spec.ignore_patterns == ("a*", "b*")
    assert RefitSpec(model_type="qwen3_moe", fmt="bf16", ignore_patterns="x*").ignore_patterns == ("x*",)
    with pytest.raises(ValueError, match="qwen3_5_moe"):
        RefitSpec(model_type="gpt2", fmt="bf16")
    with pytest.raises(ValueError, match="unknown format"):
        RefitSpec(model_type="qwen3_moe", fmt="int4")
    with pytest.raises(ValueError, match="num_first_layers_in_bf16"):
        RefitSpec(model_type="qwen3_moe", fmt="bf16", num_first_layers_in_bf16=-1)
    with pytest.raises(ValueError, match="num_last_layers_in_bf16"):
        RefitSpec(model_type="qwen3_moe", fmt="bf16", num_last_layers_in_bf16=True)
    with pytest.raises(ValueError, match="exceeds"):
        RefitSpec(
            model_type="qwen3_moe",
            fmt="bf16",
            num_hidden_layers=4,
            num_first_layers_in_bf16=3,
            num_last_layers_in_bf16=2,
        )
    with pytest.raises(ValueError, match="num_hidden_layers"):
        RefitSpec(model_type="qwen3_moe", fmt="bf16", num_hidden_layers=0)
    with pytest.raises(ValueError, match="ignore_patterns"):
        RefitSpec(model_type="qwen3_moe", fmt="bf16", ignore_patterns=["ok*", ""])


def test_layer_counts_are_checked_against_the_names():
    specs = [(n, tuple(t.shape), t.dtype) for n, t in make_state_dict("qwen3_moe", num_layers=4).items()]
    with pytest.raises(ValueError, match="exceeds the model's 4 layers"):
        RefitPlan.build(specs, RefitSpec(model_type="qwen3_moe", fmt="mxfp8", num_first_layers_in_bf16=5))
    with pytest.raises(ValueError, match="names layer 3"):
        RefitPlan.build(specs, RefitSpec(model_type="qwen3_moe", fmt="mxfp8", num_hidden_layers=3))
    plan = RefitPlan.build(
        specs, RefitSpec(model_type="qwen3_moe", fmt="mxfp8", num_hidden_layers=6, num_last_layers_in_bf16=2)
    )
    assert all(u.kind is not UnitKind.PASSTHROUGH or u.keep_reason is None for u in plan.units)


# ---- validation: every problem in one error


def test_every_inconsistent_expert_tensor_is_reported_at_once():
    bf = torch.bfloat16
    p = "model.language_model.layers"
    specs = [
        (f"{p}.0.mlp.experts.gate_up_proj", (4, 63, 64), bf),  # odd 2I
        (f"{p}.0.mlp.experts.down_proj", (4, 64, 31), bf),
        (f"{p}.1.mlp.experts.gate_up_proj", (4, 64, 64), bf),  # E disagrees
        (f"{p}.1.mlp.experts.down_proj", (5, 64, 32), bf),
        (f"{p}.2.mlp.experts.gate_up_proj", (4, 64, 64), bf),  # H disagrees
        (f"{p}.2.mlp.experts.down_proj", (4, 96, 32), bf),
        (f"{p}.3.mlp.experts.gate_up_proj", (4, 64, 64), bf),  # no down_proj partner
        (f"{p}.4.mlp.experts.gate_up_proj", (64, 64), bf),  # not 3-D
        (f"{p}.4.mlp.experts.down_proj", (4, 64, 32), bf),
        (f"{p}.5.mlp.experts.gate_up_proj", (4, 64, 48), bf),  # mxfp8: in dim 48 % 32
        (f"{p}.5.mlp.experts.down_proj", (4, 48, 32), bf),
        ("model.layers.6.mlp.experts.0.gate_proj.weight", (32, 64), bf),  # gate/up shapes differ
        ("model.layers.6.mlp.experts.0.up_proj.weight", (48, 64), bf),
        ("model.layers.6.mlp.experts.0.down_proj.weight", (64, 32), bf),
        ("model.layers.6.mlp.experts.1.gate_proj.weight", (32, 64), bf),  # no down_proj
        ("model.layers.6.mlp.experts.1.up_proj.weight", (32, 64), bf),
    ]
    with pytest.raises(ValueError) as err:
        RefitPlan.build(specs, RefitSpec(model_type="qwen3_5_moe", fmt="mxfp8"))
    msg = str(err.value)
    for needle in (
        f"{p}.0.mlp.experts.gate_up_proj: shape (4, 63, 64) has an odd 2I",
        f"{p}.1.mlp.experts.gate_up_proj (4, 64, 64) and {p}.1.mlp.experts.down_proj (5, 64, 32) disagree on E",
        f"{p}.2.mlp.experts.down_proj (4, 96, 32) disagree on H",
        f"{p}.3.mlp.experts.gate_up_proj: no partner slab {p}.3.mlp.experts.down_proj",
        f"{p}.4.mlp.experts.gate_up_proj: shape (64, 64) is not 3-D",
        f"{p}.5.mlp.experts.gate_up_proj: mxfp8 needs the input dim to be a multiple of 32, got 48",
        "model.layers.6.mlp.experts.0.gate_proj.weight (32, 64) and model.layers.6.mlp.experts.0.up_proj.weight",
        "model.layers.6.mlp.experts.1: expert has no down_proj",
    ):
        assert needle in msg, needle
    assert msg.count("\n  - ") >= 8


def test_mxfp8_alignment_is_not_required_of_experts_kept_bf16():
    bf = torch.bfloat16
    p = "model.language_model.layers.0.mlp.experts"
    specs = [(f"{p}.gate_up_proj", (2, 64, 48), bf), (f"{p}.down_proj", (2, 48, 32), bf)]
    with pytest.raises(ValueError, match="multiple of 32"):
        RefitPlan.build(specs, RefitSpec(model_type="qwen3_5_moe", fmt="mxfp8"))
    plan = RefitPlan.build(
        specs, RefitSpec(model_type="qwen3_5_moe", fmt="mxfp8", ignore_patterns=[f"{p}.gate_up_proj"])
    )
    assert [u.kind for u in plan.units] == [UnitKind.PASSTHROUGH, UnitKind.SLAB]


def test_duplicate_inputs_and_clashing_outputs_are_refused():
    bf = torch.bfloat16
    with pytest.raises(ValueError, match="unique"):
        RefitPlan.build(
            [("a.weight", (2,), bf), ("a.weight", (2,), bf)], RefitSpec(model_type="qwen3_moe", fmt="bf16")
        )
    p = "model.layers.0.mlp.experts"
    specs = [
        (f"{p}.gate_up_proj", (1, 64, 32), bf),
        (f"{p}.down_proj", (1, 32, 32), bf),
        *[
            (f"{p}.0.{x}.weight", s, bf)
            for x, s in (("gate_proj", (32, 32)), ("up_proj", (32, 32)), ("down_proj", (32, 32)))
        ],
    ]
    with pytest.raises(ValueError, match="same output names"):
        RefitPlan.build(specs, RefitSpec(model_type="qwen3_moe", fmt="block_fp8"))


# ---- the plan alone (no data) predicts the conversion exactly


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_plan_from_shapes_equals_actual_outputs(model_type, fmt):
    kwargs = {"unaligned": True, "num_layers": 5}
    config = make_hf_config(model_type, **kwargs)
    spec = RefitSpec(model_type=model_type, fmt=fmt, num_last_layers_in_bf16=1)
    plan = plan_from_hf_config(config, spec)
    meta_plan = RefitPlan.build(list(meta_state_dict(config).items()), spec)
    got = convert(make_state_dict(model_type, **kwargs), spec)
    predicted = [(o.name, o.dtype, o.shape, o.nbytes) for o in plan.outputs]
    assert predicted == [(n, t.dtype, tuple(t.shape), t.numel() * t.element_size()) for n, t in got.items()]
    assert [(o.name, o.shape) for o in meta_plan.outputs] == [(o.name, o.shape) for o in plan.outputs]
    assert plan.bytes_out == sum(o.nbytes for o in plan.outputs) == sum(u.bytes_out for u in plan.units)
    assert plan.bytes_in == sum(u.bytes_in for u in plan.units)
    roles = {o.role for o in plan.outputs}
    assert roles == ({Role.PASSTHROUGH} if fmt == "bf16" else {Role.PASSTHROUGH, Role.WEIGHT, Role.SCALE})


def test_units_know_their_layers():
    state = make_state_dict("qwen3_5_moe")
    plan = RefitPlan.build(list(state.items()), RefitSpec(model_type="qwen3_5_moe", fmt="block_fp8"))
    (mtp,) = plan.units_for_input("mtp.layers.0.mlp.experts.gate_up_proj")
    assert plan.layer_of(mtp) == ("mtp", 0) and mtp.kind is UnitKind.SLAB
    (embed,) = plan.units_for_input("model.language_model.embed_tokens.weight")
    assert plan.layer_of(embed) is None
    (attn,) = plan.units_for_input("model.language_model.layers.3.self_attn.q_proj.weight")
    assert plan.layer_of(attn) == 3
    with pytest.raises(ValueError, match="no input named"):
        plan.units_for_input("nope")
    assert plan.inputs[0] == TensorSpec(
        "model.language_model.embed_tokens.weight", torch.bfloat16, (256, 128)
    )


# ---- streaming


def _shuffled(state: dict, seed: int = 0) -> list:
    items = list(state.items())
    random.Random(seed).shuffle(items)
    return items


@pytest.mark.parametrize("fmt", ["block_fp8", "fp8_per_tensor"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_iter_convert_in_shuffled_order_gives_the_same_bytes(model_type, fmt):
    state = make_state_dict(model_type, unaligned=True)
    spec = RefitSpec(model_type=model_type, fmt=fmt)
    specs = [(n, tuple(t.shape), t.dtype) for n, t in state.items()]
    consumed = 0

    def source():
        nonlocal consumed
        for item in _shuffled(state):
            consumed += 1
            yield item

    stream = iter_convert(source(), spec, specs=specs)
    first = next(stream)
    assert consumed < len(state)  # outputs flow before the last input arrives
    got = dict([first, *stream])
    want = convert(state, spec)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert same_bytes(got[name], t), name
    unmaterialised = dict(iter_convert(_shuffled(state, 1), spec))  # specs=None reads everything first
    assert sorted(unmaterialised) == sorted(want)


def test_iter_convert_names_missing_and_unknown_inputs():
    state = make_state_dict("qwen3_5_moe")
    spec = RefitSpec(model_type="qwen3_5_moe", fmt="mxfp8")
    specs = [(n, tuple(t.shape), t.dtype) for n, t in state.items()]
    lost = "model.language_model.layers.2.mlp.experts.down_proj"
    items = [(n, t) for n, t in state.items() if n != lost] + [("model.extra.weight", torch.zeros(2))]
    with pytest.raises(ValueError) as err:
        list(iter_convert(items, spec, specs=specs))
    assert lost in str(err.value) and "model.extra.weight" in str(err.value)
    bad = [(n, t[:1] if n == lost else t) for n, t in state.items()]
    with pytest.raises(ValueError, match="arrived as"):
        list(iter_convert(bad, spec, specs=specs))
    twice = [*state.items(), (lost, state[lost])]
    with pytest.raises(ValueError, match="arrived twice"):
        list(iter_convert(twice, spec, specs=specs))


# ---- the real models: parameter and scale totals computed from their config.json files


def _routed(plan: RefitPlan, decoder_only: bool = True) -> tuple[int, int]:
    """(params, scale bytes) of the routed experts, decoder layers only by default."""
    params = scale_bytes = 0
    for unit in plan.units:
        if unit.fmt is None or (decoder_only and not isinstance(unit.layer, int)):
            continue
        params += unit.bytes_in // 2
        scale_bytes += sum(o.nbytes for o in unit.outputs if o.role is Role.SCALE)
    return params, scale_bytes


def test_qwen3_5_35b_a3b_totals():
    config = json.loads((DATA / "qwen3.5-35b-a3b.config.json").read_text())
    block = plan_from_hf_config(config, RefitSpec(model_type="qwen3_5_moe", fmt="block_fp8"))
    params, scales = _routed(block)
    assert block.num_hidden_layers == 40
    assert params == 40 * 805_306_368  # 32.21 B routed params, 60.0 GiB BF16
    assert params * 2 == 60 * GIB
    assert scales == 7.5 * MIB  # 192 FP32 scales per expert-layer
    assert _routed(block, decoder_only=False)[0] == 41 * 805_306_368  # + the MTP layer's experts
    assert sum(u.kind is UnitKind.SLAB for u in block.units) == 82
    mx = plan_from_hf_config(config, RefitSpec(model_type="qwen3_5_moe", fmt="mxfp8"))
    assert _routed(mx)[1] == 960 * MIB
    summary = summarize(block)
    assert summary["routed_expert_params"] == 41 * 805_306_368
    assert summary["quantized"]["weights"] == 41 * 256 * 3


def test_qwen3_30b_a3b_totals():
    config = json.loads((DATA / "qwen3-30b-a3b.config.json").read_text())
    plan = plan_from_hf_config(config, RefitSpec(model_type="qwen3_moe", fmt="mxfp8"))
    params, scales = _routed(plan)
    assert plan.num_hidden_layers == 48
    assert params == 48 * 603_979_776 == 28_991_029_248  # 28.99 B
    assert params * 2 == 54 * GIB
    assert scales == 864 * MIB
    assert sum(u.fmt is not None for u in plan.units) == 48 * 128 * 3


# ---- DeepSeek-V3 / GLM-4.5: the checkpoint's own scheme, per-tensor dtypes, appended MTP, a node's share

DSV3_KW = {"num_layers": 3, "num_experts": 4}


def _dsv3(fmt: str = "block_fp8", **spec_kw) -> tuple[dict, dict, RefitPlan]:
    config = make_hf_config("deepseek_v3", **DSV3_KW)
    state = make_state_dict("deepseek_v3", **DSV3_KW)
    plan = plan_from_hf_config(config, RefitSpec(model_type="deepseek_v3", fmt=fmt, **spec_kw))
    return config, state, plan


def _quantized_modules(plan: RefitPlan) -> set[str]:
    return {o.name.removesuffix(".weight") for o in plan.outputs if o.role is Role.WEIGHT}


def test_block_fp8_checkpoint_quantizes_its_linears_too():
    """DeepSeek-V3's quantization_config (weight_block_size [128, 128]) makes attention projections,
    the dense MLP and the shared experts FP8 with weight_scale_inv, like the routed experts; the
    router, its FP32 bias, embeddings, heads, norms and the MTP eh_proj pass through."""
    _, _, plan = _dsv3()
    quantized = _quantized_modules(plan)
    for module in (
        "model.layers.0.self_attn.q_a_proj",
        "model.layers.0.self_attn.q_b_proj",
        "model.layers.0.self_attn.kv_a_proj_with_mqa",
        "model.layers.0.self_attn.kv_b_proj",
        "model.layers.0.self_attn.o_proj",
        "model.layers.0.mlp.gate_proj",
        "model.layers.0.mlp.down_proj",
        "model.layers.1.mlp.shared_experts.up_proj",
        "model.layers.3.self_attn.q_a_proj",  # the MTP layer's own attention
        "model.layers.3.mlp.experts.0.gate_proj",
    ):
        assert module in quantized, module
    outs = {o.name: o for o in plan.outputs}
    assert outs["model.layers.0.self_attn.q_b_proj.weight_scale_inv"].shape == (2, 1)  # [192, 128] in blocks
    for name in (
        "model.layers.1.mlp.gate.weight",
        "model.layers.1.mlp.gate.e_score_correction_bias",
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.layers.3.eh_proj.weight",
        "model.layers.3.shared_head.head.weight",
        "model.layers.0.self_attn.kv_a_layernorm.weight",
    ):
        assert outs[name].role is Role.PASSTHROUGH, name
    kinds = {u.inputs[0]: u.kind for u in plan.units}
    assert kinds["model.layers.0.self_attn.o_proj.weight"] is UnitKind.LINEAR


def test_spec_narrows_and_widens_the_checkpoint_scheme():
    """ignore_patterns and quantize_linears=False narrow what the checkpoint quantizes; a BF16
    checkpoint (GLM-4.5) quantizes only its routed experts unless quantize_linears=True widens it."""
    _, _, narrowed = _dsv3(ignore_patterns=("*.self_attn.kv_b_proj",))
    assert "model.layers.0.self_attn.kv_b_proj" not in _quantized_modules(narrowed)
    assert "model.layers.0.self_attn.q_b_proj" in _quantized_modules(narrowed)
    _, _, experts_only = _dsv3(quantize_linears=False)
    assert all(".mlp.experts." in m for m in _quantized_modules(experts_only))
    glm = make_hf_config("glm4_moe", **DSV3_KW)
    plain = plan_from_hf_config(glm, RefitSpec(model_type="glm4_moe", fmt="block_fp8"))
    assert all(".mlp.experts." in m for m in _quantized_modules(plain))
    wide = plan_from_hf_config(glm, RefitSpec(model_type="glm4_moe", fmt="block_fp8", quantize_linears=True))
    assert "model.layers.0.self_attn.q_proj" in _quantized_modules(wide)
    assert "model.layers.1.mlp.gate" not in _quantized_modules(wide)
    assert {o.role for o in wide.outputs if o.name == "model.layers.0.self_attn.q_proj.bias"} == {
        Role.PASSTHROUGH
    }


def test_modules_to_not_convert_stay_bf16():
    config = make_hf_config("deepseek_v3", **DSV3_KW)
    config["quantization_config"]["modules_to_not_convert"] = ["model.layers.0.self_attn.o_proj"]
    plan = plan_from_hf_config(config, RefitSpec(model_type="deepseek_v3", fmt="block_fp8"))
    assert "model.layers.0.self_attn.o_proj" not in _quantized_modules(plan)
    assert "model.layers.1.self_attn.o_proj" in _quantized_modules(plan)


def test_a_checkpoint_block_other_than_128_is_refused():
    config = make_hf_config("deepseek_v3", **DSV3_KW)
    config["quantization_config"]["weight_block_size"] = [64, 64]
    with pytest.raises(ValueError, match="weight_block_size"):
        plan_from_hf_config(config, RefitSpec(model_type="deepseek_v3", fmt="block_fp8"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_deepseek_v3_converts_byte_exact_and_fp32_passes_through(fmt):
    """Every quantized linear equals sidecar.numerics.reference on its own; the FP32 router bias and every other
    passthrough comes out bit for bit in its own dtype; the plan's input sizes follow the dtypes."""
    _, state, plan = _dsv3(fmt)
    out = convert(state, plan.spec)  # the spec with the checkpoint's scheme resolved
    assert list(out) == [o.name for o in plan.outputs]
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert out[bias].dtype is torch.float32 and same_bytes(out[bias], state[bias])
    assert {i.name: i for i in plan.inputs}[bias].nbytes == 4 * DSV3_KW["num_experts"]
    for o in plan.outputs:
        if o.role is Role.WEIGHT:
            q, s = quant.quantize(o.source_view(state[o.source]), Format(fmt))
            if (
                fmt == "fp8_per_tensor"
                and ".mlp.experts." in o.name
                and o.proj is not None
                and o.proj.value != "down_proj"
            ):
                continue  # gate+up share one scale: covered by the Qwen tests
            assert same_bytes(out[o.name], q), o.name
            assert same_bytes(out[o.scale_name], s), o.scale_name
        elif o.role is Role.PASSTHROUGH:
            assert same_bytes(out[o.name], state[o.source]), o.name


def test_appended_mtp_layer_is_an_mtp_layer():
    """DeepSeek-V3's MTP layer is model.layers.{num_hidden_layers}: the plan counts it as ("mtp", 0),
    num_last_layers_in_bf16 leaves it alone, and the layer count is inferred without it."""
    _, state, plan = _dsv3(num_last_layers_in_bf16=1)
    layers = {u.layer for u in plan.units}
    assert ("mtp", 0) in layers and 3 not in layers
    assert "model.layers.3.mlp.experts.0.gate_proj" in _quantized_modules(plan)
    assert "model.layers.2.mlp.experts.0.gate_proj" not in _quantized_modules(plan)
    inferred = RefitPlan.build(list(state.items()), RefitSpec(model_type="deepseek_v3", fmt="block_fp8"))
    assert inferred.num_hidden_layers == 3


def test_engine_layout_places_experts_like_the_engines():
    from sidecar.plan.build import EngineLayout

    layout = EngineLayout(ep=16, tp=1, nodes=2)
    assert layout.experts_of_node(256, 0) == range(0, 128)
    assert layout.experts_of_node(256, 1) == range(128, 256)
    odd = EngineLayout(ep=4, nodes=2)
    assert [odd.experts_of_rank(10, r) for r in range(4)] == [
        range(0, 3),
        range(3, 6),
        range(6, 8),
        range(8, 10),
    ]
    assert odd.experts_of_node(10, 1) == range(6, 10)
    with pytest.raises(ValueError, match="tp=16 spans"):
        EngineLayout(ep=16, tp=16, nodes=2)
    with pytest.raises(ValueError, match="evenly"):
        EngineLayout(ep=12, nodes=8)
    with pytest.raises(ValueError, match=r"nodes 0\.\.1"):
        layout.experts_of_node(256, 2)


def test_a_node_plans_only_its_share_and_the_nodes_cover_the_model():
    """With EP across two nodes each node publishes its half of the routed experts and everything
    else whole; the other node's per-expert inputs are dropped; together they cover every output."""
    from sidecar.plan.build import EngineLayout

    config, _, whole = _dsv3()
    layout = EngineLayout(ep=4, nodes=2)
    shares = [plan_from_hf_config(config, whole.spec, share=(layout, n)) for n in range(2)]
    names = [{o.name for o in p.outputs} for p in shares]
    assert names[0] | names[1] == {o.name for o in whole.outputs}
    common = names[0] & names[1]
    assert not any(".mlp.experts." in n for n in common)
    assert "model.layers.1.mlp.experts.1.up_proj.weight" in names[0] - names[1]
    assert "model.layers.1.mlp.experts.2.up_proj.weight" in shares[0].dropped
    assert "model.layers.1.mlp.experts.2.up_proj.weight" not in {i.name for i in shares[0].inputs}


def test_slab_share_publishes_only_the_nodes_experts():
    from sidecar.plan.build import EngineLayout

    config = make_hf_config("qwen3_5_moe", num_layers=4, num_experts=4)
    spec = RefitSpec(model_type="qwen3_5_moe", fmt="block_fp8")
    plan = plan_from_hf_config(config, spec, share=(EngineLayout(ep=4, nodes=2), 1))
    experts = {o.expert for o in plan.outputs if o.role is Role.WEIGHT}
    assert experts == {2, 3} and not plan.dropped
    state = make_state_dict("qwen3_5_moe", num_layers=4, num_experts=4)
    outputs = plan.allocate()
    for unit in plan.units:
        run_unit(unit, state, outputs)
    whole = convert(state, spec)
    for o in plan.outputs:
        assert same_bytes(outputs[o.name], whole[o.name]), o.name


def test_the_daemon_spec_follows_the_checkpoint_scheme(tmp_path):
    """The daemon resolves quantize_linears from its hf_config once, so the plan it checks an
    engine's manifest against (and the one it builds from a step's declarations) quantizes the
    same linears as the plan it allocated from the config (an attach was refused before)."""
    from sidecar.config.settings import DaemonConfig
    from sidecar.daemon.setup import refit_spec

    config = make_hf_config("deepseek_v3", **DSV3_KW)
    spec = refit_spec(DaemonConfig(runtime_dir=tmp_path, format="block_fp8"), config)
    assert spec.quantize_linears is True
    state = make_state_dict("deepseek_v3", **DSV3_KW)
    declared = RefitPlan.build([(n, t) for n, t in state.items()], spec)
    assert _quantized_modules(declared) == _quantized_modules(plan_from_hf_config(config, spec))
    qwen = refit_spec(DaemonConfig(runtime_dir=tmp_path, format="block_fp8"), make_hf_config("qwen3_5_moe"))
    assert qwen.quantize_linears is False


def test_an_fp32_input_passes_through_in_its_own_dtype():
    """Qwen3.5's A_log may arrive as FP32: the plan carries the input's dtype, sizes follow it, and
    the output is the input's bytes."""
    state = make_state_dict("qwen3_5_moe", num_layers=4, num_experts=4)
    name = "model.language_model.layers.0.linear_attn.A_log"
    state[name] = state[name].float() - 1.0
    spec = RefitSpec(model_type="qwen3_5_moe", fmt="mxfp8")
    plan = RefitPlan.build(list(state.items()), spec)
    assert {i.name: i for i in plan.inputs}[name].nbytes == 4 * state[name].numel()
    out = convert(state, spec)
    assert out[name].dtype is torch.float32 and same_bytes(out[name], state[name])
