"""Host side of the 4-bit slab kernels (``triton_fourbit_slab``): checks, pointer tables, launches.

The 4-bit twin of :func:`sidecar.numerics.kernels.quantize_slab`, for NVFP4, MXFP4 and INT4-W4A16
under the plan's :class:`FormatParams` (INT4 group and scale dtype, NVFP4's names). ``outs[e][p]``
is the (expert, part)'s outputs in ``OutputSpec.quantized_outputs`` order: ``(values, scales,
global scale)`` for NVFP4 (ModelOpt's ``gs`` or compressed-tensors' ``1 / gs``), ``(values,
scales)`` for MXFP4, ``(packed, scales, shape)`` for INT4. Every output is written by the kernels
in place: the daemon's publish ring, with nothing allocated per launch but a one-int32 flag (none
inside :func:`sidecar.numerics.kernels.collecting`: the group's slot) and, the first time a set of
output tensors is seen, its three pointer tables (8 bytes per output, cached by identity as the
FP8 path's are). NVFP4 also needs one int32 per expert for its global amax (``amax=``: the caller's
scratch; ``sidecar.numerics.kernels.scratch`` in the daemon: 1 KiB for 256 experts).

No Triton import here: the kernels load on first launch, so this module's checks run anywhere.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from sidecar.numerics.formats import (
    DEFAULT_FORMAT_PARAMS,
    FLOAT_DTYPES,
    Format,
    FormatParams,
    Nvfp4Names,
)
from sidecar.numerics.kernels.lru import IdentityLru
from sidecar.numerics.kernels.slab import FLAG_CLEAR, pointer_table

__all__ = ["FourBitLaunch", "amax_slab", "fourbit_problems", "probe", "quantize_slab_fourbit", "supports"]

log = logging.getLogger("sidecar.numerics.kernels")

#: outs[e][p] = the (expert, part)'s outputs, quantized_outputs order
FourBitOuts = Sequence[Sequence[Sequence[torch.Tensor]]]


def supports(fmt: Format, params: FormatParams = DEFAULT_FORMAT_PARAMS) -> str | None:
    """Why the slab kernels cannot run ``fmt`` under ``params`` (None: they can)."""
    if not fmt.four_bit:
        return f"{fmt.value} is not a 4-bit format"
    g = params.int4_group
    if fmt is Format.INT4_W4A16 and g & (g - 1):
        return f"the Triton int4 kernel takes power-of-two groups, not {g}"
    return None


def _expected(fmt: Format, params: FormatParams, rows: int, cols: int):
    """(what, shape, dtype) of each output of one part ``[rows, cols]``."""
    shape = (rows, cols)
    first = ("values", fmt.weight_shape(shape), fmt.weight_dtype)
    scales = ("scales", params.scale_shape(fmt, shape), params.scale_dtype(fmt))
    if fmt is Format.NVFP4:
        one = (1,) if params.nvfp4_names is Nvfp4Names.COMPRESSED_TENSORS else ()  # SPEC §2.3
        return (first, scales, ("global scale", one, torch.float32))
    if fmt is Format.INT4_W4A16:
        return (first, scales, ("shape", (2,), torch.int64))
    return (first, scales)


def fourbit_problems(
    slab: torch.Tensor, fmt: Format, outs: FourBitOuts, names: Sequence[Sequence[str]], params: FormatParams
) -> list[str]:
    """Every reason the kernels cannot quantize ``slab [E, R, K]`` into ``outs`` (empty: they can)."""
    if (why := supports(fmt, params)) is not None:
        return [why]
    if not isinstance(slab, torch.Tensor) or slab.dim() != 3 or slab.dtype not in FLOAT_DTYPES:
        return ["the input is not a 3-D bfloat16, float16 or float32 slab"]
    e, r, k = slab.shape
    if k and slab.stride(2) != 1:
        return ["the input's last dim is not contiguous"]
    if len(outs) != e or not outs or any(len(row) != len(outs[0]) for row in outs) or not outs[0]:
        return [f"outs must hold one row per expert ({e}), each with the same number of parts"]
    parts = len(outs[0])
    if r % parts:
        return [f"{r} rows do not split into {parts} parts"]
    multiple = params.k_multiple(fmt) or 1
    if k % multiple:
        return [f"K={k} is not a multiple of {multiple}"]
    want = _expected(fmt, params, r // parts, k)
    problems = []
    for ei, row in enumerate(outs):
        for pi, bufs in enumerate(row):
            if len(bufs) != len(want):
                problems.append(f"{names[ei][pi]}: expected {len(want)} output buffers, got {len(bufs)}")
                continue
            for t, (what, shape, dtype) in zip(bufs, want):
                if not isinstance(t, torch.Tensor):
                    problems.append(f"{names[ei][pi]}: {what} is a {type(t).__name__}, not a tensor")
                elif tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != slab.device:
                    problems.append(
                        f"{names[ei][pi]}: {what} buffer is {t.dtype} {tuple(t.shape)} on {t.device}, "
                        f"expected {dtype} {tuple(shape)} on {slab.device}"
                    )
                elif not t.is_contiguous():
                    problems.append(f"{names[ei][pi]}: {what} buffer is not contiguous")
    return problems


@dataclass(slots=True)
class _Tables:
    tables: tuple[torch.Tensor, ...]
    refs: list[weakref.ref]

    def same(self, tensors: Sequence[torch.Tensor]) -> bool:
        return len(tensors) == len(self.refs) and all(r() is t for r, t in zip(self.refs, tensors))


#: output sets' pointer tables, by identity (LRU; weak references, as slab.prepare_outputs)
_tables: IdentityLru[_Tables] = IdentityLru()


def _pointer_tables(slab: torch.Tensor, fmt: Format, outs: FourBitOuts) -> tuple[torch.Tensor, ...]:
    """One int64 table of base addresses per output position (values, scales[, third]), built
    once per set of output tensors (the arena hands the same views every step)."""
    n = len(outs[0][0])
    columns = [[bufs[i] for row in outs for bufs in row] for i in range(n)]
    tensors = [t for col in columns for t in col]
    key = (fmt, tuple(slab.shape), slab.device, len(outs[0]), tuple(map(id, tensors)))
    hit = _tables.get(key, tensors)
    if hit is not None:
        return hit.tables
    entry = _Tables(
        tuple(pointer_table(col, slab.device) for col in columns), [weakref.ref(t) for t in tensors]
    )
    _tables.put(key, entry)
    return entry.tables


def clear_tables() -> None:
    _tables.clear()


@dataclass(slots=True)
class FourBitLaunch:
    """One 4-bit slab launch's NaN/Inf flag: :meth:`check` (one host sync) or a FlagGroup's read
    calls :meth:`raise_for` with the flag's value, ``ep * rows + row`` of the first bad row."""

    flag: torch.Tensor
    fmt: Format
    parts: int
    rows: int
    cols: int
    names: Callable[[], Sequence[Sequence[str]]]

    def check(self) -> None:
        self.raise_for(int(self.flag.item()))

    def raise_for(self, value: int) -> None:
        if value == FLAG_CLEAR:
            return
        from sidecar.numerics.checks import _raise_non_finite

        ep, row = divmod(value, max(1, self.rows))
        e, p = divmod(ep, self.parts)
        _raise_non_finite(self.names()[e][p], f"first in row {row} of its [{self.rows}, {self.cols}]")


