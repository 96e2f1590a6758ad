"""GPU kernels for the quantizers of docs/spec.md §1, behind guards.

``import sidecar.numerics.kernels`` never imports Triton; the kernels (``sidecar.numerics.kernels.triton_quant``) load
on first use. The torch reference (``sidecar.numerics.reference``) stays the oracle and the CPU path; the kernels
must match it byte for byte (tests/test_kernels.py, bench/gpu_check.py).

Usage::

    from sidecar.numerics import kernels

    if kernels.available(slab.device):
        # gate_up [E, 2I, H]: two parts per expert (gate rows [0, I), up rows [I, 2I))
        kernels.quantize_slab(slab, "block_fp8", [[(q_gate[e], s_gate[e]), (q_up[e], s_up[e])] for e in ...])

This package knows slabs, formats and launches, never the plan: ``sidecar.plan.launch`` maps a plan's
units onto slab launches (``try_run_unit``, what ``sidecar.plan.run.run_unit`` calls first) and a plan
onto the :class:`LaunchSpec` list that :func:`warm_up` compiles.

One launch per slab (two for fp8_per_tensor: amax, then quantize) writes every expert's values and
scales straight into the caller's tensors, found through a table of their base addresses.

On the GPU path: every launch and allocation happens with the slab's device current (Triton
launches on the current device's stream); the daemon's quantize worker collects the launches' NaN/Inf
flags in a :class:`FlagGroup` and reads them once per batch instead of once per launch; the per-tensor
scratch is kept per device and stream. At start :func:`warm_up` probes a tiny launch on the daemon's
GPU (a Triton that imports but cannot launch makes the torch reference quantize, said in the log,
status and metrics) and compiles the distinct specialisations of the plan's launches before READY.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from sidecar.config.environment import triton_interpret_env
from sidecar.numerics.formats import BLOCK, Format
from sidecar.numerics.kernels.slab import (
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

__all__ = [
    "DEFAULT_CONFIGS",
    "FlagGroup",
    "LaunchSpec",
    "SlabLaunch",
    "TileConfig",
    "WarmUp",
    "available",
    "collecting",
    "device_scope",
    "flags_in_use",
    "quantize",
    "quantize_slab",
    "specialisations",
    "unavailable_reason",
    "warm_up",
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
    from sidecar.numerics.kernels import triton_quant

    return triton_quant


def unavailable_reason(device: torch.device | str | None = None) -> str | None:
    """Why the kernels cannot run on ``device`` (default: any CUDA device), or None if they can.

    For a CUDA device the first call compiles and launches a tiny kernel there (:func:`probe`): a
    Triton that imports but cannot launch (no C compiler or Python headers for its launcher, no
    libcuda through ldconfig, an unwritable cache) is found once, and the torch reference is used.
    """
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
    if device is not None:
        return probe(device)
    return None


def available(device: torch.device | str | None = None) -> bool:
    """True when the Triton kernels can run on ``device`` (default: on this machine's GPU).

    False on a CPU tensor, without Triton, without CUDA, or when the probe launch on ``device``
    failed; the same predicate drives the tests' ``skipif``.
    """
    return unavailable_reason(device) is None


def _device_index(device: torch.device | str) -> int:
    device = torch.device(device)
    return torch.cuda.current_device() if device.index is None else device.index


#: CUDA index -> why the probe launch failed there (None: it passed); one probe per device
_probed: dict[int, str | None] = {}
_probe_lock = threading.Lock()
#: the probe's input: zero, tiny, ordinary, saturating and negative values in one MXFP8 block
_PROBE_VALUES = [0.0, 1e-30, 0.5, -1.0, 3.0, 448.0, -1000.0, 0.3] * 4


def _probe_launch(device: torch.device) -> None:
    """Compile and launch the MXFP8 kernel on a 1x32 input on ``device`` and compare its bytes
    with the torch reference; raises whatever the compile or launch raised."""
    from sidecar.numerics import reference as quant

    x = torch.tensor(_PROBE_VALUES, dtype=torch.bfloat16).view(1, 32)
    previous, _collecting.active = getattr(_collecting, "active", None), None  # its own flag, checked now
    try:
        q, s = quantize(x.to(device), Format.MXFP8, name="probe")
    finally:
        _collecting.active = previous
    rq, rs = quant.quantize(x, Format.MXFP8)
    if not (torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s.cpu(), rs)):
        raise RuntimeError("the probe's bytes differ from the torch reference")


def probe(device: torch.device | str) -> str | None:
    """Compile and launch a tiny kernel on CUDA ``device`` once per process and device; why it
    failed (the torch reference is used there from then on), or None when it ran and matched."""
    index = _device_index(device)
    with _probe_lock:
        if index in _probed:
            return _probed[index]
        try:
            with device_scope(torch.device("cuda", index)):
                _probe_launch(torch.device("cuda", index))
            reason = None
        except Exception as err:  # any failure to compile or launch: the reference still works
            reason = (
                f"Triton imports but cannot launch a kernel on cuda:{index} "
                f"({type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}); "
                "check that a C compiler and the Python headers are installed, that libcuda.so is "
                "found by ldconfig, and that TRITON_CACHE_DIR (default ~/.triton) is writable"
            )
            log.warning("quantizing with the torch reference on cuda:%s: %s", index, reason)
        _probed[index] = reason
        return reason


def device_scope(device: torch.device | str) -> contextlib.AbstractContextManager:
    """Make ``device`` the thread's current CUDA device for the block (Triton launches on the
    current device and its stream; allocations without an index land there too); nothing for a
    CPU device. Restores the previous device on exit."""
    device = torch.device(device)
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.device(device)


# --------------------------------------------------------------------------------------------------
# the slab entry point


def _raise_non_finite(name: str, where: str) -> None:
    from sidecar.numerics import reference as quant

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
    """One slab's launch: its non-finite flag (checked by :meth:`check`, one host sync, or with a
    whole :class:`FlagGroup`) and, for diagnostics, the compiled kernels Triton returned (empty
    under the interpreter)."""

    flag: torch.Tensor
    fmt: Format
    geom: SlabGeometry
    config: TileConfig
    names: Callable[[], Sequence[Sequence[str]]]
    compiled: list[Any] = field(default_factory=list)

    def check(self) -> None:
        """Raise NonFiniteError (naming the tensor and its first bad tile) if any block held NaN/Inf."""
        self.raise_for(int(self.flag.item()))

    def raise_for(self, value: int) -> None:
        """Raise NonFiniteError for the flag ``value`` read back, unless it is clear."""
        if value != FLAG_CLEAR:
            _raise_non_finite(*_non_finite_where(self.fmt, self.geom, self.config, value, self.names()))


class FlagGroup:
    """The non-finite flags of many launches, read back with one host sync for all of them.

    A flag per launch checked right away costs a host sync per launch (``flag.item()``: about 18k
    per step for a per-expert 48-layer model) and a tiny allocation each. Instead each launch made
    while the group :func:`collects <collecting>` atomic-mins into its own slot of a buffer the
    group keeps per device (allocated once, reused every step); :meth:`check` reads each device's
    slots in one copy, clears them, and returns the error of every tag (the caller's unit) whose
    launch saw NaN/Inf. Used by one thread at a time (the quantize worker's).

        group = FlagGroup()
        with collecting(group, tag=unit.index):
            run_unit(unit, inputs, outputs)      # launches, no host sync
        errors = group.check()                   # {unit.index: NonFiniteError} for the bad ones
    """

    #: slots per buffer; a group that needs more takes another buffer of this size
    CHUNK = 4096
    #: int32s from one slot to the next: every flag pointer is 16-byte aligned, so every launch has
    #: the specialisation the warm-up compiled (Triton specialises on a pointer's 16-byte alignment)
    STRIDE = 4

    def __init__(self) -> None:
        self._buffers: dict[torch.device, list[torch.Tensor]] = {}
        self._used: dict[torch.device, int] = {}
        self._launches: list[tuple[Any, torch.device, int, SlabLaunch]] = []

    def __len__(self) -> int:
        """Launches made since the last :meth:`check`."""
        return len(self._launches)

    def slot(self, device: torch.device) -> tuple[torch.Tensor, int]:
        """A cleared one-int32 flag on ``device`` for the next launch, and its slot number."""
        i = self._used.get(device, 0)
        buffers = self._buffers.setdefault(device, [])
        if i // self.CHUNK >= len(buffers):
            buffers.append(
                torch.full((self.CHUNK * self.STRIDE,), FLAG_CLEAR, dtype=torch.int32, device=device)
            )
        self._used[device] = i + 1
        k = i % self.CHUNK * self.STRIDE
        return buffers[i // self.CHUNK][k : k + 1], i

    def add(self, tag: Any, device: torch.device, slot: int, launch: SlabLaunch) -> None:
        self._launches.append((tag, device, slot, launch))

    def check(self) -> dict[Any, Exception]:
        """Read every flag set since the last check (one device-to-host copy per device), clear
        them for the next group, and map each tag whose launch saw NaN/Inf to its NonFiniteError
        (the first such launch of the tag)."""
        if not self._launches:
            return {}
        values: dict[torch.device, list[int]] = {}
        for device, used in self._used.items():
            buffers = self._buffers[device][: -(-used // self.CHUNK)]
            with device_scope(device):
                flat = buffers[0] if len(buffers) == 1 else torch.cat(buffers)
                values[device] = flat[:: self.STRIDE][:used].tolist()  # the one host sync for this device
                for b in buffers:
                    b.fill_(FLAG_CLEAR)
        errors: dict[Any, Exception] = {}
        launches, self._launches, self._used = self._launches, [], {}
        for tag, device, slot, launch in launches:
            if tag in errors or values[device][slot] == FLAG_CLEAR:
                continue
            try:
                launch.raise_for(values[device][slot])
            except Exception as err:  # NonFiniteError, naming the tensor and tile
                errors[tag] = err
        return errors


_collecting = threading.local()


def flags_in_use() -> tuple[FlagGroup, Any] | None:
    """``(group, tag)`` of this thread's :func:`collecting` block, or None outside one."""
    return getattr(_collecting, "active", None)


@contextlib.contextmanager
def collecting(group: FlagGroup, tag: Any) -> Iterator[FlagGroup]:
    """Launches made by this thread inside the block put their non-finite flag in ``group`` under
    ``tag`` instead of checking it with a host sync each; ``group.check()`` reports them."""
    previous = getattr(_collecting, "active", None)
    _collecting.active = (group, tag)
    try:
        yield group
    finally:
        _collecting.active = previous


#: (device, stream) -> int32 scratch for fp8_per_tensor's partial amaxes; grows, never shrinks.
#: Launches on one stream run in order, so they can share one scratch.
_scratch: dict[tuple[torch.device, int], torch.Tensor] = {}
_scratch_lock = threading.Lock()


def _stream_id(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


def scratch(device: torch.device, n: int) -> torch.Tensor:
    """At least ``n`` int32 elements of scratch on ``device`` for the current stream; allocated
    when a launch needs more than any before (a warm-up reserves the plan's largest)."""
    key = (device, _stream_id(device))
    with _scratch_lock:  # the per-GPU quantization threads share the dict
        buf = _scratch.get(key)
        if buf is None or buf.numel() < n:
            buf = _scratch[key] = torch.empty(max(n, 1024), dtype=torch.int32, device=device)
    return buf


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
    before publishing the outputs. Inside :func:`collecting` the flag goes to the group instead
    (no host sync, whatever ``wait`` says).

    Everything runs with the slab's device current: the launches (Triton launches on the current
    device and its stream), the flag, scratch and pointer tables.
    """
    fmt = Format.parse(fmt)
    parts = len(outs[0]) if outs and len(outs[0]) else 1

    def all_names() -> Sequence[Sequence[str]]:
        return names or default_names(max(1, len(outs)), parts)

    first = names[0][0] if names and names[0] else "slab"
    check_slab(slab, fmt, parts, first)
    if slab.device.type != "cuda" and not _interpreting():
        raise ValueError(
            f"{first}: quantize_slab runs on CUDA tensors; use sidecar.numerics.reference on {slab.device}"
        )
    cfg = config or DEFAULT_CONFIGS[fmt]
    cfg.validate(fmt)
    device = slab.device
    with device_scope(device):
        prepared = prepare_outputs(slab, fmt, outs, all_names)
        geom = SlabGeometry.of(slab, parts)
        group = getattr(_collecting, "active", None)
        if group is not None:
            flag, slot = group[0].slot(device)
        else:
            flag = torch.full((1,), FLAG_CLEAR, dtype=torch.int32, device=device)
        launch = SlabLaunch(flag, fmt, geom, cfg, all_names)
        if geom.numel == 0:
            if fmt is Format.FP8_PER_TENSOR:  # amax over nothing is 0: scale 1.0
                for row in outs:
                    for _, s in row:
                        s.fill_(1.0)
            return launch
        tq = _load()
        extra = {}
        if fmt is Format.FP8_PER_TENSOR:
            extra["partials"] = scratch(device, tq.partials_size(geom, cfg))
        calls = tq.CALLS[fmt.value](
            slab,
            prepared.q_table,
            prepared.s_table,
            flag,
            geom,
            cfg,
            aligned=prepared.aligned,
            wide=needs_wide_offsets(slab),
            **extra,
        )
        launch.compiled = tq.launch(calls)
        if group is not None:
            group[0].add(group[1], device, slot, launch)
        elif wait:
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
    """The kernels' twin of ``sidecar.numerics.reference.quantize``: any shape the reference takes, same outputs
    (``(values, scales)``), same errors; one launch. For tests and checks: the daemon calls
    :func:`quantize_slab` (through ``sidecar.plan.launch.try_run_unit``) on whole slabs."""
    from sidecar.numerics import reference as quant

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
    return triton_interpret_env()  # Triton before 3.4 had no knobs


# --------------------------------------------------------------------------------------------------
# warm-up: compile the plan's specialisations before the first step needs them


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    """One slab launch a plan will make, as far as compiling it goes: format, input dtype and the
    geometry of a contiguous slab (what the staging arena holds)."""

    fmt: Format
    dtype: torch.dtype
    geom: SlabGeometry


def _calls(spec: LaunchSpec, config: TileConfig | None = None) -> list:
    """The kernel calls of ``spec`` with dtypes in place of tensors (Triton compiles from dtypes,
    alignment and integer arguments; the arena's buffers are 16-byte aligned)."""
    tq = _load()
    cfg = config or DEFAULT_CONFIGS[spec.fmt]
    g = spec.geom
    meta = torch.empty_strided(
        (g.experts, g.parts * g.rows, g.cols), g.strides, dtype=spec.dtype, device="meta"
    )
    extra = {"partials": torch.int32} if spec.fmt is Format.FP8_PER_TENSOR else {}
    return tq.CALLS[spec.fmt.value](
        spec.dtype,
        torch.int64,
        torch.int64,
        torch.int32,
        g,
        cfg,
        aligned=True,
        wide=needs_wide_offsets(meta),
        **extra,
    )


def _int_traits(v: int) -> tuple[bool, bool, bool]:
    """What Triton specialises an integer argument on: == 1, divisible by 16, needs 64 bits."""
    return v == 1, v % 16 == 0, not -(2**31) <= v < 2**31


def specialisation(spec: LaunchSpec, config: TileConfig | None = None) -> tuple:
    """The key under which Triton compiles ``spec``'s kernels: each kernel's name, its argument
    dtypes, integer traits and constexprs. Launches with equal keys share compiled kernels."""
    key = []
    for call in _calls(spec, config):
        args = tuple(_int_traits(a) if isinstance(a, int) else str(a) for a in call.args)
        key.append((call.kernel.fn.__name__, args, tuple(sorted(call.kwargs.items()))))
    return tuple(key)


def specialisations(launches: Iterable[LaunchSpec]) -> dict[tuple, LaunchSpec]:
    """The distinct kernel specialisations of ``launches``, each with one launch that needs it."""
    out: dict[tuple, LaunchSpec] = {}
    for spec in dict.fromkeys(launches):  # equal launches (every layer's) once
        out.setdefault(specialisation(spec), spec)
    return out


@dataclass(slots=True)
class WarmUp:
    """What :func:`warm_up` did: which quantizer the daemon uses, and why; for log, status, metrics."""

    device: str
    impl: str  # "triton" or "torch"
    reason: str | None = None  # why the torch reference (None with triton)
    compiled: int = 0  # specialisations compiled
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "impl": self.impl,
            "reason": self.reason,
            "compiled": self.compiled,
            "seconds": round(self.seconds, 3),
        }


def warm_up(
    launches: Iterable[LaunchSpec] | None,
    device: torch.device | str,
    *,
    compile: Callable[[list], Any] | None = None,
) -> WarmUp:
    """Before the daemon says READY: probe the kernels on ``device`` and compile every distinct
    specialisation of ``launches`` there (the first step would otherwise compile each, ~0.5 s
    apiece), and reserve the per-tensor scratch the largest launch needs. ``None`` (no plan yet:
    the first step fixes it) runs only the probe. A no-op on a CPU device (the torch reference
    quantizes there). ``compile`` replaces Triton's compile-only call (tests). A plan's launches
    come from ``sidecar.plan.launch.plan_launches``."""
    device = torch.device(device)
    if (reason := unavailable_reason(device)) is not None:
        return WarmUp(str(device), "torch", reason)
    if launches is None:  # the plan comes with the first step: its kernels compile then
        return WarmUp(str(device), "triton")
    tq = _load()
    compile = compile or tq.compile_only
    t0 = time.monotonic()
    specs = specialisations(launches)
    with device_scope(device):
        for spec in specs.values():
            compile(_calls(spec))
        sizes = [tq.partials_size(s.geom, DEFAULT_CONFIGS[s.fmt]) for s in specs.values()]
        sizes = [n for s, n in zip(specs.values(), sizes) if s.fmt is Format.FP8_PER_TENSOR]
        if sizes:
            scratch(torch.device("cuda", _device_index(device)), max(sizes))
    done = WarmUp(str(device), "triton", None, len(specs), time.monotonic() - t0)
    log.info("compiled %d kernel specialisations for %s in %.1f s", done.compiled, device, done.seconds)
    return done
