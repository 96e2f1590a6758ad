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
The FP8 formats are here, the 4-bit ones in :mod:`sidecar.numerics.cpu_fourbit` (re-exported here),
what they share (views, :class:`Prepared`, the threads) in :mod:`sidecar.numerics.native_calls`.

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

import logging
import time
from collections.abc import Callable, Sequence

import torch

from sidecar.numerics import cpu_fourbit, native
from sidecar.numerics import reference as ref
from sidecar.numerics.cpu_fourbit import (
    nvfp4_global_scale,
    prepare_int4,
    prepare_mxfp4,
    prepare_nvfp4,
    prepare_nvfp4_global_scale,
    quantize_int4,
    quantize_mxfp4,
    quantize_nvfp4,
    quantize_nvfp4_groups,
)
from sidecar.numerics.formats import BLOCK, FLT_MIN, INT4_GROUP, MX_BLOCK, MXFP4_BLOCK, NVFP4_BLOCK, Format
from sidecar.numerics.kernels import WarmUp
from sidecar.numerics.native_calls import (
    BF16_NONFINITE,
    FLT_MAX,
    POOL,
    Prepared,
    amax_call,
    group_call,
    lib_for,
    ptr,
    raise_like_reference,
    row_split,
    run_one,
    run_prepared,
    shared_views,
    view3,
)
from sidecar.numerics.threads import MIN_SPLIT_ELEMS

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
    "quantize_fp8_per_tensor_groups",
    "quantize_int4",
    "quantize_mxfp4",
    "quantize_mxfp8",
    "quantize_nvfp4",
    "quantize_nvfp4_groups",
    "run_prepared",
    "warm_up",
]

log = logging.getLogger("sidecar.numerics.native")


def native_applies(w: torch.Tensor, fmt: Format | str) -> bool:
    """Whether ``w`` would be quantized by the native kernels (with outputs allocated here)."""
    fmt = Format.parse(fmt)
    if lib_for(w) is None or (fmt is Format.BLOCK_FP8 and w.dim() < 2):
        return False
    if fmt is Format.MXFP8 and (w.dim() < 1 or w.shape[-1] % MX_BLOCK):
        return False
    if fmt in (Format.NVFP4, Format.INT4_W4A16) and w.dim() < 2:
        return False
    multiple = {Format.NVFP4: NVFP4_BLOCK, Format.MXFP4: MXFP4_BLOCK, Format.INT4_W4A16: INT4_GROUP}.get(fmt)
    if multiple is not None and (w.dim() < 1 or w.shape[-1] % multiple):
        return False
    split = w.dim() - 2 if fmt is Format.BLOCK_FP8 else row_split(w)
    return w.dim() > 0 and view3(w, split) is not None


# --------------------------------------------------------------------------------------------------
# block-FP8


