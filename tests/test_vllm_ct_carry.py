"""adapters.vllm.ct_carry: compressed-tensors NVFP4 W4A4's activation global scales carried back from
the scale vLLM holds (pure torch). What ``processed`` mirrors is checked against vLLM's real
``convert_to_nvfp4_moe_kernel_format`` per backend, and the carry on the real Qwen3-MoE, in
tests/test_engine_vllm_variants.py (``make test-engines``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from adapters.vllm.ct_carry import CT_NVFP4_W4A4_BACKENDS, carried_global_scales, processed

EXPERTS = 8
HELD_BACKENDS = sorted(CT_NVFP4_W4A4_BACKENDS - {"MARLIN", "HUMMING"})


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float32).contiguous().view(torch.int32)


def _layer(g13: torch.Tensor, g2: torch.Tensor, backend: str) -> SimpleNamespace:
    held13, held2 = processed(backend, g13, g2)
    return SimpleNamespace(
        w13_input_global_scale=g13.clone(),
        w2_input_global_scale=g2.clone(),
        w13_input_scale=held13,
        w2_input_scale=held2,
    )


def _calibrated(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.exp2(torch.randn(EXPERTS, 1, generator=g) * 6 + 10).float()  # 2688 / amax, spread
    return gate_up.expand(EXPERTS, 2).contiguous(), torch.exp2(
        torch.randn(EXPERTS, generator=g) * 6 + 10
    ).float()


@pytest.mark.parametrize("backend", HELD_BACKENDS)
@pytest.mark.parametrize("seed", range(20))
def test_the_carried_scales_reproduce_the_held_scale_bit_for_bit(backend, seed):
    g13, g2 = _calibrated(seed)
    layer = _layer(g13, g2, backend)
    kept13, kept2 = carried_global_scales("m", layer, backend)  # the loaded values still process into it
    assert torch.equal(_bits(kept13), _bits(g13)) and torch.equal(_bits(kept2), _bits(g2))
    layer.w13_input_global_scale.fill_(3.0)  # gone: computed back from the held scale
    layer.w2_input_global_scale.fill_(5.0)
    c13, c2 = carried_global_scales("m", layer, backend)
    assert c13.shape == (EXPERTS, 2) and c2.shape == (EXPERTS,) and c13.device.type == "cpu"
    back13, back2 = processed(backend, c13, c2)
    assert torch.equal(_bits(back13), _bits(layer.w13_input_scale)), backend
    assert torch.equal(_bits(back2), _bits(layer.w2_input_scale)), backend


def test_a_backend_that_drops_the_scales_gets_the_loaded_values_back():
    g13, g2 = _calibrated(0)
    layer = SimpleNamespace(
        w13_input_global_scale=g13, w2_input_global_scale=g2, w13_input_scale=None, w2_input_scale=None
    )
    c13, c2 = carried_global_scales("m", layer, "MARLIN")
    assert torch.equal(_bits(c13), _bits(g13)) and torch.equal(_bits(c2), _bits(g2))


def test_refusals_name_why():
    g13, g2 = _calibrated(1)
    with pytest.raises(ValueError, match=r"does not mirror.*moe_backend"):
        carried_global_scales("m", _layer(g13, g2, "EMULATION"), "SOME_NEW_BACKEND")
    for bad in (0.0, float("inf"), -1.0):
        layer = _layer(g13, g2, "VLLM_CUTLASS")
        layer.w2_input_scale = layer.w2_input_scale.clone()
        layer.w2_input_scale[3] = bad
        with pytest.raises(
            ValueError, match=r"m: the engine holds NVFP4 activation scale .* finite positive"
        ):
            carried_global_scales("m", layer, "VLLM_CUTLASS")
    # a float32 that 1 / x reaches from no float32 (the map is monotone: a gap between consecutive images)
    bits = torch.tensor(1.0).view(torch.int32) + torch.arange(1 << 23, dtype=torch.int32)
    image = _bits(1.0 / bits.view(torch.float32))
    gap = torch.nonzero(image[:-1] - image[1:] > 1)[0]  # decreasing: a skipped value between two images
    hole = (image[int(gap)] - 1).view(torch.float32)
    layer = _layer(g13, g2, "VLLM_CUTLASS")
    layer.w2_input_scale = layer.w2_input_scale.clone()
    layer.w2_input_scale[0] = hole
    with pytest.raises(ValueError, match=r"no float32 input_global_scale reproduces .* VLLM_CUTLASS's 1 / x"):
        carried_global_scales("m", layer, "VLLM_CUTLASS")


def test_the_w4a4_config_is_compressed_tensors_nvfp4_preset_and_resolves_static():
    """``vllm_engine_args(..., nvfp4_w4a4=True)``: the group's activations are compressed-tensors 0.20.0's
    own ``NVFP4`` preset's (parsed by its ``QuantizationArgs``), the config resolves to NVFP4 under
    compressed-tensors' names with static activations (the manifest then counts the carried scales);
    NVFP4A16 does not, and the flag is refused for another format."""
    import json
    from pathlib import Path

    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    import adapters.vllm as av
    from adapters.vllm.quant import resolve_quant
    from sidecar.numerics.formats import Format, FormatParams, Nvfp4Names
    from sidecar.plan.build import RefitSpec

    hf = json.loads((Path(__file__).parent / "data" / "qwen3-30b-a3b.config.json").read_text())
    params = FormatParams(nvfp4_names="compressed_tensors")
    spec = RefitSpec(
        model_type="qwen3_moe", fmt="nvfp4", num_hidden_layers=hf["num_hidden_layers"], params=params
    )
    w4a4 = av.vllm_engine_args(spec, hf, nvfp4_w4a4=True)["hf_overrides"]["quantization_config"]
    a16 = av.vllm_engine_args(spec, hf)["hf_overrides"]["quantization_config"]
    acts = w4a4["config_groups"]["group_0"]["input_activations"]
    preset = PRESET_SCHEMES["NVFP4"]["input_activations"]
    parsed = QuantizationArgs.model_validate(acts)
    for field in ("num_bits", "type", "strategy", "group_size", "symmetric", "dynamic"):
        assert getattr(parsed, field) == getattr(preset, field), field
    quant = resolve_quant(w4a4)
    assert (quant.fmt, quant.params.nvfp4_names, quant.static_activations) == (
        Format.NVFP4,
        Nvfp4Names.COMPRESSED_TENSORS,
        True,
    )
    assert a16["config_groups"]["group_0"]["input_activations"] is None
    assert not resolve_quant(a16).static_activations
    fp8 = RefitSpec(model_type="qwen3_moe", fmt="block_fp8", num_hidden_layers=hf["num_hidden_layers"])
    with pytest.raises(ValueError, match="nvfp4_w4a4 is an NVFP4 choice"):
        av.vllm_engine_args(fp8, hf, nvfp4_w4a4=True)
