"""The SGLang adapter's pure parts (no SGLang needed): the manifest from the parameter lists SGLang
0.5.23's real classes hold (recorded by ``make test-sglang``'s harness into
``tests/data/sglang_0.5.23_params.json``), the daemon's attach check against it, the attach refusals,
and the ``quantization_config`` that keeps in BF16 what the plan keeps in BF16."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from adapters.sglang import build_manifest, check_sglang_constraints, sglang_quantization_config
from adapters.sglang.checkpoint import hf_field_names
from adapters.sglang.quant import resolve_quant
from sidecar.numerics.formats import Format
from sidecar.plan.attach import check_manifest
from sidecar.plan.build import with_checkpoint_scheme
from sidecar.plan.models import get_model
from sidecar.plan.spec import RefitSpec

RECORDED = json.loads((Path(__file__).parent / "data" / "sglang_0.5.23_params.json").read_text())["models"]


def _recorded(key: str):
    entry = RECORDED[key]
    return entry["config"], [(n, d, tuple(s)) for n, d, s in entry["params"]]


def _manifest(key: str, **kw):
    config, params = _recorded(key)
    return config, build_manifest(params, config, config["quantization_config"], **kw)


@pytest.mark.parametrize("key", ["qwen3_moe_block_fp8", "deepseek_v3_block_fp8_linears"])
def test_the_daemon_accepts_the_manifest_of_sglangs_real_parameters(key):
    """Every name SGLang holds maps to a published tensor with its dtype and shape; the DeepSeek case
    (block-FP8 kv_a_proj_with_mqa of 192 rows, not a multiple of 128) was refused before as if it were
    an MoE operand."""
    config, manifest = _manifest(key)
    cfg = hf_field_names(config)
    spec = with_checkpoint_scheme(RefitSpec(model_type=cfg["model_type"], fmt=Format.BLOCK_FP8), cfg)
    inputs = get_model(cfg["model_type"]).parameters(cfg, include_mtp=False)
    check = check_manifest(inputs, spec, manifest)
    assert check.ok, check.errors
    assert not check_sglang_constraints(manifest, config)
    names = manifest.by_name()
    assert not any("routed_experts" in n for n in names)
    assert names["model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv"].dtype == torch.float32
    if key.startswith("qwen3"):  # the router stays BF16 under Fp8Config (vLLM quantizes it)
        assert names["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16
    else:  # fused_qkv_a_proj_with_mqa -> both shards, each with its own block scales
        assert names["model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape == (2, 2)
        assert names["model.layers.1.self_attn.q_a_proj.weight"].dtype == torch.float8_e4m3fn
        assert names["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32


def test_a_parameter_no_checkpoint_tensor_maps_to_is_refused_by_name():
    """SGLang skips unknown names silently: the adapter lists the engine parameter it cannot fill."""
    config, params = _recorded("qwen3_moe_block_fp8")
    params = [*params, ("model.layers.0.self_attn.rogue_proj.weight", "bfloat16", (4, 4))]
    with pytest.raises(ValueError, match=r"rogue_proj.*skip it silently"):
        build_manifest(params, config, config["quantization_config"])


def test_mxfp8_scales_are_the_checkpoints_weight_scale():
    """SGLang holds MXFP8 scales as ``weight_scale_inv`` (uint8); ``load_weights_only`` renames the
    checkpoint's ``weight_scale``: the manifest lists the checkpoint name, with the MXFP8 grid."""
    config, params = _recorded("qwen3_moe_block_fp8")
    mx = [(n, "uint8" if n.endswith("_scale_inv") else d, s) for n, d, s in params if "self_attn" not in n]
    mx = [(n, d, s) for n, d, s in mx if ".experts." in n or not n.endswith("_scale_inv")]
    manifest = build_manifest(mx, config, {"quant_method": "mxfp8", "activation_scheme": "dynamic"})
    names = manifest.by_name()
    assert manifest.expert_format is Format.MXFP8
    assert names["model.layers.0.mlp.experts.2.up_proj.weight_scale"].shape == (128, 256 // 32)
    assert names["model.layers.0.mlp.experts.2.down_proj.weight_scale"].dtype == torch.uint8
    assert not any(n.endswith("weight_scale_inv") for n in names)


def test_attach_refusals_name_the_setting_that_works():
    config, manifest = _manifest("qwen3_moe_block_fp8", deepgemm_scale_ue8m0=True, dp_size=2)
    problems = check_sglang_constraints(manifest, config)
    assert any("SGLANG_ENABLE_JIT_DEEPGEMM=0" in p for p in problems)
    assert any("dp_size > 1" in p and "dp_size=1" in p for p in problems)
    _, params = _recorded("qwen3_moe_block_fp8")
    per_tensor = build_manifest(
        [(n, d, s) for n, d, s in params if not n.endswith("_scale_inv")], config, {"quant_method": "fp8"}
    )
    assert per_tensor.expert_format is Format.FP8_PER_TENSOR
    (problem,) = check_sglang_constraints(per_tensor, config)
    assert "cannot reload per-tensor FP8" in problem and "block_fp8" in problem


def test_block_fp8_alignment_is_checked_against_the_tp_split():
    config, manifest = _manifest("qwen3_moe_block_fp8", tp_size=2)
    (problem,) = check_sglang_constraints(manifest, config)
    assert "128/2 = 64" in problem and "--ep-size" in problem


def test_quantization_config_keeps_in_bf16_what_the_plan_keeps():
    config, _ = _recorded("qwen3_moe_block_fp8")
    config = {k: v for k, v in hf_field_names(config).items() if k != "quantization_config"}
    spec = RefitSpec(model_type="qwen3_moe", fmt=Format.BLOCK_FP8, num_first_layers_in_bf16=1)
    qc = sglang_quantization_config(spec, config)
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]
    skip = qc["modules_to_not_convert"]
    assert "model.layers.0.mlp.experts" in skip and "model.layers.1.mlp.experts" not in skip
    assert {"model.layers.1.mlp.gate", "model.layers.1.self_attn.q_proj", "lm_head"} <= set(skip)
    assert resolve_quant(qc).fmt is Format.BLOCK_FP8
    mx = sglang_quantization_config(RefitSpec(model_type="qwen3_moe", fmt=Format.MXFP8), config)
    assert mx["quant_method"] == "mxfp8" and resolve_quant(mx).fmt is Format.MXFP8
    assert sglang_quantization_config(RefitSpec(model_type="qwen3_moe", fmt=Format.BF16), config) is None


