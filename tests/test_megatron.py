"""Megatron-Core through its real bridge (megatron-core 0.19.2, megatron-bridge 0.6.2, gloo on the
CPU): README's one call on every rank, ``push_megatron`` (the bridge's whole export streamed with
``replicated=True``), into real ``refitd serve`` daemons, at TP=1, TP=2, EP=2 and TP=2 x EP=2; each
of two steps, in block-FP8 and NVFP4, publishes byte for byte what ``refitd convert`` makes of
the bridge's export of the same weights.

Runs in .venv-megatron (``make test-megatron``; tests/setup_megatron.sh); skipped elsewhere, failed
instead when REFITD_REQUIRE_MEGATRON=1 (the make target). The CPU workarounds are all in
tests/support/megatron_cpu.py; tests/support/megatron_rank.py is one rank.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RANK = REPO / "tests" / "support" / "megatron_rank.py"
FORMATS = ("block_fp8", "nvfp4")
#: a whole run (imports, model, two steps, the oracle's dumps) must end by then
RUN_S = 600

HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None  # the ranks import it (with workarounds)

if not HAVE_MEGATRON:
    if os.environ.get("REFITD_REQUIRE_MEGATRON") == "1":
        raise RuntimeError(
            "REFITD_REQUIRE_MEGATRON=1 but megatron-bridge is not installed: run tests/setup_megatron.sh"
        )
    pytest.skip("Megatron runs in .venv-megatron: make test-megatron", allow_module_level=True)

from sidecar.cli.main import main as refitd_main  # noqa: E402

#: a tiny Qwen3-MoE, as transformers 5.x writes its config (moe_intermediate_size / TP stays a
#: multiple of 128: block-FP8's rule)
CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "dtype": "bfloat16",
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_experts": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": False,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-06,
    "max_position_embeddings": 512,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "attention_bias": False,
    "tie_word_embeddings": False,
}


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child process: refitd refuses REFITD_ variables it does not know (this
    test's REFITD_REQUIRE_MEGATRON)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("REFITD_REQUIRE_")}
    return {**env, "PYTHONPATH": str(REPO), **extra}


class Daemon:
    """A real ``refitd serve`` process for ``world`` ranks."""

    def __init__(self, root: Path, fmt: str, world: int, config: Path):
        run = root / f"run-{fmt}"
        run.mkdir(mode=0o700)
        self.endpoint = f"ipc://{run}/control.sock"
        self.log = open(root / f"daemon-{fmt}.log", "w")  # noqa: SIM115 - closed in stop()
        env = child_env()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sidecar.cli.main", "serve", "--runtime-dir", str(run), "--hf-config",
             str(config), "--format", fmt, "--world-size", str(world), "--log-level", "warning"],
            env=env, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while not (run / "control.sock").exists():
            assert self.proc.poll() is None, (root / f"daemon-{fmt}.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the daemon did not listen within 120 s"
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def tensors(directory: Path) -> dict:
    from safetensors.torch import load_file

    out: dict = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def same_bytes(a, b) -> bool:
    import torch

    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


@pytest.mark.parametrize(("tp", "ep"), [(1, 1), (2, 1), (1, 2), (2, 2)], ids=["tp1", "tp2", "ep2", "tp2xep2"])
def test_megatron_export_publishes_convert_bytes(tp, ep, tmp_path, free_port):
    world = tp * ep
    config = tmp_path / "config.json"
    config.write_text(json.dumps(CONFIG))
    daemons = [Daemon(tmp_path, fmt, world, config) for fmt in FORMATS]
    procs, logs = [], []
    try:
        port = free_port()
        for rank in range(world):
            log = open(tmp_path / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
            logs.append(log)
            env = child_env(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(port), OMP_NUM_THREADS="1")  # fmt: skip
            cmd = [sys.executable, str(RANK), "--dir", str(tmp_path), "--tp", str(tp), "--ep", str(ep)]
            for d in daemons:
                cmd += ["--endpoint", d.endpoint]
            procs.append(subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + RUN_S
        for rank, p in enumerate(procs):
            try:
                p.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(
                    f"rank {rank} did not finish within {RUN_S} s: {_tail(tmp_path / f'rank{rank}.log')}"
                )
            assert p.returncode == 0, f"rank {rank} failed: {_tail(tmp_path / f'rank{rank}.log')}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
        for d in daemons:
            d.stop()
    for step in range(2):
        export = tmp_path / f"export{step}"
        for i, fmt in enumerate(FORMATS):
            want = tmp_path / f"want{step}_{fmt}"
            assert refitd_main(["convert", "--format", fmt, str(export), str(want)]) == 0
            expected, published = tensors(want), tensors(tmp_path / f"published{step}_{i}")
            assert set(published) == set(expected), sorted(set(published) ^ set(expected))[:10]
            bad = [n for n, t in expected.items() if not same_bytes(published[n], t)]
            assert not bad, f"step {step} {fmt}: {len(bad)} of {len(expected)} tensors differ: {bad[:5]}"
            assert any(t.dtype.itemsize == 1 for t in published.values())  # experts quantized
    # both steps changed the weights: the second generation is not the first
    assert not same_bytes(*(tensors(tmp_path / f"export{s}")["model.embed_tokens.weight"] for s in (0, 1)))


def _tail(path: Path) -> str:
    lines = [ln for ln in path.read_text(errors="replace").splitlines() if "warn" not in ln.lower()]
    return "\n".join(lines[-40:])
