"""Refusals that must read the same on every quantizer path (issue 26, Deliver 5): ``out=`` buffers
whose elements overlap (written from several threads they were a data race in the native kernels),
and a shared scale given as a Python float (an AttributeError in the reference, a ValueError natively)."""

from __future__ import annotations

import pytest
import torch

from sidecar.numerics import cpu, fourbit
from sidecar.numerics import reference as ref
from sidecar.numerics.checks import _overlaps_itself
from sidecar.numerics.formats import Format

ALL = [f for f in Format if f.quantized]
NAME = "model.layers.3.mlp.experts.1.gate_proj.weight"


def _buffers(fmt: Format, shape: tuple[int, ...]) -> list[torch.Tensor]:
    shape_q = fmt.weight_shape(shape)
    bufs = [torch.empty(shape_q, dtype=fmt.weight_dtype)]
    bufs.append(torch.empty(fmt.scale_shape(shape), dtype=fmt.scale_dtype))
    if fmt is Format.NVFP4:
        bufs.append(torch.empty((), dtype=torch.float32))
    if fmt is Format.INT4_W4A16:
        bufs.append(torch.empty(2, dtype=torch.int64))
    return bufs


def _overlapping(t: torch.Tensor, how: str) -> torch.Tensor:
    if how == "expand":  # every row the same memory
        return torch.empty(t.shape[-1], dtype=t.dtype).expand(t.shape)
    # as_strided: rows one element apart, so row r's element j is row r+1's element j-1
    return torch.empty(t.numel(), dtype=t.dtype).as_strided(t.shape, (1,) * t.dim())


PATHS = {"reference": ref.quantize, "cpu": cpu.quantize}


@pytest.mark.parametrize("how", ["expand", "as_strided"])
@pytest.mark.parametrize("which", [0, 1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.value)
def test_overlapping_out_buffers_are_refused_alike(fmt, dtype, which, how):
    w = torch.randn(4, 128, generator=torch.Generator().manual_seed(0)).to(dtype)
    messages = set()
    for path, fn in PATHS.items():
        bufs = _buffers(fmt, tuple(w.shape))
        if bufs[which].dim() < 2 or bufs[which].shape[0] < 2:
            pytest.skip("a buffer of one row cannot overlap itself this way")
        bufs[which] = _overlapping(bufs[which], how)
        with pytest.raises(ValueError, match="share memory") as err:
            fn(w, fmt, out=tuple(bufs), name=NAME)
        assert NAME in str(err.value), path
        messages.add(str(err.value))
    assert len(messages) == 1, messages


def test_overlap_check_is_exact():
    """Views that interleave without sharing memory are accepted; the quick stride test is not enough
    for them, the exact count decides."""
    base = torch.empty(64, dtype=torch.uint8)
    interleaved = base.as_strided((3, 2), (2, 3))  # offsets 0,3,2,5,4,7: distinct
    assert not _overlaps_itself(interleaved)
    assert _overlaps_itself(base.as_strided((3, 2), (1, 2)))  # 0,2,1,3,2,4: 2 twice
    assert _overlaps_itself(base[:4].expand(2, 4))
    assert not _overlaps_itself(base.view(8, 8)[:, 2:6])
    assert not _overlaps_itself(base.view(8, 8).t())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [0.5, 1, "0.5", torch.tensor(0.5, dtype=torch.float64), torch.ones(2)])
def test_shared_scale_not_a_float32_tensor_is_refused_alike(bad, dtype):
    w = torch.randn(4, 64).to(dtype)
    messages = set()
    for fn in (ref.quantize_fp8_per_tensor, cpu.quantize_fp8_per_tensor):
        with pytest.raises(ValueError, match="shared scale= must be one float32 value") as err:
            fn(w, scale=bad, name=NAME)
        messages.add(str(err.value))
    for fn in (fourbit.quantize_nvfp4, cpu.quantize_nvfp4):
        with pytest.raises(ValueError, match="shared global_scale= must be one float32 value") as err:
            fn(w, global_scale=bad, name=NAME)
        messages.add(str(err.value).replace("global_scale=", "scale="))
    assert len(messages) == 1, messages


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.value)
def test_a_layout_checked_once_lets_no_other_through(fmt):
    """out= buffers laid out as a call that already passed skip the checks (sidecar.numerics.checks: the
    daemon's arenas hand the same views step after step); a call with other strides, dtype, or an input
    over the same bytes is checked anew and refused, however often the good one ran before."""
    w = torch.randn(4, 128, generator=torch.Generator().manual_seed(1)).bfloat16()
    for fn in PATHS.values():
        bufs = _buffers(fmt, tuple(w.shape))
        for _ in range(2):
            fn(w, fmt, out=tuple(bufs), name=NAME)
        q = bufs[0]
        overlapping = q.as_strided(q.shape, (1,) * q.dim())  # q's first bytes, rows one element apart
        with pytest.raises(ValueError, match="share memory"):
            fn(w, fmt, out=(overlapping, *bufs[1:]), name=NAME)
        wrong_dtype = torch.empty(q.shape, dtype=torch.int16 if q.element_size() != 2 else torch.int8)
        with pytest.raises(ValueError, match="buffer is"):
            fn(w, fmt, out=(wrong_dtype, *bufs[1:]), name=NAME)
        aliased = w.view(torch.uint8).view(-1)[: q.numel() * q.element_size()].view(q.dtype).view(q.shape)
        with pytest.raises(ValueError, match="shares memory with the input"):
            fn(w, fmt, out=(aliased, *bufs[1:]), name=NAME)
        fn(w, fmt, out=tuple(bufs), name=NAME)  # and the good layout still passes
