"""Engine side end to end: attach with a manifest, load every generation, acknowledge.

The daemon runs in a thread of the test process (the real serve loop, sockets and shared memory);
engine workers are reference engines, in threads or, where one is killed, in a child process.
"""

from __future__ import annotations

import multiprocessing as mp
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from support.daemons import daemon_factory

from adapters.engine import EngineWorker, LoadResult, check_results
from adapters.reference import ReferenceEngine, next_token_kl, sample_inputs
from sidecar.cli.demo.synthetic import make_hf_config, make_state_dict
from sidecar.client.client import RefitClient
from sidecar.errors import ErrorKind, RefitError
from sidecar.plan.build import RefitSpec
from sidecar.plan.run import convert

pytestmark = pytest.mark.timeout(180)

MODEL = dict(num_layers=2, num_experts=4, unaligned=True)
CONFIG = make_hf_config("qwen3_5_moe", **MODEL)


def weights(step: int) -> dict[str, torch.Tensor]:
    return make_state_dict("qwen3_5_moe", seed=100 + step, **MODEL)


@pytest.fixture
def run_daemon(tmp_path):
    factory = daemon_factory(tmp_path, hf_config=CONFIG, world_size=1)
    start = next(factory)
    yield lambda fmt="block_fp8", **settings: start(format=fmt, **settings)
    next(factory, None)


def reference_worker(endpoint: str, name: str, fmt: str, keep_bf16=(), fail: bool = False):
    engine = ReferenceEngine.from_config(CONFIG, expert_format=fmt, keep_bf16=keep_bf16)

    def load(gen):
        if fail:
            raise RuntimeError("CUDA error: out of memory (injected)")
        engine.load(gen.tensors)

    return engine, EngineWorker(endpoint, name=name, manifest=engine.manifest(), load=load, timeout=60)


def logits_of(engine: ReferenceEngine) -> torch.Tensor:
    return engine.forward(sample_inputs(engine.vocab_size))


@pytest.mark.parametrize("fmt", ["block_fp8", "mxfp8", "fp8_per_tensor"])
def test_every_format_end_to_end_through_the_reference_engine(run_daemon, fmt):
    """A trainer pushes two steps with wait='loaded'; the engine loads each one exactly as published,
    and its outputs track the BF16 model."""
    d = run_daemon(fmt)
    engine, worker = reference_worker(d.endpoint, "ref-0", fmt)
    worker.attach()
    with ThreadPoolExecutor(1) as pool, RefitClient(d.endpoint, 0, 1) as client:
        for step in range(2):
            loading = pool.submit(worker.load_next, step, 60)
            result = client.push_step(step, weights(step), wait="loaded", timeout=60)
            assert loading.result().ok
            assert [r["worker"] for r in result.loads] == ["ref-0"] and result.loads[0]["ok"]
    expected = ReferenceEngine.from_config(CONFIG, expert_format=fmt)
    expected.load(convert(weights(1), RefitSpec(model_type="qwen3_5_moe", fmt=fmt)))
    assert torch.equal(logits_of(engine), logits_of(expected))  # it holds exactly the published bytes
    bf16 = ReferenceEngine.from_config(CONFIG, expert_format="bf16")
    bf16.load_bf16(weights(1))
    assert 0 < next_token_kl(logits_of(bf16), logits_of(engine)) < 0.05
    worker.detach()


def test_attach_mismatch_is_refused_listing_every_mismatch(run_daemon):
    """An engine built for MXFP8 attaches to a block-FP8 daemon: refused, each difference listed."""
    d = run_daemon("block_fp8")
    _, worker = reference_worker(d.endpoint, "wrong-format", "mxfp8")
    with pytest.raises(RefitError) as err:
        worker.attach(timeout=30)
    assert err.value.kind is ErrorKind.ENGINE
    text = str(err.value)
    assert "'wrong-format'" in text and "routed experts are mxfp8" in text
    assert "weight_scale: the engine expects uint8" in text and "does not publish it" in text
    assert "mismatches" in text and text.count("\n  - ") > 10
    assert d.status()["engines"] == []  # nothing registered; the daemon keeps serving
    _, good = reference_worker(d.endpoint, "right-format", "block_fp8")
    assert good.attach(timeout=30)["checked"] is True
    good.detach()
    worker.detach()


def test_manifest_wins_experts_the_engine_holds_in_bf16_are_published_in_bf16(run_daemon):
    """The engine keeps layer 0's experts in BF16; with room to publish them so, the daemon re-plans;
    with exact-size arenas it refuses and says how to fix it."""
    keep = ["model.language_model.layers.0.mlp.experts"]
    tight = run_daemon("block_fp8")
    _, refused = reference_worker(tight.endpoint, "bf16-layer0", "block_fp8", keep_bf16=keep)
    with pytest.raises(RefitError, match="does not fit") as err:
        refused.attach(timeout=30)
    assert err.value.kind is ErrorKind.CAPACITY and "--publish-bytes" in str(err.value)
    refused.detach()
    tight.close()

    roomy = run_daemon(
        "block_fp8", publish_bytes="64MiB", runtime_dir=tight.config.runtime_dir.parent / "run2"
    )
    engine, worker = reference_worker(roomy.endpoint, "bf16-layer0", "block_fp8", keep_bf16=keep)
    worker.attach(timeout=30)
    with ThreadPoolExecutor(1) as pool, RefitClient(roomy.endpoint, 0, 1) as client:
        loading = pool.submit(worker.load_next, 0, 60)
        client.push_step(0, weights(0), wait="loaded", timeout=60)
        gen_ok = loading.result()
    assert gen_ok.ok
    slabs = [f"{keep[0]}.gate_up_proj", f"{keep[0]}.down_proj"]
    expected = convert(weights(0), RefitSpec(model_type="qwen3_5_moe", fmt="block_fp8"), keep_bf16=slabs)
    assert expected["model.language_model.layers.0.mlp.experts.gate_up_proj"].dtype == torch.bfloat16
    reference = ReferenceEngine.from_config(CONFIG, expert_format="block_fp8", keep_bf16=keep)
    reference.load(expected)
    assert torch.equal(logits_of(engine), logits_of(reference))
    worker.detach()


