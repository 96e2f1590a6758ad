"""A passthrough's copy out of staging, checked for NaN/Inf on the copy, never on staging.

Staging is mapped writable by the local ranks of the step: a rank may still change a byte after
the daemon looked at it (a bug, a late copy of a rank that was declared dead). Checking staging
and then copying it would publish whatever landed in between, so the daemon copies first and then
checks the bytes it copied: what is published is what was checked, and no trainer process can
reach it (it maps no generation).

The two passes are fused chunk by chunk on the CPU: the native library (``refitd_copy_check`` in
``sidecar/numerics/native/quant.c``) copies a 64 KiB chunk and scans it while it is still in cache,
on the quantizers' threads, so the check costs little beyond the copy. Elsewhere (a GPU, no C
compiler, another dtype) one ``copy_`` and one ``aminmax`` of the destination do the same.

    copy_checked(dst, src, name)      # NonFiniteError naming ``name`` if the copy holds NaN or Inf
    check_copied(unit, outputs)       # a unit's outputs, already copied
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from sidecar.numerics import native
from sidecar.numerics.native_calls import POOL as cpu_threads
from sidecar.numerics.reference import NonFiniteError
from sidecar.plan.build import Unit

#: exponent masks of the dtypes the native copy checks: all bits set means Inf or NaN
_EXPONENT = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00, torch.float32: 0x7F800000}
#: bytes per thread's share at least (below it one thread copies the lot)
_SPLIT_BYTES = 1 << 20


def _refuse(name: str) -> NonFiniteError:
    return NonFiniteError(f"tensor {name!r} holds NaN or Inf; refusing to publish it")


def finite(t: torch.Tensor) -> bool:
    """Whether ``t`` (floating, non-empty) holds no NaN and no Inf: ``aminmax`` propagates NaN and
    sees Inf in one pass (16 GB/s on bf16 where ``isfinite().all()`` manages 0.3)."""
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    """Copy ``src`` into ``dst`` (same dtype and shape), then refuse NaN/Inf found in ``dst``:
    fused in the native library where it applies, else a copy and a scan of ``dst``."""
    if dst.data_ptr() != src.data_ptr():  # else the daemon wrote a remote rank's frames there: check only
        seen = _native_copy_check(dst, src)
        if seen is not None:
            if seen:
                raise _refuse(name)
            return
        dst.copy_(src)
    if dst.is_floating_point() and dst.numel() and not finite(dst):
        raise _refuse(name)


def _native_copy_check(dst: torch.Tensor, src: torch.Tensor) -> bool | None:
    """Copy and check with ``refitd_copy_check`` (True: NaN or Inf seen), split over the
    quantizers' threads; None, having done nothing, where it does not apply."""
    expo = _EXPONENT.get(dst.dtype)
    if (
        expo is None
        or src.dtype != dst.dtype
        or dst.device.type != "cpu"
        or src.device.type != "cpu"
        or not dst.is_contiguous()
        or not src.is_contiguous()
        or not dst.numel()
    ):
        return None
    lib = native.load()
    if lib is None:
        return None
    d, s_, width, nbytes = dst.data_ptr(), src.data_ptr(), dst.element_size(), dst.nbytes
    units = -(-nbytes // _SPLIT_BYTES)  # shares of _SPLIT_BYTES (the last one shorter)

    def share(begin: int, end: int) -> int:
        return lib.refitd_copy_check(
            d, s_, begin * _SPLIT_BYTES, min(end * _SPLIT_BYTES, nbytes), width, expo
        )

    return any(cpu_threads.run(share, units, _SPLIT_BYTES // width))


def check_copied(unit: Unit, outputs: Mapping[str, torch.Tensor]) -> None:
    """NonFiniteError naming the input of ``unit`` (a passthrough) whose copy in ``outputs`` holds
    NaN or Inf."""
    for o in unit.outputs:
        t = outputs[o.name]
        if t.is_floating_point() and t.numel() and not finite(t):
            raise _refuse(o.source)


def run_passthrough(
    unit: Unit, inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor]
) -> bool:
    """Copy-and-check a plain passthrough (each output a whole input of its dtype and shape);
    False, having done nothing, for anything else (``run_unit`` + :func:`check_copied` then)."""
    pairs = []
    for o in unit.outputs:
        src, dst = inputs.get(o.source), outputs.get(o.name)
        if src is None or dst is None or src.dtype != dst.dtype or src.shape != dst.shape:
            return False
        if src.device != dst.device:
            return False
        pairs.append((dst, src, o.source))
    for dst, src, name in pairs:
        copy_checked(dst, src, name)
    return True
