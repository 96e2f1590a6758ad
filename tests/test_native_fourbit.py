"""The native 4-bit kernels' rounding (sidecar/numerics/native/fourbit.c) against the torch reference
(sidecar/numerics/fourbit.py), where it is most likely to go wrong.

fourbit.c never divides (or multiplies) per element: for each scale it finds, with the reference's own
float32 operation, the smallest bf16 magnitude passing each rounding test, and counts thresholds. So every
scale a kernel can meet is exercised here: every finite bf16 magnitude as a block's (or group's) amax, with
smaller values and both signs beside it; exact ties of INT4's rounding; each group size's loop (the
per-element division path for groups it does not take); rows whose pieces end in a partial run; and INT4's
process-wide threshold table filled from cold by two threads at once, in a fresh process."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest
import torch

from sidecar.numerics import cpu, cpu_fourbit, fourbit, native
from sidecar.numerics.formats import FP8_DTYPE
from tests.support.native_builds import LEVELS, build_for

FINITE = 0x7F80  # sign-cleared bf16 bits below this are finite


@pytest.fixture(autouse=True)
def _native_only():
    if native.load() is None:
        pytest.skip(f"native quantizers unavailable: {native.unavailable_reason()}")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def _same(got, want) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        a, b = (t.view(torch.uint8) if t.dtype == FP8_DTYPE else t for t in (a, b))
        mismatch = (a != b).nonzero()
        assert mismatch.numel() == 0, f"{len(mismatch)} elements differ, first at {mismatch[0].tolist()}"


def _every_magnitude(width: int, seed: int) -> torch.Tensor:
    """[FINITE, width] bf16 rows, row i's amax being bf16 magnitude i (permuted), the others random below it
    (five within 300 ulps of it), random signs."""
    g = torch.Generator().manual_seed(seed)
    amax = torch.randperm(FINITE, generator=g, dtype=torch.int32)
    others = (torch.rand(FINITE, width - 1, generator=g) * (amax[:, None].float() + 1)).to(torch.int32)
    others = others.clamp(max=amax[:, None])
    others[:, :5] = (amax[:, None] - torch.randint(0, 300, (FINITE, 5), generator=g)).clamp(min=0)
    bits = torch.cat([amax[:, None], others], 1)
    bits = bits[:, torch.randperm(width, generator=g)]
    bits |= torch.randint(0, 2, bits.shape, generator=g, dtype=torch.int32) << 15
    return bits.to(torch.int16).view(torch.bfloat16)


def test_mxfp4_every_bf16_magnitude():
    """Every E8M0 scale byte a bf16 block can get (1 .. 254), products down to subnormal and 0."""
    w = _every_magnitude(32, seed=1).reshape(-1, 256)
    _same(cpu.quantize_mxfp4(w), fourbit.quantize_mxfp4(w))


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("group", [16, 32, 128, 48, 2048, 8, 24])
def test_int4_every_bf16_magnitude(group, scale_dtype):
    """Every group amax, so every scale (bf16-rounded ones down to 0); groups 8 and 24 take the
    per-element division paths, the others the threshold path (48 and 2048 a group a pass, the others
    a piece of groups)."""
    w = _every_magnitude(group, seed=group)
    if group >= 128:
        w = w[:: group // 32]  # a sample of the magnitudes keeps the reference quick
    w = w[: w.shape[0] // 8 * 8].reshape(-1, group * 8)
    got = cpu.quantize_int4(w, group=group, scale_dtype=scale_dtype)
    _same(got, fourbit.quantize_int4(w, group=group, scale_dtype=scale_dtype))


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_int4_exact_ties(scale_dtype):
    """x / s exactly j + 0.5 (RNE takes the even neighbour, and the threshold path must agree), and one bf16
    step either side of it."""
    g = torch.Generator().manual_seed(7)
    amax = (torch.rand(4096, generator=g) * 8 + 0.1) * 2.0 ** torch.randint(-30, 30, (4096,), generator=g)
    amax = amax.bfloat16().float()
    s = amax / 7 if scale_dtype == torch.float32 else (amax / 7).bfloat16().float()
    halves = torch.arange(7, dtype=torch.float32) + 0.5
    ties = s[:, None] * halves  # exact in float32 for bf16 scales; for float32 ones only where representable
    rows = []
    for t in (ties, ties.bfloat16().float()):
        bits = t.bfloat16().view(torch.int16)
        rows += [bits, bits + 1, bits - 1]
    body = torch.cat(rows, 1)[:, :31].view(torch.bfloat16)
    body = torch.where(torch.rand(body.shape, generator=g) < 0.5, body, -body)
    w = torch.cat([amax.bfloat16()[:, None], body], 1)  # one group of 32 a row, its amax first
    w = torch.where(w.abs() > amax.bfloat16()[:, None], torch.zeros_like(w), w)  # keep amax the largest
    exact = (w.float() / s[:, None]) - (w.float() / s[:, None]).floor() == 0.5
    assert exact.sum() > 1000  # the test holds many true ties
    got = cpu.quantize_int4(w, group=32, scale_dtype=scale_dtype)
    _same(got, fourbit.quantize_int4(w, group=32, scale_dtype=scale_dtype))


@pytest.mark.parametrize("k", [16, 48, 272, 1040, 2064])
def test_rows_ending_in_partial_pieces(k):
    """Rows of fewer than eight blocks, and rows whose last piece is shorter than the others."""
    g = torch.Generator().manual_seed(k)
    w = (torch.randn(37, k, generator=g) * 10.0 ** torch.randint(-8, 8, (37, 1), generator=g)).bfloat16()
    _same(cpu.quantize_nvfp4(w), fourbit.quantize_nvfp4(w))
    _same(cpu.quantize_int4(w, group=16), fourbit.quantize_int4(w, group=16))
    w = torch.cat([w, w[:, :16]], 1)  # MXFP4 takes K multiples of 32: k + 16 is one
    _same(cpu.quantize_mxfp4(w), fourbit.quantize_mxfp4(w))


COLD = """
import sys, torch
from sidecar.numerics import cpu, fourbit
torch.set_num_threads(2)
g = torch.Generator().manual_seed(3)
w = (torch.randn(512, 2048, generator=g) * 10.0 ** torch.randint(-6, 6, (512, 1), generator=g)).bfloat16()
for dtype in (torch.bfloat16, torch.float32):
    for _ in range(2):  # the table cold, then warm
        got = cpu.quantize_int4(w, group=32, scale_dtype=dtype)
        want = fourbit.quantize_int4(w, group=32, scale_dtype=dtype)
        if not all(torch.equal(a, b) for a, b in zip(got, want)):
            sys.exit(f"{dtype}: native != reference")
