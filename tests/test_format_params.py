"""Format parameters the engine decides (DESIGN: "the engine's manifest decides"): INT4's group size and
scale dtype (SPEC §1.7) and NVFP4 under compressed-tensors' names (SPEC §2.3), through the plan, the
conversion, the manifest and the attach check. Byte-exact against the torch reference; decoded by
compressed-tensors' real decompressors (the ``test`` extra) to SPEC's values."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sidecar.cli.demo.synthetic import make_state_dict
from sidecar.numerics import fourbit
from sidecar.numerics.formats import DEFAULT_FORMAT_PARAMS, FormatParams, Nvfp4Names
from sidecar.plan.attach import check_manifest, with_engine_params
from sidecar.plan.build import RefitPlan, RefitSpec, Role, TensorSpec
from sidecar.plan.run import convert, iter_convert
from sidecar.protocol.manifest import EngineKind, Manifest, ManifestTensor

G128_F32 = FormatParams(int4_group=128, int4_scale_dtype="float32")
CT_NAMES = FormatParams(nvfp4_names="compressed_tensors")


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.fixture(scope="module")
def ct() -> SimpleNamespace:
    """compressed-tensors, imported when a test runs (it imports Triton; see test_fourbit_libraries)."""
    from compressed_tensors.compressors import NVFP4PackedCompressor, PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import generate_gparam

    def scheme(**args) -> QuantizationScheme:
        return QuantizationScheme(
            targets=["Linear"], weights=QuantizationArgs(num_bits=4, symmetric=True, **args)
        )

    return SimpleNamespace(
        NVFP4PackedCompressor=NVFP4PackedCompressor,
        PackedQuantizationCompressor=PackedQuantizationCompressor,
        generate_gparam=generate_gparam,
        int4=lambda g: scheme(type="int", strategy="group", group_size=g),
        nvfp4=scheme(type="float", strategy="tensor_group", group_size=16),
    )


def manifest_of(plan: RefitPlan, params: FormatParams = DEFAULT_FORMAT_PARAMS) -> Manifest:
    return Manifest(
        engine=EngineKind.REFERENCE,
        engine_version="test",
        moe_backend="ReferenceFusedMoE",
        expert_format=plan.spec.format,
        tensors=tuple(ManifestTensor(o.name, o.dtype, tuple(o.shape)) for o in plan.outputs),
        format_params=params,
    )


# --------------------------------------------------------------------------------------------------
# the parameters themselves


def test_parameters_are_checked_naming_the_fix():
    with pytest.raises(ValueError, match="positive multiple of 8"):
        FormatParams(int4_group=12)
    with pytest.raises(ValueError, match="positive multiple of 8"):
        FormatParams(int4_group=True)
    with pytest.raises(ValueError, match="bfloat16, float32"):
        FormatParams(int4_scale_dtype="float16")
    with pytest.raises(ValueError, match="modelopt, compressed_tensors"):
        FormatParams(nvfp4_names="gguf")
    assert FormatParams(int4_scale_dtype="torch.float32").int4_scale_torch_dtype is torch.float32
    assert FormatParams(nvfp4_names="compressed-tensors").nvfp4_names is Nvfp4Names.COMPRESSED_TENSORS
    with pytest.raises(ValueError, match=r"int4_group = 128.*applies to another format than nvfp4"):
        RefitSpec(model_type="qwen3_moe", fmt="nvfp4", params=G128_F32)
    with pytest.raises(ValueError, match="nvfp4_names = compressed_tensors applies to another format"):
        RefitSpec(model_type="qwen3_moe", fmt="int4_w4a16", params=CT_NAMES)


def test_manifest_carries_the_parameters_and_an_old_one_means_the_defaults():
    state = make_state_dict("qwen3_moe", num_layers=1, num_experts=2)
    plan = RefitPlan.build(
        list(state.items()), RefitSpec(model_type="qwen3_moe", fmt="int4_w4a16", params=G128_F32)
    )
    wire = manifest_of(plan, G128_F32).to_wire()
    assert wire["format_params"] == {
        "int4_group": 128,
        "int4_scale_dtype": "float32",
        "nvfp4_names": "modelopt",
    }
    assert Manifest.from_wire(wire).format_params == G128_F32
    old = {k: v for k, v in wire.items() if k != "format_params"}
    assert Manifest.from_wire(old).format_params == DEFAULT_FORMAT_PARAMS
    for bad, needle in (
        ({"int4_group": 100}, "positive multiple of 8"),
        ({"int4_group": "128"}, "positive multiple of 8"),
        ({"group": 128}, "unknown format parameter"),
        ({"nvfp4_names": 3}, "must be a string"),
    ):
        with pytest.raises(ValueError, match=f"malformed manifest: .*{needle}"):
            Manifest.from_wire({**wire, "format_params": bad})
    with pytest.raises(ValueError, match="applies to another format than int4_w4a16"):
        Manifest.from_wire({**wire, "format_params": {"nvfp4_names": "compressed_tensors"}})


# --------------------------------------------------------------------------------------------------
# INT4: the engine's group size and scale dtype


@pytest.mark.parametrize(
    "params",
    [
        FormatParams(int4_group=64),
        FormatParams(int4_group=128),
        FormatParams(int4_scale_dtype="float32"),
        G128_F32,
    ],
    ids=lambda p: f"g{p.int4_group}-{p.int4_scale_dtype}",
)
@pytest.mark.parametrize("model_type", ["qwen3_5_moe", "qwen3_moe"])
def test_int4_outputs_follow_the_group_and_scale_dtype_byte_exact(model_type, params):
    """Every routed expert's packed words, scales and shape are the torch reference's under the
    engine's group and scale dtype (the conversion runs the native CPU kernels), in a batch and
    streamed; the plan's sizes are what it allocates."""
    state = make_state_dict(model_type, seed=5)  # H = I = 128
    spec = RefitSpec(model_type=model_type, fmt="int4_w4a16", params=params)
    plan = RefitPlan.build(list(state.items()), spec)
    got = convert(state, spec)
    streamed = dict(iter_convert(list(state.items()), spec))
    weights = [o for o in plan.outputs if o.role is Role.WEIGHT]
    assert weights
    for w in weights:
        src = w.source_view(state[w.source])
        want = fourbit.quantize_int4(src, group=params.int4_group, scale_dtype=params.int4_scale_torch_dtype)
        for name, t in zip(w.quantized_outputs, want, strict=True):
            assert same_bytes(got[name], t), name
            assert same_bytes(streamed[name], t), name
        assert got[w.scale_name].shape == (*src.shape[:-1], src.shape[-1] // params.int4_group)
    for o in plan.outputs:
        assert got[o.name].nbytes == o.nbytes and got[o.name].dtype == o.dtype


@pytest.mark.parametrize("params", [FormatParams(int4_group=128), G128_F32], ids=["bf16", "f32"])
def test_int4_group_128_decoded_by_compressed_tensors(params, ct):
    """compressed-tensors' pack-quantized ``decompress`` (group_size 128) of the published tensors gives
    SPEC's ``q * s``: exactly in float32 with float32 scales, rounded once to bfloat16 with bf16 ones."""
    state = make_state_dict("qwen3_moe", num_layers=1, num_experts=2, seed=9)
    got = convert(state, RefitSpec(model_type="qwen3_moe", fmt="int4_w4a16", params=params))
    modules = sorted({n.rsplit(".", 1)[0] for n in got if n.endswith(".weight_packed")})
    assert len(modules) == 6
    for m in modules:
        packed, scale, shape = (
            got[f"{m}.{leaf}"] for leaf in ("weight_packed", "weight_scale", "weight_shape")
        )
        spec_values = fourbit.dequantize_int4(packed, scale)
        state_dict = {"weight_packed": packed, "weight_scale": scale, "weight_shape": shape}
        out = ct.PackedQuantizationCompressor.decompress(state_dict, ct.int4(128))["weight"]
        assert out.dtype == scale.dtype and torch.equal(out.float(), spec_values.to(scale.dtype).float())
        if scale.dtype == torch.float32:
            assert torch.equal(out, spec_values)


def test_a_k_the_group_does_not_divide_is_refused_naming_the_fix():
    """K = 96 takes group 32 but not 128: the plan is refused naming the tensor and what divides it."""
    state = make_state_dict("qwen3_moe", num_layers=1, num_experts=2, hidden=128, intermediate=96)
    with pytest.raises(
        ValueError,
        match=r"down_proj.weight: int4_w4a16 needs the input dim to be a multiple of 128 "
        r"\(the group size the engine holds\), got 96; .*32 divides 96",
    ):
        RefitPlan.build(
            list(state.items()), RefitSpec(model_type="qwen3_moe", fmt="int4_w4a16", params=G128_F32)
        )
    RefitPlan.build(list(state.items()), RefitSpec(model_type="qwen3_moe", fmt="int4_w4a16"))  # group 32 fits


# --------------------------------------------------------------------------------------------------
# NVFP4 under compressed-tensors' names


def test_nvfp4_under_compressed_tensors_names_is_the_same_bytes():
    """``weight_packed`` / ``weight_scale`` hold ModelOpt's ``weight`` / ``weight_scale`` bytes;
    ``weight_global_scale`` is ``float32(1 / weight_scale_2)``, shape [1] (compressed-tensors'
    one-element global scale); gate and up still share it."""
    state = make_state_dict("qwen3_5_moe", seed=2)
    modelopt = convert(state, RefitSpec(model_type="qwen3_5_moe", fmt="nvfp4"))
    ours = convert(state, RefitSpec(model_type="qwen3_5_moe", fmt="nvfp4", params=CT_NAMES))
    modules = [n.removesuffix(".weight_scale_2") for n in modelopt if n.endswith(".weight_scale_2")]
    assert modules and len(ours) == len(modelopt)
    for m in modules:
        assert same_bytes(ours[f"{m}.weight_packed"], modelopt[f"{m}.weight"])
        assert same_bytes(ours[f"{m}.weight_scale"], modelopt[f"{m}.weight_scale"])
        g = ours[f"{m}.weight_global_scale"]
        assert g.dtype == torch.float32 and g.shape == (1,)
        assert same_bytes(g, (1.0 / modelopt[f"{m}.weight_scale_2"]).reshape(1))
    p = "model.language_model.layers.1.mlp.experts.3"
    assert torch.equal(ours[f"{p}.gate_proj.weight_global_scale"], ours[f"{p}.up_proj.weight_global_scale"])
    passthrough = [n for n in modelopt if ".mlp.experts." not in n]
    assert all(same_bytes(ours[n], modelopt[n]) for n in passthrough)


def test_nvfp4_compressed_tensors_names_decoded_by_compressed_tensors(ct):
    """compressed-tensors' NVFP4 ``decompress`` of the published tensors: the E2M1 codes and e4m3 block
    scales are exact; it divides ``s`` by the global scale in bfloat16 (its arithmetic, not SPEC's
    ``s * gs``), so its values are SPEC's within one bfloat16 rounding (docs/formats.md). Its own global
    scale (``generate_gparam``: 2688 / amax) is refitd's ``1 / gs`` or one float32 ulp from it."""
    state = make_state_dict("qwen3_moe", num_layers=1, num_experts=2, seed=4)
    got = convert(state, RefitSpec(model_type="qwen3_moe", fmt="nvfp4", params=CT_NAMES))
    ulps = []
    for m in sorted({n.rsplit(".", 1)[0] for n in got if n.endswith(".weight_packed")}):
        packed, scale, g = (
            got[f"{m}.{leaf}"] for leaf in ("weight_packed", "weight_scale", "weight_global_scale")
        )
        spec_values = fourbit.dequantize_nvfp4(packed, scale, 1.0 / g.reshape(()))
        out = ct.NVFP4PackedCompressor.decompress(
            {"weight_packed": packed, "weight_scale": scale, "weight_global_scale": g}, ct.nvfp4
        )["weight"].float()
        assert bool((out == 0).eq(spec_values == 0).all())
        assert bool(((out - spec_values).abs() <= spec_values.abs() * 2.0**-7).all())
        w = state[f"{m}.weight"].float()
        pair = (
            [w]
            if m.endswith("down_proj")
            else [state[f"{m.rsplit('.', 1)[0]}.{p}.weight"].float() for p in ("gate_proj", "up_proj")]
        )
        amax = torch.stack([t.abs().amax() for t in pair]).amax()
        theirs = ct.generate_gparam(-amax, amax)
        ulps.append(int((theirs.view(torch.int32) - g.view(torch.int32)).abs()))
    assert max(ulps) <= 1


# --------------------------------------------------------------------------------------------------
# the attach check: the engine's manifest decides


@pytest.mark.parametrize(
    ("fmt", "params"), [("int4_w4a16", G128_F32), ("nvfp4", CT_NAMES)], ids=["int4", "nvfp4"]
)
def test_the_engines_manifest_decides_the_parameters(fmt, params):
    state = make_state_dict("qwen3_5_moe", num_layers=2, num_experts=2)
    inputs = [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in state.items()]
    spec = RefitSpec(model_type="qwen3_5_moe", fmt=fmt)  # the daemon's: the defaults
    engine_plan = RefitPlan.build(inputs, RefitSpec(model_type="qwen3_5_moe", fmt=fmt, params=params))
    assert with_engine_params(spec, manifest_of(engine_plan, params)).params == params
    check = check_manifest(inputs, spec, manifest_of(engine_plan, params))
    assert check.ok, check.errors
    assert check.plan.spec.params == params
    assert [(o.name, o.dtype, o.shape) for o in check.plan.outputs] == [
        (o.name, o.dtype, o.shape) for o in engine_plan.outputs
    ]
    # an adapter that lists these tensors but says nothing of the parameters: every mismatch is named
    stale = check_manifest(inputs, spec, manifest_of(engine_plan))
    assert not stale.ok
    assert any("the plan does not publish it" in e or "the plan publishes" in e for e in stale.errors)


# --------------------------------------------------------------------------------------------------
# vLLM's engine arguments from the same choice


def test_vllm_engine_args_follow_the_plans_parameters():
    """INT4's ``group_size`` and NVFP4's compressed-tensors scheme come from the spec the daemon plans
    with; the config parses back (``resolve_quant``) to the same format parameters. float32 INT4
    scales are refused: vLLM's WNA16 MoE holds its scales in the model dtype."""
    from adapters.vllm.args import vllm_engine_args
    from adapters.vllm.quant import resolve_quant
    from sidecar.cli.demo.synthetic import make_hf_config
    from sidecar.numerics.formats import Format

    cfg = make_hf_config("qwen3_moe", num_layers=2, num_experts=2)
    g128 = FormatParams(int4_group=128)
    args = vllm_engine_args(RefitSpec(model_type="qwen3_moe", fmt="int4_w4a16", params=g128), cfg)
    qc = args["hf_overrides"]["quantization_config"]
    assert qc["format"] == "pack-quantized" and qc["config_groups"]["group_0"]["weights"]["group_size"] == 128
    q = resolve_quant(qc)
    assert (q.fmt, q.params) == (Format.INT4_W4A16, g128)
    with pytest.raises(
        ValueError, match="CompressedTensorsWNA16MoEMethod holds the group scales in the model dtype"
    ):
        vllm_engine_args(RefitSpec(model_type="qwen3_moe", fmt="int4_w4a16", params=G128_F32), cfg)

    modelopt = vllm_engine_args(RefitSpec(model_type="qwen3_moe", fmt="nvfp4"), cfg)
    args = vllm_engine_args(RefitSpec(model_type="qwen3_moe", fmt="nvfp4", params=CT_NAMES), cfg)
    qc = args["hf_overrides"]["quantization_config"]
    assert args["quantization"] == "compressed-tensors" and qc["format"] == "nvfp4-pack-quantized"
    group = qc["config_groups"]["group_0"]
    assert group["weights"]["strategy"] == "tensor_group" and group["weights"]["group_size"] == 16
    assert group["input_activations"] is None  # NVFP4 weights, BF16 activations: nothing to carry over
    assert qc["ignore"] == modelopt["hf_overrides"]["quantization_config"]["ignore"]
    q = resolve_quant(qc)
    assert (q.fmt, q.params, q.static_activations) == (Format.NVFP4, CT_NAMES, False)
    mx = {
        **qc,
        "config_groups": {
            "g": {"weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32}}
        },
    }
    assert resolve_quant(mx).fmt is Format.MXFP4
    odd = {
        **qc,
        "config_groups": {
            "g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 12}}
        },
    }
    with pytest.raises(ValueError, match="nvfp4-pack-quantized"):
        resolve_quant(odd)  # a group refitd cannot publish: refused naming what refitd publishes


# --------------------------------------------------------------------------------------------------
# the reference engine holding a variant


@pytest.mark.parametrize(
    ("fmt", "params"),
    [("int4_w4a16", FormatParams(int4_group=64, int4_scale_dtype="float32")), ("nvfp4", CT_NAMES)],
    ids=["int4-g64-f32", "nvfp4-ct"],
)
def test_the_reference_engine_holds_a_variant_and_decodes_it(fmt, params):
    """The reference engine built with format parameters says them in its manifest, the attach check
    re-plans a default spec to them, the generation loads byte for byte, the forward pass multiplies by
    SPEC's values (NVFP4's ``gs`` recovered from compressed-tensors' reciprocal, as vLLM does) and the
    next-token KL against BF16 stays small."""
    from adapters.reference import ReferenceEngine, next_token_kl, sample_inputs
    from sidecar.cli.demo.synthetic import make_hf_config

    sizes = {"num_layers": 2, "num_experts": 4}  # H = I = 128
    cfg = make_hf_config("qwen3_5_moe", **sizes)
    state = make_state_dict("qwen3_5_moe", seed=3, **sizes)
    engine = ReferenceEngine.from_config(cfg, expert_format=fmt, format_params=params)
    manifest = engine.manifest(version="t")
    assert manifest.format_params == params
    inputs = [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in state.items()]
    check = check_manifest(inputs, RefitSpec(model_type="qwen3_5_moe", fmt=fmt), manifest)
    assert check.ok, check.errors
    published = convert(state, check.plan.spec)
    engine.load(published)
    p = "model.language_model.layers.1.mlp.experts"
    w13 = engine.compute_weight(f"{p}.w13_weight")
    inter = 128
    for e in (0, 3):
        for proj, rows in (("gate_proj", slice(0, inter)), ("up_proj", slice(inter, 2 * inter))):
            m = f"{p}.{e}.{proj}"
            if fmt == "nvfp4":
                q, s, g = (
                    published[f"{m}.{leaf}"]
                    for leaf in ("weight_packed", "weight_scale", "weight_global_scale")
                )
                want = fourbit.dequantize_nvfp4(q, s, 1.0 / g.reshape(()))
            else:
                want = fourbit.dequantize_int4(
                    published[f"{m}.weight_packed"], published[f"{m}.weight_scale"]
                )
            assert torch.equal(w13[e, rows], want), m
    bf16 = ReferenceEngine.from_config(cfg, expert_format="bf16")
    bf16.load_bf16(state)
    ids = sample_inputs(cfg["text_config"]["vocab_size"], seed=0)
    assert 0 < next_token_kl(bf16.forward(ids), engine.forward(ids)) < 0.02
    with pytest.raises(ValueError, match="applies to another format"):
        ReferenceEngine.from_config(cfg, expert_format="mxfp4", format_params=params)


# --------------------------------------------------------------------------------------------------
# refitd plan


def test_refitd_plan_takes_the_parameters(capsys, tmp_path):
    """``refitd plan --int4-group 128 --int4-scale-dtype float32`` plans float32 scales per 128 (0.25
    bits a value against bf16 per 32's 0.5: fewer bytes out) and says so; a flag of another format is
    refused naming it (exit 1)."""
    import argparse
    import json

    from sidecar.cli import plan as plan_cli
    from sidecar.cli.demo.synthetic import make_hf_config

    config = tmp_path / "config.json"
    config.write_text(json.dumps(make_hf_config("qwen3_moe", num_layers=2, num_experts=4)))

    def run(*argv: str) -> int:
        parser = argparse.ArgumentParser(prog="refitd")
        plan_cli.add_parser(parser.add_subparsers(dest="command"))
        args = parser.parse_args(["plan", str(config), *argv])
        return args.run(args)

    assert run("--format", "int4_w4a16", "--json") == 0
    default = json.loads(capsys.readouterr().out)
    assert (
        run("--format", "int4_w4a16", "--int4-group", "128", "--int4-scale-dtype", "float32", "--json") == 0
    )
    g128 = json.loads(capsys.readouterr().out)
    assert (default["format_params"], g128["format_params"]) == (
        "group 32, bfloat16 scales",
        "group 128, float32 scales",
    )
    assert g128["quantized"]["bytes_out"] < default["quantized"]["bytes_out"]
    assert run("--format", "nvfp4", "--nvfp4-names", "compressed_tensors") == 0
    assert "routed experts -> nvfp4 (compressed_tensors names)" in capsys.readouterr().out
    assert run("--format", "nvfp4", "--int4-group", "128") == 1
    assert "int4_group = 128 applies to another format than nvfp4" in capsys.readouterr().err
