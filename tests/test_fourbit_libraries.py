"""What refitd publishes in the 4-bit formats, decoded and re-derived by the libraries the engines load.

The real libraries are the oracles here, on CPU (both in the ``test`` extra):

* compressed-tensors (vLLM's and SGLang's loader for ``pack-quantized`` INT4 and MXFP4 checkpoints, and
  NVFP4 under its own names): its ``decompress`` of refitd's tensors gives SPEC's values, its packing
  helpers lay out the same bytes, its MX scale rule gives the same E8M0 bytes;
* ModelOpt's ``NVFP4QTensor`` (the arithmetic SPEC §1.5 names): quantizing the same input gives the same
  packed codes, block scales and global scale, and its dequantization gives SPEC's values.

Where a library's own arithmetic rounds differently from SPEC (compressed-tensors' NVFP4 dequantization
divides by ``1 / gs`` in bfloat16), the test says so and pins what is exact (the codes and scales).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sidecar.numerics import cpu, fourbit
from sidecar.numerics.formats import FP8_DTYPE


@pytest.fixture(scope="module")
def ct() -> SimpleNamespace:
    """compressed-tensors, imported when a test runs, not when pytest collects this file: it imports
    Triton, which tests/test_kernels*.py must import first, in interpreter mode."""
    from compressed_tensors.compressors import (
        MXFP4PackedCompressor,
        NVFP4PackedCompressor,
        PackedQuantizationCompressor,
    )
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4
    from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales

    def scheme(**args) -> QuantizationScheme:
        return QuantizationScheme(
            targets=["Linear"], weights=QuantizationArgs(num_bits=4, symmetric=True, **args)
        )

    return SimpleNamespace(
        MXFP4PackedCompressor=MXFP4PackedCompressor,
        NVFP4PackedCompressor=NVFP4PackedCompressor,
        PackedQuantizationCompressor=PackedQuantizationCompressor,
        pack_fp4_to_uint8=pack_fp4_to_uint8,
        unpack_fp4_from_uint8=unpack_fp4_from_uint8,
        pack_to_int32=pack_to_int32,
        unpack_from_int32=unpack_from_int32,
        cast_to_fp4=cast_to_fp4,
        generate_mx_scales=generate_mx_scales,
        int4=scheme(type="int", strategy="group", group_size=32),
        int4_g64=scheme(type="int", strategy="group", group_size=64),
        mxfp4=scheme(type="float", strategy="group", group_size=32, scale_dtype=torch.uint8),
        nvfp4=scheme(type="float", strategy="tensor_group", group_size=16),
    )


def _weights(seed: int, shape=(64, 256), dtype=torch.bfloat16) -> torch.Tensor:
    """Normal values with blocks of very unlike size (so block scales spread over many binades)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    binades = torch.randint(-12, 12, (*shape[:-1], shape[-1] // 16), generator=g).float()
    x *= torch.exp2(binades).repeat_interleave(16, -1)
    x.view(-1)[::29] = 0.0
    return x.to(dtype)


QUANTIZE = {"reference": fourbit, "cpu": cpu}


# --------------------------------------------------------------------------------------------------
# INT4 weight-only: compressed-tensors' pack-quantized


@pytest.mark.parametrize("path", list(QUANTIZE))
@pytest.mark.parametrize("seed", range(3))
def test_int4_decompressed_by_compressed_tensors(seed, path, ct):
    w = _weights(seed)
    packed, scale, shape = QUANTIZE[path].quantize_int4(w)
    spec = fourbit.dequantize_int4(packed, scale)  # q * s, exact in float32
    state = {"weight_packed": packed, "weight_scale": scale, "weight_shape": shape}
    out = ct.PackedQuantizationCompressor.decompress(state, ct.int4)["weight"]
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == tuple(w.shape)
    assert torch.equal(out, spec.bfloat16())  # the library's bf16 result is SPEC's value, rounded once
    state["weight_scale"] = scale.float()
    out = ct.PackedQuantizationCompressor.decompress(state, ct.int4)["weight"]
    assert out.dtype == torch.float32 and torch.equal(out, spec)  # and in float32, SPEC's value exactly
    # the layout: the library's packing of SPEC's codes is refitd's words, and its unpacking inverts it
    q = fourbit.unpack_int4(packed)
    assert torch.equal(ct.pack_to_int32(q, 4), packed)
    assert torch.equal(ct.unpack_from_int32(packed, 4, torch.Size(w.shape)), q)


def test_int4_float32_scales_decompressed_by_compressed_tensors(ct):
    w = _weights(7, (32, 128))
    packed, scale, shape = cpu.quantize_int4(w, scale_dtype=torch.float32, group=64)
    state = {"weight_packed": packed, "weight_scale": scale, "weight_shape": shape}
    out = ct.PackedQuantizationCompressor.decompress(state, ct.int4_g64)["weight"]
    assert torch.equal(out, fourbit.dequantize_int4(packed, scale))


# --------------------------------------------------------------------------------------------------
# MXFP4: compressed-tensors' mxfp4-pack-quantized


@pytest.mark.parametrize("path", list(QUANTIZE))
@pytest.mark.parametrize("seed", range(3))
def test_mxfp4_decompressed_by_compressed_tensors(seed, path, ct):
    w = _weights(seed)
    q, scale = QUANTIZE[path].quantize_mxfp4(w)
    spec = fourbit.dequantize_mxfp4(q, scale)
    out = ct.MXFP4PackedCompressor.decompress({"weight_packed": q, "weight_scale": scale}, ct.mxfp4)["weight"]
    assert out.dtype == torch.bfloat16
    assert torch.equal(out.float(), spec)  # e2m1 * 2^k is exact in bfloat16: SPEC's value exactly


@pytest.mark.parametrize("seed", range(3))
def test_mxfp4_scale_bytes_are_compressed_tensors_rule(seed, ct):
    """SPEC §1.6 is compressed-tensors' rule (round the amax to a power of two, bumping at significand
    1.75, minus 2) except that byte 0 is never emitted; every block amax of a bf16 tensor, and the
    edges, give the library's bytes."""
    w = _weights(seed, (16, 1024))
    _, scale = fourbit.quantize_mxfp4(w)
    amax = w.float().unflatten(-1, (-1, 32)).abs().amax(-1)
    theirs = ct.generate_mx_scales(amax.bfloat16(), num_bits=4)
    keep = amax > 0
    assert torch.equal(scale[keep].long(), theirs[keep].long())
    every = (torch.arange(0x0080, 0x7F80, dtype=torch.int32) << 16).view(torch.float32)  # every normal bf16
    ours = fourbit._mxfp4_bytes(every)
    theirs = ct.generate_mx_scales(every.bfloat16(), num_bits=4).float()
    inside = (theirs >= 1) & (theirs <= 254)
    assert torch.equal(ours[inside].float(), theirs[inside])
    # below byte 1 the library's exponent goes on down (-1): SPEC clamps to byte 1; at the top its
    # power-of-two rounding overflows to Inf (significand >= 1.75 in the last binade): SPEC's is 253
    assert bool((ours[theirs < 1] == 1).all()) and bool((ours[theirs.isinf()] == 253).all())
    assert int(inside.sum()) + int((theirs < 1).sum()) + int(theirs.isinf().sum()) == every.numel()


def test_e2m1_rounding_is_compressed_tensors_cast(ct):
    """RNE_e2m1 (ties to the even code, saturating at 6) against the library's own cast, on every
    float32 between the codes' midpoints and ties included, packed by the library into refitd's bytes."""
    grid = torch.cat(
        [torch.arange(0, 8.0, 1 / 64), torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 100.0])]
    )
    grid = torch.cat([grid, -grid[1:]])
    grid = torch.cat([grid, torch.nextafter(grid, torch.full_like(grid, 99.0))])
    grid = grid[: grid.numel() // 2 * 2].reshape(1, -1)
    codes = fourbit.e2m1_codes(grid)
    values = fourbit._e2m1_decode(codes)
    assert torch.equal(values, ct.cast_to_fp4(grid.clone()))
    # the library's cast-then-pack (its CPU quantizer) gives refitd's bytes, a tiny negative included
    # (code 8: v < 0); the grid holds no -0.0, which SPEC makes code 0
    assert torch.equal(fourbit.pack_e2m1(codes), ct.pack_fp4_to_uint8(ct.cast_to_fp4(grid.clone())))


# --------------------------------------------------------------------------------------------------
# NVFP4: ModelOpt's NVFP4QTensor, and compressed-tensors under its own names


def _modelopt():
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    return NVFP4QTensor


@pytest.mark.parametrize("path", list(QUANTIZE))
@pytest.mark.parametrize("seed", range(4))
def test_nvfp4_is_modelopt_nvfp4qtensor(seed, path):
    NVFP4QTensor = _modelopt()
    w = _weights(seed, (32, 512))
    q, s, gs = QUANTIZE[path].quantize_nvfp4(w)
    qt, wsf, wsf2 = NVFP4QTensor.quantize(w, 16)
    assert torch.equal(qt._quantized_data, q)
    assert wsf.dtype == FP8_DTYPE and torch.equal(wsf.view(torch.uint8), s.view(torch.uint8))
    assert wsf2.dtype == torch.float32 and torch.equal(wsf2.reshape(()), gs)
    deq = qt.dequantize(dtype=torch.float32, scale=s, double_scale=gs, block_sizes={-1: 16})
    assert torch.equal(deq, fourbit.dequantize_nvfp4(q, s, gs))


def test_nvfp4_gate_and_up_global_scale_is_modelopts_shared_amax():
    """gate_proj and up_proj share gs (SPEC §2.3): ModelOpt given the same shared global scale agrees."""
    NVFP4QTensor = _modelopt()
    gate, up = _weights(11, (16, 256)), _weights(12, (16, 256)) * 3
    gs = cpu.nvfp4_global_scale(gate, up)
    assert torch.equal(gs, NVFP4QTensor.get_weights_scaling_factor_2(torch.cat([gate, up])).reshape(()))
    for w in (gate, up):
        q, s, _ = cpu.quantize_nvfp4(w, global_scale=gs)
        qt, wsf, _ = NVFP4QTensor.quantize(w, 16, weights_scaling_factor_2=gs)
        assert torch.equal(qt._quantized_data, q) and torch.equal(wsf.view(torch.uint8), s.view(torch.uint8))


@pytest.mark.parametrize("seed", range(3))
def test_nvfp4_under_compressed_tensors_names(seed, ct):
    """An engine that loads compressed-tensors' NVFP4 names gets the same bytes with
    ``weight_global_scale = float32(1 / gs)``. The codes decode to the E2M1 values exactly and the block
    scales are the e4m3 bytes; the library then multiplies by ``s / (1 / gs)`` in bfloat16, which is not
    SPEC's ``s * gs``: its values are SPEC's within that rounding (a bfloat16 ulp), not bit for bit."""
    w = _weights(seed)
    q, s, gs = cpu.quantize_nvfp4(w)
    m, n = w.shape
    codes = fourbit.unpack_e2m1(q)
    assert torch.equal(ct.unpack_fp4_from_uint8(q, m, n, dtype=torch.float32), fourbit._e2m1_decode(codes))
    state = {"weight_packed": q, "weight_scale": s, "weight_global_scale": (1.0 / gs).reshape(1)}
    out = ct.NVFP4PackedCompressor.decompress(state, ct.nvfp4)["weight"].float()
    spec = fourbit.dequantize_nvfp4(q, s, gs)
    assert bool((out == 0).eq(spec == 0).all())
    assert bool(((out - spec).abs() <= spec.abs() * 2.0**-7).all())
