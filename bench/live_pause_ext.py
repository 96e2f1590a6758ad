"""The worker extension bench/live_pause.py starts vLLM with: refitd's (adapters.vllm.RefitWorkerExtension)
plus vLLM's own reload path fed from worker memory, for a same-engine comparison."""

from __future__ import annotations

from adapters.vllm import RefitWorkerExtension, ordered_weights


class PauseBenchExtension(RefitWorkerExtension):
    def bench_stage(self, endpoint: str, step: int) -> int:
        """Copy generation ``step``'s tensors (BF16, checkpoint names) into this worker's memory, outside
        any pause: what an RL framework's own transfer would have delivered to the worker."""
        from adapters.base import RefitReader

        with RefitReader(endpoint, name=f"bench-stage-{self.rank}") as reader:
            gen = reader.wait(min_step=step, timeout=120)
            try:
                self._bench_weights = [(n, t.clone()) for n, t in ordered_weights(gen.tensors)]
            finally:
                reader.release(gen)
        return gen.step

    def bench_vllm_reload(self) -> None:
        """vLLM's own path: ``Worker.reload_weights(weights_iterator=..., is_checkpoint_format=True)``
        (layerwise reload, reload/inplace.py) of the staged tensors."""
        self.reload_weights(weights_iterator=iter(self._bench_weights), is_checkpoint_format=True)
