"""The reference engine in the 4-bit formats: its manifest is what convert() publishes, a generation
loads byte for byte, the packed experts decode by SPEC's rules, and the logits stay close to BF16."""

from __future__ import annotations

import pytest
import torch

from adapters.reference import ReferenceEngine, next_token_kl, sample_inputs
from sidecar.cli.demo.synthetic import make_hf_config, make_state_dict
from sidecar.numerics import fourbit
from sidecar.numerics.formats import FOUR_BIT_FORMATS, Format
from sidecar.plan.build import RefitSpec, plan_from_hf_config
from sidecar.plan.run import convert

MODEL = "qwen3_5_moe"
SIZES = {"num_layers": 4, "num_experts": 8, "unaligned": True}  # H=160, I=96: multiples of 32
CONFIG = make_hf_config(MODEL, **SIZES)
FORMATS = [f.value for f in FOUR_BIT_FORMATS]
#: a loose ceiling on the mean next-token KL(BF16 || 4-bit), seed 0. Measured: nvfp4 ~4e-4, mxfp4
#: ~5e-4, int4_w4a16 ~3.5e-4 (the FP8 formats: 4e-5 to 2.3e-4)
KL_BOUND = 0.02


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


@pytest.fixture(scope="module")
def state() -> dict[str, torch.Tensor]:
    return make_state_dict(MODEL, seed=0, **SIZES)


@pytest.mark.parametrize("fmt", FORMATS)
def test_manifest_load_decode_and_kl(fmt, state):
    published = convert(state, RefitSpec(model_type=MODEL, fmt=fmt))
    engine = ReferenceEngine.from_config(CONFIG, expert_format=fmt)
    manifest = engine.manifest(version="t")
    plan = plan_from_hf_config(CONFIG, RefitSpec(model_type=MODEL, fmt=fmt))
    want = {o.name: (o.dtype, tuple(o.shape)) for o in plan.outputs}
    assert {t.name: (t.dtype, tuple(t.shape)) for t in manifest.tensors} == want
    assert {n: (t.dtype, tuple(t.shape)) for n, t in published.items()} == want
    assert manifest.expert_format is Format(fmt)
    engine.load(published)
    p = "model.language_model.layers.1.mlp.experts"
    params = engine.params
    inter = CONFIG["text_config"]["moe_intermediate_size"]
    f = Format(fmt)
    for e in (0, 5):
        gate, up, down = (
            published[f"{p}.{e}.{proj}.{f.weight_suffix}"] for proj in ("gate_proj", "up_proj", "down_proj")
        )
        assert torch.equal(_bytes(params[f"{p}.w13_weight"][e, :inter]), _bytes(gate))
        assert torch.equal(_bytes(params[f"{p}.w13_weight"][e, inter:]), _bytes(up))
        assert torch.equal(_bytes(params[f"{p}.w2_weight"][e]), _bytes(down))
    # what the forward pass multiplies by: SPEC's dequantization of each published projection
    w13 = engine.compute_weight(f"{p}.w13_weight")
    for e in (0, 7):
        for proj, rows in (("gate_proj", slice(0, inter)), ("up_proj", slice(inter, 2 * inter))):
            m = f"{p}.{e}.{proj}"
            q, s = published[f"{m}.{f.weight_suffix}"], published[f"{m}.weight_scale"]
            if f is Format.NVFP4:
                want_w = fourbit.dequantize_nvfp4(q, s, published[f"{m}.weight_scale_2"])
            elif f is Format.MXFP4:
                want_w = fourbit.dequantize_mxfp4(q, s)
            else:
                want_w = fourbit.dequantize_int4(q, s)
            assert torch.equal(w13[e, rows], want_w), m
    bf16 = ReferenceEngine.from_config(CONFIG, expert_format="bf16")
    bf16.load_bf16(state)
    ids = sample_inputs(CONFIG["text_config"]["vocab_size"], seed=0)
    kl = next_token_kl(bf16.forward(ids), engine.forward(ids))
    assert 0 < kl < KL_BOUND


