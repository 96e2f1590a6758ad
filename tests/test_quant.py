"""Every quantizer implementation against the edge-case table, the scalar oracle and docs/spec.md's bounds."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support import oracle

from sidecar.numerics import reference as quant
from sidecar.numerics.cases import CASES, Case
from sidecar.numerics.formats import FP8_DTYPE, Format


def _with_out(fn, scale_shape, scale_dtype):
    def run(w, **kw):
        try:
            shape = scale_shape(w)
        except ValueError:  # a shape the format refuses: let the implementation say so
            return fn(w, **kw)
        if w.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return fn(w, **kw)
        q = torch.full(w.shape, 0x7F, dtype=torch.uint8).view(
            FP8_DTYPE
        )  # NaN fill: every byte must be written
        if scale_dtype == torch.uint8:
            s = torch.full(shape, 255, dtype=torch.uint8)
        else:
            s = torch.full(shape, float("nan"), dtype=scale_dtype)
        rq, rs = fn(w, out=(q, s), **kw)
        assert rq is q and rs is s
        return q, s

    return run


def _scale_shape(fmt):
    return lambda w: Format(fmt).scale_shape(tuple(w.shape))


#: implementation name -> {format: callable(w) -> (q, scale)}; a GPU kernel registers here too
IMPLEMENTATIONS = {
    "torch": {
        Format.BLOCK_FP8: quant.quantize_block_fp8,
        Format.MXFP8: quant.quantize_mxfp8,
        Format.FP8_PER_TENSOR: quant.quantize_fp8_per_tensor,
    },
    "torch-tiny-chunks": {  # every chunk boundary path: one tile row / a few rows per chunk
        Format.BLOCK_FP8: lambda w, **kw: quant.quantize_block_fp8(w, chunk_elems=1, **kw),
        Format.MXFP8: lambda w, **kw: quant.quantize_mxfp8(w, chunk_elems=64, **kw),
        Format.FP8_PER_TENSOR: lambda w, **kw: quant.quantize_fp8_per_tensor(w, chunk_elems=7, **kw),
    },
    "torch-out": {
        Format.BLOCK_FP8: _with_out(quant.quantize_block_fp8, _scale_shape("block_fp8"), torch.float32),
        Format.MXFP8: _with_out(quant.quantize_mxfp8, _scale_shape("mxfp8"), torch.uint8),
        Format.FP8_PER_TENSOR: _with_out(
            quant.quantize_fp8_per_tensor, _scale_shape("fp8_per_tensor"), torch.float32
        ),
    },
}

ORACLES = {
    Format.BLOCK_FP8: oracle.block_fp8,
    Format.MXFP8: oracle.mxfp8,
    Format.FP8_PER_TENSOR: lambda w: (lambda qs, s: (qs[0], np.array(s, dtype=np.float32)))(
        *oracle.fp8_per_tensor(w)
    ),
}


_ORACLE_CACHE: dict[str, tuple[np.ndarray, np.ndarray]] = {}


def _oracle(case: Case) -> tuple[np.ndarray, np.ndarray]:
    if case.id not in _ORACLE_CACHE:
        _ORACLE_CACHE[case.id] = ORACLES[case.fmt](case.make())
    return _ORACLE_CACHE[case.id]


def _bits(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype == FP8_DTYPE:
        return t.view(torch.uint8).numpy()
    if t.dtype == torch.float32:
        return t.contiguous().numpy().view(np.uint32)
    return t.numpy()


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_edge_case_table(case: Case, impl: str):
    """Each case is quantized by each implementation and compared with the oracle byte for byte."""
    fn = IMPLEMENTATIONS[impl][case.fmt]
    w = case.make()
    if case.error:
        with pytest.raises(ValueError, match=case.error) as err:
            fn(w, name="model.layers.0.mlp.experts.0.up_proj.weight")
        assert "model.layers.0.mlp.experts.0.up_proj.weight" in str(err.value)
        return
    q, s = fn(w)
    assert q.dtype == FP8_DTYPE and tuple(q.shape) == tuple(w.shape)
    assert s.dtype == case.fmt.scale_dtype and tuple(s.shape) == case.fmt.scale_shape(tuple(w.shape))
    oq, os_ = _oracle(case)
    np.testing.assert_array_equal(_bits(q), oq)
    expected_scale = os_.view(np.uint32) if os_.dtype == np.float32 else os_
    np.testing.assert_array_equal(_bits(s).reshape(-1), np.asarray(expected_scale).reshape(-1))
    for index, byte in case.q_bytes.items():
        assert int(q.view(torch.uint8)[index]) == byte, f"q{index}"
    if case.scales is not None:
        flat = s.reshape(-1).tolist()
        assert flat == list(case.scales)


def _all_finite_magnitudes() -> torch.Tensor:
    """Every positive finite bfloat16 and float16 value, and float32 extremes, as float32 amaxes."""
    bf16 = (torch.arange(1, 0x7F80, dtype=torch.int32) << 16).view(torch.float32)
    f16 = torch.arange(1, 0x7C00, dtype=torch.int16).view(torch.float16).float()
    f32 = torch.tensor([2.0**-149, 2.0**-126, 1e-30, 1.0, 448.0, 449.0, 3.0e38, 3.4028234663852886e38])
    return torch.cat([bf16, f16, f32])


def test_scaling_by_a_computed_scale_needs_no_clamp():
    """The quantizers skip SPEC's clamp when they computed the scale: it must never change a byte.

    For every amax an input can have, the largest scaled magnitude (amax itself times the multiplier)
    casts to the same byte with and without the clamp, for block-FP8 / per-tensor and for MXFP8.
    """
    amax = _all_finite_magnitudes()
    block = amax * torch.reciprocal(quant._scale_from_amax(amax))
    mx = amax * quant._pow2_from_exponent(quant.E8M0_BIAS - quant._e8m0_bytes(amax))
    for scaled in (block, mx, -block, -mx):
        unclamped = scaled.to(FP8_DTYPE).view(torch.uint8)
        clamped = scaled.clamp(-448.0, 448.0).to(FP8_DTYPE).view(torch.uint8)
        assert torch.equal(unclamped, clamped)
        assert bool((scaled.abs() < 464.0).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("-inf"), float("inf"), -float("nan"), float("nan")])
@pytest.mark.parametrize("fmt", [Format.BLOCK_FP8, Format.MXFP8, Format.FP8_PER_TENSOR])
def test_amax_from_magnitude_bits_sees_every_non_finite(fmt, bad, dtype):
    """The 2-byte inputs' amax is taken on sign-cleared bits: -NaN and -Inf must still be refused."""
    w = torch.zeros(3, 256, dtype=dtype)
    w[2, 200] = bad
    with pytest.raises(quant.NonFiniteError, match="NaN or Inf"):
        quant.quantize(w, fmt, name="w")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", [Format.BLOCK_FP8, Format.MXFP8, Format.FP8_PER_TENSOR])
