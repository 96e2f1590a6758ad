"""Caller-supplied scales and ``out=`` buffers (SPEC §1.4), refused alike on every quantizer path.

A shared scale (NVFP4's ``global_scale=``, FP8 per-tensor's ``scale=``) that is NaN, ±Inf, negative
or -0.0, and ``out=`` buffers that overlap the input or each other, are refused with the same
ValueError and message by the torch reference, the native C path and the Triton path (whose checks
run before any launch, so they are exercised here on the CPU). Before issue 31 the native NVFP4 path
wrote zeros or another scale where the reference flipped signs, and overlapping buffers gave bytes
unlike a fresh call (or a NonFiniteError blaming the trainer for the input the kernel overwrote).
"""

from __future__ import annotations

import pytest
import torch

from sidecar.numerics import cpu, cpu_fourbit, fourbit, native
from sidecar.numerics import reference as ref
from tests.test_kernels_fourbit import SKIP as TRITON_SKIP

NAME = "model.layers.0.mlp.experts.0.up_proj.weight"
BAD_SCALES = [-1.0, -0.0, float("nan"), float("inf"), float("-inf"), -1e-30]


def _triton(fn: str):
    if TRITON_SKIP is not None:
        return None
    from sidecar.numerics.kernels import triton_fourbit

    return getattr(triton_fourbit, fn)


def _paths(fn: str, reference, cpu_module) -> dict:
    paths = {"reference": reference, "native": getattr(cpu_module, fn)}
    if fn != "quantize_fp8_per_tensor":
        triton = _triton(fn)
        if triton is not None:
            paths["triton"] = triton
    return paths


NVFP4 = _paths("quantize_nvfp4", fourbit.quantize_nvfp4, cpu_fourbit)
MXFP4 = _paths("quantize_mxfp4", fourbit.quantize_mxfp4, cpu_fourbit)
INT4 = _paths("quantize_int4", fourbit.quantize_int4, cpu_fourbit)
FP8 = _paths("quantize_fp8_per_tensor", ref.quantize_fp8_per_tensor, cpu)


@pytest.fixture(autouse=True)
def _native_built():
    assert native.load() is not None, "the native CPU kernels did not build: the native path is untested"


