"""Streamed refit (issue 23): engines load each layer group while the step is still arriving, and
every engine ends each step on one whole generation.

The daemon runs its real serve loop (in a thread, or as ``refitd serve`` where it is killed); the
engines are two reference engines behind real ``EngineWorker``s in threads. A staging ring makes
groups complete one after another, as a step streams in. After every step, success or failure, each
engine's parameters are compared byte for byte with a reference engine loaded with
``convert(weights(step))`` of the step it must hold: the new one, or the previous one.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from support.daemons import daemon_factory
from support.waiting import wait_until

from adapters.base import RefitReader
from adapters.engine import EngineWorker, LoadResult
from adapters.reference import ReferenceEngine
from sidecar.cli.demo.synthetic import make_hf_config, make_state_dict
from sidecar.client.client import RefitClient
from sidecar.errors import ErrorKind, RefitError
from sidecar.plan.build import RefitSpec
from sidecar.plan.run import convert

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parent.parent
MODEL = dict(num_layers=2, num_experts=4, unaligned=True)
CONFIG = make_hf_config("qwen3_5_moe", **MODEL)
FMT = "block_fp8"
SPEC = RefitSpec(model_type="qwen3_5_moe", fmt=FMT)
LAYER1 = "model.language_model.layers.1.mlp.experts."
REPLY_S = 60.0


def weights(step: int) -> dict[str, torch.Tensor]:
    return make_state_dict("qwen3_5_moe", seed=700 + step, **MODEL)


_EXPECTED: dict[int, ReferenceEngine] = {}


def expected(step: int) -> ReferenceEngine:
    if step not in _EXPECTED:
        engine = ReferenceEngine.from_config(CONFIG, expert_format=FMT)
        engine.load(convert(weights(step), SPEC))
        _EXPECTED[step] = engine
    return _EXPECTED[step]


def differing(engine: ReferenceEngine, step: int) -> list[str]:
    """Engine parameters whose bytes differ from a whole load of ``step`` (empty: it holds exactly that)."""
    want = expected(step).params
    return [
        n
        for n, p in engine.params.items()
        if not torch.equal(p.reshape(-1).view(torch.uint8), want[n].reshape(-1).view(torch.uint8))
    ]


class Engine:
    """A reference engine behind an EngineWorker that streams; records every group load."""

    def __init__(self, endpoint: str, name: str, *, fail_on: int | None = None, streaming=None):
        self.name = name
        self.engine = ReferenceEngine.from_config(CONFIG, expert_format=FMT)
        self.calls: list[tuple[int, int]] = []  # (step of the generation read, tensors) per load_group
        self.took = threading.Event()  # a group of a streamed step was loaded
        self.fail_on = fail_on  # fail the n-th group (0-based) of the first streamed step

        def load_group(gen, names):
            streamed = [c for c in self.calls if c[0] == gen.step]
            if self.fail_on is not None and len(streamed) == self.fail_on:
                self.fail_on = None
                self.calls.append((gen.step, 0))
                raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
            self.engine.load_part({n: gen.tensors[n] for n in names})
            self.calls.append((gen.step, len(names)))
            self.took.set()

        self.worker = EngineWorker(
            endpoint,
            name=name,
            manifest=self.engine.manifest(),
            load=lambda gen: self.engine.load(gen.tensors),
            load_group=load_group,
            streaming=streaming,
            timeout=REPLY_S,
        )

    def streamed_groups(self, step: int) -> int:
        return len([c for c in self.calls if c[0] == step])


@pytest.fixture
def start(tmp_path):
    factory = daemon_factory(tmp_path, hf_config=CONFIG, format=FMT, staging_regions=2, step_timeout_s=60.0)
    yield next(factory)
    next(factory, None)


def waiting_readers(d, count: int) -> None:
    """Until ``count`` readers have a WAIT outstanding (the step is then streamed to them)."""

    def seen():
        try:
            return len([p for p in list(d.daemon.peers.values()) if p.waiting is not None]) >= count
        except RuntimeError:  # the serve loop changed the dict meanwhile: ask again
            return False

    wait_until(f"{count} waiting readers", seen)


def load_step(pool, engines, step: int) -> list:
    return [pool.submit(e.worker.load_next, step, REPLY_S) for e in engines]


def first_step(d, pool, engines, client) -> None:
    """Step 0 is loaded whole (nothing to return to yet); every later step streams."""
    loads = load_step(pool, engines, 0)
    client.push_step(0, weights(0), wait="loaded", timeout=REPLY_S)
    assert all(f.result().ok for f in loads)
    assert all(e.streamed_groups(0) == 0 for e in engines)


def test_streamed_steps_load_group_by_group_and_end_whole(start):
    d = start(world_size=1)
    engines = [Engine(d.endpoint, f"tp{i}") for i in range(2)]
    whole = Engine(d.endpoint, "whole", streaming=False)
    for e in [*engines, whole]:
        e.worker.attach()
    assert engines[0].worker.attach_info.get("stream") == 1 and "stream" not in whole.worker.attach_info
    with ThreadPoolExecutor(3) as pool, RefitClient(d.endpoint, 0, 1) as client:
        first_step(d, pool, [*engines, whole], client)
        for step in (1, 2):
            loads = load_step(pool, [*engines, whole], step)
            waiting_readers(d, 3)
            result = client.push_step(step, weights(step), wait="loaded", timeout=REPLY_S)
            assert sorted(r["worker"] for r in result.loads) == ["tp0", "tp1", "whole"]
            outcomes = [f.result() for f in loads]
            assert all(r.ok and r.step == step and not r.rolled_back for r in outcomes), outcomes
            for e in engines:
                assert e.streamed_groups(step) > 1  # group by group, not one whole load
            assert whole.streamed_groups(step) == 0
            for e in [*engines, whole]:
                assert differing(e.engine, step) == [], e.name
    for e in [*engines, whole]:
        e.worker.detach()


def test_nan_in_a_late_group_rolls_every_engine_back_to_the_last_good_step(start):
    """Step 1 has a NaN in layer 1's experts: the engines took the groups before it, the step fails
    (NON_FINITE, naming both engines as rolled back), and each holds step 0 byte for byte. Step 2
    then streams and publishes."""
    d = start(world_size=1)
    engines = [Engine(d.endpoint, f"tp{i}") for i in range(2)]
    for e in engines:
        e.worker.attach()
    with ThreadPoolExecutor(2) as pool, RefitClient(d.endpoint, 0, 1) as client:
        first_step(d, pool, engines, client)
        bad = weights(1)
        bad[LAYER1 + "gate_up_proj"][1, 0, 0] = float("nan")
        loads = load_step(pool, engines, 1)
        waiting_readers(d, 2)
        with pytest.raises(RefitError) as err:
            client.push_step(1, bad, wait="loaded", timeout=REPLY_S)
        assert err.value.kind is ErrorKind.NON_FINITE
        outcomes: list[LoadResult] = [f.result() for f in loads]
        assert all(r.rolled_back and not r.ok and r.step == 0 for r in outcomes), outcomes
        assert all(e.streamed_groups(1) >= 1 for e in engines)  # they had taken part of step 1
        assert sorted(err.value.rolled_back) == ["tp0", "tp1"]
        assert "reload it from the last good generation: tp0, tp1" in str(err.value)
        for e in engines:
            assert differing(e.engine, 0) == [], e.name
        assert d.status()["last_step"] == 0
        loads = load_step(pool, engines, 2)
        waiting_readers(d, 2)
        client.push_step(2, weights(2), wait="loaded", timeout=REPLY_S)
        assert all(f.result().ok for f in loads)
        for e in engines:
            assert e.streamed_groups(2) > 1 and differing(e.engine, 2) == [], e.name
    for e in engines:
        e.worker.detach()


def _held_rank(endpoint: str, gate: threading.Event, world: int = 2) -> RefitClient:
    """Rank 1 of ``world``: its ring writes wait for ``gate`` (the step cannot seal before)."""
    client = RefitClient(endpoint, 1, world, timeout=REPLY_S)
    own = client._write_ring

    def held(*args, **kwargs):
        gate.wait(REPLY_S)
        return own(*args, **kwargs)

    client._write_ring = held
    return client


def _split(sd: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """Rank 0 sends everything up to layer 1's experts; rank 1 the rest (the last groups)."""
    names = list(sd)
    cut = names.index(LAYER1 + "gate_up_proj")
    return {n: sd[n] for n in names[:cut]}, {n: sd[n] for n in names[cut:]}


