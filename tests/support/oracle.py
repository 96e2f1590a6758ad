"""A scalar, loop-by-loop oracle of ../shared/SPEC.md §1, independent of sidecar.numerics.reference.

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
