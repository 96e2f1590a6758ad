"""A real ``refitd serve`` quantizing on the CPU: one local step of routed experts to "published", per
format, against the same step in bf16 (the daemon's own floor: staging to generation copies) and a
plain copy of the same bytes, measured in the same run.

Two layouts of the same expert shapes (Qwen3.5-35B-A3B's: hidden 2048, expert intermediate 512):
  slab        qwen3_5_moe: a layer's experts are one gate_up slab and one down slab (a unit each);
  per-expert  qwen3_moe: a tensor per expert projection (a unit per expert's gate and up, and down).
``--baseline-tree PATH`` also runs each daemon from another checkout (``git worktree add /tmp/base
REV``), its steps interleaved with this tree's, so the two are compared on the same moments of a
shared machine ("x base": base's time over this tree's).

    python bench/daemon_quant.py [--mib 192] [--repeat 5] [--formats nvfp4,int4_w4a16,...]
                                 [--baseline-tree PATH] [--json PATH]

Reports the median time to "published" and the daemon's ``quantize`` phase (first unit started to
last unit done), each as a share of a plain copy of the step's bytes.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

#: ``python bench/daemon_quant.py`` puts bench/ first on sys.path, where bench/transport.py hides
#: the ``transport`` package; the repository root goes ahead of it.
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(1, str(REPO / "bench"))

from ingest import DaemonProc, interleaved_steps  # noqa: E402

from sidecar.cli.demo.synthetic import make_hf_config, make_state_dict  # noqa: E402
from sidecar.plan.models import get_model  # noqa: E402

MiB = 1 << 20
HIDDEN, INTER = 2048, 512  # Qwen3.5-35B-A3B
LAYERS = 2
FORMATS = ("nvfp4", "int4_w4a16", "mxfp4", "block_fp8", "mxfp8", "fp8_per_tensor")
LAYOUTS = {"slab": "qwen3_5_moe", "per-expert": "qwen3_moe"}


def config_for(model_type: str, mib: int) -> tuple[dict, int]:
    """A ``model_type`` config.json with Qwen3.5-35B-A3B's expert shapes, about ``mib`` MiB of BF16,
    and its expert count."""

    def nbytes(experts: int) -> int:
        cfg = make_hf_config(
            model_type, num_layers=LAYERS, hidden=HIDDEN, intermediate=INTER, num_experts=experts, vocab=1024
        )
        return sum(n * d.itemsize for n, d in _params(model_type, cfg))

    base, per = nbytes(1), nbytes(2) - nbytes(1)
    experts = max(1, round((mib * MiB - base) / per) + 1)
    config = make_hf_config(
        model_type, num_layers=LAYERS, hidden=HIDDEN, intermediate=INTER, num_experts=experts, vocab=1024
    )
    return config, experts


def _params(model_type: str, cfg: dict) -> list[tuple[int, torch.dtype]]:
    out = []
    for _, shape, dtype in get_model(model_type).parameters(cfg):
        n = 1
        for s in shape:
            n *= s
        out.append((n, dtype))
    return out


def copy_seconds(sd: dict[str, torch.Tensor], repeat: int) -> float:
    """Median time of ``dst.copy_(src)`` over the step's tensors into preallocated buffers."""
    dst = {k: torch.empty_like(t) for k, t in sd.items()}
    samples = []
    for _ in range(repeat + 1):
        t0 = time.perf_counter()
        for k, t in sd.items():
            dst[k].copy_(t)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=192, help="BF16 size of each step (default 192)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--formats", default="nvfp4,int4_w4a16,mxfp4,block_fp8")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--baseline-tree", type=Path, default=None, help="another checkout to run alongside")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    formats = [f for f in args.formats.split(",") if f]
    threads = torch.get_num_threads()  # the daemons' quantizer threads too (torch's default)
    results: dict = {"meta": {"mib": args.mib, "threads": threads, "machine": platform.machine()}}
    lines = []
    for layout in args.layouts.split(","):
        model_type = LAYOUTS[layout]
        config, experts = config_for(model_type, args.mib)
        sd = make_state_dict(
            model_type,
            num_layers=LAYERS,
            hidden=HIDDEN,
            intermediate=INTER,
            num_experts=experts,
            vocab=1024,
            seed=1,
        )
        nbytes = sum(t.numel() * t.element_size() for t in sd.values())
        expert_bytes = sum(t.numel() * t.element_size() for n, t in sd.items() if ".mlp.experts." in n)
        t_copy = copy_seconds(sd, args.repeat)
        lines.append(
            f"\n{layout} ({model_type}, {experts} experts): {nbytes / MiB:.0f} MiB bf16 in {len(sd)} tensors, "
            f"{expert_bytes / nbytes * 100:.0f}% of it routed experts; plain copy {t_copy * 1e3:.1f} ms"
        )
        lines.append(
            f"{'format':<16}{'tree':<6}{'published ms':>13}{'of copy':>9}{'quantize ms':>13}{'of copy':>9}"
            f"{'x base':>8}"
        )
        for fmt in ["bf16", *formats]:
            trees = {"this": REPO}
            if args.baseline_tree is not None:
                trees["base"] = args.baseline_tree
            daemons = {}
            try:
                for key, tree in trees.items():
                    daemons[key] = DaemonProc(
                        "--format",
                        fmt,
                        config=config,
                        label=f"{fmt} {key}",
                        cwd=tree,
                    )
                rows = interleaved_steps(daemons, sd, local=True, repeat=args.repeat, warmup=2)
            finally:
                for d in daemons.values():
                    d.stop()
            results[f"{layout}/{fmt}"] = rows
            for key, row in rows.items():
                if "error" in row:
                    lines.append(f"{fmt:<16}{key:<6}  FAILED: {row['error']}")
                    continue
                pub = statistics.median(row["published_s"])
                quant = row["daemon_phases_median_s"].get("quantize", float("nan"))
                vs = ""
                if key == "this" and "base" in rows and "error" not in rows["base"]:
                    vs = f"{statistics.median(rows['base']['published_s']) / pub:>7.2f}x"
                lines.append(
                    f"{fmt:<16}{key:<6}{pub * 1e3:>13.1f}{t_copy / pub * 100:>8.0f}%{quant * 1e3:>13.1f}"
                    f"{t_copy / quant * 100 if quant else float('nan'):>8.0f}%{vs}"
                )
                print(lines[-1], flush=True)
        results[f"{layout}/copy_s"] = t_copy
    print(
        f"\nrefitd bench/daemon_quant: {LAYERS} layers of Qwen3.5-35B-A3B-shaped experts, "
        f"{threads} quantizer threads, torch {torch.__version__}"
    )
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
