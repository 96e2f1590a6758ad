"""A slab unit's expert projections run as one split across the quantizer threads, not one hand-off
each (sidecar.plan.run._quantize_groups through sidecar.numerics.cpu.run_prepared): with enough scale
groups (NVFP4's and FP8 per-tensor's: an expert's gate and up), the groups as one call of whole groups
(the native group pipeline), else the
shared scales of every group in one ``run_many``, every projection's kernel in another; the bytes are the
reference's on each source slice (tests/test_plan.py, test_plan_fourbit.py check every output), and
a NaN in one expert of the slab still names that expert."""

from __future__ import annotations

import pytest
import torch

from sidecar.cli.demo.synthetic import make_state_dict
from sidecar.numerics import cpu, cpu_fourbit, fourbit, native, native_calls
from sidecar.numerics import reference as ref
from sidecar.numerics.formats import DEFAULT_FORMAT_PARAMS, Format, FormatParams
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


def _slab_units(
    fmt: Format, params: FormatParams = DEFAULT_FORMAT_PARAMS
) -> tuple[dict[str, torch.Tensor], RefitPlan, list]:
    state = make_state_dict("qwen3_5_moe", num_layers=1, num_experts=EXPERTS, seed=4)
    spec = RefitSpec(model_type="qwen3_5_moe", fmt=fmt, params=params)
    plan = RefitPlan.build(list(state.items()), spec)
    slabs = [u for u in plan.units if u.kind is UnitKind.SLAB and u.fmt is not None]
    assert slabs and all(len(u.scale_groups) in (EXPERTS, 2 * EXPERTS) for u in slabs)
    return state, plan, slabs


def _outputs(unit) -> dict[str, torch.Tensor]:
    return {o.name: torch.empty(o.shape, dtype=o.dtype) for o in unit.outputs}


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_a_slab_unit_takes_one_split_per_pass(fmt: Format, monkeypatch: pytest.MonkeyPatch):
    state, _, slabs = _slab_units(fmt)
    splits: list[int] = []
    real = native_calls.POOL.run_many
    monkeypatch.setattr(native_calls.POOL, "run_many", lambda calls: splits.append(len(calls)) or real(calls))
    for unit in slabs:
        splits.clear()
        run_unit(unit, state, _outputs(unit))
        projections = sum(len(g) for g in unit.scale_groups)
        if fmt in SHARED_SCALE:  # the groups as one call (a unit a group): the native group pipeline
            assert splits == [1], unit.inputs
        else:
            assert splits == [projections], unit.inputs


@pytest.mark.parametrize("groups_per_thread", [1, 1000])
def test_nvfp4_groups_whole_or_split_give_the_same_bytes(groups_per_thread: int, monkeypatch):
    """NVFP4's groups run whole on a thread each (enough of them to share the threads) or as two
    split passes (too few): the same bytes as the torch reference either way, under both names."""
    monkeypatch.setattr(cpu_fourbit, "GROUPS_PER_THREAD", groups_per_thread)
    splits: list[int] = []
    real = native_calls.POOL.run_many
    monkeypatch.setattr(native_calls.POOL, "run_many", lambda calls: splits.append(len(calls)) or real(calls))
    for names in ("modelopt", "compressed_tensors"):
        state, _, slabs = _slab_units(Format.NVFP4, params=FormatParams(nvfp4_names=names))
        for unit in slabs:
            splits.clear()
            got = _outputs(unit)
            run_unit(unit, state, got)
            projections = sum(len(g) for g in unit.scale_groups)
            assert splits == ([1] if groups_per_thread == 1 else [EXPERTS, projections])
            for group in unit.scale_groups:
                members = [o for o in unit.outputs if o.name in group]
                views = [o.source_view(state[o.source]) for o in members]
                gs = fourbit.nvfp4_global_scale(*views)
                for o, v in zip(members, views, strict=True):
                    q, s, g = fourbit.quantize_nvfp4(v, global_scale=gs)
                    if names == "compressed_tensors":
                        g = torch.reciprocal(g).reshape(1)
                    for buf, want in zip(o.quantized_outputs, (q, s, g), strict=True):
                        same = torch.equal(
                            got[buf].reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)
                        )
                        assert same, buf


