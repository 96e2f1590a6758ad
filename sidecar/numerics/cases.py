"""The one table of quantizer edge cases that every implementation is checked against.

Each case names a format, builds its input, and, where the answer is known by hand, the exact bytes
expected (``q`` as uint8 codes for chosen positions, scales as float32 bit patterns or E8M0 bytes).
``CASES`` are the FP8 formats'; ``FOUR_BIT_CASES`` the 4-bit ones, where ``q_bytes`` index the packed
values (bytes of two E2M1 codes, or int32 words of eight int4 nibbles) and ``scales`` are float32
values (NVFP4's e4m3 scales and int4's scales as floats, MXFP4's as E8M0 bytes).
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
    #: NVFP4: the expected global scale (float32 value)
    global_scale: float | None = None


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


# --------------------------------------------------------------------------------------------------
# 4-bit formats (SPEC §1.5-1.7)


def _nvfp4_ties():
    """gs = 2688 / 2688 = 1 (block 0 holds 2688: s = 448, it becomes code 7) and block 1's amax is 6
    (s = 1): block 1's values reach RNE_e2m1 unscaled, on every tie."""
    ties = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, 0.3, -5.0, 4.9, 5.1, -0.0, 0.5]
    return torch.tensor([[2688.0] + [0.0] * 15 + ties], dtype=F32)


def _nvfp4_saturates():
    """gs = 1; block 1's amax 6.3 gives s = RNE_e4m3(1.05) = 1.0, so 6.3 saturates at 6 (code 7)."""
    return torch.tensor([[2688.0] + [0.0] * 15 + [6.3, -6.3] + [1.0] * 14], dtype=F32)


def _nvfp4_scale_floor():
    """gs = 1; block 1's amax 1e-4 / 6 is below 2^-9: s is clamped to 2^-9 (e4m3 byte 0x01)."""
    return torch.tensor([[2688.0] + [0.0] * 15 + [1e-4] * 16], dtype=F32)


def _int4_ties():
    """amax 7: s = 1 exactly, values reach RNE unscaled: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -2.5 -> -2."""
    row = [7.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.49] + [0.0] * 24
    return torch.tensor([row], dtype=F32)


def _word(nibbles):
    """int32 value of eight nibbles (element i at bits 4i..4i+3)."""
    w = sum(n << (4 * i) for i, n in enumerate(nibbles))
    return w - (1 << 32) if w >= 1 << 31 else w


def _nvfp4_non_contiguous():
    return _randn(3, 48, 40, seed=21)().transpose(-1, -2)[:, 8:40:2]


def _mx4_non_contiguous():
    return _randn(64, 5, 4, seed=22)().permute(2, 1, 0)


def _int4_non_contiguous():
    return _randn(2, 70, 64, seed=23)()[:, 3:67]


def _tiny_bf16():
    # the smallest bf16 subnormal: amax / 7 rounds to a bf16 scale of 0 (x / 0 -> +-7; 0 / 0 -> 0)
    t = torch.zeros(2, 32, dtype=BF16)
    t[0, 3] = float.fromhex("0x1p-133")
    t[1, 7] = -float.fromhex("0x1p-133")
    return t


NVFP4, MXFP4, INT4 = Format.NVFP4, Format.MXFP4, Format.INT4_W4A16

