"""sidecar/numerics/threads.py: the quantizers' worker threads. A call's chunks run on the caller and
the workers, each taken by the next thread free (a slow one takes fewer); a pipelined call is cut once a
thread; a call whose kernel hands out its own units (Claims) runs whole on every thread; an error in any
chunk is raised only once every running chunk has finished (they all write the caller's buffers); and
a second caller (or a share splitting work again) runs its call on its own thread instead of waiting
for workers that are busy."""

from __future__ import annotations

import threading

import pytest
import torch

from sidecar.numerics.threads import CHUNKS_PER_THREAD, MIN_CHUNK_ELEMS, MIN_SPLIT_ELEMS, Claims, Pool

BIG = MIN_SPLIT_ELEMS  # elements a unit: every call of several units splits


@pytest.fixture
def three_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    yield Pool()
    torch.set_num_threads(before)


def test_chunks_cover_the_units_once_on_three_threads(three_threads):
    seen: list[tuple[int, int, int]] = []
    lock = threading.Lock()
    together = threading.Barrier(3, timeout=30)  # each chunk waits for two others: three threads run them

    def share(begin: int, end: int) -> int:
        together.wait()
        with lock:
            seen.append((begin, end, threading.get_ident()))
        return end - begin

    assert three_threads.run(share, 10, BIG) == [3, 4, 3]  # cut at the units nearest 10/3 and 20/3
    assert sorted((b, e) for b, e, _ in seen) == [(0, 3), (3, 7), (7, 10)]
    assert len({t for _, _, t in seen}) == 3
    seen.clear()
    together = threading.Barrier(2, timeout=30)
    assert three_threads.run(share, 2, BIG) == [1, 1]  # fewer units than threads
    assert three_threads.run(lambda b, e: e - b, 5, 1) == [5]  # too little work to split


def test_an_error_is_raised_after_every_running_chunk_finished(three_threads):
    release, finished = threading.Event(), []
    together = threading.Barrier(3, timeout=30)  # all three chunks taken before any goes on

    def share(begin: int, end: int) -> int:
        together.wait()
        if begin == 3:
            raise ValueError("chunk 1 failed")
        if begin == 6:
            assert release.wait(30)
            finished.append(begin)
        else:
            release.set()
        return 0

    with pytest.raises(ValueError, match="chunk 1 failed"):
        three_threads.run(share, 9, BIG)
    assert finished == [6]
    assert three_threads.run(lambda b, e: e - b, 9, BIG) == [3, 3, 3]  # the workers still serve


def test_the_first_chunks_error_waits_for_the_others(three_threads):
    raised, finished = threading.Event(), []
    together = threading.Barrier(3, timeout=30)

    def share(begin: int, end: int) -> int:
        together.wait()
        if begin == 0:
            raised.set()
            raise KeyError("first chunk")
        assert raised.wait(30)
        finished.append(begin)
        return 0

    with pytest.raises(KeyError):
        three_threads.run(share, 9, BIG)
    assert sorted(finished) == [3, 6]


def test_a_slow_thread_takes_fewer_chunks():
    """A thread held up in its chunk (a core another process took) leaves the rest to the others:
    the first chunk does not end until every other chunk has, which halves would never allow."""
    pool, before = Pool(), torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        units = 2 * CHUNKS_PER_THREAD  # a chunk a unit
        others_done, lock, ran = threading.Event(), threading.Lock(), []

        def share(begin: int, end: int) -> int:
            if begin == 0:
                assert others_done.wait(30), "the other thread did not take the remaining chunks"
            with lock:
                ran.append((begin, threading.get_ident()))
                if len(ran) == units - 1 and all(b != 0 for b, _ in ran):
                    others_done.set()
            return end - begin

        assert pool.run(share, units, MIN_CHUNK_ELEMS) == [1] * units
        slow = next(t for b, t in ran if b == 0)
        assert [b for b, t in ran if t == slow] == [0]
        assert sorted(b for b, _ in ran) == list(range(units))
    finally:
        torch.set_num_threads(before)


def test_a_pipelined_call_is_cut_once_a_thread(three_threads):
    """A call whose every share pays a start-up (a scale-group pipeline) is cut into one share a thread,
    however much work it holds; the same call unmarked is cut into chunks."""
    seen: list[tuple[int, int]] = []
    lock = threading.Lock()

    def share(begin: int, end: int) -> int:
        with lock:
            seen.append((begin, end))
        return end - begin

    units, per = 3 * CHUNKS_PER_THREAD, CHUNKS_PER_THREAD
    assert three_threads.run_many([(share, units, MIN_CHUNK_ELEMS, True)]) == [[per, per, per]]
    assert sorted(seen) == [(0, per), (per, 2 * per), (2 * per, 3 * per)]
    seen.clear()
    assert three_threads.run_many([(share, units, MIN_CHUNK_ELEMS)]) == [[1] * units]
    assert sorted(seen) == [(u, u + 1) for u in range(units)]


