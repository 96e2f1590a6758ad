"""The demo's rollout engines: each attaches to ``refitd serve`` with its manifest, loads every
step's generation through refitd's engine worker and samples from what it holds.

* :class:`ReferenceRollouts`: refitd's pure-torch reference engine (``adapters.reference``), which
  holds the routed experts in the format asked (BF16 slabs, block-FP8, MXFP8, NVFP4, INT4 W4A16) and
  computes with them dequantized, as the FP8 and 4-bit engines' kernels do.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from examples.rl_demo import policy


@dataclass
class Refit:
    step: int  # the step the engine now holds
    pause_s: float  # generation stopped for the refit: the load into the engine, until it can sample
    load_s: float  # the load alone, as the engine worker reports it to the daemon


class ReferenceRollouts:
    """The reference engine for ``fmt``, attached to the daemon at ``endpoint``."""

    def __init__(self, endpoint: str, hf_config: dict[str, Any], fmt: str, name: str = "rl-demo-engine"):
        from adapters.engine import EngineWorker
        from adapters.reference import ReferenceEngine

        self.engine = ReferenceEngine.from_config(hf_config, expert_format=fmt)
        self.worker = EngineWorker(
            endpoint,
            name=name,
            manifest=self.engine.manifest(),
            load=lambda g: self.engine.load(g.tensors),
            load_group=lambda g, names: self.engine.load_part({n: g.tensors[n] for n in names}),
        )

    def attach(self, timeout: float = 60.0) -> None:
        self.worker.attach(timeout=timeout)

    def refit(self, min_step: int, timeout: float = 120.0) -> Refit:
        """Wait for a generation of ``min_step`` or later, load it whole and intact; the pause is the
        load (from the published generation held to every tensor copied in) and the first forward
        pass's dequantization of the experts (the reference engine caches them dequantized)."""
        loaded = self.worker.load_intact(min_step=min_step, timeout=timeout)
        if not loaded.ok:
            raise RuntimeError(f"the engine could not load step {loaded.step}: {loaded.error}")
        t0 = time.perf_counter()
        with torch.no_grad():
            self.engine.forward(torch.zeros(1, 1, dtype=torch.long))
        warm = time.perf_counter() - t0
        return Refit(step=loaded.step, pause_s=loaded.seconds + warm, load_s=loaded.seconds)

    def rollouts(self, prompt_ids: torch.Tensor, task: policy.Task, seed: int) -> dict[str, Any]:
        with torch.no_grad():
            return policy.sample(self.engine.forward, prompt_ids, task, seed)

    def close(self) -> None:
        self.worker.detach()