def test_an_engine_that_fails_a_group_fails_the_step_and_every_engine_returns(start):
    """tp1 fails the second group it loads of step 1: the daemon fails the step (ENGINE, naming it)
    before it could seal (rank 1 holds its part until then); both engines hold step 0 again."""
    d = start(world_size=2)
    engines = [Engine(d.endpoint, "tp0"), Engine(d.endpoint, "tp1", fail_on=1)]
    for e in engines:
        e.worker.attach()
    gate = threading.Event()
    with ThreadPoolExecutor(4) as pool, RefitClient(d.endpoint, 0, 2) as rank0:
        rank1 = _held_rank(d.endpoint, gate)
        try:
            loads = load_step(pool, engines, 0)
            gate.set()
            halves = _split(weights(0))
            pushes = [pool.submit(c.push_step, 0, h, timeout=REPLY_S) for c, h in zip((rank0, rank1), halves)]
            assert [p.result().step for p in pushes] == [0, 0] and all(f.result().ok for f in loads)
            gate.clear()
            loads = load_step(pool, engines, 1)
            waiting_readers(d, 2)
            halves = _split(weights(1))
            pushes = [pool.submit(c.push_step, 1, h, timeout=REPLY_S) for c, h in zip((rank0, rank1), halves)]
            failed = loads[1].result()  # tp1 failed its group, told the daemon, rolled back
            assert failed.rolled_back and "illegal memory access" in failed.error
            d.barrier()
            gate.set()
            for p in pushes:
                with pytest.raises(RefitError) as err:
                    p.result()
                assert err.value.kind is ErrorKind.ENGINE and "tp1" in str(err.value)
                assert "tp1" in err.value.rolled_back
            assert loads[0].result().rolled_back
            for e in engines:
                assert differing(e.engine, 0) == [], e.name
        finally:
            gate.set()
            rank1.close()
    for e in engines:
        e.worker.detach()