def test_negative_zeros_and_largest_magnitudes_from_magnitude_bits(fmt, dtype):
    """-0.0 has magnitude bits 0 (scale of an all-zero block), and the largest finite value is kept."""
    zeros = torch.full((2, 128), -0.0, dtype=dtype)
    q, s = quant.quantize(zeros, fmt)
    assert bool((q.view(torch.uint8) == 0x80).all())
    expected = 1 if fmt is Format.MXFP8 else 1.0
    assert s.reshape(-1).tolist() == [expected] * s.numel()
    big = torch.full((2, 128), torch.finfo(dtype).max, dtype=dtype)
    big[1, 5] = -torch.finfo(dtype).max
    oq, os_ = ORACLES[fmt](big)
    q, s = quant.quantize(big, fmt)
    np.testing.assert_array_equal(_bits(q), oq)
    np.testing.assert_array_equal(_bits(s).reshape(-1), np.asarray(os_).view(_bits(s).dtype).reshape(-1))


def test_shared_scale_saturates_and_is_used():
    """A shared per-tensor scale smaller than amax/448 saturates values at +-448 instead of NaN."""
    w = torch.tensor([1000.0, -1000.0, 1.0])
    q, s = quant.quantize_fp8_per_tensor(w, scale=torch.tensor(1.0))
    assert q.view(torch.uint8).tolist() == [0x7E, 0xFE, 0x38]
    assert float(s) == 1.0


def test_gate_up_share_one_scale():
    """fp8_per_tensor_scale over a group equals the oracle's shared scale; each member uses it."""
    g = torch.Generator().manual_seed(3)
    gate, up = torch.randn(40, 64, generator=g).bfloat16(), (3 * torch.randn(40, 64, generator=g)).bfloat16()
    scale = quant.fp8_per_tensor_scale(gate, up)
    (og, ou), oscale = oracle.fp8_per_tensor(gate, up)
    assert np.float32(float(scale)) == oscale
    np.testing.assert_array_equal(_bits(quant.quantize_fp8_per_tensor(gate, scale=scale)[0]), og)
    np.testing.assert_array_equal(_bits(quant.quantize_fp8_per_tensor(up, scale=scale)[0]), ou)


