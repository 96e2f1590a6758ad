"""One trainer rank of tests/test_megatron.py: real Megatron-Core and Megatron-Bridge over gloo.

A tiny Qwen3-MoE imported with ``AutoBridge.from_hf_config`` from the ``config.json`` in ``--dir``,
split ``--tp`` x ``--ep``; each step changes the weights, then makes README's one call
(``integrations.megatron.push_megatron``: the bridge's whole export streamed with
``replicated=True``) into the ``refitd serve`` daemon at ``--endpoint``. For the test's oracle every
rank then reads the export again (its collectives) and rank 0 writes it as a BF16 checkpoint
(``--dir/export{step}``) and the daemon's live generation (``refitd convert --from-daemon``,
``--dir/published{step}``) before the next step.

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/support/megatron_rank.py ...
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the repository: refitd, tests.support

from tests.support.megatron_cpu import install, provider_settings  # noqa: E402

install()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.bridge import AutoBridge  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from integrations.megatron import declare_of, push_megatron  # noqa: E402
from sidecar.cli.main import main as refitd_main  # noqa: E402
from sidecar.client import RefitClient  # noqa: E402


def build(args: argparse.Namespace):
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tp, expert_model_parallel_size=args.ep
    )
    bridge = AutoBridge.from_hf_config(AutoConfig.from_pretrained(args.dir))
    provider = bridge.to_megatron_provider(load_weights=False)
    provider.tensor_model_parallel_size, provider.expert_model_parallel_size = args.tp, args.ep
    provider_settings(provider)
    provider.finalize()
    model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
    return bridge, model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", action="append", required=True, help="a daemon (repeat: one push each)")
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234)
    bridge, model = build(args)
    declare = declare_of(bridge)
    config = (args.dir / "config.json").read_text()
    clients = [RefitClient(e, rank=rank, world_size=world, timeout=300) for e in args.endpoint]
    for step in range(args.steps):
        with torch.no_grad():  # "training": every rank changes its shards alike
            for p in model[0].parameters():
                p.mul_(1.0 + 0.25 * step).add_(0.01 * (step + 1))
        for client in clients:
            result = push_megatron(client, step, bridge, model, declare=declare)  # README's call
            print(
                f"rank {rank} step {step}: generation {result.generation}, {result.bytes_in} bytes in",
                flush=True,
            )
        export = {
            n: t.detach().to("cpu").contiguous().clone()
            for n, t in bridge.export_hf_weights(model, show_progress=False)
        }
        if rank == 0:
            out = args.dir / f"export{step}"
            out.mkdir()
            save_file(export, str(out / "model.safetensors"))
            (out / "config.json").write_text(config)
            for i, endpoint in enumerate(args.endpoint):
                args_ = ["convert", "--from-daemon", endpoint, "--config", str(args.dir / "config.json"),
                         "--min-step", str(step), "--timeout", "120", str(args.dir / f"published{step}_{i}")]  # fmt: skip
                assert refitd_main(args_) == 0, f"refitd {' '.join(args_)} failed"
        dist.barrier()
    for client in clients:
        client.close()
    dist.destroy_process_group()
    os._exit(0)  # Megatron's and gloo's threads: nothing left to flush


if __name__ == "__main__":
    main()
