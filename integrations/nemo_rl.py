"""refitd as a NeMo-RL weight transport: ``policy.generation.refit_transport: "module:Class"``.

NeMo-RL (``nemo_rl/utils/checkpoint_engines/base.py``, read at NVIDIA-NeMo/RL@2bce0689 and
@7ea279ab) builds the
transport named ``"module:Class"`` with ``create_checkpoint_engine``: ``Class(bucket_size=...,
**engine_kwargs)`` in every policy worker and in every vLLM worker; then ``prepare()`` everywhere,
``init_policy_process_group(worker_rank=, train_world_size=, rollout_world_size=, metadata=)`` on
the policy side, ``init_rollout_process_group(rollout_rank=, ...)`` inside vLLM, ``send_weights``
(policy) while the vLLM workers iterate ``receive_weight_batches`` and load each batch with their own
loader, and ``finalize()``. The config (the ``refit_cfg`` entry becomes the constructor's keywords,
``weight_sync/checkpoint_engine_config.py``)::

    policy:
      generation:
        refit_transport: "integrations.nemo_rl:RefitdCheckpointEngine"
        refit_cfg:
          "integrations.nemo_rl:RefitdCheckpointEngine": {hf_config: /models/m/config.json}
        vllm_kwargs: {quantization: fp8, hf_config_path: /models/m-refitd}   # FP8/4-bit only

What crosses: every policy rank hands ``send_weights`` the same gathered Hugging Face tensors (the
DTensor worker's ``full_tensor()``, the Megatron bridge's export); each is pushed by one rank
(``replicated=True``, :mod:`integrations.push`). The daemon quantizes (FP8, MXFP8, 4-bit) and
publishes. Inside a vLLM worker, ``receive_weight_batches`` loads the published generation into the
worker's model itself, through refitd's vLLM adapter (vLLM's layerwise reload, then
``process_weights_after_loading``), and yields no batch: NeMo-RL's own loader would re-quantize a
quantized one (:mod:`integrations.nemo_rl_vllm` has the facts, file and line in NeMo-RL). The engine
is built in refitd's format by two ``vllm_kwargs`` (``quantization``, ``hf_config_path``) that
``python -m integrations.nemo_rl_vllm`` prints; ``vllm_cfg.precision`` stays ``bfloat16``.

Where the transport runs outside a NeMo-RL vLLM worker (no worker owns it), it yields a BF16
generation as one batch and refuses a quantized one. Framework-free: NeMo-RL is never imported (its
base class is abstract only; ``create_checkpoint_engine`` instantiates by name). At @7ea279ab
NeMo-RL's vLLM mixin reads ``shard_expert_weights`` of every transport: False here.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncGenerator, Iterable, Mapping
from typing import Any

import torch

from adapters.base import RefitReader
from integrations.nemo_rl_vllm import detach, find_worker, load_in_worker
from integrations.push import GatheredPush, read_hf_config
from sidecar.errors import ErrorKind, RefitError

SETTING = 'policy.generation.refit_cfg["integrations.nemo_rl:RefitdCheckpointEngine"].hf_config'


class RefitdCheckpointEngine:
    """One per NeMo-RL worker (policy or vLLM). ``engine_kwargs``: ``hf_config`` (required),
    ``endpoint`` (the node's daemon; default ``$REFITD_ENDPOINT`` or a default daemon's socket),
    ``wait`` (``"published"``, ``"committed"``), ``timeout`` seconds, ``name`` (the reader's name in
    the daemon's status). ``bucket_size`` is not used: the daemon owns the staging memory."""

    #: NeMo-RL frees the CUDA cache after a load when this is set
    cleanup_after_load: bool = True
    #: NeMo-RL's vLLM mixin reads it (checkpoint_engine.py:93, :116): refitd sends whole tensors
    shard_expert_weights: bool = False

    def __init__(
        self,
        bucket_size: int = 0,
        *,
        hf_config: str | Mapping[str, Any] | None = None,
        endpoint: str | None = None,
        wait: str = "published",
        timeout: float = 600.0,
        name: str | None = None,
        **unused: Any,
    ) -> None:
        if unused:  # NeMo-RL's own call may grow keywords (e.g. a default device): never fatal
            self.unused = dict(unused)
        self.bucket_size = bucket_size
        self.pusher = GatheredPush(
            read_hf_config(hf_config, where=SETTING), endpoint=endpoint, wait=wait, timeout=timeout
        )
        self.name = name
        self.rollout_rank: int | None = None
        self.last_loaded: int | None = None
        #: the vLLM worker this transport loads into (integrations.nemo_rl_vllm.find_worker)
        self.worker: Any = None

    def get_target_weight_layout(self) -> None:
        """NeMo-RL's hook for expert-sharded transfers: none (whole tensors)."""
        return None

    def prepare(self) -> dict[str, Any]:
        return {"endpoint": self.pusher.endpoint}

    def init_policy_process_group(
        self, *, worker_rank: int, train_world_size: int, rollout_world_size: int, metadata: list[Any]
    ) -> None:
        self.pusher.set_rank(worker_rank, train_world_size)

    def init_rollout_process_group(
        self, *, rollout_rank: int, train_world_size: int, rollout_world_size: int, metadata: list[Any]
    ) -> None:
        self.rollout_rank = rollout_rank
        self.worker = find_worker(self, sys._getframe(1))

    def finalize(self) -> None:
        """NeMo-RL's release (``release_after_refit``): the worker detaches from the daemon; the next
        refit attaches again. The daemon's generation outlives it."""
        if self.worker is not None and getattr(self.worker, "_refit", None) is not None:
            detach(self.worker)

    def close(self) -> None:
        self.finalize()
        self.pusher.close()

    @property
    def reader_name(self) -> str:
        return self.name or f"nemo-rl-rollout{self.rollout_rank if self.rollout_rank is not None else ''}"

    async def send_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], step: int | None = None
    ) -> dict:
        """Push this rank's view of the gathered stream (read on a worker thread, gathers included)."""
        device = torch.cuda.current_device() if torch.cuda.is_available() else None

        def run() -> dict[str, Any]:
            if device is not None:
                torch.cuda.set_device(device)
            return self.pusher.push(weights, step)

        return await asyncio.to_thread(run)

    async def receive_weight_batches(self) -> AsyncGenerator[list[tuple[str, torch.Tensor]], None]:
        """Inside a vLLM worker: the next generation the daemon publishes after the last one this
        worker loaded (the first call: the live one, once there is one). NeMo-RL tells a transport no
        step number, so a first refit that starts before the trainer's push is published loads the
        generation live before it. With the worker found (NeMo-RL's vLLM mixin owns this transport),
        it is loaded in place through refitd's vLLM adapter and no batch is yielded; otherwise a BF16
        generation is yielded as one batch (a quantized one is refused), released after it."""
        min_step = 0 if self.last_loaded is None else self.last_loaded + 1
        timeout = self.pusher.timeout
        if self.worker is None:
            self.worker = find_worker(self, sys._getframe(1))
        if self.worker is not None:
            result = load_in_worker(
                self.worker, self.pusher.endpoint, name=self.reader_name, min_step=min_step, timeout=timeout
            )
            self.last_loaded = int(result["step"])
            return
        with RefitReader(self.pusher.endpoint, name=self.reader_name, timeout=timeout) as reader:
            gen = await asyncio.to_thread(reader.wait, min_step=min_step, timeout=timeout)
            try:
                quantized = sorted(
                    {str(t.dtype) for t in gen.tensors.values()} - {"torch.bfloat16", "torch.float32"}
                )
                if quantized:
                    raise RefitError(
                        f"step {gen.step} is published quantized ({', '.join(quantized)}) and this transport runs "
                        "outside a NeMo-RL vLLM worker (no worker's checkpoint_engine is it), so it cannot load it "
                        "through refitd's vLLM adapter, and NeMo-RL's loader would re-quantize it: call it from "
                        "NeMo-RL's VllmCheckpointEngineMixin, load with adapters.vllm.refit_engine, or run the "
                        "daemon with --format bf16",
                        kind=ErrorKind.ENGINE,
                        step=gen.step,
                    )
                yield [(n, t.clone()) for n, t in gen.tensors.items()]
                self.last_loaded = gen.step
            finally:
                reader.release(gen)
