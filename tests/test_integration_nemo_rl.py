"""refitd's NeMo-RL transport (integrations/nemo_rl.py) against NeMo-RL's interface, transcribed at a
named commit (tests/support/nemo_rl_interface.py), and a real daemon (the serve loop in a thread).

Two policy ranks hand ``send_weights`` the same gathered tensors, as NeMo-RL's workers do; each tensor
is pushed by one rank, and the generation is byte-equal to refitd's conversion of those tensors.
Inside NeMo-RL's vLLM mixin (its consumer side, transcribed at NVIDIA-NeMo/RL@7ea279ab) the transport
finds the worker that owns it and loads through refitd's vLLM adapter, handing NeMo-RL's loader no
batch; vLLM itself loads in ``tests/test_engine_vllm_nemo_rl.py`` (``make test-engines``). Outside a
worker, ``receive_weight_batches`` yields a BF16 generation as one batch and refuses a quantized one.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from support.nemo_rl_interface import CheckpointEngine, VllmCheckpointEngineMixin, create_checkpoint_engine

from adapters.base import RefitReader
from sidecar.cli.demo.synthetic import make_hf_config, make_state_dict
from sidecar.errors import RefitError
from sidecar.plan.build import RefitSpec
from sidecar.plan.run import convert

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parent.parent

MODEL = dict(num_layers=2, num_experts=4, unaligned=True)
CONFIG = make_hf_config("qwen3_5_moe", **MODEL)
TRANSPORT = "integrations.nemo_rl:RefitdCheckpointEngine"


def transports(endpoint: str, world: int, **kwargs):
    out = []
    for rank in range(world):
        t = create_checkpoint_engine(
            TRANSPORT,
            bucket_size_bytes=1 << 20,
            engine_kwargs={"hf_config": CONFIG, "endpoint": endpoint, **kwargs},
        )
        t.prepare()
        t.init_policy_process_group(
            worker_rank=rank, train_world_size=world, rollout_world_size=1, metadata=[]
        )
        out.append(t)
    return out


def push_all(engines, weights: dict[str, torch.Tensor], step: int) -> list[dict]:
    """Every rank pushes the same gathered stream (FP32 masters, as a trainer holds them), at once."""
    with ThreadPoolExecutor(len(engines)) as pool:
        futures = [
            pool.submit(asyncio.run, e.send_weights(((n, t.float()) for n, t in weights.items()), step))
            for e in engines
        ]
        return [f.result(timeout=120) for f in futures]


def test_the_transport_implements_nemo_rls_interface():
    ours = create_checkpoint_engine(TRANSPORT, bucket_size_bytes=1 << 20, engine_kwargs={"hf_config": CONFIG})
    for name in CheckpointEngine.__abstractmethods__:
        theirs, mine = getattr(CheckpointEngine, name), getattr(type(ours), name, None)
        assert mine is not None, f"{name} is missing"
        assert inspect.iscoroutinefunction(theirs) == inspect.iscoroutinefunction(mine), name
        want = {p.name: p.kind for p in inspect.signature(theirs).parameters.values()}
        got = {p.name: p.kind for p in inspect.signature(mine).parameters.values()}
        assert all(got.get(k) == kind for k, kind in want.items()), (name, want, got)
    assert inspect.isasyncgenfunction(type(ours).receive_weight_batches)
    assert ours.cleanup_after_load is True
    assert ours.shard_expert_weights is CheckpointEngine.shard_expert_weights is False
    assert ours.get_target_weight_layout() is None


def test_a_missing_config_says_which_setting():
    with pytest.raises(ValueError, match=r"refit_cfg.*hf_config"):
        create_checkpoint_engine(TRANSPORT, bucket_size_bytes=1, engine_kwargs={})


@pytest.mark.parametrize("fmt", ["block_fp8", "bf16"])
def test_two_policy_ranks_publish_byte_equal_and_the_rollout_side_loads(daemons, fmt):
    d = daemons(hf_config=CONFIG, world_size=2, format=fmt)
    engines = transports(d.endpoint, 2)
    rollout = create_checkpoint_engine(
        TRANSPORT, bucket_size_bytes=1, engine_kwargs={"hf_config": CONFIG, "endpoint": d.endpoint}
    )
    rollout.init_rollout_process_group(rollout_rank=0, train_world_size=2, rollout_world_size=1, metadata=[])
    spec = RefitSpec(model_type="qwen3_5_moe", fmt=fmt)
    try:
        for step in (3, 4):
            weights = make_state_dict("qwen3_5_moe", seed=10 + step, **MODEL)
            metrics = push_all(engines, weights, step)
            assert {m["refitd/step"] for m in metrics} == {step}
            assert len({m["refitd/generation"] for m in metrics}) == 1
            expected = convert(weights, spec)  # the FP32 masters cast back: the same BF16 bytes
            with RefitReader(d.endpoint, name="check") as reader:
                gen = reader.wait(min_step=step, timeout=30)
                try:
                    assert gen.step == step
                    assert sorted(gen.tensors) == sorted(expected)
                    for name, want in expected.items():
                        got = gen.tensors[name]
                        assert got.dtype == want.dtype and got.shape == want.shape, name
                        assert torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8)), name
                finally:
                    reader.release(gen)

            async def receive():
                return [batch async for batch in rollout.receive_weight_batches()]

            if fmt == "bf16":
                batches = asyncio.run(receive())
                assert len(batches) == 1
                got = dict(batches[0])
                assert sorted(got) == sorted(expected)
                assert all(torch.equal(got[n], expected[n]) for n in expected)
                assert rollout.last_loaded == step
            else:
                with pytest.raises(RefitError, match=r"quantized.*adapters\.vllm\.refit_engine"):
                    asyncio.run(receive())
    finally:
        for e in [*engines, rollout]:
            e.close()


class NemoRLWorker(VllmCheckpointEngineMixin):
    """NeMo-RL's vLLM mixin (transcribed) over a worker without vLLM: ``model_runner.model`` records
    what NeMo-RL's own loader would load."""

    def __init__(self):
        self.loaded: list[list[str]] = []
        model = SimpleNamespace(load_weights=lambda weights: self.loaded.append([n for n, _ in weights]))
        self.model_runner = SimpleNamespace(model=model, vllm_config=SimpleNamespace(quant_config=None))


