"""vLLM's own NVFP4 dequantization (``nvfp4_emulation_utils.dequantize_to_dtype``, the pure-torch path
its emulation backend and weight checks use) decodes what refitd publishes to SPEC §1.5's values.

Runs under ``make test-engines`` (the vLLM wheel in .venv-engines, on CPU); skipped elsewhere, and a
failure there when vLLM cannot be imported (REFITD_REQUIRE_ENGINES=1)."""

from __future__ import annotations

import os

import pytest
import torch
from support.engines import missing

from sidecar.numerics import cpu, fourbit

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def dequantize_to_dtype():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import dequantize_to_dtype
    except ImportError as exc:
        missing("vLLM's nvfp4_emulation_utils does not import", "needs vLLM: run `make test-engines`", exc)
    return dequantize_to_dtype


def _weights(seed: int, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    x *= torch.exp2(
        torch.randint(-10, 10, (*shape[:-1], shape[-1] // 16), generator=g).float()
    ).repeat_interleave(16, -1)
    return x.bfloat16()


@pytest.mark.parametrize("seed", range(3))
def test_vllm_decodes_a_published_nvfp4_weight(dequantize_to_dtype, seed):
    w = _weights(seed, (64, 256))
    q, s, gs = cpu.quantize_nvfp4(w)
    spec = fourbit.dequantize_nvfp4(q, s, gs)
    out = dequantize_to_dtype(q, s, gs, torch.float32, swizzle=False)
    assert torch.equal(out, spec)
    assert torch.equal(dequantize_to_dtype(q, s, gs, torch.bfloat16, swizzle=False), spec.bfloat16())


def test_vllm_decodes_an_expert_slab_with_per_expert_global_scales(dequantize_to_dtype):
    """The fused [E, 2I, H/2] layout an engine holds, gate and up sharing each expert's gs."""
    w = _weights(7, (4, 64, 128))
    qs, ss, gss, want = [], [], [], []
    for e in range(w.shape[0]):
        gs = cpu.nvfp4_global_scale(w[e, :32], w[e, 32:])
        q, s, _ = cpu.quantize_nvfp4(w[e], global_scale=gs)
        qs.append(q)
        ss.append(s)
        gss.append(gs)
        want.append(fourbit.dequantize_nvfp4(q, s, gs))
    out = dequantize_to_dtype(
        torch.stack(qs), torch.stack(ss), torch.stack(gss), torch.float32, swizzle=False
    )
    assert torch.equal(out, torch.stack(want))


# --------------------------------------------------------------------------------------------------
# the engine's quantization config: parsed by vLLM's own config classes into the intended schemes


def test_vllm_parses_the_four_bit_quantization_configs(dequantize_to_dtype):
    import torch as _torch
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )
    from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config

    from adapters.vllm.fourbit import four_bit_quantization
    from sidecar.numerics.formats import Format

    ignored = ["lm_head", "model.language_model.layers.0.mlp.experts"]
    name, qc = four_bit_quantization(Format.NVFP4, ignored)
    nv = ModelOptNvFp4Config.from_config(qc)
    assert name == nv.get_name() == "modelopt_fp4"
    assert nv.is_checkpoint_nvfp4_serialized and nv.group_size == 16 and list(nv.exclude_modules) == ignored
    for fmt, want in ((Format.INT4_W4A16, ("int", None)), (Format.MXFP4, ("float", _torch.uint8))):
        name, qc = four_bit_quantization(fmt, ignored)
        ct = CompressedTensorsConfig.from_config(qc)
        assert name == ct.get_name() == "compressed-tensors" and list(ct.ignore) == ignored
        args = ct.target_scheme_map["Linear"]["weights"]
        assert (args.num_bits, args.type, args.group_size, args.strategy, args.symmetric) == (
            4,
            want[0],
            32,
            "group",
            True,
        )
        assert args.scale_dtype == want[1]
        assert ct.target_scheme_map["Linear"]["input_activations"] is None  # weight-only