FOUR_BIT_CASES: list[Case] = [
    # ---- NVFP4
    Case("nvfp4/zero", NVFP4, _full((2, 32), 0.0), {(0, 0): 0, (1, 15): 0}, (1.0,) * 4, global_scale=1.0),
    Case(
        "nvfp4/negative-zero", NVFP4, _full((1, 16), -0.0), {(0, 0): 0, (0, 7): 0}, (1.0,), global_scale=1.0
    ),
    Case(
        "nvfp4/e2m1-ties",
        NVFP4,
        _nvfp4_ties,
        # codes 7,0 | 2,2 | 4,4 | 6,6 | 8,10 (-0.25 keeps its sign) | 1,14 | 6,7 | 0 (-0.0),1
        {
            (0, 0): 0x07,
            (0, 8): 0x07,
            (0, 9): 0x22,
            (0, 10): 0x44,
            (0, 11): 0x66,
            (0, 12): 0xA8,
            (0, 13): 0xE1,
            (0, 14): 0x76,
            (0, 15): 0x10,
        },
        (448.0, 1.0),
        global_scale=1.0,
    ),
    Case("nvfp4/saturates-at-6", NVFP4, _nvfp4_saturates, {(0, 8): 0xF7}, (448.0, 1.0), global_scale=1.0),
    Case("nvfp4/scale-floor", NVFP4, _nvfp4_scale_floor, {(0, 8): 0}, (448.0, 2.0**-9), global_scale=1.0),
    Case("nvfp4/subnormal-f32", NVFP4, _full((2, 32), 1e-40, dtype=F32)),
    Case("nvfp4/tiny-bf16", NVFP4, _randn(4, 64, scale=1e-38, seed=24)),
    Case("nvfp4/random", NVFP4, _randn(33, 128, seed=25)),
    Case("nvfp4/batched", NVFP4, _randn(2, 3, 5, 48, seed=26, dtype=F16)),
    Case("nvfp4/non-contiguous", NVFP4, _nvfp4_non_contiguous),
    Case("nvfp4/ragged-k", NVFP4, _randn(4, 40), error="multiple of 16"),
    Case("nvfp4/1d", NVFP4, _randn(32), error="at least 2 dims"),
    Case("nvfp4/nan", NVFP4, _with(_randn(4, 64), (2, 40), float("nan")), error="NaN or Inf"),
    Case("nvfp4/inf", NVFP4, _with(_randn(2, 4, 32), (1, 0, 0), float("-inf")), error="NaN or Inf"),
    Case("nvfp4/fp8-input", NVFP4, lambda: torch.zeros(4, 16).to(torch.float8_e4m3fn), error="dtype"),
    # ---- MXFP4
    Case("mxfp4/zero", MXFP4, _full((2, 64), 0.0), {(0, 0): 0, (1, 31): 0}, (1, 1, 1, 1)),
    Case("mxfp4/negative-zero", MXFP4, _full((1, 32), -0.0), {(0, 0): 0}, (1,)),
    # significand 1.75: the exponent is bumped: byte 126, 1.75 * 2 = 3.5 ties to 4 (code 6)
    Case("mxfp4/bump-1.75", MXFP4, _full((1, 32), 1.75), {(0, 0): 0x66}, (126,)),
    # significand 1.5: no bump: byte 125, 1.5 * 4 = 6 (code 7)
    Case("mxfp4/no-bump-1.5", MXFP4, _full((1, 32), 1.5), {(0, 0): 0x77}, (125,)),
    # significand 1.7: byte 125, 6.8 saturates at 6
    Case("mxfp4/saturates-at-6", MXFP4, _full((1, 32), -1.7, dtype=F32), {(0, 0): 0xFF}, (125,)),
    Case("mxfp4/tiny", MXFP4, _full((1, 32), 1e-40, dtype=F32), scales=(1,)),
    # 3e38 = 1.76 * 2^127: byte 254 + 1 - 2
    Case("mxfp4/huge", MXFP4, _full((1, 32), 3.0e38, dtype=F32), scales=(253,)),
    Case("mxfp4/random", MXFP4, _randn(64, 256, seed=27)),
    Case("mxfp4/1d", MXFP4, _randn(96, seed=28)),
    Case("mxfp4/batched", MXFP4, _randn(2, 3, 5, 96, seed=29, dtype=F16)),
    Case("mxfp4/non-contiguous", MXFP4, _mx4_non_contiguous),
    Case("mxfp4/ragged-k", MXFP4, _randn(4, 48), error="multiple of 32"),
    Case("mxfp4/nan", MXFP4, _with(_randn(4, 64), (3, 63), float("nan")), error="NaN or Inf"),
    # ---- INT4 weight-only (group 32, bfloat16 scales)
    Case(
        "int4/zero", INT4, _full((2, 64), 0.0), {(0, 0): _word([8] * 8), (1, 7): _word([8] * 8)}, (1.0,) * 4
    ),
    Case("int4/negative-zero", INT4, _full((1, 32), -0.0), {(0, 0): _word([8] * 8)}, (1.0,)),
    Case("int4/ties", INT4, _int4_ties, {(0, 0): _word([15, 8, 10, 10, 8, 6, 6, 11])}, (1.0,)),
    Case("int4/scale-underflows", INT4, _tiny_bf16, {(0, 0): _word([8, 8, 8, 15, 8, 8, 8, 8])}),
    Case("int4/subnormal-f32", INT4, _full((2, 32), 1e-40, dtype=F32)),
    Case("int4/random", INT4, _randn(33, 128, seed=30)),
    Case("int4/batched", INT4, _randn(2, 3, 5, 64, seed=31, dtype=F16)),
    Case("int4/non-contiguous", INT4, _int4_non_contiguous),
    Case("int4/ragged-k", INT4, _randn(4, 40), error="multiple of 32"),
    Case("int4/1d", INT4, _randn(32), error="at least 2 dims"),
    Case("int4/nan", INT4, _with(_randn(2, 4, 64), (1, 3, 63), float("inf")), error="NaN or Inf"),
    Case("int4/int-dtype", INT4, lambda: torch.ones(4, 32, dtype=torch.int32), error="dtype"),
]
