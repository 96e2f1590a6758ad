"""One tensor-parallel rank of a vLLM engine built from its real classes on CPU (gloo), as a child
process of tests/test_engine_vllm_models.py::test_tp2_* and tests/test_engine_vllm_fourbit.py::test_tp2_*:
``python -m support.vllm_tp RANK WORLD PORT FOLDER FORMAT[,FORMAT...] OUT`` (several formats: one
engine after another in the same gloo world, the results under ``"by_format"``). It writes its findings as JSON to OUT (errors as data; no tensor leaves the
process): what the adapter's manifest and constraint check said, whether ``load_weights`` put the
rank's slice of every routed expert (and its refined, upsampled block scales) where vLLM's own
sharding puts it, and whether two generations through ``load_generation`` kept every parameter
object and match vLLM's own first load + processing of the same generation on this rank.

A 4-bit engine's first load is vLLM's own load of a generation plus, for NVFP4, calibrated W4A4
activation scales (as a ModelOpt checkpoint leaves it; refitd carries them into every reload), so
the reference loads carry the same scales; the routed experts' 4-bit codes and group scales are
checked as this rank's slice along the split dimension (w13 rows, w2 columns = K, whole groups).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

import torch


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bytes(a), _bytes(b))


def generation(hf: dict[str, Any], spec, manifest, seed: int) -> dict[str, torch.Tensor]:
    """What the daemon publishes for a synthetic trainer state dict (checkpoint names, BF16; the
    router bias FP32), planned against ``manifest`` as the daemon plans at attach."""
    from sidecar.plan.attach import check_manifest
    from sidecar.plan.models import get_model, model_type_of, normalize_hf_config
    from sidecar.plan.run import convert

    plan_hf = normalize_hf_config(hf)
    params = get_model(model_type_of(plan_hf)).parameters(plan_hf, include_mtp=True, include_vision=False)
    g = torch.Generator().manual_seed(seed)
    state = {n: (torch.randn(s, generator=g) * 0.05).to(d) for n, s, d in params}
    for n in state:  # DeepSeek's MTP layer holds a copy of the embedding (vLLM loads both into one)
        if n.endswith(".embed_tokens.weight") and n.startswith("model.layers."):
            state[n] = state["model.embed_tokens.weight"]
    check = check_manifest(params, spec, manifest)
    if not check.ok:
        raise ValueError(check.message("vllm"))
    return convert(state, spec, keep_bf16=check.keep_bf16)


def _expert_slices(
    model: torch.nn.Module,
    gen: dict[str, torch.Tensor],
    rank: int,
    world: int,
    checked: list[str] | None = None,
) -> list[str]:
    """Routed experts at load time on this rank: w13 rows = this rank's part of gate then up, w2
    columns = its part of down; block scales on the engine's (refined) grid, each holding the
    checkpoint scale of the 128-block it lies in."""
    wrong = []
    for name, p in model.named_parameters():
        head, sep, tail = name.rpartition(".mlp.experts.routed_experts.")
        if not sep:
            continue
        w, _, leaf = tail.partition("_")
        moe = f"{head}.mlp.experts"
        projs = ("gate_proj", "up_proj") if w == "w13" else ("down_proj",)
        for e in range(p.shape[0]):
            if leaf in ("weight_packed", "weight_scale"):  # 4-bit codes / group scales (K packed whole)
                parts = [
                    gen[f"{moe}.{e}.{x}.{leaf}"].chunk(world, 0 if w == "w13" else 1)[rank] for x in projs
                ]
                if checked is not None:
                    checked.append(f"{name}[{e}]")
                if not _same(p[e], torch.cat(parts)):
                    wrong.append(f"{name}[{e}]")
                continue
            if leaf not in ("weight", "weight_scale_inv"):
                continue  # per-expert 0-d scales, INT4's weight_shape: not split
            weights = [gen[f"{moe}.{e}.{x}.weight"] for x in projs]
            if checked is not None:
                checked.append(f"{name}[{e}]")
            if leaf == "weight":
                parts = [t.chunk(world, 0 if w == "w13" else 1)[rank] for t in weights]
                want = torch.cat(parts)
            elif leaf == "weight_scale_inv":
                scales = [gen[f"{moe}.{e}.{x}.weight_scale_inv"] for x in projs]
                want = torch.cat(
                    [_on_grid(s, t.shape, p.shape[1:], w, rank, world) for s, t in zip(scales, weights)]
                )
            else:
                continue
            if not _same(p[e], want):
                wrong.append(f"{name}[{e}]")
    return wrong


def _on_grid(scale, weight_shape, param_shape, w: str, rank: int, world: int) -> torch.Tensor:
    """Checkpoint block scales (128x128 blocks of the whole weight) on the engine's grid for this
    rank: w13 splits the weight's rows (I), w2 its columns (I); ``block`` is the engine's block size."""
    rows, cols = weight_shape
    if w == "w13":
        part = rows // world
        grid_rows, grid_cols = param_shape[0] // 2, param_shape[1]
        block = part // grid_rows
        r = (rank * part + torch.arange(grid_rows) * block) // 128
        c = (torch.arange(grid_cols) * block) // 128
    else:
        part = cols // world
        grid_rows, grid_cols = param_shape
        block = part // grid_cols
        r = (torch.arange(grid_rows) * block) // 128
        c = (rank * part + torch.arange(grid_cols) * block) // 128
    return scale[r][:, c]


def _calibrated(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """NVFP4 W4A4's static activation scales as a calibrated checkpoint holds them (per expert)."""
    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if hasattr(module, "w13_input_scale"):
            moe = name.replace(".routed_experts", "")
            for e in range(int(module.w13_weight.shape[0])):
                for proj, v in (("gate_proj", 0.02), ("up_proj", 0.02), ("down_proj", 0.05)):
                    out[f"{moe}.{e}.{proj}.input_scale"] = torch.tensor(v + 0.001 * e)
    return out


