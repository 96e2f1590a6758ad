"""Triton kernels for the 4-bit formats on whole slabs: what the daemon's CUDA path launches.

The arithmetic is :mod:`sidecar.numerics.kernels.triton_fourbit`'s (same jit helpers, same bit-level
rounding, byte-exact with :mod:`sidecar.numerics.fourbit`); only the addressing differs. A launch
reads a slab ``[E, R, K]`` (last dim contiguous, any expert and row strides) cut into ``PARTS``
equal row parts per expert, and writes each (expert, part)'s outputs straight into the caller's
buffers (the daemon's publish ring), whose base addresses it loads from int64 tables as the FP8
slab kernels do (``sidecar.numerics.kernels.slab`` says why): values, scales and the third output
(NVFP4's global scale ``gs`` or its reciprocal, INT4's ``weight_shape``), written by the first
program of each part. Nothing is allocated per launch but the flag the caller passes.

Program ``pid`` covers ``NB`` blocks (groups) of one row: ``pid = (ep * rows + row) * pieces +
piece`` with ``ep = e * PARTS + p``. A block holding NaN/Inf ``atomic_min``s ``ep * rows + row``
into the flag (the host names the tensor and row).

NVFP4's global scale is one per expert over all its parts (gate and up share it, SPEC §1.5): a
first pass (:func:`calls_amax`) ``atomic_max``es each expert's magnitude bits into an int32 per
expert (the caller's scratch, zeroed first: 4 bytes per expert), and the quantize pass derives
``gs = amax / 2688`` (1.0 for all zeros) from it in every program, as the reference does once.
Two separate tensors sharing one scale (per-expert checkpoints) point their amax passes at the
same int32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from sidecar.numerics.formats import MXFP4_BLOCK, NVFP4_BLOCK
from sidecar.numerics.kernels.triton_fourbit import _ABS, _NON_FINITE, _e2m1, _load_f32, _nvfp4_blocks
from sidecar.numerics.kernels.triton_quant import KernelCall

__all__ = ["blocks_per_program", "calls_amax", "calls_int4", "calls_mxfp4", "calls_nvfp4"]

#: input elements of one row per program: 8 per thread of 4 warps, so each thread loads 16 bytes of
#: bf16 at once (fewer elements left the loads 2- or 4-byte wide: sm_90 PTX, tests)
_ELEMS = 1024
#: the amax pass: rows x columns per step of one program, rows per program
_AMAX_BR = 8
_AMAX_BK = 256
_AMAX_ROWS = 64
_GS_DIVISOR = tl.constexpr(2688.0)


@triton.jit
def _decode(pid, rows, n_pc):
    piece = pid % n_pc
    rest = pid // n_pc
    return rest // rows, rest % rows, piece


@triton.jit
def _row_base(x_ptr, se, sr, ep, row, rows, PARTS: tl.constexpr):
    return x_ptr + (ep // PARTS).to(tl.int64) * se + ((ep % PARTS) * rows + row).to(tl.int64) * sr


@triton.jit
def _flag_rows(amax_bits, valid, flag_ptr, ep, rows, row):
    worst = tl.max(tl.where(valid, amax_bits, 0), axis=0)
    if worst >= _NON_FINITE:
        tl.atomic_min(flag_ptr, ep * rows + row)


@triton.jit
def _amax_kernel(
    x_ptr, se, sr, amax_ptr, total_rows, K, n_chunks, BR: tl.constexpr, BK: tl.constexpr,
    ROW_ITERS: tl.constexpr, COL_ITERS: tl.constexpr, IS_BF16: tl.constexpr,
):  # fmt: skip
    # constexpr trip counts: Triton 3.6's interpreter cannot loop over tensor bounds (triton_quant)
    pid = tl.program_id(0)
    e = pid // n_chunks
    r0 = (pid % n_chunks) * (BR * ROW_ITERS)
    base = x_ptr + e.to(tl.int64) * se
    acc = tl.zeros([BR, BK], dtype=tl.int32)
    for i in range(ROW_ITERS):
        r = r0 + i * BR + tl.arange(0, BR)
        for j in range(COL_ITERS):
            c = j * BK + tl.arange(0, BK)
            m = (r < total_rows)[:, None] & (c < K)[None, :]
            x = _load_f32(base + r.to(tl.int64)[:, None] * sr + c[None, :], m, IS_BF16)
            acc = tl.maximum(acc, x.to(tl.int32, bitcast=True) & _ABS)
    tl.atomic_max(amax_ptr + e, tl.max(tl.max(acc, axis=1), axis=0))


@triton.jit
def _nvfp4_kernel(
    x_ptr, se, sr, q_tab, s_tab, g_tab, amax_ptr, flag_ptr, rows, K, n_pc,
    PARTS: tl.constexpr, IS_BF16: tl.constexpr, RECIPROCAL: tl.constexpr, NB: tl.constexpr,
):  # fmt: skip
    ep, row, piece = _decode(tl.program_id(0), rows, n_pc)
    blk = piece * NB + tl.arange(0, NB)
    valid = blk < K // 16
    mask = valid[:, None]
    x_row = _row_base(x_ptr, se, sr, ep, row, rows, PARTS)
    x = _load_f32(x_row + blk[:, None] * 16 + tl.arange(0, 16)[None, :], mask, IS_BF16)
    amax_bits = tl.max(x.to(tl.int32, bitcast=True) & _ABS, axis=1)
    _flag_rows(amax_bits, valid, flag_ptr, ep, rows, row)
    amax = amax_bits.to(tl.float32, bitcast=True)
    t_bits = tl.load(amax_ptr + ep // PARTS)
    gs = tl.where(t_bits == 0, 1.0, tl.math.div_rn(t_bits.to(tl.float32, bitcast=True), _GS_DIVISOR))
    packed, byte = _nvfp4_blocks(x, amax, gs, NB)
    q_base = tl.load(q_tab + ep).to(tl.pointer_type(tl.uint8))
    s_base = tl.load(s_tab + ep).to(tl.pointer_type(tl.uint8))
    r64 = row.to(tl.int64)
    tl.store(q_base + r64 * (K // 2) + blk[:, None] * 8 + tl.arange(0, 8)[None, :], packed, mask=mask)
    tl.store(s_base + r64 * (K // 16) + blk, byte.to(tl.uint8), mask=valid)
    if (row == 0) & (piece == 0):
        g_base = tl.load(g_tab + ep).to(tl.pointer_type(tl.float32))
        if RECIPROCAL:  # compressed-tensors' weight_global_scale: float32(1 / gs)
            tl.store(g_base, tl.math.div_rn(1.0, gs))
        else:
            tl.store(g_base, gs)


@triton.jit
def _mxfp4_kernel(
    x_ptr, se, sr, q_tab, s_tab, flag_ptr, rows, K, n_pc,
    PARTS: tl.constexpr, IS_BF16: tl.constexpr, NB: tl.constexpr,
):  # fmt: skip
    ep, row, piece = _decode(tl.program_id(0), rows, n_pc)
    blk = piece * NB + tl.arange(0, NB)
    valid = blk < K // 32
    mask = valid[:, None]
    x_row = _row_base(x_ptr, se, sr, ep, row, rows, PARTS)
    x = _load_f32(x_row + blk[:, None] * 32 + tl.arange(0, 32)[None, :], mask, IS_BF16)
    amax_bits = tl.max(x.to(tl.int32, bitcast=True) & _ABS, axis=1)
    _flag_rows(amax_bits, valid, flag_ptr, ep, rows, row)
    bump = ((amax_bits & 0x7FFFFF) >= 0x600000).to(tl.int32)
    byte = tl.minimum(tl.maximum(((amax_bits >> 23) & 0xFF) + bump - 2, 1), 254)
    byte = tl.where(amax_bits == 0, 1, byte)
    exponent = 127 - byte
    mult = tl.where(exponent == -127, 1 << 22, (exponent + 127) << 23).to(tl.float32, bitcast=True)
    codes = _e2m1(x * mult[:, None])
    lo, hi = tl.split(tl.reshape(codes, (NB, 16, 2)))
    packed = (lo | (hi << 4)).to(tl.uint8)
    q_base = tl.load(q_tab + ep).to(tl.pointer_type(tl.uint8))
    s_base = tl.load(s_tab + ep).to(tl.pointer_type(tl.uint8))
    r64 = row.to(tl.int64)
    tl.store(q_base + r64 * (K // 2) + blk[:, None] * 16 + tl.arange(0, 16)[None, :], packed, mask=mask)
    tl.store(s_base + r64 * (K // 32) + blk, byte.to(tl.uint8), mask=valid)


@triton.jit
def _int4_kernel(
    x_ptr, se, sr, q_tab, s_tab, shape_tab, flag_ptr, rows, K, n_pc,
    PARTS: tl.constexpr, IS_BF16: tl.constexpr, G: tl.constexpr, SCALE_BF16: tl.constexpr,
    NB: tl.constexpr,
):  # fmt: skip
    ep, row, piece = _decode(tl.program_id(0), rows, n_pc)
    grp = piece * NB + tl.arange(0, NB)
    valid = grp < K // G
    mask = valid[:, None]
    x_row = _row_base(x_ptr, se, sr, ep, row, rows, PARTS)
    x = _load_f32(x_row + grp[:, None] * G + tl.arange(0, G)[None, :], mask, IS_BF16)
    amax_bits = tl.max(x.to(tl.int32, bitcast=True) & _ABS, axis=1)
    _flag_rows(amax_bits, valid, flag_ptr, ep, rows, row)
    amax = amax_bits.to(tl.float32, bitcast=True)
    sf = tl.where(amax == 0.0, 1.0, tl.math.div_rn(amax, 7.0))
    r64 = row.to(tl.int64)
    if SCALE_BF16:
        u = sf.to(tl.int32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        sf = (u << 16).to(tl.float32, bitcast=True)
        s_base = tl.load(s_tab + ep).to(tl.pointer_type(tl.int16))
        tl.store(s_base + r64 * (K // G) + grp, u.to(tl.int16), mask=valid)
    else:
        s_base = tl.load(s_tab + ep).to(tl.pointer_type(tl.float32))
        tl.store(s_base + r64 * (K // G) + grp, sf, mask=valid)
    v = tl.math.div_rn(x, sf[:, None])
    r = (v + 12582912.0) - 12582912.0  # round half to even for |v| < 2^22 (Inf stays Inf)
    r = tl.where(r > 7.0, 7.0, tl.where(r < -7.0, -7.0, r))
    r = tl.where(x == 0.0, 0.0, r)  # 0 / 0 where the scale underflowed: the zero's code
    nib = (r.to(tl.int32) + 8).to(tl.int64)
    words = tl.reshape(nib, (NB, G // 8, 8))
    shifts = (tl.arange(0, 8) * 4).to(tl.int64)
    packed = tl.sum(words << shifts[None, None, :], axis=2)
    packed = tl.where(packed >= 2**31, packed - 2**32, packed).to(tl.int32)
    q_base = tl.load(q_tab + ep).to(tl.pointer_type(tl.int32))
    tl.store(
        q_base + r64 * (K // 8) + grp[:, None] * (G // 8) + tl.arange(0, G // 8)[None, :], packed, mask=mask
    )
    if (row == 0) & (piece == 0):  # compressed-tensors' weight_shape: the part's [rows, K]
        sh_base = tl.load(shape_tab + ep).to(tl.pointer_type(tl.int64))
        two = tl.arange(0, 2)
        tl.store(sh_base + two, tl.where(two == 0, rows, K).to(tl.int64))


# --------------------------------------------------------------------------------------------------
# calls (host side): dtypes may stand in for tensors (compiling without launching)


def blocks_per_program(block: int) -> int:
    """Blocks (groups) of ``block`` elements one program covers: ``_ELEMS`` elements' worth (one
    group for INT4 groups of 1024 and wider)."""
    return max(1, _ELEMS // block)


def _programs(experts: int, parts: int, rows: int, blocks: int, nb: int) -> tuple[int, int]:
    n_pc = max(1, -(-blocks // nb))
    return experts * parts * rows * n_pc, n_pc


_OPTS = {"num_warps": 4, "enable_fp_fusion": False}  # no contraction: SPEC rounds each step


def calls_amax(slab, se: int, sr: int, amax, experts: int, total_rows: int, cols: int, *, is_bf16: bool):
    """The NVFP4 global scale's pass: each expert's ``[total_rows, cols]`` magnitude bits
    ``atomic_max``ed into ``amax[e]`` (int32, zeroed by the caller)."""
    rows_per_program = _AMAX_BR * max(1, min(_AMAX_ROWS // _AMAX_BR, -(-total_rows // _AMAX_BR)))
    n_chunks = max(1, -(-total_rows // rows_per_program))
    consts = {
        "BR": _AMAX_BR,
        "BK": _AMAX_BK,
        "ROW_ITERS": rows_per_program // _AMAX_BR,
        "COL_ITERS": max(1, -(-cols // _AMAX_BK)),
        "IS_BF16": is_bf16,
    }
    args = (slab, se, sr, amax, total_rows, cols, n_chunks)
    return [KernelCall(_amax_kernel, experts * n_chunks, args, {**consts, **_OPTS})]


def calls_nvfp4(slab, se, sr, tables, amax, flag, experts, parts, rows, cols, *, is_bf16, reciprocal):
    nb = blocks_per_program(NVFP4_BLOCK)
    programs, n_pc = _programs(experts, parts, rows, cols // NVFP4_BLOCK, nb)
    args = (slab, se, sr, *tables, amax, flag, rows, cols, n_pc)
    consts = {"PARTS": parts, "IS_BF16": is_bf16, "RECIPROCAL": reciprocal, "NB": nb}
    return [KernelCall(_nvfp4_kernel, programs, args, {**consts, **_OPTS})]


def calls_mxfp4(slab, se, sr, tables, flag, experts, parts, rows, cols, *, is_bf16):
    nb = blocks_per_program(MXFP4_BLOCK)
    programs, n_pc = _programs(experts, parts, rows, cols // MXFP4_BLOCK, nb)
    args = (slab, se, sr, *tables, flag, rows, cols, n_pc)
    return [
        KernelCall(_mxfp4_kernel, programs, args, {"PARTS": parts, "IS_BF16": is_bf16, "NB": nb, **_OPTS})
    ]


def calls_int4(slab, se, sr, tables, flag, experts, parts, rows, cols, *, is_bf16, group, scale_bf16):
    nb = blocks_per_program(group)
    programs, n_pc = _programs(experts, parts, rows, cols // group, nb)
    args = (slab, se, sr, *tables, flag, rows, cols, n_pc)
    consts = {"PARTS": parts, "IS_BF16": is_bf16, "G": group, "SCALE_BF16": scale_bf16, "NB": nb}
    return [KernelCall(_int4_kernel, programs, args, {**consts, **_OPTS})]
