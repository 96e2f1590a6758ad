"""The daemon's CPU quantizers: the native kernels (``native/quant.c``, ``native/fourbit.c``) where they
apply, the torch reference everywhere else, with the reference's signatures, errors and bytes.

The native kernels take bfloat16 CPU tensors whose last dim is contiguous, with any strides above it
that fold into ``[batch, rows, cols]`` (a slab's per-expert views do), writing into the caller's
buffers under the same rule. Anything else (float16 / float32 input, odd strides, a CUDA tensor, no C
compiler) goes to :mod:`sidecar.numerics.reference` unchanged. A call's work is split across
``torch.get_num_threads()`` threads, each running its share in C with the GIL released; small
tensors run on the calling thread alone. Each ``quantize_*`` is a ``prepare_*`` (the checks, the
reference where it must run) and a run; many prepared calls run as one split (:func:`run_prepared`),
which is how a slab's hundreds of expert projections take one hand-off to the threads, not one each.

Errors are the reference's: input and ``out=`` checks are its own functions, and when the kernel sees
NaN or Inf the reference is run on that tensor to raise its NonFiniteError, naming the first bad block
in the same words (``out=`` buffers may then be partly written, as the reference's may).

Usage::

    from sidecar.numerics import cpu

    done = cpu.warm_up()                                      # build + load now, not on a step
    q, s = cpu.quantize(w, Format.BLOCK_FP8, out=(q_buf, s_buf), name="...weight")
    cpu.run_prepared([cpu.prepare(v, fmt, out=o, name=n) for v, o, n in projections])
"""

from __future__ import annotations

import ctypes
import functools
import logging
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sidecar.numerics import fourbit, native
from sidecar.numerics import reference as ref
from sidecar.numerics.formats import (
    BLOCK,
    FLT_MIN,
    INT4_GROUP,
    MX_BLOCK,
    MXFP4_BLOCK,
    NVFP4_BLOCK,
    NVFP4_GLOBAL_DIVISOR,
    Format,
)
from sidecar.numerics.kernels import WarmUp
from sidecar.numerics.threads import MIN_SPLIT_ELEMS, Pool

__all__ = [
    "MIN_SPLIT_ELEMS",
    "Prepared",
    "fp8_per_tensor_scale",
    "native_applies",
    "nvfp4_global_scale",
    "prepare",
    "prepare_block_fp8",
    "prepare_fp8_per_tensor",
    "prepare_fp8_per_tensor_scale",
    "prepare_int4",
    "prepare_mxfp4",
    "prepare_mxfp8",
    "prepare_nvfp4",
    "prepare_nvfp4_global_scale",
    "quantize",
    "quantize_block_fp8",
    "quantize_fp8_per_tensor",
    "quantize_int4",
    "quantize_mxfp4",
    "quantize_mxfp8",
    "quantize_nvfp4",
    "quantize_nvfp4_groups",
    "run_prepared",
    "warm_up",
]

log = logging.getLogger("sidecar.numerics.native")

#: sign-cleared bfloat16 bits at or above this are Inf or NaN
_BF16_NONFINITE = 0x7F80
_FLT_MAX = float.fromhex("0x1.fffffep127")  # largest finite float32

# --------------------------------------------------------------------------------------------------
# strided views as [batch, rows, cols]


def _fold(shape: Sequence[int], strides: Sequence[int]) -> tuple[int, int] | None:
    """(count, stride) of dims folded into one, or None when their strides do not allow it."""
    dims = [(n, st) for n, st in zip(shape, strides) if n != 1]
    if not dims:
        return 1, 0
    count, stride = dims[-1]
    for n, st in reversed(dims[:-1]):
        if st != stride * count:
            return None
        count *= n
    return count, stride


def _view3(t: torch.Tensor, split: int) -> tuple[int, int, int, int, int] | None:
    """``t`` as (batch, rows, cols, batch stride, row stride) in elements: dims ``[:split]`` fold
    into batch, ``[split:-1]`` into rows; None unless the last dim is contiguous and both fold."""
    return _view3_of(tuple(t.shape), t.stride(), split)


@functools.lru_cache(maxsize=4096)
def _view3_of(
    shape: tuple[int, ...], strides: tuple[int, ...], split: int
) -> tuple[int, int, int, int, int] | None:
    """:func:`_view3` of a shape and strides (a slab's hundreds of projection views share them)."""
    if not shape or (shape[-1] != 1 and strides[-1] != 1):
        return None
    batch = _fold(shape[:split], strides[:split])
    rows = _fold(shape[split:-1], strides[split:-1])
    if batch is None or rows is None:
        return None
    return batch[0], rows[0], shape[-1], batch[1], rows[1]


