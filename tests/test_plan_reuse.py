"""A CPU quantizing unit's kernel calls kept for its next run on the same buffers (sidecar.plan.reuse), as
the daemon runs a slab unit step after step on the same staging and arena views: the kept run writes the
bytes a fresh one does for the new input (INT4's weight_shape too), a NaN that arrives later still raises
the reference's error naming the expert, and other buffers (another address, other strides) take the
full path with its checks."""

from __future__ import annotations

import pytest
import torch

from sidecar.cli.demo.synthetic import make_state_dict
from sidecar.numerics import cpu, native
from sidecar.numerics.checks import NonFiniteError
from sidecar.numerics.formats import DEFAULT_FORMAT_PARAMS, FP8_DTYPE, Format, FormatParams, Nvfp4Names
from sidecar.plan.build import RefitPlan, RefitSpec, UnitKind
from sidecar.plan.run import run_quantized_units, run_unit

pytestmark = pytest.mark.skipif(native.load() is None, reason="no C compiler: the native kernels are off")

#: formats, and NVFP4 under compressed-tensors' names too (its global scale published as 1 / gs)
CT = FormatParams(nvfp4_names=Nvfp4Names.COMPRESSED_TENSORS)
KEPT = [
    (Format.BLOCK_FP8, DEFAULT_FORMAT_PARAMS),
    (Format.MXFP8, DEFAULT_FORMAT_PARAMS),
    (Format.FP8_PER_TENSOR, DEFAULT_FORMAT_PARAMS),
    (Format.NVFP4, DEFAULT_FORMAT_PARAMS),
    (Format.NVFP4, CT),
    (Format.MXFP4, DEFAULT_FORMAT_PARAMS),
    (Format.INT4_W4A16, DEFAULT_FORMAT_PARAMS),
]
IDS = ["block_fp8", "mxfp8", "fp8_per_tensor", "nvfp4", "nvfp4-compressed-tensors", "mxfp4", "int4_w4a16"]
EXPERTS = 8  # a shared scale's formats keep their group pipeline: at least 2 groups a thread


def _slabs(fmt_params, model: str = "qwen3_5_moe"):
    fmt, params = fmt_params
    state = make_state_dict(model, num_layers=1, num_experts=EXPERTS, seed=9)
    plan = RefitPlan.build(list(state.items()), RefitSpec(model_type=model, fmt=fmt, params=params))
    units = [
        u for u in plan.units if u.fmt is not None and (u.kind is UnitKind.SLAB or model != "qwen3_5_moe")
    ]
    assert units
    return state, units


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def _reference(unit, inputs, monkeypatch) -> dict[str, torch.Tensor]:
    """The unit run by the torch reference (the native library off): what every run must write."""
    out = {o.name: torch.zeros(o.shape, dtype=o.dtype) for o in unit.outputs}
    with monkeypatch.context() as m:
        m.setattr(native, "load", lambda: None)
        run_unit(unit, inputs, out)
    return out


def _count_prepares(monkeypatch) -> list[str]:
    """Each call the full path prepares (its per-projection prepares, its group calls), as it happens."""
    seen: list[str] = []
    for name in ("prepare", "prepare_int4", "quantize_nvfp4_groups", "quantize_fp8_per_tensor_groups"):
        real = getattr(cpu, name)
        monkeypatch.setattr(
            cpu, name, lambda *a, _real=real, _name=name, **k: seen.append(_name) or _real(*a, **k)
        )
    return seen


@pytest.mark.parametrize("fmt", KEPT, ids=IDS)
def test_a_unit_run_again_on_its_buffers_writes_what_a_fresh_run_does(fmt, monkeypatch):
    state, units = _slabs(fmt)
    prepared = _count_prepares(monkeypatch)
    g = torch.Generator().manual_seed(3)
    for unit in units:
        out = {o.name: torch.zeros(o.shape, dtype=o.dtype) for o in unit.outputs}
        run_unit(unit, state, out)
        assert prepared, "the first run took no native call"
        for _ in range(2):  # the trainer's next steps: new values in the same staging buffer
            for n in unit.inputs:
                state[n].copy_(torch.randn(state[n].shape, generator=g) * 0.05)
            for t in out.values():
                t.zero_()  # INT4's weight_shape must be written again too
            before = len(prepared)
            run_unit(unit, state, out)
            assert len(prepared) == before, "a run on the same buffers prepared its calls again"
            want = _reference(unit, state, monkeypatch)
            for name, t in out.items():
                assert torch.equal(_bits(t), _bits(want[name])), name


@pytest.mark.parametrize("fmt", KEPT, ids=IDS)
def test_a_nan_arriving_after_the_calls_were_kept_names_its_expert(fmt):
    state, units = _slabs(fmt)
    unit = next(u for u in units if "gate_up" in u.inputs[0])
    out = {o.name: torch.zeros(o.shape, dtype=o.dtype) for o in unit.outputs}
    run_unit(unit, state, out)
    run_unit(unit, state, out)  # now kept
    slab = state[unit.inputs[0]]
    slab[2, 7, 5] = float("nan")  # expert 2's gate rows
    with pytest.raises(NonFiniteError, match=r"experts\.2\.gate_proj"):
        run_unit(unit, state, out)
    slab[2, 7, 5] = 0.0
    run_unit(unit, state, out)  # and the unit runs again once the input is finite


@pytest.mark.parametrize("fmt", KEPT, ids=IDS)
def test_other_buffers_take_the_full_path_and_its_checks(fmt, monkeypatch):
    state, units = _slabs(fmt)
    unit = units[0]
    out = {o.name: torch.zeros(o.shape, dtype=o.dtype) for o in unit.outputs}
    run_unit(unit, state, out)
    run_unit(unit, state, out)
    # the same first output's bytes, read as an overlapping view: a layout never checked, refused
    name = unit.outputs[0].name
    q = out[name]
    bad = dict(out)
    bad[name] = q.as_strided(q.shape, (1,) * q.dim())
    with pytest.raises(ValueError, match="share memory"):
        run_unit(unit, state, bad)
    moved = {n: t.clone() for n, t in out.items()}  # other addresses: run, and right
    run_unit(unit, state, moved)
    want = _reference(unit, state, monkeypatch)
    for n, t in moved.items():
        assert torch.equal(_bits(t), _bits(want[n])), n


@pytest.mark.parametrize("fmt", KEPT, ids=IDS)
def test_per_expert_units_batched_are_kept_too(fmt, monkeypatch):
    """Qwen3-MoE's units (an expert's projections each) run together by run_quantized_units, as the
    daemon's worker batches them: kept under all of the batch's units."""
    state, units = _slabs(fmt, "qwen3_moe")
    units = [u for u in units if ".experts." in u.inputs[0]]
    outs = [{o.name: torch.zeros(o.shape, dtype=o.dtype) for o in u.outputs} for u in units]
    ins = [{n: state[n] for n in u.inputs} for u in units]
    prepared = _count_prepares(monkeypatch)
    assert run_quantized_units(units, ins, outs)
    first = len(prepared)
    assert first > 0
    for t in state.values():
        t.mul_(0.5)
    assert run_quantized_units(units, ins, outs)
    assert len(prepared) == first, "a batch on the same buffers prepared its calls again"
    for unit, out in zip(units, outs, strict=True):
        want = _reference(unit, state, monkeypatch)
        for n, t in out.items():
            assert torch.equal(_bits(t), _bits(want[n])), n
