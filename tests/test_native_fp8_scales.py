"""The native FP8 kernels' per-scale shortcuts (sidecar/numerics/native/fp8_vec.h) against the torch
reference, byte for byte, over many scales: every finite bfloat16 value under hundreds of multipliers
spread over the whole float32 range (each scale builds its own code table and thresholds, or falls back to
the float path where a multiplier is past 2^119 or subnormal), block-FP8 tiles and MXFP8 blocks whose
amaxes walk every binade (every E8M0 byte, including those under the 16-bit path's floor), with lanes that
round to e4m3 subnormals scattered through otherwise normal vectors (the float path taken per vector)."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from sidecar.numerics import cpu, native
from sidecar.numerics import reference as ref
from sidecar.numerics.formats import FP8_DTYPE

pytestmark = pytest.mark.skipif(
    shutil.which(native.compiler()[0]) is None, reason="no C compiler: the native quantizers cannot be built"
)


def _same(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...], what: str) -> None:
    for g, w in zip(got, want, strict=True):
        gb = g.view(torch.uint8) if g.dtype == FP8_DTYPE else g.reshape(-1).contiguous().view(torch.uint8)
        wb = w.view(torch.uint8) if w.dtype == FP8_DTYPE else w.reshape(-1).contiguous().view(torch.uint8)
        if not torch.equal(gb, wb):
            at = torch.nonzero(gb != wb)[0].tolist()
            raise AssertionError(f"{what}: bytes differ first at {at}: {gb[tuple(at)]} != {wb[tuple(at)]}")


def _finite_bf16() -> torch.Tensor:
    bits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16)
    return bits[(bits.to(torch.int32) & 0x7FFF) < 0x7F80].view(torch.bfloat16)


def _scales(count: int, seed: int) -> list[float]:
    """Scales log-uniform over float32's normal range, with the edges the kernels branch on: the
    multiplier past 2^119 (a subnormal input reaches e4m3's normal range), subnormal (scale past 2^126),
    powers of two and 448ths."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.exp2(torch.rand(count, generator=g, dtype=torch.float64) * 253.0 - 126.0)
    edges = [2.0**-126, 2.0**-120, 2.0**-119.5, 2.0**-119, 1.5 * 2.0**-119, 2.0**-118, 2.0**126, 2.0**127]
    edges += [3.0e38, 1.0, 1.0 / 448.0, 0.02 / 448.0, 448.0, 2.0**-10]
    return edges + [float(torch.tensor(s, dtype=torch.float32)) for s in spread.tolist()]


def test_per_tensor_every_bf16_under_many_shared_scales():
    """Every finite bf16 value (rows of 120, strided: each row ends in a masked tail) quantized with a
    caller's shared scale (the clamped path), then with its own amax (unclamped), under 300 scales."""
    x = _finite_bf16().reshape(-1, 120)
    w = torch.zeros(x.shape[0], 200, dtype=torch.bfloat16)[:, 40:160]
    w.copy_(x)
    for scale in _scales(300, seed=3):
        s = torch.tensor(scale, dtype=torch.float32)
        _same(
            cpu.quantize_fp8_per_tensor(w, scale=s),
            ref.quantize_fp8_per_tensor(w, scale=s),
            f"scale {scale!r}",
        )
    g = torch.Generator().manual_seed(4)
    for amax in _scales(60, seed=5):
        if not math.isfinite(amax * 448.0) or amax * 448.0 > 3.0e38:
            continue
        v = (torch.randn(64, 96, generator=g) * amax).bfloat16()
        v[0, 0] = torch.tensor(amax * 448.0).bfloat16()
        _same(cpu.quantize_fp8_per_tensor(v), ref.quantize_fp8_per_tensor(v), f"amax {amax * 448.0!r}")


@pytest.mark.parametrize("layout", ["full", "ragged"])
def test_block_fp8_tiles_across_binades(layout: str):
    """Tiles of random values each scaled to its own amax (every other binade from 2^-133 to 2^127), a
    few per tile set to the tile's tiny values (subnormal results inside normal vectors), ties at 448;
    a ragged shape ends in partial tiles and partial vectors."""
    g = torch.Generator().manual_seed(7)
    n, k = (1024, 2048) if layout == "full" else (1000, 1100)
    tiles_n, tiles_k = -(-n // 128), -(-k // 128)
    exps = torch.arange(tiles_n * tiles_k) * 2 % 260 - 133
    factor = torch.exp2(exps.to(torch.float64)).reshape(tiles_n, 1, tiles_k, 1)
    base = torch.randn(tiles_n, 128, tiles_k, 128, generator=g, dtype=torch.float64)
    tiny = torch.rand(base.shape, generator=g) < 0.002
    base = torch.where(tiny, base * 2.0**-17, base)
    w = (base * factor).clamp(-3.0e38, 3.0e38).reshape(tiles_n * 128, tiles_k * 128)[:n, :k]
    w = w.to(torch.float32).bfloat16().contiguous()
    _same(cpu.quantize_block_fp8(w), ref.quantize_block_fp8(w), "block-FP8")


def test_mxfp8_every_scale_byte():
    """Blocks of 32 whose amax takes every E8M0 byte (1..254: under the 16-bit path's floor, byte 11,
    the float path per piece), each with lanes far below the amax (subnormal results in a normal
    vector), plus pieces mixing a tiny block with normal ones."""
    g = torch.Generator().manual_seed(9)
    exps = torch.arange(-140, 128, dtype=torch.float64)
    blocks = torch.randn(exps.numel() * 4, 32, generator=g, dtype=torch.float64)
    blocks *= torch.exp2(exps.repeat(4)).unsqueeze(1)
    blocks[:, 5] *= 2.0**-14
    blocks[:, 17] *= 2.0**-16
    w = blocks.clamp(-3.0e38, 3.0e38).to(torch.float32).bfloat16().reshape(-1, 32 * 8)
    perm = torch.randperm(w.shape[0] * 8, generator=g)
    shuffled = w.reshape(-1, 32)[perm].reshape(-1, 32 * 8).contiguous()
    for what, t in (("ordered", w.contiguous()), ("shuffled", shuffled)):
        _same(cpu.quantize_mxfp8(t), ref.quantize_mxfp8(t), f"MXFP8 {what}")


@pytest.mark.parametrize("shuffled", [False, True], ids=["ordered", "shuffled"])
@pytest.mark.parametrize("byte", [1, 7, 10, 11, 12, 30, 100, 126, 127, 128, 135, 200, 246, 247])
def test_mxfp8_every_bf16_under_one_scale_byte(byte: int, shuffled: bool):
    """Every finite bf16 magnitude, both signs, 31 to a block beside an amax that sets the block's E8M0
    byte to ``byte``: each lane's code under that one multiplier, at every threshold (2^-10, 2^-6), in
    order and shuffled (a lane at a threshold in a block of lanes all on one side of it)."""
    amax = torch.tensor(448.0 * 2.0 ** (byte - 127) if byte < 247 else 3.3e38, dtype=torch.float32).bfloat16()
    x = _finite_bf16()
    x = x[(x.float().abs() <= amax.float())]
    if shuffled:
        x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(byte))]
    pad = (-x.numel()) % (31 * 4)
    x = torch.cat([x, torch.zeros(pad, dtype=torch.bfloat16)]).reshape(-1, 31)
    w = torch.cat([amax.expand(x.shape[0], 1), x], dim=1).reshape(-1, 32 * 4).contiguous()
    got, want = cpu.quantize_mxfp8(w), ref.quantize_mxfp8(w)
    assert int(want[1].min()) == int(want[1].max()) == max(byte, 1)
    _same(got, want, f"MXFP8 byte {byte}")


