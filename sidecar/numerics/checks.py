"""What every quantizer path shares (the torch references, the native and Triton kernels): input and
``out=`` checks, the errors they raise, and small exact helpers. Kept below ``reference`` and
``fourbit`` so that neither imports the other's internals (the 4-bit reference dispatches from
``reference.quantize``)."""

from __future__ import annotations

import functools
import math

import torch

from sidecar.numerics.formats import E8M0_BIAS, FLOAT_DTYPES, MX_BLOCK, Format

__all__ = ["DEFAULT_CHUNK_ELEMS", "NonFiniteError", "check_shared_scale"]

#: float32 scratch elements per chunk (4 MiB): measured fastest on a 2-core CPU (bench/quant.py).
DEFAULT_CHUNK_ELEMS = 1 << 20

_F32_MANTISSA_BITS = 23
_F32_MANTISSA_MASK = (1 << _F32_MANTISSA_BITS) - 1
_F32_EXP_MASK = 0xFF
_F32_TWO_POW_MINUS_127_BITS = 1 << (_F32_MANTISSA_BITS - 1)  # 2^-127 is a float32 subnormal


class NonFiniteError(ValueError):
    """A tensor to be quantized holds NaN or Inf (SPEC §1.4): it is refused, never made finite."""


def _label(name: str | None) -> str:
    return f"tensor {name!r}" if name else "input tensor"


def _check_input(w: torch.Tensor, name: str | None, fmt: Format) -> None:
    if not isinstance(w, torch.Tensor):
        raise ValueError(f"{_label(name)}: expected a torch.Tensor, got {type(w).__name__}")
    if w.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"{_label(name)} has dtype {w.dtype}; {fmt.value} quantizes bfloat16, float16 or float32 "
            "weights only (pass the trainer's high-precision tensor, not an already quantized one)"
        )
    if fmt is Format.BLOCK_FP8 and w.dim() < 2:
        raise ValueError(
            f"{_label(name)} has shape {tuple(w.shape)}; block_fp8 needs at least 2 dims [..., N, K]"
        )
    if fmt in (Format.NVFP4, Format.INT4_W4A16) and w.dim() < 2:
        raise ValueError(
            f"{_label(name)} has shape {tuple(w.shape)}; {fmt.value} needs at least 2 dims [..., N, K]"
        )
    multiple = _LAST_DIM_MULTIPLE.get(fmt)
    if multiple is not None:
        if w.dim() < 1:
            raise ValueError(f"{_label(name)} is 0-d; {fmt.value} needs at least 1 dim [..., K]")
        if w.shape[-1] % multiple:
            raise ValueError(
                f"{_label(name)} has shape {tuple(w.shape)}: {fmt.value} needs the last dim K to be a "
                f"multiple of {multiple}, and K={w.shape[-1]} is not; keep this tensor in bf16 "
                "(ignore_patterns) or choose block_fp8"
            )


#: formats whose blocks run along the last dim: K must be a multiple of this (int4's group is
#: checked by its quantizer, which knows the group)
_LAST_DIM_MULTIPLE = {
    Format.MXFP8: MX_BLOCK,
    Format.NVFP4: 16,
    Format.MXFP4: 32,
    Format.INT4_W4A16: 8,
}


