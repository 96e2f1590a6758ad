"""Triton kernels of docs/spec.md §1: one launch quantizes a whole layer slab.

Each kernel reads the slab ``[E, R, K]`` through its strides (any float dtype, contiguous or not)
and writes each (expert, part)'s values and scales straight into the caller's tensors, whose base
addresses it loads from two int64 tables (``sidecar.numerics.kernels.slab`` says why). Program ``pid`` covers
tile ``((e * PARTS + p) * n_rt + rt) * n_ct + ct`` (block-FP8: groups of ``TILES_K`` column tiles).

Exactness, operation by operation, against sidecar.numerics.reference (the torch reference):

* ``amax`` is an integer max over ``bits(x) & 0x7FFFFFFF``: exact for every float, blind to the
  flush-to-zero question, and one reduction that also finds NaN/Inf (their magnitude bits are
  ``>= 0x7F800000``). A program that sees one ``atomic_min``s its tile id into a one-int32 flag; the
  host reads the flag once per launch and raises NonFiniteError naming the tensor and the first tile;
* ``amax / 448`` and ``1 / scale`` are ``tl.math.div_rn`` (correctly rounded), as docs/spec.md §0 demands;
* E8M0 bytes come from the quotient's bits (biased exponent + (mantissa != 0), clamped to
  [1, 254]) and ``2^-(byte-127)`` is built from bits (``2^-127`` as the subnormal ``1 << 22``);
* values are clamped to +-448 and then cast round-to-nearest-even to float8_e4m3fn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import triton
import triton.language as tl

from sidecar.numerics.formats import BLOCK, MX_BLOCK
from sidecar.numerics.kernels.slab import SlabGeometry, TileConfig, next_pow2

__all__ = [
    "CALLS",
    "KernelCall",
    "calls_block_fp8",
    "calls_fp8_per_tensor",
    "calls_mxfp8",
    "compile_only",
    "launch",
    "partials_size",
]

# Triton kernels may read globals only when they are constexpr
_FP8_MAX = tl.constexpr(448.0)
_FLT_MIN = tl.constexpr(2.0**-126)
_ABS_MASK = tl.constexpr(0x7FFFFFFF)
_NON_FINITE = tl.constexpr(0x7F800000)  # magnitude bits of +Inf; NaN is above it
_MANT_MASK = tl.constexpr(0x7FFFFF)
_POW2_M127 = tl.constexpr(1 << 22)  # bits of 2^-127, a float32 subnormal
_TILE = tl.constexpr(BLOCK)
_MX = tl.constexpr(MX_BLOCK)


# --------------------------------------------------------------------------------------------------
# shared pieces


@triton.jit
def _abs_bits(x):
    """|x| as int32 bits: ordered like |x| for every float, NaN above Inf."""
    return x.to(tl.int32, bitcast=True) & _ABS_MASK


@triton.jit
def _scale_from_amax(amax):
    """SPEC §1.1 / §1.3: 1.0 where amax == 0, else max(amax / 448, FLT_MIN)."""
    return tl.where(amax == 0.0, 1.0, tl.maximum(tl.math.div_rn(amax, _FP8_MAX), _FLT_MIN))


@triton.jit
def _cast_e4m3(v):
    v = tl.minimum(tl.maximum(v, -_FP8_MAX), _FP8_MAX)
    return v.to(tl.float8e4nv, fp_downcast_rounding="rtne")


@triton.jit
def _decode(pid, n_rt, n_ct):
    """pid -> (e * PARTS + p, row tile, column tile)."""
    ct = pid % n_ct
    rest = pid // n_ct
    return rest // n_rt, rest % n_rt, ct


@triton.jit
def _bases(q_tab, s_tab, ep, S_TY: tl.constexpr, ALIGNED: tl.constexpr):
    q_base = tl.load(q_tab + ep).to(tl.pointer_type(tl.float8e4nv))
    s_base = tl.load(s_tab + ep).to(tl.pointer_type(S_TY))
    if ALIGNED:
        q_base = tl.multiple_of(q_base, 16)
    return q_base, s_base


# --------------------------------------------------------------------------------------------------
# block-FP8


@triton.jit
def _block_fp8_kernel(
    x_ptr,
    q_tab,
    s_tab,
    flag_ptr,
    stride_e,
    stride_r,
    stride_k,
    rows,
    cols,
    n_rt,
    n_ct,
    n_cg,
    PARTS: tl.constexpr,
    TILES_K: tl.constexpr,
    ALIGNED: tl.constexpr,
    WIDE: tl.constexpr,
):
    ep, rt, cg = _decode(tl.program_id(0), n_rt, n_cg)
    q_base, s_base = _bases(q_tab, s_tab, ep, tl.float32, ALIGNED)
    x_base = x_ptr + (ep // PARTS).to(tl.int64) * stride_e + ((ep % PARTS) * rows).to(tl.int64) * stride_r
    r = rt * _TILE + tl.arange(0, _TILE)
    if WIDE:
        r = r.to(tl.int64)
    row_ok = r < rows
    for i in tl.static_range(TILES_K):
        ct = cg * TILES_K + i
        c = ct * _TILE + tl.arange(0, _TILE)
        if WIDE:
            c = c.to(tl.int64)
        m = row_ok[:, None] & (c < cols)[None, :]
        x = tl.load(x_base + r[:, None] * stride_r + c[None, :] * stride_k, mask=m, other=0.0).to(tl.float32)
        amax_bits = tl.max(_abs_bits(x))
        if amax_bits >= _NON_FINITE:
            tl.atomic_min(flag_ptr, (ep * n_rt + rt) * n_ct + ct)
        scale_inv = _scale_from_amax(amax_bits.to(tl.float32, bitcast=True))
        q = _cast_e4m3(x * tl.math.div_rn(1.0, scale_inv))
        tl.store(q_base + r[:, None] * cols + c[None, :], q, mask=m)
        tl.store(s_base + rt * n_ct + ct, scale_inv, mask=ct < n_ct)


def calls_block_fp8(slab, q_tab, s_tab, flag, geom: SlabGeometry, cfg: TileConfig, *, aligned, wide):
    n_rt, n_ct = geom.tiles(BLOCK, BLOCK)
    tiles_k = cfg.block_cols // BLOCK
    n_cg = -(-n_ct // tiles_k)
    programs = geom.experts * geom.parts * n_rt * n_cg
    if programs == 0:
        return []
    args = (slab, q_tab, s_tab, flag, *geom.strides, geom.rows, geom.cols, n_rt, n_ct, n_cg)
    consts = {"PARTS": geom.parts, "TILES_K": tiles_k, "ALIGNED": aligned, "WIDE": wide}
    return [KernelCall(_block_fp8_kernel, programs, args, {**consts, **_options(cfg)})]


# --------------------------------------------------------------------------------------------------
# MXFP8


@triton.jit
def _mxfp8_kernel(
    x_ptr,
    q_tab,
    s_tab,
    flag_ptr,
    stride_e,
    stride_r,
    stride_k,
    rows,
    cols,
    n_rt,
    n_ct,
    PARTS: tl.constexpr,
    BR: tl.constexpr,
    BK: tl.constexpr,
    ALIGNED: tl.constexpr,
    WIDE: tl.constexpr,
):
    NB: tl.constexpr = BK // _MX
    ep, rt, ct = _decode(tl.program_id(0), n_rt, n_ct)
    q_base, s_base = _bases(q_tab, s_tab, ep, tl.uint8, ALIGNED)
    x_base = x_ptr + (ep // PARTS).to(tl.int64) * stride_e + ((ep % PARTS) * rows).to(tl.int64) * stride_r
    r = rt * BR + tl.arange(0, BR)
    b = ct * NB + tl.arange(0, NB)  # 32-element block index along the row
    if WIDE:
        r = r.to(tl.int64)
        b = b.to(tl.int64)
    c = b[:, None] * _MX + tl.arange(0, _MX)[None, :]  # [NB, 32]
    r3 = r[:, None, None]
    m = (r3 < rows) & (c < cols)[None, :, :]
    x = tl.load(x_base + r3 * stride_r + c[None, :, :] * stride_k, mask=m, other=0.0).to(tl.float32)
    amax_bits = tl.max(_abs_bits(x), axis=2)  # [BR, NB]
    if tl.max(amax_bits) >= _NON_FINITE:
        tl.atomic_min(flag_ptr, (ep * n_rt + rt) * n_ct + ct)
    quot = tl.math.div_rn(amax_bits.to(tl.float32, bitcast=True), _FP8_MAX).to(tl.int32, bitcast=True)
    byte = ((quot >> 23) & 0xFF) + ((quot & _MANT_MASK) != 0).to(tl.int32)  # ceil(log2) + 127
    byte = tl.minimum(tl.maximum(byte, 1), 254)
    mult = tl.where(byte == 254, _POW2_M127, (254 - byte) << 23).to(tl.float32, bitcast=True)
    q = _cast_e4m3(x * mult[:, :, None])
    tl.store(q_base + r3 * cols + c[None, :, :], q, mask=m)
    s_mask = (r < rows)[:, None] & (b < cols // _MX)[None, :]
    tl.store(s_base + r[:, None] * (cols // _MX) + b[None, :], byte.to(tl.uint8), mask=s_mask)


def calls_mxfp8(slab, q_tab, s_tab, flag, geom: SlabGeometry, cfg: TileConfig, *, aligned, wide):
    n_rt, n_ct = geom.tiles(cfg.block_rows, cfg.block_cols)
    programs = geom.programs(cfg.block_rows, cfg.block_cols)
    if programs == 0:
        return []
    args = (slab, q_tab, s_tab, flag, *geom.strides, geom.rows, geom.cols, n_rt, n_ct)
    consts = {
        "PARTS": geom.parts,
        "BR": cfg.block_rows,
        "BK": cfg.block_cols,
        "ALIGNED": aligned,
        "WIDE": wide,
    }
    return [KernelCall(_mxfp8_kernel, programs, args, {**consts, **_options(cfg)})]


# --------------------------------------------------------------------------------------------------
# FP8 per-tensor: pass 1 (amax bits per expert chunk), pass 2 (shared scale, quantize)


@triton.jit
def _amax_kernel(
    x_ptr,
    part_ptr,
    flag_ptr,
    stride_e,
    stride_r,
    stride_k,
    total_rows,
    cols,
    rows_per_chunk,
    n_chunks,
    BR: tl.constexpr,
    BK: tl.constexpr,
    ROW_ITERS: tl.constexpr,
    COL_ITERS: tl.constexpr,
    WIDE: tl.constexpr,
):
    # Loop trip counts are constexprs, never tensors: a loop over tensor bounds is a runtime
    # scf.for when compiled, but Triton 3.6's interpreter turns its bounds into ints with
    # int(ndarray of shape (1,)), which NumPy >= 2.4 refuses. Rows past the chunk are masked.
    pid = tl.program_id(0)
    x_base = x_ptr + (pid // n_chunks).to(tl.int64) * stride_e
    r_start = (pid % n_chunks) * rows_per_chunk
    r_end = tl.minimum(r_start + rows_per_chunk, total_rows)
    acc = tl.zeros([BR, BK], dtype=tl.int32)
    for i in range(ROW_ITERS):
        r = r_start + i * BR + tl.arange(0, BR)
        if WIDE:
            r = r.to(tl.int64)
        for j in range(COL_ITERS):
            c = j * BK + tl.arange(0, BK)
            if WIDE:
                c = c.to(tl.int64)
            m = (r < r_end)[:, None] & (c < cols)[None, :]
            x = tl.load(x_base + r[:, None] * stride_r + c[None, :] * stride_k, mask=m, other=0.0)
            acc = tl.maximum(acc, _abs_bits(x.to(tl.float32)))
    amax_bits = tl.max(acc)
    tl.store(part_ptr + pid, amax_bits)
    if amax_bits >= _NON_FINITE:
        tl.atomic_min(flag_ptr, pid)


@triton.jit
def _per_tensor_kernel(
    x_ptr,
    q_tab,
    s_tab,
    part_ptr,
    stride_e,
    stride_r,
    stride_k,
    rows,
    cols,
    n_rt,
    n_ct,
    n_chunks,
    PARTS: tl.constexpr,
    BR: tl.constexpr,
    BK: tl.constexpr,
    CHUNKS: tl.constexpr,
    ALIGNED: tl.constexpr,
    WIDE: tl.constexpr,
):
    ep, rt, ct = _decode(tl.program_id(0), n_rt, n_ct)
    q_base, s_base = _bases(q_tab, s_tab, ep, tl.float32, ALIGNED)
    e = ep // PARTS
    k = tl.arange(0, CHUNKS)
    amax_bits = tl.max(tl.load(part_ptr + e * n_chunks + k, mask=k < n_chunks, other=0))
    scale = _scale_from_amax(amax_bits.to(tl.float32, bitcast=True))
    x_base = x_ptr + e.to(tl.int64) * stride_e + ((ep % PARTS) * rows).to(tl.int64) * stride_r
    r = rt * BR + tl.arange(0, BR)
    c = ct * BK + tl.arange(0, BK)
    if WIDE:
        r = r.to(tl.int64)
        c = c.to(tl.int64)
    m = (r < rows)[:, None] & (c < cols)[None, :]
    x = tl.load(x_base + r[:, None] * stride_r + c[None, :] * stride_k, mask=m, other=0.0).to(tl.float32)
    q = _cast_e4m3(x * tl.math.div_rn(1.0, scale))
    tl.store(q_base + r[:, None] * cols + c[None, :], q, mask=m)
    if (rt == 0) & (ct == 0):
        tl.store(s_base, scale)


def partials_size(geom: SlabGeometry, cfg: TileConfig) -> int:
    """int32 elements of the per-tensor scratch (partial amax bits) a launch of ``geom`` needs."""
    return geom.experts * geom.amax_chunks(cfg)[0]


def calls_fp8_per_tensor(
    slab, q_tab, s_tab, flag, geom: SlabGeometry, cfg: TileConfig, *, aligned, wide, partials
):
    """Pass 1 writes each expert's ``n_chunks`` partial amax bits into ``partials`` (int32, at
    least :func:`partials_size` elements: a scratch the caller keeps, so a launch allocates
    nothing); pass 2 reduces them to the expert's scale (gate and up share it: they are rows of
    one expert matrix) and quantizes."""
    n_chunks, rows_per_chunk = geom.amax_chunks(cfg)
    if geom.experts == 0 or geom.rows * geom.cols == 0:
        return []
    amax_args = (
        slab,
        partials,
        flag,
        *geom.strides,
        geom.parts * geom.rows,
        geom.cols,
        rows_per_chunk,
        n_chunks,
    )
    amax_consts = {
        "BR": cfg.block_rows,
        "BK": cfg.block_cols,
        "ROW_ITERS": -(-rows_per_chunk // cfg.block_rows),
        "COL_ITERS": -(-geom.cols // cfg.block_cols),
        "WIDE": wide,
    }
    n_rt, n_ct = geom.tiles(cfg.block_rows, cfg.block_cols)
    args = (slab, q_tab, s_tab, partials, *geom.strides, geom.rows, geom.cols, n_rt, n_ct, n_chunks)
    consts = {
        "PARTS": geom.parts,
        "BR": cfg.block_rows,
        "BK": cfg.block_cols,
        "CHUNKS": next_pow2(n_chunks),
        "ALIGNED": aligned,
        "WIDE": wide,
    }
    return [
        KernelCall(_amax_kernel, geom.experts * n_chunks, amax_args, {**amax_consts, **_options(cfg)}),
        KernelCall(
            _per_tensor_kernel,
            geom.programs(cfg.block_rows, cfg.block_cols),
            args,
            {**consts, **_options(cfg)},
        ),
    ]


# --------------------------------------------------------------------------------------------------
# launching and compiling


@dataclass(frozen=True, slots=True)
class KernelCall:
    """One kernel launch, not yet made: the kernel, its 1-D grid, arguments and keyword arguments."""

    kernel: Any
    programs: int
    args: tuple
    kwargs: dict[str, Any]


def _options(cfg: TileConfig) -> dict[str, Any]:
    # enable_fp_fusion=False: no mul+add contraction, ever; SPEC rounds each step
    return {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages, "enable_fp_fusion": False}


def launch(calls: list[KernelCall]) -> list:
    """Launch ``calls`` in order on the current device's current stream; the compiled kernels
    Triton returns (none under the interpreter). The caller enters the tensors' device first."""
    out = []
    for c in calls:
        k = c.kernel[(c.programs,)](*c.args, **c.kwargs)
        if k is not None:
            out.append(k)
    return out


def compile_only(calls: list[KernelCall]) -> list:
    """Compile ``calls`` for the current device without launching them (``JITFunction.warmup``):
    the specialisations a later launch with the same dtypes, alignments and integer arguments
    finds in Triton's cache."""
    return [c.kernel.warmup(*c.args, grid=(c.programs,), **c.kwargs) for c in calls]


#: format -> the function building its calls
CALLS = {"block_fp8": calls_block_fp8, "mxfp8": calls_mxfp8, "fp8_per_tensor": calls_fp8_per_tensor}
