"""A real training loop pushing to refitd: tiny transformers 5.x MoE models (Qwen3-MoE, DeepSeek-V3)
under FSDP2 over two gloo processes on CPU take AdamW steps and push ``model.state_dict()`` after each.

What it holds the daemon and the client to (tests/support/fsdp_trainer.py runs the ranks):

* the state dict goes in as it lies: FP32 DTensors (``Shard(0)``, uneven last shards), the routed
  experts fused as transformers 5.x modules hold them, against a daemon planned from the
  ``config.json`` transformers' ``save_pretrained`` writes (``num_local_experts``, ``dtype``);
* no collective runs while ``push_step`` does (counted; the same counter sees ``full_tensor()``'s);
* every published generation equals ``convert`` of the gathered full state dict, byte for byte;
* the engine side (the same transformers class loading the dequantized generation) tracks the
  trainer's logits: the KL per step and format is printed (``-s`` shows it) and bounded.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import queue
from pathlib import Path

import pytest

pytest.importorskip("transformers", minversion="5.0", reason="the test extra: pip install -e '.[test]'")

from support import fsdp_trainer

SPAWN = mp.get_context("spawn")
WORLD = 2
STEPS = 3
FORMATS = ("mxfp8", "block_fp8", "fp8_per_tensor")
#: a generous bound: the engine's FP8 weights against the trainer's FP32 masters, tiny random model
KL_BOUND = 1e-3
RESULT_TIMEOUT_S = 240


def save_config(model: str, folder: Path) -> Path:
    """config.json as transformers' ``save_pretrained`` writes it (5.x field names)."""
    fsdp_trainer.make_config(model).save_pretrained(folder)
    return folder / "config.json"


@pytest.mark.parametrize(
    "model, parallel, formats",
    [("qwen3_moe", "fsdp", FORMATS), ("deepseek_v3", "fsdp", FORMATS), ("qwen3_moe", "tp", FORMATS[:1])],
)
def test_training_loop_pushes_dtensor_shards(model, parallel, formats, tmp_path, daemons):
    path = save_config(model, tmp_path / "hf")
    config = json.loads(path.read_text())
    assert ("num_experts" not in config and "n_routed_experts" in config) or "num_local_experts" in config
    started = {
        fmt: daemons(
            hf_config=config, world_size=WORLD, format=fmt, staging_bytes=8 << 20, runtime_dir=tmp_path / fmt
        )
        for fmt in formats
    }
    job = {
        "model": model,
        "parallel": parallel,
        "steps": STEPS,
        "init_file": str(tmp_path / "gloo-init"),
        "config_path": str(path),
        "daemons": {fmt: d.endpoint for fmt, d in started.items()},
    }
    results = SPAWN.Queue()
    procs = [SPAWN.Process(target=fsdp_trainer.run_rank, args=(r, WORLD, job, results)) for r in range(WORLD)]
    for p in procs:
        p.start()
    rows, done = [], 0
    try:
        while done < WORLD:
            try:
                row = results.get(timeout=RESULT_TIMEOUT_S)
            except queue.Empty:
                pytest.fail(f"the trainer ranks sent nothing for {RESULT_TIMEOUT_S} s; rows so far: {rows}")
            assert "error" not in row, f"rank {row['rank']} failed:\n{row['error']}"
            if row.get("done"):
                done += 1
            else:
                rows.append(row)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert len(rows) == STEPS * len(formats)
    print(f"\n{model} ({parallel}): KL(trainer || engine) per step and format")
    for row in rows:
        print(
            f"  step {row['step']}  {row['fmt']:<15} KL {row['kl']:.3e}  (BF16-rounded masters, same step: "
            f"{row['kl_bf16']:.3e}, ratio {row['kl'] / max(row['kl_bf16'], 1e-30):.1f})  loss {row['loss']:.4f}"
        )
    for row in rows:
        where = f"{model} step {row['step']} {row['fmt']}"
        assert row["gen_step"] == row["step"], where
        assert not row["differ"] and not row["extra"], (
            f"{where}: not convert's bytes: {row['differ']} {row['extra']}"
        )
        assert row["collectives"] == [], f"{where}: push_step ran collectives {row['collectives']}"
        assert row["gather_collectives"] > 0, "the collective counter saw no full_tensor(): it cannot fail"
        assert row["norm_dtypes"] == ["torch.bfloat16"], (
            f"{where}: FP32 masters' norms published as {row['norm_dtypes']}"
        )
        assert 0 <= row["kl"] < KL_BOUND, f"{where}: KL {row['kl']}"
        # FSDP2: dim-0 shards; TP: column-parallel q/k/v on dim 0, row-parallel o_proj on dim 1
        assert row["placements"] == (["S(0)"] if parallel == "fsdp" else ["S(0)", "S(1)"]), row["placements"]


def test_refitd_serve_starts_on_the_config_save_pretrained_writes(tmp_path):
    """``refitd serve --hf-config`` on transformers 5.x's own Qwen3-MoE config.json (``num_local_experts``
    where refitd read ``num_experts``, ``dtype``) starts and answers STATUS."""
    model = "qwen3_moe"
    import signal
    import subprocess
    import sys
    import time

    from adapters.base import RefitReader
    from sidecar.errors import RefitError

    path = save_config(model, tmp_path / "hf")
    run = tmp_path / "run"
    argv = [sys.executable, "-m", "sidecar.cli", "serve", "--hf-config", str(path), "--runtime-dir", str(run),
            "--world-size", "2", "--format", "mxfp8"]  # fmt: skip
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        with RefitReader(f"ipc://{run / 'control.sock'}", name="probe") as probe:
            while True:
                assert proc.poll() is None, f"refitd serve exited {proc.returncode}:\n{log.read_text()}"
                try:
                    status = probe.status(timeout=0.5)
                    break
                except RefitError:
                    assert time.monotonic() < deadline, f"refitd serve not ready:\n{log.read_text()}"
        assert status.get("instance")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
