"""Runs of small passthrough units copied as byte spans: staging to generation in one copy per run.

A step of thousands of small tensors (norms, biases) is mostly per-tensor overhead: a view, a
finiteness check and a copy each. Both arenas are carved in plan order (the staging layout in input
order, the generation's in output order, and a passthrough's one output sits where its input
does in that order), so consecutive passthrough units lie at the same relative offsets on both
sides, separated only by alignment padding. :class:`SpanTable` (made once per plan and layouts)
knows each passthrough unit's two offsets; :meth:`SpanTable.spans` merges the units that became
ready together into runs; the worker copies each run with one ``copy_`` and then checks the copy
(never staging, which a local rank may still write) for NaN/Inf with one ``aminmax`` per dtype
(:func:`run_span`).

The padding between tensors is copied too (never read by anyone), and it takes part in the
finiteness check: a run that looks non-finite is checked again tensor by tensor, so only a tensor
holding NaN or Inf fails the step, by name, exactly as one-by-one units do.

    table = SpanTable(plan, staging.layout, generation.layout)
    spans, rest = table.spans(units)            # rest: units that are not small passthroughs
    run_span(span, staging_bytes, gen_bytes)    # uint8 views of the two arenas' span ranges
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from sidecar.numerics.reference import NonFiniteError
from sidecar.plan.build import RefitPlan, Unit
from transport.layout import ALIGN, Layout

#: passthrough units of at most this many bytes go into spans (larger ones run on their own, so
#: the worker's progress stays visible at tensor granularity where a tensor is big)
SPAN_UNIT_BYTES = 256 << 10
#: a span ends after this many bytes: its check and copy then stay under torch's parallel grain
#: (32,768 elements), where a 2-thread OpenMP region on a busy 2-core machine cost 0.5-8 ms per
#: call instead of microseconds (measured: aminmax of 64k bf16, 15 us on one thread)
SPAN_MAX_BYTES = 64 << 10


@dataclass(frozen=True, slots=True)
class Member:
    """One passthrough unit: its tensor at byte ``src`` of staging and ``dst`` of the generation
    (made once per plan; spans list them, never copy them)."""

    unit: int
    name: str
    src: int
    dst: int
    nbytes: int
    dtype: torch.dtype
    direct: bool = False  # written straight into the generation: ``src`` is a generation offset too


@dataclass(slots=True)
class Span:
    """Bytes ``[src, src + nbytes)`` of staging go to ``[dst, dst + nbytes)`` of the generation."""

    src: int
    dst: int
    nbytes: int
    members: list[Member]
    units: list[int]  # the members' units, in order
    dtype: torch.dtype | None  # every member's dtype when they share one (None: mixed)
    direct: bool = False  # its bytes are in the generation already: checked, not copied


class SpanTable:
    """Which units of ``plan`` may travel in spans, and where each lies in both layouts."""

    def __init__(
        self, plan: RefitPlan, staging: Layout, outputs: Layout, direct: Mapping[str, int] | None = None
    ):
        """``direct``: inputs written straight into the generation this step (Arenas.direct:
        name -> byte offset there): their spans read the generation itself and only check it."""
        self.plan, self.staging, self.outputs, self.direct = plan, staging, outputs, direct
        self._members: dict[int, Member] = {}  # by unit index
        #: the last call to :meth:`spans`: (its units' indices, the spans, the rest)
        self._last: tuple[tuple[int, ...], list[Span], list[Unit]] | None = None
        for unit in plan.units:
            if unit.fmt is not None or len(unit.inputs) != 1 or len(unit.outputs) != 1:
                continue
            out = unit.outputs[0]
            src, dst = staging.slots.get(out.source), outputs.slots.get(out.name)
            if src is None or dst is None or src.nbytes != dst.nbytes or src.nbytes > SPAN_UNIT_BYTES:
                continue
            if src.dtype != dst.dtype or src.shape != dst.shape:
                continue  # run_unit names the mismatch
            at = direct.get(out.source) if direct else None
            self._members[unit.index] = Member(
                unit.index,
                out.source,
                src.offset if at is None else at,
                dst.offset,
                src.nbytes,
                src.dtype,
                at is not None,
            )

    def fits(
        self, plan: RefitPlan, staging: Layout, outputs: Layout, direct: Mapping[str, int] | None = None
    ) -> bool:
        """Whether this table was made for exactly these (a new plan carves new layouts)."""
        same = self.plan is plan and self.staging is staging and self.outputs is outputs
        return same and self.direct is direct

    def spans(self, units: Iterable[Unit]) -> tuple[list[Span], list[Unit]]:
        """``units`` split into spans (in unit order) and the units that go one by one. The same
        units as the last call (every step of one model: its passthroughs) get the same spans
        back, worked out once (nothing changes a span once made)."""
        units = list(units)
        key = tuple(map(_UNIT_INDEX, units))
        last = self._last
        if last is not None and last[0] == key:
            return list(last[1]), list(last[2])
        spans, rest = self._spans(units)
        self._last = (key, spans, rest)
        return list(spans), list(rest)

    def _spans(self, units: list[Unit]) -> tuple[list[Span], list[Unit]]:
        members, rest, picked = self._members, [], []
        for unit in units:
            m = members.get(unit.index)
            if m is None:
                rest.append(unit)
            else:
                picked.append(m)
        picked.sort(key=_ORDER)  # unit order is layout order (a zero-byte slot shares an offset)
        spans: list[Span] = []
        span: Span | None = None
        lo = end = shift = 0  # the open span's first byte and end in staging; dst - src
        for m in picked:
            if (
                span is not None
                and m.dst - m.src == shift
                and m.direct == span.direct
                and 0 <= m.src - end < ALIGN
                and m.src + m.nbytes - lo <= SPAN_MAX_BYTES
            ):
                span.members.append(m)
                span.units.append(m.unit)
                if m.dtype != span.dtype:
                    span.dtype = None
                end = m.src + m.nbytes
                span.nbytes = end - lo
                continue
            span = Span(m.src, m.dst, m.nbytes, [m], [m.unit], m.dtype, m.direct)
            spans.append(span)
            lo, end, shift = m.src, m.src + m.nbytes, m.dst - m.src
        return spans, rest


_ORDER = operator.attrgetter("src", "unit")
_UNIT_INDEX = operator.attrgetter("index")


def _float_runs(span: Span) -> list[tuple[torch.dtype, int, int]]:
    """Maximal runs of consecutive floating, non-empty members of one dtype: ``(dtype, lo, hi)``
    byte ranges relative to the span (padding between them included)."""
    if span.dtype is not None:  # the usual span: one run, whatever zero-byte members it holds
        return [(span.dtype, 0, span.nbytes)] if span.dtype.is_floating_point and span.nbytes else []
    runs: list[tuple[torch.dtype, int, int]] = []
    base = span.src
    for m in span.members:
        if not m.nbytes or not m.dtype.is_floating_point:
            continue
        rel = m.src - base
        if runs and runs[-1][0] == m.dtype and rel - runs[-1][2] < ALIGN:
            runs[-1] = (m.dtype, runs[-1][1], rel + m.nbytes)
        else:
            runs.append((m.dtype, rel, rel + m.nbytes))
    return runs


def _finite(t: torch.Tensor) -> bool:
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def check_span(span: Span, src: torch.Tensor) -> None:
    """NonFiniteError naming the first member of ``span`` that holds NaN or Inf (``src``: the
    span's bytes, uint8: its copy in the generation). One ``aminmax`` per run of one float dtype; a run that looks
    non-finite (a tensor, or the padding between two) is checked tensor by tensor."""
    for dtype, lo, hi in _float_runs(span):
        if _finite(src[lo:hi].view(dtype)):
            continue
        for m in span.members:
            rel = m.src - span.src
            inside = lo <= rel < hi and m.dtype == dtype and m.nbytes
            if inside and not _finite(src[rel : rel + m.nbytes].view(dtype)):
                raise NonFiniteError(f"tensor {m.name!r} holds NaN or Inf; refusing to publish it")


def run_span(span: Span, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy ``span``'s bytes, then check the copy (:func:`check_span`): ``src`` and ``dst`` are
    uint8 tensors of ``span.nbytes`` bytes, in staging and in the target generation."""
    sizes = (src.numel(), dst.numel())
    if src.dtype != torch.uint8 or dst.dtype != torch.uint8 or sizes != (span.nbytes, span.nbytes):
        raise ValueError(
            f"span of {span.nbytes} bytes got buffers of {src.numel()} ({src.dtype}) and "
            f"{dst.numel()} ({dst.dtype}) bytes: give uint8 views of exactly the span"
        )
    if src.data_ptr() != dst.data_ptr():  # else a direct span: the daemon wrote its frames there
        wide = next(
            d for d in (torch.int64, torch.int32, torch.int16, torch.uint8) if not span.nbytes % d.itemsize
        )
        dst.view(wide).copy_(src.view(wide))  # the same bytes, in fewer elements
    # the copy is checked, never staging: a local rank may still write there (a span is at most
    # SPAN_MAX_BYTES: it is still in cache)
    check_span(span, dst)
