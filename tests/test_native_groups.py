"""Scale groups through the native group pipeline (native/common.h's run_groups: FP8 per-tensor's
``refitd_fp8_per_tensor_groups``, NVFP4's ``refitd_nvfp4_groups``): each group's amax read while the group
before it converts. Byte for byte the torch reference's scales and values for every member, on groups of
unequal sizes, strided slab views, amaxes across the binades (an all-zero group, tiny ones on e4m3's
subnormals), on one thread and split across two; a NaN names its group; and the same bytes from builds
for CPUs without AVX-512 (fp8_vec.h's REFITD_FP8_VEC off: quant.c's plain loops) and without AVX2.
"""

from __future__ import annotations

import platform
import threading
from pathlib import Path

import pytest
import torch

from sidecar.numerics import cpu, cpu_fourbit, fourbit, native, threads
from sidecar.numerics import reference as ref
from sidecar.numerics.formats import FP8_DTYPE, Format
from tests.support.native_builds import LEVELS, build_for

pytestmark = pytest.mark.skipif(native.load() is None, reason="no C compiler: the native kernels are off")


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return (
        t.view(torch.uint8)
        if t.element_size() == 1
        else t.view(torch.int16 if t.element_size() == 2 else torch.int32)
    )


def _groups(seed: int, cols: int = 256) -> list[list[torch.Tensor]]:
    """Groups of one to three members of unequal rows, magnitudes 1e-30 .. 1e4, some members strided views
    of a slab (rows of a [experts, 2 rows, cols] tensor), an all-zero group."""
    g = torch.Generator().manual_seed(seed)
    slab = (torch.randn(3, 2 * 48, cols, generator=g) * 0.02).bfloat16()
    groups: list[list[torch.Tensor]] = []
    for i in range(9):
        members = []
        for _ in range(1 + i % 3):
            rows = int(torch.randint(1, 40, (), generator=g))
            scale = 10.0 ** float(torch.randint(-30, 5, (), generator=g))
            members.append((torch.randn(rows, cols, generator=g) * scale).bfloat16())
        groups.append(members)
    groups.append([slab[e, :48] for e in range(2)] + [slab[2, 48:]])  # views into one slab
    groups.append([torch.zeros(8, cols, dtype=torch.bfloat16)])  # amax 0: scale 1
    groups.append([(torch.randn(16, cols, generator=g) * 1e-38).bfloat16()])  # subnormal bf16
    return groups


def _fp8_call(groups):
    outs = [[(torch.empty(t.shape, dtype=FP8_DTYPE), torch.empty(())) for t in ts] for ts in groups]
    jobs = [
        (ts, o, [f"grp{k}-m{i}" for i in range(len(ts))], f"grp{k}-all")
        for k, (ts, o) in enumerate(zip(groups, outs))
    ]
    return cpu.quantize_fp8_per_tensor_groups(jobs), outs


def _nvfp4_call(groups):
    outs = [[fourbit.nvfp4_outputs(t, None, None) for t in ts] for ts in groups]  # new buffers
    jobs = [
        (ts, o, [f"grp{k}-m{i}" for i in range(len(ts))], f"grp{k}-all")
        for k, (ts, o) in enumerate(zip(groups, outs))
    ]
    return cpu.quantize_nvfp4_groups(jobs), outs


def _check_fp8(groups, scales, outs) -> None:
    for ts, o, scale in zip(groups, outs, scales, strict=True):
        want = ref.fp8_per_tensor_scale(*ts)
        assert torch.equal(_bits(scale), _bits(want))
        for t, (q, s) in zip(ts, o, strict=True):
            wq, ws = ref.quantize_fp8_per_tensor(t, scale=want)
            assert torch.equal(_bits(q), _bits(wq)) and torch.equal(_bits(s), _bits(ws))


def _check_nvfp4(groups, scales, outs) -> None:
    for ts, o, gs in zip(groups, outs, scales, strict=True):
        want = fourbit.nvfp4_global_scale(*ts)
        assert torch.equal(_bits(gs), _bits(want))
        for t, got in zip(ts, o, strict=True):
            for x, y in zip(got, fourbit.quantize_nvfp4(t, global_scale=want), strict=True):
                assert torch.equal(_bits(x), _bits(y))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("seed", [1, 2])
