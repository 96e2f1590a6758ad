"""GPU kernels for the quantizers of ../shared/SPEC.md §1, behind guards.

``import sidecar.kernels`` never imports Triton; the kernels (``sidecar.kernels.triton_quant``) load
on first use. The torch reference (``sidecar.quant``) stays the oracle and the CPU path; the kernels
must match it byte for byte (tests/test_kernels.py, bench/gpu_check.py).

Usage::

    from sidecar import kernels

    if kernels.available(slab.device):
        # gate_up [E, 2I, H]: two parts per expert (gate rows [0, I), up rows [I, 2I))
        kernels.quantize_slab(slab, "block_fp8", [[(q_gate[e], s_gate[e]), (q_up[e], s_up[e])] for e in ...])

    # or let the plan's unit decide (what sidecar.convert.run_unit calls first):
    if not kernels.try_run_unit(unit, inputs, outputs):
        ...  # the torch reference

One launch per slab (two for fp8_per_tensor: amax, then quantize) writes every expert's values and
scales straight into the caller's tensors, found through a table of their base addresses.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import sys
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from sidecar.formats import BLOCK, Format
from sidecar.kernels.slab import (
    DEFAULT_CONFIGS,
    FLAG_CLEAR,
    Outs,
    SlabGeometry,
    TileConfig,
    check_slab,
    default_names,
    needs_wide_offsets,
    prepare_outputs,
)

if TYPE_CHECKING:
    from sidecar.plan import Unit

__all__ = [
    "DEFAULT_CONFIGS",
    "SlabLaunch",
    "TileConfig",
    "available",
    "quantize",
    "quantize_slab",
    "try_run_unit",
    "unavailable_reason",
]

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------
# capability


@functools.cache
def _triton_missing() -> str | None:
    try:
        found = importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        found = False
    return None if found else "triton is not installed (pip install 'refitd[gpu]')"


@functools.cache
def _load() -> ModuleType:
    from sidecar.kernels import triton_quant

    return triton_quant


def unavailable_reason(device: torch.device | str | None = None) -> str | None:
    """Why the kernels cannot run on ``device`` (default: any CUDA device), or None if they can."""
    if device is not None and torch.device(device).type != "cuda":
        return f"the kernels run on CUDA tensors only, not on {torch.device(device).type}"
    if missing := _triton_missing():
        return missing
    if not torch.cuda.is_available():
        return "CUDA is not available (no GPU, or a CPU-only torch build)"
    try:
        _load()
    except Exception as err:  # a broken Triton install: say so once, then use the reference
        return f"importing the Triton kernels failed: {type(err).__name__}: {err}"
    return None


def available(device: torch.device | str | None = None) -> bool:
    """True when the Triton kernels can run on ``device`` (default: on this machine's GPU).

    False on a CPU tensor, without Triton, or without CUDA; the same predicate drives the tests'
    ``skipif``.
    """
    return unavailable_reason(device) is None


# --------------------------------------------------------------------------------------------------
# the slab entry point


def _raise_non_finite(name: str, where: str) -> None:
    from sidecar import quant

    quant._raise_non_finite(name, where)


def _non_finite_where(
    fmt: Format, geom: SlabGeometry, cfg: TileConfig, tile_id: int, names
) -> tuple[str, str]:
    """(tensor name, where) for the flagged tile id of a launch."""
    if fmt is Format.FP8_PER_TENSOR:
        chunks, _ = geom.amax_chunks(cfg)
        e, chunk = divmod(tile_id, chunks)
        r0, r1 = geom.amax_rows(chunk, cfg)
        parts = sorted({r // geom.rows for r in (r0, r1 - 1)})
        name = " + ".join(names[e][p] for p in parts)
        return name, f"first in rows {r0}..{r1 - 1} of expert {e}'s [{geom.parts * geom.rows}, {geom.cols}]"
    rows, cols = (BLOCK, BLOCK) if fmt is Format.BLOCK_FP8 else (cfg.block_rows, cfg.block_cols)
    t = geom.tile(tile_id, rows, cols)
    where = f"first in tile rows {t.rows[0]}..{t.rows[1] - 1}, cols {t.cols[0]}..{t.cols[1] - 1}"
    return names[t.expert][t.part], where


@dataclass(slots=True)
class SlabLaunch:
    """One slab's launch: its non-finite flag (checked by :meth:`check`, one host sync) and, for
    diagnostics, the compiled kernels Triton returned (empty under the interpreter)."""

    flag: torch.Tensor
    fmt: Format
    geom: SlabGeometry
    config: TileConfig
    names: Callable[[], Sequence[Sequence[str]]]
    compiled: list[Any] = field(default_factory=list)

    def check(self) -> None:
        """Raise NonFiniteError (naming the tensor and its first bad tile) if any block held NaN/Inf."""
        bad = int(self.flag.item())
        if bad != FLAG_CLEAR:
            _raise_non_finite(*_non_finite_where(self.fmt, self.geom, self.config, bad, self.names()))


def quantize_slab(
    slab: torch.Tensor,
    fmt: Format | str,
    outs: Outs,
    *,
    names: Sequence[Sequence[str]] | None = None,
    config: TileConfig | None = None,
    wait: bool = True,
) -> SlabLaunch:
    """Quantize every expert of ``slab [E, R, K]`` into ``outs`` with one launch.

    ``outs[e][p] = (values, scales)``: ``len(outs[e])`` parts split each expert's rows evenly (2 for
    gate_up: gate rows ``[0, R/2)``, up rows ``[R/2, R)``; 1 for down). Values are float8_e4m3fn
    ``[R/P, K]``, scales as SPEC §2.3 says; every buffer contiguous, on the slab's device. For
    ``fp8_per_tensor`` all parts of one expert share one scale (gate and up, SPEC §2.3).
    ``names[e][p]`` names each output in errors. Raises ValueError for a bad slab or buffer and
    NonFiniteError (naming the tensor and its first bad tile) for NaN/Inf; on error the outputs'
    contents are unspecified. ``wait=False`` skips the host sync: call ``.check()`` on the result
    before publishing the outputs (a pipelined caller checks a layer's launches together).
    """
    fmt = Format.parse(fmt)
    parts = len(outs[0]) if outs and len(outs[0]) else 1

    def all_names() -> Sequence[Sequence[str]]:
        return names or default_names(max(1, len(outs)), parts)

    first = names[0][0] if names and names[0] else "slab"
    check_slab(slab, fmt, parts, first)
    if slab.device.type != "cuda" and not _interpreting():
        raise ValueError(f"{first}: quantize_slab runs on CUDA tensors; use sidecar.quant on {slab.device}")
    cfg = config or DEFAULT_CONFIGS[fmt]
    cfg.validate(fmt)
    prepared = prepare_outputs(slab, fmt, outs, all_names)
    geom = SlabGeometry.of(slab, parts)
    flag = torch.full((1,), FLAG_CLEAR, dtype=torch.int32, device=slab.device)
    launch = SlabLaunch(flag, fmt, geom, cfg, all_names)
    if geom.numel == 0:
        if fmt is Format.FP8_PER_TENSOR:  # amax over nothing is 0: scale 1.0
            for row in outs:
                for _, s in row:
                    s.fill_(1.0)
        return launch
    tq = _load()
    run = {
        Format.BLOCK_FP8: tq.launch_block_fp8,
        Format.MXFP8: tq.launch_mxfp8,
        Format.FP8_PER_TENSOR: tq.launch_fp8_per_tensor,
    }[fmt]
    launch.compiled = run(
        slab,
        prepared.q_table,
        prepared.s_table,
        flag,
        geom,
        cfg,
        aligned=prepared.aligned,
        wide=needs_wide_offsets(slab),
    )
    if wait:
        launch.check()
    return launch


def _as_slab(w: torch.Tensor, fmt: Format) -> torch.Tensor:
    """``w`` as ``[B, R, K]`` (a view when strides allow): block-FP8 batches its matrices, MXFP8 its
    rows, per-tensor is one matrix (one shared scale)."""
    if fmt is Format.FP8_PER_TENSOR:
        return w.reshape(1, 1, 1) if w.dim() == 0 else w.reshape(1, -1, w.shape[-1])
    if w.dim() == 1:
        return w.reshape(1, 1, -1)
    return w.reshape(-1, *w.shape[-2:])


def quantize(
    w: torch.Tensor,
    fmt: Format | str,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    name: str | None = None,
    config: TileConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' twin of ``sidecar.quant.quantize``: any shape the reference takes, same outputs
    (``(values, scales)``), same errors; one launch. For tests and checks: the daemon calls
    :func:`quantize_slab` (through :func:`try_run_unit`) on whole slabs."""
    from sidecar import quant

    fmt = Format.parse(fmt)
    if not fmt.quantized:
        raise ValueError(f"format {fmt.value} is not a quantized format; nothing to quantize")
    quant._check_input(w, name, fmt)
    scale_shape = fmt.scale_shape(tuple(w.shape))
    q, s = quant._check_out(out, w, scale_shape, fmt.scale_dtype, name)
    for what, t in (("values", q), ("scales", s)):
        if not t.is_contiguous():
            raise ValueError(
                f"{name or 'input tensor'}: out {what} buffer must be contiguous for the kernels"
            )
    w3 = _as_slab(w, fmt)
    q3 = q.view(w3.shape)
    if fmt is Format.FP8_PER_TENSOR:
        outs = [[(q3[0], s)]]
    else:
        s3 = s.view(w3.shape[0], *fmt.scale_shape(tuple(w3.shape[1:])))
        outs = [[(q3[e], s3[e])] for e in range(w3.shape[0])]
    label = name or "input tensor"
    quantize_slab(w3, fmt, outs, names=[[label]] * max(1, w3.shape[0]), config=config)
    return q, s


def _interpreting() -> bool:
    """Triton's CPU interpreter (TRITON_INTERPRET=1) runs the kernels on CPU tensors: tests only."""
    if _triton_missing() or "triton" not in sys.modules:
        return False
    runtime = getattr(getattr(sys.modules["triton"], "knobs", None), "runtime", None)
    if runtime is not None:
        return bool(runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")  # Triton before 3.4 had no knobs


# --------------------------------------------------------------------------------------------------
# dispatch from a plan unit


#: slab unit -> output order, by identity: hashing a frozen Unit rehashes its 2E outputs every call
_ORDERS: OrderedDict[int, tuple[Unit, tuple | None]] = OrderedDict()
_ORDERS_SIZE = 1024


def _slab_order(unit: Unit) -> tuple[tuple[tuple[str, str], ...], ...] | None:
    """(weight name, scale name) per expert in order, parts by row offset (gate before up); None if
    the unit's experts are not 0..E-1 with the same number of parts each."""
    hit = _ORDERS.get(id(unit))
    if hit is not None and hit[0] is unit:
        return hit[1]
    from sidecar.plan import Role

    by_expert: dict[int, list] = {}
    for o in unit.outputs:
        if o.role is Role.WEIGHT:
            by_expert.setdefault(o.expert, []).append(o)
    experts = sorted(by_expert, key=lambda e: -1 if e is None else e)
    order = None
    if experts == list(range(len(experts))) and len({len(v) for v in by_expert.values()}) <= 1:
        order = tuple(
            tuple(
                (w.name, w.scale_name) for w in sorted(by_expert[e], key=lambda o: o.rows[0] if o.rows else 0)
            )
            for e in experts
        )
    _ORDERS[id(unit)] = (unit, order)
    while len(_ORDERS) > _ORDERS_SIZE:
        _ORDERS.popitem(last=False)
    return order


def _slab_outs(unit: Unit, outputs: Mapping[str, torch.Tensor]):
    """(outs, names) for a SLAB unit; None if its outputs are irregular."""
    order = _slab_order(unit)
    if order is None:
        return None
    outs = [[(outputs[w], outputs[s]) for w, s in row] for row in order]
    return outs, [[w for w, _ in row] for row in order]


def try_run_unit(unit: Unit, inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor]) -> bool:
    """Run a quantizing ``unit`` with the kernels when its input is a CUDA tensor; False when the
    caller should use the torch reference instead (passthrough, CPU, no Triton, a buffer the
    kernels cannot write, fp8_per_tensor gate+up from two separate tensors).

    Slab units are one launch each; per-expert units one launch per projection. The outputs are
    checked in full the first time a set of output tensors is seen, then recognised by identity.
    """
    from sidecar.plan import Role, UnitKind

    if unit.fmt is None or not unit.inputs or not available(inputs[unit.inputs[0]].device):
        return False
    if unit.kind is UnitKind.SLAB:
        slab = inputs[unit.inputs[0]]
        arranged = _slab_outs(unit, outputs)
        if arranged is None or slab.dim() != 3:
            return False
        jobs = [(slab, *arranged)]
    elif unit.kind in (UnitKind.EXPERT, UnitKind.LINEAR):
        if any(len(g) > 1 for g in unit.scale_groups):
            return False  # one shared scale over two input tensors: the reference does it
        jobs = []
        for o in unit.outputs:
            if o.role is Role.WEIGHT:
                src = inputs[o.source]
                if src.dim() != 2:
                    return False
                jobs.append((src.unsqueeze(0), [[(outputs[o.name], outputs[o.scale_name])]], [[o.name]]))
    else:
        return False
    for slab, outs, names in jobs:
        try:
            check_slab(slab, unit.fmt, len(outs[0]) if outs else 1, names[0][0] if names else "slab")
        except ValueError as err:
            log.debug("unit %s runs on the torch reference: %s", unit.index, err)
            return False
        if prepare_outputs(slab, unit.fmt, outs, lambda names=names: names, strict=False) is None:
            log.debug(
                "unit %s runs on the torch reference: its output buffers do not fit the kernels", unit.index
            )
            return False
    for slab, outs, names in jobs:
        quantize_slab(slab, unit.fmt, outs, names=names)
    return True
