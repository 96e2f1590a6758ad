"""The native CPU quantizers (sidecar/numerics/native/quant.c) through sidecar.numerics.cpu: byte for
byte the torch reference's output, errors and fallbacks.

Every comparison is on bits (``.view(torch.uint8)`` / float32 bit patterns): values, scales and error
messages must be the reference's exactly. Skipped only where no C compiler exists at all; a compiler
that exists but fails to build quant.c fails ``test_native_builds_and_loads``.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import shutil
import signal
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from sidecar.numerics import cpu, native, native_calls, threads
from sidecar.numerics import reference as ref
from sidecar.numerics.cases import CASES, Case
from sidecar.numerics.formats import FP8_DTYPE, Format

pytestmark = pytest.mark.skipif(
    shutil.which(native.compiler()[0]) is None, reason="no C compiler: the native quantizers cannot be built"
)

FORMATS = (Format.BLOCK_FP8, Format.MXFP8, Format.FP8_PER_TENSOR)


@pytest.fixture
def fresh_native(monkeypatch: pytest.MonkeyPatch):
    """Forget the process's native decision before and after a test that changes the environment."""
    native.reset()
    yield monkeypatch
    monkeypatch.undo()
    native.reset()


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == FP8_DTYPE:
        return t.view(torch.uint8)
    if t.dtype == torch.float32:
        return t.contiguous().view(torch.int32)
    return t


def _assert_same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    for g, w, what in zip(got, want, ("values", "scales")):
        assert g.dtype == w.dtype and g.shape == w.shape, what
        gb, wb = _bits(g), _bits(w)
        if not torch.equal(gb, wb):
            bad = torch.nonzero(gb != wb)[0].tolist()
            raise AssertionError(f"{what} differ first at {bad}: {gb[tuple(bad)]} != {wb[tuple(bad)]}")


def _both(w: torch.Tensor, fmt: Format, **kw) -> None:
    """cpu.quantize and the reference on ``w``, into NaN-filled out= buffers and allocating."""
    want = ref.quantize(w, fmt, **kw)
    _assert_same(cpu.quantize(w, fmt, **kw), want)
    q = torch.full(w.shape, 0x7F, dtype=torch.uint8).view(FP8_DTYPE)
    s = torch.full(want[1].shape, 255, dtype=torch.uint8).view(want[1].dtype) if fmt is Format.MXFP8 else None
    if s is None:
        s = torch.full(want[1].shape, float("nan"), dtype=torch.float32)
    got = cpu.quantize(w, fmt, out=(q, s), **kw)
    assert got[0] is q and got[1] is s
    _assert_same(got, want)


def test_native_builds_and_loads():
    """With a C compiler present, the kernels build and load: the CPU path is the native one."""
    native.reset()
    assert native.load() is not None, native.unavailable_reason()
    assert cpu.warm_up().impl == "native"
    assert cpu.native_applies(torch.zeros(128, 128, dtype=torch.bfloat16), Format.BLOCK_FP8)


# --------------------------------------------------------------------------------------------------
# exactness


def _as_bf16_case(case: Case) -> torch.Tensor | None:
    w = case.make()
    if w.dtype not in (torch.float16, torch.float32) or case.error:
        return None
    return w.bfloat16()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_edge_case_table(case: Case):
    """The shared table, as given (float16/float32 cases take the fallback) and cast to bfloat16 (the
    native path), against the reference; error cases raise the reference's exact message."""
    w = case.make()
    if case.error:
        with pytest.raises(ValueError) as want:
            ref.quantize(w, case.fmt, name="model.layers.0.mlp.experts.0.up_proj.weight")
        with pytest.raises(type(want.value)) as got:
            cpu.quantize(w, case.fmt, name="model.layers.0.mlp.experts.0.up_proj.weight")
        assert str(got.value) == str(want.value)
        return
    _both(w, case.fmt)
    as_bf16 = _as_bf16_case(case)
    if as_bf16 is not None and torch.isfinite(as_bf16).all():
        _both(as_bf16, case.fmt)