def test_a_worker_that_fails_to_load_is_named_to_the_trainer(run_daemon):
    """Two engines attached; one fails its load: the trainer's push raises naming it and its cause,
    and reports that the other loaded the step."""
    d = run_daemon("block_fp8")
    _, good = reference_worker(d.endpoint, "good-worker", "block_fp8")
    _, bad = reference_worker(d.endpoint, "bad-worker", "block_fp8", fail=True)
    good.attach()
    bad.attach()
    with ThreadPoolExecutor(2) as pool, RefitClient(d.endpoint, 0, 1) as client:
        loads = [pool.submit(w.load_next, 0, 60) for w in (good, bad)]
        with pytest.raises(RefitError) as err:
            client.push_step(0, weights(0), wait="loaded", timeout=60)
        results = [f.result() for f in loads]
    assert err.value.kind is ErrorKind.ENGINE and err.value.step == 0
    assert "bad-worker: RuntimeError: CUDA error: out of memory (injected)" in str(err.value)
    assert "loaded it: good-worker" in str(err.value)
    with pytest.raises(RefitError, match="bad-worker"):
        check_results([r.to_dict() for r in results], step=0)
    assert d.status()["last_step"] == 0  # the generation itself is published and intact
    good.detach()
    bad.detach()


def test_two_engines_attached_at_once_both_load_every_step(run_daemon):
    d = run_daemon("fp8_per_tensor")
    pairs = [reference_worker(d.endpoint, f"tp{i}", "fp8_per_tensor") for i in range(2)]
    for _, w in pairs:
        w.attach()
    with ThreadPoolExecutor(2) as pool, RefitClient(d.endpoint, 0, 1) as client:
        for step in range(2):
            loads = [pool.submit(w.load_next, step, 60) for _, w in pairs]
            result = client.push_step(step, weights(step), wait="loaded", timeout=60)
            assert sorted(r["worker"] for r in result.loads) == ["tp0", "tp1"]
            assert all(f.result().ok for f in loads)
    assert torch.equal(logits_of(pairs[0][0]), logits_of(pairs[1][0]))
    for _, w in pairs:
        w.detach()


def _engine_process(endpoint: str, name: str, steps: list, conn) -> None:
    """A child engine worker: attach, load what it is told, report the logits' checksum."""
    torch.set_num_threads(1)
    engine, worker = reference_worker(endpoint, name, "block_fp8")
    worker.attach(timeout=60)
    conn.send("attached")
    for step in steps:
        result = worker.load_next(step, 60)
        conn.send({"step": result.step, "ok": result.ok, "sum": float(logits_of(engine).double().sum())})
    conn.recv()  # parent says when to exit (or kills us)
    worker.detach()


def test_a_killed_worker_is_named_and_its_restart_loads_the_current_generation(run_daemon):
    """A worker process is killed after loading step 0: step 1's load report names it. Restarted
    under the same name it re-attaches and loads the generation that is live (step 1)."""
    d = run_daemon("block_fp8")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    first = ctx.Process(target=_engine_process, args=(d.endpoint, "worker-7", [0], child))
    first.start()
    with RefitClient(d.endpoint, 0, 1) as client:
        assert parent.poll(120) and parent.recv() == "attached"
        client.push_step(0, weights(0), wait="loaded", timeout=60)
        assert parent.recv()["ok"]
        first.kill()
        first.join(timeout=30)
        # named either when its acknowledgement times out or when its heartbeat stops, whichever is first
        with pytest.raises(RefitError, match=r"worker-7: (did not acknowledge|stopped responding)") as err:
            client.push_step(1, weights(1), wait="loaded", timeout=60)
        assert err.value.kind is ErrorKind.ENGINE
        parent2, child2 = ctx.Pipe()
        second = ctx.Process(target=_engine_process, args=(d.endpoint, "worker-7", [None], child2))
        second.start()
        assert parent2.poll(120) and parent2.recv() == "attached"
        assert parent2.poll(60)
        reply = parent2.recv()
        assert reply == {"step": 1, "ok": True, "sum": reply["sum"]}
        expected = ReferenceEngine.from_config(CONFIG, expert_format="block_fp8")
        expected.load(convert(weights(1), RefitSpec(model_type="qwen3_5_moe", fmt="block_fp8")))
        assert reply["sum"] == float(logits_of(expected).double().sum())
        names = [e["name"] for e in d.status()["engines"]]
        assert names == ["worker-7"]  # the restart replaced the dead registration
        parent2.send("exit")
        second.join(timeout=60)


def test_check_results_treats_no_answer_as_failure():
    with pytest.raises(RefitError, match="no engine worker"):
        check_results([])
    ok = check_results([LoadResult("a", 3, True).to_dict()], step=3)
    assert ok[0].worker == "a"
    with pytest.raises(RefitError, match="loaded step 2, expected 3"):
        check_results([{"worker": "b", "step": 2, "ok": True}], step=3)
