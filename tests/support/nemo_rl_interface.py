"""NeMo-RL's weight-transport interface, transcribed: ``nemo_rl/utils/checkpoint_engines/base.py`` at
NVIDIA-NeMo/RL@2bce06890714a2c3f60977f22e0c13e432f409f0 (the PyPI ``nemo-rl`` is a 0.0.0 placeholder
without it, and CI reaches no GitHub), checked again at @7ea279ab (same methods; ``shard_expert_weights``
added). Transcribed are only the parts a transport meets: the abstract
methods with their keyword-only parameters, and ``create_checkpoint_engine``'s way of building one
(``"module:Class"`` imported, then ``Class(bucket_size=..., **engine_kwargs)``).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import Any


class CheckpointEngine(ABC):
    cleanup_after_load: bool = True
    #: @7ea279ab: read by the vLLM mixin below of every transport (base.py:41)
    shard_expert_weights: bool = False

    @abstractmethod
    def prepare(self) -> Any: ...

    @abstractmethod
    def init_policy_process_group(
        self, *, worker_rank: int, train_world_size: int, rollout_world_size: int, metadata: list[Any]
    ) -> None: ...

    @abstractmethod
    def init_rollout_process_group(
        self, *, rollout_rank: int, train_world_size: int, rollout_world_size: int, metadata: list[Any]
    ) -> None: ...

    def finalize(self) -> None:  # noqa: B027 (NeMo-RL's own: concrete and empty)
        pass

    @abstractmethod
    async def send_weights(self, weights) -> None: ...

    @abstractmethod
    def receive_weight_batches(self): ...


def create_checkpoint_engine(backend: str, *, bucket_size_bytes: int, engine_kwargs: dict[str, Any]):
    """As NeMo-RL's: ``"nixl"`` is its own; anything else is ``"module:Class"``."""
    module_name, class_name = backend.split(":", 1)
    engine_cls = getattr(importlib.import_module(module_name), class_name)
    return engine_cls(bucket_size=bucket_size_bytes, **engine_kwargs)


# --------------------------------------------------------------------------------------------------
# The consumer side a transport meets inside vLLM, transcribed from NVIDIA-NeMo/RL@7ea279abfbeb698b09
# 2856d0dab61e7cf39bc909: ``nemo_rl/models/generation/vllm/checkpoint_engine.py``
# ``VllmCheckpointEngineMixin`` (lines 83-173: ``init_checkpoint_engine``, ``prepare_checkpoint_engine``,
# ``init_checkpoint_engine_process_group``, ``finalize_checkpoint_engine``,
# ``_update_weights_from_checkpoint_engine_async``, ``update_weights_from_checkpoint_engine``) and
# ``vllm_backend.py`` ``VllmInternalWorkerExtension._load_hf_weights`` (:201) with ``_load_weights``
# (:574) reduced to its dispatch (the Gemma3 rename, draft and MTP-drafter feeds left out). ``self`` is
# vLLM's worker with the extension mixed in (``worker_extension_cls``, vllm_worker.py:586). Left out:
# NVTX wrappers, the sharded-expert path (``shard_expert_weights`` True) and the CUDA stream sync
# (``torch.cuda.current_stream().synchronize()`` after each batch, a no-op without CUDA).


def resolve_rollout_rank(rank_prefix: int, rollout_world_size: int) -> int:
    """checkpoint_engine.py:75 (torch.distributed's rank; 0 and a world of one when not initialized)."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == rollout_world_size:
        return rank
    return rank_prefix + rank


class VllmCheckpointEngineMixin:
    checkpoint_engine: Any

    def _load_full_hf_weights(self, policy_weights) -> None:  # vllm_backend.py:196
        self.model_runner.model.load_weights(weights=policy_weights)

    def _load_hf_weights(self, policy_weights) -> None:  # vllm_backend.py:201 under the mixin's :91
        if self.checkpoint_engine.shard_expert_weights:
            raise NotImplementedError("the sharded-expert path is not transcribed")
        if is_fp8_model(self.model_runner.vllm_config):
            raise AssertionError("NeMo-RL would re-quantize this batch (quantization/fp8.py load_weights)")
        self._load_full_hf_weights(policy_weights)

    def _load_weights(self, weights) -> None:  # vllm_backend.py:574, the dispatch only
        self._load_hf_weights(weights)

    def _maybe_process_fp8_kv_cache(self) -> None:  # vllm_backend.py:340 (no FP8 KV cache here)
        pass

    def init_checkpoint_engine(
        self, backend: str, bucket_size_bytes: int, engine_kwargs: dict[str, Any]
    ) -> None:
        if getattr(self, "checkpoint_engine", None) is not None:
            return
        self.checkpoint_engine = create_checkpoint_engine(
            backend, bucket_size_bytes=bucket_size_bytes, engine_kwargs=engine_kwargs
        )

    def prepare_checkpoint_engine(self) -> Any:
        metadata = self.checkpoint_engine.prepare()
        if isinstance(metadata, dict):
            metadata = {**metadata, "rank": resolve_rollout_rank(0, 1)}
            if self.checkpoint_engine.shard_expert_weights:
                raise NotImplementedError("the sharded-expert path is not transcribed")
        return metadata

    def init_checkpoint_engine_process_group(
        self, rank_prefix: int, train_world_size: int, rollout_world_size: int, metadata: list[Any]
    ) -> None:
        self.checkpoint_engine.init_rollout_process_group(
            rollout_rank=resolve_rollout_rank(rank_prefix, rollout_world_size),
            train_world_size=train_world_size,
            rollout_world_size=rollout_world_size,
            metadata=metadata,
        )

    def finalize_checkpoint_engine(self) -> None:
        checkpoint_engine = getattr(self, "checkpoint_engine", None)
        if checkpoint_engine is not None:
            checkpoint_engine.finalize()

    async def _update_weights_from_checkpoint_engine_async(self) -> bool:
        loaded_batches = 0
        async for weight_batch in self.checkpoint_engine.receive_weight_batches():
            loaded_batches += 1
            self._load_weights(weight_batch)
            del weight_batch
        self._maybe_process_fp8_kv_cache()
        self.loaded_batches = loaded_batches  # (NeMo-RL prints it; kept for the tests)
        return True

    def update_weights_from_checkpoint_engine(self) -> bool:
        import asyncio

        return asyncio.run(self._update_weights_from_checkpoint_engine_async())


def is_fp8_model(vllm_config: Any) -> bool:
    """quantization/fp8.py:315: the engine's quant config is vLLM's ``Fp8Config`` or
    ``ModelOptMxFp8Config`` (False where vLLM is not installed)."""
    try:
        from vllm.model_executor.layers.quantization.fp8 import Fp8Config
    except ImportError:
        return False
    try:
        from vllm.model_executor.layers.quantization.modelopt import ModelOptMxFp8Config
    except ImportError:
        types: tuple[type, ...] = (Fp8Config,)
    else:
        types = (Fp8Config, ModelOptMxFp8Config)
    return isinstance(getattr(vllm_config, "quant_config", None), types)
