"""Triton kernels for the 4-bit formats (SPEC §1.5-1.7), byte-exact with sidecar.numerics.fourbit.

One launch quantizes a matrix ``[M, K]`` (any leading dims folded into M; the last dim contiguous):
program ``(row, piece)`` covers ``NB`` blocks of one row. Every step is written so the compiled
kernel and Triton's CPU interpreter compute the same bits, without float8 casts (the interpreter
miscasts at binade edges):

* bfloat16 inputs are loaded as their 16 bits and widened by a shift (the interpreter's bf16 load
  mangles subnormals); float16 and float32 load exactly;
* ``amax`` is an integer max over the magnitude bits (NaN/Inf: ``>= 0x7F800000``, flagged by an
  ``atomic_min`` of the row; the host then lets the reference raise its error);
* divisions are ``tl.math.div_rn``; NVFP4's e4m3 block scale is rounded on its bits (c10's
  ``fp8e4m3fn_from_fp32_value`` for the in-range values it can take) and decoded from them;
* E2M1 codes come from comparisons with the midpoints (ties to the even code, as the reference);
* INT4's round-half-even is ``(v + 1.5 * 2^23) - 1.5 * 2^23`` (exact for ``|v| < 2^22``), its bf16
  scale rounded on the bits.

The host functions check inputs and ``out=`` buffers with the reference's own checks, so errors are
the reference's; they are checked under the interpreter (tests/test_kernels_fourbit.py). The daemon's
CUDA path launches the slab variants of these kernels (``triton_fourbit_slab``: the same jit helpers
and arithmetic, addressing whole slabs and the publish ring's buffers through pointer tables).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sidecar.numerics import fourbit
from sidecar.numerics import reference as ref
from sidecar.numerics.formats import INT4_GROUP, MXFP4_BLOCK, NVFP4_BLOCK

__all__ = ["quantize_int4", "quantize_mxfp4", "quantize_nvfp4"]

_ABS = tl.constexpr(0x7FFFFFFF)
_NON_FINITE = tl.constexpr(0x7F800000)
_NO_BAD_ROW = 2**31 - 1
#: blocks per program
_NB = 16


@triton.jit
def _load_f32(ptrs, mask, IS_BF16: tl.constexpr):
    if IS_BF16:
        bits = tl.load(ptrs.to(tl.pointer_type(tl.int16)), mask=mask, other=0)
        return ((bits.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _e2m1(v):
    """RNE_e2m1 codes (int32): midpoints' counts, ties to the even code, saturating at 6, sign iff v < 0."""
    a = (v.to(tl.int32, bitcast=True) & _ABS).to(tl.float32, bitcast=True)
    c = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
    c += (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32)
    return c | ((v < 0.0).to(tl.int32) << 3)


@triton.jit
def _flag_bad(amax_bits, valid, flag_ptr, row):
    worst = tl.max(tl.where(valid, amax_bits, 0), axis=0)
    if worst >= _NON_FINITE:
        tl.atomic_min(flag_ptr, row)


