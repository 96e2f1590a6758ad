"""``refitd demo``: convert a small synthetic Qwen3.5-MoE state dict and say what happened.

This is the in-process path (``sidecar.plan.convert``); the daemon demo builds on it.
"""

from __future__ import annotations

import argparse
import time

import torch

from sidecar.formats import Format
from sidecar.plan import RefitPlan, RefitSpec, convert
from sidecar.plan_cli import human_bytes
from sidecar.quant import dequantize
from sidecar.synthetic import make_state_dict


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("demo", help="run refitd end to end on a small synthetic model (CPU)")
    p.add_argument("--format", default="block_fp8", choices=[f.value for f in Format if f.quantized])
    p.add_argument("--layers", type=int, default=4)
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    spec = RefitSpec(model_type="qwen3_5_moe", fmt=args.format)
    state = make_state_dict("qwen3_5_moe", num_layers=args.layers, num_experts=8, unaligned=True)
    plan = RefitPlan.build(list(state.items()), spec)
    t0 = time.perf_counter()
    out = convert(state, spec)
    seconds = time.perf_counter() - t0
    quantized = [u for u in plan.units if u.fmt is not None]
    print(f"refitd demo: synthetic qwen3_5_moe, {args.layers} layers + MTP, format {spec.fmt.value}")
    print(
        f"  {len(plan.inputs)} tensors in ({human_bytes(plan.bytes_in)}), {len(out)} tensors out ({human_bytes(plan.bytes_out)})"
    )
    print(
        f"  {len(quantized)} expert slabs quantized, {len(plan.units) - len(quantized)} tensors passed through"
    )
    worst = 0.0
    for unit in quantized:
        for o in unit.outputs:
            if o.scale_name is None:
                continue
            src = o.source_view(state[o.source]).float()
            err = (dequantize(out[o.name], out[o.scale_name], spec.fmt) - src).norm() / src.norm().clamp_min(
                1e-30
            )
            worst = max(worst, float(err))
    print(f"  converted in {seconds * 1e3:.1f} ms; worst relative L2 dequantization error {worst:.4f}")
    first = next(o for u in quantized for o in u.outputs)
    print(f"  e.g. {first.name}: {str(first.dtype).removeprefix('torch.')} {list(first.shape)}")
    return 0 if worst < 0.1 and torch.isfinite(torch.tensor(worst)) else 1