@pytest.mark.parametrize("groups_per_thread", [1, 1000])
def test_fp8_per_tensor_groups_whole_or_split_give_the_same_bytes(groups_per_thread: int, monkeypatch):
    """FP8 per-tensor's groups (an expert's gate and up share a scale) whole on a thread each, or as two
    split passes: the reference's scale and bytes for every projection either way."""
    monkeypatch.setattr(cpu_fourbit, "GROUPS_PER_THREAD", groups_per_thread)
    splits: list[int] = []
    real = native_calls.POOL.run_many
    monkeypatch.setattr(native_calls.POOL, "run_many", lambda calls: splits.append(len(calls)) or real(calls))
    state, _, slabs = _slab_units(Format.FP8_PER_TENSOR)
    for unit in slabs:
        splits.clear()
        got = _outputs(unit)
        run_unit(unit, state, got)
        projections = sum(len(g) for g in unit.scale_groups)
        assert splits == ([1] if groups_per_thread == 1 else [EXPERTS, projections])
        for group in unit.scale_groups:
            members = [o for o in unit.outputs if o.name in group]
            views = [o.source_view(state[o.source]) for o in members]
            scale = ref.fp8_per_tensor_scale(*views)
            for o, v in zip(members, views, strict=True):
                q, s = ref.quantize_fp8_per_tensor(v, scale=scale)
                assert torch.equal(got[o.name].view(torch.uint8), q.view(torch.uint8)), o.name
                assert torch.equal(got[o.scale_name].view(torch.int32), s.view(torch.int32)), o.scale_name


def test_fp8_per_tensor_groups_with_a_member_off_the_native_path_match_the_reference(monkeypatch):
    """A group one of whose tensors the native kernels do not take (a transposed view), beside whole
    groups on the threads: every group's scale and bytes are the reference's."""
    monkeypatch.setattr(cpu_fourbit, "GROUPS_PER_THREAD", 1)
    gen = torch.Generator().manual_seed(5)
    tensors = [[torch.randn(64, 256, generator=gen).mul(0.02).bfloat16() for _ in range(2)] for _ in range(5)]
    tensors[3][0] = torch.randn(256, 64, generator=gen).mul(0.02).bfloat16().t()
    groups, outs = [], []
    for k, ts in enumerate(tensors):
        o = [(torch.empty(t.shape, dtype=torch.float8_e4m3fn), torch.empty(())) for t in ts]
        outs.append(o)
        groups.append((ts, o, [f"g{k}.gate", f"g{k}.up"], f"g{k}.gate + g{k}.up"))
    scales = cpu.quantize_fp8_per_tensor_groups(groups)
    for ts, o, scale in zip(tensors, outs, scales, strict=True):
        want = ref.fp8_per_tensor_scale(*ts)
        assert torch.equal(scale.view(torch.int32), want.view(torch.int32))
        for t, (q, s) in zip(ts, o, strict=True):
            wq, ws = ref.quantize_fp8_per_tensor(t, scale=want)
            assert torch.equal(q.view(torch.uint8), wq.view(torch.uint8))
            assert torch.equal(s.view(torch.int32), ws.view(torch.int32))


@pytest.mark.parametrize("groups_per_thread", [1, 1000])
@pytest.mark.parametrize(
    "fmt",
    [Format.NVFP4, Format.MXFP4, Format.INT4_W4A16, Format.MXFP8, Format.BLOCK_FP8, Format.FP8_PER_TENSOR],
)
def test_nan_in_one_expert_of_a_slab_names_that_expert(fmt: Format, groups_per_thread: int, monkeypatch):
    monkeypatch.setattr(cpu_fourbit, "GROUPS_PER_THREAD", groups_per_thread)
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


def test_nvfp4_groups_with_a_member_off_the_native_path_match_the_reference(monkeypatch):
    """A group one of whose tensors the native kernels do not take (a transposed view) runs as
    quantize_nvfp4 would, beside whole groups on the threads: every group's bytes are the reference's."""
    monkeypatch.setattr(cpu_fourbit, "GROUPS_PER_THREAD", 1)
    gen = torch.Generator().manual_seed(3)

    def bf16(*shape):
        return torch.randn(*shape, generator=gen).mul(0.02).bfloat16()

    tensors = [[bf16(64, 256), bf16(64, 256)] for _ in range(5)]
    tensors[2][1] = bf16(256, 64).t()  # last dim strided: the reference's path
    groups, outs = [], []
    for k, ts in enumerate(tensors):
        o = [tuple(torch.empty(s, dtype=d) for s, d in _nvfp4_buffers(t)) for t in ts]
        outs.append(o)
        groups.append((ts, o, [f"g{k}.gate", f"g{k}.up"], f"g{k}.gate + g{k}.up"))
    scales = cpu.quantize_nvfp4_groups(groups)
    for ts, o, gs in zip(tensors, outs, scales, strict=True):
        want_gs = fourbit.nvfp4_global_scale(*ts)
        assert torch.equal(gs.view(torch.int32), want_gs.view(torch.int32))
        for t, got in zip(ts, o, strict=True):
            for x, y in zip(got, fourbit.quantize_nvfp4(t, global_scale=want_gs), strict=True):
                assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))


def _nvfp4_buffers(t: torch.Tensor):
    shape = tuple(t.shape)
    return [
        (Format.NVFP4.weight_shape(shape), Format.NVFP4.weight_dtype),
        (Format.NVFP4.scale_shape(shape), Format.NVFP4.scale_dtype),
        ((), torch.float32),
    ]
