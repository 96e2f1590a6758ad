"""Never torn (issue 11): a live reader whose hold the daemon revoked is told, never left with a
silently torn copy.

The daemon drops a reader's hold on a generation after ``reader_timeout_s`` (a stuck engine must not
block training) and may then write a newer step into it while a slow but live reader still copies
out of it. Each generation has an epoch in a read-only shared page, bumped when a step claims the
generation and before any byte is written; the reader compares it with the epoch it was handed
(``Generation.intact()``), ``release`` raises ``HoldRevoked``, and an ``EngineWorker`` acknowledges
``ok=False`` and raises instead of serving the copy.

The daemon runs its real serve loop in a thread of the test process; trainers and readers are the
real ``RefitClient``, ``RefitReader`` and ``EngineWorker``. ``reader_timeout_s`` is 2 s, so a
revocation costs about two seconds.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import torch
from support.daemons import RunningDaemon, daemon_factory
from support.net import free_port
from support.waiting import wait_until

from adapters.base import Generation, RefitReader
from adapters.engine import EngineWorker
from sidecar.cli.demo.synthetic import make_hf_config, make_state_dict
from sidecar.client.client import RefitClient
from sidecar.daemon.memory.generations import Arenas
from sidecar.errors import ErrorKind, HoldRevoked
from sidecar.ops.metrics import MetricsObserver
from sidecar.plan.build import RefitSpec
from sidecar.plan.run import convert
from sidecar.protocol.manifest import Manifest
from transport.curve import write_keypair
from transport.epochs import EpochView
from transport.shm import SHM_DIR

MODEL = dict(num_layers=2, num_experts=2)
CONFIG = make_hf_config("qwen3_5_moe", **MODEL)
SPEC = RefitSpec(model_type="qwen3_5_moe", fmt="block_fp8")
REPLY_S = 20.0  # a deadline for any answer: one that never comes fails the test, it does not hang
READER_TIMEOUT_S = 2.0  # readers ping every 0.2 s: a loaded machine can delay several before one expires


@pytest.fixture
def start(tmp_path):
    factory = daemon_factory(
        tmp_path, hf_config=CONFIG, world_size=1, step_timeout_s=30.0, reader_timeout_s=READER_TIMEOUT_S
    )
    yield next(factory)
    next(factory, None)


def weights(seed: int) -> dict[str, torch.Tensor]:
    return make_state_dict("qwen3_5_moe", seed=seed, **MODEL)


def push(endpoint: str, step: int, seed: int | None = None):
    with RefitClient(endpoint, 0, 1, timeout=REPLY_S) as client:
        return client.push_step(step, weights(step if seed is None else seed))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def copy_out(gen: Generation) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in gen.tensors.items()}


def exact(copy: dict[str, torch.Tensor], step: int) -> bool:
    """Whether ``copy`` holds step ``step``'s quantized weights byte for byte."""
    expected = convert(weights(step), SPEC)
    return set(copy) == set(expected) and all(
        torch.equal(_bytes(copy[n]), _bytes(expected[n])) for n in expected
    )


def wait_for(predicate, what: str, timeout: float = REPLY_S):
    """``predicate()``'s first truthy value within ``timeout`` (support.waiting.wait_until)."""
    return wait_until(what, predicate, timeout=timeout, interval=0.02)


def held_then_overwritten(d, reader: RefitReader) -> Generation:
    """Step 1 handed to ``reader`` and kept; step 2 goes into the other generation; step 3 must be
    written into the held one: the daemon waits reader_timeout_s, drops the hold and writes it."""
    push(d.endpoint, 1)
    gen = reader.wait(min_step=1)
    push(d.endpoint, 2)
    assert gen.intact(), "nothing was written into the held generation yet"
    assert push(d.endpoint, 3).generation == gen.index
    return gen


