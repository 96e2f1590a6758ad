"""The 4-bit formats' CPU quantizers (SPEC §1.5-1.7: NVFP4, MXFP4, INT4 W4A16): the native kernels
(``native/fourbit.c``) where they apply, the torch reference (:mod:`sidecar.numerics.fourbit`)
everywhere else, with its signatures, errors and bytes. Rows formats, split by rows like MXFP8; see
:mod:`sidecar.numerics.cpu` for how calls are checked, prepared and run."""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence
from typing import Any

import torch

from sidecar.numerics import fourbit
from sidecar.numerics import reference as ref
from sidecar.numerics.formats import INT4_GROUP, MXFP4_BLOCK, NVFP4_BLOCK, NVFP4_GLOBAL_DIVISOR
from sidecar.numerics.native_calls import (
    BF16_NONFINITE,
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

__all__ = [
    "GROUPS_PER_THREAD",
    "nvfp4_global_scale",
    "prepare_int4",
    "prepare_mxfp4",
    "prepare_nvfp4",
    "prepare_nvfp4_global_scale",
    "quantize_int4",
    "quantize_mxfp4",
    "quantize_nvfp4",
    "quantize_nvfp4_groups",
]


def _rows_native(lib, w: torch.Tensor, outs: tuple[torch.Tensor, ...]):
    """(lib, input view, output views) when ``w`` and every output fold to [batch, rows, cols] views
    alike (the output strides then index the same rows), else None (the reference runs)."""
    if lib is None or w.dim() < 1:
        return None
    split = row_split(w)
    views = [view3(t, split) for t in (w, *outs)]
    if any(v is None for v in views):
        return None
    return views


def nvfp4_global_scale(*tensors: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """:func:`sidecar.numerics.fourbit.nvfp4_global_scale`, natively when every tensor qualifies."""
    return run_one(prepare_nvfp4_global_scale(*tensors, name=name))


def prepare_nvfp4_global_scale(*tensors: torch.Tensor, name: str | None = None) -> Prepared:
    """:func:`nvfp4_global_scale`, ready to run (:class:`Prepared`)."""
    found = shared_views(tensors, lambda t: t.dim() >= 2 and t.shape[-1] % NVFP4_BLOCK == 0)
    if found is None:
        return Prepared.done(fourbit.nvfp4_global_scale(*tensors, name=name))
    lib, views = found

    def finish(amax: int) -> torch.Tensor:
        if amax >= BF16_NONFINITE:
            raise_like_reference(lambda: fourbit.nvfp4_global_scale(*tensors, name=name), name)
        return torch.tensor(_nvfp4_global_scale_value(amax), dtype=torch.float32)

    return amax_call(lib, views, finish)


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
    return run_one(prepare_nvfp4(w, global_scale=global_scale, out=out, name=name))


def prepare_nvfp4(
    w: torch.Tensor,
    *,
    global_scale: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    name: str | None = None,
) -> Prepared:
    """:func:`quantize_nvfp4`, checked and ready to run (:class:`Prepared`). Without ``global_scale``
    the tensor's own amax pass runs here, first."""
    lib = lib_for(w)
    if lib is None or w.dim() < 2 or w.shape[-1] % NVFP4_BLOCK:
        return Prepared.done(fourbit.quantize_nvfp4(w, global_scale=global_scale, out=out, name=name))
    q, s, g = fourbit.nvfp4_outputs(w, out, name)
    kernel = _nvfp4_kernel_args(lib, w, q, s)
    if kernel is None:
        return Prepared.done(fourbit.quantize_nvfp4(w, global_scale=global_scale, out=(q, s, g), name=name))
    if global_scale is None:
        gs = nvfp4_global_scale(w, name=name)
    else:
        gs = ref.check_shared_scale(global_scale, name, "global_scale")
    value = float(gs)
    args, rows = kernel
    args = (*args, value)

    def finish(bad: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if any(r >= 0 for r in bad):
            raise_like_reference(lambda: fourbit.quantize_nvfp4(w, global_scale=gs, name=name), name)
        g.fill_(value)
        return q, s, g

    return Prepared(lambda b, e: lib.refitd_nvfp4(*args, b, e), rows, w.shape[-1], finish)


def _nvfp4_kernel_args(lib, w: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> tuple[tuple, int] | None:
    """``refitd_nvfp4``'s arguments up to the global scale, and ``w``'s rows; None when ``w``, ``q``
    and ``s`` do not fold to ``[batch, rows, cols]`` alike (the reference runs)."""
    views = _rows_native(lib, w, (q, s))
    if views is None:
        return None
    (batch, n, k, xbs, xrs), qv, sv = views
    return (ptr(w), n, k, xbs, xrs, ptr(q), qv[3], qv[4], ptr(s), sv[3], sv[4]), batch * n


#: scale groups a thread below which :func:`quantize_nvfp4_groups` splits each pass across the threads
#: instead of handing out whole groups (too few to share the threads evenly)
GROUPS_PER_THREAD = 2

Nvfp4Group = tuple[
    Sequence[torch.Tensor],
    Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    Sequence[str | None],
    str,
]


def quantize_nvfp4_groups(
    groups: Sequence[Nvfp4Group], ran: list[Prepared] | None = None
) -> list[torch.Tensor]:
    """NVFP4 scale groups, each ``(tensors, their out= buffers, their names, the group's name)`` sharing
    one global scale (an expert's gate and up); returns each group's ``gs``.

    With at least :data:`GROUPS_PER_THREAD` groups a thread, a thread takes a run of whole groups through
    the native group pipeline (``refitd_nvfp4_groups``: a group's amax read while the group before it
    runs its kernels, re-reading its bytes from cache: a group is a few MiB, so the slab is read from
    memory about once, and the reads overlap the kernels' arithmetic). With fewer, each pass is split
    across the threads: every group's amax, then every member's kernel. Bytes and errors are the same
    either way. ``ran`` receives the pipeline's call when it ran (sidecar.plan.reuse keeps it)."""
    if len(groups) >= GROUPS_PER_THREAD * POOL.threads():
        pipelined = _nvfp4_pipeline(groups)
        if pipelined is not None:
            scales = run_one(pipelined)
            if ran is not None:
                ran.append(pipelined)
            return scales
        return run_prepared([_prepare_nvfp4_group(*g) for g in groups])
    scales = run_prepared([prepare_nvfp4_global_scale(*ts, name=label) for ts, _, _, label in groups])
    calls = []
    for (tensors, outs, names, _), gs in zip(groups, scales, strict=True):
        calls += [prepare_nvfp4(w, global_scale=gs, out=o, name=n) for w, o, n in zip(tensors, outs, names)]
    run_prepared(calls)
    return scales


def _nvfp4_pipeline(groups: Sequence[Nvfp4Group]) -> Prepared | None:
    """The groups through native ``refitd_nvfp4_groups`` (each group's amax read while the one before it
    converts), or None where a group is not all for the native kernels or the build lacks it (then group
    by group). Every member's buffers are checked first, as the group by group path does."""
    checked = [
        [fourbit.nvfp4_outputs(w, out, name) for w, out, name in zip(tensors, outs, names, strict=True)]
        for tensors, outs, names, _ in groups
    ]
    members, fills = [], []
    for (tensors, *_), bufs in zip(groups, checked, strict=True):
        if not tensors:  # the reference's error for a group of nothing, group by group
            return None
        fields = []
        for w, (q, s, g) in zip(tensors, bufs, strict=True):
            # nvfp4_outputs checked w's dims and K; the kernel's views fold or the groups go one by one
            lib = lib_for(w)
            run = None if lib is None else getattr(lib, "refitd_nvfp4_groups", None)
            kernel = None if run is None else _nvfp4_kernel_args(lib, w, q, s)
            if kernel is None:
                return None
            claimed = getattr(lib, "refitd_nvfp4_groups_claimed", None)
            (x, n, k, xbs, xrs, *qs), rows = kernel
            fields.append((x, rows // n, n, k, xbs, xrs, *qs))
            fills.append((len(members), g))
        members.append(fields)

    def refuse(bad: int) -> None:
        tensors, label = groups[bad][0], groups[bad][3]
        raise_like_reference(lambda: fourbit.nvfp4_global_scale(*tensors, name=label), label)

    return group_call(run, members, fills, refuse, claimed)


def _prepare_nvfp4_group(
    tensors: Sequence[torch.Tensor],
    outs: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    names: Sequence[str | None],
    label: str,
) -> Prepared:
    """One NVFP4 scale group as one call of one unit (it never splits): the amax over its tensors, the
    global scale, then each tensor's kernel; ``finish`` returns the ``gs`` tensor. A group some
    member of which is not for the native kernels runs at once, as :func:`quantize_nvfp4` would."""
    found = shared_views(tensors, lambda t: t.dim() >= 2 and t.shape[-1] % NVFP4_BLOCK == 0)
    members = []
    for w, out, name in zip(tensors, outs, names, strict=True):
        q, s, g = fourbit.nvfp4_outputs(w, out, name)
        kernel = None if found is None else _nvfp4_kernel_args(found[0], w, q, s)
        if kernel is None:
            members = None
            break
        members.append((w, name, *kernel, g))
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
        if amax >= BF16_NONFINITE:
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
                raise_like_reference(lambda: fourbit.nvfp4_global_scale(*tensors, name=label), label)
            w, name = state["bad"]
            gs = torch.tensor(state["value"], dtype=torch.float32)
            raise_like_reference(lambda: fourbit.quantize_nvfp4(w, global_scale=gs, name=name), name)
        for *_, g in members:
            g.fill_(state["value"])
        return torch.tensor(state["value"], dtype=torch.float32)

    elems = sum(rows * args[2] for _, _, args, rows, _ in members)
    return Prepared(share, 1, elems, finish)


def quantize_mxfp4(
    w: torch.Tensor, *, out: tuple[torch.Tensor, torch.Tensor] | None = None, name: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sidecar.numerics.fourbit.quantize_mxfp4`, natively where it applies."""
    return run_one(prepare_mxfp4(w, out=out, name=name))


def prepare_mxfp4(
    w: torch.Tensor, *, out: tuple[torch.Tensor, torch.Tensor] | None = None, name: str | None = None
) -> Prepared:
    """:func:`quantize_mxfp4`, checked and ready to run (:class:`Prepared`)."""
    lib = lib_for(w)
    if lib is None or w.dim() < 1 or w.shape[-1] % MXFP4_BLOCK:
        return Prepared.done(fourbit.quantize_mxfp4(w, out=out, name=name))
    q, s = fourbit.mxfp4_outputs(w, out, name)
    views = _rows_native(lib, w, (q, s))
    if views is None:
        return Prepared.done(fourbit.quantize_mxfp4(w, out=(q, s), name=name))
    (batch, n, k, xbs, xrs), qv, sv = views
    args = (ptr(w), n, k, xbs, xrs, ptr(q), qv[3], qv[4], ptr(s), sv[3], sv[4])

    def finish(bad: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        if any(r >= 0 for r in bad):
            raise_like_reference(lambda: fourbit.quantize_mxfp4(w, name=name), name)
        return q, s

    return Prepared(lambda b, e: lib.refitd_mxfp4(*args, b, e), batch * n, k, finish)


@functools.lru_cache(maxsize=256)
def _shape_tensor(n: int, k: int) -> torch.Tensor:
    """INT4's ``weight_shape`` values [n, k] as a tensor, made once a shape (a slab's projections repeat a
    few): only ever read, as the source of a copy."""
    return torch.tensor((n, k), dtype=torch.int64)


def quantize_int4(
    w: torch.Tensor,
    *,
    group: int = INT4_GROUP,
    scale_dtype: torch.dtype = torch.bfloat16,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    name: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`sidecar.numerics.fourbit.quantize_int4`, natively where it applies."""
    return run_one(prepare_int4(w, group=group, scale_dtype=scale_dtype, out=out, name=name))


def prepare_int4(
    w: torch.Tensor,
    *,
    group: int = INT4_GROUP,
    scale_dtype: torch.dtype = torch.bfloat16,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    name: str | None = None,
) -> Prepared:
    """:func:`quantize_int4`, checked and ready to run (:class:`Prepared`)."""
    lib = lib_for(w)
    kw = {"group": group, "scale_dtype": scale_dtype, "name": name}
    if lib is None or w.dim() < 2:
        return Prepared.done(fourbit.quantize_int4(w, out=out, **kw))
    packed, s, shape = fourbit.int4_outputs(w, out, group, scale_dtype, name)
    views = _rows_native(lib, w, (packed, s))
    if views is None:
        return Prepared.done(fourbit.quantize_int4(w, out=(packed, s, shape), **kw))
    (batch, n, k, xbs, xrs), qv, sv = views
    f32 = int(scale_dtype == torch.float32)
    args = (ptr(w), n, k, xbs, xrs, ptr(packed), qv[3], qv[4], ptr(s), sv[3], sv[4], group, f32)

    def finish(bad: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if any(r >= 0 for r in bad):
            raise_like_reference(lambda: fourbit.quantize_int4(w, **kw), name)
        shape.copy_(_shape_tensor(*w.shape[-2:]))
        return packed, s, shape

    return Prepared(lambda b, e: lib.refitd_int4(*args, b, e), batch * n, k, finish)
