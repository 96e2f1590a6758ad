"""The native kernel calls of a CPU quantizing unit, kept for its next run on the same buffers.

Preparing a unit's calls is Python: a view of the slab for each expert projection, the out= checks, the
kernels' arguments, about 20 us a projection, so a slab of a hundred projections spent 10-15% of its
time (at one thread; more at two, where the kernels are shared and the Python is not) before any kernel
ran. The daemon runs a unit on the same buffers step after step: its inputs are staging views and its
outputs the generation arena's cached views. So :func:`remember` keeps what a run's calls reduce to
(``(share, units, elems, split)`` tuples whose closures hold the library and integer arguments, never a
tensor) under a key of everything they were derived from (the units themselves, the native library,
and each input's and output's address, shape, strides, dtype and device), and :func:`run_again` runs
them when a later call's key is the same: the same arguments, so the same bytes.

A run whose kernels flag NaN or Inf returns False having written part of the outputs; the caller then
takes the full path, which runs the unit again and raises the reference's error naming the tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from sidecar.numerics import native
from sidecar.numerics.native_calls import POOL, Prepared
from sidecar.plan.spec import Unit

__all__ = ["forget", "key_of", "remember", "run_again"]

#: keys kept at most (emptied when full: a model's units, a few per layer, stay far below it)
MAX_KEPT = 4096


@dataclass(frozen=True, slots=True)
class _Kept:
    units: tuple[Unit, ...]  # held, so that no other unit takes their ids while the key lives
    shares: tuple[tuple[Callable[[int, int], int], int, int, object], ...]
    #: outputs to fill after the kernels: (output name, value), each value a tensor copied in
    fills: tuple[tuple[str, torch.Tensor], ...]
    #: a group call's scales (native_calls.Prepared.scales, as a float32 tensor over that array), its
    #: reciprocals' buffer, and the outputs each group's scale goes to: (name, group, reciprocal)
    scales: torch.Tensor | None = None
    reciprocals: torch.Tensor | None = None
    scale_fills: tuple[tuple[str, int, bool], ...] = ()


_KEPT: dict[tuple, _Kept] = {}


def _signature(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)


def key_of(
    units: Sequence[Unit], inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor]
) -> tuple | None:
    """What a run of ``units`` over these buffers depends on; None where a buffer is missing or not a
    tensor (the full path names it)."""
    try:
        return (
            tuple(id(u) for u in units),
            id(native.load()),
            tuple(_signature(inputs[n]) for u in units for n in u.inputs),
            tuple(_signature(outputs[o.name]) for u in units for o in u.outputs),
        )
    except (KeyError, AttributeError, TypeError):
        return None


def run_again(key: tuple | None, outputs: Mapping[str, torch.Tensor]) -> bool:
    """Run the calls kept under ``key``; False if none are, or if the kernels flagged NaN/Inf."""
    kept = _KEPT.get(key) if key is not None else None
    if kept is None:
        return False
    results = POOL.run_many(kept.shares)
    if any(r >= 0 for found in results for r in found):
        return False
    if kept.fills:
        torch._foreach_copy_([outputs[name] for name, _ in kept.fills], [value for _, value in kept.fills])
    if kept.scale_fills:
        scales, reciprocals = kept.scales, kept.reciprocals
        if reciprocals is not None:  # float32(1 / scale), as torch divides (no double rounding)
            torch.reciprocal(scales, out=reciprocals)
        for name, g, reciprocal in kept.scale_fills:
            outputs[name].copy_((reciprocals if reciprocal else scales)[g])
    return True


def remember(
    key: tuple | None,
    units: Sequence[Unit],
    calls: Sequence[Prepared],
    fills: Sequence[tuple[str, torch.Tensor]] = (),
    scale_fills: Sequence[tuple[str, int, bool]] = (),
) -> None:
    """Keep ``calls`` (which just ran without error) under ``key``; nothing where any of them ran the
    reference instead of a kernel (it has no share to run again). ``scale_fills``: outputs that take a
    group's scale (or its float32 reciprocal) from the one group call in ``calls``, after each run."""
    if key is None or not calls or any(c.share is None for c in calls):
        return
    scales = reciprocals = None
    if scale_fills:
        if len(calls) != 1 or calls[0].scales is None:
            return
        scales = torch.frombuffer(calls[0].scales, dtype=torch.float32)  # the array the kernels write
        if any(reciprocal for _, _, reciprocal in scale_fills):
            reciprocals = torch.empty_like(scales)
    if len(_KEPT) >= MAX_KEPT:
        _KEPT.clear()
    _KEPT[key] = _Kept(
        tuple(units),
        tuple(c.work for c in calls),
        tuple(fills),
        scales,
        reciprocals,
        tuple(scale_fills),
    )


def forget() -> None:
    """Drop every kept call (tests: each starts from the full path, whatever addresses it reuses)."""
    _KEPT.clear()