def quantize_block_fp8(
    w: torch.Tensor, *, out: tuple[torch.Tensor, torch.Tensor] | None = None, name: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sidecar.numerics.reference.quantize_block_fp8`, natively where it applies."""
    return run_one(prepare_block_fp8(w, out=out, name=name))


def prepare_block_fp8(
    w: torch.Tensor, *, out: tuple[torch.Tensor, torch.Tensor] | None = None, name: str | None = None
) -> Prepared:
    """:func:`quantize_block_fp8`, checked and ready to run (:class:`Prepared`)."""
    lib = lib_for(w)
    if lib is None or w.dim() < 2:
        return Prepared.done(ref.quantize_block_fp8(w, out=out, name=name))
    ref._check_input(w, name, Format.BLOCK_FP8)
    q, s = ref._check_out(out, w, Format.BLOCK_FP8.scale_shape(tuple(w.shape)), torch.float32, name)
    split = w.dim() - 2
    xv, qv, sv = view3(w, split), view3(q, split), view3(s, split)
    if xv is None or qv is None or sv is None:
        return Prepared.done(ref.quantize_block_fp8(w, out=(q, s), name=name))
    batch, n, k, xbs, xrs = xv
    args = (ptr(w), n, k, xbs, xrs, ptr(q), qv[3], qv[4], ptr(s), sv[3], sv[4])

    def finish(bad: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        if any(r >= 0 for r in bad):
            raise_like_reference(lambda: ref.quantize_block_fp8(w, name=name), name)
        return q, s

    return Prepared(lambda b, e: lib.refitd_block_fp8(*args, b, e), batch * -(-n // BLOCK), BLOCK * k, finish)


# --------------------------------------------------------------------------------------------------
# MXFP8


def quantize_mxfp8(
    w: torch.Tensor, *, out: tuple[torch.Tensor, torch.Tensor] | None = None, name: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sidecar.numerics.reference.quantize_mxfp8`, natively where it applies."""
    return run_one(prepare_mxfp8(w, out=out, name=name))


def prepare_mxfp8(
    w: torch.Tensor, *, out: tuple[torch.Tensor, torch.Tensor] | None = None, name: str | None = None
) -> Prepared:
    """:func:`quantize_mxfp8`, checked and ready to run (:class:`Prepared`)."""
    lib = lib_for(w)
    if lib is None or w.dim() < 1 or w.shape[-1] % MX_BLOCK:
        return Prepared.done(ref.quantize_mxfp8(w, out=out, name=name))
    ref._check_input(w, name, Format.MXFP8)
    q, s = ref._check_out(out, w, Format.MXFP8.scale_shape(tuple(w.shape)), torch.uint8, name)
    split = row_split(w)
    xv, qv, sv = view3(w, split), view3(q, split), view3(s, split)
    if xv is None or qv is None or sv is None:
        return Prepared.done(ref.quantize_mxfp8(w, out=(q, s), name=name))
    batch, n, k, xbs, xrs = xv
    args = (ptr(w), n, k, xbs, xrs, ptr(q), qv[3], qv[4], ptr(s), sv[3], sv[4])

    def finish(bad: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        if any(r >= 0 for r in bad):
            raise_like_reference(lambda: ref.quantize_mxfp8(w, name=name), name)
        return q, s

    return Prepared(lambda b, e: lib.refitd_mxfp8(*args, b, e), batch * n, k, finish)


# --------------------------------------------------------------------------------------------------
# shared scales and FP8 per-tensor


def fp8_per_tensor_scale(*tensors: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """:func:`sidecar.numerics.reference.fp8_per_tensor_scale`, natively when every tensor qualifies."""
    return run_one(prepare_fp8_per_tensor_scale(*tensors, name=name))


def prepare_fp8_per_tensor_scale(*tensors: torch.Tensor, name: str | None = None) -> Prepared:
    """:func:`fp8_per_tensor_scale`, ready to run (:class:`Prepared`)."""
    found = shared_views(tensors, lambda t: t.dim() > 0)
    if found is None:
        return Prepared.done(ref.fp8_per_tensor_scale(*tensors, name=name))
    lib, views = found

    def finish(amax: int) -> torch.Tensor:
        if amax >= BF16_NONFINITE:
            raise_like_reference(lambda: ref.fp8_per_tensor_scale(*tensors, name=name), name)
        return torch.tensor(lib.refitd_scale_from_amax_bits(amax), dtype=torch.float32)

    return amax_call(lib, views, finish)


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
    return run_one(prepare_fp8_per_tensor(w, scale=scale, out=out, name=name))


def prepare_fp8_per_tensor(
    w: torch.Tensor,
    *,
    scale: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    name: str | None = None,
) -> Prepared:
    """:func:`quantize_fp8_per_tensor`, checked and ready to run (:class:`Prepared`). Without ``scale``
    the tensor's own amax pass runs here, first."""
    lib = lib_for(w)
    if lib is None or w.dim() == 0:
        return Prepared.done(ref.quantize_fp8_per_tensor(w, scale=scale, out=out, name=name))
    ref._check_input(w, name, Format.FP8_PER_TENSOR)
    q, s = ref._check_out(out, w, (), torch.float32, name)
    split = row_split(w)
    xv, qv = view3(w, split), view3(q, split)
    if xv is None or qv is None:
        return Prepared.done(ref.quantize_fp8_per_tensor(w, scale=scale, out=(q, s), name=name))
    clamp = scale is not None
    if scale is None:
        value = float(run_one(prepare_fp8_per_tensor_scale(w, name=name)))
    else:
        value = float(ref.check_shared_scale(scale, name))
        if not FLT_MIN <= value <= FLT_MAX:  # 0, negative, subnormal, Inf or NaN: 1 / value is not
            # a finite positive multiplier, and the reference's NaN-producing arithmetic is the answer
            return Prepared.done(ref.quantize_fp8_per_tensor(w, scale=scale, out=(q, s), name=name))
    batch, n, k, xbs, xrs = xv
    args = (ptr(w), n, k, xbs, xrs, ptr(q), qv[3], qv[4], value, int(clamp))

    def finish(seen: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        if max(seen) >= BF16_NONFINITE:  # only a shared scale's pass looks (a computed one already did)
            raise_like_reference(lambda: ref.quantize_fp8_per_tensor(w, scale=scale, name=name), name)
        s.fill_(value)
        return q, s

    return Prepared(lambda b, e: lib.refitd_fp8_per_tensor(*args, b, e), batch * n, k, finish)


#: an FP8 per-tensor scale group: (tensors, their out= buffers, their names, the group's name)
Fp8Group = tuple[
    Sequence[torch.Tensor], Sequence[tuple[torch.Tensor, torch.Tensor]], Sequence[str | None], str
]


def quantize_fp8_per_tensor_groups(
    groups: Sequence[Fp8Group], ran: list[Prepared] | None = None
) -> list[torch.Tensor]:
    """FP8 per-tensor scale groups (an expert's gate and up share one scale); returns each group's scale.

    As :func:`quantize_nvfp4_groups`: with at least ``GROUPS_PER_THREAD`` groups a thread, a thread
    takes a run of whole groups through the native group pipeline (``refitd_fp8_per_tensor_groups``: a
    group's amax read while the group before it converts, whose bytes are still in cache: about one
    pass over memory); with fewer, every group's amax as one split, then every member's conversion as
    another. Bytes and errors are the same either way. ``ran`` receives the pipeline's call when it ran
    (sidecar.plan.reuse keeps it)."""
    if len(groups) >= cpu_fourbit.GROUPS_PER_THREAD * POOL.threads():
        pipelined = _fp8_per_tensor_pipeline(groups)
        if pipelined is not None:
            scales = run_one(pipelined)
            if ran is not None:
                ran.append(pipelined)
            return scales
        return run_prepared([_prepare_fp8_per_tensor_group(*g) for g in groups])
    scales = run_prepared([prepare_fp8_per_tensor_scale(*ts, name=label) for ts, _, _, label in groups])
    calls = []
    for (tensors, outs, names, _), scale in zip(groups, scales, strict=True):
        calls += [
            prepare_fp8_per_tensor(w, scale=scale, out=o, name=n) for w, o, n in zip(tensors, outs, names)
        ]
    run_prepared(calls)
    return scales


def _fp8_per_tensor_pipeline(groups: Sequence[Fp8Group]) -> Prepared | None:
    """The groups through native ``refitd_fp8_per_tensor_groups`` (each group's amax read while the one
    before it converts), or None where a group is not all for the native kernels, a check refuses one
    (the group by group path then raises the reference's error, in order) or the build lacks it."""
    members, fills = [], []
    for tensors, outs, names, _ in groups:
        if not tensors:  # the reference's error for a group of nothing, group by group
            return None
        fields = []
        for w, out, name in zip(tensors, outs, names, strict=True):
            lib = lib_for(w)
            run = None if lib is None else getattr(lib, "refitd_fp8_per_tensor_groups", None)
            if run is None:
                return None
            claimed = getattr(lib, "refitd_fp8_per_tensor_groups_claimed", None)
            try:
                ref._check_input(w, name, Format.FP8_PER_TENSOR)
                q, s = ref._check_out(out, w, (), torch.float32, name)
            except ValueError:
                return None
            split = row_split(w)
            xv, qv = view3(w, split), view3(q, split)
            if xv is None or qv is None:
                return None
            batch, n, k, xbs, xrs = xv
            fields.append((ptr(w), batch, n, k, xbs, xrs, ptr(q), qv[3], qv[4], 0, 0, 0))
            fills.append((len(members), s))
        members.append(fields)

    def refuse(bad: int) -> None:
        tensors, label = groups[bad][0], groups[bad][3]
        raise_like_reference(lambda: ref.fp8_per_tensor_scale(*tensors, name=label), label)

    return group_call(run, members, fills, refuse, claimed)


def _prepare_fp8_per_tensor_group(
    tensors: Sequence[torch.Tensor],
    outs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    names: Sequence[str | None],
    label: str,
) -> Prepared:
    """One scale group as one call of one unit (it never splits): the amax over its tensors, the scale,
    then each tensor's conversion clamped by it (a shared scale, as the two-pass path passes it). A
    group that the native kernels do not take, or that a check refuses, runs the two-pass way at once
    (the same bytes, and the reference's errors in their order)."""
    found = shared_views(tensors, lambda t: t.dim() > 0)
    members: list | None = [] if found is not None else None
    for w, out, name in zip(tensors, outs, names, strict=True):
        if members is None:
            break
        try:
            ref._check_input(w, name, Format.FP8_PER_TENSOR)
            q, s = ref._check_out(out, w, (), torch.float32, name)
        except ValueError:  # the two-pass path raises it, in the reference's words
            members = None
            break
        split = row_split(w)
        xv, qv = view3(w, split), view3(q, split)
        if xv is None or qv is None:
            members = None
            break
        batch, n, k, xbs, xrs = xv
        members.append((s, (ptr(w), n, k, xbs, xrs, ptr(q), qv[3], qv[4]), batch * n))
    if found is None or members is None:
        scale = fp8_per_tensor_scale(*tensors, name=label)
        for w, out, name in zip(tensors, outs, names, strict=True):
            quantize_fp8_per_tensor(w, scale=scale, out=out, name=name)
        return Prepared.done(scale)
    lib = found[0]
    state: dict[str, float] = {}

    def share(begin: int, end: int) -> int:
        amax = 0
        for _, args, rows in members:
            amax = max(amax, lib.refitd_amax_bits(*args[:5], 0, rows))
        if amax >= BF16_NONFINITE:
            return 1
        value = state["value"] = lib.refitd_scale_from_amax_bits(amax)
        for _, args, rows in members:
            lib.refitd_fp8_per_tensor(*args, value, 1, 0, rows)
        return 0

    def finish(bad: list[int]) -> torch.Tensor:
        if any(bad):
            raise_like_reference(lambda: ref.fp8_per_tensor_scale(*tensors, name=label), label)
        for s, _, _ in members:
            s.fill_(state["value"])
        return torch.tensor(state["value"], dtype=torch.float32)

    return Prepared(share, 1, sum(rows * args[2] for _, args, rows in members), finish)


# --------------------------------------------------------------------------------------------------
# dispatch and warm-up


def quantize(
    w: torch.Tensor,
    fmt: Format | str,
    *,
    out: tuple[torch.Tensor, ...] | None = None,
    name: str | None = None,
) -> tuple[torch.Tensor, ...]:
    """:func:`sidecar.numerics.reference.quantize`, natively where it applies."""
    return run_one(prepare(w, fmt, out=out, name=name))


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


def warm_up() -> WarmUp:
    """Build (if needed) and load the native kernels and start the threads, before a step needs them.

    Returns what the CPU path will use: impl ``"native"``, or ``"torch"`` with the reason.
    """
    t0 = time.monotonic()
    lib = native.load()
    seconds = time.monotonic() - t0
    if lib is None:
        return WarmUp("cpu", "torch", f"native CPU quantizers unavailable: {native.unavailable_reason()}")
    threads = POOL.threads()
    if threads > 1:
        POOL._get(threads - 1)
    log.info("native CPU quantizers loaded in %.2f s, %d threads", seconds, threads)
    return WarmUp("cpu", "native", None, 1, seconds)
