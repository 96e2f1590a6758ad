"""The rollout side of refitd's verl backend: the worker extension verl's vLLM servers run.

Named in the rollout config (verl 0.9.1 lays ``engine_kwargs.vllm`` over its own vLLM arguments, so it
replaces verl's ``worker_extension_cls``)::

    +actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls=integrations.verl_vllm.RefitdVerlWorkerExtension

It is verl's own ``vLLMColocateWorkerExtension`` (LoRA, sleep mode and the rest keep working) with
refitd's ``adapters.vllm.RefitWorkerExtension`` mixed in, plus :meth:`refitd_load`, which
``integrations.verl.RefitdCheckpointEngineManager`` calls on every worker through the server's
``collective_rpc``. vLLM loads through its own loader (layerwise reload), never verl's
``load_quanted_weights``. The vLLM arguments that keep what refitd keeps in BF16 come from
``adapters.vllm.vllm_engine_args``; give them as ``engine_kwargs.vllm.quantization`` /
``hf_overrides`` and leave ``rollout.quantization`` unset. Imported inside vLLM's worker processes
only (it imports vLLM through verl's extension).
"""

from __future__ import annotations

from typing import Any

from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

from adapters.vllm import RefitWorkerExtension
from sidecar.errors import ErrorKind, RefitError


class RefitdVerlWorkerExtension(vLLMColocateWorkerExtension, RefitWorkerExtension):
    def refitd_load(self, endpoint: str, min_step: int, timeout: float | None = None) -> dict[str, Any]:
        """Attach on first use (this worker's manifest), then load the generation >= ``min_step``.
        Raises on failure: verl's server ``collective_rpc`` returns nothing, so an error is the only
        way a failure reaches the manager."""
        if getattr(self, "_refit", None) is None:
            self.refit_attach(endpoint, timeout=timeout or 600.0)
        result = self.refit_load(min_step=min_step, timeout=timeout)
        if not result.get("ok"):
            raise RefitError(
                f"{result.get('worker')}: {result.get('error')}", kind=ErrorKind.ENGINE, step=min_step
            )
        return result
