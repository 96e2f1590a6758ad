"""Where refitd replaces an RL framework's weight refit: a sketch for verl and NeMo-RL.

Both frameworks end each training step by moving the policy's weights into the rollout engine. Their
own path gathers every tensor (``full_tensor()``, or Megatron-Bridge's export), then sends it to the
engine over NCCL/IPC, with the engine waiting. With refitd the trainer ranks push what they hold to the
node's daemon, which quantizes and publishes a versioned generation; the engine workers (``adapters/``)
load it when they are ready. This file is a sketch of the hook, not an import of either framework:
the ``…`` are the framework's own objects, named as in their code.
"""

from __future__ import annotations

from typing import Any

from sidecar.client import RefitClient

ENDPOINT = "ipc:///run/refitd/control.sock"


class RefitdSync:
    """One per trainer rank, made once next to the framework's worker."""

    def __init__(self, rank: int, world_size: int, endpoint: str = ENDPOINT):
        self.client = RefitClient(endpoint, rank=rank, world_size=world_size)
        self.declare: dict | None = None  # Megatron: the export's tensors, as meta tensors

    # ---- FSDP2 / DTensor policies: verl's FSDP workers, NeMo-RL's DTensorPolicyWorker

    def push_fsdp(self, step: int, model: Any) -> int:
        """Replaces verl's ``FSDPVLLMShardingManager.__enter__`` weight sync (``state_dict()`` then
        ``full_tensor()`` per tensor, then ``model.load_weights``) and NeMo-RL's
        ``DTensorPolicyWorker.prepare_weights_for_ipc`` / ``broadcast_weights_for_collective``: every
        rank pushes its own shards, no gather. Returns the published generation."""
        return self.client.push_step(step, model.state_dict()).generation

    # ---- Megatron-Core policies: NeMo-RL's MegatronPolicyWorker, verl-megatron, slime

    def push_megatron(self, step: int, bridge: Any, model: Any) -> int:
        """Replaces the loop over ``bridge.export_hf_weights(model)`` that feeds the engine. The same
        call on every rank (TP, EP, PP, DP alike): the export is streamed, declared once (names,
        shapes, dtypes from the HF config), each rank reads it in lockstep (its gathers are
        collectives) and each gathered tensor is written to refitd by exactly one rank, then dropped,
        so the full model is never held (``integrations.megatron``)."""
        from integrations.megatron import declare_of, push_megatron

        if self.declare is None:
            self.declare = declare_of(bridge)
        return push_megatron(self.client, step, bridge, model, declare=self.declare).generation

    def close(self) -> None:
        self.client.close()


# The engine side needs no trainer hook: each rollout worker runs refitd's adapter (adapters/vllm,
# adapters/trtllm), which attaches with the engine's manifest, loads every new generation between
# requests and acknowledges it. ``push_step(..., wait="loaded")`` makes the trainer wait for that too,
# where the framework's own refit was synchronous.