def _finite_bf16_patterns() -> torch.Tensor:
    """Every finite bfloat16 value (65536 patterns less Inf and NaN), as a 1-d tensor."""
    bits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16)
    finite = (bits.to(torch.int32) & 0x7FFF) < 0x7F80
    return bits[finite].view(torch.bfloat16)


@pytest.mark.parametrize("fmt", [Format.BLOCK_FP8, Format.MXFP8])
@pytest.mark.parametrize("arrangement", ["sorted", "shuffled", "with-amax"])
def test_every_bf16_pattern(fmt: Format, arrangement: str):
    """All finite bfloat16 values, in tiles / blocks whose amax puts them in every e4m3 binade, its
    subnormals and its rounding ties: sorted by magnitude (each block spans a narrow range, so most
    values scale near 448), shuffled (wide ranges, many subnormals), and with a chosen amax written
    into each block (a power of two, 448, 449, 464, 479, 480 times a power of two)."""
    x = _finite_bf16_patterns()
    if arrangement == "sorted":
        x = x[torch.argsort(x.view(torch.int16).to(torch.int32) & 0x7FFF, stable=True)]
    elif arrangement == "shuffled":
        x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(1))]
    cols = 128 if fmt is Format.BLOCK_FP8 else 32
    w = x[: x.numel() // cols * cols].reshape(-1, cols).clone()
    if arrangement == "with-amax":
        amaxes = torch.tensor([1.0, 448.0, 449.0, 464.0, 479.0, 480.0, 2.0**-100, 3.0e38]).bfloat16()
        rows = torch.arange(0, w.shape[0], 128 if fmt is Format.BLOCK_FP8 else 1)
        w[rows, 0] = amaxes[torch.arange(rows.numel()) % amaxes.numel()]
    _both(w, fmt)


@pytest.mark.parametrize(
    "scale",
    [1.0, 2.0**-10, 2.0**10, 0.7, 1.0 / 448.0, 2.0**-126, 3.0e38 / 448.0],
    ids=["one", "2^-10", "2^10", "0.7", "1/448", "FLT_MIN", "huge"],
)
def test_every_bf16_pattern_per_tensor_shared_scale(scale: float):
    """A caller's shared scale (clamped path): every finite bfloat16 value, scaled into e4m3's
    subnormals, exact ties (scale 1: 15.5, 232, ...), past 448 / 464 / 480 (saturating at +-448)."""
    x = _finite_bf16_patterns().reshape(-1, 120)
    w = torch.zeros(x.shape[0], 200, dtype=torch.bfloat16)[:, 40:160]  # rows with a stride
    w.copy_(x)
    s = torch.tensor(scale, dtype=torch.float32)
    if scale == 1.0:
        _both(w, Format.FP8_PER_TENSOR)
    want = ref.quantize_fp8_per_tensor(w, scale=s)
    _assert_same(cpu.quantize_fp8_per_tensor(w, scale=s), want)


def _f32_structured() -> torch.Tensor:
    """float32 values whose bits probe every rounding decision of the e4m3 cast: each exponent,
    each top-12-bit mantissa, and low bits just around the halfway points, both signs."""
    exp = torch.arange(0, 256, dtype=torch.int64) << 23
    top = torch.arange(0, 1 << 12, dtype=torch.int64) << 11
    low = torch.tensor([0, 1, 0x3FF, 0x400, 0x7FF], dtype=torch.int64)
    bits = (exp[:, None, None] | top[None, :, None] | low[None, None, :]).reshape(-1)
    bits = torch.cat([bits, bits | (1 << 31)])
    return (bits - ((bits >= (1 << 31)).to(torch.int64) << 32)).to(torch.int32).view(torch.float32)


def _convert(fn_name: str, x: torch.Tensor) -> torch.Tensor:
    lib = native.load()
    assert lib is not None
    q = torch.empty(x.shape, dtype=torch.uint8)
    getattr(lib, fn_name)(x.data_ptr(), q.data_ptr(), x.numel())
    return q


def test_conversion_is_torchs_cast():
    """quant.c's float32 -> e4m3fn conversions against torch's own cast, bit for bit: the full port
    of c10's function on every probed value (NaN, Inf, >= 480 included), and the fast one the
    quantizers use on every probed value below 464 (all they ever convert)."""
    x = _f32_structured()
    rng = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), generator=torch.Generator().manual_seed(2))
    x = torch.cat([x, rng.to(torch.int32).view(torch.float32)])
    want = x.to(FP8_DTYPE).view(torch.uint8)
    assert torch.equal(_convert("refitd_e4m3_from_f32", x), want)
    in_range = x[x.abs() < 464.0]
    assert in_range.numel() > 1_000_000
    assert torch.equal(
        _convert("refitd_e4m3_from_f32_in_range", in_range), in_range.to(FP8_DTYPE).view(torch.uint8)
    )