# ----------------------------------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_a_reader_that_releases_in_time_keeps_an_intact_generation(start):
    """A reader copies step 1 out and releases it before any step needs the generation: ``intact()``
    is True, the copy is exact and ``release`` does not raise; the steps that follow reuse the
    generation without revoking anything."""
    d = start()
    push(d.endpoint, 1)
    with RefitReader(d.endpoint, name="prompt-engine", timeout=REPLY_S) as reader:
        gen = reader.wait(min_step=1)
        copy = copy_out(gen)
        assert gen.epoch is not None and gen.intact()
        reader.release(gen)
        assert exact(copy, 1)
        push(d.endpoint, 2)
        push(d.endpoint, 3)
        again = reader.wait(min_step=3)
        assert again.index == gen.index and again.intact() and exact(copy_out(again), 3)
        reader.release(again)
    assert d.status()["revoked_holds"] == 0


@pytest.mark.timeout(90)
def test_a_hold_past_reader_timeout_is_revoked_intact_is_false_and_release_raises(start, caplog):
    """A live reader keeps step 1's generation past reader_timeout_s while the trainer pushes until
    step 3 is written into it. The overwrite is real (the reader's views now show step 3), and the
    reader is not left to copy it silently: the daemon says REVOKED, ``intact()`` is False,
    ``status`` counts the revoked hold, and ``release`` sends the RELEASE and then raises
    HoldRevoked naming the generation, the step and reader_timeout_s. The reader goes on: it waits
    for step 3 and loads it intact."""
    caplog.set_level(logging.DEBUG, logger="refitd.daemon")
    d = start()
    metrics = MetricsObserver("127.0.0.1:0")
    d.daemon.observers.append(metrics)  # before any step: the serve loop notifies it from then on
    try:
        with RefitReader(d.endpoint, name="slow-engine", timeout=REPLY_S) as reader:
            _revoked_and_reported(d, reader, caplog)
        assert metrics.registry.get_sample_value("refitd_holds_revoked_total") == 1
    finally:
        metrics.close()


def _revoked_and_reported(d, reader: RefitReader, caplog) -> None:
    """The body of the test above, with ``reader`` holding step 1 until step 3 overwrites it."""
    gen = held_then_overwritten(d, reader)
    assert not gen.intact()
    assert exact(copy_out(gen), 3), "the held views were overwritten by step 3: a copy now would be torn"
    wait_for(lambda: gen.revoked, "the daemon tells the reader it revoked the hold (REVOKED)")
    status = d.status()
    assert status["revoked_holds"] == 1 and "slow-engine" in status["readers"], status
    with pytest.raises(HoldRevoked) as excinfo:
        reader.release(gen)
    err = excinfo.value
    assert err.kind is ErrorKind.REVOKED and (err.generation, err.step) == (gen.index, 1)
    assert f"reader_timeout_s={READER_TIMEOUT_S:g} s" in err.message and "torn" in err.message, err.message
    assert "slow-engine" in err.message and "raise reader_timeout_s" in err.message, err.message
    reader.release(gen)  # idempotent: raised once
    wait_for(
        lambda: any("no longer held it" in r.getMessage() for r in caplog.records),
        "the RELEASE still reached the daemon before the error was raised",
    )
    assert any("revoked the hold of reader 'slow-engine'" in r.getMessage() for r in caplog.records)
    fresh = reader.wait(min_step=3)
    assert fresh.step == 3 and fresh.intact() and exact(copy_out(fresh), 3)
    reader.release(fresh)


@pytest.mark.timeout(90)
def test_closing_a_reader_with_a_revoked_generation_does_not_raise(start):
    """``close()`` releases what the reader still holds; a revoked generation among them is logged,
    not raised (nothing is loaded from it any more), and the reader detaches."""
    d = start()
    reader = RefitReader(d.endpoint, name="closing-engine", timeout=REPLY_S)
    try:
        gen = held_then_overwritten(d, reader)
    finally:
        reader.close()
    assert gen.released and not gen.intact()
    wait_for(lambda: "closing-engine" not in d.status()["readers"], "the reader detached")


