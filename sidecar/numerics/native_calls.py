"""What the CPU quantizers share (sidecar.numerics.cpu, cpu_fourbit): tensors as ``[batch, rows,
cols]`` views for the native kernels, a checked call ready to run (:class:`Prepared`) and many of them
run as one split across the quantizer threads (:func:`run_prepared`), the amax pass of a shared scale,
and the reference's error for what a kernel flagged."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sidecar.numerics import native
from sidecar.numerics import reference as ref
from sidecar.numerics.threads import Claims, Pool

__all__ = [
    "BF16_NONFINITE",
    "FLT_MAX",
    "POOL",
    "Prepared",
    "amax_call",
    "fold",
    "group_call",
    "lib_for",
    "ptr",
    "raise_like_reference",
    "row_split",
    "run_one",
    "run_prepared",
    "shared_views",
    "view3",
]

#: sign-cleared bfloat16 bits at or above this are Inf or NaN
BF16_NONFINITE = 0x7F80
FLT_MAX = float.fromhex("0x1.fffffep127")  # largest finite float32

# --------------------------------------------------------------------------------------------------
# strided views as [batch, rows, cols]


def fold(shape: Sequence[int], strides: Sequence[int]) -> tuple[int, int] | None:
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


def view3(t: torch.Tensor, split: int) -> tuple[int, int, int, int, int] | None:
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
    batch = fold(shape[:split], strides[:split])
    rows = fold(shape[split:-1], strides[split:-1])
    if batch is None or rows is None:
        return None
    return batch[0], rows[0], shape[-1], batch[1], rows[1]


def row_split(t: torch.Tensor) -> int:
    """Where ``t``'s leading dims split into (batch, rows) for a rows format: all in rows if they fold."""
    return _row_split_of(tuple(t.shape), t.stride())


@functools.lru_cache(maxsize=4096)
def _row_split_of(shape: tuple[int, ...], strides: tuple[int, ...]) -> int:
    lead = len(shape) - 1
    return 0 if fold(shape[:lead], strides[:lead]) is not None else max(0, lead - 1)


def lib_for(w: torch.Tensor) -> ctypes.CDLL | None:
    if (
        not isinstance(w, torch.Tensor)
        or w.device.type != "cpu"
        or w.dtype != torch.bfloat16
        or w.numel() == 0
    ):
        return None
    return native.load()


# --------------------------------------------------------------------------------------------------
# prepared calls and the threads they run on


#: every call's shares run here (sidecar/numerics/threads.py)
POOL = Pool()


def ptr(t: torch.Tensor) -> int:
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
    #: a group call's float32 array of its groups' scales, which ``share`` writes (group_call; read by
    #: sidecar.plan.reuse, which runs the share again without ``finish``)
    scales: Any = None
    #: how the pool splits it (threads.Call's fourth field): None, chunks; a Claims, the kernel takes its
    #: units itself (a group pipeline); True, one share a thread (a group pipeline of an older build)
    split: Claims | bool | None = None

    @property
    def work(self) -> tuple:
        """What :meth:`Pool.run_many <sidecar.numerics.threads.Pool.run_many>` takes for it."""
        return (self.share, self.units, self.elems, self.split)

    @classmethod
    def done(cls, result: Any) -> Prepared:
        return cls(None, 0, 0, lambda _: result)


def run_prepared(calls: Sequence[Prepared]) -> list[Any]:
    """Run prepared calls together (one split across the threads) and return their results in order;
    the first call whose ``finish`` raises stops the rest (their outputs may be written, not finished)."""
    native = [c for c in calls if c.share is not None]
    results = iter(POOL.run_many([c.work for c in native]))
    return [c.finish(next(results) if c.share is not None else []) for c in calls]


def run_one(call: Prepared) -> Any:
    return run_prepared([call])[0]


# --------------------------------------------------------------------------------------------------
# shared scales: the amax over every tensor sharing one (an expert's gate and up)