SHAPES = [(1, 1), (1, 32), (5, 160), (127, 129), (128, 128), (129, 4096 + 32), (3, 130, 257), (2, 2, 200, 96)]


@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
@pytest.mark.parametrize("fmt", FORMATS)
def test_random_ragged_shapes(shape: tuple[int, ...], fmt: Format):
    """Random values of several magnitudes (and a zeroed block) in ragged and batched shapes."""
    if fmt is Format.MXFP8 and shape[-1] % 32:
        shape = (*shape[:-1], shape[-1] // 32 * 32 + 32)
    g = torch.Generator().manual_seed(sum(shape))
    for magnitude in (1e-30, 0.02, 300.0, 1e30):
        w = (torch.randn(shape, generator=g) * magnitude).bfloat16()
        w.view(-1)[: min(w.numel(), 40)] = 0.0
        _both(w, fmt)


def test_slab_views_and_strided_outputs():
    """A gate_up slab's per-expert gate / up views (row stride = K, offset rows), a down slab with a
    ragged last tile, outputs that are themselves views of bigger buffers, and views the kernels
    cannot take (last dim not contiguous: the reference runs) all give the reference's bytes."""
    g = torch.Generator().manual_seed(5)
    gate_up = (torch.randn(3, 2 * 192, 320, generator=g) * 0.05).bfloat16()
    down = (torch.randn(3, 320, 192, generator=g) * 0.05).bfloat16()
    for e in range(3):
        for view in (gate_up[e, :192], gate_up[e, 192:], down[e], gate_up[e, :, 32:288], down[e].t()):
            for fmt in FORMATS:
                if fmt is Format.MXFP8 and view.shape[-1] % 32:
                    continue
                _both(view, fmt)
    # outputs that are views with a row stride (a bigger arena buffer)
    w = gate_up[1, 192:]
    big_q = torch.zeros(192, 512, dtype=torch.uint8).view(FP8_DTYPE)
    big_s = torch.zeros(2, 3, 4)
    q, s = cpu.quantize_block_fp8(w, out=(big_q[:, 100:420], big_s[1, :2, 1:4]))
    _assert_same((q, s), ref.quantize_block_fp8(w))
    # the whole slab in one call, batched
    for fmt in FORMATS:
        _both(gate_up, fmt)
        _both(gate_up[:, 192:], fmt)


def test_per_tensor_shared_scale_over_gate_and_up():
    """fp8_per_tensor_scale over gate and up (slab views) is the reference's, and each member
    quantized with it matches; a scale below amax/448 saturates at +-448 in both."""
    g = torch.Generator().manual_seed(6)
    slab = (torch.randn(2, 256, 384, generator=g) * 0.1).bfloat16()
    gate, up = slab[0, :128], slab[0, 128:]
    up[3, 7] = 5.0
    scale = cpu.fp8_per_tensor_scale(gate, up, name="gate + up")
    want = ref.fp8_per_tensor_scale(gate, up, name="gate + up")
    assert scale.dtype == torch.float32 and scale.shape == () and _bits(scale) == _bits(want)
    for member in (gate, up):
        _assert_same(
            cpu.quantize_fp8_per_tensor(member, scale=scale), ref.quantize_fp8_per_tensor(member, scale=want)
        )
    small = torch.tensor(0.001, dtype=torch.float32)
    got = cpu.quantize_fp8_per_tensor(up, scale=small)
    _assert_same(got, ref.quantize_fp8_per_tensor(up, scale=small))
    assert int(got[0].view(torch.uint8)[3, 7]) == 0x7E


# --------------------------------------------------------------------------------------------------
# refusals


def _message(fn) -> tuple[type, str]:
    with pytest.raises(ValueError) as err:
        fn()
    return type(err.value), str(err.value)


@pytest.mark.parametrize("bad", [float("nan"), -float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("fmt", FORMATS)
def test_non_finite_refused_with_the_references_message(fmt: Format, bad: float):
    """NaN / Inf anywhere (here in the second matrix's ragged last tile) is refused with exactly the
    reference's NonFiniteError, block named; nothing is ever quantized to something finite."""
    w = torch.zeros(2, 300, 256, dtype=torch.bfloat16)
    w[1, 290, 200] = bad
    name = "model.layers.3.mlp.experts.gate_up_proj"
    got = _message(lambda: cpu.quantize(w, fmt, name=name))
    assert got == _message(lambda: ref.quantize(w, fmt, name=name))
    assert got[0] is ref.NonFiniteError and name in got[1]


def test_non_finite_refused_by_shared_scale_paths():
    """fp8_per_tensor_scale over a group, and quantizing with a caller's scale, refuse NaN / Inf too."""
    gate, up = torch.zeros(64, 64, dtype=torch.bfloat16), torch.zeros(64, 64, dtype=torch.bfloat16)
    up[63, 63] = float("inf")
    got = _message(lambda: cpu.fp8_per_tensor_scale(gate, up, name="g + u"))
    assert got == _message(lambda: ref.fp8_per_tensor_scale(gate, up, name="g + u"))
    one = torch.tensor(1.0)
    got = _message(lambda: cpu.quantize_fp8_per_tensor(up, scale=one, name="u"))
    assert got == _message(lambda: ref.quantize_fp8_per_tensor(up, scale=one, name="u"))
    assert got[0] is ref.NonFiniteError


def test_bad_arguments_get_the_references_errors():
    """Shapes, dtypes, out= buffers and scales the reference refuses are refused in its words."""
    w = torch.zeros(128, 128, dtype=torch.bfloat16)
    cases = [
        (lambda m: m.quantize_mxfp8(torch.zeros(4, 100, dtype=torch.bfloat16), name="x")),
        (lambda m: m.quantize_block_fp8(torch.zeros(128, dtype=torch.bfloat16), name="x")),
        (lambda m: m.quantize_block_fp8(w, out=(torch.empty(128, 128, dtype=FP8_DTYPE), torch.empty(2, 2)))),
        (lambda m: m.quantize_fp8_per_tensor(w, scale=torch.ones(2), name="x")),
        (lambda m: m.quantize(w, "bf16")),
    ]
    for case in cases:
        assert _message(lambda case=case: case(cpu)) == _message(lambda case=case: case(ref))


# --------------------------------------------------------------------------------------------------
# threads


def test_work_is_split_across_threads_and_bytes_do_not_depend_on_it():
    """With 2 threads a large call runs its chunks on 2 threads (the caller and a pool worker), a
    small one on the caller alone; 1 and 2 threads give the same bytes."""
    pool = threads.Pool()
    seen: list[int] = []
    lock = threading.Lock()
    both = threading.Barrier(2, timeout=30)  # the first two chunks wait for each other: two threads

    def share(begin: int, end: int) -> int:
        with lock:
            first_two = len(seen) < 2 and end - begin > 1  # the large call's first two chunks
            seen.append(threading.get_ident())
        if first_two:
            both.wait()
        return end - begin

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert sum(pool.run(share, 64, cpu.MIN_SPLIT_ELEMS)) == 64
        assert len(set(seen)) == 2 and threading.get_ident() in seen
        seen.clear()
        assert pool.run(share, 1, 128) == [1] and seen == [threading.get_ident()]
        w = (torch.randn(4, 512, 1024, generator=torch.Generator().manual_seed(7)) * 0.02).bfloat16()
        two = {f: cpu.quantize(w, f) for f in FORMATS}
        torch.set_num_threads(1)
        for f in FORMATS:
            _assert_same(cpu.quantize(w, f), two[f])
    finally:
        torch.set_num_threads(before)


# --------------------------------------------------------------------------------------------------
# building, caching and falling back


def test_disabled_by_environment_falls_back(fresh_native, caplog):
    """REFITD_NATIVE=0: one WARNING saying so, and the reference quantizes (same bytes)."""
    fresh_native.setenv("REFITD_NATIVE", "0")
    with caplog.at_level(logging.WARNING, logger="sidecar.numerics.native"):
        w = torch.randn(130, 256).bfloat16()
        _assert_same(cpu.quantize(w, Format.BLOCK_FP8), ref.quantize(w, Format.BLOCK_FP8))
        cpu.quantize(w, Format.MXFP8)
    assert native.load() is None and not cpu.native_applies(w, Format.BLOCK_FP8)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "REFITD_NATIVE=0" in warnings[0].getMessage()
    assert "torch reference" in warnings[0].getMessage()
    done = cpu.warm_up()
    assert done.impl == "torch" and "REFITD_NATIVE=0" in done.reason


def _script(path: Path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize("compiler", ["missing", "false", "fails-to-compile"])
def test_no_working_compiler_falls_back(fresh_native, tmp_path: Path, caplog, compiler: str):
    """No compiler, one that fails everything (/bin/false), or one that fails only the compile:
    never an error, one WARNING naming what failed, and the reference's bytes."""
    cc = {
        "missing": str(tmp_path / "no-such-cc"),
        "false": "/bin/false",
        "fails-to-compile": _script(
            tmp_path / "cc",
            'case "$1" in --version) echo fake-cc 1.0;; *) echo "quant.c:1: error: nope" >&2; exit 1;; esac\n',
        ),
    }[compiler]
    fresh_native.setenv("REFITD_CC", cc)
    fresh_native.setenv("REFITD_NATIVE_DIR", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger="sidecar.numerics.native"):
        w = torch.randn(3, 64, 96).bfloat16()
        for fmt in FORMATS:
            _assert_same(cpu.quantize(w, fmt), ref.quantize(w, fmt))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and cc in warnings[0] and "torch reference" in warnings[0]
    if compiler == "fails-to-compile":
        assert "nope" in warnings[0]
        assert not list((tmp_path / "cache").glob("*.tmp")) and not list((tmp_path / "cache").glob("*.so"))


def test_build_cache_key_and_atomic_build(fresh_native, tmp_path: Path):
    """The cached library's name changes with the flags, the compiler and its version; a build
    lands under REFITD_NATIVE_DIR with no temporary file left, and is reused, not rebuilt."""
    cc = native.compiler()
    key = native.build_key(cc, version="gcc 12")
    assert native.build_key(cc, version="gcc 12") == key
    assert native.build_key(cc, (*native.FLAGS, "-DREFITD_X"), version="gcc 12") != key
    assert native.build_key(cc, version="gcc 13") != key
    assert native.build_key(["clang"], version="gcc 12") != key
    fresh_native.setenv("REFITD_NATIVE_DIR", str(tmp_path / "cache"))
    path = native.build()
    assert path.parent == tmp_path / "cache" and path.name.endswith(".so")
    assert [p.name for p in path.parent.iterdir()] == [path.name]
    mtime = os.stat(path).st_mtime_ns
    assert native.build() == path and os.stat(path).st_mtime_ns == mtime
    lib = ctypes.CDLL(str(path))
    assert lib.refitd_native_abi() == native.ABI


@pytest.mark.parametrize("fmt", FORMATS)
def test_plan_units_run_on_the_native_kernels(fmt: Format, monkeypatch: pytest.MonkeyPatch):
    """sidecar.plan.run (what the daemon calls per unit) quantizes a bf16 state dict's expert slabs
    through the native kernels, and every output is the reference's on its source slice."""
    import test_plan

    from sidecar.plan.build import RefitSpec
    from sidecar.plan.run import convert

    calls: list[int] = []
    real = native_calls.POOL.run_many
    monkeypatch.setattr(
        native_calls.POOL, "run_many", lambda many: calls.extend(c[1] for c in many) or real(many)
    )
    state = test_plan.make_state_dict("qwen3_5_moe", unaligned=True, seed=3)
    assert any(t.dtype == torch.bfloat16 and ".experts." in n for n, t in state.items())
    got = convert(state, RefitSpec(model_type="qwen3_5_moe", fmt=fmt))
    test_plan.assert_outputs_equal(got, test_plan.expected_outputs(state, fmt))
    assert calls


def test_native_variables_are_not_daemon_settings():
    """REFITD_NATIVE / REFITD_CC / REFITD_NATIVE_DIR in a daemon's environment are not refused as
    unknown settings (every other unknown REFITD_* variable is)."""
    from sidecar.config.sources import env_to_values
    from sidecar.config.values import ConfigError

    env = {"REFITD_NATIVE": "0", "REFITD_CC": "/bin/false", "REFITD_NATIVE_DIR": "/tmp/x"}
    assert env_to_values(env) == {}
    with pytest.raises(ConfigError, match="REFITD_NATIV"):
        env_to_values({"REFITD_NATIV": "0"})


def test_a_forked_child_gets_its_own_threads():
    """A child forked after the pool started (its threads are not inherited) still splits a call
    across threads and finishes; the parent waits for it with a deadline. (The child compares with
    numpy: torch's OpenMP regions are not safe after a fork.)"""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        w = (torch.randn(4, 512, 1024, generator=torch.Generator().manual_seed(8)) * 0.02).bfloat16()
        want = cpu.quantize(w, Format.BLOCK_FP8)[0].view(torch.uint8).numpy()  # the parent's pool runs
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            ok = False
            try:
                ok = bool(
                    np.array_equal(cpu.quantize(w, Format.BLOCK_FP8)[0].view(torch.uint8).numpy(), want)
                )
            finally:
                os._exit(0 if ok else 1)
        status: list[int] = []
        reaped = threading.Event()

        def reap() -> None:
            status.append(os.waitpid(pid, 0)[1])
            reaped.set()

        threading.Thread(target=reap, daemon=True).start()
        if not reaped.wait(30):
            os.kill(pid, signal.SIGKILL)
            reaped.wait(10)
            pytest.fail("the forked child hung on the parent's thread pool")
        assert os.waitstatus_to_exitcode(status[0]) == 0
    finally:
        torch.set_num_threads(before)


def test_ahead_of_time_build_command(fresh_native, tmp_path: Path, capsys):
    """``python -m sidecar.numerics.native`` builds into the cache and prints the path (exit 0), or
    says what failed and that the torch reference will run instead (exit 1)."""
    from sidecar.numerics.native.__main__ import main

    fresh_native.setenv("REFITD_NATIVE_DIR", str(tmp_path / "cache"))
    assert main() == 0
    path = Path(capsys.readouterr().out.strip())
    assert path.parent == tmp_path / "cache" and path.exists()
    fresh_native.setenv("REFITD_CC", "/bin/false")
    assert main() == 1
    err = capsys.readouterr().err
    assert "/bin/false" in err and "torch reference" in err


@pytest.mark.parametrize("scale", [0.0, -0.0, -1.0, 2.0**-140, float("inf"), float("nan"), 2.0**-126])
def test_odd_shared_scales_give_the_references_bytes(scale: float):
    """A caller's shared scale that is not a normal positive float32 (0, subnormal: 1 / scale is then
    not a finite positive multiplier) gives the reference's bytes; one that is negative, -0.0, Inf
    or NaN is refused by both with the same error (docs/spec.md §1.4)."""
    w = torch.tensor([[0.0, -0.0, 1.0, -3.0, 1e-30, 448.0, -1e30, 2.0**-133]], dtype=torch.bfloat16)
    s = torch.tensor(scale, dtype=torch.float32)
    if not math.isfinite(scale) or math.copysign(1.0, scale) < 0:
        errors = []
        for fn in (cpu.quantize_fp8_per_tensor, ref.quantize_fp8_per_tensor):
            with pytest.raises(ValueError, match="finite and not negative") as err:
                fn(w, scale=s)
            errors.append(str(err.value))
        assert errors[0] == errors[1]
        return
    _assert_same(cpu.quantize_fp8_per_tensor(w, scale=s), ref.quantize_fp8_per_tensor(w, scale=s))