@pytest.mark.timeout(120)
def test_an_engine_worker_whose_hold_was_revoked_acknowledges_not_ok_and_raises(start, caplog):
    """An engine worker is loading step 1 (its load blocks) while the trainer pushes steps 2 and 3;
    step 3 is written into the generation it is copying from, after reader_timeout_s. When its load
    returns the worker checks ``intact()`` before acknowledging: it acknowledges ok=False with the
    HoldRevoked error (the daemon reports the worker's error) and raises instead of returning a
    result, so the engine loads the next generation: ``load_next`` again yields step 3, ok."""
    caplog.set_level(logging.INFO, logger="refitd.daemon")
    d = start()
    manifest = Manifest.from_tensors(
        convert(weights(0), SPEC),
        engine="reference",
        engine_version="test",
        moe_backend="ReferenceFusedMoE",
        expert_format="block_fp8",
    )
    loading, go = threading.Event(), threading.Event()
    loaded: list[dict[str, torch.Tensor]] = []

    def slow_load(gen: Generation) -> None:
        loading.set()
        if not go.wait(REPLY_S):
            raise TimeoutError("the test never let the load finish")
        loaded.append(copy_out(gen))

    worker = EngineWorker(d.endpoint, name="engine-tp0", manifest=manifest, load=slow_load, timeout=REPLY_S)
    outcome: list[BaseException | object] = []
    try:
        worker.attach()
        push(d.endpoint, 1)
        thread = threading.Thread(target=lambda: outcome.append(_catch(worker.load_next, 1)), daemon=True)
        thread.start()
        assert loading.wait(REPLY_S)
        push(d.endpoint, 2)
        push(d.endpoint, 3)  # waits reader_timeout_s for the worker, revokes its hold, writes step 3
        go.set()
        thread.join(REPLY_S)
        assert not thread.is_alive()
        (err,) = outcome
        assert isinstance(err, HoldRevoked) and err.kind is ErrorKind.REVOKED and err.step == 1, err
        assert "engine-tp0" in err.message and "torn" in err.message
        assert exact(loaded[0], 3), "the engine really copied overwritten bytes: serving them would be wrong"
        wait_for(
            lambda: any(
                "failed to load step 1" in r.getMessage() and "[revoked: step 1]" in r.getMessage()
                for r in caplog.records
            ),
            "the daemon received ok=False with the HoldRevoked error",
        )
        result = worker.load_next(min_step=3, timeout=REPLY_S)
        assert result.ok and result.step == 3 and exact(loaded[-1], 3)
    finally:
        go.set()
        worker.detach()


def _catch(fn, *args):
    try:
        return fn(*args)
    except BaseException as exc:  # handed to the test thread, which asserts on it
        return exc


