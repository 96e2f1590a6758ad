"""Streamed refit ends every step on one whole generation, whatever ends an engine's load (issue 31).

A real daemon (its serve loop in a thread), reference engines behind real ``EngineWorker``s; each
engine's parameters are compared byte for byte with a whole load of ``convert(weights(step))``
(tests/test_streamed.py's ``differing``):

* a load interrupted by a ``BaseException`` (KeyboardInterrupt in the engine's copy) after it took
  groups of a step is re-raised, and the worker then claims no step: the daemon streams nothing on
  top of the mix, and the next step is loaded whole;
* the documented recovery from a failed rollback ("load a whole generation (load_next) before
  serving") works the first time: a STREAM the daemon sent for the worker's earlier, given-up WAIT
  (a step below the one now asked for) is never loaded.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from support.daemons import daemon_factory

from adapters.engine import EngineWorker
from adapters.reference import ReferenceEngine
from sidecar.client.client import RefitClient
from sidecar.errors import ErrorKind, RefitError
from tests.test_streamed import CONFIG, FMT, LAYER1, REPLY_S, differing, waiting_readers, weights

pytestmark = pytest.mark.timeout(180)


class Engine:
    """A reference engine behind a streaming EngineWorker; ``hook(gen, call)`` runs before each group
    load (``call``: how many group loads of that step came before) and may raise."""

    def __init__(self, endpoint: str, name: str):
        self.engine = ReferenceEngine.from_config(CONFIG, expert_format=FMT)
        self.calls: list[int] = []  # the step of every group load that reached the engine
        self.hook = None
        self.lock = threading.Lock()

        def load_group(gen, names):
            hook = self.hook
            if hook is not None:
                hook(gen, self.calls.count(gen.step))
            self.engine.load_part({n: gen.tensors[n] for n in names})
            self.calls.append(gen.step)

        self.worker = EngineWorker(
            endpoint,
            name=name,
            manifest=self.engine.manifest(),
            load=lambda gen: self.engine.load(gen.tensors),
            load_group=load_group,
            timeout=REPLY_S,
        )


@pytest.fixture
def start(tmp_path):
    factory = daemon_factory(tmp_path, hf_config=CONFIG, format=FMT, staging_regions=2, step_timeout_s=60.0)
    yield next(factory)
    next(factory, None)


def _first_step(pool, e: Engine, client: RefitClient) -> None:
    load = pool.submit(e.worker.load_next, 0, REPLY_S)
    client.push_step(0, weights(0), wait="loaded", timeout=REPLY_S)
    assert load.result().ok and e.worker.loaded_step() == 0


def test_an_interrupted_streamed_load_leaves_a_worker_the_daemon_streams_nothing_to(start):
    d = start(world_size=1)
    e = Engine(d.endpoint, "tp0")
    e.worker.attach()
    with ThreadPoolExecutor(2) as pool, RefitClient(d.endpoint, 0, 1) as client:
        _first_step(pool, e, client)

        def interrupt(gen, call):
            if gen.step == 1 and call == 2:  # after it took 2 groups of step 1, in the third
                raise KeyboardInterrupt

        e.hook = interrupt
        load = pool.submit(e.worker.load_next, 1, REPLY_S)
        waiting_readers(d, 1)
        client.push_step(1, weights(1), timeout=REPLY_S)
        with pytest.raises(KeyboardInterrupt):  # re-raised, not swallowed
            load.result()
        e.hook = None
        assert e.calls.count(1) == 2  # its parameters are a mix of steps 0 and 1
        assert e.worker.loaded_step() is None  # and it says it holds no one step
        # step 2 fails in the daemon (a NaN in a late group): streamed on top of the mix, the old
        # worker "rolled back" the groups it took from step 2 and ended on a torn engine saying step 0
        bad = weights(2)
        bad[LAYER1 + "gate_up_proj"][1, 0, 0] = float("nan")
        load = pool.submit(e.worker.load_next, 2, REPLY_S)
        waiting_readers(d, 1)
        with pytest.raises(RefitError) as err:
            client.push_step(2, bad, timeout=REPLY_S)
        assert err.value.kind is ErrorKind.NON_FINITE
        assert e.calls.count(2) == 0  # nothing of step 2 was streamed into it
        client.push_step(3, weights(3), timeout=REPLY_S)
        result = load.result()  # the wait for >= 2 is answered whole by step 3
        assert result.ok and result.step == 3 and not result.rolled_back, result
        assert e.calls.count(3) == 0 and differing(e.engine, 3) == []
        assert e.worker.loaded_step() == 3
        load = pool.submit(e.worker.load_next, 4, REPLY_S)  # and it streams again on top of it
        waiting_readers(d, 1)
        client.push_step(4, weights(4), timeout=REPLY_S)
        result = load.result()
        assert result.ok and result.step == 4 and e.calls.count(4) > 1 and differing(e.engine, 4) == []
    e.worker.detach()


def test_the_documented_recovery_from_a_failed_rollback_works_the_first_time(start):
    """The engine fails a group of step 1, and its rollback fails too: the mix error. While that
    load's WAIT (``loaded=0``) was still outstanding the daemon streams it step 2; the recovery
    ``load_next(min_step=4)`` must not load that queued STREAM, and ends whole on step 4."""
    d = start(world_size=1)
    e = Engine(d.endpoint, "tp0")
    e.worker.attach()
    with ThreadPoolExecutor(2) as pool, RefitClient(d.endpoint, 0, 1) as client:
        _first_step(pool, e, client)
        broken = threading.Event()

        def fail(gen, call):
            if not broken.is_set() and (gen.step == 0 or call == 1):  # a group of step 1, then the rollback
                if gen.step == 0:
                    broken.set()
                raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")

        e.hook = fail
        load = pool.submit(e.worker.load_next, 1, REPLY_S)
        waiting_readers(d, 1)
        push = pool.submit(client.push_step, 1, weights(1), timeout=REPLY_S)
        with pytest.raises(RefitError, match="a mix of two steps"):
            load.result()
        assert broken.is_set() and e.worker.loaded_step() is None
        with pytest.raises(RefitError):
            push.result()  # the engine's failure failed the step
        e.hook = None
        before = len(e.calls)
        for step in (2, 3, 4):  # step 2 is streamed to the WAIT the failed load left behind
            client.push_step(step, weights(step), timeout=REPLY_S)
        result = e.worker.load_next(min_step=4, timeout=REPLY_S)  # the recovery, once
        assert result.ok and result.step == 4 and not result.rolled_back, result
        assert e.calls[before:] == []  # nothing streamed: step 4 loaded whole, step 2 never
        assert differing(e.engine, 4) == [] and e.worker.loaded_step() == 4
    e.worker.detach()
