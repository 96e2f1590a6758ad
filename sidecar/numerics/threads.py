"""The CPU quantizers' threads: a call's shares run on persistent worker threads and the caller.

The native kernels drop the GIL (ctypes), so a call split into ``torch.get_num_threads()`` shares runs
on that many cores. The daemon makes many such calls per step (one per expert projection, a few
hundred thousand to a few million elements each), so the hand-off matters: each worker waits on a
plain lock of its own and answers on another (two lock releases and two wake-ups per share), measured
about half of a ``ThreadPoolExecutor``'s queue and futures per call (15 vs 21-47 us, the pool's
median, on the 2-core CI machine).

A call is cut into chunks of about even elements, more than there are threads, and each thread takes
the next chunk as it finishes one: a core that runs slower (another process on it, a busy neighbour on a
shared host) takes fewer chunks instead of holding the call until its fixed half is done.
A call whose every start costs (a scale-group pipeline reads its first group's amax with nothing to
overlap it) takes its units itself instead (:class:`Claims`): every thread runs the whole call, and the
kernel hands its units out one at a time from a counter the threads share, so a thread's pipeline runs
on across the units it takes. A pipelined call without one (a build of an older tree) is cut into one
share a thread.

A second caller arriving while the workers run another call's shares runs its own call on its own
thread (the cores are busy with the first call anyway); a share that itself splits work does the same,
so nothing ever waits on a worker that waits on it.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
from collections.abc import Callable, Sequence

import torch

__all__ = ["CHUNKS_PER_THREAD", "MIN_CHUNK_ELEMS", "MIN_SPLIT_ELEMS", "Call", "Claims", "Pool"]

#: elements of work per thread below which a call is not split (a thread hand-off costs ~15 us,
#: about what a kernel needs for 64 Ki elements)
MIN_SPLIT_ELEMS = 1 << 17
#: chunks a thread of a split call (at most). bench/pool.py, 2 threads on the 2-core CI machine, 32
#: experts' slab units, row kernels, five runs: with the worker's core shared with a busy process, 4 a
#: thread ran 0.87-1.36x as fast as halves (median 1.11x); on two free cores 0.94-1.00x (median 0.975x:
#: each chunk costs a ctypes call, a few us of Python under the GIL, and its streams' start). 8 a
#: thread lost 4-6% on free cores.
CHUNKS_PER_THREAD = 4
#: elements a chunk takes at least (about 0.2 ms of a kernel on one core)
MIN_CHUNK_ELEMS = 1 << 20

#: ``(fn, units, elems_per_unit)``, or with a fourth field: a :class:`Claims` (the call's kernel takes
#: its units itself), or True for a call whose every share pays a start-up, cut into one share a thread
Call = tuple


class Claims:
    """The counter a call's kernel takes its units from (native/common.h's run_groups with ``claim``):
    every thread runs the call's ``fn(0, units)`` and the kernel hands each unit to one of them. The
    pool sets it to 0 before the threads start, and ``whole``: True where the threads run the call whole
    (``fn`` then passes :attr:`ref` to the kernel), False where the pool cuts it into one share a thread
    instead (a pool of ``chunks_per_thread`` 1: bench/pool.py's halves)."""

    __slots__ = ("counter", "ref", "whole")

    def __init__(self) -> None:
        self.counter = ctypes.c_int64(0)
        self.ref = ctypes.byref(self.counter)
        self.whole = True


class _Worker:
    """One persistent daemon thread running one share at a time, handed over through two locks."""

    def __init__(self, name: str) -> None:
        self._go = threading.Lock()
        self._go.acquire()
        self._done = threading.Lock()
        self._done.acquire()
        self._job: Callable[[], int] | None = None
        self._result = 0
        self._error: BaseException | None = None
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def _loop(self) -> None:
        while True:
            self._go.acquire()
            job = self._job
            if job is None:  # stop()
                return
            try:
                self._result, self._error = job(), None
            except BaseException as err:  # handed to the caller, which raises it
                self._result, self._error = 0, err
            self._done.release()

    def start(self, job: Callable[[], int]) -> None:
        self._job = job
        self._go.release()

    def wait(self) -> tuple[int, BaseException | None]:
        """The share's result, or the error it raised; returns once the share is done."""
        self._done.acquire()
        self._job = None
        return self._result, self._error

    def stop(self) -> None:
        self._job = None
        self._go.release()


class Pool:
    """Runs a call's shares: all but the first on persistent worker threads, the first on the caller.

    Sized by ``torch.get_num_threads()`` at each call (the workers are replaced when that changes, and
    in a forked child, which inherits the pool but not its threads). ``chunks_per_thread``: chunks a
    thread, at most (1: one even share a thread, as a pipelined call; bench/pool.py compares).
    """

    def __init__(self, chunks_per_thread: int = CHUNKS_PER_THREAD) -> None:
        self.chunks_per_thread = chunks_per_thread
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Lock()  # guards the worker list
        self._busy = threading.Lock()  # held while a call's shares run on the workers
        self._workers: list[_Worker] = []
        self._pid = os.getpid()

    def threads(self) -> int:
        return max(1, torch.get_num_threads())

    def _get(self, workers: int) -> list[_Worker]:
        """The workers, ``workers`` of them (started or replaced as needed)."""
        if self._pid != os.getpid():  # a forked child: the parent's threads (and lock holders) are gone
            self._reset()
        with self._lock:
            if len(self._workers) != workers:
                for old in self._workers:
                    old.stop()
                self._workers = [_Worker(f"refitd-quant-{i}") for i in range(workers)]
            return self._workers

    def run(self, fn: Callable[[int, int], int], units: int, elems_per_unit: int) -> list[int]:
        """``fn(begin, end)`` over ``[0, units)`` in chunks the threads take (:meth:`run_many`); their
        results, in order. An error raised by any chunk is raised here, once every thread has stopped
        (they write the caller's buffers)."""
        return self.run_many([(fn, units, elems_per_unit)])[0]

    def run_many(self, calls: Sequence[Call]) -> list[list[int]]:
        """Several calls ``(fn, units, elems_per_unit[, split])`` as one: their units numbered one
        after the other and cut into chunks of about even elements (one hand-off to the workers for all
        of them: a slab's hundreds of expert projections), which the threads take one after another
        until none is left; where any call's ``split`` is True (pipelined), one even share a thread. A
        call whose ``split`` is a :class:`Claims` runs alone, whole on every thread: its results, one a
        thread. A chunk runs ``fn(begin, end)`` for each call it covers part of; the results, a list a
        call (one per chunk that ran part of it, in order; empty for a call of no units). An error
        raised by any chunk is raised here, once every thread has stopped (no thread takes a chunk
        after it; they write the caller's buffers)."""
        claims = [c[3] for c in calls if len(c) > 3 and isinstance(c[3], Claims)]
        if claims:
            if len(calls) != 1:
                raise ValueError("a call whose kernel takes its own units (Claims) runs alone in run_many")
            claims[0].counter.value = 0
            claims[0].whole = self.chunks_per_thread > 1
        sizes = [c[1] * c[2] for c in calls]
        total = sum(sizes)
        units = sum(c[1] for c in calls)
        threads = self.threads()
        parts = min(threads, max(1, total // MIN_SPLIT_ELEMS), units)
        if parts > 1:
            workers = self._get(threads - 1)
            if not self._busy.acquire(blocking=False):  # another call (or this call's caller) has them
                parts = 1
        results: list[list[int]] = [[] for _ in calls]
        if parts <= 1:
            self._share(calls, results, (0, 0), (len(calls), 0))
            return results
        try:
            if claims and claims[0].whole:  # every thread runs it whole: the kernel hands out the units
                fn, units = calls[0][0], calls[0][1]
                return [_on_threads(workers[: parts - 1], lambda: fn(0, units))]
            per_thread = 1 if any(len(c) > 3 and c[3] for c in calls) else self.chunks_per_thread
            starts = _chunk_starts(total, units, parts, per_thread)
            chunks = len(starts)
            cuts = [_position(calls, sizes, start) for start in starts] + [(len(calls), 0)]
            pieces: list[list[list[int]]] = [[[] for _ in calls] for _ in range(chunks)]
            taken = itertools.count()  # next() on it is atomic: each chunk goes to one thread
            failed: list[bool] = []

            def take() -> int:
                while True:
                    i = next(taken)
                    if i >= chunks or failed:
                        return 0
                    try:
                        self._share(calls, pieces[i], cuts[i], cuts[i + 1])
                    except BaseException:
                        failed.append(True)
                        raise

            _on_threads(workers[: parts - 1], take)
            for piece in pieces:
                for mine, part in zip(results, piece):
                    mine.extend(part)
            return results
        finally:
            self._busy.release()

    @staticmethod
    def _share(calls, results: list[list[int]], begin: tuple[int, int], end: tuple[int, int]) -> int:
        """Run the calls' units from position ``begin`` to ``end`` (each ``(call, unit)``), appending each
        call's result to ``results``."""
        for c in range(begin[0], min(end[0] + 1, len(calls))):
            fn, units = calls[c][0], calls[c][1]
            b = begin[1] if c == begin[0] else 0
            e = end[1] if c == end[0] else units
            if b < e:
                results[c].append(fn(b, e))
        return 0


def _on_threads(started: list[_Worker], work: Callable[[], int]) -> list[int]:
    """``work()`` on the caller and on each of ``started`` at once: each thread's result (the caller's
    first); the first error any raised, once every thread has stopped."""
    for worker in started:
        worker.start(work)
    try:
        mine = work()
    finally:
        done = [worker.wait() for worker in started]
    for _, err in done:
        if err is not None:
            raise err
    return [mine] + [result for result, _ in done]


def _chunk_starts(total: int, units: int, parts: int, per_thread: int) -> list[int]:
    """Where a call of ``total`` elements in ``units`` units, split ``parts`` ways, is cut: into
    ``parts * per_thread`` chunks of about even elements (fewer where they would fall under
    MIN_CHUNK_ELEMS or outnumber the units, never fewer than ``parts``)."""
    chunks = max(parts, min(parts * per_thread, total // MIN_CHUNK_ELEMS, units))
    return [total * i // chunks for i in range(chunks)]


def _position(calls, sizes: list[int], elem: int) -> tuple[int, int]:
    """The (call, unit) at which the ``elem``-th element of the calls numbered one after the other
    lies in, rounded to the nearest unit start."""
    for c, size in enumerate(sizes):
        if elem < size:
            per = calls[c][2]
            unit = (elem + per // 2) // per
            return (c, unit) if unit < calls[c][1] else (c + 1, 0)
        elem -= size
    return len(calls), 0
