"""The daemon's CPU quantizers: the native kernels (``native/quant.c``, ``native/fourbit.c``) where they
apply, the torch reference everywhere else, with the reference's signatures, errors and bytes.

The native kernels take bfloat16 CPU tensors whose last dim is contiguous, with any strides above it
that fold into ``[batch, rows, cols]`` (a slab's per-expert views do), writing into the caller's
buffers under the same rule. Anything else (float16 / float32 input, odd strides, a CUDA tensor, no C
compiler) goes to :mod:`sidecar.numerics.reference` unchanged. A call's work is split across
``torch.get_num_threads()`` threads, each running its share in C with the GIL released; small
tensors run on the calling thread alone.

Errors are the reference's: input and ``out=`` checks are its own functions, and when the kernel sees
NaN or Inf the reference is run on that tensor to raise its NonFiniteError, naming the first bad block
in the same words (``out=`` buffers may then be partly written, as the reference's may).

Usage::

    from sidecar.numerics import cpu

    done = cpu.warm_up()                                      # build + load now, not on a step
    q, s = cpu.quantize(w, Format.BLOCK_FP8, out=(q_buf, s_buf), name="...weight")
"""

from __future__ import annotations

import ctypes
import logging
import struct
import time
from collections.abc import Callable, Sequence

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
    "fp8_per_tensor_scale",
    "native_applies",
    "nvfp4_global_scale",
    "quantize",
    "quantize_block_fp8",
    "quantize_fp8_per_tensor",
    "quantize_int4",
    "quantize_mxfp4",
    "quantize_mxfp8",
    "quantize_nvfp4",
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
    shape, strides = tuple(t.shape), t.stride()
    if not shape or (shape[-1] != 1 and strides[-1] != 1):
        return None
    batch = _fold(shape[:split], strides[:split])
    rows = _fold(shape[split:-1], strides[split:-1])
    if batch is None or rows is None:
        return None
    return batch[0], rows[0], shape[-1], batch[1], rows[1]


def _row_split(t: torch.Tensor) -> int:
    """Where ``t``'s leading dims split into (batch, rows) for a rows format: all in rows if they fold."""
    lead = t.dim() - 1
    return 0 if _fold(t.shape[:lead], t.stride()[:lead]) is not None else max(0, lead - 1)


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


# --------------------------------------------------------------------------------------------------
# block-FP8


