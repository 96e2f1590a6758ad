"""The one table of quantizer edge cases that every implementation is checked against.

Each case names a format, builds its input, and, where the answer is known by hand, the exact bytes
expected (``q`` as uint8 codes for chosen positions, scales as float32 bit patterns or E8M0 bytes).
Cases without hand-written bytes are still compared byte for byte against tests/support/oracle.py (a scalar oracle of SPEC §1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from sidecar.numerics.formats import Format

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
E4M3_448, E4M3_M448 = 0x7E, 0xFE  # +-448, the largest finite e4m3fn
SCALE_ONE = 1.0


@dataclass(frozen=True)
class Case:
    id: str
    fmt: Format
    make: Callable[[], torch.Tensor]
    #: {index tuple: expected e4m3 byte} checked on top of the oracle comparison
    q_bytes: dict[tuple[int, ...], int] = field(default_factory=dict)
    #: expected scales: float32 values (block / per-tensor) or E8M0 bytes (mxfp8), flattened
    scales: tuple[float | int, ...] | None = None
    #: ValueError expected, and a fragment its message must contain
    error: str | None = None


def _full(shape, value, dtype=BF16):
    return lambda: torch.full(shape, value, dtype=dtype)


def _randn(*shape, dtype=BF16, seed=0, scale=1.0):
    def make():
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    return make


def _with(base, index, value):
    def make():
        t = base()
        t[index] = value
        return t

    return make


def _binade():
    # per-tensor scale is exactly 1 (amax 448): values land unscaled on RNE ties across binades
    return torch.tensor([448.0, 15.5, -15.5, -31.5, 0.5 * 2.0**-9, 0.75 * 2.0**-9, 240.0, 232.0], dtype=F32)


def _non_contiguous_block():
    return _randn(3, 200, 160, seed=4)().transpose(-1, -2)[:, ::1, 7:]


def _non_contiguous_mx():
    return _randn(96, 5, 4, seed=5)().permute(2, 1, 0)


CASES: list[Case] = [
    # ---- block-FP8
    Case("block/zero", Format.BLOCK_FP8, _full((128, 128), 0.0), {(0, 0): 0, (127, 127): 0}, (SCALE_ONE,)),
    Case(
        "block/zero-ragged-batched",
        Format.BLOCK_FP8,
        _full((2, 130, 259), 0.0),
        {(1, 129, 258): 0},
        (SCALE_ONE,) * 12,
    ),
    Case(
        "block/constant-one",
        Format.BLOCK_FP8,
        _full((128, 256), 1.0),
        {(0, 0): E4M3_448, (127, 255): E4M3_448},
        (float(torch.tensor(1.0) / torch.tensor(448.0)),) * 2,
    ),
    Case("block/constant-negative", Format.BLOCK_FP8, _full((64, 64), -2.0), {(5, 5): E4M3_M448}),
    # 1.0234375 / (1.0234375 / 448) rounds to 448.00003 in float32: the clamp must catch it
    Case("block/saturates-at-448", Format.BLOCK_FP8, _full((128, 128), 1.0234375), {(3, 3): E4M3_448}),
    Case(
        "block/tiny-amax-subnormal",
        Format.BLOCK_FP8,
        _full((4, 4), 1e-40, dtype=F32),
        {(0, 0): 0x04},  # 1e-40 * 2^126 = 0.0085 = 4.35 subnormal steps of 2^-9
        (2.0**-126,),
    ),
    Case("block/tiny-amax-bf16", Format.BLOCK_FP8, _randn(128, 128, scale=1e-38, seed=1)),
    Case("block/ragged", Format.BLOCK_FP8, _randn(300, 200, seed=2)),
    Case("block/batched-ragged", Format.BLOCK_FP8, _randn(3, 130, 257, seed=3)),
    Case("block/4d-batch", Format.BLOCK_FP8, _randn(2, 2, 129, 64, seed=6, dtype=F16)),
    Case("block/non-contiguous", Format.BLOCK_FP8, _non_contiguous_block),
    Case(
        "block/one-zero-tile",
        Format.BLOCK_FP8,
        _with(_randn(256, 256, seed=7), (slice(128, 256), slice(0, 128)), 0.0),
    ),
    Case("block/nan", Format.BLOCK_FP8, _with(_randn(256, 256), (200, 3), float("nan")), error="NaN or Inf"),
    Case(
        "block/inf", Format.BLOCK_FP8, _with(_randn(2, 64, 64), (1, 0, 0), float("inf")), error="NaN or Inf"
    ),
    Case("block/int-dtype", Format.BLOCK_FP8, lambda: torch.ones(128, 128, dtype=torch.int32), error="dtype"),
    Case(
        "block/fp8-input", Format.BLOCK_FP8, lambda: torch.zeros(8, 8).to(torch.float8_e4m3fn), error="dtype"
    ),
    Case("block/1d", Format.BLOCK_FP8, _randn(128), error="at least 2 dims"),
    # ---- MXFP8
    Case("mx/zero", Format.MXFP8, _full((2, 64), 0.0), {(0, 0): 0, (1, 63): 0}, (1, 1, 1, 1)),
    # amax 1: ceil(log2(1/448)) = -8 -> byte 119; q = 1 * 2^8 = 256 = e4m3 0x78
    Case("mx/constant-one", Format.MXFP8, _full((1, 32), 1.0), {(0, 0): 0x78}, (119,)),
    # amax 448: log2(1) = 0 exactly -> byte 127, values unscaled
    Case("mx/exact-power", Format.MXFP8, _full((1, 32), 448.0), {(0, 5): E4M3_448}, (127,)),
    # amax 449: quotient just above 1 -> rounds up to byte 128, q = 224.5 -> 224 (0x76)
    Case("mx/ceil-not-nearest", Format.MXFP8, _full((1, 32), 449.0, dtype=F32), {(0, 0): 0x76}, (128,)),
    Case("mx/tiny-amax", Format.MXFP8, _full((1, 32), 1e-40, dtype=F32), scales=(1,)),
    Case("mx/huge-amax", Format.MXFP8, _full((1, 32), 3.0e38, dtype=F32), scales=(247,)),
    Case("mx/random", Format.MXFP8, _randn(64, 256, seed=8)),
    Case("mx/batched", Format.MXFP8, _randn(2, 3, 5, 96, seed=9, dtype=F16)),
    Case("mx/non-contiguous", Format.MXFP8, _non_contiguous_mx),
    Case("mx/ragged-k", Format.MXFP8, _randn(4, 100), error="multiple of 32"),
    Case("mx/nan", Format.MXFP8, _with(_randn(4, 64), (2, 40), float("nan")), error="NaN or Inf"),
    Case("mx/neg-inf", Format.MXFP8, _with(_randn(4, 64), (0, 0), float("-inf")), error="NaN or Inf"),
    # ---- per-tensor
    Case("tensor/zero", Format.FP8_PER_TENSOR, _full((3, 5), 0.0), {(2, 4): 0}, (SCALE_ONE,)),
    Case(
        "tensor/binade-ties",
        Format.FP8_PER_TENSOR,
        _binade,
        # 15.5 ties between 15 (odd mantissa) and 16 -> 16 (0x58); -31.5 -> -32 (0xE0);
        # half the smallest subnormal ties to 0; 0.75 of it rounds up to 2^-9 (0x01);
        # 240 is exact (0x77); 232 ties between 224 (0x76) and 240 (0x77) -> even 0x76
        {(1,): 0x58, (2,): 0xD8, (3,): 0xE0, (4,): 0x00, (5,): 0x01, (6,): 0x77, (7,): 0x76},
        (SCALE_ONE,),
    ),
    Case("tensor/random", Format.FP8_PER_TENSOR, _randn(3, 77, 33, seed=10)),
    Case("tensor/tiny", Format.FP8_PER_TENSOR, _full((7,), 1e-42, dtype=F32), scales=(2.0**-126,)),
    Case("tensor/non-contiguous", Format.FP8_PER_TENSOR, lambda: _randn(40, 30, seed=11)().t()),
    # rows of a batch that cannot be flattened into one matrix (a slab's up halves): each input row
    # must land in its own output row
    Case(
        "tensor/non-contiguous-batched", Format.FP8_PER_TENSOR, lambda: _randn(3, 40, 64, seed=12)()[:, 8:32]
    ),
    Case(
        "tensor/nan", Format.FP8_PER_TENSOR, _with(_randn(10, 10), (9, 9), float("nan")), error="NaN or Inf"
    ),
    Case("tensor/int-dtype", Format.FP8_PER_TENSOR, lambda: torch.ones(3, dtype=torch.int64), error="dtype"),
]
