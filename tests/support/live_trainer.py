"""A trainer rank for the live-engine tests (tests/support/vllm_live.py ``Trainer``): reads step numbers on
stdin; for each, seeds a transformers model of the config in MODEL_DIR, pushes ``model.state_dict()``
(transformers 5's fused experts) to the daemon at ENDPOINT, saves the same weights as a per-expert BF16
checkpoint (the Hugging Face form ``refitd convert`` reads) in ROOT/step{N}, and prints ``pushed N``.

    python tests/support/live_trainer.py MODEL ENDPOINT MODEL_DIR ROOT
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from sidecar.client import RefitClient


def per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's fused experts back into the checkpoint's per-expert names (gate rows, then up)."""
    out = {}
    for name, t in state.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix, half = name.removesuffix(".gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = t[e, :half].contiguous()
                out[f"{prefix}.{e}.up_proj.weight"] = t[e, half:].contiguous()
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name.removesuffix(".down_proj")
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t.contiguous()
    return out


def seeded_state(config, seed: int) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` of a BF16 transformers model of ``config``, its matrices drawn from
    N(0, 0.08) under ``seed``: weights large enough that the layers matter to the logits."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    return {n: t.detach() for n, t in model.state_dict().items()}


def save_checkpoint(state: dict[str, torch.Tensor], model_dir: Path, out: Path) -> None:
    """``state`` as a per-expert BF16 checkpoint in ``out``, with ``model_dir``'s JSON files."""
    out.mkdir(parents=True, exist_ok=True)
    save_file(per_expert(state), str(out / "model.safetensors"))
    for f in model_dir.iterdir():
        if f.suffix == ".json":
            shutil.copy(f, out / f.name)


def main() -> None:
    _, _model_type, endpoint, model_dir, root = sys.argv  # the model type: what the config says
    model_dir, root = Path(model_dir), Path(root)
    config = AutoConfig.from_pretrained(model_dir)
    with RefitClient(endpoint, rank=0, world_size=1) as client:
        for line in sys.stdin:
            step = int(line)
            state = seeded_state(config, 1000 + step)
            assert any(n.endswith("mlp.experts.gate_up_proj") for n in state), sorted(state)[:20]
            client.push_step(step, state, timeout=120)
            save_checkpoint(state, model_dir, root / f"step{step}")
            print(f"pushed {step}", flush=True)


if __name__ == "__main__":
    main()