def quantize_block_fp8(
    w: torch.Tensor, *, out: tuple[torch.Tensor, torch.Tensor] | None = None, name: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sidecar.numerics.reference.quantize_block_fp8`, natively where it applies."""
    lib = _lib_for(w)
    if lib is None or w.dim() < 2:
        return ref.quantize_block_fp8(w, out=out, name=name)
    ref._check_input(w, name, Format.BLOCK_FP8)
    q, s = ref._check_out(out, w, Format.BLOCK_FP8.scale_shape(tuple(w.shape)), torch.float32, name)
    split = w.dim() - 2
    xv, qv, sv = _view3(w, split), _view3(q, split), _view3(s, split)
    if xv is None or qv is None or sv is None:
        return ref.quantize_block_fp8(w, out=(q, s), name=name)
    batch, n, k, xbs, xrs = xv
    units = batch * -(-n // BLOCK)
    args = (_ptr(w), n, k, xbs, xrs, _ptr(q), qv[3], qv[4], _ptr(s), sv[3], sv[4])
    bad = _POOL.run(lambda b, e: lib.refitd_block_fp8(*args, b, e), units, BLOCK * k)
    if any(r >= 0 for r in bad):
        _raise_like_reference(lambda: ref.quantize_block_fp8(w, name=name), name)
    return q, s


# --------------------------------------------------------------------------------------------------
# MXFP8


def quantize_mxfp8(
    w: torch.Tensor, *, out: tuple[torch.Tensor, torch.Tensor] | None = None, name: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sidecar.numerics.reference.quantize_mxfp8`, natively where it applies."""
    lib = _lib_for(w)
    if lib is None or w.dim() < 1 or w.shape[-1] % MX_BLOCK:
        return ref.quantize_mxfp8(w, out=out, name=name)
    ref._check_input(w, name, Format.MXFP8)
    q, s = ref._check_out(out, w, Format.MXFP8.scale_shape(tuple(w.shape)), torch.uint8, name)
    split = _row_split(w)
    xv, qv, sv = _view3(w, split), _view3(q, split), _view3(s, split)
    if xv is None or qv is None or sv is None:
        return ref.quantize_mxfp8(w, out=(q, s), name=name)
    batch, n, k, xbs, xrs = xv
    args = (_ptr(w), n, k, xbs, xrs, _ptr(q), qv[3], qv[4], _ptr(s), sv[3], sv[4])
    bad = _POOL.run(lambda b, e: lib.refitd_mxfp8(*args, b, e), batch * n, k)
    if any(r >= 0 for r in bad):
        _raise_like_reference(lambda: ref.quantize_mxfp8(w, name=name), name)
    return q, s


# --------------------------------------------------------------------------------------------------
# FP8 per-tensor


def _amax_bits(lib: ctypes.CDLL, t: torch.Tensor, view: tuple[int, int, int, int, int]) -> int:
    return _amax_bits_of(lib, [(t, view)])


def _amax_bits_of(
    lib: ctypes.CDLL, views: Sequence[tuple[torch.Tensor, tuple[int, int, int, int, int]]]
) -> int:
    """The largest sign-cleared bf16 bits over several tensors, in one split call: their rows numbered
    one after the other (an expert's gate and up share one scale: one hand-off to the threads)."""
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

    return max(_POOL.run(share, rows, elems // max(rows, 1)))


def fp8_per_tensor_scale(*tensors: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """:func:`sidecar.numerics.reference.fp8_per_tensor_scale`, natively when every tensor qualifies."""
    views = []
    for t in tensors:
        lib = _lib_for(t)
        view = None if lib is None or t.dim() == 0 else _view3(t, _row_split(t))
        if view is None:
            return ref.fp8_per_tensor_scale(*tensors, name=name)
        views.append((lib, t, view))
    if not views:
        return ref.fp8_per_tensor_scale(*tensors, name=name)
    lib = views[0][0]
    amax = _amax_bits_of(lib, [(t, view) for _, t, view in views])
    if amax >= _BF16_NONFINITE:
        _raise_like_reference(lambda: ref.fp8_per_tensor_scale(*tensors, name=name), name)
    return torch.tensor(lib.refitd_scale_from_amax_bits(amax), dtype=torch.float32)


def quantize_fp8_per_tensor(
    w: torch.Tensor,
    *,
    scale: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    name: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sidecar.numerics.reference.quantize_fp8_per_tensor`, natively where it applies."""
    lib = _lib_for(w)
    if lib is None or w.dim() == 0:
        return ref.quantize_fp8_per_tensor(w, scale=scale, out=out, name=name)
    ref._check_input(w, name, Format.FP8_PER_TENSOR)
    q, s = ref._check_out(out, w, (), torch.float32, name)
    split = _row_split(w)
    xv, qv = _view3(w, split), _view3(q, split)
    if xv is None or qv is None:
        return ref.quantize_fp8_per_tensor(w, scale=scale, out=(q, s), name=name)
    clamp = scale is not None
    if scale is None:
        amax = _amax_bits(lib, w, xv)
        if amax >= _BF16_NONFINITE:
            _raise_like_reference(lambda: ref.quantize_fp8_per_tensor(w, name=name), name)
        value = lib.refitd_scale_from_amax_bits(amax)
    else:
        value = float(ref.check_shared_scale(scale, name))
        if not FLT_MIN <= value <= _FLT_MAX:  # 0, negative, subnormal, Inf or NaN: 1 / value is not
            # a finite positive multiplier, and the reference's NaN-producing arithmetic is the answer
            return ref.quantize_fp8_per_tensor(w, scale=scale, out=(q, s), name=name)
    batch, n, k, xbs, xrs = xv
    args = (_ptr(w), n, k, xbs, xrs, _ptr(q), qv[3], qv[4], value, int(clamp))
    seen = _POOL.run(lambda b, e: lib.refitd_fp8_per_tensor(*args, b, e), batch * n, k)
    if max(seen) >= _BF16_NONFINITE:  # only a shared scale's pass looks (a computed one already did)
        _raise_like_reference(lambda: ref.quantize_fp8_per_tensor(w, scale=scale, name=name), name)
    s.fill_(value)
    return q, s


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
    views = []
    for t in tensors:
        lib = _lib_for(t)
        view = None if lib is None or t.dim() < 2 or t.shape[-1] % NVFP4_BLOCK else _view3(t, _row_split(t))
        if view is None:
            return fourbit.nvfp4_global_scale(*tensors, name=name)
        views.append((lib, t, view))
    if not views:
        return fourbit.nvfp4_global_scale(*tensors, name=name)
    amax = _amax_bits_of(views[0][0], [(t, view) for _, t, view in views])
    if amax >= _BF16_NONFINITE:
        _raise_like_reference(lambda: fourbit.nvfp4_global_scale(*tensors, name=name), name)
    return torch.tensor(_nvfp4_global_scale_value(amax), dtype=torch.float32)


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
    lib = _lib_for(w)
    if lib is None or w.dim() < 2 or w.shape[-1] % NVFP4_BLOCK:
        return fourbit.quantize_nvfp4(w, global_scale=global_scale, out=out, name=name)
    q, s, g = fourbit.nvfp4_outputs(w, out, name)
    views = _rows_native(lib, w, (q, s))
    if views is None:
        return fourbit.quantize_nvfp4(w, global_scale=global_scale, out=(q, s, g), name=name)
    if global_scale is None:
        gs = nvfp4_global_scale(w, name=name)
    else:
        gs = ref.check_shared_scale(global_scale, name, "global_scale")
    value = float(gs)
    (batch, n, k, xbs, xrs), qv, sv = views
    args = (_ptr(w), n, k, xbs, xrs, _ptr(q), qv[3], qv[4], _ptr(s), sv[3], sv[4], value)
    bad = _POOL.run(lambda b, e: lib.refitd_nvfp4(*args, b, e), batch * n, k)
    if any(r >= 0 for r in bad):
        _raise_like_reference(lambda: fourbit.quantize_nvfp4(w, global_scale=gs, name=name), name)
    g.fill_(value)
    return q, s, g


def quantize_mxfp4(
    w: torch.Tensor, *, out: tuple[torch.Tensor, torch.Tensor] | None = None, name: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sidecar.numerics.fourbit.quantize_mxfp4`, natively where it applies."""
    lib = _lib_for(w)
    if lib is None or w.dim() < 1 or w.shape[-1] % MXFP4_BLOCK:
        return fourbit.quantize_mxfp4(w, out=out, name=name)
    q, s = fourbit.mxfp4_outputs(w, out, name)
    views = _rows_native(lib, w, (q, s))
    if views is None:
        return fourbit.quantize_mxfp4(w, out=(q, s), name=name)
    (batch, n, k, xbs, xrs), qv, sv = views
    args = (_ptr(w), n, k, xbs, xrs, _ptr(q), qv[3], qv[4], _ptr(s), sv[3], sv[4])
    bad = _POOL.run(lambda b, e: lib.refitd_mxfp4(*args, b, e), batch * n, k)
    if any(r >= 0 for r in bad):
        _raise_like_reference(lambda: fourbit.quantize_mxfp4(w, name=name), name)
    return q, s


def quantize_int4(
    w: torch.Tensor,
    *,
    group: int = INT4_GROUP,
    scale_dtype: torch.dtype = torch.bfloat16,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    name: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`sidecar.numerics.fourbit.quantize_int4`, natively where it applies."""
    lib = _lib_for(w)
    kw = {"group": group, "scale_dtype": scale_dtype, "name": name}
    if lib is None or w.dim() < 2:
        return fourbit.quantize_int4(w, out=out, **kw)
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
        return fourbit.quantize_int4(w, out=(packed, s, shape), **kw)
    (batch, n, k, xbs, xrs), qv, sv = views
    f32 = int(scale_dtype == torch.float32)
    args = (_ptr(w), n, k, xbs, xrs, _ptr(packed), qv[3], qv[4], _ptr(s), sv[3], sv[4], group, f32)
    bad = _POOL.run(lambda b, e: lib.refitd_int4(*args, b, e), batch * n, k)
    if any(r >= 0 for r in bad):
        _raise_like_reference(lambda: fourbit.quantize_int4(w, **kw), name)
    shape.copy_(torch.tensor(tuple(w.shape[-2:]), dtype=torch.int64))
    return packed, s, shape


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
    fmt = Format.parse(fmt)
    if fmt is Format.BLOCK_FP8:
        return quantize_block_fp8(w, out=out, name=name)
    if fmt is Format.MXFP8:
        return quantize_mxfp8(w, out=out, name=name)
    if fmt is Format.FP8_PER_TENSOR:
        return quantize_fp8_per_tensor(w, out=out, name=name)
    if fmt is Format.NVFP4:
        return quantize_nvfp4(w, out=out, name=name)
    if fmt is Format.MXFP4:
        return quantize_mxfp4(w, out=out, name=name)
    if fmt is Format.INT4_W4A16:
        return quantize_int4(w, out=out, name=name)
    return ref.quantize(w, fmt, out=out, name=name)  # its error for a format with nothing to quantize


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