def _row_split(t: torch.Tensor) -> int:
    """Where ``t``'s leading dims split into (batch, rows) for a rows format: all in rows if they fold."""
    return _row_split_of(tuple(t.shape), t.stride())


@functools.lru_cache(maxsize=4096)
def _row_split_of(shape: tuple[int, ...], strides: tuple[int, ...]) -> int:
    lead = len(shape) - 1
    return 0 if _fold(shape[:lead], strides[:lead]) is not None else max(0, lead - 1)


def _lib_for(w: torch.Tensor) -> ctypes.CDLL | None:
    if (
        not isinstance(w, torch.Tensor)
        or w.device.type != "cpu"
        or w.dtype != torch.bfloat16
        or w.numel() == 0
    ):
        return None
    return native.load()


def native_applies(w: torch.Tensor, fmt: Format | str) -> bool:
    """Whether ``w`` would be quantized by the native kernels (with outputs allocated here)."""
    fmt = Format.parse(fmt)
    if _lib_for(w) is None or (fmt is Format.BLOCK_FP8 and w.dim() < 2):
        return False
    if fmt is Format.MXFP8 and (w.dim() < 1 or w.shape[-1] % MX_BLOCK):
        return False
    if fmt in (Format.NVFP4, Format.INT4_W4A16) and w.dim() < 2:
        return False
    multiple = {Format.NVFP4: NVFP4_BLOCK, Format.MXFP4: MXFP4_BLOCK, Format.INT4_W4A16: INT4_GROUP}.get(fmt)
    if multiple is not None and (w.dim() < 1 or w.shape[-1] % multiple):
        return False
    split = w.dim() - 2 if fmt is Format.BLOCK_FP8 else _row_split(w)
    return w.dim() > 0 and _view3(w, split) is not None


#: every call's shares run here (sidecar/numerics/threads.py)
_POOL = Pool()


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


@dataclass(slots=True)
class Prepared:
    """A quantizer call checked and ready to run (``prepare_*``): ``share(begin, end)`` is the kernel
    over ``units`` units of ``elems`` elements each, and ``finish`` turns the shares' results into the
    call's return value (raising the reference's error for what the kernel flagged). Many of them run
    as one hand-off to the threads (:func:`run_prepared`): a slab's expert projections. A call the
    reference had to take ran at once: no units, and ``finish`` returns its result."""

    share: Callable[[int, int], int] | None
    units: int
    elems: int
    finish: Callable[[list[int]], Any]

    @classmethod
    def done(cls, result: Any) -> Prepared:
        return cls(None, 0, 0, lambda _: result)


def run_prepared(calls: Sequence[Prepared]) -> list[Any]:
    """Run prepared calls together (one split across the threads) and return their results in order;
    the first call whose ``finish`` raises stops the rest (their outputs may be written, not finished)."""
    native = [c for c in calls if c.share is not None]
    results = iter(_POOL.run_many([(c.share, c.units, c.elems) for c in native]))
    return [c.finish(next(results) if c.share is not None else []) for c in calls]


def _run(call: Prepared) -> Any:
    return run_prepared([call])[0]


# --------------------------------------------------------------------------------------------------
# block-FP8