@pytest.mark.timeout(120)
@pytest.mark.parametrize("regions", [0, 2], ids=["whole-staging", "staging-ring"])
def test_the_epoch_is_bumped_before_the_first_write_into_a_claimed_generation(start, regions):
    """The claim is instrumented: every generation arena records the epoch it is at whenever the
    daemon takes a view of it to write a step (its quantization worker does, per unit). For each
    step, staged whole and through the staging ring, including the step that revokes a hold, the
    claim bumped the generation's epoch by one, and every write into it came after, at the new epoch."""
    d = start(staging_regions=regions)
    daemon = d.daemon
    arenas = daemon.arenas
    events: list[tuple] = []
    lock = threading.Lock()
    original_claim = arenas.claim_target

    def claim(now, reader_timeout_s):
        before = [arenas.epochs.read(g.index) for g in arenas.generations]
        gen = original_claim(now, reader_timeout_s)
        if gen is not None:
            with lock:
                events.append(("claim", gen.index, before[gen.index], arenas.epochs.read(gen.index)))
        return gen

    def spy(gen, method):
        def wrapped(*args, **kwargs):
            with lock:
                events.append(("write", gen.index, arenas.epochs.read(gen.index)))
            return method(*args, **kwargs)

        return wrapped

    arenas.claim_target = claim
    for g in arenas.generations:
        g.arena.tensor = spy(g, g.arena.tensor)
        g.arena.tensors = spy(g, g.arena.tensors)
    with RefitReader(d.endpoint, name="slow-engine", timeout=REPLY_S) as reader:
        gen = held_then_overwritten(d, reader)  # steps 1-3; step 3 revokes the hold
        assert not gen.intact()
    push(d.endpoint, 4)
    claims = [e for e in events if e[0] == "claim"]
    assert [c[1] for c in claims] == [0, 1, 0, 1], claims
    current: dict[int, int] = {}
    writes = 0
    for event in events:
        if event[0] == "claim":
            _, index, before, after = event
            assert after == before + 1, f"claiming generation {index} did not bump its epoch: {event}"
            current[index] = after
        else:
            _, index, epoch = event
            assert index in current, f"generation {index} was written before any claim: {events}"
            assert epoch == current[index], f"a write into generation {index} saw epoch {epoch}: {events}"
            writes += 1
    assert writes >= 4, f"the instrumentation saw no writes: {events}"


def test_arenas_bump_on_claim_count_revocations_and_own_their_epoch_page(tmp_path):
    """``Arenas`` directly: a fresh page reads the first epoch for every generation; a claim bumps
    only the claimed one; a claim past reader_timeout_s drops the holds, counts them and tells
    ``on_revoke`` (identity, generation, the step it held); a reader maps the page read-only; close
    unlinks the page with the other segments."""
    arenas = Arenas("refitd-test-epochs", staging_bytes=4096, publish_bytes=4096)
    try:
        page = arenas.epochs
        assert page.name in arenas.segment_names() and (SHM_DIR / page.name).exists()
        view = EpochView.attach(page.handle())
        assert [view.read(g.index) for g in arenas.generations] == [1, 1]
        told: list[tuple] = []
        arenas.on_revoke = lambda identity, gen, step: told.append((identity, gen.index, step))
        first = arenas.claim_target(0.0, 5.0)
        arenas.publish(first, 7)
        assert (first.index, view.read(0), view.read(1)) == (0, 2, 1)
        second = arenas.claim_target(0.0, 5.0)
        arenas.publish(second, 8)
        arenas.hold(b"reader-a", arenas.generations[0])
        assert arenas.claim_target(10.0, 5.0) is None and view.read(0) == 2, "held: not claimed, not bumped"
        assert arenas.claim_target(15.0, 5.0) is arenas.generations[0]
        assert (view.read(0), arenas.revoked_holds, told) == (3, 1, [(b"reader-a", 0, 7)])
        with pytest.raises(ValueError, match="read-only"):
            view._epochs[0] = 0  # mapped read-only: a reader cannot forge an epoch
        view.close()
    finally:
        arenas.close()
    assert not (SHM_DIR / page.name).exists()
    assert not Path(SHM_DIR / arenas.generations[0].arena.name).exists()


# ----------------------------------------------------------------------------------------------
# an inference node of a disaggregated layout: forwarded generations are claimed the same way


@pytest.fixture
def disaggregated(tmp_path):
    """(trainer node's daemon, inference node's daemon), CURVE between them; readers on the
    inference node are dropped after reader_timeout_s=2 s, the trainer node keeps the defaults."""
    keys = tmp_path / "keys"
    allowed = keys / "allowed"
    allowed.mkdir(parents=True)
    trainer_key, _ = write_keypair(allowed, "trainer")
    inference_key, inference_pub = write_keypair(keys, "inference")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    common = dict(layout="disaggregated", forward_timeout_s=10.0, format="block_fp8")
    inference = RunningDaemon(
        tmp_path,
        runtime_dir=tmp_path / "inference",
        role="inference",
        model_type="qwen3_5_moe",
        publish_bytes=4 << 20,
        listen=endpoint,
        curve_secret_key=inference_key,
        curve_allowed_keys=allowed,
        curve_trainer_keys=allowed / "trainer.key.pub",
        **{**common, "reader_timeout_s": READER_TIMEOUT_S},
    )
    trainer = RunningDaemon(
        tmp_path,
        runtime_dir=tmp_path / "trainer",
        hf_config=CONFIG,
        role="trainer",
        world_size=1,
        peers=[endpoint],
        curve_secret_key=trainer_key,
        curve_server_key=inference_pub,
        **{**common, "reader_timeout_s": 30.0},
    )
    yield trainer, inference
    trainer.close()
    inference.close()