@pytest.mark.parametrize("fmt", FORMATS)
def test_first_and_last_layers_kept_bf16(fmt, state):
    first_last = ["model.language_model.layers.0.mlp.experts", "model.language_model.layers.3.mlp.experts"]
    engine = ReferenceEngine.from_config(CONFIG, expert_format=fmt, keep_bf16=first_last)
    spec = RefitSpec(model_type=MODEL, fmt=fmt, num_first_layers_in_bf16=1, num_last_layers_in_bf16=1)
    out = convert(state, spec)
    assert {t.name: (t.dtype, tuple(t.shape)) for t in engine.manifest().tensors} == {
        n: (t.dtype, tuple(t.shape)) for n, t in out.items()
    }
    engine.load(out)
    assert torch.isfinite(engine.forward(sample_inputs(CONFIG["text_config"]["vocab_size"], seed=1))).all()


def test_deepseek_engine_refuses_four_bit():
    with pytest.raises(ValueError, match="FP8 or BF16 experts, not nvfp4"):
        ReferenceEngine.from_config(make_hf_config("deepseek_v3"), expert_format="nvfp4")


# --------------------------------------------------------------------------------------------------
# vLLM takes the 4-bit formats (ModelOpt NVFP4, compressed-tensors W4A16 / MXFP4); TensorRT-LLM takes
# NVFP4 (tests/test_adapter_trtllm_nvfp4.py) and refuses MXFP4 / INT4 naming the names it reads instead


@pytest.mark.parametrize("fmt", FORMATS)
def test_vllm_gives_four_bit_args_and_trtllm_takes_nvfp4_only(fmt):
    from adapters.trtllm.args import trtllm_llm_args
    from adapters.trtllm.backends import backend_refusal
    from adapters.vllm.args import vllm_engine_args
    from adapters.vllm.quant import COMPRESSED_TENSORS_REFUSAL, resolve_quant

    spec = RefitSpec(model_type=MODEL, fmt=fmt)
    args = vllm_engine_args(spec, CONFIG)
    qc = args["hf_overrides"]["quantization_config"]
    if fmt == "nvfp4":
        assert args["quantization"] == "modelopt_fp4" and qc["quant_algo"] == "NVFP4"
        assert resolve_quant(qc).fmt is Format.NVFP4 and resolve_quant(qc).static_activations
        ignored = qc["ignore"]
    else:
        assert args["quantization"] == "compressed-tensors"
        want = "pack-quantized" if fmt == "int4_w4a16" else "mxfp4-pack-quantized"
        assert qc["format"] == want and resolve_quant(qc).fmt is Format.parse(fmt)
        ignored = qc["ignore"]
        unknown = {**qc, "config_groups": {"g": {"weights": {"type": "other"}}}}
        with pytest.raises(ValueError, match="compressed-tensors") as exc:
            resolve_quant(unknown)  # a scheme refitd does not publish: refused at attach, naming the fix
        assert str(exc.value) == COMPRESSED_TENSORS_REFUSAL and "nvfp4" in str(exc.value)
    assert "lm_head" in ignored and not any(".mlp.experts" in m for m in ignored)  # as for FP8
    if fmt == "nvfp4":
        trt = trtllm_llm_args(spec, CONFIG, sm=100, load_format="auto")["model_kwargs"]["quantization_config"]
        assert trt["quant_algo"] == "NVFP4" and "lm_head" in trt["exclude_modules"]
        assert backend_refusal(fmt, "CutlassFusedMoE", 100) is None
    else:
        with pytest.raises(
            ValueError, match=f"TensorRT-LLM (cannot load|has no MoE that loads) refitd's {fmt}"
        ):
            trtllm_llm_args(spec, CONFIG)
        assert "format to one of them" in backend_refusal(fmt, "CutlassFusedMoE", 100)