def _overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` share memory (an ``expand``-ed or ``as_strided`` view).

    Written into from several threads such a buffer is a data race, and what lands in it depends on
    timing; torch's own ``copy_`` refuses the obvious cases only. Exact: a quick sufficient test on
    the strides (each dim, by increasing stride, steps past everything the smaller ones reach), and
    for layouts that fail it (rare, never the daemon's) a count of the distinct offsets.
    """
    return _overlapping_layout(tuple(t.shape), t.stride())


@functools.lru_cache(maxsize=4096)
def _overlapping_layout(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """:func:`_overlaps_itself` of a shape and strides (the daemon's buffers repeat a few layouts)."""
    dims = sorted((st, n) for n, st in zip(shape, strides) if n > 1)
    reach = 0
    for st, n in dims:
        if st <= reach:
            break
        reach += (n - 1) * st
    else:
        return False
    if any(st == 0 for st, _ in dims):
        return True
    offsets = torch.zeros((), dtype=torch.int64)
    for st, n in dims:
        offsets = (offsets[..., None] + torch.arange(n, dtype=torch.int64) * st).flatten()
    return int(torch.unique(offsets).numel()) != int(offsets.numel())


def _check_out_buffers(
    out: tuple[torch.Tensor, ...] | None,
    w: torch.Tensor,
    wanted: tuple[tuple[str, tuple[int, ...], torch.dtype], ...],
    name: str | None,
) -> tuple[torch.Tensor, ...]:
    """The caller's ``out=`` buffers, checked against ``wanted`` ((what, shape, dtype) each), or new
    ones. Refused with a ValueError on every path alike: a wrong count, shape, dtype or device, and a
    buffer whose elements overlap (the native kernels would race on it)."""
    if out is None:
        return tuple(torch.empty(shape, dtype=dtype, device=w.device) for _, shape, dtype in wanted)
    key = _layout_key(w, out, wanted)  # buffers laid out as a call already checked: it passes again
    if key is not None and key in _PASSED:
        return tuple(out)
    if not (isinstance(out, (tuple, list)) and len(out) == len(wanted)):
        names = ", ".join(what for what, _, _ in wanted)
        raise ValueError(f"{_label(name)}: out= must be a tuple of {len(wanted)} tensors ({names})")
    for (what, shape, dtype), t in zip(wanted, out):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{_label(name)}: out {what} buffer is a {type(t).__name__}, not a torch.Tensor")
        if tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != w.device:
            raise ValueError(
                f"{_label(name)}: out {what} buffer is {t.dtype} {tuple(t.shape)} on {t.device}, "
                f"expected {dtype} {tuple(shape)} on {w.device}"
            )
        if _overlaps_itself(t):
            raise ValueError(
                f"{_label(name)}: out {what} buffer {tuple(t.shape)} with strides {t.stride()} has elements "
                "that share memory (an expand()-ed or as_strided view); pass a buffer with one location "
                "per element (.clone() it, or allocate it from the plan)"
            )
    # every buffer is on w's device (checked above): the byte spans alone decide, each found once (a
    # slab's hundreds of projections each check their buffers, on the daemon's quantize path)
    spans = [
        ("the input", _byte_span(w)),
        *((f"the out {what} buffer", _byte_span(t)) for (what, _, _), t in zip(wanted, out)),
    ]
    for i in range(1, len(spans)):
        for j in range(i):
            if _spans_meet(spans[i][1], spans[j][1]):
                raise ValueError(
                    f"{_label(name)}: {spans[i][0]} shares memory with {spans[j][0]} (SPEC §1.4: out= "
                    "buffers must not overlap the input or each other; the kernels write scales before "
                    "they finish reading a row): pass separate buffers, allocated from the plan"
                )
    if key is not None:
        if len(_PASSED) >= _PASSED_MAX:  # a plain dict, emptied when full: atomic under the GIL for the
            _PASSED.clear()  # daemon's worker threads, and far more than a model's layouts
        _PASSED[key] = None
    return tuple(out)


#: layouts of (input, out= buffers, what was wanted) that passed _check_out_buffers. Every
#: check there is a function of the tensors' addresses, shapes, strides, dtypes and devices alone, so a call
#: with the same ones passes again: the daemon's arenas hand the same views step after step, and a slab's
#: hundred projections cost ~10 us each to check anew (a fifth of the Python around the kernels)
_PASSED: dict[tuple, None] = {}
_PASSED_MAX = 8192


def _layout_key(w: torch.Tensor, out: object, wanted: tuple) -> tuple | None:
    """What _check_out_buffers' verdict depends on, as a key; None where ``out`` is not all tensors (the
    checks then name what is wrong)."""
    if not (isinstance(out, (tuple, list)) and len(out) == len(wanted)):
        return None
    key = [wanted, w.data_ptr(), w.shape, w.stride(), w.dtype, w.device, w.element_size()]
    for t in out:
        if not isinstance(t, torch.Tensor):
            return None
        key += (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)
    try:
        hash(wanted)
    except TypeError:  # a caller's shapes as lists: checked anew each time
        return None
    return tuple(key)


def _byte_span(t: torch.Tensor) -> tuple[int, int] | None:
    """``[first, end)`` addresses of the bytes ``t`` may touch; None when it holds no elements."""
    if t.numel() == 0 or t.device.type == "meta":
        return None
    reach = sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
    start = t.data_ptr()
    return start, start + (reach + 1) * t.element_size()


def _spans_meet(sa: tuple[int, int] | None, sb: tuple[int, int] | None) -> bool:
    """Whether two byte spans (of tensors on one device) intersect: the tensors may share memory
    (conservative for two strided views that interleave without sharing an element; no caller of the
    quantizers makes those, and refusing them costs nothing)."""
    return sa is not None and sb is not None and sa[0] < sb[1] and sb[0] < sa[1]


def check_shared_scale(scale: object, name: str | None, what: str = "scale") -> torch.Tensor:
    """A caller's shared scale, as a 0-d float32 tensor; anything else (a Python float included), and
    (SPEC §1.4) a value that is NaN, ±Inf, negative or -0.0, is refused with the same ValueError on
    every path (reference, native, Triton). +0.0 is taken: what a zero scale quantizes to is in
    SPEC §1.4."""
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1 or scale.dtype != torch.float32:
        got = (
            type(scale).__name__
            if not isinstance(scale, torch.Tensor)
            else f"{scale.dtype} {tuple(scale.shape)}"
        )
        raise ValueError(
            f"{_label(name)}: a shared {what}= must be one float32 value in a torch.Tensor "
            f"(torch.tensor(x, dtype=torch.float32)), got {got}"
        )
    value = float(scale.reshape(()))
    if not math.isfinite(value) or math.copysign(1.0, value) < 0:
        raise ValueError(
            f"{_label(name)}: a shared {what}= must be finite and not negative (docs/spec.md §1.4), got {value!r}; "
            "compute it from the tensors' amax (nvfp4_global_scale / the per-tensor scale) instead"
        )
    return scale.reshape(())


def _raise_non_finite(name: str | None, where: str) -> None:
    raise NonFiniteError(
        f"{_label(name)} holds NaN or Inf ({where}); refusing to quantize it. The trainer sent "
        "non-finite weights (a diverged step?): fix the source, or skip this step"
    )


def _unravel(index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for dim in reversed(shape):
        out.append(index % dim if dim else 0)
        index = index // dim if dim else 0
    return tuple(reversed(out))


def _flatten_lead(t: torch.Tensor, keep: int) -> torch.Tensor | None:
    """View ``t`` with all but its last ``keep`` dims flattened into one, or None if strides forbid."""
    lead = t.shape[: t.dim() - keep]
    try:
        return t.view(math.prod(lead), *t.shape[t.dim() - keep :])
    except RuntimeError:
        return None


def _pow2_from_exponent(exponent: torch.Tensor) -> torch.Tensor:
    """Exact float32 ``2^exponent`` for int32 exponents in [-127, 127], built from bits."""
    bits = (exponent + E8M0_BIAS) << _F32_MANTISSA_BITS
    bits = torch.where(exponent == -E8M0_BIAS, torch.full_like(bits, _F32_TWO_POW_MINUS_127_BITS), bits)
    return bits.view(torch.float32)