def _dying_rank(endpoint: str, names: list[str], conn) -> None:
    """Rank 1 in a child process: begins step 1 and is SIGKILLed where it would write its data."""
    import os

    torch.set_num_threads(1)
    client = RefitClient(endpoint, 1, 2, timeout=REPLY_S)
    sd = weights(1)

    def die(*args, **kwargs):
        conn.send("dying")
        os.kill(os.getpid(), signal.SIGKILL)

    client._write_ring = die
    client.push_step(1, {n: sd[n] for n in names}, timeout=REPLY_S)


def test_a_rank_killed_mid_step_rolls_the_engines_back(start):
    d = start(world_size=2, rank_timeout_s=2.0)
    engines = [Engine(d.endpoint, f"tp{i}") for i in range(2)]
    for e in engines:
        e.worker.attach()
    gate = threading.Event()
    gate.set()
    with ThreadPoolExecutor(4) as pool, RefitClient(d.endpoint, 0, 2) as rank0:
        rank1 = _held_rank(d.endpoint, gate)
        loads = load_step(pool, engines, 0)
        halves = _split(weights(0))
        pushes = [pool.submit(c.push_step, 0, h, timeout=REPLY_S) for c, h in zip((rank0, rank1), halves)]
        assert all(p.result().step == 0 for p in pushes) and all(f.result().ok for f in loads)
        rank1.close()
        loads = load_step(pool, engines, 1)
        waiting_readers(d, 2)
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_dying_rank, args=(d.endpoint, list(_split(weights(1))[1]), child))
        proc.start()
        try:
            with pytest.raises(RefitError) as err:
                rank0.push_step(1, _split(weights(1))[0], timeout=REPLY_S)
            assert err.value.kind is ErrorKind.RANK_DIED
            assert parent.poll(REPLY_S) and parent.recv() == "dying"
        finally:
            proc.join(timeout=30)
        outcomes = [f.result() for f in loads]
        assert all(r.rolled_back and r.step == 0 for r in outcomes), outcomes
        assert all(e.streamed_groups(1) >= 1 for e in engines)
        assert sorted(err.value.rolled_back) == ["tp0", "tp1"]
        for e in engines:
            assert differing(e.engine, 0) == [], e.name
    for e in engines:
        e.worker.detach()