def test_shared_scale_still_refuses_nan():
    w = torch.zeros(4, 4)
    w[1, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        quant.quantize_fp8_per_tensor(w, scale=torch.tensor(1.0), name="x")


def test_out_buffer_mismatch_is_refused():
    w = torch.randn(128, 128)
    with pytest.raises(ValueError, match="out scales buffer"):
        quant.quantize_block_fp8(w, out=(torch.empty(128, 128, dtype=FP8_DTYPE), torch.empty(2, 2)))


def test_quantize_dispatch_and_bf16_refused():
    w = torch.randn(64, 64)
    for fmt in ("block_fp8", "mxfp8", "fp8_per_tensor"):
        q, _ = quant.quantize(w, fmt)
        assert q.dtype == FP8_DTYPE
    with pytest.raises(ValueError, match="not a quantized format"):
        quant.quantize(w, "bf16")


def test_empty_tensors():
    _, s = quant.quantize_block_fp8(torch.empty(0, 300))
    assert tuple(s.shape) == (0, 3)
    _, s = quant.quantize_mxfp8(torch.empty(3, 0))
    assert tuple(s.shape) == (3, 0)


# --------------------------------------------------------------------------------------------------
# property tests: dequantization error within half an e4m3 step at the block's amax


def _half_step_bound(amax_scaled: torch.Tensor, mult: torch.Tensor) -> torch.Tensor:
    """Half the e4m3 step of the binade holding the scaled amax, in unscaled units."""
    exp = torch.floor(torch.log2(amax_scaled.clamp_min(2.0**-6)))
    return 0.5 * torch.exp2(exp - 3) * mult


#: x * (1/scale) is two float32 roundings away from x / scale: a tie may land a few ulps past half a step
_RECIP_SLACK = 2.0**-21

shapes = st.tuples(st.integers(1, 3), st.integers(1, 300), st.integers(1, 300))
magnitudes = st.sampled_from([1e-30, 1e-6, 0.02, 1.0, 300.0, 1e20])


@settings(max_examples=25, deadline=None)
@given(
    shape=shapes,
    mag=magnitudes,
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
)
def test_block_fp8_error_bound(shape, mag, seed, dtype):
    if dtype == torch.float16 and not 1e-4 < mag < 6e4:
        mag = 1.0
    w = (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * mag).to(dtype)
    q, s = quant.quantize_block_fp8(w)
    err = (quant.dequantize(q, s, "block_fp8").double() - w.double()).abs()  # exact in float64
    *_, n, k = w.shape
    bound = s.repeat_interleave(128, -2)[..., :n, :].repeat_interleave(128, -1)[..., :k] * 16
    assert bool((err <= bound + _RECIP_SLACK * w.double().abs()).all())


@settings(max_examples=25, deadline=None)
@given(shape=shapes, mag=magnitudes, seed=st.integers(0, 2**31 - 1))
def test_mxfp8_error_bound(shape, mag, seed):
    shape = (*shape[:-1], 32 * max(1, shape[-1] // 32))
    w = (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * mag).to(torch.bfloat16)
    q, s = quant.quantize_mxfp8(w)
    x = w.float().unflatten(-1, (-1, 32))
    mult = torch.exp2(s.float() - 127)
    amax = x.abs().amax(-1)
    bound = _half_step_bound(amax / mult, mult)
    err = (quant.dequantize(q, s, "mxfp8").double().unflatten(-1, (-1, 32)) - x.double()).abs()
    assert bool((err <= bound[..., None]).all())
    assert bool((s >= 1).all())


@settings(max_examples=25, deadline=None)
@given(shape=shapes, mag=magnitudes, seed=st.integers(0, 2**31 - 1))
def test_per_tensor_error_bound(shape, mag, seed):
    w = (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * mag).to(torch.bfloat16)
    q, s = quant.quantize_fp8_per_tensor(w)
    err = (quant.dequantize(q, s, "fp8_per_tensor").double() - w.double()).abs()
    assert bool((err <= 16 * s.double() + _RECIP_SLACK * w.double().abs()).all())
