"""Megatron-Core through its real bridge (megatron-core 0.19.2, megatron-bridge 0.6.2, gloo on the
CPU): README's one call on every rank, ``push_megatron`` (the bridge's whole export streamed with
``replicated=True``), into real ``refitd serve`` daemons, at TP=1, TP=2, EP=2, PP=2, DP=2,
TP=2 x EP=2, TP=2 x PP=2 and PP=2 x EP=2; each of two steps, in block-FP8, MXFP8, NVFP4 and INT4
(W4A16), publishes byte for byte what ``refitd convert`` makes of the bridge's export of the same
weights, and every rank (of every PP stage) read the whole model from the export, alike. Each
layout's second step forces the order of arrival that deadlocked README's old recipe (every other
rank inside the export's collectives before rank 0 calls ``push_megatron``).

One set of rank processes and daemons per world size runs its layouts one after another (the
process group and the daemons reused; Megatron's parallel state made again per layout): the spawns,
not the steps, are what costs here.

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
FORMATS = ("block_fp8", "mxfp8", "nvfp4", "int4_w4a16")
#: world size -> its layouts, run in turn by the same ranks: id -> (TP, PP, EP), DP the rest
WORLDS = {
    1: {"tp1": (1, 1, 1)},
    2: {"tp2": (2, 1, 1), "ep2": (1, 1, 2), "pp2": (1, 2, 1), "dp2": (1, 1, 1)},
    4: {"tp2xep2": (2, 1, 2), "tp2xpp2": (2, 2, 1), "pp2xep2": (1, 2, 2)},
}
STEPS = 2
#: a layout (its model, two steps, the oracle's dumps) must end within this, after the ranks' imports
RUN_S = 120
IMPORT_S = 300

HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None  # the ranks import it (with workarounds)

if not HAVE_MEGATRON:
    if os.environ.get("REFITD_REQUIRE_MEGATRON") == "1":
        raise RuntimeError(
            "REFITD_REQUIRE_MEGATRON=1 but megatron-bridge is not installed: run tests/setup_megatron.sh"
        )
    pytest.skip("Megatron runs in .venv-megatron: make test-megatron", allow_module_level=True)

from sidecar.cli.main import main as refitd_main  # noqa: E402
from sidecar.plan.build import meta_state_dict  # noqa: E402

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
        self.socket, self.log_path = run / "control.sock", root / f"daemon-{fmt}.log"

    def wait_listening(self, deadline: float) -> None:
        while not self.socket.exists():
            assert self.proc.poll() is None, self.log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, f"{self.log_path.name}: the daemon did not listen in time"
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


@pytest.mark.parametrize("world", list(WORLDS), ids=["-".join(WORLDS[w]) for w in WORLDS])
def test_megatron_export_publishes_convert_bytes(world, tmp_path, free_port):
    layouts = WORLDS[world]
    config = tmp_path / "config.json"
    config.write_text(json.dumps(CONFIG))
    # the daemons and the ranks start together: a rank's first push (its HELLO) comes after its
    # imports and its model, and the client's socket connects once the daemon listens
    daemons = [Daemon(tmp_path, fmt, world, config) for fmt in FORMATS]
    procs, logs = [], []
    try:
        port = free_port()
        for rank in range(world):
            log = open(tmp_path / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
            logs.append(log)
            env = child_env(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(port), OMP_NUM_THREADS="1")  # fmt: skip
            cmd = [sys.executable, str(RANK), "--dir", str(tmp_path), "--steps", str(STEPS)]
            cmd += [a for sizes in layouts.values() for a in ("--layout", ",".join(map(str, sizes)))]
            cmd += [a for d in daemons for a in ("--endpoint", d.endpoint)]
            procs.append(subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 120
        for d in daemons:
            d.wait_listening(deadline)
        limit = IMPORT_S + RUN_S * len(layouts)
        wait_ranks(procs, tmp_path, time.monotonic() + limit, limit)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
        for d in daemons:
            d.stop()
    whole = set(meta_state_dict(CONFIG))  # the whole model, from its config alone
    for index, name in enumerate(layouts):
        for step in range(index * STEPS, (index + 1) * STEPS):
            check_step(tmp_path, world, name, step, whole)
        # the layout's steps changed the weights: its second generation is not its first
        first, second = (tensors(tmp_path / f"export{s}") for s in (index * STEPS, index * STEPS + 1))
        assert not same_bytes(first["model.embed_tokens.weight"], second["model.embed_tokens.weight"])


def wait_ranks(procs: list[subprocess.Popen], root: Path, deadline: float, limit: float) -> None:
    """Until every rank exits 0; the first that fails fails the test at once (the others may be
    left waiting in a collective for it)."""
    running = dict(enumerate(procs))
    while running:
        for rank, p in list(running.items()):
            if p.poll() is not None:
                assert p.returncode == 0, f"rank {rank} failed: {_tail(root / f'rank{rank}.log')}"
                del running[rank]
        if not running:
            return
        if time.monotonic() > deadline:
            rank = min(running)
            pytest.fail(f"rank {rank} did not finish within {limit} s: {_tail(root / f'rank{rank}.log')}")
        with contextlib.suppress(subprocess.TimeoutExpired):
            next(iter(running.values())).wait(0.2)


def check_step(root: Path, world: int, layout: str, step: int, whole: set[str]) -> None:
    """Every rank's export of ``step`` was the whole model, alike; each daemon published what
    ``refitd convert`` makes of it, byte for byte."""
    where = f"{layout} step {step}"
    # every rank, of every PP stage, read the whole model from the bridge, alike
    digests = [(root / f"digest{step}_rank{r}.txt").read_text() for r in range(world)]
    assert all(d == digests[0] for d in digests), f"{where}: the ranks' exports differ"
    names = {line.split(" ", 1)[0] for line in digests[0].splitlines()}
    assert names == whole, f"{where}: the export lacks {sorted(whole - names)[:10]}"
    export = root / f"export{step}"
    for i, fmt in enumerate(FORMATS):
        want = root / f"want{step}_{fmt}"
        assert refitd_main(["convert", "--format", fmt, str(export), str(want)]) == 0
        expected, published = tensors(want), tensors(root / f"published{step}_{i}")
        assert set(published) == set(expected), (
            f"{where} {fmt}: {sorted(set(published) ^ set(expected))[:10]}"
        )
        bad = [n for n, t in expected.items() if not same_bytes(published[n], t)]
        assert not bad, f"{where} {fmt}: {len(bad)} of {len(expected)} tensors differ: {bad[:5]}"
        # the experts quantized: FP8 / packed 4-bit bytes, or INT4 packed in int32
        assert any(t.dtype.itemsize == 1 or not t.is_floating_point() for t in published.values())


def _tail(path: Path) -> str:
    lines = [ln for ln in path.read_text(errors="replace").splitlines() if "warn" not in ln.lower()]
    return "\n".join(lines[-40:])
