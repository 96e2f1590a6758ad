"""4-bit quantizers: the pure-torch reference of docs/spec.md §1.5-1.7, exact to the byte.

NVFP4 (E2M1 values, float8_e4m3fn scales per 16, one float32 global scale), MXFP4 (E2M1 values,
E8M0 scales per 32) and INT4 weight-only (symmetric groups, compressed-tensors' ``pack-quantized``).
Like :mod:`sidecar.numerics.reference` (the FP8 formats), this is the oracle the native C and
Triton kernels are checked against and the quantizer wherever they do not run; CPU and CUDA alike.

All three are row formats: every output keeps the input's leading dims and only the last one
changes, so the input is processed in chunks of whole rows (about ``chunk_elems`` float32 elements of
scratch at a time), whatever its strides. Divisions that docs/spec.md says are correctly rounded divide by
tensors on the input's device (on CUDA, ``t / 448.0`` is not).

E2M1 rounding is done by comparisons against the midpoints between the eight magnitudes, with the
tie direction of each midpoint chosen so that ties go to the even code (ModelOpt's ``_cast_fp4`` does
the same with a search and a fix-up). A comparison with NaN is false, so the only NaN these formulas
can meet (``0 / 0`` where a scale underflowed to zero, possible only for subnormal inputs) gives code
0, the value the zero element had; SPEC does not otherwise say.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch

from sidecar.numerics.checks import (
    DEFAULT_CHUNK_ELEMS,
    _check_input,
    _check_out_buffers,
    _flatten_lead,
    _label,
    _pow2_from_exponent,
    _raise_non_finite,
    _unravel,
    check_shared_scale,
)
from sidecar.numerics.formats import (
    E2M1_MAX,
    E8M0_MAX_BYTE,
    E8M0_MIN_BYTE,
    FP8_DTYPE,
    FP8_MAX,
    INT4_GROUP,
    INT4_MAX,
    INT4_PACK,
    MXFP4_BLOCK,
    NVFP4_BLOCK,
    NVFP4_GLOBAL_DIVISOR,
    NVFP4_SCALE_MIN,
    Format,
)

__all__ = [
    "E2M1_VALUES",
    "INT4_SCALE_DTYPES",
    "dequantize_int4",
    "dequantize_mxfp4",
    "dequantize_nvfp4",
    "e2m1_codes",
    "nvfp4_global_scale",
    "pack_e2m1",
    "pack_int4",
    "quantize_int4",
    "quantize_mxfp4",
    "quantize_nvfp4",
    "unpack_e2m1",
    "unpack_int4",
]

#: the E2M1 magnitudes of codes 0-7 (bit 3 is the sign)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: (midpoint, True if a tie there rounds up): a tie goes to the even code
_E2M1_MIDPOINTS = (
    (0.25, False),
    (0.75, True),
    (1.25, False),
    (1.75, True),
    (2.5, False),
    (3.5, True),
    (5.0, False),
)
#: the scale dtypes an int4_w4a16 engine may hold (SPEC §1.7)
INT4_SCALE_DTYPES = (torch.bfloat16, torch.float32)

_F32_MANTISSA_BITS = 23
_MXFP4_BUMP_MANTISSA = 3 << 21  # significand 1.75: mantissa bits 0x600000


# --------------------------------------------------------------------------------------------------
# E2M1 codes and packing


def e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """SPEC's ``RNE_e2m1`` of float32 ``v`` as uint8 codes 0-15: nearest magnitude, ties to the even
    code, saturating at 6; bit 3 set iff ``v < 0`` (so -0.0 is code 0). NaN gives code 0."""
    a = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for mid, up in _E2M1_MIDPOINTS:
        code += (a >= mid) if up else (a > mid)
    code |= (v < 0).to(torch.uint8) << 3
    return code


def pack_e2m1(codes: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Two codes per byte along the last dim: element ``2i`` in the low nibble, ``2i+1`` in the high."""
    pairs = codes.unflatten(-1, (-1, 2))
    packed = pairs[..., 0] | (pairs[..., 1] << 4)
    if out is None:
        return packed
    out.copy_(packed)
    return out


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """The codes of :func:`pack_e2m1`'s bytes, ``[..., 2 * K]`` uint8."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def _e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(
        E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=codes.device
    )
    return table[codes.long()]


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' ``pack-quantized``: the nibble ``q + 8`` of element ``8j + i`` at bits
    ``4i..4i+3`` of int32 word ``j`` (the word's bits read as two's complement)."""
    nibbles = (q.to(torch.int64) + 8).unflatten(-1, (-1, INT4_PACK))
    shifts = torch.arange(0, 4 * INT4_PACK, 4, dtype=torch.int64, device=q.device)
    words = (nibbles << shifts).sum(dim=-1)
    words = words - ((words >> 31) & 1) * (1 << 32)  # the uint32 bits as an int32 value
    return words.to(torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The int values in [-8, 7] of :func:`pack_int4`'s words, ``[..., 8 * K]`` int8."""
    shifts = torch.arange(0, 4 * INT4_PACK, 4, dtype=torch.int64, device=packed.device)
    nibbles = (packed.to(torch.int64)[..., None] >> shifts) & 0xF
    return (nibbles - 8).to(torch.int8).flatten(-2)


# --------------------------------------------------------------------------------------------------
# rows


def _row_pieces(*ts: torch.Tensor) -> Iterator[tuple[int, tuple[torch.Tensor, ...]]]:
    """(first flat row index, 2-d views ``[rows, last dim]``) of tensors sharing their leading dims
    (an input and its outputs): all rows at once when every tensor's leading dims fold, else one
    matrix (the last leading dim) at a time, so the i-th rows of the views are always the same rows."""
    t = ts[0]
    if t.dim() == 1:
        yield 0, tuple(x.reshape(1, -1) for x in ts)
        return
    flats = [_flatten_lead(x, 1) for x in ts]
    if all(f is not None for f in flats):
        yield 0, tuple(flats)  # type: ignore[misc]
        return
    rows = t.shape[-2]
    for flat, idx in enumerate(itertools.product(*(range(d) for d in t.shape[:-2]))):
        yield flat * rows, tuple(x[idx] for x in ts)


def _row_chunks(chunk_elems: int, *ts: torch.Tensor) -> Iterator[tuple[int, tuple[torch.Tensor, ...]]]:
    """:func:`_row_pieces` cut into slices of about ``chunk_elems`` input elements."""
    k = max(1, ts[0].shape[-1])
    step = max(1, chunk_elems // k)
    for base, views in _row_pieces(*ts):
        for r0 in range(0, views[0].shape[0], step):
            yield base + r0, tuple(v[r0 : r0 + step] for v in views)


def _check_blocks_finite(
    amax: torch.Tensor, row0: int, block: int, w: torch.Tensor, name: str | None
) -> None:
    """Refuse NaN/Inf seen in a chunk's block maxima ``[rows, blocks]``, naming the first bad block."""
    if bool(torch.isfinite(amax).all()):
        return
    row, blk = torch.nonzero(~torch.isfinite(amax))[0].tolist()
    index = _unravel(row0 + row, tuple(w.shape[:-1]))
    _raise_non_finite(name, f"first in the {block}-element block at index {(*index, blk * block)}")


def _f32(value: float, like: torch.Tensor) -> torch.Tensor:
    return torch.full((), value, dtype=torch.float32, device=like.device)


# --------------------------------------------------------------------------------------------------
# NVFP4 (SPEC §1.5)


def nvfp4_global_scale(
    *tensors: torch.Tensor, name: str | None = None, chunk_elems: int = DEFAULT_CHUNK_ELEMS
) -> torch.Tensor:
    """``gs``: one float32 0-d global scale over ``tensors`` (an expert's gate_proj and up_proj share
    one): ``amax / 2688``, or 1.0 when every value is zero. NaN/Inf refused."""
    if not tensors:
        raise ValueError(f"{_label(name)}: nvfp4_global_scale needs at least one tensor")
    device = tensors[0].device
    amax = torch.zeros((), dtype=torch.float32, device=device)
    for t in tensors:
        _check_input(t, name, Format.NVFP4)
        if t.device != device:
            raise ValueError(f"{_label(name)}: tensors sharing one global scale must be on one device")
        for _, (chunk,) in _row_chunks(chunk_elems, t):
            if chunk.numel():
                amax = torch.maximum(amax, chunk.abs().amax().float())
    if not bool(torch.isfinite(amax)):
        _raise_non_finite(name, "somewhere in the tensor")
    gs = amax / _f32(NVFP4_GLOBAL_DIVISOR, amax)
    return torch.where(amax == 0, torch.ones_like(gs), gs)


def nvfp4_outputs(w: torch.Tensor, out, name: str | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w`` checked for NVFP4 and its ``(q, s, gs)`` buffers: ``out``'s, checked, or new ones. Every
    NVFP4 implementation (this reference, the native and Triton kernels) starts here, so all refuse
    the same inputs with the same errors."""
    _check_input(w, name, Format.NVFP4)
    shape = tuple(w.shape)
    return _check_out_buffers(
        out,
        w,
        (
            ("values", Format.NVFP4.weight_shape(shape), torch.uint8),
            ("scales", Format.NVFP4.scale_shape(shape), FP8_DTYPE),
            ("global scale", (), torch.float32),
        ),
        name,
    )


def mxfp4_outputs(w: torch.Tensor, out, name: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` checked for MXFP4 and its ``(q, scale)`` buffers, as :func:`nvfp4_outputs`."""
    _check_input(w, name, Format.MXFP4)
    shape = tuple(w.shape)
    return _check_out_buffers(
        out,
        w,
        (
            ("values", Format.MXFP4.weight_shape(shape), torch.uint8),
            ("scales", Format.MXFP4.scale_shape(shape), torch.uint8),
        ),
        name,
    )


def quantize_nvfp4(
    w: torch.Tensor,
    *,
    global_scale: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    name: str | None = None,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``w [..., N, K]`` (``K % 16 == 0``) to NVFP4.

    Returns ``(q uint8 [..., N, K/2], s float8_e4m3fn [..., N, K/16], gs float32 0-d)``.
    ``global_scale=`` is a ``gs`` shared with other tensors (:func:`nvfp4_global_scale` over gate_proj
    and up_proj); ``out=(q, s, gs)`` writes into existing buffers.
    """
    q, s, g = nvfp4_outputs(w, out, name)
    if global_scale is None:
        gs = nvfp4_global_scale(w, name=name, chunk_elems=chunk_elems)
    else:
        gs = check_shared_scale(global_scale, name, "global_scale").to(w.device)
    g.copy_(gs)
    six_gs = _f32(E2M1_MAX, gs) * gs
    for row0, (x, qv, sv) in _row_chunks(chunk_elems, w, q, s):
        blocks = x.float().unflatten(-1, (-1, NVFP4_BLOCK))
        amax = blocks.abs().amax(dim=-1)
        _check_blocks_finite(amax, row0, NVFP4_BLOCK, w, name)
        sf = torch.where(amax == 0, torch.ones_like(amax), amax / six_gs)
        scale = sf.clamp(NVFP4_SCALE_MIN, FP8_MAX).to(FP8_DTYPE)
        sv.copy_(scale)
        denom = scale.float() * gs
        pack_e2m1(e2m1_codes(blocks / denom[..., None]).flatten(-2), out=qv)
    return q, s, g


def dequantize_nvfp4(q: torch.Tensor, s: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """float32 ``e2m1(q) * s.float() * gs`` (SPEC §1.5), ``[..., N, K]``."""
    values = _e2m1_decode(unpack_e2m1(q)).unflatten(-1, (-1, NVFP4_BLOCK))
    return (values * (s.float() * gs.float())[..., None]).flatten(-2)


# --------------------------------------------------------------------------------------------------
# MXFP4 (SPEC §1.6)


def _mxfp4_bytes(amax: torch.Tensor) -> torch.Tensor:
    """clamp(floor(log2(amax)) + (significand >= 1.75) - 2 + 127, 1, 254) from amax's float32 bits
    (int32). A subnormal amax (biased exponent 0) lands below the clamp: byte 1, as for amax == 0."""
    bits = amax.contiguous().view(torch.int32)
    biased = (bits >> _F32_MANTISSA_BITS) & 0xFF
    bump = ((bits & ((1 << _F32_MANTISSA_BITS) - 1)) >= _MXFP4_BUMP_MANTISSA).to(torch.int32)
    byte = torch.clamp(biased + bump - 2, E8M0_MIN_BYTE, E8M0_MAX_BYTE)
    return torch.where(amax == 0, torch.full_like(byte, E8M0_MIN_BYTE), byte)


def quantize_mxfp4(
    w: torch.Tensor,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    name: str | None = None,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``w [..., K]`` (``K % 32 == 0``) to MXFP4.

    Returns ``(q uint8 [..., K/2], scale uint8 [..., K/32])``: E2M1 codes two per byte, E8M0 biased
    exponents (never byte 0).
    """
    q, s = mxfp4_outputs(w, out, name)
    for row0, (x, qv, sv) in _row_chunks(chunk_elems, w, q, s):
        blocks = x.float().unflatten(-1, (-1, MXFP4_BLOCK))
        amax = blocks.abs().amax(dim=-1)
        _check_blocks_finite(amax, row0, MXFP4_BLOCK, w, name)
        byte = _mxfp4_bytes(amax)
        sv.copy_(byte)
        mult = _pow2_from_exponent(127 - byte)
        pack_e2m1(e2m1_codes(blocks * mult[..., None]).flatten(-2), out=qv)
    return q, s


def dequantize_mxfp4(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``e2m1(q) * 2^(byte - 127)`` (SPEC §1.6), ``[..., K]``."""
    values = _e2m1_decode(unpack_e2m1(q)).unflatten(-1, (-1, MXFP4_BLOCK))
    return (values * _pow2_from_exponent(scale.to(torch.int32) - 127)[..., None]).flatten(-2)


# --------------------------------------------------------------------------------------------------
# INT4 weight-only (SPEC §1.7)


def int4_outputs(
    w: torch.Tensor, out, group: int, scale_dtype: torch.dtype, name: str | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w``, ``group`` and ``scale_dtype`` checked for INT4 and its ``(packed, scale, shape)`` buffers,
    as :func:`nvfp4_outputs`."""
    _check_input(w, name, Format.INT4_W4A16)
    _check_int4_args(w, group, scale_dtype, name)
    *lead, k = w.shape
    return _check_out_buffers(
        out,
        w,
        (
            ("values", Format.INT4_W4A16.weight_shape(tuple(w.shape)), torch.int32),
            ("scales", (*lead, k // group), scale_dtype),
            ("shape", (2,), torch.int64),
        ),
        name,
    )


def _check_int4_args(w: torch.Tensor, group: int, scale_dtype: torch.dtype, name: str | None) -> None:
    if not isinstance(group, int) or isinstance(group, bool) or group <= 0 or group % INT4_PACK:
        raise ValueError(f"{_label(name)}: int4_w4a16 group must be a positive multiple of 8, got {group!r}")
    if scale_dtype not in INT4_SCALE_DTYPES:
        raise ValueError(
            f"{_label(name)}: int4_w4a16 scales are bfloat16 or float32 (what the engine holds), got {scale_dtype}"
        )
    if w.shape[-1] % group:
        raise ValueError(
            f"{_label(name)} has shape {tuple(w.shape)}: int4_w4a16 with group {group} needs the last dim K "
            f"to be a multiple of {group}, and K={w.shape[-1]} is not; keep this tensor in bf16 "
            "(ignore_patterns) or choose another group size"
        )


def quantize_int4(
    w: torch.Tensor,
    *,
    group: int = INT4_GROUP,
    scale_dtype: torch.dtype = torch.bfloat16,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    name: str | None = None,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``w [..., N, K]`` to symmetric INT4 with one scale per ``group`` elements of K.

    Returns ``(packed int32 [..., N, K/8], scale [..., N, K/group] in scale_dtype, shape int64 [2])``
    (compressed-tensors' ``pack-quantized``: ``weight_packed``, ``weight_scale``, ``weight_shape``).
    """
    packed, s, shape = int4_outputs(w, out, group, scale_dtype, name)
    shape.copy_(torch.tensor(tuple(w.shape[-2:]), dtype=torch.int64))
    seven = _f32(float(INT4_MAX), w)
    for row0, (x, pv, sv) in _row_chunks(chunk_elems, w, packed, s):
        groups = x.float().unflatten(-1, (-1, group))
        amax = groups.abs().amax(dim=-1)
        _check_blocks_finite(amax, row0, group, w, name)
        scale = torch.where(amax == 0, torch.ones_like(amax), amax / seven).to(scale_dtype)
        sv.copy_(scale)
        v = torch.round(groups / scale.float()[..., None])  # round half to even
        q = v.clamp_(-INT4_MAX, INT4_MAX).nan_to_num_(0.0).flatten(-2)
        pv.copy_(pack_int4(q))
    return packed, s, shape


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``q * s`` (SPEC §1.7), ``[..., N, K]``; the group size follows from the shapes."""
    q = unpack_int4(packed).float()
    group = q.shape[-1] // scale.shape[-1]
    return (q.unflatten(-1, (-1, group)) * scale.float()[..., None]).flatten(-2)