@pytest.mark.timeout(180)
def test_a_forwarded_generation_held_past_reader_timeout_on_an_inference_node_is_revoked(disaggregated):
    """On an inference node an engine reader holds forwarded step 1 past reader_timeout_s while the
    trainer node forwards steps 2 and 3; step 3 is written into the held generation. The reader is
    told as on a trainer node: ``intact()`` is False, ``release`` raises HoldRevoked, the inference
    node's ``status`` counts the revoked hold; step 3 then loads intact and exact."""
    trainer, inference = disaggregated
    local = inference.daemon.local_listen

    def status() -> dict:  # over the node's local ipc:// socket (its tcp:// one takes CURVE keys)
        with RefitReader(local, name="test-status") as probe:
            return probe.status(timeout=REPLY_S)

    def land(step: int) -> None:
        push(trainer.endpoint, step)
        wait_for(lambda: status()["last_step"] == step, f"forwarded step {step} live there")

    with RefitReader(local, name="inference-engine", timeout=REPLY_S) as reader:
        land(1)
        gen = reader.wait(min_step=1)
        assert gen.intact() and exact(copy_out(gen), 1)
        land(2)
        land(3)
        assert status()["live"]["generation"] == gen.index
        assert not gen.intact()
        with pytest.raises(HoldRevoked) as excinfo:
            reader.release(gen)
        assert excinfo.value.generation == gen.index and excinfo.value.step == 1
        assert status()["revoked_holds"] == 1
        fresh = reader.wait(min_step=3)
        assert fresh.intact() and exact(copy_out(fresh), 3)
        reader.release(fresh)


# ----------------------------------------------------------------------------------------------
# GPU arenas: copies out of them are asynchronous


class _Page:
    """Stands in for the epoch page: records when it is read."""

    def __init__(self, calls: list, epoch: int):
        self.calls, self.epoch = calls, epoch

    def read(self, index: int) -> int:
        self.calls.append("read epoch")
        return self.epoch


def test_intact_on_a_gpu_generation_finishes_the_copies_before_reading_the_epoch(monkeypatch):
    """On a GPU arena a copy out of the generation is asynchronous: ``intact()`` waits for the GPUs
    (the arena's and the current one) before it reads the epoch, else a copy still running after
    the check could read bytes the daemon writes next."""
    import adapters.base as base

    calls: list = []
    monkeypatch.setattr(base, "_finish_copies", lambda gen: calls.append("finish copies"))
    gen = Generation(0, 7, {}, "refitd-gen0", on_gpu=True, device=1, epoch=5, epochs=_Page(calls, 5))
    assert gen.intact() and calls == ["finish copies", "read epoch"]
    calls.clear()
    gen.epochs = _Page(calls, 6)
    assert not gen.intact() and calls == ["finish copies", "read epoch"]


def test_a_generation_from_a_daemon_without_epochs_is_judged_by_revoked_alone():
    """A GENERATION without an epoch (an older daemon): ``intact()`` cannot read a page and relies on
    the daemon's REVOKED message alone."""
    gen = Generation(0, 7, {}, "refitd-gen0")
    assert gen.intact()
    gen.revoked = True
    assert not gen.intact()


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (arena = cuda)")


