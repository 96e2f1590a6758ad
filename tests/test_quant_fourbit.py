"""The 4-bit quantizers (SPEC §1.5-1.7) against the edge-case table and the scalar oracle, byte for byte.

tests/support/oracle.py computes every value element by element from SPEC's text (numpy float32
scalars, an explicit nearest-value search for E2M1 and e4m3), sharing no code with the implementations.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from support import oracle

from sidecar.numerics import cpu, fourbit
from sidecar.numerics import reference as ref
from sidecar.numerics.cases import FOUR_BIT_CASES, Case
from sidecar.numerics.formats import FP8_DTYPE, Format

NAME = "model.layers.0.mlp.experts.0.up_proj.weight"


@contextlib.contextmanager
def torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _fill_out(fmt: Format, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """out= buffers full of garbage: every element must be written."""
    shape = tuple(w.shape)
    q = torch.full(Format(fmt).weight_shape(shape), 0x5A, dtype=fmt.weight_dtype)
    s_shape = fmt.scale_shape(shape)
    if fmt is Format.NVFP4:
        return q, torch.full(s_shape, 0x7F, dtype=torch.uint8).view(FP8_DTYPE), torch.tensor(float("nan"))
    if fmt is Format.MXFP4:
        return q, torch.full(s_shape, 255, dtype=torch.uint8)
    return q, torch.full(s_shape, float("nan"), dtype=torch.bfloat16), torch.full((2,), -1, dtype=torch.int64)


def _with_out(fn, fmt):
    def run(w, **kw):
        try:
            _fill_out(fmt, w)
            ref._check_input(w, None, fmt)
        except (ValueError, RuntimeError):  # a shape or dtype the format refuses: let it say so
            return fn(w, **kw)
        if w.shape[-1] % 32 and fmt is Format.INT4_W4A16:
            return fn(w, **kw)
        bufs = _fill_out(fmt, w)
        got = fn(w, out=bufs, **kw)
        assert all(g is b for g, b in zip(got, bufs, strict=True))
        return got

    return run


FNS = {
    Format.NVFP4: fourbit.quantize_nvfp4,
    Format.MXFP4: fourbit.quantize_mxfp4,
    Format.INT4_W4A16: fourbit.quantize_int4,
}


#: implementation name -> {format: callable(w, **kw) -> outputs}; the native and Triton kernels register too
def _tiny_chunks(fn):
    return lambda w, **kw: fn(w, chunk_elems=1, **kw)


def _dispatch(fmt):
    return lambda w, **kw: ref.quantize(w, fmt, **kw)


IMPLEMENTATIONS = {
    "torch": dict(FNS),
    "torch-tiny-chunks": {f: _tiny_chunks(fn) for f, fn in FNS.items()},
    "torch-out": {f: _with_out(fn, f) for f, fn in FNS.items()},
    "dispatch": {f: _dispatch(f) for f in FNS},
}


def _oracle(fmt: Format, w: torch.Tensor):
    if fmt is Format.NVFP4:
        return oracle.nvfp4(w)
    if fmt is Format.MXFP4:
        return oracle.mxfp4(w)
    return oracle.int4(w)


_ORACLE_CACHE: dict[str, tuple] = {}


def check_against_oracle(fmt: Format, w: torch.Tensor, got: tuple[torch.Tensor, ...], expected=None) -> None:
    """``got`` (an implementation's outputs for ``w``) equal the oracle's, byte for byte."""
    expected = _oracle(fmt, w) if expected is None else expected
    shape = tuple(w.shape)
    q, s = got[0], got[1]
    assert q.dtype == fmt.weight_dtype and tuple(q.shape) == fmt.weight_shape(shape)
    assert s.dtype == fmt.scale_dtype and tuple(s.shape) == fmt.scale_shape(shape)
    np.testing.assert_array_equal(q.cpu().numpy(), expected[0])
    if fmt is Format.NVFP4:
        np.testing.assert_array_equal(s.cpu().view(torch.uint8).numpy(), expected[1])
        assert got[2].dtype == torch.float32 and got[2].shape == ()
        assert np.float32(float(got[2])).view(np.uint32) == np.float32(expected[2]).view(np.uint32)
    elif fmt is Format.MXFP4:
        np.testing.assert_array_equal(s.cpu().numpy(), expected[1])
    else:
        np.testing.assert_array_equal(s.cpu().float().numpy().view(np.uint32), expected[1].view(np.uint32))
        assert got[2].tolist() == expected[2].tolist()


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("case", FOUR_BIT_CASES, ids=[c.id for c in FOUR_BIT_CASES])
def test_four_bit_edge_case_table(case: Case, impl: str):
    fn = IMPLEMENTATIONS[impl][case.fmt]
    w = case.make()
    if case.error:
        with pytest.raises(ValueError, match=case.error) as err:
            fn(w, name=NAME)
        assert NAME in str(err.value)
        return
    got = fn(w)
    if case.id not in _ORACLE_CACHE:
        _ORACLE_CACHE[case.id] = _oracle(case.fmt, w)
    check_against_oracle(case.fmt, w, got, _ORACLE_CACHE[case.id])
    q, s = got[0], got[1]
    for index, value in case.q_bytes.items():
        assert int(q[index]) == value, f"q{index}"
    if case.scales is not None:
        flat = s.float().reshape(-1).tolist() if s.dtype != torch.uint8 else s.reshape(-1).tolist()
        assert flat == list(case.scales)
    if case.global_scale is not None:
        assert float(got[2]) == case.global_scale


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("fmt", list(FNS), ids=lambda f: f.value)
def test_random_shapes_and_magnitudes(fmt, seed):
    g = torch.Generator().manual_seed(seed)
    lead = [int(torch.randint(1, 4, (1,), generator=g))] * (seed % 3)
    k = 32 * int(torch.randint(1, 4, (1,), generator=g))
    n = int(torch.randint(1, 9, (1,), generator=g))
    mag = [1e-30, 1e-3, 1.0, 1e4][seed]
    dtype = [torch.bfloat16, torch.float16, torch.float32, torch.bfloat16][seed]
    if dtype == torch.float16:
        mag = 1.0
    x = torch.randn(*lead, n, k, generator=g) * mag
    x[..., : k // 2] *= 10.0 ** float(torch.randint(-3, 3, (1,), generator=g))  # blocks of unlike size
    w = x.to(dtype)
    check_against_oracle(fmt, w, FNS[fmt](w))


def test_nvfp4_gate_and_up_share_one_global_scale():
    """SPEC §2.3: an expert's gate_proj and up_proj are quantized with one gs over both."""
    g = torch.Generator().manual_seed(5)
    gate = torch.randn(8, 64, generator=g).bfloat16()
    up = (7 * torch.randn(8, 64, generator=g)).bfloat16()
    gs = fourbit.nvfp4_global_scale(gate, up)
    ogs = oracle.nvfp4_global_scale(gate, up)
    assert np.float32(float(gs)) == ogs
    assert float(gs) == float(up.float().abs().max()) / 2688 or float(gs) != float(
        fourbit.nvfp4_global_scale(gate)
    )
    for w in (gate, up):
        got = fourbit.quantize_nvfp4(w, global_scale=gs)
        check_against_oracle(Format.NVFP4, w, got, oracle.nvfp4(w, ogs))


def test_int4_float32_scales_and_other_groups():
    w = torch.randn(6, 256, generator=torch.Generator().manual_seed(6)).bfloat16()
    for group, dtype in ((32, torch.float32), (128, torch.bfloat16), (64, torch.float32)):
        packed, s, shape = fourbit.quantize_int4(w, group=group, scale_dtype=dtype)
        op, os_, _ = oracle.int4(w, group=group, scale_dtype=dtype)
        assert s.dtype == dtype and tuple(s.shape) == (6, 256 // group)
        np.testing.assert_array_equal(packed.numpy(), op)
        np.testing.assert_array_equal(s.float().numpy(), os_)
        assert shape.tolist() == [6, 256]
    with pytest.raises(ValueError, match="multiple of 8"):
        fourbit.quantize_int4(w, group=12, name=NAME)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        fourbit.quantize_int4(w, scale_dtype=torch.float16, name=NAME)


@pytest.mark.parametrize("fmt", list(FNS), ids=lambda f: f.value)
def test_dequantize_is_spec_rule(fmt):
    """dequantize gives SPEC's values from the oracle's own codes and scales."""
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(7)).bfloat16()
    got = FNS[fmt](w)
    if fmt is Format.NVFP4:
        deq = ref.dequantize(got[0], got[1], fmt, global_scale=got[2])
        q, s, gs = oracle.nvfp4(w)
        codes = [[c for b in row for c in (b & 0xF, b >> 4)] for row in q.tolist()]
        want = [
            [
                (-1 if c & 8 else 1)
                * oracle.E2M1[c & 7]
                * np.float32(np.float32(oracle.e4m3_value(int(s[r][j // 16]))) * gs)
                for j, c in enumerate(row)
            ]
            for r, row in enumerate(codes)
        ]
    elif fmt is Format.MXFP4:
        deq = ref.dequantize(got[0], got[1], fmt)
        q, s = oracle.mxfp4(w)
        codes = [[c for b in row for c in (b & 0xF, b >> 4)] for row in q.tolist()]
        want = [
            [
                (-1 if c & 8 else 1) * oracle.E2M1[c & 7] * 2.0 ** (int(s[r][j // 32]) - 127)
                for j, c in enumerate(row)
            ]
            for r, row in enumerate(codes)
        ]
    else:
        deq = ref.dequantize(got[0], got[1], fmt)
        packed, s, _ = oracle.int4(w)
        want = [
            [((int(word) >> (4 * i)) & 0xF) - 8 for word in row for i in range(8)] for row in packed.tolist()
        ]
        want = [[v * float(s[r][j // 32]) for j, v in enumerate(row)] for r, row in enumerate(want)]
    np.testing.assert_array_equal(deq.numpy(), np.array(want, dtype=np.float32))
    # and the quantization is close: within half a step of the largest E2M1/int4 spacing of each block
    assert float((deq - w.float()).abs().max()) < float(w.float().abs().max()) * 0.2


def test_packing_round_trips():
    codes = torch.arange(16, dtype=torch.uint8).repeat(3, 2)
    assert torch.equal(fourbit.unpack_e2m1(fourbit.pack_e2m1(codes)), codes)
    assert fourbit.pack_e2m1(torch.tensor([[1, 2]], dtype=torch.uint8)).tolist() == [[0x21]]
    q = torch.arange(-7, 8).repeat(8)[:64].reshape(2, 32)
    assert torch.equal(fourbit.unpack_int4(fourbit.pack_int4(q)).long(), q)
    assert fourbit.pack_int4(torch.tensor([[-7, 0, 0, 0, 0, 0, 0, 7]])).tolist() == [
        [int(np.int32(np.uint32(0xF8888881)))]
    ]


# --------------------------------------------------------------------------------------------------
# the native CPU kernels (bfloat16 input): the same table and the same random inputs


def _native_or_skip():
    from sidecar.numerics import native

    if native.load() is None:
        pytest.skip(f"native quantizers unavailable: {native.unavailable_reason()}")


CPU_FNS = {
    Format.NVFP4: cpu.quantize_nvfp4,
    Format.MXFP4: cpu.quantize_mxfp4,
    Format.INT4_W4A16: cpu.quantize_int4,
}


@pytest.mark.parametrize("case", FOUR_BIT_CASES, ids=[c.id for c in FOUR_BIT_CASES])
def test_native_edge_cases_as_bf16(case: Case):
    """Each case cast to bfloat16 (what the native kernels take), through sidecar.numerics.cpu, equals
    the oracle; error cases raise the reference's error."""
    _native_or_skip()
    w = case.make()
    if w.dtype in (torch.float16, torch.float32):
        w = w.bfloat16()
    fn = CPU_FNS[case.fmt]
    if case.error:
        with pytest.raises(ValueError, match=case.error) as err:
            fn(w, name=NAME)
        assert NAME in str(err.value)
        with pytest.raises(ValueError) as want:
            FNS[case.fmt](w, name=NAME)
        assert str(err.value) == str(want.value)
        return
    if w.is_floating_point():
        assert cpu.native_applies(w, case.fmt) or w.dim() < 2 or not w.is_contiguous()
    check_against_oracle(case.fmt, w, fn(w))
    check_against_oracle(case.fmt, w, _with_out(fn, case.fmt)(w))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("fmt", list(FNS), ids=lambda f: f.value)
def test_native_equals_reference_on_random_bf16(fmt, seed):
    """Larger tensors than the oracle can take, split across threads: native bytes == reference bytes."""
    _native_or_skip()
    g = torch.Generator().manual_seed(100 + seed)
    shape = [(3, 256, 512), (1, 4096), (40, 96), (2, 2, 64, 160), (300, 64), (17, 1024)][seed]
    x = torch.randn(*shape, generator=g) * 10.0 ** float(torch.randint(-20, 20, (1,), generator=g))
    x[..., ::7] *= 1e3
    x.view(-1)[::13] = 0.0
    w = x.bfloat16()
    if seed == 3:
        w = w.transpose(0, 1)  # leading dims that do not fold: one matrix at a time, or the fallback
    want = FNS[fmt](w)
    with torch_threads(2):
        got = CPU_FNS[fmt](w)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(
            a.view(torch.uint8) if a.dtype == FP8_DTYPE else a,
            b.view(torch.uint8) if b.dtype == FP8_DTYPE else b,
        )


def test_native_nvfp4_shared_global_scale_and_int4_f32_scales():
    _native_or_skip()
    g = torch.Generator().manual_seed(9)
    gate, up = (
        torch.randn(64, 128, generator=g).bfloat16(),
        (5 * torch.randn(64, 128, generator=g)).bfloat16(),
    )
    gs = cpu.nvfp4_global_scale(gate, up)
    assert torch.equal(gs, fourbit.nvfp4_global_scale(gate, up))
    for w in (gate, up):
        for a, b in zip(cpu.quantize_nvfp4(w, global_scale=gs), fourbit.quantize_nvfp4(w, global_scale=gs)):
            assert torch.equal(
                a.view(torch.uint8) if a.dtype == FP8_DTYPE else a,
                b.view(torch.uint8) if b.dtype == FP8_DTYPE else b,
            )
    wide = torch.randn(3, 6144, generator=g).bfloat16()
    # powers of two up to the kernel's piece run in pieces, others (24) and wider ones (2048) group by group
    for w, group, dtype in (
        (up, 32, torch.float32),
        (up, 128, torch.bfloat16),
        (wide, 24, torch.bfloat16),
        (wide, 2048, torch.float32),
        (wide, 8, torch.bfloat16),
    ):
        a = cpu.quantize_int4(w, group=group, scale_dtype=dtype)
        b = fourbit.quantize_int4(w, group=group, scale_dtype=dtype)
        assert all(torch.equal(x, y) for x, y in zip(a, b)), group


@pytest.mark.parametrize("global_scale", [None, 1.0, 2.0**-149, 1e-30, 0.37, 1e30, 1.1e35])
def test_native_nvfp4_every_bf16_magnitude(global_scale):
    """Every finite bfloat16 magnitude as a block's amax, with random smaller values and signs beside it,
    under global scales down to ones where ``s * gs`` is subnormal or 0: the native kernel's rounding
    (per-scale thresholds found with its own division, fourbit.c first_passing) equals the reference."""
    _native_or_skip()
    g = torch.Generator().manual_seed(5)
    amax = torch.randperm(0x7F80, generator=g, dtype=torch.int32)  # every finite non-negative bf16
    others = (torch.rand(amax.numel(), 15, generator=g) * (amax[:, None].float() + 1)).to(torch.int32)
    others = others.clamp(max=amax[:, None])
    others[:, :5] = (amax[:, None] - torch.randint(0, 300, (amax.numel(), 5), generator=g)).clamp(min=0)
    bits = torch.cat([amax[:, None], others], 1)
    bits |= torch.randint(0, 2, bits.shape, generator=g, dtype=torch.int32) << 15
    w = bits.to(torch.int16).view(torch.bfloat16).reshape(-1, 64)
    gs = None if global_scale is None else torch.tensor(global_scale, dtype=torch.float32)
    with torch_threads(2):
        got = cpu.quantize_nvfp4(w, global_scale=gs)
    want = fourbit.quantize_nvfp4(w, global_scale=gs)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(
            a.view(torch.uint8) if a.dtype == FP8_DTYPE else a,
            b.view(torch.uint8) if b.dtype == FP8_DTYPE else b,
        )


@pytest.mark.parametrize("fmt", list(FNS), ids=lambda f: f.value)
def test_native_path_is_taken_for_bf16(fmt, monkeypatch):
    """A contiguous bfloat16 input (or a slab's per-expert view) never reaches the torch reference."""
    _native_or_skip()
    slab = torch.randn(4, 64, 128, generator=torch.Generator().manual_seed(1)).bfloat16()
    want = [FNS[fmt](slab), FNS[fmt](slab[:, 32:])]

    def refuse(*a, **k):
        raise AssertionError("the reference ran")

    for mod_fn in ("quantize_nvfp4", "quantize_mxfp4", "quantize_int4", "nvfp4_global_scale"):
        monkeypatch.setattr(fourbit, mod_fn, refuse)
    for w, expected in zip((slab, slab[:, 32:]), want):
        got = CPU_FNS[fmt](w)
        for a, b in zip(got, expected):
            assert torch.equal(
                a.view(torch.uint8) if a.dtype == FP8_DTYPE else a,
                b.view(torch.uint8) if b.dtype == FP8_DTYPE else b,
            )