def _start(slab: torch.Tensor, flag_owner) -> tuple[torch.Tensor, tuple | None]:
    """The launch's flag: a slot of the collecting group, else a fresh one-int32 tensor."""
    if flag_owner is not None:
        flag, slot = flag_owner[0].slot(slab.device)
        return flag, slot
    return torch.full((1,), FLAG_CLEAR, dtype=torch.int32, device=slab.device), None


def amax_slab(slab: torch.Tensor, amax: torch.Tensor) -> None:
    """Launch the NVFP4 global amax pass: ``amax[e] = max(amax[e], bits(max |slab[e]|))`` (int32,
    zero it first; several slabs may add into one ``amax`` to share a global scale)."""
    from sidecar.numerics.kernels import triton_fourbit_slab as tk
    from sidecar.numerics.kernels import triton_quant

    e, r, k = slab.shape
    if not (e and r and k):
        return
    calls = tk.calls_amax(
        slab, slab.stride(0), slab.stride(1), amax, e, r, k, is_bf16=slab.dtype == torch.bfloat16
    )
    triton_quant.launch(calls)


def quantize_slab_fourbit(
    slab: torch.Tensor,
    fmt: Format,
    outs: FourBitOuts,
    *,
    names: Sequence[Sequence[str]],
    params: FormatParams = DEFAULT_FORMAT_PARAMS,
    amax: torch.Tensor | None = None,
    flags=None,
    wait: bool = True,
) -> FourBitLaunch:
    """Quantize every (expert, part) of ``slab [E, R, K]`` into ``outs`` with one launch.

    NVFP4 reads each expert's global amax bits from ``amax[e]`` (int32, filled by
    :func:`amax_slab`); the other formats take none. ``flags=(group, tag)``: put the NaN/Inf flag
    in that :class:`FlagGroup` (no host sync); else ``wait`` checks it now. The caller checks the
    buffers first (:func:`fourbit_problems`) and makes the slab's device current.
    """
    from sidecar.numerics.kernels import triton_fourbit_slab as tk
    from sidecar.numerics.kernels import triton_quant

    problems = fourbit_problems(slab, fmt, outs, names, params)
    if problems:
        raise ValueError(f"{names[0][0] if names and names[0] else 'slab'}: " + "; ".join(problems[:5]))
    e, r, k = slab.shape
    parts = len(outs[0])
    rows = r // parts
    flag, slot = _start(slab, flags)
    launch = FourBitLaunch(flag, fmt, parts, rows, k, lambda: names)
    if not (e and rows and k):
        return launch
    tables = _pointer_tables(slab, fmt, outs)
    common = (slab, slab.stride(0), slab.stride(1), tables)
    shape = (e, parts, rows, k)
    bf16 = slab.dtype == torch.bfloat16
    if fmt is Format.NVFP4:
        if amax is None or amax.dtype != torch.int32 or amax.numel() < e or amax.device != slab.device:
            raise ValueError(
                "nvfp4 needs amax=: an int32 tensor of one global amax per expert on the slab's device"
            )
        reciprocal = params.nvfp4_names is Nvfp4Names.COMPRESSED_TENSORS
        calls = tk.calls_nvfp4(*common, amax, flag, *shape, is_bf16=bf16, reciprocal=reciprocal)
    elif fmt is Format.MXFP4:
        calls = tk.calls_mxfp4(*common, flag, *shape, is_bf16=bf16)
    else:
        scale_bf16 = params.int4_scale_torch_dtype == torch.bfloat16
        calls = tk.calls_int4(
            *common, flag, *shape, is_bf16=bf16, group=params.int4_group, scale_bf16=scale_bf16
        )
    triton_quant.launch(calls)
    if flags is not None:
        flags[0].add(flags[1], slab.device, slot, launch)
    elif wait:
        launch.check()
    return launch


