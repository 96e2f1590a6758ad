"""FP8 quantizers: the pure-torch reference of docs/spec.md §1, exact to the byte.

This is the oracle every other implementation (the Triton and native C kernels included) is checked
against, and the daemon's quantizer wherever those do not run (``sidecar.numerics.cpu`` dispatches).
It runs on CPU and CUDA tensors alike.

How it stays fast without giving up exactness:

* the input is processed in chunks of whole 128-row tiles (block-FP8) or whole rows (MXFP8,
  per-tensor); each chunk is upcast into one reused float32 scratch buffer, quantized there in place
  and cast straight into the output. Peak extra memory is one chunk of float32 (``chunk_elems``
  elements, 4 MiB by default, a size that stays in cache on a CPU) plus the scales;
* max |x| of a bfloat16 / float16 input is an int16 max over its sign-cleared bits (one 2-byte pass,
  NaN and Inf still seen), not a float32 max and min over the upcast chunk;
* where the scale is computed here, the clamp to [-448, 448] is skipped: every scaled value is at
  most 448 * (1 + 2^-22), which the cast rounds to 448 as it does the clamped value (a test checks
  it for every bf16/f16 amax). What remains is the float32 -> float8 cast, torch's scalar
  conversion loop: about two thirds of the time on a CPU (bench/quant.py);
* outputs may be caller-provided (``out=``) so the daemon writes straight into shared memory;
* every division that docs/spec.md says must be correctly rounded divides by a tensor on the same device
  (on CUDA, torch turns ``t / 448.0`` into ``t * (1/448)``, which is not).

Names: block-FP8 returns ``scale_inv`` (the dequantization multiplier, checkpoint name
``weight_scale_inv``); MXFP8 returns ``scale`` as E8M0 bytes; per-tensor returns ``scale`` (also a
dequantization multiplier, checkpoint name ``weight_scale``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch

# the shared checks, errors and helpers live one layer down (``checks``) so that the 4-bit reference
# (``fourbit``) uses them without importing this module; they stay importable from here
from sidecar.numerics import fourbit
from sidecar.numerics.checks import (
    _F32_EXP_MASK,
    _F32_MANTISSA_BITS,
    _F32_MANTISSA_MASK,
    DEFAULT_CHUNK_ELEMS,
    NonFiniteError,
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
    BLOCK,
    E8M0_BIAS,
    E8M0_MAX_BYTE,
    E8M0_MIN_BYTE,
    FLT_MIN,
    FP8_DTYPE,
    FP8_MAX,
    MX_BLOCK,
    Format,
)

__all__ = [
    "DEFAULT_CHUNK_ELEMS",
    "NonFiniteError",
    "check_shared_scale",
    "dequantize",
    "fp8_per_tensor_scale",
    "quantize",
    "quantize_block_fp8",
    "quantize_fp8_per_tensor",
    "quantize_mxfp8",
]


# --------------------------------------------------------------------------------------------------
# validation


def _check_out(
    out: tuple[torch.Tensor, torch.Tensor] | None,
    w: torch.Tensor,
    scale_shape: tuple[int, ...],
    scale_dtype: torch.dtype,
    name: str | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    wanted = (("values", tuple(w.shape), FP8_DTYPE), ("scales", tuple(scale_shape), scale_dtype))
    q, s = _check_out_buffers(out, w, wanted, name)
    return q, s


# --------------------------------------------------------------------------------------------------
# shared pieces


def _batched_views(
    keep: int, tensors: tuple[torch.Tensor, ...], scale_keep: int
) -> Iterator[tuple[int, tuple[torch.Tensor, ...]]]:
    """Yield (first flat batch index, views) with leading dims flattened to one batch dim.

    ``tensors`` are (input, values out, scales out); the scales keep ``scale_keep`` trailing dims. When
    a tensor's strides do not allow flattening (a non-contiguous input, say), fall back to one batch
    entry per leading index so nothing is copied whole.
    """
    w = tensors[0]
    keeps = (keep, keep, scale_keep)
    views = tuple(_flatten_lead(t, k) for t, k in zip(tensors, keeps))
    if all(v is not None for v in views):
        yield 0, views  # type: ignore[misc]
        return
    lead = tuple(w.shape[: w.dim() - keep])
    for flat, idx in enumerate(itertools.product(*(range(d) for d in lead))):
        yield flat, tuple(t[idx].unsqueeze(0) for t in tensors)


def _fp8_max_like(t: torch.Tensor) -> torch.Tensor:
    # a 0-d tensor on the same device: division by it is correctly rounded on CPU and CUDA
    return torch.full((), FP8_MAX, dtype=torch.float32, device=t.device)


def _absmax(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """max |x| over ``dims`` without materialising |x|; NaN propagates."""
    return torch.maximum(t.amax(dim=dims), t.amin(dim=dims).neg())


def _scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """SPEC §1.1 / §1.3: 1.0 where amax == 0, else max(amax / 448, FLT_MIN), float32."""
    scale = torch.clamp_min(amax / _fp8_max_like(amax), FLT_MIN)
    return torch.where(amax == 0, torch.ones_like(scale), scale)


def _magnitude_bits_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The integer dtype whose sign-cleared bits order |x| for ``dtype`` (2-byte floats), else None.

    For an IEEE float with the sign bit cleared, the bit pattern read as an integer orders the
    magnitudes exactly, with Inf above every finite value and NaN above Inf. So ``max(bits & 0x7FFF)``
    is the bits of ``max |x|`` (non-finite when anything was), found in one integer pass over the
    2-byte input instead of a float32 max and min over an upcast copy (measured ~2x cheaper).
    """
    return torch.int16 if dtype in (torch.bfloat16, torch.float16) else None


