"""docs/spec.md's worked examples (§1.8) and caller-scale rules (§1.4), against every CPU quantizer.

The examples are the page's own bytes: if a quantizer or the page changes, this says which line
disagrees. The caller-scale rule (a shared scale must be finite and not negative, -0.0 included) is
checked on the torch reference and on the native CPU path, which both read it through one check.
"""

from __future__ import annotations

import struct

import pytest
import torch

from sidecar.numerics import cpu, fourbit
from sidecar.numerics import reference as ref


def _f32_bits(t: torch.Tensor) -> int:
    return struct.unpack("<I", struct.pack("<f", float(t)))[0]


def _u8(t: torch.Tensor) -> list[int]:
    return t.reshape(-1).view(torch.uint8).tolist()


def _row(n: int, head: list[float], dtype=torch.float32) -> torch.Tensor:
    w = torch.zeros(1, n, dtype=dtype)
    w[0, : len(head)] = torch.tensor(head, dtype=dtype)
    return w


@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_block_fp8_examples(impl: str):
    quant = ref.quantize_block_fp8 if impl == "reference" else cpu.quantize_block_fp8
    q, s = quant(torch.zeros(128, 128))
    assert float(s) == 1.0 and set(_u8(q)) == {0}
    w = torch.zeros(128, 128)
    w[3, 5] = 1.0
    q, s = quant(w)
    assert _f32_bits(s) == 0x3B124925 and _u8(q[3, 5]) == [0x7E]
    w = torch.zeros(128, 128)
    w[0, 0] = 1e-40  # a float32 subnormal: the scale is floored at FLT_MIN
    q, s = quant(w)
    assert _f32_bits(s) == 0x00800000 and _u8(q[0, 0]) == [0x04]


@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_mxfp8_examples(impl: str):
    quant = ref.quantize_mxfp8 if impl == "reference" else cpu.quantize_mxfp8
    q, s = quant(_row(32, [448.0]))
    assert s.tolist() == [[127]] and _u8(q[0, 0]) == [0x7E]
    q, s = quant(_row(32, [449.0]))
    assert s.tolist() == [[128]] and _u8(q[0, 0]) == [0x76]
    _, s = quant(torch.zeros(1, 32))
    assert s.tolist() == [[1]]


@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_nvfp4_examples(impl: str):
    quant = fourbit.quantize_nvfp4 if impl == "reference" else cpu.quantize_nvfp4
    q, s, gs = quant(_row(16, [6.0]))
    assert float(gs) == float(torch.tensor(6.0) / torch.tensor(2688.0))
    assert _u8(s) == [0x7E] and q.tolist() == [[0x07] + [0] * 7]
    q, s, gs = quant(torch.full((1, 16), -0.0))
    assert float(gs) == 1.0 and _u8(s) == [0x38] and set(q.reshape(-1).tolist()) == {0}


@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_mxfp4_examples(impl: str):
    quant = fourbit.quantize_mxfp4 if impl == "reference" else cpu.quantize_mxfp4
    q, s = quant(_row(32, [6.0]))
    assert s.tolist() == [[127]] and q[0, 0] == 7
    q, s = quant(_row(32, [7.0]))  # significand 1.75: the exponent bumps, 3.5 ties to 4 (code 6)
    assert s.tolist() == [[128]] and q[0, 0] == 6


@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_int4_examples(impl: str):
    quant = fourbit.quantize_int4 if impl == "reference" else cpu.quantize_int4
    packed, s, shape = quant(_row(32, [7.0, -7.0, 3.5, 0.0]))
    assert s.dtype == torch.bfloat16 and s.tolist() == [[1.0]]
    assert packed[0, 0].item() & 0xFFFFFFFF == 0x88888C1F and shape.tolist() == [1, 32]
    assert fourbit.unpack_int4(packed)[0, :4].tolist() == [7, -7, 4, 0]


BAD_SCALES = [float("nan"), float("inf"), float("-inf"), -1.0, -0.0]


@pytest.mark.parametrize("bad", BAD_SCALES)
@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_caller_scales_that_are_not_finite_or_are_negative_are_refused(impl: str, bad: float):
    """docs/spec.md §1.4: NaN, ±Inf, negative and -0.0 shared scales are refused, never turned into
    NaN bytes (the old check took any float32 tensor: a NaN scale gave 0x7F, FP8's NaN)."""
    w = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    fp8 = ref.quantize_fp8_per_tensor if impl == "reference" else cpu.quantize_fp8_per_tensor
    nv = fourbit.quantize_nvfp4 if impl == "reference" else cpu.quantize_nvfp4
    with pytest.raises(ValueError, match="finite and not negative") as err:
        fp8(w, scale=torch.tensor(bad), name="layers.0.x")
    assert "layers.0.x" in str(err.value)
    with pytest.raises(ValueError, match="finite and not negative"):
        nv(w, global_scale=torch.tensor(bad), name="layers.0.x")


def test_a_zero_caller_scale_saturates_with_the_sign():
    """docs/spec.md §1.4/§1.5: +0.0 is allowed; nonzero elements saturate, zeros stay code 0."""
    w = _row(16, [1.0, -2.0])
    q, s, gs = fourbit.quantize_nvfp4(w, global_scale=torch.tensor(0.0))
    assert float(gs) == 0.0 and _u8(s) == [0x7E]
    assert fourbit.unpack_e2m1(q)[0, :3].tolist() == [7, 15, 0]


def test_the_spec_has_a_rule_and_a_name_row_for_every_format():
    """docs/spec.md covers every format the code knows: a §1 rule for each quantized one and a row of
    the §2.3 names table for each (bf16 included), so a new Format cannot land without its contract."""
    from pathlib import Path

    from sidecar.numerics.formats import Format

    text = (Path(__file__).resolve().parent.parent / "docs" / "spec.md").read_text()
    rules = text[text.index("## 1. Quantizers") : text.index("## 2. Checkpoint conversion")]
    names = text[text.index("### 2.3 Output names") : text.index("### 2.4 Engines")]
    for fmt in Format:
        if fmt.quantized:
            assert f"(`{fmt.value}`" in rules, f"docs/spec.md §1 has no rule for {fmt.value}"
        assert f"| `{fmt.value}`" in names, f"docs/spec.md §2.3 has no names row for {fmt.value}"
