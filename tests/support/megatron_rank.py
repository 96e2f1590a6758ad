"""One trainer rank of tests/test_megatron.py: real Megatron-Core and Megatron-Bridge over gloo.

A tiny Qwen3-MoE imported with ``AutoBridge.from_hf_config`` from the ``config.json`` in ``--dir``,
built in turn in each ``--layout TP,PP,EP`` (DP the rest of the world) in the same process group
(Megatron's parallel state torn down and made again between layouts: one spawn for several). In each
layout each of ``--steps`` steps changes the weights, then makes README's one call
(``integrations.megatron.push_megatron``: the bridge's whole export streamed with
``replicated=True``) into each ``refitd serve`` daemon at ``--endpoint``; the steps count on across
layouts (layout i's steps are ``i * steps ...``). For the test's oracle every rank then reads the
export again (its collectives) and writes its digest (``--dir/digest{step}_rank{r}.txt``: every rank
of every PP stage yields the whole model), and rank 0 writes it as a BF16 checkpoint
(``--dir/export{step}``) and each daemon's live generation (``refitd convert --from-daemon``,
``--dir/published{step}_{i}``) before the next step. A layout's second step forces the order of
arrival that deadlocked README's old recipe: every other rank is reading the export (blocked in its
first collective) before rank 0 calls ``push_step`` (:class:`EnteredFirst`).

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/support/megatron_rank.py ...
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the repository: refitd, tests.support

from tests.support.megatron_cpu import install, provider_settings  # noqa: E402

install()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.bridge import AutoBridge  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.utils import unwrap_model  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from integrations.megatron import declare_of, push_megatron  # noqa: E402
from sidecar.cli.main import main as refitd_main  # noqa: E402
from sidecar.client import RefitClient  # noqa: E402


def build(directory: Path, tp: int, pp: int, ep: int):
    """The bridge and the model chunks of this rank, split TP x PP x EP."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep
    )
    bridge = AutoBridge.from_hf_config(AutoConfig.from_pretrained(directory))
    provider = bridge.to_megatron_provider(load_weights=False)
    provider.tensor_model_parallel_size, provider.pipeline_model_parallel_size = tp, pp
    provider.expert_model_parallel_size = ep
    provider_settings(provider)
    provider.finalize()
    model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
    # the layout is real: this rank holds its stage's layers only, split TP x EP
    sizes = (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_expert_model_parallel_world_size(),
    )
    assert sizes == (tp, pp, ep), f"Megatron runs TP, PP, EP = {sizes}, not {(tp, pp, ep)}"
    layers = sum(len(chunk.decoder.layers) for chunk in unwrap_model(model))
    assert layers * pp == provider.num_layers, f"{layers} of {provider.num_layers} layers on a stage of {pp}"
    return bridge, model


def digest(export: dict[str, torch.Tensor]) -> str:
    """One line per tensor: its name, dtype, shape and the SHA-256 of its bytes."""
    lines = []
    for name in sorted(export):
        t = export[name]
        sha = hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        lines.append(f"{name} {str(t.dtype).removeprefix('torch.')} {list(t.shape)} {sha}")
    return "\n".join(lines) + "\n"


#: how long rank 0 waits for the other ranks to be inside the export before calling push_step
ENTER_WAIT = timedelta(seconds=120)


class EnteredFirst:
    """The bridge, whose export tells rank 0 (over ``signal``, a group of its own) when this rank
    starts reading it: inside ``push_step``, past its BEGIN, at the export's first collective."""

    def __init__(self, bridge, signal) -> None:
        self.bridge, self.signal = bridge, signal

    def export_hf_weights(self, model, **kwargs):
        export = self.bridge.export_hf_weights(model, **kwargs)

        def entered():
            dist.send(torch.zeros(1), dst=0, group=self.signal)
            yield from export

        return entered()


def run_layout(args, clients, layout: tuple[int, int, int], first_step: int, signal) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    bridge, model = build(args.dir, *layout)
    declare = declare_of(bridge)
    declared_bytes = sum(t.numel() * t.element_size() for t in declare.values())
    config = (args.dir / "config.json").read_text()
    for step in range(first_step, first_step + args.steps):
        with torch.no_grad():  # "training": every rank changes its shards alike
            for chunk in model:
                for p in chunk.parameters():
                    p.mul_(1.0 + 0.25 * (step - first_step)).add_(0.01 * (step + 1))
        for i, client in enumerate(clients):
            pusher = bridge
            if i == 0 and world > 1 and (step - first_step) % 2:  # the deadlock order:
                if rank == 0:  # rank 0 calls push_step only once every other rank is in the export
                    for other in range(1, world):
                        try:
                            dist.irecv(torch.zeros(1), src=other, group=signal).wait(ENTER_WAIT)
                        except RuntimeError as exc:
                            raise SystemExit(
                                f"step {step}: rank {other} did not start reading the export (within its "
                                f"push_step) before rank 0 called push_step: {exc}"
                            ) from exc
                else:
                    pusher = EnteredFirst(bridge, signal)
            result = push_megatron(client, step, pusher, model, declare=declare)  # README's call
            print(
                f"rank {rank} layout {layout} step {step}: generation {result.generation}, "
                f"{result.bytes_in} bytes in",
                flush=True,
            )
            # every declared byte arrived once, from the ranks together (the daemon refuses overlaps)
            assert result.bytes_in == declared_bytes, (result.bytes_in, declared_bytes)
        export = {
            n: t.detach().to("cpu").contiguous().clone()
            for n, t in bridge.export_hf_weights(model, show_progress=False)
        }
        (args.dir / f"digest{step}_rank{rank}.txt").write_text(digest(export))
        if rank == 0:
            out = args.dir / f"export{step}"
            out.mkdir()
            save_file(export, str(out / "model.safetensors"))
            (out / "config.json").write_text(config)
            for i, endpoint in enumerate(args.endpoint):
                args_ = ["convert", "--from-daemon", endpoint, "--config", str(args.dir / "config.json"),
                         "--min-step", str(step), "--timeout", "120", str(args.dir / f"published{step}_{i}")]  # fmt: skip
                assert refitd_main(args_) == 0, f"refitd {' '.join(args_)} failed"
        del export
        dist.barrier()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", action="append", required=True, help="a daemon (repeat: one push each)")
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--layout", action="append", required=True, help="TP,PP,EP (repeat: one after another)")
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    clients = [RefitClient(e, rank=rank, world_size=world, timeout=300) for e in args.endpoint]
    signal = dist.new_group(backend="gloo")  # the order of arrival a step forces (EnteredFirst)
    for i, text in enumerate(args.layout):
        torch.manual_seed(1234 + i)
        run_layout(args, clients, tuple(int(x) for x in text.split(",")), i * args.steps, signal)
    for client in clients:
        client.close()
    dist.destroy_process_group()
    os._exit(0)  # Megatron's and gloo's threads: nothing left to flush


if __name__ == "__main__":
    main()
