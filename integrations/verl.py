"""refitd as verl's weight-sync backend (verl 0.9.1): one module for ``custom_backend_module``.

Importing this module registers ``refitd`` in verl's ``CheckpointEngineRegistry``; verl imports it on
every worker and on the driver (``rollout.checkpoint_engine.custom_backend_module``). The config lines::

    actor_rollout_ref.rollout.checkpoint_engine.backend=refitd
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=integrations.verl
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.refitd.hf_config=/models/m/config.json
    +actor_rollout_ref.rollout.checkpoint_manager_class=integrations.verl.RefitdCheckpointEngineManager
    +actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls=integrations.verl_vllm.RefitdVerlWorkerExtension
    actor_rollout_ref.rollout.quantization=null      # verl must not re-quantize: refitd's daemon does

What crosses: verl's actor workers call ``send_weights(engine.get_per_tensor_param())``. verl 0.9.1
hands a registered backend gathered tensors only (FSDP: ``full_tensor()`` per tensor, a collective;
Megatron: the bridge's export, gathered across TP/EP), the same on every rank; only its built-in
``delta_sharded`` backend is handed the engine's shards. So every rank reads the whole stream (the
gathers are collectives) and refitd's client sends each tensor from exactly one rank
(``push_step(..., replicated=True)``), spreading the bytes. Tensors are cast to the checkpoint dtype
the model's config declares (verl's FSDP masters are often FP32); the daemon quantizes.

The manager (``RefitdCheckpointEngineManager``) replaces verl's, whose rollout-side path would hand the
weights to verl's loader, which re-quantizes (``vllm_quant_utils``, ``SGLangFP8QuantizerHelper``). Per
update: abort the replicas' requests -> every actor rank pushes -> every replica loads the published
generation through refitd's engine adapter -> prefix cache reset -> resume.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

import ray
import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineManager, CheckpointEngineRegistry
from verl.utils.ray_utils import auto_await

from integrations.push import GatheredPush, default_endpoint, read_hf_config

BACKEND = "refitd"
#: the vLLM worker-extension method the manager calls on every replica (integrations.verl_vllm)
LOAD_METHOD = "refitd_load"
SETTING = "rollout.checkpoint_engine.engine_kwargs.refitd.hf_config"


@CheckpointEngineRegistry.register(BACKEND)
class RefitdCheckpointEngine(CheckpointEngine):
    """The actor side: each rank's ``send_weights`` is one ``push_step`` to its node's daemon.

    Built by verl as ``CheckpointEngineRegistry.new("refitd", bucket_size=..., is_master=...,
    **engine_kwargs["refitd"])``. ``engine_kwargs.refitd``: ``hf_config`` (required: config.json or
    the model directory), ``endpoint`` (default: ``$REFITD_ENDPOINT``, else a default daemon's socket),
    ``wait`` (``"published"``: the push returns once the generation is live; ``"committed"``: once
    the daemon holds this rank's bytes), ``timeout`` seconds. ``bucket_size`` is not used: the daemon
    owns the staging memory.
    """

    def __init__(
        self,
        bucket_size: int = 0,
        is_master: bool = False,
        *,
        hf_config: str | Mapping[str, Any] | None = None,
        endpoint: str | None = None,
        wait: str = "published",
        timeout: float = 600.0,
    ) -> None:
        self.bucket_size, self.is_master = bucket_size, is_master
        self.pusher = GatheredPush(
            read_hf_config(hf_config, where=SETTING), endpoint=endpoint, wait=wait, timeout=timeout
        )

    # ---- verl's topology calls: refitd needs no process group of its own

    def prepare(self) -> dict[str, Any]:
        return {"endpoint": self.pusher.endpoint}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Actor ranks are refitd client ranks; rollout workers take no part (-1): they load from the
        daemon through refitd's engine adapter."""
        n = actor_wg_world_size
        actor = {"rank": list(range(n)), "world_size": [n] * n}
        rollout = {"rank": [-1] * rollout_world_size, "world_size": [n] * rollout_world_size}
        return actor, rollout

    def init_process_group(self, rank: int, world_size: int, **_: Any) -> None:
        if rank >= 0:
            self.pusher.set_rank(rank, world_size)

    def finalize(self) -> None:
        """Nothing per step: the connection and the daemon's generation outlive it."""

    def close(self) -> None:
        self.pusher.close()

    async def send_weights(self, weights, global_steps: int | None = None) -> dict[str, Any]:
        """verl's actor worker awaits this with ``engine.get_per_tensor_param()``'s generator; the
        generator is read on a worker thread (its gathers with it), the event loop stays free."""
        device = torch.cuda.current_device() if torch.cuda.is_available() else None

        def run() -> dict[str, Any]:
            if device is not None:  # the generator's gathers run here: on the worker's GPU
                torch.cuda.set_device(device)
            return self.pusher.push(weights, global_steps)

        return await asyncio.to_thread(run)

    async def receive_weights(self, global_steps: int | None = None):
        raise NotImplementedError(
            "the refitd backend loads rollout replicas through refitd's engine adapters, not verl's rollout "
            "loader (which re-quantizes): set rollout.checkpoint_manager_class="
            "integrations.verl.RefitdCheckpointEngineManager"
        )


def resolved(pending: Any) -> list[Any]:
    """A worker group's answers: verl's non-blocking dispatch returns Ray object refs, a blocking one
    the values."""
    items = pending if isinstance(pending, list) else [pending]
    return [ray.get(x) if isinstance(x, ray.ObjectRef) else x for x in items]


class RefitdCheckpointEngineManager(CheckpointEngineManager):
    """verl's ``rollout.checkpoint_manager_class``: abort -> push -> load -> prefix-cache reset -> resume.

    A vLLM replica loads through :data:`LOAD_METHOD` of refitd's vLLM worker extension
    (``integrations.verl_vllm``), called on its server with ``collective_rpc``; an SGLang replica
    (``rollout.name=sglang``) through its HTTP server's weight-update session, refitd's custom loader
    running in each TP scheduler (``integrations.verl_sglang``); a replica object with its own
    ``refitd_load(step, endpoint)`` coroutine (a test's) is asked that instead. A failed load raises
    (naming the worker) and leaves the replicas paused: they must not serve half-loaded weights.
    """

    def __init__(self, config, actor_wg, replicas) -> None:
        super().__init__(config, actor_wg, replicas)
        if self.backend != BACKEND:
            raise ValueError(
                f"RefitdCheckpointEngineManager drives the refitd backend; checkpoint_engine.backend is {self.backend!r}"
            )
        kwargs = dict(config.engine_kwargs.get(BACKEND, {}) or {})
        self.endpoint = kwargs.get("endpoint") or default_endpoint()
        self.load_timeout = float(kwargs.get("timeout", 600.0))

    async def load_replica(self, replica, step: int) -> None:
        own = getattr(replica, "refitd_load", None)
        if own is not None:
            await own(step, self.endpoint)
            return
        engine = str(getattr(getattr(replica, "config", None), "name", None) or "vllm")
        if engine == "sglang":  # verl's SGLangReplica: over its HTTP server, refitd's loader in each TP rank
            from integrations.verl_sglang import load_sglang_replica

            await load_sglang_replica(replica, step, self.endpoint, self.load_timeout)
            return
        if engine != "vllm":
            raise ValueError(
                f"rollout.name={engine!r}: refitd's verl backend loads vLLM and SGLang replicas "
                "(TensorRT-LLM: adapters.trtllm, driven by the user)"
            )
        server = replica.server_handle
        await server.collective_rpc.remote(
            LOAD_METHOD, kwargs={"endpoint": self.endpoint, "min_step": step, "timeout": self.load_timeout}
        )

    def build_actor_ranks(self) -> None:
        """Once: verl's prepare -> build_topology -> init_process_group on the actor workers (each
        learns its refitd rank and world size); rollout workers take no part."""
        n = self.actor_wg.world_size
        metadata = resolved(self.actor_wg.execute_checkpoint_engine(["prepare"] * n))
        actor_kwargs, _ = self.backend_cls.build_topology(n, 0, metadata)
        resolved(self.actor_wg.execute_checkpoint_engine(["init_process_group"] * n, **actor_kwargs))
        self.actor_ranks_built = True

    @auto_await
    async def update_weights(self, global_steps: int | None = None) -> dict[str, Any]:
        await self.abort_replicas()
        if not getattr(self, "actor_ranks_built", False):
            await asyncio.to_thread(self.build_actor_ranks)
        pending = self.actor_wg.update_weights(global_steps=global_steps, mode=self.backend)
        metrics: dict[str, Any] = {}
        for m in await asyncio.to_thread(resolved, pending):
            if isinstance(m, dict):
                metrics.update(m)
        step = metrics.get("refitd/step", global_steps)
        t0 = time.perf_counter()
        await asyncio.gather(*[self.load_replica(r, step) for r in self.replicas])
        metrics["refitd/load_s"] = time.perf_counter() - t0
        await asyncio.gather(*[r.clear_kv_cache() for r in self.replicas])
        await self.resume_generation_replicas()
        return metrics
