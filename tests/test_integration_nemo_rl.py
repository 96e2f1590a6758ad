"""refitd's NeMo-RL transport (integrations/nemo_rl.py) against NeMo-RL's interface, transcribed at a
named commit (tests/support/nemo_rl_interface.py), and a real daemon (the serve loop in a thread).

Two policy ranks hand ``send_weights`` the same gathered tensors, as NeMo-RL's workers do; each tensor
is pushed by one rank, and the generation is byte-equal to refitd's conversion of those tensors. The
rollout side's ``receive_weight_batches`` yields a BF16 generation as one batch and refuses a
quantized one (NeMo-RL's vLLM loader would re-quantize it).
"""

from __future__ import annotations

import asyncio
import inspect
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from support.nemo_rl_interface import CheckpointEngine, create_checkpoint_engine

from adapters.base import RefitReader
from sidecar.cli.demo.synthetic import make_hf_config, make_state_dict
from sidecar.errors import RefitError
from sidecar.plan.build import RefitSpec
from sidecar.plan.run import convert

pytestmark = pytest.mark.timeout(180)

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
