"""A passthrough's copy out of staging, checked on the copy (sidecar.daemon.copyout): the native
fused copy-and-scan and the torch fallback copy every byte and refuse exactly the tensors that hold
NaN or Inf, wherever it sits (first element, last, across a chunk or a thread's share)."""

from __future__ import annotations

import pytest
import torch

from sidecar.daemon import copyout
from sidecar.numerics import native
from sidecar.numerics.reference import NonFiniteError

SIZES = [1, 7, 40_000, (3 << 20) // 2 + 5]  # elements: tiny, odd, one chunk and a bit, > two shares
BAD = [float("nan"), float("inf"), float("-inf")]


@pytest.fixture(params=["native", "torch"])
def path(request, monkeypatch):
    if request.param == "native":
        if native.load() is None:
            pytest.skip(f"no native library: {native.unavailable_reason()}")
    else:
        monkeypatch.setattr(copyout.native, "load", lambda: None)
    return request.param


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_byte_copied_and_finite_values_pass(path, dtype):
    for n in SIZES:
        src = (torch.randn(n) * 1e3).to(dtype)
        src[0] = torch.finfo(dtype).max  # the largest finite value is not Inf
        dst = torch.full_like(src, 3.0)
        copyout.copy_checked(dst, src, "w")
        assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8)), (path, dtype, n)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_nan_or_inf_anywhere_in_the_copy_is_refused_naming_the_tensor(path, dtype):
    n = SIZES[-1]
    chunk = 65536 // torch.empty((), dtype=dtype).element_size()
    for at in (0, n - 1, chunk - 1, chunk, n // 2):
        for bad in BAD:
            src = torch.randn(n).to(dtype)
            src[at] = bad
            dst = torch.zeros_like(src)
            with pytest.raises(NonFiniteError, match=r"tensor 'm\.norm\.weight' holds NaN or Inf"):
                copyout.copy_checked(dst, src, "m.norm.weight")


def test_what_is_checked_is_the_copy_not_the_source():
    """The verdict is about the bytes that landed: a source that turns NaN after the copy does not
    change it, and a destination that is already the source (a remote rank's frames the daemon wrote
    in place) is only checked."""
    src = torch.randn(1000).bfloat16()
    dst = torch.empty_like(src)
    copyout.copy_checked(dst, src, "w")
    src[5] = float("nan")  # a rank writing staging after the copy: the copy stays finite
    assert bool(torch.isfinite(dst).all())
    with pytest.raises(NonFiniteError):
        copyout.copy_checked(src, src, "w")


def test_other_layouts_and_dtypes_take_the_torch_path():
    src = torch.randn(64, 64).bfloat16().t()  # not contiguous
    dst = torch.empty(64, 64, dtype=torch.bfloat16)
    copyout.copy_checked(dst, src, "w")
    assert torch.equal(dst, src)
    ints = torch.arange(10, dtype=torch.int32)
    out = torch.zeros_like(ints)
    copyout.copy_checked(out, ints, "i")  # integers hold no NaN: copied, never refused
    assert torch.equal(out, ints)