def run(rank: int, world: int, port: int, folder: Path, fmt: str) -> dict[str, Any]:
    from support import vllm_models as vm

    vm.import_vllm()
    import adapters.vllm as av
    from sidecar.numerics.formats import Format
    from sidecar.plan.build import RefitSpec
    from sidecar.plan.models import get_model, model_type_of, normalize_hf_config
    from sidecar.plan.run import convert

    hf = vm.config_dict(folder)
    layers = get_model(model_type_of(hf)).num_hidden_layers(hf)
    spec = RefitSpec(model_type=model_type_of(hf), fmt=fmt, num_hidden_layers=layers)
    args = av.vllm_engine_args(spec, hf, include_vision=False)
    config = vm.vllm_config(folder, args, tp=world)
    vm.init_distributed(config, rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    out: dict[str, Any] = {"rank": rank}

    calibrated: dict[str, torch.Tensor] = {}

    def fresh(processed: bool) -> torch.nn.Module:
        model = vm.build_model(config)
        if processed:
            with torch.no_grad():
                for p in model.parameters():
                    p.data.zero_()
            vm.process(config, model)
        return model

    if spec.format.four_bit:  # the engine as a (calibrated) 4-bit checkpoint leaves it: vLLM's own load
        model = vm.build_model(config)
        if spec.format is Format.NVFP4:
            calibrated = _calibrated(model)
        inputs = get_model(model_type_of(hf)).parameters(
            normalize_hf_config(hf), include_mtp=True, include_vision=False
        )
        g = torch.Generator().manual_seed(10)
        first = convert({n: (torch.randn(s, generator=g) * 0.05).to(d) for n, s, d in inputs}, spec)
        model.load_weights(av.ordered_weights({**first, **calibrated}))
        vm.process(config, model)
    else:
        model = fresh(processed=True)
    worker = vm.worker(config, model, rank=rank)
    manifest = av.RefitWorkerExtension.refit_manifest(worker)
    out["constraints"] = av.check_vllm_constraints(manifest, hf)
    out["moe_tp_size"] = manifest.constraints.moe_tp_size
    out["scale_shapes"] = (
        {}
        if spec.format.four_bit
        else {
            n: list(p.shape)
            for n, p in fresh(processed=False).named_parameters()
            if n.endswith("weight_scale_inv")
        }
    )
    gen = generation(hf, spec, manifest, seed=11)
    loaded = fresh(processed=False)
    loaded.load_weights(av.ordered_weights(gen))
    checked: list[str] = []
    out["expert_slices_wrong"] = _expert_slices(loaded, gen, rank, world, checked)
    out["expert_slices_checked"] = len(checked)
    before = {n: (p, p.data_ptr()) for n, p in model.named_parameters()}
    out["reloads"] = []
    for seed in (12, 13):
        gen = generation(hf, spec, manifest, seed)
        av.load_generation(worker, gen, spec.format)
        after = dict(model.named_parameters())
        reference = fresh(processed=False)
        reference.load_weights(av.ordered_weights({**gen, **calibrated}))
        vm.process(config, reference)
        ref = dict(reference.named_parameters())
        out["reloads"].append(
            {
                "moved": [
                    n for n, (p, ptr) in before.items() if after[n] is not p or after[n].data_ptr() != ptr
                ],
                "differ": [
                    n
                    for n, p in after.items()
                    if n.rpartition(".")[2] not in ("q_scale", "k_scale", "v_scale", "prob_scale")
                    and not _same(p, ref[n])
                ],
                "compared": len(after),
            }
        )
    return out


def run_ranks(
    folder: Path, fmt: str, out_dir: Path, world: int = 2, timeout: float = 600.0
) -> list[dict[str, Any]]:
    """Run ``world`` ranks of this module as child processes on a free port (the test side); every
    rank's JSON result, or an AssertionError with the stderr tail of each rank that failed."""
    from support.net import free_port

    port = free_port()
    tests = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests)])}
    outs = [
        out_dir / f"tp{world}-{folder.name}-{fmt.replace(',', '-')}-rank{rank}.json" for rank in range(world)
    ]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "support.vllm_tp",
                str(rank),
                str(world),
                str(port),
                str(folder),
                fmt,
                str(out),
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for rank, out in enumerate(outs)
    ]
    errors = []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        if proc.returncode:
            errors.append(err.decode(errors="replace")[-3000:])
    if errors:
        raise AssertionError(errors)
    return [json.loads(out.read_text()) for out in outs]


def main() -> None:
    rank, world, port, folder, fmt, path = sys.argv[1:7]
    try:
        if "," in fmt:
            by = {f: run(int(rank), int(world), int(port), Path(folder), f) for f in fmt.split(",")}
            result = {"rank": int(rank), "by_format": by}
        else:
            result = run(int(rank), int(world), int(port), Path(folder), fmt)
    except BaseException as exc:  # reported as data: the test names the rank and the error
        result = {"rank": int(rank), "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
    Path(path).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
