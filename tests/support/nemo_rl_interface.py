"""NeMo-RL's weight-transport interface, transcribed: ``nemo_rl/utils/checkpoint_engines/base.py`` at
NVIDIA-NeMo/RL@2bce06890714a2c3f60977f22e0c13e432f409f0 (the PyPI ``nemo-rl`` is a 0.0.0 placeholder
without it, and CI reaches no GitHub). Transcribed are only the parts a transport meets: the abstract
methods with their keyword-only parameters, and ``create_checkpoint_engine``'s way of building one
(``"module:Class"`` imported, then ``Class(bucket_size=..., **engine_kwargs)``).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import Any


class CheckpointEngine(ABC):
    cleanup_after_load: bool = True

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
