"""The 4-bit Triton kernels (sidecar/numerics/kernels/triton_fourbit.py) against the torch reference and
the edge-case table, byte for byte: compiled on a GPU when there is one, else under Triton's CPU
interpreter (the kernels avoid the float8 casts the interpreter gets wrong at binade edges)."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

from sidecar.numerics import fourbit
from sidecar.numerics.cases import FOUR_BIT_CASES, Case
from sidecar.numerics.formats import FP8_DTYPE, Format


def _enable_interpreter() -> str | None:
    """Import Triton and the kernels in interpreter mode (as tests/test_kernels.py does); the reason
    it cannot be done, or None."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if torch.cuda.is_available():
        return None
    if "triton" in sys.modules:
        import triton

        if not triton.knobs.runtime.interpret:
            return "triton was imported before this module could enable its interpreter; run this file alone"
        return None
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton

        triton.knobs.runtime.interpret = True
        from sidecar.numerics.kernels import triton_fourbit  # noqa: F401
    except Exception as err:
        return f"the Triton interpreter cannot be used here: {err!r}"
    finally:
        os.environ.pop("TRITON_INTERPRET", None)
    return None


SKIP = _enable_interpreter()
pytestmark = [
    pytest.mark.skipif(SKIP is not None, reason=str(SKIP)),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAME = "model.layers.0.mlp.experts.0.up_proj.weight"


def _kernels():
    from sidecar.numerics.kernels import triton_fourbit

    return {
        Format.NVFP4: triton_fourbit.quantize_nvfp4,
        Format.MXFP4: triton_fourbit.quantize_mxfp4,
        Format.INT4_W4A16: triton_fourbit.quantize_int4,
    }


REFERENCE = {
    Format.NVFP4: fourbit.quantize_nvfp4,
    Format.MXFP4: fourbit.quantize_mxfp4,
    Format.INT4_W4A16: fourbit.quantize_int4,
}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu(), b.cpu()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == FP8_DTYPE:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(
        a.reshape(-1).view(torch.uint8) if a.dim() == 0 else a,
        b.reshape(-1).view(torch.uint8) if b.dim() == 0 else b,
    )


@pytest.mark.parametrize("case", FOUR_BIT_CASES, ids=[c.id for c in FOUR_BIT_CASES])
def test_edge_case_table(case: Case):
    w = case.make().to(DEVICE)
    fn = _kernels()[case.fmt]
    if case.error:
        with pytest.raises(ValueError, match=case.error) as err:
            fn(w, name=NAME)
        assert NAME in str(err.value)
        return
    got = fn(w)
    want = REFERENCE[case.fmt](w.cpu())
    for g, r in zip(got, want, strict=True):
        assert _same(g, r), case.id


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("fmt", list(REFERENCE), ids=lambda f: f.value)
def test_random_against_reference(fmt, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 3, 160 if fmt is Format.NVFP4 else 128, generator=g)
    span = 8 if seed == 1 else 30  # float16 (seed 1) has a narrow range
    x *= torch.exp2(torch.randint(-span, span, (5, 3, 1), generator=g).float())
    x.view(-1)[::17] = 0.0
    w = x.to([torch.bfloat16, torch.float16, torch.float32][seed]).to(DEVICE)
    for g_, r in zip(_kernels()[fmt](w), REFERENCE[fmt](w.cpu()), strict=True):
        assert _same(g_, r)


def test_shared_global_scale_and_int4_options():
    k = _kernels()
    gen = torch.Generator().manual_seed(4)
    gate, up = (
        torch.randn(8, 64, generator=gen).bfloat16(),
        (4 * torch.randn(8, 64, generator=gen)).bfloat16(),
    )
    gs = fourbit.nvfp4_global_scale(gate, up)
    for w in (gate, up):
        for g_, r in zip(
            k[Format.NVFP4](w.to(DEVICE), global_scale=gs.to(DEVICE)),
            fourbit.quantize_nvfp4(w, global_scale=gs),
        ):
            assert _same(g_, r)
    for group, dtype in ((64, torch.float32), (32, torch.bfloat16), (8, torch.bfloat16)):
        got = k[Format.INT4_W4A16](up.to(DEVICE), group=group, scale_dtype=dtype)
        want = fourbit.quantize_int4(up, group=group, scale_dtype=dtype)
        assert all(_same(g_, r) for g_, r in zip(got, want))
    wide = torch.cat([gate, up, 3 * gate, up / 5], dim=1)  # K = 256: group 128, as an engine may hold it
    for dtype in (torch.float32, torch.bfloat16):
        got = k[Format.INT4_W4A16](wide.to(DEVICE), group=128, scale_dtype=dtype)
        want = fourbit.quantize_int4(wide, group=128, scale_dtype=dtype)
        assert all(_same(g_, r) for g_, r in zip(got, want))