# --------------------------------------------------------------------------------------------------
# the 4-bit formats (adapters.sglang.fourbit): parameter lists of SGLang's ModelOptNvFp4FusedMoEMethod
# and CompressedTensorsWNA16MoE, recorded as above (their CUDA-only processing a no-op: see
# tests/test_adapter_sglang_fourbit.py)


@pytest.mark.parametrize(
    ("key", "fmt"), [("qwen3_moe_nvfp4", Format.NVFP4), ("qwen3_moe_int4_w4a16", Format.INT4_W4A16)]
)
def test_the_daemon_accepts_sglangs_four_bit_manifest(key, fmt):
    """Every 4-bit name SGLang loads maps to SPEC §2.3's tensors; NVFP4's activation scales are kept as
    held (not published, not refused); INT4's group and scale dtype come from SGLang's parameters."""
    config, manifest = _manifest(key)
    assert manifest.expert_format is fmt and resolve_quant(config["quantization_config"]).fmt is fmt
    cfg = hf_field_names(config)
    spec = with_checkpoint_scheme(
        RefitSpec(model_type="qwen3_moe", fmt=fmt, params=manifest.format_params), cfg
    )
    check = check_manifest(get_model("qwen3_moe").parameters(cfg, include_mtp=False), spec, manifest)
    assert check.ok, check.errors
    assert not check_sglang_constraints(manifest, config)
    names = manifest.by_name()
    if fmt is Format.NVFP4:
        assert names["model.layers.1.mlp.experts.0.gate_proj.weight_scale"].dtype == torch.float8_e4m3fn
        assert names["model.layers.1.mlp.experts.0.up_proj.weight_scale_2"].shape == ()
        assert manifest.info["held_input_scales"] == [
            f"model.layers.{n}.mlp.experts.{w}_input_scale" for n in (0, 1) for w in ("w13", "w2")
        ]
        assert manifest.moe_backend == "ModelOptNvFp4FusedMoEMethod"
    else:
        assert names["model.layers.1.mlp.experts.0.gate_proj.weight_packed"].shape == (128, 256 // 8)
        assert names["model.layers.1.mlp.experts.0.gate_proj.weight_scale"].shape == (128, 256 // 32)
        assert (manifest.format_params.int4_group, manifest.format_params.int4_scale_dtype) == (
            32,
            "bfloat16",
        )
        assert not any("g_idx" in n for n in names)


def test_four_bit_attach_refusals_quote_sglangs_reason():
    """NVFP4 through Marlin (parameters replaced without a weight_loader), INT4 through the Triton WNA16
    experts (the same), K multiples under a TP split, and MXFP4 (SGLang's Mxfp4MoEMethod reads other names)."""
    config, params = _recorded("qwen3_moe_nvfp4")
    qc = config["quantization_config"]
    lost = ["model.layers.0.mlp.experts.w13_weight"]
    marlin = build_manifest(
        params, config, qc, no_loader=lost, moe_runner_backend="auto", device_capability=90
    )
    (problem,) = check_sglang_constraints(marlin, config)
    assert (
        "Marlin on SM90" in problem
        and "marlin_utils_fp4.py:530" in problem
        and "flashinfer_trtllm" in problem
    )
    config4, params4 = _recorded("qwen3_moe_int4_w4a16")
    triton = build_manifest(
        params4, config4, config4["quantization_config"], no_loader=lost, device_capability=100
    )
    (problem,) = check_sglang_constraints(triton, config4)
    assert "CompressedTensorsWNA16TritonMoE on SM100" in problem and "--moe-runner-backend marlin" in problem
    # moe_intermediate_size 128 over tp 16: 8 per rank, not a multiple of NVFP4's 16
    split = build_manifest(params, config, qc, tp_size=16)
    assert any(
        "moe_intermediate_size / tp = 8" in p and "16" in p for p in check_sglang_constraints(split, config)
    )
    linear = [(n, "uint8", s) if n.endswith("self_attn.o_proj.weight") else (n, d, s) for n, d, s in params]
    (problem,) = check_sglang_constraints(build_manifest(linear, config, qc), config)
    assert "4-bit routed experts only" in problem and "quantize_linears" in problem
    spec = RefitSpec(model_type="qwen3_moe", fmt=Format.MXFP4)
    with pytest.raises(ValueError, match=r"Mxfp4MoEMethod.*compressed_tensors.py:236-242.*weight_packed"):
        sglang_quantization_config(spec, hf_field_names(config))
    mx = {**config4["quantization_config"]}
    mx["config_groups"] = {
        "group_0": {"weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32}}
    }
    with pytest.raises(ValueError, match="MXFP4"):
        resolve_quant(mx)


def test_int4_group_and_scale_dtype_come_from_sglangs_parameters():
    """A group-128 config: SGLang's ``w13_weight_scale [E, H/128, 2I]`` (the recorded list with its
    scale rows regrouped) gives the manifest's group; a float16 model's scales are refused by name."""
    config, params = _recorded("qwen3_moe_int4_w4a16")
    qc = json.loads(json.dumps(config["quantization_config"]))
    qc["config_groups"]["group_0"]["weights"]["group_size"] = 128

    def regroup(name, dtype, shape, scale_dtype="bfloat16"):
        if name.endswith("_weight_scale"):
            return name, scale_dtype, (shape[0], shape[1] * 32 // 128, shape[2])
        return name, dtype, shape

    manifest = build_manifest([regroup(*p) for p in params], config, qc)
    assert (manifest.format_params.int4_group, manifest.format_params.int4_scale_dtype) == (128, "bfloat16")
    assert manifest.by_name()["model.layers.0.mlp.experts.1.down_proj.weight_scale"].shape == (
        256,
        128 // 128,
    )
    with pytest.raises(ValueError, match=r"float16 \(the model dtype\).*--dtype bfloat16"):
        build_manifest([regroup(*p, scale_dtype="float16") for p in params], config, qc)
    with pytest.raises(ValueError, match="not one per 32"):  # the config says 32, SGLang holds 128
        build_manifest([regroup(*p) for p in params], config, config["quantization_config"])
