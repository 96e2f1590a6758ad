"""The quantization worker: a thread that runs plan units while the serve loop keeps receiving.

Torch releases the GIL inside its kernels, so quantizing layer L overlaps with layers L+1... still
arriving. Results go back through a queue; a message on an inproc socket wakes the serve loop.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import zmq

from sidecar.plan import Unit, run_unit
from sidecar.quant import NonFiniteError

log = logging.getLogger("refitd.worker")


@dataclass(slots=True)
class Done:
    step: int
    unit: int
    seconds: float
    error: Exception | None
    skipped: bool = False  # cancelled before it ran: its outputs were never written
    start: float = 0.0  # time.monotonic() when it started


def check_finite(unit: Unit, tensors: dict) -> None:
    """Passthrough tensors are validated too: a NaN in a norm weight poisons the engine as surely.

    ``aminmax`` propagates NaN and sees Inf in one pass: 16 GB/s on bf16 where ``isfinite().all()``
    manages 0.3 (measured on the CI machine).
    """
    for name in unit.inputs:
        t = tensors[name]
        if t.is_floating_point() and t.numel():
            lo, hi = torch.aminmax(t)
            if not bool(torch.isfinite(lo) & torch.isfinite(hi)):
                raise NonFiniteError(f"tensor {name!r} holds NaN or Inf; refusing to publish it")


def _synchronize(tensors: dict) -> None:
    for t in tensors.values():
        if t.is_cuda:
            torch.cuda.synchronize(t.device)
            return


class QuantWorker:
    """Runs ``run_unit`` for submitted units in order; ``close()`` joins the thread."""

    def __init__(self, ctx: zmq.Context, wake_endpoint: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.results: queue.SimpleQueue[Done] = queue.SimpleQueue()
        self._ctx, self._wake_endpoint = ctx, wake_endpoint
        self._cancelled: set[int] = set()
        self._lock = threading.Lock()
        self.inflight = 0  # submitted and not yet reported back; touched by the serve loop only
        self._thread = threading.Thread(target=self._run, name="refitd-quant", daemon=True)
        self._thread.start()

    def submit(
        self,
        step: int,
        unit: Unit,
        inputs: Callable[[], dict],
        outputs: Callable[[], dict],
        *,
        sync: bool = False,
    ) -> None:
        """Queue ``unit``. ``sync``: wait for its GPU work before reporting it done (the staging ring
        reuses the region it read as soon as it is reported)."""
        self.inflight += 1
        self._jobs.put((step, unit, inputs, outputs, sync))

    def cancel(self, step: int) -> None:
        """Skip whatever of ``step`` has not started (a failed step); running units finish."""
        with self._lock:
            self._cancelled.add(step)

    def forget_cancelled(self) -> None:
        """Call when a step starts with nothing in flight: a failed step may be retried under the
        same number, and its units must then run, not be skipped."""
        with self._lock:
            self._cancelled.clear()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        wake = self._ctx.socket(zmq.PUSH)
        wake.connect(self._wake_endpoint)
        try:
            while (job := self._jobs.get()) is not None:
                step, unit, inputs, outputs, sync = job
                with self._lock:
                    skip = step in self._cancelled
                t0 = time.monotonic()
                error = None
                if not skip:
                    try:
                        # no_grad, not inference_mode: the arenas cache their views, and a view first
                        # made here would be an inference tensor that the serve loop may not write
                        # into (handle_shard copying a remote frame into staging would raise)
                        with torch.no_grad():
                            tensors = inputs()
                            if unit.fmt is None:
                                check_finite(unit, tensors)
                            run_unit(unit, tensors, outputs())
                            if sync:
                                _synchronize(tensors)
                    except Exception as exc:  # reported to the serve loop, which fails the step
                        error = exc
                        if not isinstance(exc, (ValueError, NonFiniteError)):
                            log.exception("unit %d of step %d failed", unit.index, step)
                self.results.put(Done(step, unit.index, time.monotonic() - t0, error, skip, t0))
                with contextlib.suppress(zmq.Again):  # a full pipe already holds a pending wake-up
                    wake.send(b"", flags=zmq.NOBLOCK)
        finally:
            wake.close(linger=0)