def _weights(rows: int = 8, k: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(31)
    return torch.randn(rows, k, generator=g).to(torch.bfloat16)


def _refusals(paths: dict, call) -> dict[str, str]:
    """Each path's ValueError message (``call(fn)`` must raise on every one)."""
    messages = {}
    for label, fn in paths.items():
        with pytest.raises(ValueError) as err:
            call(fn)
        messages[label] = str(err.value)
    return messages


@pytest.mark.parametrize("value", BAD_SCALES, ids=repr)
def test_a_bad_nvfp4_global_scale_is_refused_alike_on_every_path(value):
    w = _weights()
    scale = torch.tensor(value, dtype=torch.float32)
    messages = _refusals(NVFP4, lambda fn: fn(w, global_scale=scale, name=NAME))
    assert len(set(messages.values())) == 1, messages
    assert "must be finite and not negative" in messages["reference"] and NAME in messages["reference"]


@pytest.mark.parametrize("value", BAD_SCALES, ids=repr)
def test_a_bad_shared_fp8_scale_is_refused_alike(value):
    w = _weights()
    scale = torch.tensor(value, dtype=torch.float32)
    messages = _refusals(FP8, lambda fn: fn(w, scale=scale, name=NAME))
    assert len(set(messages.values())) == 1, messages
    assert "must be finite and not negative" in messages["reference"]


def test_a_zero_global_scale_quantizes_zeros_to_code_0_and_saturates_the_rest_alike():
    """SPEC §1.4: +0.0 is taken; 0/0 -> code 0, a nonzero element over a zero scale saturates."""
    w = _weights(4, 32)
    w[0] = 0
    scale = torch.tensor(0.0, dtype=torch.float32)
    want = fourbit.quantize_nvfp4(w, global_scale=scale, name=NAME)
    got = cpu_fourbit.quantize_nvfp4(w, global_scale=scale, name=NAME)
    for a, b in zip(want[:2], got[:2]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert not want[0][0].any()  # an all-zero row: every code 0
    codes = torch.stack([want[0][1:] & 0xF, want[0][1:] >> 4], -1).flatten(-2)
    assert set((codes & 0x7).unique().tolist()) == {7}  # |x| / 0: E2M1's largest magnitude, 6
    assert torch.equal(codes >> 3 == 1, w[1:] < 0)  # with the sign of the input


def _buffers(wanted) -> list[torch.Tensor]:
    return [torch.empty(shape, dtype=dtype) for shape, dtype in wanted]


def _nvfp4_out(w):
    q, s, g = fourbit.quantize_nvfp4(w)
    return [torch.empty_like(q), torch.empty_like(s), torch.empty_like(g)]


def _int4_out(w):
    p, s, _ = fourbit.quantize_int4(w)
    return [torch.empty_like(p), torch.empty_like(s), torch.zeros(2, dtype=torch.int64)]


def _overlap_input(out: list[torch.Tensor], w: torch.Tensor, k: int) -> list[torch.Tensor]:
    """``out`` with buffer ``k`` laid over ``w``'s own bytes."""
    t = out[k]
    nbytes = t.numel() * t.element_size()
    out[k] = w.view(torch.uint8).reshape(-1)[:nbytes].view(t.dtype).view(t.shape)
    return out


def _overlap_each_other(out: list[torch.Tensor], k: int) -> list[torch.Tensor]:
    """``out`` with buffer ``k`` laid over buffer 0's bytes (buffer 0 made big enough)."""
    t = out[k]
    need = t.numel() * t.element_size()
    base = torch.empty(max(need, out[0].numel() * out[0].element_size()), dtype=torch.uint8)
    out[0] = base[: out[0].numel() * out[0].element_size()].view(out[0].dtype).view(out[0].shape)
    out[k] = base[:need].view(t.dtype).view(t.shape)
    return out


CASES = {
    "nvfp4": (NVFP4, _nvfp4_out, {}),
    "mxfp4": (MXFP4, lambda w: [torch.empty_like(t) for t in fourbit.quantize_mxfp4(w)], {}),
    "int4": (INT4, _int4_out, {}),
}


@pytest.mark.parametrize("fmt", list(CASES))
@pytest.mark.parametrize("how", ["values over the input", "scales over the input", "scales over the values"])
def test_out_buffers_overlapping_the_input_or_each_other_are_refused_alike(fmt, how):
    paths, make, kwargs = CASES[fmt]
    w = _weights()
    before = w.clone()

    def call(fn):
        out = make(w)
        if how == "values over the input":
            out = _overlap_input(out, w, 0)
        elif how == "scales over the input":
            out = _overlap_input(out, w, 1)
        else:
            out = _overlap_each_other(out, 1)
        return fn(w, out=tuple(out), name=NAME, **kwargs)

    messages = _refusals(paths, call)
    assert len(set(messages.values())) == 1, messages
    assert "shares memory with" in messages["reference"] and "SPEC §1.4" in messages["reference"]
    assert torch.equal(w, before)  # refused before anything was written


def test_separate_buffers_in_one_allocation_are_taken():
    """Buffers side by side in one allocation (as the daemon's arenas carve them) do not overlap."""
    w = _weights()
    q, s, g = fourbit.quantize_nvfp4(w)
    sizes = [t.numel() * t.element_size() for t in (q, s, g)]
    arena = torch.zeros(sum(sizes) + 64, dtype=torch.uint8)
    outs, at = [], 0
    for t, n in zip((q, s, g), sizes):
        outs.append(arena[at : at + n].view(t.dtype).view(t.shape))
        at += n
    for fn in (fourbit.quantize_nvfp4, cpu_fourbit.quantize_nvfp4):
        got = fn(w, out=tuple(outs), name=NAME)
        assert torch.equal(got[0], q) and torch.equal(got[1].view(torch.uint8), s.view(torch.uint8))