def test_native_against_the_scalar_oracle():
    """The native kernels against SPEC's scalar oracle (tests/support/oracle.py) directly, not only
    through the reference: random tensors at three magnitudes (one tile / a few blocks each; the oracle
    is a Python loop), with values at 448-ties, subnormal results and a -0."""
    from support import oracle

    g = torch.Generator().manual_seed(11)
    for magnitude in (0.02, 3.0e-38, 1.0e30):
        w = torch.randn(128, 160, generator=g) * magnitude
        w[0, :4] = torch.tensor([448.0, -464.0, 2.0**-9, -0.0]) * magnitude
        w[1, :8] *= 2.0**-16
        w = w.bfloat16()
        q, s = cpu.quantize_block_fp8(w)
        oq, os_ = oracle.block_fp8(w)
        assert (q.view(torch.uint8).numpy() == oq).all() and (s.numpy() == os_).all(), magnitude
        q, s = cpu.quantize_mxfp8(w)
        oq, os_ = oracle.mxfp8(w)
        assert (q.view(torch.uint8).numpy() == oq).all() and (s.numpy() == os_).all(), magnitude
        q, s = cpu.quantize_fp8_per_tensor(w)
        (oq,), os_ = oracle.fp8_per_tensor(w)
        assert (q.view(torch.uint8).numpy() == oq).all() and float(s) == float(os_), magnitude