@triton.jit
def _nvfp4_blocks(x, amax, gs, NB: tl.constexpr):
    """NVFP4 of NB blocks of 16 (x [NB, 16] float32, amax [NB] their amax, gs the global scale):
    (packed E2M1 codes [NB, 8] uint8, e4m3 scale bytes [NB] int32), SPEC 1.5 on the bits."""
    sf = tl.where(amax == 0.0, 1.0, tl.math.div_rn(amax, gs * 6.0))
    sf = tl.minimum(tl.maximum(sf, 0.001953125), 448.0)
    # e4m3 rounding of sf in [2^-9, 448] on its bits (c10's conversion, in-range branch)
    bits = sf.to(tl.int32, bitcast=True)
    denorm = (sf + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
    normal = (bits - (120 << 23) + 0x7FFFF + ((bits >> 20) & 1)) >> 20
    byte = tl.where(bits < (121 << 23), denorm, normal) & 0xFF
    e = (byte >> 3) & 0xF
    m = byte & 7
    sval = tl.where(
        e == 0, m.to(tl.float32) * 0.001953125, (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    )
    denom = sval * gs
    codes = _e2m1(tl.math.div_rn(x, denom[:, None]))
    lo, hi = tl.split(tl.reshape(codes, (NB, 8, 2)))
    packed = (lo | (hi << 4)).to(tl.uint8)
    return packed, byte


@triton.jit
def _nvfp4_kernel(x_ptr, x_rs, q_ptr, s_ptr, gs_ptr, flag_ptr, K, IS_BF16: tl.constexpr, NB: tl.constexpr):
    row = tl.program_id(0)
    blk = tl.program_id(1) * NB + tl.arange(0, NB)
    valid = blk < K // 16
    mask = valid[:, None]
    x = _load_f32(x_ptr + row * x_rs + blk[:, None] * 16 + tl.arange(0, 16)[None, :], mask, IS_BF16)
    amax_bits = tl.max(x.to(tl.int32, bitcast=True) & _ABS, axis=1)
    _flag_bad(amax_bits, valid, flag_ptr, row)
    amax = amax_bits.to(tl.float32, bitcast=True)
    gs = tl.load(gs_ptr)
    packed, byte = _nvfp4_blocks(x, amax, gs, NB)
    tl.store(q_ptr + row * (K // 2) + blk[:, None] * 8 + tl.arange(0, 8)[None, :], packed, mask=mask)
    tl.store(s_ptr + row * (K // 16) + blk, byte.to(tl.uint8), mask=valid)


@triton.jit
def _mxfp4_kernel(x_ptr, x_rs, q_ptr, s_ptr, flag_ptr, K, IS_BF16: tl.constexpr, NB: tl.constexpr):
    row = tl.program_id(0)
    blk = tl.program_id(1) * NB + tl.arange(0, NB)
    valid = blk < K // 32
    mask = valid[:, None]
    x = _load_f32(x_ptr + row * x_rs + blk[:, None] * 32 + tl.arange(0, 32)[None, :], mask, IS_BF16)
    amax_bits = tl.max(x.to(tl.int32, bitcast=True) & _ABS, axis=1)
    _flag_bad(amax_bits, valid, flag_ptr, row)
    bump = ((amax_bits & 0x7FFFFF) >= 0x600000).to(tl.int32)
    byte = tl.minimum(tl.maximum(((amax_bits >> 23) & 0xFF) + bump - 2, 1), 254)
    byte = tl.where(amax_bits == 0, 1, byte)
    exponent = 127 - byte
    mult = tl.where(exponent == -127, 1 << 22, (exponent + 127) << 23).to(tl.float32, bitcast=True)
    codes = _e2m1(x * mult[:, None])
    lo, hi = tl.split(tl.reshape(codes, (NB, 16, 2)))
    packed = (lo | (hi << 4)).to(tl.uint8)
    tl.store(q_ptr + row * (K // 2) + blk[:, None] * 16 + tl.arange(0, 16)[None, :], packed, mask=mask)
    tl.store(s_ptr + row * (K // 32) + blk, byte.to(tl.uint8), mask=valid)


@triton.jit
def _int4_kernel(
    x_ptr,
    x_rs,
    q_ptr,
    s_ptr,
    flag_ptr,
    K,
    IS_BF16: tl.constexpr,
    G: tl.constexpr,
    SCALE_BF16: tl.constexpr,
    NB: tl.constexpr,
):
    row = tl.program_id(0)
    grp = tl.program_id(1) * NB + tl.arange(0, NB)
    valid = grp < K // G
    mask = valid[:, None]
    x = _load_f32(x_ptr + row * x_rs + grp[:, None] * G + tl.arange(0, G)[None, :], mask, IS_BF16)
    amax_bits = tl.max(x.to(tl.int32, bitcast=True) & _ABS, axis=1)
    _flag_bad(amax_bits, valid, flag_ptr, row)
    amax = amax_bits.to(tl.float32, bitcast=True)
    sf = tl.where(amax == 0.0, 1.0, tl.math.div_rn(amax, 7.0))
    if SCALE_BF16:
        u = sf.to(tl.int32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        sf = (u << 16).to(tl.float32, bitcast=True)
        tl.store(s_ptr.to(tl.pointer_type(tl.int16)) + row * (K // G) + grp, u.to(tl.int16), mask=valid)
    else:
        tl.store(s_ptr + row * (K // G) + grp, sf, mask=valid)
    v = tl.math.div_rn(x, sf[:, None])
    r = (v + 12582912.0) - 12582912.0  # round half to even for |v| < 2^22 (Inf stays Inf)
    r = tl.where(r > 7.0, 7.0, tl.where(r < -7.0, -7.0, r))
    r = tl.where(x == 0.0, 0.0, r)  # 0 / 0 where the scale underflowed: the zero's code
    nib = (r.to(tl.int32) + 8).to(tl.int64)
    words = tl.reshape(nib, (NB, G // 8, 8))
    shifts = (tl.arange(0, 8) * 4).to(tl.int64)
    packed = tl.sum(words << shifts[None, None, :], axis=2)
    packed = tl.where(packed >= 2**31, packed - 2**32, packed).to(tl.int32)
    tl.store(
        q_ptr + row * (K // 8) + grp[:, None] * (G // 8) + tl.arange(0, G // 8)[None, :], packed, mask=mask
    )


# --------------------------------------------------------------------------------------------------
# host side


def _rows(w: torch.Tensor) -> torch.Tensor:
    """``w`` as ``[M, K]`` with a contiguous last dim (a view where strides allow, else a copy)."""
    k = w.shape[-1]
    try:
        v = w.view(-1, k)
    except RuntimeError:
        v = w.reshape(-1, k)
    return v if v.stride(-1) == 1 or k == 1 else v.contiguous()


def _flag(device: torch.device) -> torch.Tensor:
    return torch.full((1,), _NO_BAD_ROW, dtype=torch.int32, device=device)


def _launch_rows(x2: torch.Tensor, blocks: int) -> tuple[int, int]:
    return (max(1, x2.shape[0]), max(1, -(-blocks // _NB)))


def _finish(outs, results, flag, raise_ref) -> tuple[torch.Tensor, ...]:
    if int(flag.item()) != _NO_BAD_ROW:
        raise_ref()
        raise RuntimeError("the 4-bit Triton kernel saw NaN or Inf that the torch reference did not")
    for o, r in zip(outs, results):
        if o is not r:
            o.copy_(r)
    return tuple(outs)


def quantize_nvfp4(
    w: torch.Tensor, *, global_scale: torch.Tensor | None = None, out=None, name: str | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`sidecar.numerics.fourbit.quantize_nvfp4` in one Triton launch."""
    q, s, g = fourbit.nvfp4_outputs(w, out, name)
    shape = tuple(w.shape)
    gs = (
        fourbit.nvfp4_global_scale(w, name=name)
        if global_scale is None
        else ref.check_shared_scale(global_scale, name, "global_scale").to(w.device)
    )
    x2 = _rows(w)
    k = shape[-1]
    q2 = q if q.is_contiguous() else torch.empty_like(q)
    s2 = s if s.is_contiguous() else torch.empty_like(s)
    flag = _flag(w.device)
    gs1 = gs.reshape(1).contiguous()
    if x2.numel():
        grid = _launch_rows(x2, k // NVFP4_BLOCK)
        _nvfp4_kernel[grid](
            x2,
            x2.stride(0),
            q2,
            s2.view(torch.uint8),
            gs1,
            flag,
            k,
            IS_BF16=w.dtype == torch.bfloat16,
            NB=_NB,
        )
    g.copy_(gs)
    done = _finish((q, s), (q2, s2), flag, lambda: fourbit.quantize_nvfp4(w, global_scale=gs, name=name))
    return (*done, g)


def quantize_mxfp4(
    w: torch.Tensor, *, out=None, name: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sidecar.numerics.fourbit.quantize_mxfp4` in one Triton launch."""
    q, s = fourbit.mxfp4_outputs(w, out, name)
    shape = tuple(w.shape)
    x2 = _rows(w)
    k = shape[-1]
    q2 = q if q.is_contiguous() else torch.empty_like(q)
    s2 = s if s.is_contiguous() else torch.empty_like(s)
    flag = _flag(w.device)
    if x2.numel():
        grid = _launch_rows(x2, k // MXFP4_BLOCK)
        _mxfp4_kernel[grid](x2, x2.stride(0), q2, s2, flag, k, IS_BF16=w.dtype == torch.bfloat16, NB=_NB)
    return _finish((q, s), (q2, s2), flag, lambda: fourbit.quantize_mxfp4(w, name=name))


def quantize_int4(
    w: torch.Tensor,
    *,
    group: int = INT4_GROUP,
    scale_dtype: torch.dtype = torch.bfloat16,
    out=None,
    name: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`sidecar.numerics.fourbit.quantize_int4` in one Triton launch (power-of-two groups)."""
    packed, s, shape = fourbit.int4_outputs(w, out, group, scale_dtype, name)
    if group & (group - 1):
        raise ValueError(f"{ref._label(name)}: the Triton int4 kernel takes power-of-two groups, not {group}")
    k = w.shape[-1]
    x2 = _rows(w)
    p2 = packed if packed.is_contiguous() else torch.empty_like(packed)
    s2 = s if s.is_contiguous() else torch.empty_like(s)
    flag = _flag(w.device)
    if x2.numel():
        grid = _launch_rows(x2, k // group)
        _int4_kernel[grid](
            x2,
            x2.stride(0),
            p2,
            s2,
            flag,
            k,
            IS_BF16=w.dtype == torch.bfloat16,
            G=group,
            SCALE_BF16=scale_dtype == torch.bfloat16,
            NB=_NB,
        )
    shape.copy_(torch.tensor(tuple(w.shape[-2:]), dtype=torch.int64))
    kw = {"group": group, "scale_dtype": scale_dtype, "name": name}
    done = _finish((packed, s), (p2, s2), flag, lambda: fourbit.quantize_int4(w, **kw))
    return (*done, shape)
