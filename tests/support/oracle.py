"""A scalar, loop-by-loop oracle of docs/spec.md §1, independent of sidecar.numerics.reference.

Everything is float32 numpy scalar arithmetic (IEEE round-to-nearest) and an explicit e4m3fn rounding
table, so it shares no code, and no vectorised torch behaviour, with the implementations it checks.
Slow on purpose: use it on small tensors.
"""

from __future__ import annotations

import math

import numpy as np
import torch

F32 = np.float32
FP8_MAX = F32(448.0)
FLT_MIN = F32(2.0**-126)


def _e4m3_value(code: int) -> float:
    exp, man = (code >> 3) & 0xF, code & 0x7
    if exp == 0:
        return man / 8 * 2.0**-6
    return (1 + man / 8) * 2.0 ** (exp - 7)


#: (value, code) for the 127 non-negative finite e4m3fn codes (0x7F is NaN)
_E4M3 = [(_e4m3_value(c), c) for c in range(0x7F)]


def rne_e4m3(v: float) -> int:
    """Byte of the round-to-nearest-even e4m3fn cast of a float32 already clamped to [-448, 448]."""
    if math.isnan(v) or abs(v) > 448:
        raise ValueError(f"oracle: {v} is not clamped")
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    a = abs(v)
    best = min(_E4M3, key=lambda vc: (abs(vc[0] - a), vc[1] & 1))
    return sign | best[1]


def _q(x: np.float32, mult: np.float32) -> int:
    return rne_e4m3(float(np.clip(F32(x * mult), -FP8_MAX, FP8_MAX)))


