"""refitd's NeMo-RL transport loads FP8 generations into vLLM 0.33.0's real model (``make test-engines``).

The engine is built as NeMo-RL builds it with the two ``vllm_kwargs`` ``python -m integrations.nemo_rl_vllm``
prints (``quantization`` and ``hf_config_path``: vLLM's real ``ModelConfig`` reads the quantization
config from the written config.json; ``precision`` bfloat16, so NeMo-RL's FP8 patches are not in force)
and vLLM's real model class (``tests/support/vllm_models.py``: what is replaced there, and why). The
worker is NeMo-RL's vLLM mixin, transcribed (``tests/support/nemo_rl_interface.py``, NVIDIA-NeMo/RL@
7ea279ab), over the real model and configs: NeMo-RL's ``is_fp8_model`` is True for this engine, so any
batch the transport yielded would go to NeMo-RL's re-quantizing loader (the transcription fails the test
there instead). Two policy ranks push through the transport into a real daemon (its serve loop in a
thread); ``update_weights_from_checkpoint_engine`` loads step 1 after it is published and, after the
transport was finalized and set up again (``release_after_refit``), step 2 by a refit call already
waiting while it is pushed. After each, every engine parameter is byte-equal to
vLLM's own first load + ``process_weights_after_loading`` of ``refitd convert``'s output of the same
weights, and the published generation is byte-equal to that output. No kernel runs (FP8 MoE kernels do
not run on this CPU): the check ends at the loaded parameters' bytes.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from support.daemons import RunningDaemon
from support.engines import missing
from support.nemo_rl_interface import VllmCheckpointEngineMixin, create_checkpoint_engine, is_fp8_model
from support.waiting import wait_until

import adapters.vllm as av
from adapters.base import RefitReader
from integrations.nemo_rl_vllm import write_engine_config
from sidecar.plan.attach import check_manifest
from sidecar.plan.build import RefitSpec, meta_state_dict
from sidecar.plan.models import get_model, model_type_of, normalize_hf_config
from sidecar.plan.run import convert

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

TRANSPORT = "integrations.nemo_rl:RefitdCheckpointEngine"


@pytest.fixture(scope="module")
def vm():
    try:
        from support import vllm_models

        vllm_models.import_vllm()
        from vllm.model_executor.model_loader.utils import initialize_model  # noqa: F401
    except ImportError as exc:
        missing(
            "vLLM's model classes do not import",
            "needs vLLM 0.33.0 in .venv-engines: run `make test-engines`",
            exc,
        )
    return vllm_models


class NemoRLWorker(VllmCheckpointEngineMixin):
    """vLLM's worker with NeMo-RL's checkpoint-engine extension mixed in (as ``worker_extension_cls``)."""

    def __init__(self, parts):
        self.__dict__.update(vars(parts))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bytes(a), _bytes(b))


@pytest.mark.parametrize("fmt", ["block_fp8", "mxfp8"])
def test_nemo_rls_vllm_worker_loads_refitds_fp8_through_vllms_loader(vm, tmp_path, fmt):
    folder = vm.write_config(tmp_path / "model", "qwen3_moe")
    hf = vm.config_dict(folder)
    vllm_kwargs = write_engine_config(tmp_path / "engine", hf, fmt)  # NeMo-RL's policy.generation.vllm_kwargs
    config = vm.vllm_config(folder, {**vllm_kwargs, "dtype": "bfloat16"})
    assert is_fp8_model(config), type(config.quant_config)  # NeMo-RL's own loader would re-quantize
    vm.init_distributed(config)
    model = vm.build_model(config)
    with torch.no_grad():
        for p in model.parameters():  # load_format="dummy", as NeMo-RL starts vLLM for training
            p.data.zero_()
    vm.process(config, model)
    worker = NemoRLWorker(vm.worker(config, model))

    layers = get_model(model_type_of(hf)).num_hidden_layers(hf)
    spec = RefitSpec(model_type="qwen3_moe", fmt=fmt, num_hidden_layers=layers)
    params = get_model(model_type_of(hf)).parameters(normalize_hf_config(hf), include_vision=False)
    check = check_manifest(params, spec, av.RefitWorkerExtension.refit_manifest(worker))
    assert check.ok, check.message("test")
    declared = meta_state_dict(hf)

    (tmp_path / "daemon").mkdir()
    settings = dict(format=fmt, world_size=2, reader_timeout_s=60.0, step_timeout_s=60.0)
    with RunningDaemon(tmp_path / "daemon", hf_config=hf, **settings) as d, ThreadPoolExecutor(3) as pool:
        worker.init_checkpoint_engine(TRANSPORT, 1 << 20, {"hf_config": hf, "endpoint": d.endpoint})
        worker.init_checkpoint_engine_process_group(0, 2, 1, [worker.prepare_checkpoint_engine()])
        transport = worker.checkpoint_engine
        assert transport.worker is worker
        policies = []
        for rank in range(2):
            t = create_checkpoint_engine(
                TRANSPORT, bucket_size_bytes=1 << 20, engine_kwargs={"hf_config": hf, "endpoint": d.endpoint}
            )
            t.init_policy_process_group(
                worker_rank=rank, train_world_size=2, rollout_world_size=1, metadata=[]
            )
            policies.append(t)

        def push(state, step):
            sends = [
                pool.submit(asyncio.run, t.send_weights(((n, v.float()) for n, v in state.items()), step))
                for t in policies
            ]
            return [f.result(timeout=120) for f in sends]

        try:
            for step in (1, 2):
                g = torch.Generator().manual_seed(step)
                state = {
                    n: (torch.randn(m.shape, generator=g) * 0.05).to(m.dtype) for n, m in declared.items()
                }
                if step == 1:  # published first, then NeMo-RL's refit call
                    push(state, step)
                    assert worker.update_weights_from_checkpoint_engine() is True
                    # release_after_refit: NeMo-RL's shutdown finalizes, its next sync sets up again
                    worker.finalize_checkpoint_engine()
                    assert worker._refit is None
                    worker.init_checkpoint_engine_process_group(0, 2, 1, [worker.prepare_checkpoint_engine()])
                else:  # NeMo-RL's refit call waits while the policy pushes (ray.get of both)
                    load = pool.submit(worker.update_weights_from_checkpoint_engine)
                    wait_until(
                        "the worker's WAIT", lambda: any(p.waiting for p in list(d.daemon.peers.values()))
                    )
                    push(state, step)
                    assert load.result(timeout=120) is True
                assert worker.loaded_batches == 0 and transport.last_loaded == step

                expected = convert(state, spec, keep_bf16=check.keep_bf16)  # refitd convert of the weights
                with RefitReader(d.endpoint, name="check") as reader:
                    gen = reader.wait(min_step=step, timeout=30)
                    try:
                        assert sorted(gen.tensors) == sorted(expected)
                        assert all(_same(gen.tensors[n], expected[n]) for n in expected)
                    finally:
                        reader.release(gen)
                reference = vm.build_model(config)
                reference.load_weights(av.ordered_weights(expected))
                vm.process(config, reference)
                ref = dict(reference.named_parameters())
                engine = dict(model.named_parameters())
                differ = [
                    n
                    for n, p in engine.items()
                    if n.rpartition(".")[2] not in ("q_scale", "k_scale", "v_scale", "prob_scale")
                    and not _same(p, ref[n])
                ]
                assert not differ, (
                    f"the engine differs from vLLM's own load of refitd convert's output: {differ[:5]}"
                )
                # the experts crossed in FP8 and are in the engine (vLLM's processing may re-lay them out:
                # MXFP8 on this CPU keeps its e8m0 scales beside the weights it dequantized)
                assert any(
                    t.dtype == torch.float8_e4m3fn and ".mlp.experts." in n for n, t in expected.items()
                )
                w13 = [p for n, p in engine.items() if n.endswith("experts.w13_weight")]
                assert w13 and all(_bytes(p).any() for p in w13)
        finally:
            worker.finalize_checkpoint_engine()
            for t in [*policies, transport]:
                t.close()


def test_an_engine_started_in_another_format_is_refused_naming_nemo_rls_settings(vm, tmp_path):
    """The daemon publishes block-FP8, the engine was started without refitd's vllm_kwargs (BF16): the
    first refit is refused at attach with the mismatches and the two NeMo-RL settings; nothing loaded."""
    from sidecar.errors import RefitError

    folder = vm.write_config(tmp_path / "model", "qwen3_moe")
    hf = vm.config_dict(folder)
    config = vm.vllm_config(folder, {"dtype": "bfloat16"})
    vm.init_distributed(config)
    model = vm.build_model(config)
    with torch.no_grad():
        for p in model.parameters():
            p.data.zero_()
    vm.process(config, model)
    worker = NemoRLWorker(vm.worker(config, model))
    (tmp_path / "daemon").mkdir()
    with RunningDaemon(tmp_path / "daemon", hf_config=hf, format="block_fp8", world_size=1) as d:
        worker.init_checkpoint_engine(
            TRANSPORT, 1 << 20, {"hf_config": hf, "endpoint": d.endpoint, "timeout": 30}
        )
        worker.init_checkpoint_engine_process_group(0, 1, 1, [worker.prepare_checkpoint_engine()])
        try:
            with pytest.raises(
                RefitError,
                match=r"(?s)routed-expert tensors in BF16.*vllm_kwargs\.quantization and \.hf_config_path",
            ):
                worker.update_weights_from_checkpoint_engine()
            assert worker.checkpoint_engine.last_loaded is None
            assert all(not _bytes(p).any() for p in model.parameters())
        finally:
            worker.checkpoint_engine.close()
