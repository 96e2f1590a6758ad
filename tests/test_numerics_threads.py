"""sidecar/numerics/threads.py: the quantizers' worker threads. A call's shares run on the caller and
the workers, an error in any share is raised only once every share has finished (they all write the
caller's buffers), and a second caller (or a share splitting work again) runs its call on its own thread
instead of waiting for workers that are busy."""

from __future__ import annotations

import threading

import pytest
import torch

from sidecar.numerics.threads import MIN_SPLIT_ELEMS, Pool

BIG = MIN_SPLIT_ELEMS  # elements a unit: every call of several units splits


@pytest.fixture
def three_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    yield Pool()
    torch.set_num_threads(before)


def test_shares_cover_the_units_once_on_three_threads(three_threads):
    seen: list[tuple[int, int, int]] = []
    lock = threading.Lock()

    def share(begin: int, end: int) -> int:
        with lock:
            seen.append((begin, end, threading.get_ident()))
        return end - begin

    assert three_threads.run(share, 10, BIG) == [3, 4, 3]  # cut at the units nearest 10/3 and 20/3
    assert sorted((b, e) for b, e, _ in seen) == [(0, 3), (3, 7), (7, 10)]
    assert len({t for _, _, t in seen}) == 3
    seen.clear()
    assert three_threads.run(share, 2, BIG) == [1, 1]  # fewer units than threads
    assert three_threads.run(share, 5, 1) == [5]  # too little work to split


def test_a_workers_error_is_raised_after_every_share_finished(three_threads):
    release, finished = threading.Event(), []

    def share(begin: int, end: int) -> int:
        if begin == 3:
            raise ValueError("share 1 failed")
        if begin == 6:
            assert release.wait(30)
            finished.append(begin)
        else:
            release.set()
        return 0

    with pytest.raises(ValueError, match="share 1 failed"):
        three_threads.run(share, 9, BIG)
    assert finished == [6]
    assert three_threads.run(lambda b, e: e - b, 9, BIG) == [3, 3, 3]  # the workers still serve


def test_the_callers_error_waits_for_the_workers(three_threads):
    raised, finished = threading.Event(), []

    def share(begin: int, end: int) -> int:
        if begin == 0:
            raised.set()
            raise KeyError("caller's share")
        assert raised.wait(30)
        finished.append(begin)
        return 0

    with pytest.raises(KeyError):
        three_threads.run(share, 9, BIG)
    assert sorted(finished) == [3, 6]


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
            threads = set()
            pool.run(lambda b, e, seen=threads: seen.add(threading.get_ident()) or 0, 16, BIG)
            assert len(threads) == n
    finally:
        torch.set_num_threads(before)


def test_many_calls_split_as_one_by_elements(three_threads):
    """run_many numbers the calls' units one after the other and splits them in about even elements
    with one hand-off: each unit runs exactly once, on one of three threads, and each call gets one
    result per share that ran part of it (an empty call none)."""
    seen: list[tuple[int, int, int, int]] = []
    lock = threading.Lock()

    def call(c: int):
        def share(begin: int, end: int) -> int:
            with lock:
                seen.append((c, begin, end, threading.get_ident()))
            return end - begin

        return share

    # 24 units of BIG, then an empty call, then 4 units of 3 * BIG and 3 of BIG: 39 * BIG elements
    calls = [(call(0), 24, BIG), (call(1), 0, BIG), (call(2), 4, 3 * BIG), (call(3), 3, BIG)]
    results = three_threads.run_many(calls)
    assert [sum(r) for r in results] == [24, 0, 4, 3]
    assert results[1] == []
    for c, (_, units, _) in enumerate(calls):
        covered = sorted((b, e) for cc, b, e, _ in seen if cc == c)
        assert [u for b, e in covered for u in range(b, e)] == list(range(units)), c
    by_thread: dict[int, int] = {}
    for c, b, e, t in seen:
        by_thread[t] = by_thread.get(t, 0) + (e - b) * calls[c][2] // BIG
    assert len(by_thread) == 3
    # 39 * BIG in three shares cut at the unit starts nearest 13 and 26: [0, 13), [13, 27), [27, 39)
    assert sorted(by_thread.values()) == [12, 13, 14]


def test_many_small_calls_run_on_the_caller(three_threads):
    """Calls too small to split, however many, run on the caller alone (no hand-off)."""
    me, seen = threading.get_ident(), set()
    calls = [(lambda b, e: seen.add(threading.get_ident()) or e - b, 4, 64) for _ in range(50)]
    assert three_threads.run_many(calls) == [[4]] * 50
    assert seen == {me}
    assert three_threads.run_many([]) == []
