"""The quantization worker: a thread that runs plan units while the serve loop keeps receiving.

Torch releases the GIL inside its kernels, so quantizing layer L overlaps with layers L+1... still
arriving. Results go back through a queue; a message on an inproc socket wakes the serve loop.

On a GPU the Triton kernels launch without a host sync each: their NaN/Inf flags collect in one
``kernels.FlagGroup`` and are read once per batch of queued units (or right after a unit that had
to synchronize anyway), before any of those units is reported done.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import zmq

from sidecar.daemon.copyout import check_copied, run_passthrough
from sidecar.daemon.memory.tiers import copy_out
from sidecar.daemon.spans import Span, run_span
from sidecar.numerics import kernels
from sidecar.numerics.reference import NonFiniteError
from sidecar.plan.build import Unit
from sidecar.plan.run import run_passthroughs, run_quantized_units, run_unit

log = logging.getLogger("refitd.worker")

#: Small passthrough units (norm weights, per-expert biases, ... of at most this many input bytes) that
#: are queued back to back run as one batch: one finiteness check and one copy for all of them, and
#: one wake-up of the serve loop, instead of a few torch calls and a socket send per unit.
BATCH_UNIT_BYTES = 256 << 10
#: at most this many units (and this many input bytes) in one batch: its results are reported together
BATCH_MAX_UNITS = 256
BATCH_MAX_BYTES = 8 << 20
#: Quantizing units on the CPU (per-expert models: an expert's gate and up, a few MiB) queued back to
#: back run as one batch of up to this many input bytes: one split across the quantizer threads per
#: pass for all of them (sidecar.plan.run.run_quantized_units), not a hand-off or two per unit. About
#: 20-60 ms of work on two cores: cheap work queued meanwhile waits at most that long.
BATCH_QUANT_BYTES = 64 << 20


@dataclass(slots=True)
class Done:
    step: int
    unit: int
    seconds: float
    error: Exception | None
    skipped: bool = False  # cancelled before it ran: its outputs were never written
    start: float = 0.0  # time.monotonic() when it started
    #: a span job's result covers all of these units (``unit`` is the first); empty for one unit
    units: tuple[int, ...] = ()


@dataclass(slots=True)
class SpanJob:
    """Small passthrough units that became ready together, as byte spans (sidecar.daemon.spans):
    each ``(span, its staging bytes, its generation bytes)``, uint8 views the serve loop made."""

    step: int
    spans: list[tuple[Span, torch.Tensor, torch.Tensor]]
    units: tuple[int, ...]


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every floating, non-empty tensor of ``tensors`` is free of NaN and Inf, in a few torch
    calls for the lot (the infinity norm propagates NaN and is Inf on an Inf). A False names no
    tensor: the one-by-one path (``sidecar.daemon.copyout``) then says which one."""
    floats = [t for t in tensors if t.is_floating_point() and t.numel()]
    if not floats:
        return True
    norms = torch._foreach_norm(floats, float("inf"))
    return bool(torch.stack(norms).isfinite().all())


def batchable(job: tuple | SpanJob) -> bool:
    """A small passthrough without a GPU sync: it may run in a batch with its neighbours (a span
    job is a batch already)."""
    if isinstance(job, SpanJob):
        return False
    unit, sync = job[1], job[4]  # (step, unit, inputs, outputs, sync[, copies])
    return unit.fmt is None and not sync and unit.bytes_in <= BATCH_UNIT_BYTES


def cpu_quantization(job: tuple | SpanJob | None) -> bool:
    """A unit quantized on the CPU that closes no staging-ring group: it may run in a batch with the
    quantizing units queued beside it (:data:`BATCH_QUANT_BYTES`)."""
    if job is None or not _quantization(job) or _closes_group(job):
        return False
    return all(t.device.type == "cpu" for t in job[3].values())


def _same_kind(job: tuple, other: tuple) -> bool:
    """Two jobs that may share a batch: both small passthroughs, or both CPU quantizations of one format
    and parameters."""
    if batchable(job) and batchable(other):
        return True
    return (
        cpu_quantization(job)
        and cpu_quantization(other)
        and job[1].fmt == other[1].fmt
        and job[1].params == other[1].params
    )