def amax_call(
    lib: ctypes.CDLL,
    views: Sequence[tuple[torch.Tensor, tuple[int, int, int, int, int]]],
    finish: Callable[[int], Any],
) -> Prepared:
    """The largest sign-cleared bf16 bits over several tensors as one call: their rows numbered one
    after the other; ``finish`` gets that maximum."""
    spans = []  # (first row, end row, kernel args) a tensor
    rows = elems = 0
    for t, (batch, n, k, xbs, xrs) in views:
        spans.append((rows, rows + batch * n, (ptr(t), n, k, xbs, xrs)))
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


#: int64 fields a member tensor of a scale group takes (native/common.h's run_groups): x, batch, rows,
#: cols, x's batch and row strides, then q's pointer and strides, then s's (0 where a format has none)
MEMBER_FIELDS = 12


def group_call(
    run: Callable[..., int],
    members: Sequence[Sequence[tuple[int, ...]]],
    fills: Sequence[tuple[int, torch.Tensor]],
    refuse: Callable[[int], None],
    claimed: Callable[..., int] | None = None,
) -> Prepared:
    """Scale groups as one call of one unit a group, run by a native group runner ``run``
    (``refitd_fp8_per_tensor_groups``, ``refitd_nvfp4_groups``): each group's amax read while the group
    before it converts (one pass over memory, see common.h). With ``claimed`` (the runner's ``_claimed``
    entry point) every thread runs the whole call and takes groups one at a time as it comes free;
    without, a thread's share is a run of whole groups. ``members[g]`` holds group g's tensors'
    MEMBER_FIELDS fields. ``refuse(g)`` raises the reference's error for g, the first group that held
    NaN/Inf; otherwise each ``(g, scale)`` of ``fills`` is filled with group g's scale, and the call's
    result is every group's scale, a float32 tensor each."""
    flat: list[int] = []
    first = [0]
    for group in members:
        for fields in group:
            if len(fields) != MEMBER_FIELDS:
                raise ValueError(f"a scale group's member takes {MEMBER_FIELDS} fields, got {len(fields)}")
            flat.extend(fields)
        first.append(first[-1] + len(group))
    desc = (ctypes.c_int64 * len(flat))(*flat)
    offsets = (ctypes.c_int64 * len(first))(*first)
    scales = (ctypes.c_float * len(members))()
    elems = sum(f[1] * f[2] * f[3] for group in members for f in group)

    groups = len(members)
    claims = None if claimed is None else Claims()

    def share(begin: int, end: int) -> int:
        if claims is not None and claims.whole:  # every thread the whole run: the kernel hands out groups
            return claimed(desc, offsets, claims.ref, groups, scales)
        return run(desc, offsets, begin, end, scales)

    def done(results: list[int]) -> list[torch.Tensor]:
        bad = [r for r in results if r >= 0]
        if bad:
            refuse(min(bad))
        values = list(scales)
        for g, scale in fills:
            scale.fill_(values[g])
        return [torch.tensor(v, dtype=torch.float32) for v in values]

    split = True if claims is None else claims
    return Prepared(share, groups, elems // max(groups, 1), done, scales, split=split)


def shared_views(tensors: Sequence[torch.Tensor], applies: Callable[[torch.Tensor], bool]):
    """(lib, [(tensor, view)]) when every tensor takes the native amax, else None."""
    views, lib = [], None
    for t in tensors:
        lib = lib_for(t)
        view = None if lib is None or not applies(t) else view3(t, row_split(t))
        if view is None:
            return None
        views.append((t, view))
    return (lib, views) if views else None


def raise_like_reference(run_reference: Callable[[], object], name: str | None) -> None:
    """The kernel saw NaN or Inf: the reference, run on the same input, raises its own error (a
    NonFiniteError naming the first bad block)."""
    run_reference()
    raise RuntimeError(
        f"{ref._label(name)}: the native quantizer saw NaN or Inf that the torch reference did not; "
        "this is a bug in sidecar/numerics/native/ (quant.c, fourbit.c): report it, and set REFITD_NATIVE=0 meanwhile"
    )