@needs_gpu
@pytest.mark.timeout(180)
def test_a_revoked_hold_on_a_gpu_arena_is_reported(start):
    """The same revocation with ``arena = "cuda"`` (cudaMalloc generations, written by GPU kernels,
    staged through the ring): the claim bumps the epoch before any kernel is launched into the
    generation, so ``intact()`` (after finishing the reader's device copies) is False, and
    ``release`` raises HoldRevoked."""
    d = start(arena="cuda", gpu=torch.cuda.current_device())
    with RefitReader(d.endpoint, name="gpu-engine", timeout=REPLY_S) as reader:
        gen = held_then_overwritten(d, reader)
        assert gen.on_gpu and not gen.intact()
        assert exact({n: t.cpu() for n, t in gen.tensors.items()}, 3)
        with pytest.raises(HoldRevoked):
            reader.release(gen)
        fresh = reader.wait(min_step=3)
        assert fresh.intact() and exact({n: t.cpu() for n, t in fresh.tensors.items()}, 3)
        reader.release(fresh)


@pytest.mark.timeout(180)
def test_a_forwarder_whose_generation_is_rewritten_mid_send_aborts_instead_of_committing(
    disaggregated, monkeypatch, caplog
):
    """The trainer node's forwarder is itself a reader of the generation it sends. If its hold were
    dropped and the generation rewritten while the bytes were on their way (the epoch moved; here the
    test moves it from inside the first send, as a claim would), it must not COMMIT what the peer got:
    it aborts the transfer, says why, and the next attempt delivers the step intact."""
    import sidecar.forward.sender as sender

    trainer, inference = disaggregated
    caplog.set_level(logging.WARNING, logger="refitd.forward")
    original, sends = sender.choose_mover, []

    def choose_mover(*args, **kwargs):
        mover = original(*args, **kwargs)
        send = mover.send

        def rewritten_during_the_first_send(fwd, job, views, ready, deadline):
            sent = send(fwd, job, views, ready, deadline)
            sends.append(job.step)
            if len(sends) == 1:
                trainer.daemon.arenas.epochs.bump(job.generation)  # what a claim does before writing
            return sent

        mover.send = rewritten_during_the_first_send
        return mover

    monkeypatch.setattr(sender, "choose_mover", choose_mover)
    local = inference.daemon.local_listen
    push(trainer.endpoint, 1)
    with RefitReader(local, name="inference-engine", timeout=REPLY_S) as reader:
        gen = reader.wait(min_step=1)
        assert gen.intact() and exact(copy_out(gen), 1)
        reader.release(gen)
    assert sends == [1, 1], "the rewritten transfer was aborted and sent again"
    assert any("was rewritten while it was being sent" in r.getMessage() for r in caplog.records)


def test_load_intact_loads_the_next_generation_after_a_torn_load_and_gives_up_after_attempts():
    """``EngineWorker.load_intact`` (the reference engine and the demo use it): a load found torn
    (HoldRevoked, already acknowledged ok=False) is followed by loading the next generation; after
    ``attempts`` torn loads in a row the last HoldRevoked is raised, not swallowed."""
    from adapters.engine import LoadResult

    worker = EngineWorker("ipc:///nonexistent/refitd-test.sock", name="engine", manifest=None, load=None)
    outcomes: list = []

    def load_next(min_step=None, timeout=None):
        outcome = outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    worker.load_next = load_next
    torn = HoldRevoked(reader="engine", generation=0, step=1, reader_timeout_s=1.0)
    outcomes[:] = [torn, LoadResult(worker="engine", step=3, ok=True)]
    assert worker.load_intact(min_step=1).step == 3 and outcomes == []
    outcomes[:] = [torn, torn, torn, LoadResult(worker="engine", step=5, ok=True)]
    with pytest.raises(HoldRevoked):
        worker.load_intact(min_step=1, attempts=3)
    assert len(outcomes) == 1
    with pytest.raises(ValueError, match="attempts=0"):
        worker.load_intact(attempts=0)
