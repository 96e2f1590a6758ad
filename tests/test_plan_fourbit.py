"""Plans and conversion in the 4-bit formats (SPEC §2.3's names for nvfp4, mxfp4 and int4_w4a16)."""

from __future__ import annotations

import pytest
import torch

from sidecar.cli.demo.synthetic import make_state_dict
from sidecar.numerics import fourbit
from sidecar.numerics.formats import FOUR_BIT_FORMATS, Format
from sidecar.plan.build import RefitPlan, RefitSpec, Role, UnitKind
from sidecar.plan.run import convert, iter_convert

FORMATS = [f.value for f in FOUR_BIT_FORMATS]
MODEL_TYPES = ["qwen3_5_moe", "qwen3_moe"]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def expected_outputs(state: dict[str, torch.Tensor], fmt: Format) -> dict[str, torch.Tensor]:
    """SPEC §2.3 written out plainly with sidecar.numerics.fourbit, in plan order."""
    out: dict[str, torch.Tensor] = {}

    def emit(name: str, w: torch.Tensor, gs: torch.Tensor | None = None) -> None:
        module = name.removesuffix(".weight")
        if fmt is Format.NVFP4:
            q, s, g = fourbit.quantize_nvfp4(w, global_scale=gs)
            out.update({f"{module}.weight": q, f"{module}.weight_scale": s, f"{module}.weight_scale_2": g})
        elif fmt is Format.MXFP4:
            q, s = fourbit.quantize_mxfp4(w)
            out.update({f"{module}.weight_packed": q, f"{module}.weight_scale": s})
        else:
            q, s, shape = fourbit.quantize_int4(w)
            out.update(
                {f"{module}.weight_packed": q, f"{module}.weight_scale": s, f"{module}.weight_shape": shape}
            )

    def shared(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
        return fourbit.nvfp4_global_scale(gate, up) if fmt is Format.NVFP4 else None

    done = set()
    for name, t in state.items():
        if name in done:
            continue
        if ".mlp.experts." not in name:
            out[name] = t
        elif name.endswith("gate_up_proj"):
            prefix, i = name.removesuffix(".gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                gs = shared(t[e, :i], t[e, i:])
                emit(f"{prefix}.{e}.gate_proj.weight", t[e, :i], gs)
                emit(f"{prefix}.{e}.up_proj.weight", t[e, i:], gs)
        elif name.endswith("experts.down_proj"):
            prefix = name.removesuffix(".down_proj")
            for e in range(t.shape[0]):
                emit(f"{prefix}.{e}.down_proj.weight", t[e])
        elif name.endswith("gate_proj.weight") and fmt is Format.NVFP4:
            up_name = name.replace("gate_proj", "up_proj")
            gs = shared(t, state[up_name])
            emit(name, t, gs)
            emit(up_name, state[up_name], gs)
            done.add(up_name)
        else:
            emit(name, t)
    return out


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_convert_matches_direct_quantization(model_type, fmt):
    state = make_state_dict(model_type, unaligned=True, seed=3)
    got = convert(state, RefitSpec(model_type=model_type, fmt=fmt))
    want = expected_outputs(state, Format(fmt))
    assert list(got) == list(want)
    for name, t in want.items():
        assert same_bytes(got[name], t), name
    streamed = dict(iter_convert(list(state.items()), RefitSpec(model_type=model_type, fmt=fmt)))
    assert set(streamed) == set(want) and all(same_bytes(streamed[n], t) for n, t in want.items())


def test_output_names_dtypes_and_shapes_follow_the_spec_table():
    state = make_state_dict("qwen3_5_moe", unaligned=True)  # H=160, I=96
    p = "model.language_model.layers.1.mlp.experts.2"
    nv = convert(state, RefitSpec(model_type="qwen3_5_moe", fmt="nvfp4"))
    assert [k for k in nv if k.startswith(f"{p}.gate_proj.")] == [
        f"{p}.gate_proj.weight",
        f"{p}.gate_proj.weight_scale",
        f"{p}.gate_proj.weight_scale_2",
    ]
    assert nv[f"{p}.gate_proj.weight"].dtype == torch.uint8 and nv[f"{p}.gate_proj.weight"].shape == (96, 80)
    assert nv[f"{p}.gate_proj.weight_scale"].dtype == torch.float8_e4m3fn
    assert nv[f"{p}.gate_proj.weight_scale"].shape == (96, 10)
    assert (
        nv[f"{p}.gate_proj.weight_scale_2"].dtype == torch.float32
        and nv[f"{p}.gate_proj.weight_scale_2"].shape == ()
    )
    assert nv[f"{p}.down_proj.weight"].shape == (160, 48)
    # gate and up share one global scale; down has its own
    assert torch.equal(nv[f"{p}.gate_proj.weight_scale_2"], nv[f"{p}.up_proj.weight_scale_2"])
    mx = convert(state, RefitSpec(model_type="qwen3_5_moe", fmt="mxfp4"))
    assert [k for k in mx if k.startswith(f"{p}.up_proj.")] == [
        f"{p}.up_proj.weight_packed",
        f"{p}.up_proj.weight_scale",
    ]
    assert mx[f"{p}.up_proj.weight_packed"].shape == (96, 80) and mx[f"{p}.up_proj.weight_scale"].shape == (
        96,
        5,
    )
    i4 = convert(state, RefitSpec(model_type="qwen3_5_moe", fmt="int4_w4a16"))
    assert [k for k in i4 if k.startswith(f"{p}.down_proj.")] == [
        f"{p}.down_proj.weight_packed",
        f"{p}.down_proj.weight_scale",
        f"{p}.down_proj.weight_shape",
    ]
    assert i4[f"{p}.down_proj.weight_packed"].dtype == torch.int32 and i4[
        f"{p}.down_proj.weight_packed"
    ].shape == (160, 12)
    assert i4[f"{p}.down_proj.weight_scale"].dtype == torch.bfloat16 and i4[
        f"{p}.down_proj.weight_scale"
    ].shape == (160, 3)
    assert i4[f"{p}.down_proj.weight_shape"].tolist() == [160, 96]


@pytest.mark.parametrize("fmt", FORMATS)
def test_plan_sizes_and_units(fmt):
    state = make_state_dict("qwen3_5_moe")
    plan = RefitPlan.build(list(state.items()), RefitSpec(model_type="qwen3_5_moe", fmt=fmt))
    allocated = plan.allocate()
    for o in plan.outputs:
        assert allocated[o.name].nbytes == o.nbytes
    for u in plan.units:
        if u.kind is UnitKind.SLAB:
            weights = [o for o in u.outputs if o.role is Role.WEIGHT]
            assert all(o.extra_name is not None for o in weights) == (fmt != "mxfp4")
            if fmt == "nvfp4" and u.inputs[0].endswith("gate_up_proj"):
                assert all(len(g) == 2 for g in u.scale_groups)  # gate + up share gs
            else:
                assert all(len(g) == 1 for g in u.scale_groups)
    routed_in = sum(i.nbytes for i in plan.inputs if ".mlp.experts." in i.name)
    routed_out = sum(o.nbytes for o in plan.outputs if ".mlp.experts." in o.name)
    # 4 bits per value plus the scales: NVFP4 4.5 bits (+ gs), MXFP4 4.25, INT4 with bf16 per 32 4.5
    assert 0.26 < routed_out / routed_in < 0.29


@pytest.mark.parametrize("fmt", FORMATS)
def test_in_dim_not_a_multiple_is_refused_naming_the_tensor(fmt):
    state = {
        "model.layers.0.mlp.experts.0.gate_proj.weight": torch.zeros(32, 40, dtype=torch.bfloat16),
        "model.layers.0.mlp.experts.0.up_proj.weight": torch.zeros(32, 40, dtype=torch.bfloat16),
        "model.layers.0.mlp.experts.0.down_proj.weight": torch.zeros(40, 32, dtype=torch.bfloat16),
    }
    with pytest.raises(ValueError, match=f"{fmt} needs the input dim to be a multiple") as err:
        RefitPlan.build(list(state.items()), RefitSpec(model_type="qwen3_moe", fmt=fmt))
    assert "experts.0.gate_proj.weight" in str(err.value)


def test_nan_in_one_expert_is_refused_naming_it():
    state = make_state_dict("qwen3_moe", seed=1)
    name = next(n for n in state if n.endswith("experts.1.up_proj.weight"))
    state[name] = state[name].clone()
    state[name][3, 5] = float("nan")
    for fmt in FORMATS:
        with pytest.raises(ValueError, match="NaN or Inf") as err:
            convert(state, RefitSpec(model_type="qwen3_moe", fmt=fmt))
        assert "experts.1" in str(err.value)


@pytest.mark.parametrize("fmt", FORMATS)
def test_sqnr_tile_of_a_packed_weight(fmt):
    """The daemon's SQNR probe dequantizes a tile of a published 4-bit weight: the same values as the
    whole weight's dequantization, cut to the tile."""
    from sidecar.numerics.reference import dequantize
    from sidecar.ops.metrics import dequantize_tile

    f = Format(fmt)
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(2)).bfloat16()
    got = (
        fourbit.quantize_nvfp4(w)
        if f is Format.NVFP4
        else (fourbit.quantize_mxfp4(w) if f is Format.MXFP4 else fourbit.quantize_int4(w))
    )
    extra = got[2] if f is Format.NVFP4 else None
    whole = dequantize(got[0], got[1], f, global_scale=extra)
    rows, cols = slice(128, 256), slice(128, 512)
    assert torch.equal(dequantize_tile(got[0], got[1], f, rows, cols, extra), whole[rows, cols])