def batches(jobs: list) -> list[list]:
    """Split queued ``jobs`` (in order) into runs: consecutive batchable jobs of one step share a run
    (up to BATCH_MAX_UNITS units and BATCH_MAX_BYTES), and so do consecutive CPU quantizations of one
    step and format (up to BATCH_QUANT_BYTES); every other job is a run of its own."""
    runs: list[list] = []
    run_bytes = 0
    for job in jobs:
        last = runs[-1] if runs else None
        limit = BATCH_QUANT_BYTES if cpu_quantization(job) else BATCH_MAX_BYTES
        if (
            last is not None
            and not isinstance(job, SpanJob)
            and not isinstance(last[0], SpanJob)
            and _same_kind(job, last[0])
            and last[0][0] == job[0]
            and len(last) < BATCH_MAX_UNITS
            and run_bytes + job[1].bytes_in <= limit
        ):
            last.append(job)
            run_bytes += job[1].bytes_in
        else:
            runs.append([job])
            run_bytes = 0 if isinstance(job, SpanJob) else job[1].bytes_in
    return runs


def _quantization(job: tuple | SpanJob) -> bool:
    """A unit that quantizes (the rest, passthroughs and spans, is a check and a copy: cheap)."""
    return not isinstance(job, SpanJob) and job[1].fmt is not None


def _closes_group(job: tuple | SpanJob) -> bool:
    """The last unit of a staging-ring group (``sync`` or ``copies`` set, see :meth:`QuantWorker._put`)."""
    return not isinstance(job, SpanJob) and (bool(job[4]) or bool(job[5] if len(job) > 5 else ()))


def _unbatched_quantization(job: tuple | SpanJob | None) -> bool:
    """A quantization that does not run through the Triton kernels (the native CPU kernels, or the
    torch reference): after one of those (or BATCH_QUANT_BYTES of them, for CPU quantizations that
    batch) the worker looks at the queue again, so that cheap work queued meanwhile goes first.
    (Queued Triton launches stay one batch: their NaN/Inf flags are read once per batch, one host
    sync.)"""
    if job is None or not _quantization(job):
        return False
    device = next((t.device for t in job[3].values()), torch.device("cpu"))
    return not kernels.available(device)


def _collected_enough(jobs: list) -> bool:
    """Whether the worker stops taking queued jobs into this round: a quantization that does not
    batch, or CPU quantizations of BATCH_QUANT_BYTES (see :func:`_unbatched_quantization`)."""
    last = jobs[-1]
    if not _unbatched_quantization(last):
        return False
    if not cpu_quantization(last):
        return True
    return sum(job[1].bytes_in for job in jobs if cpu_quantization(job)) >= BATCH_QUANT_BYTES


def _synchronize(tensors: dict) -> None:
    """Wait for the GPU work of the device these tensors live on (the kernels ran there)."""
    for t in tensors.values():
        if t.is_cuda:
            torch.cuda.synchronize(t.device)
            return