def quantize_block_fp8(
    w: torch.Tensor, *, out: tuple[torch.Tensor, torch.Tensor] | None = None, name: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sidecar.numerics.reference.quantize_block_fp8`, natively where it applies."""
    return _run(prepare_block_fp8(w, out=out, name=name))


def prepare_block_fp8(
    w: torch.Tensor, *, out: tuple[torch.Tensor, torch.Tensor] | None = None, name: str | None = None
) -> Prepared:
    """:func:`quantize_block_fp8`, checked and ready to run (:class:`Prepared`)."""
    lib = _lib_for(w)
    if lib is None or w.dim() < 2:
        return Prepared.done(ref.quantize_block_fp8(w, out=out, name=name))
    ref._check_input(w, name, Format.BLOCK_FP8)
    q, s = ref._check_out(out, w, Format.BLOCK_FP8.scale_shape(tuple(w.shape)), torch.float32, name)
    split = w.dim() - 2
    xv, qv, sv = _view3(w, split), _view3(q, split), _view3(s, split)
    if xv is None or qv is None or sv is None:
        return Prepared.done(ref.quantize_block_fp8(w, out=(q, s), name=name))
    batch, n, k, xbs, xrs = xv
    args = (_ptr(w), n, k, xbs, xrs, _ptr(q), qv[3], qv[4], _ptr(s), sv[3], sv[4])

    def finish(bad: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        if any(r >= 0 for r in bad):
            _raise_like_reference(lambda: ref.quantize_block_fp8(w, name=name), name)
        return q, s

    return Prepared(lambda b, e: lib.refitd_block_fp8(*args, b, e), batch * -(-n // BLOCK), BLOCK * k, finish)


# --------------------------------------------------------------------------------------------------
# MXFP8


def quantize_mxfp8(
    w: torch.Tensor, *, out: tuple[torch.Tensor, torch.Tensor] | None = None, name: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sidecar.numerics.reference.quantize_mxfp8`, natively where it applies."""
    return _run(prepare_mxfp8(w, out=out, name=name))


def prepare_mxfp8(
    w: torch.Tensor, *, out: tuple[torch.Tensor, torch.Tensor] | None = None, name: str | None = None
) -> Prepared:
    """:func:`quantize_mxfp8`, checked and ready to run (:class:`Prepared`)."""
    lib = _lib_for(w)
    if lib is None or w.dim() < 1 or w.shape[-1] % MX_BLOCK:
        return Prepared.done(ref.quantize_mxfp8(w, out=out, name=name))
    ref._check_input(w, name, Format.MXFP8)
    q, s = ref._check_out(out, w, Format.MXFP8.scale_shape(tuple(w.shape)), torch.uint8, name)
    split = _row_split(w)
    xv, qv, sv = _view3(w, split), _view3(q, split), _view3(s, split)
    if xv is None or qv is None or sv is None:
        return Prepared.done(ref.quantize_mxfp8(w, out=(q, s), name=name))
    batch, n, k, xbs, xrs = xv
    args = (_ptr(w), n, k, xbs, xrs, _ptr(q), qv[3], qv[4], _ptr(s), sv[3], sv[4])

    def finish(bad: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        if any(r >= 0 for r in bad):
            _raise_like_reference(lambda: ref.quantize_mxfp8(w, name=name), name)
        return q, s

    return Prepared(lambda b, e: lib.refitd_mxfp8(*args, b, e), batch * n, k, finish)


# --------------------------------------------------------------------------------------------------
# shared scales: the amax over every tensor sharing one (an expert's gate and up)


def _amax_call(
    lib: ctypes.CDLL,
    views: Sequence[tuple[torch.Tensor, tuple[int, int, int, int, int]]],
    finish: Callable[[int], Any],
) -> Prepared:
    """The largest sign-cleared bf16 bits over several tensors as one call: their rows numbered one
    after the other; ``finish`` gets that maximum."""
    spans = []  # (first row, end row, kernel args) a tensor
    rows = elems = 0
    for t, (batch, n, k, xbs, xrs) in views:
        spans.append((rows, rows + batch * n, (_ptr(t), n, k, xbs, xrs)))
        rows += batch * n
        elems += batch * n * k

    def share(begin: int, end: int) -> int:
        worst = 0
        for first, stop, args in spans:
            b, e = max(begin, first), min(end, stop)
            if b < e:
                worst = max(worst, lib.refitd_amax_bits(*args, b - first, e - first))
        return worst

    return Prepared(share, rows, elems // max(rows, 1), lambda found: finish(max(found, default=0)))


def _shared_views(tensors: Sequence[torch.Tensor], applies: Callable[[torch.Tensor], bool]):
    """(lib, [(tensor, view)]) when every tensor takes the native amax, else None."""
    views, lib = [], None
    for t in tensors:
        lib = _lib_for(t)
        view = None if lib is None or not applies(t) else _view3(t, _row_split(t))
        if view is None:
            return None
        views.append((t, view))
    return (lib, views) if views else None


def fp8_per_tensor_scale(*tensors: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """:func:`sidecar.numerics.reference.fp8_per_tensor_scale`, natively when every tensor qualifies."""
    return _run(prepare_fp8_per_tensor_scale(*tensors, name=name))


def prepare_fp8_per_tensor_scale(*tensors: torch.Tensor, name: str | None = None) -> Prepared:
    """:func:`fp8_per_tensor_scale`, ready to run (:class:`Prepared`)."""
    found = _shared_views(tensors, lambda t: t.dim() > 0)
    if found is None:
        return Prepared.done(ref.fp8_per_tensor_scale(*tensors, name=name))
    lib, views = found

    def finish(amax: int) -> torch.Tensor:
        if amax >= _BF16_NONFINITE:
            _raise_like_reference(lambda: ref.fp8_per_tensor_scale(*tensors, name=name), name)
        return torch.tensor(lib.refitd_scale_from_amax_bits(amax), dtype=torch.float32)

    return _amax_call(lib, views, finish)


# --------------------------------------------------------------------------------------------------
# FP8 per-tensor


def quantize_fp8_per_tensor(
    w: torch.Tensor,
    *,
    scale: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    name: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sidecar.numerics.reference.quantize_fp8_per_tensor`, natively where it applies."""
    return _run(prepare_fp8_per_tensor(w, scale=scale, out=out, name=name))


def prepare_fp8_per_tensor(
    w: torch.Tensor,
    *,
    scale: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    name: str | None = None,
) -> Prepared:
    """:func:`quantize_fp8_per_tensor`, checked and ready to run (:class:`Prepared`). Without ``scale``
    the tensor's own amax pass runs here, first."""
    lib = _lib_for(w)
    if lib is None or w.dim() == 0:
        return Prepared.done(ref.quantize_fp8_per_tensor(w, scale=scale, out=out, name=name))
    ref._check_input(w, name, Format.FP8_PER_TENSOR)
    q, s = ref._check_out(out, w, (), torch.float32, name)
    split = _row_split(w)
    xv, qv = _view3(w, split), _view3(q, split)
    if xv is None or qv is None:
        return Prepared.done(ref.quantize_fp8_per_tensor(w, scale=scale, out=(q, s), name=name))
    clamp = scale is not None
    if scale is None:
        value = float(_run(prepare_fp8_per_tensor_scale(w, name=name)))
    else:
        value = float(ref.check_shared_scale(scale, name))
        if not FLT_MIN <= value <= _FLT_MAX:  # 0, negative, subnormal, Inf or NaN: 1 / value is not
            # a finite positive multiplier, and the reference's NaN-producing arithmetic is the answer
            return Prepared.done(ref.quantize_fp8_per_tensor(w, scale=scale, out=(q, s), name=name))
    batch, n, k, xbs, xrs = xv
    args = (_ptr(w), n, k, xbs, xrs, _ptr(q), qv[3], qv[4], value, int(clamp))

    def finish(seen: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        if max(seen) >= _BF16_NONFINITE:  # only a shared scale's pass looks (a computed one already did)
            _raise_like_reference(lambda: ref.quantize_fp8_per_tensor(w, scale=scale, name=name), name)
        s.fill_(value)
        return q, s

    return Prepared(lambda b, e: lib.refitd_fp8_per_tensor(*args, b, e), batch * n, k, finish)


# --------------------------------------------------------------------------------------------------
# 4-bit formats (SPEC §1.5-1.7): rows formats, split by rows like MXFP8


def _rows_native(lib, w: torch.Tensor, outs: tuple[torch.Tensor, ...]):
    """(lib, input view, output views) when ``w`` and every output fold to [batch, rows, cols] views
    alike (the output strides then index the same rows), else None (the reference runs)."""
    if lib is None or w.dim() < 1:
        return None
    split = _row_split(w)
    views = [_view3(t, split) for t in (w, *outs)]
    if any(v is None for v in views):
        return None
    return views


def nvfp4_global_scale(*tensors: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """:func:`sidecar.numerics.fourbit.nvfp4_global_scale`, natively when every tensor qualifies."""
    return _run(prepare_nvfp4_global_scale(*tensors, name=name))


def prepare_nvfp4_global_scale(*tensors: torch.Tensor, name: str | None = None) -> Prepared:
    """:func:`nvfp4_global_scale`, ready to run (:class:`Prepared`)."""
    found = _shared_views(tensors, lambda t: t.dim() >= 2 and t.shape[-1] % NVFP4_BLOCK == 0)
    if found is None:
        return Prepared.done(fourbit.nvfp4_global_scale(*tensors, name=name))
    lib, views = found

    def finish(amax: int) -> torch.Tensor:
        if amax >= _BF16_NONFINITE:
            _raise_like_reference(lambda: fourbit.nvfp4_global_scale(*tensors, name=name), name)
        return torch.tensor(_nvfp4_global_scale_value(amax), dtype=torch.float32)

    return _amax_call(lib, views, finish)


def _nvfp4_global_scale_value(amax_bits: int) -> float:
    """float32(amax / 2688) from amax's sign-cleared bf16 bits (1.0 for 0), as a Python float: the
    quotient in double precision rounded once to float32 is the correctly rounded float32 quotient (53 >=
    2 * 24 + 2: double rounding is innocuous for division), so one tensor is made, not five."""
    if amax_bits == 0:
        return 1.0
    (amax,) = struct.unpack("<f", struct.pack("<I", amax_bits << 16))
    (gs,) = struct.unpack("<f", struct.pack("<f", amax / NVFP4_GLOBAL_DIVISOR))
    return gs


def quantize_nvfp4(
    w: torch.Tensor,
    *,
    global_scale: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    name: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`sidecar.numerics.fourbit.quantize_nvfp4`, natively where it applies."""
    return _run(prepare_nvfp4(w, global_scale=global_scale, out=out, name=name))


def prepare_nvfp4(
    w: torch.Tensor,
    *,
    global_scale: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    name: str | None = None,
) -> Prepared:
    """:func:`quantize_nvfp4`, checked and ready to run (:class:`Prepared`). Without ``global_scale``
    the tensor's own amax pass runs here, first."""
    lib = _lib_for(w)
    if lib is None or w.dim() < 2 or w.shape[-1] % NVFP4_BLOCK:
        return Prepared.done(fourbit.quantize_nvfp4(w, global_scale=global_scale, out=out, name=name))
    q, s, g = fourbit.nvfp4_outputs(w, out, name)
    views = _rows_native(lib, w, (q, s))
    if views is None:
        return Prepared.done(fourbit.quantize_nvfp4(w, global_scale=global_scale, out=(q, s, g), name=name))
    if global_scale is None:
        gs = nvfp4_global_scale(w, name=name)
    else:
        gs = ref.check_shared_scale(global_scale, name, "global_scale")
    value = float(gs)
    (batch, n, k, xbs, xrs), qv, sv = views
    args = (_ptr(w), n, k, xbs, xrs, _ptr(q), qv[3], qv[4], _ptr(s), sv[3], sv[4], value)

    def finish(bad: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if any(r >= 0 for r in bad):
            _raise_like_reference(lambda: fourbit.quantize_nvfp4(w, global_scale=gs, name=name), name)
        g.fill_(value)
        return q, s, g

    return Prepared(lambda b, e: lib.refitd_nvfp4(*args, b, e), batch * n, k, finish)


#: scale groups a thread below which :func:`quantize_nvfp4_groups` splits each pass across the threads
#: instead of handing out whole groups (too few to share the threads evenly)
GROUPS_PER_THREAD = 2

Nvfp4Group = tuple[
    Sequence[torch.Tensor],
    Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    Sequence[str | None],
    str,
]


def quantize_nvfp4_groups(groups: Sequence[Nvfp4Group]) -> list[torch.Tensor]:
    """NVFP4 scale groups, each ``(tensors, their out= buffers, their names, the group's name)`` sharing
    one global scale (an expert's gate and up); returns each group's ``gs``.

    With at least :data:`GROUPS_PER_THREAD` groups a thread, each group runs whole on one thread: its
    amax, then its members' kernels while their bytes are still in cache (a group is a few MiB: the
    second read is served from L2/L3, not memory). With fewer, each pass is split across the threads:
    every group's amax, then every member's kernel. Bytes and errors are the same either way."""
    if len(groups) >= GROUPS_PER_THREAD * _POOL.threads():
        return run_prepared([_prepare_nvfp4_group(*g) for g in groups])
    scales = run_prepared([prepare_nvfp4_global_scale(*ts, name=label) for ts, _, _, label in groups])
    calls = []
    for (tensors, outs, names, _), gs in zip(groups, scales, strict=True):
        calls += [prepare_nvfp4(w, global_scale=gs, out=o, name=n) for w, o, n in zip(tensors, outs, names)]
    run_prepared(calls)
    return scales


def _prepare_nvfp4_group(
    tensors: Sequence[torch.Tensor],
    outs: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    names: Sequence[str | None],
    label: str,
) -> Prepared:
    """One NVFP4 scale group as one call of one unit (it never splits): the amax over its tensors, the
    global scale, then each tensor's kernel; ``finish`` returns the ``gs`` tensor. A group some
    member of which is not for the native kernels runs at once, as :func:`quantize_nvfp4` would."""
    found = _shared_views(tensors, lambda t: t.dim() >= 2 and t.shape[-1] % NVFP4_BLOCK == 0)
    members = []
    for w, out, name in zip(tensors, outs, names, strict=True):
        q, s, g = fourbit.nvfp4_outputs(w, out, name)
        views = None if found is None else _rows_native(found[0], w, (q, s))
        if views is None:
            members = None
            break
        (batch, n, k, xbs, xrs), qv, sv = views
        args = (_ptr(w), n, k, xbs, xrs, _ptr(q), qv[3], qv[4], _ptr(s), sv[3], sv[4])
        members.append((w, name, args, batch * n, g))
    if found is None or members is None:
        gs = nvfp4_global_scale(*tensors, name=label)
        for w, out, name in zip(tensors, outs, names, strict=True):
            quantize_nvfp4(w, global_scale=gs, out=out, name=name)
        return Prepared.done(gs)
    lib = found[0]
    state: dict[str, Any] = {}

    def share(begin: int, end: int) -> int:
        amax = 0
        for _, _, args, rows, _ in members:
            amax = max(amax, lib.refitd_amax_bits(*args[:5], 0, rows))
        if amax >= _BF16_NONFINITE:
            state["bad"] = None
            return 0
        value = state["value"] = _nvfp4_global_scale_value(amax)
        for w, name, args, rows, _ in members:
            if lib.refitd_nvfp4(*args, value, 0, rows) >= 0:
                state["bad"] = (w, name)
                return 0
        return 0

    def finish(_: list[int]) -> torch.Tensor:
        if "bad" in state:
            if state["bad"] is None:
                _raise_like_reference(lambda: fourbit.nvfp4_global_scale(*tensors, name=label), label)
            w, name = state["bad"]
            gs = torch.tensor(state["value"], dtype=torch.float32)
            _raise_like_reference(lambda: fourbit.quantize_nvfp4(w, global_scale=gs, name=name), name)
        for *_, g in members:
            g.fill_(state["value"])
        return torch.tensor(state["value"], dtype=torch.float32)

    elems = sum(rows * args[2] for _, _, args, rows, _ in members)
    return Prepared(share, 1, elems, finish)


def quantize_mxfp4(
    w: torch.Tensor, *, out: tuple[torch.Tensor, torch.Tensor] | None = None, name: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sidecar.numerics.fourbit.quantize_mxfp4`, natively where it applies."""
    return _run(prepare_mxfp4(w, out=out, name=name))


def prepare_mxfp4(
    w: torch.Tensor, *, out: tuple[torch.Tensor, torch.Tensor] | None = None, name: str | None = None
) -> Prepared:
    """:func:`quantize_mxfp4`, checked and ready to run (:class:`Prepared`)."""
    lib = _lib_for(w)
    if lib is None or w.dim() < 1 or w.shape[-1] % MXFP4_BLOCK:
        return Prepared.done(fourbit.quantize_mxfp4(w, out=out, name=name))
    q, s = fourbit.mxfp4_outputs(w, out, name)
    views = _rows_native(lib, w, (q, s))
    if views is None:
        return Prepared.done(fourbit.quantize_mxfp4(w, out=(q, s), name=name))
    (batch, n, k, xbs, xrs), qv, sv = views
    args = (_ptr(w), n, k, xbs, xrs, _ptr(q), qv[3], qv[4], _ptr(s), sv[3], sv[4])

    def finish(bad: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        if any(r >= 0 for r in bad):
            _raise_like_reference(lambda: fourbit.quantize_mxfp4(w, name=name), name)
        return q, s

    return Prepared(lambda b, e: lib.refitd_mxfp4(*args, b, e), batch * n, k, finish)


def quantize_int4(
    w: torch.Tensor,
    *,
    group: int = INT4_GROUP,
    scale_dtype: torch.dtype = torch.bfloat16,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    name: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`sidecar.numerics.fourbit.quantize_int4`, natively where it applies."""
    return _run(prepare_int4(w, group=group, scale_dtype=scale_dtype, out=out, name=name))


def prepare_int4(
    w: torch.Tensor,
    *,
    group: int = INT4_GROUP,
    scale_dtype: torch.dtype = torch.bfloat16,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    name: str | None = None,
) -> Prepared:
    """:func:`quantize_int4`, checked and ready to run (:class:`Prepared`)."""
    lib = _lib_for(w)
    kw = {"group": group, "scale_dtype": scale_dtype, "name": name}
    if lib is None or w.dim() < 2:
        return Prepared.done(fourbit.quantize_int4(w, out=out, **kw))
    ref._check_input(w, name, Format.INT4_W4A16)
    fourbit._check_int4_args(w, group, scale_dtype, name)
    *lead, k = w.shape
    packed, s, shape = ref._check_out_buffers(
        out,
        w,
        (
            ("values", Format.INT4_W4A16.weight_shape(tuple(w.shape)), torch.int32),
            ("scales", (*lead, k // group), scale_dtype),
            ("shape", (2,), torch.int64),
        ),
        name,
    )
    views = _rows_native(lib, w, (packed, s))
    if views is None:
        return Prepared.done(fourbit.quantize_int4(w, out=(packed, s, shape), **kw))
    (batch, n, k, xbs, xrs), qv, sv = views
    f32 = int(scale_dtype == torch.float32)
    args = (_ptr(w), n, k, xbs, xrs, _ptr(packed), qv[3], qv[4], _ptr(s), sv[3], sv[4], group, f32)

    def finish(bad: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if any(r >= 0 for r in bad):
            _raise_like_reference(lambda: fourbit.quantize_int4(w, **kw), name)
        shape.copy_(torch.tensor(tuple(w.shape[-2:]), dtype=torch.int64))
        return packed, s, shape

    return Prepared(lambda b, e: lib.refitd_int4(*args, b, e), batch * n, k, finish)


# --------------------------------------------------------------------------------------------------
# dispatch, errors, warm-up


def quantize(
    w: torch.Tensor,
    fmt: Format | str,
    *,
    out: tuple[torch.Tensor, ...] | None = None,
    name: str | None = None,
) -> tuple[torch.Tensor, ...]:
    """:func:`sidecar.numerics.reference.quantize`, natively where it applies."""
    return _run(prepare(w, fmt, out=out, name=name))


def prepare(
    w: torch.Tensor,
    fmt: Format | str,
    *,
    out: tuple[torch.Tensor, ...] | None = None,
    name: str | None = None,
) -> Prepared:
    """:func:`quantize`, checked and ready to run (:class:`Prepared`)."""
    fmt = Format.parse(fmt)
    prepare_fmt: Callable[..., Prepared] | None = {
        Format.BLOCK_FP8: prepare_block_fp8,
        Format.MXFP8: prepare_mxfp8,
        Format.FP8_PER_TENSOR: prepare_fp8_per_tensor,
        Format.NVFP4: prepare_nvfp4,
        Format.MXFP4: prepare_mxfp4,
        Format.INT4_W4A16: prepare_int4,
    }.get(fmt)
    if prepare_fmt is None:  # the reference's error for a format with nothing to quantize
        return Prepared.done(ref.quantize(w, fmt, out=out, name=name))
    return prepare_fmt(w, out=out, name=name)


def _raise_like_reference(run_reference: Callable[[], object], name: str | None) -> None:
    """The kernel saw NaN or Inf: the reference, run on the same input, raises its own error (a
    NonFiniteError naming the first bad block)."""
    run_reference()
    raise RuntimeError(
        f"{ref._label(name)}: the native quantizer saw NaN or Inf that the torch reference did not; "
        "this is a bug in sidecar/numerics/native/ (quant.c, fourbit.c): report it, and set REFITD_NATIVE=0 meanwhile"
    )


def warm_up() -> WarmUp:
    """Build (if needed) and load the native kernels and start the threads, before a step needs them.

    Returns what the CPU path will use: impl ``"native"``, or ``"torch"`` with the reason.
    """
    t0 = time.monotonic()
    lib = native.load()
    seconds = time.monotonic() - t0
    if lib is None:
        return WarmUp("cpu", "torch", f"native CPU quantizers unavailable: {native.unavailable_reason()}")
    threads = _POOL.threads()
    if threads > 1:
        _POOL._get(threads - 1)
    log.info("native CPU quantizers loaded in %.2f s, %d threads", seconds, threads)
    return WarmUp("cpu", "native", None, 1, seconds)
