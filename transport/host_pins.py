"""Page-locking host generations off the hot path, and a reader's fallback where CUDA refuses
READ_ONLY registration.

``cudaHostRegister`` of a host generation costs about a second per 10-30 GiB (every page faulted in
and locked): 2 x 331 GiB for a DeepSeek-V3 node share is minutes, close to systemd's
``TimeoutStartSec=300`` when done before READY, and each engine TP worker paid it again on its
first load. :class:`BackgroundPins` does it on a thread of its own: READY (and a reader's first
load) no longer wait; copies before a generation is pinned are pageable (slower, correct), after
it DMAs. ``pinned`` lists what is pinned so far; ``release`` waits for the thread, then unpins.

A reader maps a generation read-only, which needs ``cudaHostRegisterReadOnly`` (CUDA 11.1+, only
where ``CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED``; a B300 with driver 610 answers
cudaErrorNotSupported). :func:`pin_read_only` then registers without the flag, which CUDA allows
for a read-only mapping where pageable memory is accessed through the host's page tables (Grace,
HMM); where that fails too the engine's copies stay pageable and the reason is kept (status, log).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from transport.cuda_driver import CudaError, Driver
from transport.cuda_ipc import HostPin, pin_shm_arena

log = logging.getLogger("refitd.cuda_ipc")

#: how long ``release`` waits for a registration in flight (one generation's) before giving up on it
RELEASE_WAIT_S = 600.0


def not_supported(exc: BaseException) -> bool:
    """Whether CUDA refused an operation as unsupported here (not a bad argument or no memory)."""
    text = str(exc)
    return "NotSupported" in text or "not supported" in text


def pin_read_only(arena: Any, *, driver: Driver, device: int) -> tuple[HostPin | None, str | None]:
    """Page-lock a read-only mapping: (pin, None), or (None, why) when CUDA cannot. Tries
    READ_ONLY registration, then, where CUDA does not support it, a plain one."""
    try:
        return pin_shm_arena(arena, driver=driver, device=device, read_only=True), None
    except CudaError as exc:
        if not not_supported(exc):
            return None, str(exc)
        first = exc
    try:
        pin = pin_shm_arena(arena, driver=driver, device=device, read_only=False)
    except CudaError as exc:
        return None, (
            f"{first}; and without the READ_ONLY flag: {exc}. This GPU or driver does not support "
            "registering read-only host memory (CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED "
            "is 0) and does not access pageable memory through the host's page tables"
        )
    log.info(
        "READ_ONLY host registration is not supported here (%s): generation %s pinned without the flag",
        first,
        getattr(arena, "name", "?"),
    )
    return pin, None


class BackgroundPins:
    """Page-lock ``arenas`` one after another on a thread; ``pin(arena)`` does one (a HostPin, or
    None: nothing to pin) and may raise (logged: that arena stays pageable)."""

    def __init__(self, arenas: Sequence[Any], pin: Callable[[Any], HostPin | None], *, what: str):
        self.pinned: list[HostPin] = []
        self.failures: list[str] = []
        self.done = threading.Event()
        self._stop = False
        self._lock = threading.Lock()
        self._what = what
        self._thread = threading.Thread(
            target=self._run, args=(list(arenas), pin), name=f"refitd-pin-{what}", daemon=True
        )
        self._thread.start()

    def _run(self, arenas: list[Any], pin: Callable[[Any], HostPin | None]) -> None:
        try:
            for arena in arenas:
                if self._stop:
                    return
                t0 = time.monotonic()
                try:
                    got = pin(arena)
                except Exception as exc:
                    log.warning("could not page-lock %s (its copies stay pageable): %s", arena.name, exc)
                    with self._lock:
                        self.failures.append(f"{arena.name}: {exc}")
                    continue
                if got is None:
                    continue
                with self._lock:
                    if self._stop:  # released meanwhile: undo at once
                        got.release()
                        return
                    self.pinned.append(got)
                log.info(
                    "%s: %s page-locked (%.1f GiB in %.1f s)",
                    self._what,
                    arena.name,
                    got.nbytes / (1 << 30),
                    time.monotonic() - t0,
                )
        finally:
            self.done.set()

    def wait(self, timeout: float | None = None) -> bool:
        """True once every arena was tried."""
        return self.done.wait(timeout)

    @property
    def pins(self) -> list[HostPin]:
        with self._lock:
            return list(self.pinned)

    def release(self) -> None:
        """Stop pinning, wait for a registration in flight, unpin everything (idempotent)."""
        self._stop = True
        if not self.done.wait(RELEASE_WAIT_S):
            log.error(
                "%s: a page-lock still runs after %.0f s; unpinning what is done", self._what, RELEASE_WAIT_S
            )
        with self._lock:
            pins, self.pinned = self.pinned, []
        for pin in pins:
            pin.release()