class QuantWorker:
    """Runs ``run_unit`` for submitted units in order; ``close()`` joins the thread."""

    def __init__(
        self,
        ctx: zmq.Context,
        wake_endpoint: str,
        *,
        results: queue.SimpleQueue | None = None,
        name: str = "refitd-quant",
    ):
        """``results``: a queue shared with other workers (one per GPU, sidecar.daemon.workers);
        by default its own."""
        #: (priority, order, job): cheap passthrough work (a span job, a small passthrough) ahead of
        #: quantization queued before it, in order within each priority; the close sentinel last
        self._jobs: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self.results: queue.SimpleQueue[Done] = queue.SimpleQueue() if results is None else results
        self._ctx, self._wake_endpoint = ctx, wake_endpoint
        self._cancelled: set[int] = set()
        self._lock = threading.Lock()
        self._flags = kernels.FlagGroup()  # the kernels' NaN/Inf flags, read once per batch
        self._unreported: list[Done] = []  # run, waiting for their flags to be read
        self.inflight = 0  # submitted and not yet reported back; touched by the serve loop only
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

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
        """Queue ``unit`` with its resolved tensors: ``inputs`` (name -> staged tensor) and ``outputs``
        (name -> its place in the target generation), views the serve loop made on its own thread (so
        no arena's view cache is touched from this worker). ``sync``: wait for its GPU work before
        reporting it done (the staging ring reuses the region it read as soon as it is reported).
        ``copies``: ``(device, host)`` byte pairs to copy after it ran (a group's publish region into
        the host generation, at the group's last unit, see :func:`copy_out`). ``lane``: the GPU the
        unit's group is placed on; one worker serves one GPU, so it must be 0 here."""
        if lane:
            raise ValueError(f"this worker serves one GPU: lane {lane} needs sidecar.daemon.workers")
        self.inflight += 1
        self._put((step, unit, inputs, outputs, sync, copies))

    def submit_spans(self, step: int, spans: list[tuple[Span, torch.Tensor, torch.Tensor]]) -> None:
        """Queue the units of ``spans`` (each ``(span, staging bytes, generation bytes)``, views the
        serve loop made) as one job: one result (``Done.units``) reports them all."""
        units = tuple(itertools.chain.from_iterable(span.units for span, _, _ in spans))
        if units:
            self.inflight += 1
            self._put(SpanJob(step, spans, units))

    def _put(self, job: tuple | SpanJob | None) -> None:
        """Queue ``job``: cheap passthrough work first. It completes layer groups, which streaming
        engines load while the quantization of later layers still runs (sidecar.daemon.streams);
        behind every queued quantization it would hold each group back to the end of the step.

        A job that closes a staging-ring group (``sync``: the GPU waited for before the region is
        reused; ``copies``: the group's publish region copied to the host generation) queues with the
        quantizations, behind every unit of its group submitted before it: it must run last."""
        priority = 2 if job is None else 1 if _quantization(job) or _closes_group(job) else 0
        self._jobs.put((priority, next(self._order), job))

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
        self._put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        wake = self._ctx.socket(zmq.PUSH)
        wake.connect(self._wake_endpoint)
        try:
            stop = False
            while not stop:
                jobs = [self._jobs.get()[2]]
                while len(jobs) < BATCH_MAX_UNITS and not _collected_enough(jobs):
                    try:  # whatever else is queued already
                        jobs.append(self._jobs.get_nowait()[2])
                    except queue.Empty:
                        break
                if None in jobs:
                    stop = True
                    jobs = jobs[: jobs.index(None)]
                for run in batches(jobs):
                    if len(run) == 1 or not self._run_batch(run):
                        for job in run:
                            self._run_one(job)
                            if (
                                not isinstance(job, SpanJob) and job[4]
                            ):  # synchronized already: reading its flags waits for nothing
                                self._report(wake)
                    if not len(self._flags):  # no kernel flag to read: reporting costs no sync
                        self._report(wake)
                self._report(wake)  # the batch's one read of the kernels' flags
        finally:
            wake.close(linger=0)

    def _report(self, wake: zmq.Socket) -> None:
        """Read the flags of the kernels launched since the last report (one host sync per device),
        turn a flagged unit's result into its NonFiniteError, hand every result run since to the
        serve loop and wake it."""
        if not self._unreported:
            return
        try:
            errors = self._flags.check()
        except Exception as exc:  # the read itself failed (a faulted kernel): every unit in it fails
            log.exception("reading the kernels' NaN/Inf flags failed")
            errors = {(d.step, d.unit): exc for d in self._unreported}
        for done in self._unreported:
            if done.error is None and not done.skipped:
                done.error = errors.get((done.step, done.unit))
            self.results.put(done)
        self._unreported.clear()
        with contextlib.suppress(zmq.Again):  # a full pipe already holds a pending wake-up
            wake.send(b"", flags=zmq.NOBLOCK)

    def _skipped(self, step: int) -> bool:
        with self._lock:
            return step in self._cancelled

    def _run_spans(self, job: SpanJob) -> None:
        """Copy every span of ``job``, then check the copy; one result for all its units."""
        if self._skipped(job.step):
            now = time.monotonic()
            self._unreported.append(Done(job.step, job.units[0], 0.0, None, True, now, units=job.units))
        else:
            self._unreported.append(run_spans(job.step, job.spans, job.units))

    def _run_one(self, job: tuple | SpanJob) -> None:
        if isinstance(job, SpanJob):
            self._run_spans(job)
            return
        step, unit, inputs, outputs, sync = job[:5]
        copies = job[5] if len(job) > 5 else ()
        skip = self._skipped(step)
        t0 = time.monotonic()
        error = None
        if not skip:
            try:
                # no_grad, not inference_mode: the views are the arenas' cached ones, which the
                # serve loop writes into (handle_shard copying a remote frame into staging)
                with torch.no_grad(), kernels.collecting(self._flags, (step, unit.index)):
                    tensors = inputs
                    if unit.fmt is None:  # copied, then the copy checked (sidecar.daemon.copyout)
                        if not run_passthrough(unit, tensors, outputs):
                            run_unit(unit, tensors, outputs)
                            check_copied(unit, outputs)
                    else:
                        run_unit(unit, tensors, outputs)
                    if sync:
                        _synchronize(tensors)
                    copy_out(copies)
            except Exception as exc:  # reported to the serve loop, which fails the step
                error = exc
                if not isinstance(exc, (ValueError, NonFiniteError)):
                    log.exception("unit %d of step %d failed", unit.index, step)
        self._unreported.append(Done(step, unit.index, time.monotonic() - t0, error, skip, t0))

    def _run_batch(self, run: list) -> bool:
        """Run a batch of one step together: small passthroughs, or CPU quantizations of one format;
        False (nothing reported, maybe some outputs written, which running them one by one redoes)
        when any of them needs the one-by-one path: a NaN, a mismatched buffer, anything unexpected,
        whose error that path then reports against its unit."""
        step = run[0][0]
        if self._skipped(step):
            for _, unit, *_ in run:
                self._unreported.append(Done(step, unit.index, 0.0, None, True, time.monotonic()))
            return True
        t0 = time.monotonic()
        try:
            with torch.no_grad():  # not inference_mode: see _run_one
                units = [job[1] for job in run]
                ins = [job[2] for job in run]
                outs = [job[3] for job in run]
                if units[0].fmt is not None:  # quantizers refuse NaN/Inf in their inputs themselves
                    if not run_quantized_units(units, ins, outs):
                        return False
                # the copies are checked, never staging: a rank may still write there
                elif not run_passthroughs(units, ins, outs) or not all_finite(
                    [t for unit, tensors in zip(units, outs) for t in _outputs_of(unit, tensors)]
                ):
                    return False
        except Exception:  # the one-by-one path reports it, with its unit
            return False
        share = (time.monotonic() - t0) / len(run)
        for k, unit in enumerate(units):
            self._unreported.append(Done(step, unit.index, share, None, False, t0 + k * share))
        return True


def run_spans(
    step: int, spans: list[tuple[Span, torch.Tensor, torch.Tensor]], units: tuple[int, ...] | None = None
) -> Done:
    """Copy every ``(span, staging bytes, generation bytes)`` and check the copy: one result for all their
    units (the first error fails them all: the step fails on it anyway). The worker runs span jobs
    with it, and the serve loop small ones itself."""
    if units is None:
        units = tuple(itertools.chain.from_iterable(span.units for span, _, _ in spans))
    t0 = time.monotonic()
    error = None
    try:
        with torch.no_grad():  # not inference_mode: see QuantWorker._run_one
            for span, src, dst in spans:
                run_span(span, src, dst)
    except Exception as exc:  # reported to the serve loop, which fails the step
        error = exc
        if not isinstance(exc, (ValueError, NonFiniteError)):
            log.exception("a span of %d units of step %d failed", len(units), step)
    return Done(step, units[0], time.monotonic() - t0, error, False, t0, units=units)


def _outputs_of(unit: Unit, tensors: dict) -> list[torch.Tensor]:
    return [tensors[o.name] for o in unit.outputs]