def block_fp8(w: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(q bytes uint8 [..., N, K], scale_inv float32 [..., ceil(N/128), ceil(K/128)])."""
    x = w.detach().cpu().float().numpy()
    *lead, n, k = x.shape
    nb, kb = -(-n // 128), -(-k // 128)
    q = np.zeros(x.shape, dtype=np.uint8)
    s = np.zeros((*lead, nb, kb), dtype=np.float32)
    for idx in np.ndindex(*lead):
        for bi in range(nb):
            for bj in range(kb):
                blk = x[idx][bi * 128 : (bi + 1) * 128, bj * 128 : (bj + 1) * 128]
                amax = F32(np.max(np.abs(blk))) if blk.size else F32(0)
                scale_inv = F32(1.0) if amax == 0 else max(F32(amax / FP8_MAX), FLT_MIN)
                s[idx][bi, bj] = scale_inv
                mult = F32(F32(1.0) / scale_inv)
                for (i, j), v in np.ndenumerate(blk):
                    q[idx][bi * 128 + i, bj * 128 + j] = _q(F32(v), mult)
    return q, s


def _ceil_log2(v: np.float32) -> int:
    """ceil(log2(v)) of a positive float32, exactly (frexp is exact on floats)."""
    m, e = math.frexp(float(v))  # v = m * 2^e with m in [0.5, 1)
    return e - 1 if m == 0.5 else e


def mxfp8(w: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(q bytes uint8 [..., K], scale uint8 [..., K/32])."""
    x = w.detach().cpu().float().numpy()
    *lead, k = x.shape
    q = np.zeros(x.shape, dtype=np.uint8)
    s = np.zeros((*lead, k // 32), dtype=np.uint8)
    for idx in np.ndindex(*lead):
        for b in range(k // 32):
            blk = x[idx][b * 32 : (b + 1) * 32]
            amax = F32(np.max(np.abs(blk)))
            byte = 1 if amax == 0 else min(max(_ceil_log2(F32(amax / FP8_MAX)) + 127, 1), 254)
            s[idx][b] = byte
            mult = F32(2.0 ** (127 - byte))
            for j, v in enumerate(blk):
                q[idx][b * 32 + j] = _q(F32(v), mult)
    return q, s


def fp8_per_tensor(*ws: torch.Tensor) -> tuple[list[np.ndarray], np.float32]:
    """(q bytes of each tensor, the one float32 scale shared by all of them)."""
    xs = [w.detach().cpu().float().numpy() for w in ws]
    amax = F32(max(float(np.max(np.abs(x))) if x.size else 0.0 for x in xs))
    scale = F32(1.0) if amax == 0 else max(F32(amax / FP8_MAX), FLT_MIN)
    mult = F32(F32(1.0) / scale)
    qs = []
    for x in xs:
        q = np.zeros(x.shape, dtype=np.uint8)
        for i, v in np.ndenumerate(x):
            q[i] = _q(F32(v), mult)
        qs.append(q)
    return qs, scale


# --------------------------------------------------------------------------------------------------
# 4-bit formats (SPEC §1.5-1.7), element by element from SPEC's text

#: the E2M1 magnitudes of codes 0-7
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def rne_e2m1(v: float) -> int:
    """SPEC's RNE_e2m1: the nearest E2M1 magnitude (ties to the even code), saturating at 6; bit 3
    set iff ``v < 0``. NaN (only ``0 / 0`` where a scale underflowed to zero) is code 0, the code of
    the zero it came from (refitd's reading where SPEC is silent)."""
    if math.isnan(v):
        return 0
    sign = 8 if v < 0 else 0
    a = abs(v)
    if a >= 6.0:
        return sign | 7
    best = min(range(8), key=lambda c: (abs(E2M1[c] - a), c & 1))
    return sign | best


def e4m3_value(code: int) -> float:
    """The value of an e4m3fn byte (finite codes)."""
    v = _e4m3_value(code & 0x7F)
    return -v if code & 0x80 else v


def _pack_pairs(codes: list[int]) -> list[int]:
    return [codes[2 * i] | (codes[2 * i + 1] << 4) for i in range(len(codes) // 2)]


def _amax(x: np.ndarray) -> np.float32:
    return F32(np.max(np.abs(x))) if x.size else F32(0)


def nvfp4_global_scale(*ws: torch.Tensor) -> np.float32:
    """gs = amax / 2688 over ``ws`` (1.0 if all zero)."""
    amax = max((_amax(w.detach().cpu().float().numpy()) for w in ws), default=F32(0))
    return F32(1.0) if amax == 0 else F32(F32(amax) / F32(2688.0))


def nvfp4(w: torch.Tensor, gs: np.float32 | None = None) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """(q bytes uint8 [..., N, K/2], s e4m3 bytes uint8 [..., N, K/16], gs float32)."""
    x = w.detach().cpu().float().numpy()
    gs = nvfp4_global_scale(w) if gs is None else F32(gs)
    *lead, k = x.shape
    q = np.zeros((*lead, k // 2), dtype=np.uint8)
    s = np.zeros((*lead, k // 16), dtype=np.uint8)
    with np.errstate(all="ignore"):
        six_gs = F32(F32(6.0) * gs)
        for idx in np.ndindex(*lead):
            row = x[idx]
            codes = []
            for b in range(k // 16):
                blk = row[b * 16 : (b + 1) * 16]
                amax = _amax(blk)
                v = F32(1.0) if amax == 0 else F32(amax / six_gs)
                byte = rne_e4m3(float(min(max(v, F32(2.0**-9)), FP8_MAX)))
                s[idx][b] = byte
                denom = F32(F32(e4m3_value(byte)) * gs)
                codes += [rne_e2m1(float(F32(F32(e) / denom))) for e in blk]
            q[idx][:] = _pack_pairs(codes)
    return q, s, gs


def mxfp4(w: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(q bytes uint8 [..., K/2], scale uint8 [..., K/32])."""
    x = w.detach().cpu().float().numpy()
    *lead, k = x.shape
    q = np.zeros((*lead, k // 2), dtype=np.uint8)
    s = np.zeros((*lead, k // 32), dtype=np.uint8)
    for idx in np.ndindex(*lead):
        row = x[idx]
        codes = []
        for b in range(k // 32):
            blk = row[b * 32 : (b + 1) * 32]
            amax = _amax(blk)
            if amax == 0:
                byte = 1
            else:
                m, e = math.frexp(float(amax))  # amax = (2m) * 2^(e-1), 2m in [1, 2)
                exponent = (e - 1) + (1 if 2 * m >= 1.75 else 0) - 2
                byte = min(max(exponent + 127, 1), 254)
            s[idx][b] = byte
            mult = F32(2.0 ** (127 - byte))
            codes += [rne_e2m1(float(F32(F32(e) * mult))) for e in blk]
        q[idx][:] = _pack_pairs(codes)
    return q, s


def _round_to_bf16(v: np.float32) -> np.float32:
    """float32 -> bfloat16 (round to nearest even on the bits; finite values), as float32."""
    bits = int(np.array(v, dtype=np.float32).view(np.uint32))
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return np.array(bits, dtype=np.uint32).view(np.float32)[()]


def int4(
    w: torch.Tensor, group: int = 32, scale_dtype: torch.dtype = torch.bfloat16
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(packed int32 [..., N, K/8], scale as float32 values [..., N, K/g], shape int64 [2])."""
    x = w.detach().cpu().float().numpy()
    *lead, k = x.shape
    packed = np.zeros((*lead, k // 8), dtype=np.int32)
    s = np.zeros((*lead, k // group), dtype=np.float32)
    with np.errstate(all="ignore"):
        for idx in np.ndindex(*lead):
            row = x[idx]
            qs = []
            for g in range(k // group):
                blk = row[g * group : (g + 1) * group]
                amax = _amax(blk)
                scale = F32(1.0) if amax == 0 else F32(amax / F32(7.0))
                if scale_dtype == torch.bfloat16:
                    scale = _round_to_bf16(scale)
                s[idx][g] = scale
                for e in blk:
                    v = float(F32(F32(e) / scale))
                    # clamp then round (the same as round then clamp: the bounds are integers; and
                    # round() of an Inf would raise); Python's round() is half to even
                    qs.append(0 if math.isnan(v) else round(max(-7.0, min(7.0, v))))
            for j in range(k // 8):
                word = 0
                for i in range(8):
                    word |= (qs[8 * j + i] + 8) << (4 * i)
                packed[idx][j] = word - (1 << 32) if word >= 1 << 31 else word
    return packed, s, np.array(x.shape[-2:], dtype=np.int64)