def _magnitude_bits(x: torch.Tensor, out: torch.Tensor) -> None:
    """Write the bits of ``|x|`` (a bfloat16 or float16 tensor) into the int16 tensor ``out``."""
    torch.bitwise_and(x.view(torch.int16), 0x7FFF, out=out)


def _float_from_magnitude_bits(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 values of sign-cleared ``dtype`` bits held as int16 (exact; NaN and Inf kept)."""
    if dtype == torch.bfloat16:
        return (bits.to(torch.int32) << 16).view(torch.float32)
    return bits.view(torch.float16).float()


# --------------------------------------------------------------------------------------------------
# block-FP8 (SPEC §1.1)


def quantize_block_fp8(
    w: torch.Tensor,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    name: str | None = None,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``w [..., N, K]`` to float8_e4m3fn with one float32 ``scale_inv`` per 128x128 tile.

    Returns ``(q [..., N, K], scale_inv [..., ceil(N/128), ceil(K/128)])``; ragged edge tiles behave
    as if zero-padded. ``out=(q, scale_inv)`` writes into existing buffers.
    """
    _check_input(w, name, Format.BLOCK_FP8)
    scale_shape = Format.BLOCK_FP8.scale_shape(tuple(w.shape))
    q, s = _check_out(out, w, scale_shape, torch.float32, name)
    n, k = w.shape[-2:]
    if w.numel() == 0:
        s.fill_(1.0)
        return q, s
    lead = tuple(w.shape[:-2])
    for base, (x3, q3, s3) in _batched_views(2, (w, q, s), 2):
        _block_fp8_3d(x3, q3, s3, n, k, chunk_elems, name, lead, base)
    return q, s


def _block_fp8_3d(x, q, s, n, k, chunk_elems, name, lead, base) -> None:
    batch = x.shape[0]
    nb, kb = s.shape[-2:]
    kp = kb * BLOCK
    tile_rows_per_chunk = max(1, chunk_elems // (BLOCK * kp))
    if tile_rows_per_chunk >= nb:  # whole matrices fit: take several at once
        mats, rows = max(1, chunk_elems // (nb * BLOCK * kp)), nb * BLOCK
    else:
        mats, rows = 1, tile_rows_per_chunk * BLOCK
    mats = min(mats, batch)
    buf = torch.zeros((mats, rows, kp), dtype=torch.float32, device=x.device)
    # amax from the input's sign-cleared bits (2-byte inputs), so the float32 chunk is read once, by
    # the scaling multiply; the padding of ragged tiles is zero bits (+0.0) in ``mag`` instead
    mag_dtype = _magnitude_bits_dtype(x.dtype)
    mag = None if mag_dtype is None else torch.zeros((mats, rows, kp), dtype=mag_dtype, device=x.device)
    for b0 in range(0, batch, mats):
        b1 = min(batch, b0 + mats)
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            rp = -(-(r1 - r0) // BLOCK) * BLOCK
            src = x[b0:b1, r0:r1]
            chunk = buf[: b1 - b0, :rp]
            if mag is None:
                chunk[:, : r1 - r0, :k].copy_(src)
                if r1 - r0 < rp:
                    chunk[:, r1 - r0 :].zero_()  # the ragged tile's padding rows
                amax = _tile_absmax(chunk.view(b1 - b0, rp // BLOCK, BLOCK, kb, BLOCK))
            else:
                bits = mag[: b1 - b0, :rp]
                _magnitude_bits(src, bits[:, : r1 - r0, :k])
                if r1 - r0 < rp:
                    bits[:, r1 - r0 :].zero_()  # the ragged tile's padding rows
                tile_bits = bits.view(b1 - b0, rp // BLOCK, BLOCK, kb, BLOCK).amax(dim=4).amax(dim=2)
                amax = _float_from_magnitude_bits(tile_bits, x.dtype)
            if not bool(torch.isfinite(amax).all()):
                bad = torch.nonzero(~torch.isfinite(amax))[0].tolist()
                where = (
                    f"first in tile rows {r0 + bad[1] * BLOCK}..{min(n, r0 + (bad[1] + 1) * BLOCK) - 1}, "
                    f"cols {bad[2] * BLOCK}..{min(k, (bad[2] + 1) * BLOCK) - 1}"
                )
                if lead:
                    where += f" of matrix {_unravel(base + b0 + bad[0], lead)}"
                _raise_non_finite(name, where)
            scale_inv = _scale_from_amax(amax)
            s[b0:b1, r0 // BLOCK : r0 // BLOCK + rp // BLOCK].copy_(scale_inv)
            if mag is not None:
                chunk[:, : r1 - r0, :k].copy_(src)  # the rows were just read: still in cache
            # No clamp to [-448, 448] before the cast: with scale_inv = RN(amax / 448) (or FLT_MIN,
            # larger) every |x| * RN(1 / scale_inv) <= 448 * (1 + 2^-22), which the round-to-nearest
            # cast turns into 448 exactly as it does the clamped value (only >= 464 would not), so
            # the bytes are those of SPEC §1.1 without a pass over the chunk.
            tiles = chunk.view(b1 - b0, rp // BLOCK, BLOCK, kb, BLOCK)
            tiles.mul_(torch.reciprocal(scale_inv)[:, :, None, :, None])
            q[b0:b1, r0:r1].copy_(chunk[:, : r1 - r0, :k])


def _tile_absmax(tiles: torch.Tensor) -> torch.Tensor:
    # reduce the contiguous dim first: measured 2.5x faster than reducing (2, 4) at once on a CPU
    hi = tiles.amax(dim=4).amax(dim=2)
    lo = tiles.amin(dim=4).amin(dim=2)
    return torch.maximum(hi, lo.neg())


# --------------------------------------------------------------------------------------------------
# MXFP8 (SPEC §1.2)


def _e8m0_bytes(amax: torch.Tensor) -> torch.Tensor:
    """clamp(ceil(log2(amax / 448)) + 127, 1, 254) from the float32 quotient's bits, as int32.

    For a normal quotient ``2^(E-127) * 1.m``, ``ceil(log2)`` is ``E - 127`` plus one unless the
    mantissa is zero; a zero or subnormal quotient (E == 0) lands below the clamp and gives byte 1,
    which is also the byte for an all-zero block.
    """
    bits = (amax / _fp8_max_like(amax)).view(torch.int32)
    biased = (bits >> _F32_MANTISSA_BITS) & _F32_EXP_MASK
    ceil_biased = biased + ((bits & _F32_MANTISSA_MASK) != 0).to(torch.int32)
    return torch.clamp(ceil_biased, E8M0_MIN_BYTE, E8M0_MAX_BYTE)


def quantize_mxfp8(
    w: torch.Tensor,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    name: str | None = None,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``w [..., K]`` (``K % 32 == 0``) to float8_e4m3fn with one E8M0 byte per 32 elements.

    Returns ``(q [..., K], scale uint8 [..., K/32])``: biased exponents, row-major, never byte 0.
    """
    _check_input(w, name, Format.MXFP8)
    k = w.shape[-1]
    scale_shape = Format.MXFP8.scale_shape(tuple(w.shape))
    q, s = _check_out(out, w, scale_shape, torch.uint8, name)
    if w.numel() == 0:
        return q, s
    lead = tuple(w.shape[:-1])
    for base, (x2, q2, s2) in _batched_views(1, (w, q, s), 1):
        _mxfp8_2d(x2, q2, s2, k, chunk_elems, name, lead, base)
    return q, s


def _mxfp8_2d(x, q, s, k, chunk_elems, name, lead, base) -> None:
    m = x.shape[0]
    rows = max(1, min(m, chunk_elems // k))
    buf = torch.empty((rows, k), dtype=torch.float32, device=x.device)
    mag_dtype = _magnitude_bits_dtype(x.dtype)
    mag = None if mag_dtype is None else torch.empty((rows, k), dtype=mag_dtype, device=x.device)
    for r0 in range(0, m, rows):
        r1 = min(m, r0 + rows)
        chunk = buf[: r1 - r0]
        blocks = chunk.view(r1 - r0, k // MX_BLOCK, MX_BLOCK)
        if mag is None:
            chunk.copy_(x[r0:r1])
            amax = _absmax(blocks, (2,))
        else:
            bits = mag[: r1 - r0]
            _magnitude_bits(x[r0:r1], bits)
            amax = _float_from_magnitude_bits(
                bits.view(r1 - r0, k // MX_BLOCK, MX_BLOCK).amax(dim=2), x.dtype
            )
        if not bool(torch.isfinite(amax).all()):
            row, blk = torch.nonzero(~torch.isfinite(amax))[0].tolist()
            index = _unravel(base + r0 + row, lead)
            where = f"first in the 32-element block at index {(*index, blk * MX_BLOCK)}"
            _raise_non_finite(name, where)
        byte = _e8m0_bytes(amax)
        s[r0:r1].copy_(byte)
        if mag is not None:
            chunk.copy_(x[r0:r1])
        # No clamp before the cast: the multiplier is 2^-e with 2^e >= RN(amax / 448) >= amax / 448
        # * (1 - 2^-24), so every |x| * 2^-e <= 448 * (1 + 2^-23) and rounds to 448 like the clamped
        # value (SPEC §1.2's clamp only matters from 464 up, which cannot occur here).
        blocks.mul_(_pow2_from_exponent(E8M0_BIAS - byte)[:, :, None])
        q[r0:r1].copy_(chunk)


# --------------------------------------------------------------------------------------------------
# FP8 per-tensor (SPEC §1.3)


def _row_chunks(*ts: torch.Tensor, chunk_elems: int) -> Iterator[tuple[torch.Tensor, ...]]:
    """Yield slices of the same rows of each of ``ts`` (tensors of one shape: an input and its output)
    holding about ``chunk_elems`` elements each, viewing them as [rows, last dim].

    When the leading dims of any of them cannot be flattened into one (a strided view), all of them
    go one leading index at a time, so the i-th slices always hold the same elements.
    """
    t = ts[0]
    if t.dim() == 0:
        yield tuple(x.reshape(1, 1) for x in ts)
        return
    flats = [_flatten_lead(x, 1) for x in ts]
    if all(f is not None for f in flats):
        pieces = [tuple(flats)]
    else:
        pieces = [tuple(x[idx] for x in ts) for idx in itertools.product(*map(range, t.shape[:-1]))]
    for piece in pieces:
        piece = tuple(p.reshape(1, -1) if p.dim() == 1 else p for p in piece)
        rows = max(1, chunk_elems // max(1, piece[0].shape[-1]))
        for r0 in range(0, piece[0].shape[0], rows):
            yield tuple(p[r0 : r0 + rows] for p in piece)


def fp8_per_tensor_scale(
    *tensors: torch.Tensor, name: str | None = None, chunk_elems: int = DEFAULT_CHUNK_ELEMS
) -> torch.Tensor:
    """One float32 0-d scale over ``tensors`` (e.g. an expert's gate and up projections)."""
    if not tensors:
        raise ValueError(f"{_label(name)}: fp8_per_tensor_scale needs at least one tensor")
    device = tensors[0].device
    amax = torch.zeros((), dtype=torch.float32, device=device)
    for t in tensors:
        _check_input(t, name, Format.FP8_PER_TENSOR)
        if t.device != device:
            raise ValueError(f"{_label(name)}: tensors sharing one scale must be on one device")
        mag_dtype = _magnitude_bits_dtype(t.dtype)
        for (chunk,) in _row_chunks(t, chunk_elems=chunk_elems):
            if not chunk.numel():
                continue
            if mag_dtype is None:
                # |x| and max are exact in the input dtype, so no float32 copy is needed here
                amax = torch.maximum(amax, _absmax(chunk, tuple(range(chunk.dim()))).float())
            else:
                bits = torch.empty(chunk.shape, dtype=mag_dtype, device=device)
                _magnitude_bits(chunk, bits)
                amax = torch.maximum(amax, _float_from_magnitude_bits(bits.amax(), t.dtype))
    if not bool(torch.isfinite(amax)):
        _raise_non_finite(name, "somewhere in the tensor")
    return _scale_from_amax(amax)


def quantize_fp8_per_tensor(
    w: torch.Tensor,
    *,
    scale: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    name: str | None = None,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``w`` with one float32 scale; ``scale=`` shares a scale computed over a group.

    Returns ``(q, scale)`` with ``scale`` 0-d float32 (the dequantization multiplier).
    """
    _check_input(w, name, Format.FP8_PER_TENSOR)
    q, s = _check_out(out, w, (), torch.float32, name)
    # A scale computed here bounds every |x| * (1 / scale) by 448 * (1 + 2^-22), which the cast rounds
    # to 448 like the clamped value (see _block_fp8_3d), so only a caller's scale= needs the clamp.
    clamp = scale is not None
    if scale is None:
        scale = fp8_per_tensor_scale(w, name=name, chunk_elems=chunk_elems)
    else:
        scale = check_shared_scale(scale, name).to(w.device)
        # a shared scale must still see every value: refuse NaN/Inf here too
        for (chunk,) in _row_chunks(w, chunk_elems=chunk_elems):
            if chunk.numel() and not bool(torch.isfinite(_absmax(chunk, tuple(range(chunk.dim()))))):
                _raise_non_finite(name, "somewhere in the tensor")
    s.copy_(scale)
    recip = torch.reciprocal(scale)
    row = w.shape[-1] if w.dim() else 1
    buf = torch.empty(min(w.numel(), max(chunk_elems, row)), dtype=torch.float32, device=w.device)
    for src, dst in _row_chunks(w, q, chunk_elems=chunk_elems):
        chunk = buf[: src.numel()].view(src.shape)
        chunk.copy_(src)
        chunk.mul_(recip)
        if clamp:
            chunk.clamp_(-FP8_MAX, FP8_MAX)
        dst.copy_(chunk)
    return q, s


# --------------------------------------------------------------------------------------------------
# dispatch and dequantization


def quantize(
    w: torch.Tensor,
    fmt: Format | str,
    *,
    out: tuple[torch.Tensor, ...] | None = None,
    name: str | None = None,
) -> tuple[torch.Tensor, ...]:
    """Quantize ``w`` to ``fmt`` (any quantized Format); returns (values, scale tensor) for the FP8
    formats and MXFP4, (values, scales, global scale) for NVFP4 and (packed, scales, shape) for
    int4_w4a16 (group 32, bfloat16 scales: :func:`sidecar.numerics.fourbit.quantize_int4` for others)."""
    fmt = Format.parse(fmt)
    if fmt is Format.BLOCK_FP8:
        return quantize_block_fp8(w, out=out, name=name)
    if fmt is Format.MXFP8:
        return quantize_mxfp8(w, out=out, name=name)
    if fmt is Format.FP8_PER_TENSOR:
        return quantize_fp8_per_tensor(w, out=out, name=name)
    if fmt.four_bit:
        fn = {
            Format.NVFP4: fourbit.quantize_nvfp4,
            Format.MXFP4: fourbit.quantize_mxfp4,
            Format.INT4_W4A16: fourbit.quantize_int4,
        }[fmt]
        return fn(w, out=out, name=name)
    raise ValueError(f"format {fmt.value} is not a quantized format; nothing to quantize")


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, fmt: Format | str, *, global_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """Float32 values of ``q`` under ``scale`` (SPEC §1 dequantization rules); NVFP4 needs its
    ``global_scale`` (``weight_scale_2``) too."""
    fmt = Format.parse(fmt)
    if fmt.four_bit:
        if fmt is Format.NVFP4:
            if global_scale is None:
                raise ValueError("dequantize: nvfp4 needs global_scale= (the .weight_scale_2 tensor)")
            return fourbit.dequantize_nvfp4(q, scale, global_scale)
        if fmt is Format.MXFP4:
            return fourbit.dequantize_mxfp4(q, scale)
        return fourbit.dequantize_int4(q, scale)
    if q.dtype != FP8_DTYPE:
        raise ValueError(f"dequantize expects float8_e4m3fn values, got {q.dtype}")
    x = q.float()
    if fmt is Format.BLOCK_FP8:
        n, k = q.shape[-2:]
        expanded = scale.repeat_interleave(BLOCK, dim=-2)[..., :n, :]
        return x * expanded.repeat_interleave(BLOCK, dim=-1)[..., :k]
    if fmt is Format.MXFP8:
        if scale.dtype != torch.uint8:
            raise ValueError(f"mxfp8 scales are uint8 E8M0 bytes, got {scale.dtype}")
        mult = _pow2_from_exponent(scale.to(torch.int32) - E8M0_BIAS)
        return (x.unflatten(-1, (-1, MX_BLOCK)) * mult[..., None]).flatten(-2)
    if fmt is Format.FP8_PER_TENSOR:
        return x * scale
    raise ValueError(f"format {fmt.value} is not a quantized format; nothing to dequantize")