def test_a_second_caller_runs_its_call_on_its_own_thread(three_threads):
    first_running, second_done = threading.Event(), threading.Event()
    results: list[list[int]] = []

    def first(begin: int, end: int) -> int:
        if begin == 0:
            first_running.set()
            assert second_done.wait(30)
        return end - begin

    caller = threading.Thread(target=lambda: results.append(three_threads.run(first, 9, BIG)))
    caller.start()
    assert first_running.wait(30)
    me, seen = threading.get_ident(), set()
    assert three_threads.run(lambda b, e: seen.add(threading.get_ident()) or e - b, 9, BIG) == [9]
    assert seen == {me}
    second_done.set()
    caller.join(30)
    assert results == [[3, 3, 3]]


def test_a_share_splitting_again_runs_on_its_thread(three_threads):
    def outer(begin: int, end: int) -> int:
        return sum(three_threads.run(lambda b, e: e - b, 8, BIG))

    assert three_threads.run(outer, 9, BIG) == [8, 8, 8]


def test_workers_follow_the_thread_count():
    pool = Pool()
    before = torch.get_num_threads()
    try:
        for n in (2, 4, 1, 3):
            torch.set_num_threads(n)
            threads: set[int] = set()
            together = threading.Barrier(n, timeout=30)  # n chunks, each waiting for the others

            def share(b: int, e: int, seen=threads, together=together) -> int:
                together.wait()
                seen.add(threading.get_ident())
                return 0

            pool.run(share, 16, BIG)
            assert len(threads) == n
    finally:
        torch.set_num_threads(before)


def test_many_calls_split_as_one_by_elements(three_threads):
    """run_many numbers the calls' units one after the other and cuts them into chunks of about even
    elements with one hand-off: each unit runs exactly once, a chunk may span calls, and each call gets
    one result per chunk that ran part of it (an empty call none)."""
    seen: list[tuple[int, int, int]] = []
    lock = threading.Lock()

    def call(c: int):
        def share(begin: int, end: int) -> int:
            with lock:
                seen.append((c, begin, end))
            return end - begin

        return share

    # 24 units of BIG, then an empty call, then 4 units of 3 * BIG and 3 of BIG: 39 * BIG elements
    calls = [(call(0), 24, BIG), (call(1), 0, BIG), (call(2), 4, 3 * BIG), (call(3), 3, BIG)]
    results = three_threads.run_many(calls)
    assert [sum(r) for r in results] == [24, 0, 4, 3]
    assert results[1] == []
    for c, (_, units, _) in enumerate(calls):
        covered = sorted((b, e) for cc, b, e in seen if cc == c)
        assert [u for b, e in covered for u in range(b, e)] == list(range(units)), c
    # 39 * BIG (4.9 Mi elements) in four chunks of at least MIN_CHUNK_ELEMS, cut at the unit starts
    # nearest 9.75, 19.5 and 29.25 BIG: [0, 10), [10, 20), [20, 30) (call 0's 20..24, call 2's 0..2),
    # [30, 39) (call 2's 2..4, call 3)
    assert 39 * BIG // MIN_CHUNK_ELEMS == 4
    assert sorted(seen) == [(0, 0, 10), (0, 10, 20), (0, 20, 24), (2, 0, 2), (2, 2, 4), (3, 0, 3)]


def test_many_small_calls_run_on_the_caller(three_threads):
    """Calls too small to split, however many, run on the caller alone (no hand-off)."""
    me, seen = threading.get_ident(), set()
    calls = [(lambda b, e: seen.add(threading.get_ident()) or e - b, 4, 64) for _ in range(50)]
    assert three_threads.run_many(calls) == [[4]] * 50
    assert seen == {me}
    assert three_threads.run_many([]) == []


def test_a_claiming_call_runs_whole_on_every_thread(three_threads):
    """A call whose kernel hands out its own units (Claims): each of the three threads runs it whole,
    the counter starting at 0 every run, each unit taken once; its results are one a thread. Under a pool
    of one share a thread it is cut into shares instead; beside another call it is refused."""
    claims = Claims()
    lock = threading.Lock()
    taken: list[tuple[int, int]] = []
    together = threading.Barrier(3, timeout=30)

    def fn(begin: int, end: int) -> int:
        if claims.whole:
            assert (begin, end) == (0, 12)
            together.wait()  # all three run it
            while True:
                with lock:
                    unit = claims.counter.value
                    claims.counter.value += 1
                if unit >= end:
                    return threading.get_ident()
                taken.append((unit, threading.get_ident()))
        with lock:
            taken.extend((u, threading.get_ident()) for u in range(begin, end))
        return end - begin

    for _ in range(2):
        claims.counter.value = 99  # whatever a run left: the pool starts it at 0
        taken.clear()
        (results,) = three_threads.run_many([(fn, 12, MIN_CHUNK_ELEMS, claims)])
        assert len(set(results)) == 3 and sorted(u for u, _ in taken) == list(range(12))

    three_threads.chunks_per_thread = 1
    taken.clear()
    assert three_threads.run_many([(fn, 12, MIN_CHUNK_ELEMS, claims)]) == [[4, 4, 4]]
    assert not claims.whole and sorted(u for u, _ in taken) == list(range(12))
    with pytest.raises(ValueError, match="runs alone"):
        three_threads.run_many([(fn, 12, MIN_CHUNK_ELEMS, claims), (fn, 1, 1)])
