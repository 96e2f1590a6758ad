"""One quantization worker per GPU (docs/multi_gpu.md, "Per-GPU work").

With the layer groups spread over several GPUs (``Arenas.gpus``), each GPU gets a
:class:`~sidecar.daemon.worker.QuantWorker` thread of its own: the groups placed on a GPU are
quantized by its thread (the kernels launch on the device their tensors are on, and torch
releases the GIL), and its publish ring is copied out on that GPU's own copy stream
(``tiers.copy_out`` makes one per device), so N GPUs quantize and copy out N groups at once and
one slow GPU does not queue another's groups behind its own. The results of every thread go to
one queue the serve loop drains, as with one worker.

:class:`QuantWorkers` has the serve loop's side of ``QuantWorker`` (``submit``, ``submit_spans``,
``results``, ``inflight``, ``cancel``, ``forget_cancelled``, ``close``); ``submit(..., lane=k)``
queues a unit on GPU ``k``'s thread. Work not placed on a GPU (span jobs, whole-step staging)
goes to the first. One GPU uses a plain ``QuantWorker``, exactly as before.
"""

from __future__ import annotations

import queue
from collections.abc import Mapping

import torch
import zmq

from sidecar.daemon.spans import Span
from sidecar.daemon.worker import Done, QuantWorker
from sidecar.plan.build import Unit

__all__ = ["QuantWorkers", "make_worker"]


class QuantWorkers:
    """``lanes`` QuantWorker threads sharing one results queue; ``inflight`` counts all of them."""

    def __init__(self, ctx: zmq.Context, wake_endpoint: str, lanes: int):
        if lanes < 2:
            raise ValueError(f"QuantWorkers is for several GPUs, got {lanes}: use QuantWorker")
        self.results: queue.SimpleQueue[Done] = queue.SimpleQueue()
        self.workers = [
            QuantWorker(ctx, wake_endpoint, results=self.results, name=f"refitd-quant-gpu{k}")
            for k in range(lanes)
        ]
        self.inflight = 0  # submitted and not yet reported back; touched by the serve loop only

    def submit(
        self,
        step: int,
        unit: Unit,
        inputs: Mapping[str, torch.Tensor],
        outputs: Mapping[str, torch.Tensor],
        *,
        sync: bool = False,
        copies: list | tuple = (),
        lane: int = 0,
    ) -> None:
        """``QuantWorker.submit`` on GPU ``lane``'s thread (the GPU the unit's group is placed on)."""
        if not 0 <= lane < len(self.workers):
            raise ValueError(f"lane {lane}: the daemon has {len(self.workers)} GPU worker(s)")
        self.inflight += 1
        self.workers[lane].submit(step, unit, inputs, outputs, sync=sync, copies=copies)

    def submit_spans(self, step: int, spans: list[tuple[Span, torch.Tensor, torch.Tensor]]) -> None:
        before = self.workers[0].inflight
        self.workers[0].submit_spans(step, spans)
        self.inflight += self.workers[0].inflight - before  # nothing queued for an empty span list

    def cancel(self, step: int) -> None:
        for w in self.workers:
            w.cancel(step)

    def forget_cancelled(self) -> None:
        for w in self.workers:
            w.forget_cancelled()

    def close(self) -> None:
        for w in self.workers:
            w.close()


def make_worker(ctx: zmq.Context, wake_endpoint: str, lanes: int) -> QuantWorker | QuantWorkers:
    """The serve loop's worker: one thread for one GPU (or host memory), one per GPU otherwise."""
    if lanes > 1:
        return QuantWorkers(ctx, wake_endpoint, lanes)
    return QuantWorker(ctx, wake_endpoint)
