"""A slab unit's expert projections run as one split across the quantizer threads, not one hand-off
each (sidecar.plan.run._quantize_groups through sidecar.numerics.cpu.run_prepared): the shared
scales of every group in one ``run_many``, every projection's kernel in another; the bytes are the
reference's on each source slice (tests/test_plan.py, test_plan_fourbit.py check every output), and
a NaN in one expert of the slab still names that expert."""

from __future__ import annotations

import pytest
import torch

from sidecar.cli.demo.synthetic import make_state_dict
from sidecar.numerics import cpu, native
from sidecar.numerics.formats import Format
from sidecar.plan.build import RefitPlan, RefitSpec, UnitKind
from sidecar.plan.run import convert, run_unit

pytestmark = pytest.mark.skipif(native.load() is None, reason="no C compiler: the native kernels are off")

#: the formats whose groups share a scale read before the kernels: two splits a unit, else one
SHARED_SCALE = {Format.NVFP4, Format.FP8_PER_TENSOR}
EXPERTS = 8
QUANTIZED = [
    Format.BLOCK_FP8,
    Format.MXFP8,
    Format.FP8_PER_TENSOR,
    Format.NVFP4,
    Format.MXFP4,
    Format.INT4_W4A16,
]


def _slab_units(fmt: Format) -> tuple[dict[str, torch.Tensor], RefitPlan, list]:
    state = make_state_dict("qwen3_5_moe", num_layers=1, num_experts=EXPERTS, seed=4)
    plan = RefitPlan.build(list(state.items()), RefitSpec(model_type="qwen3_5_moe", fmt=fmt))
    slabs = [u for u in plan.units if u.kind is UnitKind.SLAB and u.fmt is not None]
    assert slabs and all(len(u.scale_groups) in (EXPERTS, 2 * EXPERTS) for u in slabs)
    return state, plan, slabs


def _outputs(unit) -> dict[str, torch.Tensor]:
    return {o.name: torch.empty(o.shape, dtype=o.dtype) for o in unit.outputs}


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_a_slab_unit_takes_one_split_per_pass(fmt: Format, monkeypatch: pytest.MonkeyPatch):
    state, _, slabs = _slab_units(fmt)
    splits: list[int] = []
    real = cpu._POOL.run_many
    monkeypatch.setattr(cpu._POOL, "run_many", lambda calls: splits.append(len(calls)) or real(calls))
    for unit in slabs:
        splits.clear()
        run_unit(unit, state, _outputs(unit))
        projections = sum(len(g) for g in unit.scale_groups)
        if fmt in SHARED_SCALE:  # a scale a group (gate and up share one), then the kernels
            assert splits == [EXPERTS, projections], unit.inputs
        else:
            assert splits == [projections], unit.inputs


@pytest.mark.parametrize(
    "fmt", [Format.NVFP4, Format.MXFP4, Format.INT4_W4A16, Format.MXFP8, Format.BLOCK_FP8]
)
def test_nan_in_one_expert_of_a_slab_names_that_expert(fmt: Format):
    state, _, _ = _slab_units(fmt)
    name = next(n for n in state if n.endswith("experts.gate_up_proj"))
    slab = state[name].clone()
    inter = slab.shape[1] // 2
    slab[5, inter + 3, 7] = float("nan")  # expert 5's up_proj
    state[name] = slab
    with pytest.raises(ValueError, match="NaN or Inf") as err:
        convert(state, RefitSpec(model_type="qwen3_5_moe", fmt=fmt))
    assert "experts.5.up_proj" in str(err.value)
    assert "experts.4." not in str(err.value) and "experts.6." not in str(err.value)


def test_prepared_calls_mixing_native_and_reference_give_each_its_own_bytes():
    """run_prepared over calls of which some take the reference (float32 input, a non-foldable
    view) returns what each call alone returns, in order."""
    gen = torch.Generator().manual_seed(9)
    a = torch.randn(64, 256, generator=gen).mul(0.02).bfloat16()
    b = torch.randn(32, 128, generator=gen).mul(0.02)  # float32: the reference
    c = torch.randn(96, 512, generator=gen).mul(0.02).bfloat16()[:, ::2].contiguous().t()  # strided rows
    d = torch.randn(256, 2048, generator=gen).mul(0.02).bfloat16()
    for fmt in (Format.MXFP4, Format.INT4_W4A16, Format.MXFP8, Format.BLOCK_FP8):
        alone = [cpu.quantize(t, fmt) for t in (a, b, c, d)]
        together = cpu.run_prepared([cpu.prepare(t, fmt) for t in (a, b, c, d)])
        for one, other in zip(alone, together, strict=True):
            for x, y in zip(one, other, strict=True):
                assert x.dtype == y.dtype and x.shape == y.shape
                assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), fmt