"""


def test_int4_threshold_table_filled_from_cold_by_two_threads():
    done = subprocess.run(
        [sys.executable, "-c", COLD], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_nvfp4_global_scale_of_every_bf16_amax():
    """The native global scale (a Python float rounded once to float32) equals the reference's float32
    division for every finite amax, subnormal ones included."""
    amax = torch.arange(FINITE, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    want = torch.where(amax == 0, 1.0, amax.float() / torch.tensor(2688.0))
    got = torch.tensor([cpu_fourbit._nvfp4_global_scale_value(a) for a in range(FINITE)], dtype=torch.float32)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    for a in (0, 1, 0x80, 0x3F80, 0x7F7F):  # and through the API, on tensors of that amax
        t = torch.tensor([[a, a & 0x7F00, 0, 0] * 4], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
        assert torch.equal(
            cpu.nvfp4_global_scale(t).view(torch.int32), fourbit.nvfp4_global_scale(t).view(torch.int32)
        )


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the -march levels below are x86-64's")
@pytest.mark.parametrize("march", list(LEVELS))
def test_builds_for_older_cpus_give_the_same_bytes(march, tmp_path, monkeypatch):
    """fourbit.c's fast paths depend on the build's -march (AVX2 intrinsics for block maxima, AVX-512 for
    NVFP4's scales, GCC vector code of the width the CPU has): the library built for plain x86-64 (SSE2, no
    AVX2), for x86-64-v3 (AVX2, no AVX-512) and for x86-64-v4 (AVX-512 without VBMI) must give this
    machine's reference bytes too."""
    lib = build_for(march, tmp_path)
    monkeypatch.setattr(native, "load", lambda: lib)
    w = _every_magnitude(32, seed=11).reshape(-1, 1024)[::3]
    g = torch.Generator().manual_seed(12)
    ragged = (
        torch.randn(9, 1056, generator=g) * 10.0 ** torch.randint(-6, 6, (9, 1), generator=g)
    ).bfloat16()
    for x in (w, ragged):
        _same(cpu.quantize_nvfp4(x), fourbit.quantize_nvfp4(x))
        _same(cpu.quantize_int4(x, group=16), fourbit.quantize_int4(x, group=16))
        _same(
            cpu.quantize_int4(x, group=32, scale_dtype=torch.float32),
            fourbit.quantize_int4(x, group=32, scale_dtype=torch.float32),
        )
        _same(cpu.quantize_mxfp4(x), fourbit.quantize_mxfp4(x))


@pytest.mark.parametrize("k", [48, 512])
@pytest.mark.parametrize("begin", [0, 3])
def test_rows_taken_together_still_name_their_nonfinite_row(k, begin):
    """Dense rows shorter than a piece are converted several at a time as one (fourbit.c rows_at_once): a
    NaN or Inf is still reported at its own row (the first of the share's rows holding one), by NVFP4,
    INT4 and MXFP4, and a share starting past it does not see it."""
    lib = native.load()
    n = 40
    g = torch.Generator().manual_seed(k + begin)
    for bad_row in (0, 1, 4, 17, 39):
        for value in (float("nan"), float("inf")):
            w = torch.randn(n, k, generator=g).bfloat16()
            w[bad_row, k // 2 + 3] = value
            want = bad_row if bad_row >= begin else -1
            q, s = torch.zeros(n, k // 2, dtype=torch.uint8), torch.zeros(n, k // 16, dtype=torch.uint8)
            got = lib.refitd_nvfp4(
                w.data_ptr(), n, k, 0, k, q.data_ptr(), 0, k // 2, s.data_ptr(), 0, k // 16, 1.0, begin, n
            )
            assert got == want, ("nvfp4", bad_row, value)
            qi, si = torch.zeros(n, k // 8, dtype=torch.int32), torch.zeros(n, k // 16, dtype=torch.bfloat16)
            got = lib.refitd_int4(
                w.data_ptr(), n, k, 0, k, qi.data_ptr(), 0, k // 8, si.data_ptr(), 0, k // 16, 16, 0, begin, n
            )
            assert got == want, ("int4", bad_row, value)
            if k % 32 == 0:  # MXFP4's blocks
                qm, sm = torch.zeros(n, k // 2, dtype=torch.uint8), torch.zeros(n, k // 32, dtype=torch.uint8)
                got = lib.refitd_mxfp4(
                    w.data_ptr(), n, k, 0, k, qm.data_ptr(), 0, k // 2, sm.data_ptr(), 0, k // 32, begin, n
                )
                assert got == want, ("mxfp4", bad_row, value)