class Serve:
    """``refitd serve`` in a subprocess (killed with SIGKILL by the test)."""

    def __init__(self, tmp_path: Path):
        config = tmp_path / "config.json"
        config.write_text(json.dumps(CONFIG))
        run = tmp_path / "run"
        self.endpoint = f"ipc://{run / 'control.sock'}"
        argv = [
            sys.executable, "-m", "sidecar.cli", "serve", "--runtime-dir", str(run), "--hf-config", str(config),
            "--world-size", "2", "--format", FMT, "--heartbeat-interval", "0.2", "--rank-timeout", "60",
            "--reader-timeout", "2", "--step-timeout", "120", "--staging-regions", "2",
        ]  # fmt: skip
        self.log = tmp_path / "serve.log"
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        with RefitReader(self.endpoint, name="readiness") as probe:

            def ready():
                if self.proc.poll() is not None:
                    raise AssertionError(f"refitd serve exited:\n{self.log.read_text()}")
                try:
                    return probe.status(timeout=0.5)
                except RefitError:
                    return None

            wait_until("refitd serve answering", ready, timeout=90)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)


def test_the_daemon_killed_mid_step_leaves_every_engine_on_the_last_good_step(tmp_path):
    serve = Serve(tmp_path)
    try:
        engines = [Engine(serve.endpoint, f"tp{i}") for i in range(2)]
        for e in engines:
            e.worker.attach()
        gate = threading.Event()
        gate.set()
        with ThreadPoolExecutor(4) as pool, RefitClient(serve.endpoint, 0, 2, timeout=REPLY_S) as rank0:
            rank1 = _held_rank(serve.endpoint, gate)
            loads = load_step(pool, engines, 0)
            halves = _split(weights(0))
            pushes = [pool.submit(c.push_step, 0, h, timeout=REPLY_S) for c, h in zip((rank0, rank1), halves)]
            assert all(p.result().step == 0 for p in pushes) and all(f.result().ok for f in loads)
            gate.clear()  # rank 1 holds its part of step 1: the step cannot seal
            loads = load_step(pool, engines, 1)
            halves = _split(weights(1))
            pushes = [pool.submit(c.push_step, 1, h, timeout=20) for c, h in zip((rank0, rank1), halves)]
            for e in engines:
                assert e.took.wait(REPLY_S), f"{e.name} took no group of step 1"
            serve.kill()
            outcomes = [f.result() for f in loads]  # each notices the silence, returns to step 0
            assert all(r.rolled_back and r.step == 0 for r in outcomes), outcomes
            assert all("went silent" in r.error or "said nothing" in r.error for r in outcomes)
            for e in engines:
                assert e.streamed_groups(1) >= 1 and differing(e.engine, 0) == [], e.name
            gate.set()
            for p in pushes:
                with pytest.raises(RefitError):
                    p.result()
            rank1.close()
        for e in engines:
            e.worker.detach()
    finally:
        serve.kill()


def test_an_engine_that_waits_after_the_step_began_joins_it_with_the_groups_already_written(start):
    """The engines WAIT only once groups of step 1 were written (rank 1 holds its part meanwhile):
    the daemon streams them the groups already readable at once, then the rest; both end on step 1."""
    d = start(world_size=2)
    engines = [Engine(d.endpoint, f"tp{i}") for i in range(2)]
    for e in engines:
        e.worker.attach()
    gate = threading.Event()
    gate.set()
    with ThreadPoolExecutor(4) as pool, RefitClient(d.endpoint, 0, 2) as rank0:
        rank1 = _held_rank(d.endpoint, gate)
        try:
            loads = load_step(pool, engines, 0)
            halves = _split(weights(0))
            pushes = [pool.submit(c.push_step, 0, h, timeout=REPLY_S) for c, h in zip((rank0, rank1), halves)]
            assert all(p.result().step == 0 for p in pushes) and all(f.result().ok for f in loads)
            gate.clear()
            halves = _split(weights(1))
            pushes = [pool.submit(c.push_step, 1, h, timeout=REPLY_S) for c, h in zip((rank0, rank1), halves)]

            def written():
                stream = d.daemon.streams.current
                return stream is not None and stream.step == 1 and len(stream.ready) >= 2

            wait_until("groups of step 1 written", written)
            loads = load_step(pool, engines, 1)
            for e in engines:
                assert e.took.wait(REPLY_S), f"{e.name} was not streamed the groups already written"
            gate.set()
            assert all(p.result().step == 1 for p in pushes)
            assert all(f.result().ok and not f.result().rolled_back for f in loads)
            for e in engines:
                assert e.streamed_groups(1) >= 2 and differing(e.engine, 1) == [], e.name
        finally:
            gate.set()
            rank1.close()
    for e in engines:
        e.worker.detach()
