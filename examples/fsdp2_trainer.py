"""An FSDP2 trainer that pushes its weights to refitd after every optimizer step.

A tiny transformers 5.x Qwen3-MoE model, sharded with ``fully_shard`` (FSDP2), trained with AdamW on
random tokens; after each step every rank calls ``push_step(step, model.state_dict())``: each rank
sends its own DTensor shards (FP32 masters, experts fused as transformers holds them) and the daemon
publishes the checkpoint's names and dtypes, quantized. Runs on CPU with gloo::

    python examples/fsdp2_trainer.py --write-config /tmp/qwen3-moe        # config.json, as save_pretrained writes it
    refitd serve --hf-config /tmp/qwen3-moe/config.json --world-size 2 --format mxfp8 \\
        --staging-bytes 64MiB --runtime-dir /tmp/refitd &                 # FP32 masters: 2x BF16 staging
    torchrun --nproc-per-node 2 examples/fsdp2_trainer.py --endpoint ipc:///tmp/refitd/control.sock

On GPUs use the ``nccl`` backend and ``init_device_mesh("cuda", ...)``; nothing else changes.
Needs ``pip install -e '.[test]'`` (transformers 5.x).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from sidecar.client import RefitClient


def config() -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        vocab_size=1024, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
        dtype="bfloat16",  # the checkpoint's dtype: what the engine holds, and what refitd publishes
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--endpoint", default="ipc:///tmp/refitd/control.sock")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument(
        "--write-config", metavar="DIR", help="write config.json for `refitd serve --hf-config` and exit"
    )
    args = ap.parse_args()
    if args.write_config:
        config().save_pretrained(args.write_config)
        return
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights everywhere, as loading a checkpoint would give
    model = Qwen3MoeForCausalLM(config())
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with RefitClient(args.endpoint, rank=rank, world_size=world) as client:
        for step in range(args.steps):
            tokens = torch.randint(0, model.config.vocab_size, (2, 32))
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            optim.step()
            optim.zero_grad()
            # each rank's local shards, where they lie: no all-gather, no full_tensor()
            result = client.push_step(step, model.state_dict())
            if rank == 0:
                print(f"step {step}: loss {loss.item():.4f}, generation {result.generation}, "
                      f"{result.bytes_in / 2**20:.1f} MiB in -> {result.bytes_out / 2**20:.1f} MiB out")  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