def test_groups_through_the_pipeline_give_the_references_bytes(threads: int, seed: int, monkeypatch):
    monkeypatch.setattr(cpu_fourbit, "GROUPS_PER_THREAD", 1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        groups = _groups(seed)
        jobs = [
            (
                ts,
                [(torch.empty(t.shape, dtype=FP8_DTYPE), torch.empty(())) for t in ts],
                [None] * len(ts),
                "g",
            )
            for ts in groups
        ]
        assert cpu._fp8_per_tensor_pipeline(jobs) is not None  # the native group runner takes these
        _check_fp8(groups, *_fp8_call(groups))
        _check_nvfp4(groups, *_nvfp4_call(groups))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads_", [1, 2])
@pytest.mark.parametrize("fmt", [Format.FP8_PER_TENSOR, Format.NVFP4])
@pytest.mark.parametrize("bad", [[0], [4], [11], [3, 7]])
def test_nan_names_the_first_group_holding_it(fmt: Format, bad: list[int], threads_: int, monkeypatch):
    """A NaN or Inf in group k (the first, one inside the run, the last; or two) raises the reference's
    error naming group k's members, whatever groups the other thread took."""
    monkeypatch.setattr(cpu_fourbit, "GROUPS_PER_THREAD", 1)
    groups = _groups(3)
    for k, value in zip(bad, (float("nan"), float("inf"))):
        groups[k][-1] = groups[k][-1].clone()
        groups[k][-1][0, 5] = value
    call = _fp8_call if fmt is Format.FP8_PER_TENSOR else _nvfp4_call
    before = torch.get_num_threads()
    torch.set_num_threads(threads_)
    try:
        with pytest.raises(ValueError, match="NaN or Inf") as err:
            call(groups)
    finally:
        torch.set_num_threads(before)
    assert f"grp{bad[0]}-" in str(err.value)
    assert not any(f"grp{k}-" in str(err.value) for k in range(len(groups)) if k != bad[0])


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the -march levels below are x86-64's")
@pytest.mark.parametrize("march", list(LEVELS))
def test_builds_without_avx512_give_the_same_bytes(march: str, tmp_path: Path, monkeypatch):
    """fp8_vec.h's AVX-512 conversions and the group runners' builds for CPUs without AVX-512 (x86-64-v3:
    AVX2, where REFITD_FP8_VEC is 0 and quant.c's plain loops run), without AVX2, and with AVX-512 but no
    VBMI (x86-64-v4: Skylake-X and Cascade Lake servers; the build once failed to compile there, leaving
    the torch reference): the reference's bytes for every FP8 format and both group runners."""
    lib = build_for(march, tmp_path)
    monkeypatch.setattr(native, "load", lambda: lib)
    monkeypatch.setattr(cpu_fourbit, "GROUPS_PER_THREAD", 1)
    groups = _groups(5, cols=1056)
    _check_fp8(groups, *_fp8_call(groups))
    _check_nvfp4(groups, *_nvfp4_call(groups))
    g = torch.Generator().manual_seed(6)
    ragged = (
        torch.randn(9, 1056, generator=g) * 10.0 ** torch.randint(-40, 6, (9, 1), generator=g)
    ).bfloat16()
    slab = (torch.randn(2, 256, 384, generator=g) * 0.02).bfloat16()
    for x in (ragged, slab, slab[:, 5:200]):
        for fmt in (Format.BLOCK_FP8, Format.MXFP8, Format.FP8_PER_TENSOR):
            for got, want in zip(cpu.quantize(x, fmt), ref.quantize(x, fmt), strict=True):
                assert torch.equal(_bits(got), _bits(want)), fmt
        scale = torch.tensor(1e-3)
        for got, want in zip(
            cpu.quantize_fp8_per_tensor(x, scale=scale),
            ref.quantize_fp8_per_tensor(x, scale=scale),
            strict=True,
        ):
            assert torch.equal(_bits(got), _bits(want))


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the -march levels below are x86-64's")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64-v4"])
def test_fp8_without_vbmi_every_bf16_pattern(march: str, tmp_path: Path, monkeypatch):
    """quant.c's AVX2 float path (the FP8 conversion where fp8_vec.h's byte tables are not built: no
    AVX-512 VBMI) on every finite bfloat16 value: in block-FP8 tiles and MXFP8 blocks sorted (values
    near 448), shuffled (e4m3 subnormals) and under chosen amaxes, and FP8 per-tensor under shared scales
    that clamp past 448, scale into the subnormals and hit exact ties: the reference's bytes."""
    from tests.test_native_quant import _finite_bf16_patterns

    lib = build_for(march, tmp_path)
    monkeypatch.setattr(native, "load", lambda: lib)
    x = _finite_bf16_patterns()
    order = torch.argsort(x.view(torch.int16).to(torch.int32) & 0x7FFF, stable=True)
    shuffled = torch.randperm(x.numel(), generator=torch.Generator().manual_seed(1))
    for fmt, cols in ((Format.BLOCK_FP8, 128), (Format.MXFP8, 32)):
        for arranged in (x[order], x[shuffled]):
            w = arranged[: x.numel() // cols * cols].reshape(-1, cols).clone()
            for got, want in zip(cpu.quantize(w, fmt), ref.quantize(w, fmt), strict=True):
                assert torch.equal(_bits(got), _bits(want)), fmt
    w = x.reshape(-1, 120)
    for scale in (1.0, 2.0**-10, 2.0**10, 0.7, 1.0 / 448.0, 2.0**-126):
        s = torch.tensor(scale, dtype=torch.float32)
        for got, want in zip(
            cpu.quantize_fp8_per_tensor(w, scale=s), ref.quantize_fp8_per_tensor(w, scale=s), strict=True
        ):
            assert torch.equal(_bits(got), _bits(want)), scale


@pytest.mark.parametrize("fmt", [Format.FP8_PER_TENSOR, Format.NVFP4])
def test_threads_claim_groups_from_a_shared_counter(fmt: Format, monkeypatch):
    """The pipeline's call hands its groups out itself (threads.Claims): a thread running it takes the
    groups from the counter's value on, one at a time, and leaves the ones before untouched; the
    counter ends past the last group; and two threads sharing the counter, each running the call
    whole, together write every group's bytes once (the reference's)."""
    monkeypatch.setattr(cpu_fourbit, "GROUPS_PER_THREAD", 1)
    groups = _groups(4)
    if fmt is Format.FP8_PER_TENSOR:
        outs = [
            [(torch.full(t.shape, 0x7F, dtype=torch.uint8).view(FP8_DTYPE), torch.empty(())) for t in ts]
            for ts in groups
        ]
        jobs = [(ts, o, [None] * len(ts), "g") for ts, o in zip(groups, outs)]
        call = cpu._fp8_per_tensor_pipeline(jobs)
    else:
        outs = [[fourbit.nvfp4_outputs(t, None, None) for t in ts] for ts in groups]
        for o in outs:
            for q, s, _ in o:
                q.fill_(0x7F), s.view(torch.uint8).fill_(0x7F)
        jobs = [(ts, o, [None] * len(ts), "g") for ts, o in zip(groups, outs)]
        call = cpu_fourbit._nvfp4_pipeline(jobs)
    assert isinstance(call.split, threads.Claims)
    start = 5
    call.split.counter.value = start
    assert call.share(0, call.units) == -1
    assert call.split.counter.value > len(groups) - 1
    for k, o in enumerate(outs):
        first = o[0][0].view(torch.uint8)
        assert bool((first == 0x7F).all()) == (k < start), k  # groups before the counter's value untouched

    call.split.counter.value = 0  # two threads sharing the counter, each running the call whole
    found: list[int] = []
    runners = [threading.Thread(target=lambda: found.append(call.share(0, call.units))) for _ in range(2)]
    for r in runners:
        r.start()
    for r in runners:
        r.join(60)
    assert found == [-1, -1]
    scales = call.finish([-1, -1])
    (_check_fp8 if fmt is Format.FP8_PER_TENSOR else _check_nvfp4)(groups, scales, outs)


def test_a_pool_of_one_share_a_thread_runs_a_claiming_call_in_shares(monkeypatch):
    """bench/pool.py's halves (chunks_per_thread 1): the pipeline's call is cut into one run of groups a
    thread, through the runner without the counter; the bytes are the same."""
    monkeypatch.setattr(cpu_fourbit, "GROUPS_PER_THREAD", 1)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        from sidecar.numerics.native_calls import POOL

        groups = _groups(5)
        outs = [[fourbit.nvfp4_outputs(t, None, None) for t in ts] for ts in groups]
        jobs = [(ts, o, [None] * len(ts), "g") for ts, o in zip(groups, outs)]
        ran: list = []
        POOL.chunks_per_thread = 1
        try:
            _check_nvfp4(groups, cpu.quantize_nvfp4_groups(jobs, ran), outs)
            _check_fp8(groups, *_fp8_call(groups))
        finally:
            POOL.chunks_per_thread = threads.CHUNKS_PER_THREAD
        assert ran and ran[0].split.whole is False  # cut into shares, not run whole on each thread
    finally:
        torch.set_num_threads(before)