def connect(worker, endpoint: str) -> None:
    """NeMo-RL's setup of a checkpoint engine in a vLLM worker (checkpoint_engine_weight_synchronizer
    ``_ensure_checkpoint_engine_ready``): init, prepare, process group; ``refit_cfg`` as it is dumped."""
    kwargs = {"hf_config": CONFIG, "endpoint": endpoint, "release_after_refit": False}
    worker.init_checkpoint_engine(TRANSPORT, 1 << 20, kwargs)
    metadata = worker.prepare_checkpoint_engine()
    worker.init_checkpoint_engine_process_group(0, 2, 1, [metadata])


def test_nemo_rls_vllm_mixin_prepares_the_transport_and_hands_it_its_worker(daemons):
    """At NeMo-RL @7ea279ab the mixin reads ``shard_expert_weights`` of the transport (it failed with an
    AttributeError before); the transport finds the worker that owns it, and a refit goes to refitd's
    vLLM adapter (here: no vLLM installed, said so), never to NeMo-RL's loader."""
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed: tests/test_engine_vllm_nemo_rl.py loads through it for real")
    d = daemons(hf_config=CONFIG, world_size=1, format="bf16")
    worker = NemoRLWorker()
    connect(worker, d.endpoint)
    transport = worker.checkpoint_engine
    try:
        assert transport.worker is worker and transport.rollout_rank == 0
        with pytest.raises(ImportError, match=r"RefitWorkerExtension\.refit_attach.*needs vLLM"):
            worker.update_weights_from_checkpoint_engine()
        assert worker.loaded == []
    finally:
        worker.finalize_checkpoint_engine()
        transport.close()


def test_a_vllm_patched_by_nemo_rls_own_fp8_is_refused_naming_the_settings(monkeypatch):
    from integrations.nemo_rl_vllm import NEMO_RL_FP8, load_in_worker

    monkeypatch.setitem(sys.modules, NEMO_RL_FP8, SimpleNamespace(fp8_patches_applied=True))
    with pytest.raises(
        RefitError, match=r"precision: fp8.*precision: bfloat16.*quantization.*hf_config_path"
    ):
        load_in_worker(NemoRLWorker(), "ipc:///nowhere", name="w", min_step=0, timeout=1.0)


@pytest.mark.parametrize("fmt", ["block_fp8", "mxfp8", "nvfp4", "bf16"])
def test_the_engine_config_holds_the_adapters_quantization(tmp_path, capsys, fmt):
    """``python -m integrations.nemo_rl_vllm`` writes config.json with ``vllm_engine_args``' quantization
    config, and prints the vllm_kwargs that name it."""
    from adapters.vllm import vllm_engine_args
    from integrations.nemo_rl_vllm import main

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(CONFIG))
    out = tmp_path / "engine"
    assert main(["--hf-config", str(tmp_path / "model"), "--format", fmt, "--out", str(out)]) == 0
    written = json.loads((out / "config.json").read_text())
    args = vllm_engine_args(RefitSpec(model_type="qwen3_5_moe", fmt=fmt), CONFIG)
    want = (args.get("hf_overrides") or {}).get("quantization_config")
    assert written.get("quantization_config") == want
    assert {k: v for k, v in written.items() if k != "quantization_config"} == CONFIG
    printed = capsys.readouterr().out
    assert f"quantization: {json.dumps(args['quantization'])}" in printed
    assert f"hf_config_path: {json.dumps(str(out))}" in printed
    assert main(["--hf-config", str(tmp_path / "nowhere"), "--format", fmt, "--out", str(out)]) == 2


def test_the_example_config_builds_the_transport_and_names_what_the_command_prints(tmp_path):
    """examples/nemo_rl_refitd.yaml: its transport is built from its refit_cfg entry, as NeMo-RL builds it,
    and its vllm_kwargs are the keys and the quantization ``python -m integrations.nemo_rl_vllm`` gives
    for block-FP8."""
    import yaml

    from integrations.nemo_rl_vllm import write_engine_config

    example = yaml.safe_load((REPO / "examples" / "nemo_rl_refitd.yaml").read_text())["policy"]["generation"]
    assert example["vllm_cfg"]["precision"] == "bfloat16"
    kwargs = dict(
        example["refit_cfg"][example["refit_transport"]], hf_config=CONFIG, release_after_refit=False
    )
    transport = create_checkpoint_engine(
        example["refit_transport"], bucket_size_bytes=1, engine_kwargs=kwargs
    )
    assert transport.pusher.wait == "published" and transport.pusher.timeout == 600
    transport.close()
    printed = write_engine_config(tmp_path, CONFIG, "block_fp8")
    assert sorted(example["vllm_kwargs"]) == sorted(printed)
    assert example["vllm_kwargs"]["quantization"] == printed["quantization"]