# --------------------------------------------------------------------------------------------------
# probe: the 4-bit kernels compile and match on this GPU, once per device, format and parameters

#: (CUDA index, format, params) -> why the 4-bit kernels cannot be used there (None: they can)
_probed: dict[tuple, str | None] = {}
_probe_lock = threading.Lock()
#: zero, tiny, ordinary, saturating and negative values, in every block of the probe
_PROBE_VALUES = [0.0, 1e-30, 0.5, -1.0, 3.0, 448.0, -1000.0, 0.3]


def _probe_launch(device: torch.device, fmt: Format, params: FormatParams) -> None:
    """Quantize a tiny two-part slab (gate + up sharing NVFP4's global scale) on ``device`` and
    compare every output's bytes with the torch reference; raises on any difference."""
    from sidecar.numerics import fourbit

    k = max(64, params.int4_group if fmt is Format.INT4_W4A16 else 64)
    row = torch.tensor(_PROBE_VALUES * (k // len(_PROBE_VALUES)), dtype=torch.float32)
    x = torch.stack([row, -2 * row, row / 3, 7 * row]).to(torch.bfloat16).view(1, 4, k)
    want = []
    gs = fourbit.nvfp4_global_scale(x[0]) if fmt is Format.NVFP4 else None
    for part in (x[0, :2], x[0, 2:]):
        if fmt is Format.NVFP4:
            q, s, g = fourbit.quantize_nvfp4(part, global_scale=gs)
            reciprocal = params.nvfp4_names is Nvfp4Names.COMPRESSED_TENSORS
            want.append((q, s, torch.reciprocal(g).reshape(1) if reciprocal else g))
        elif fmt is Format.MXFP4:
            want.append(fourbit.quantize_mxfp4(part))
        else:
            kw = {"group": params.int4_group, "scale_dtype": params.int4_scale_torch_dtype}
            want.append(fourbit.quantize_int4(part, **kw))
    outs = [[tuple(torch.empty_like(t, device=device) for t in w) for w in want]]
    amax = torch.zeros(1, dtype=torch.int32, device=device)
    slab = x.to(device)
    if fmt is Format.NVFP4:
        amax_slab(slab, amax)
    names = [["probe gate", "probe up"]]
    quantize_slab_fourbit(slab, fmt, outs, names=names, params=params, amax=amax, flags=None)
    for got, ref in zip(outs[0], want):
        for a, b in zip(got, ref):
            if not torch.equal(a.cpu().reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
                raise RuntimeError("the probe's bytes differ from the torch reference")


def probe(
    device: torch.device | str, fmt: Format, params: FormatParams = DEFAULT_FORMAT_PARAMS
) -> str | None:
    """Why the 4-bit kernels must not quantize ``fmt`` under ``params`` on CUDA ``device`` (they
    failed to compile or launch there, or disagreed with the reference on a tiny slab), or None.
    Probed once per process, device, format and parameters; the torch reference is used where it
    failed, said in the log. A CPU device (the interpreter, in tests) is not probed."""
    from sidecar.numerics.kernels import device_scope

    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = torch.cuda.current_device() if device.index is None else device.index
    key = (index, fmt, params)
    with _probe_lock:
        if key in _probed:
            return _probed[key]
        try:
            with device_scope(torch.device("cuda", index)):
                _probe_launch(torch.device("cuda", index), fmt, params)
            reason = None
        except Exception as err:  # any failure: the reference still quantizes this format
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            reason = f"the {fmt.value} Triton kernels failed their probe on cuda:{index} ({type(err).__name__}: {first})"
            log.warning("quantizing %s with the torch reference on cuda:%s: %s", fmt.value, index, reason)
        _probed[key] = reason
        return reason


# --------------------------------------------------------------------------------------------------
# warm-up: the kernel calls of a launch, with dtypes in place of tensors (Triton compiles from these)


def warm_up_calls(
    fmt: Format, params: FormatParams, dtype: torch.dtype, shape: tuple[int, int, int], parts: int
) -> list:
    """The calls :func:`quantize_slab_fourbit` (and NVFP4's :func:`amax_slab`) make for a contiguous
    slab of ``shape`` in ``dtype``, cut into ``parts``, as Triton's compile-only call takes them
    (the arena's buffers are 16-byte aligned, as the FP8 warm-up assumes)."""
    from sidecar.numerics.kernels import triton_fourbit_slab as tk

    e, r, k = shape
    rows = r // parts
    if not (e and rows and k):
        return []
    i64, i32 = torch.int64, torch.int32
    bf16 = dtype == torch.bfloat16
    tables = (i64,) * len(_expected(fmt, params, rows, k))
    common = (dtype, r * k, k, tables)
    if fmt is Format.NVFP4:
        reciprocal = params.nvfp4_names is Nvfp4Names.COMPRESSED_TENSORS
        return [
            *tk.calls_amax(dtype, r * k, k, i32, e, r, k, is_bf16=bf16),
            *tk.calls_nvfp4(*common, i32, i32, e, parts, rows, k, is_bf16=bf16, reciprocal=reciprocal),
        ]
    if fmt is Format.MXFP4:
        return tk.calls_mxfp4(*common, i32, e, parts, rows, k, is_bf16=bf16)
    scale_bf16 = params.int4_scale_torch_dtype == torch.bfloat16
    return tk.calls_int4(
        *common, i32, e, parts, rows, k, is_bf16=bf16, group=params.int4_group, scale_bf16=scale_bf16
    )
