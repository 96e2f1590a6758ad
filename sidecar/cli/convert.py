"""``refitd convert``: write a Hugging Face checkpoint directory in the format and names a daemon publishes.

An engine can then boot from exactly the bytes later refits replace (slime and NeMo-RL ship one-off
scripts for this). Two sources:

* ``refitd convert BF16_DIR OUT_DIR --format block_fp8``: a BF16 checkpoint directory (safetensors,
  with or without ``model.safetensors.index.json``), read tensor by tensor and quantized unit by
  unit through the same plan and kernels as the daemon (``sidecar.plan.run.run_unit``): only one
  output shard (``--max-shard-size``) and one unit's inputs are in memory at a time. Every format
  the daemon publishes, the 4-bit ones in the parameters the engine loads (``--int4-group``,
  ``--int4-scale-dtype``, ``--nvfp4-names``, as ``refitd plan`` takes them).
* ``refitd convert --from-daemon ENDPOINT OUT_DIR --config config.json``: the live generation of a
  running daemon (a :class:`~adapters.base.RefitReader`, released when written).

``OUT_DIR`` gets ``model-0000i-of-0000n.safetensors`` shards, ``model.safetensors.index.json`` and
``config.json`` (the source's, with the ``quantization_config`` the ``--engine`` reads; see
:func:`quantization_config_for`). Exit codes: 0 ok; 1 conversion failed (the message says why);
2 usage.

What it reads is checked before anything is written (``sidecar.cli.convert_source``: every header
bounded by its file, the shards against the index, the tensors against ``config.json``), and every
tensor written is checked finite. It writes into a fresh directory beside OUT, renamed to OUT only
when complete (``sidecar.cli.convert_write``): OUT must be new or empty (``--force`` replaces it),
a symlink is never followed, and a failed conversion leaves OUT as it was. Progress goes to stderr:
a bar on a terminal, else a line a source shard; ``--quiet`` for none.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from sidecar.cli.convert_source import CheckpointDir, check_against_config
from sidecar.cli.convert_write import ShardWriter, Staged, check_finite, check_out
from sidecar.cli.plan import format_params_of
from sidecar.cli.progress import Progress
from sidecar.numerics.formats import (
    DEFAULT_FORMAT_PARAMS,
    INT4_SCALE_DTYPE_NAMES,
    Format,
    FormatParams,
    Nvfp4Names,
)
from sidecar.plan.build import RefitPlan, RefitSpec, with_checkpoint_scheme
from sidecar.plan.models import get_model, model_type_of

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
DEFAULT_SHARD_BYTES = 2 << 30
ENGINES = ("sglang", "vllm")
#: a ModelOpt NVFP4 checkpoint written from BF16 weights has no calibrated activation scales
NO_INPUT_SCALE = (
    "the NVFP4 checkpoint holds no input_scale (W4A4's static activation scales come from calibration, "
    "not from weights; vLLM 0.33.0 leaves them uninitialised when a checkpoint lacks them). Backends "
    "that run NVFP4 weights with BF16 activations (Marlin, Hopper's choice) drop them; for a W4A4 "
    "backend (SM100's FlashInfer / CUTLASS, the emulation) add calibrated input_scale tensors, or convert "
    "with --nvfp4-names compressed_tensors (NVFP4 weights, BF16 activations)"
)


def quantization_config_for(
    fmt: Format,
    hf_config: Mapping[str, Any],
    tensors: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
    *,
    engine: str = "sglang",
    params: FormatParams = DEFAULT_FORMAT_PARAMS,
) -> dict[str, Any] | None:
    """The ``quantization_config`` for ``config.json``, its BF16 modules read off the written tensors.

    Block-FP8 and per-tensor FP8: ``quant_method fp8`` (``weight_block_size [128, 128]`` for block),
    dynamic activations, ``modules_to_not_convert``: what SGLang's ``Fp8Config``, vLLM's ``Fp8Config``
    and transformers' ``FineGrainedFP8Config`` all read. MXFP8: SGLang reads ``quant_method mxfp8``
    (``Fp8Config(use_mxfp8=True)``), vLLM ModelOpt's ``quant_method modelopt, quant_algo MXFP8,
    ignore``: pick with ``engine``. The 4-bit formats: the config the engine's adapter starts a refit
    engine with (vLLM: ``adapters.vllm.fourbit.four_bit_quantization``, ModelOpt NVFP4 or
    compressed-tensors W4A16 / MXFP4 / ``nvfp4-pack-quantized`` per ``params``; SGLang:
    ``sglang_quantization_config``, which refuses what SGLang does not load)."""
    from adapters.sglang.quant import bf16_modules_of, sglang_quantization_config

    if fmt is Format.BF16:
        return None
    model = get_model(model_type_of(hf_config))
    skip = bf16_modules_of(tensors, model)
    if engine == "vllm" and fmt.four_bit:
        from adapters.vllm.args import vllm_engine_args, with_vllm_aliases
        from adapters.vllm.fourbit import four_bit_quantization

        params = params.for_format(fmt)
        # the checks vLLM's engine arguments make of this format and its parameters (INT4 scales it
        # cannot hold) hold for a checkpoint it boots from too; the BF16 modules are the written ones
        vllm_engine_args(RefitSpec(model_type=model.model_type, fmt=fmt, params=params), hf_config)
        return four_bit_quantization(fmt, with_vllm_aliases(skip), params)[1]
    if fmt is Format.MXFP8 and engine == "vllm":
        return {"quant_method": "modelopt", "quant_algo": "MXFP8", "ignore": skip}
    spec = RefitSpec(model_type=model.model_type, fmt=fmt, params=params.for_format(fmt))
    qc = sglang_quantization_config(spec, hf_config, skip=skip)
    if fmt.four_bit and qc is not None and qc.get("quant_method") in ("fp8", "mxfp8"):
        # an SGLang adapter from before its 4-bit configs answers with an FP8 one: never write that
        raise ValueError(
            f"refitd's SGLang adapter has no {fmt.value} quantization_config here: convert with --engine vllm, "
            "or in block_fp8, mxfp8 or fp8_per_tensor for SGLang"
        )
    return qc


# --------------------------------------------------------------------------------------------------
# reading a BF16 checkpoint directory (checked: sidecar.cli.convert_source), tensor by tensor


def convert_outputs(
    source: CheckpointDir, plan: RefitPlan | RefitSpec, progress: Progress | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every output of ``plan`` (built over ``source.specs``; a RefitSpec: the plan of it), unit by
    unit: each unit's inputs are read, quantized (in the plan's format parameters, as the daemon
    does), and dropped. ``progress``: bytes read, and each source shard once all of it was read."""
    from sidecar.plan.run import run_unit

    if isinstance(plan, RefitSpec):
        plan = RefitPlan.build(source.specs, plan)
    left: dict[Path, int] = {}
    for f in source.where.values():
        left[f] = left.get(f, 0) + 1

    def read(name: str) -> torch.Tensor:
        tensor = source.get(name)
        if progress is not None:
            progress.advance(tensor.numel() * tensor.element_size())
            f = source.where[name]
            left[f] -= 1
            if left[f] == 0:
                progress.unit_done(f.name)
        return tensor

    for unit in plan.units:
        inputs = {n: read(n) for n in unit.inputs}
        if unit.fmt is None:  # written as read: checked finite here (quantizers refuse NaN/Inf)
            for o in unit.outputs:
                check_finite(o.name, inputs[o.source])
                yield o.name, inputs[o.source]
            continue
        outputs = {o.name: torch.empty(o.shape, dtype=o.dtype) for o in unit.outputs}
        run_unit(unit, inputs, outputs)
        yield from outputs.items()


# --------------------------------------------------------------------------------------------------
# writing (into a fresh directory renamed to OUT when complete: sidecar.cli.convert_write)


def write_checkpoint(
    out: Path,
    tensors: Iterable[tuple[str, torch.Tensor]],
    hf_config: Mapping[str, Any],
    fmt: Format,
    layout: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
    *,
    engine: str = "sglang",
    params: FormatParams = DEFAULT_FORMAT_PARAMS,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    verify: Callable[[], None] | None = None,
    force: bool = False,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Write ``tensors`` as shards + index + ``config.json`` (``hf_config`` with the matching
    ``quantization_config``) as ``out``; returns the config written. ``layout``: the ``(name,
    dtype, shape)`` of every tensor that ``tensors`` yields (the plan's outputs), from which the
    config is worked out before anything is written: a format or parameter the engine cannot load
    is refused with ``out`` untouched. ``verify`` runs once every shard is saved, before anything
    is placed (a live generation's copy checks it was not rewritten meanwhile). Everything is
    written into a fresh directory and renamed to ``out`` only when complete
    (:class:`~sidecar.cli.convert_write.Staged`); ``out`` must be new or empty unless ``force``.
    Any failure (a tensor holding NaN or Inf, ``verify`` raising, an interrupt) leaves ``out`` as
    it was, and converting again works."""
    layout = [(n, d, tuple(s)) for n, d, s in layout]
    config = {k: v for k, v in hf_config.items() if k != "quantization_config"}
    qc = quantization_config_for(fmt, hf_config, layout, engine=engine, params=params)
    if qc is not None:
        config["quantization_config"] = qc
    with Staged(out, force) as staged:
        writer = ShardWriter(staged.path, max_shard_bytes)
        if progress is not None:
            writer.on_flush = lambda part, nbytes: progress.count("shards written")
        counted = tensors if progress is None else _counted(tensors, progress)
        writer.write_all(counted)
        if verify is not None:
            verify()
        writer.finish()
        (staged.path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        staged.place()
    return config


def _counted(
    tensors: Iterable[tuple[str, torch.Tensor]], progress: Progress
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in tensors:
        yield name, tensor
        progress.count("tensors written")


def convert_directory(
    source: Path,
    out: Path,
    fmt: Format,
    *,
    engine: str = "sglang",
    num_first_layers_in_bf16: int = 0,
    num_last_layers_in_bf16: int = 0,
    ignore_patterns: tuple[str, ...] = (),
    quantize_linears: bool | None = None,
    params: FormatParams = DEFAULT_FORMAT_PARAMS,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    force: bool = False,
    quiet: bool = True,
) -> dict[str, Any]:
    """A BF16 checkpoint directory -> a quantized one (the daemon's plan and kernels), after every
    check of :mod:`sidecar.cli.convert_source` (headers, index, config). ``quiet=False``: progress
    on stderr (:class:`~sidecar.cli.progress.Progress`).
    ``quantize_linears``: block-FP8 attention/dense/shared-expert linears too, as DeepSeek-V3's own
    checkpoint (``RefitSpec.quantize_linears``); a daemon started on the written ``config.json``
    follows it (its ``weight_block_size``). ``params``: the format parameters the engine holds
    (INT4 group and scale dtype, NVFP4 names: what its manifest would say at attach); one of another
    format than ``fmt`` away from its default is refused."""
    check_out(out, force)  # before reading anything: a refused OUT costs no time
    hf_config = json.loads((source / "config.json").read_text())
    if not isinstance(hf_config, dict):
        raise ValueError(f"{source}/config.json is not a JSON object")
    if "quantization_config" in hf_config:
        raise ValueError(f"{source}/config.json has a quantization_config: convert takes a BF16 checkpoint")
    checkpoint = CheckpointDir(source)
    check_against_config(checkpoint.specs, hf_config, source)  # absurd counts refused before any listing
    spec = RefitSpec(
        model_type=model_type_of(hf_config),
        fmt=fmt,
        num_hidden_layers=get_model(model_type_of(hf_config)).num_hidden_layers(hf_config),
        num_first_layers_in_bf16=num_first_layers_in_bf16,
        num_last_layers_in_bf16=num_last_layers_in_bf16,
        ignore_patterns=ignore_patterns,
        quantize_linears=quantize_linears,
        params=params,
    )
    spec = with_checkpoint_scheme(spec, hf_config)
    plan = RefitPlan.build(checkpoint.specs, spec)
    total = sum(checkpoint.bytes_of.values())
    with Progress("convert", total, units=len(checkpoint.files), unit_name="shard", quiet=quiet) as progress:
        return write_checkpoint(
            out,
            convert_outputs(checkpoint, plan, progress),
            hf_config,
            fmt,
            [(o.name, o.dtype, tuple(o.shape)) for o in plan.outputs],
            engine=engine,
            params=spec.params,
            max_shard_bytes=max_shard_bytes,
            force=force,
            progress=progress,
        )


def convert_generation(
    endpoint: str,
    out: Path,
    hf_config: Mapping[str, Any],
    *,
    min_step: int | None = None,
    timeout: float = 600.0,
    engine: str = "sglang",
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    force: bool = False,
    quiet: bool = True,
) -> dict[str, Any]:
    """The live generation of the daemon at ``endpoint`` -> a checkpoint directory, in the format
    and format parameters its status says (a daemon from before ``format_params``: the defaults)."""
    from adapters.base import RefitReader

    check_out(out, force)
    with RefitReader(endpoint, name="refitd-convert", timeout=timeout) as reader:
        status = reader.status(timeout=timeout)
        fmt = Format.parse(status["format"])
        params = FormatParams.from_wire(status.get("format_params") or {}).for_format(fmt)
        gen = reader.wait(min_step=min_step, timeout=timeout)

        def untorn() -> None:
            if not gen.intact():
                raise ValueError(
                    f"the daemon rewrote generation {gen.index} (step {gen.step}) while it was being written "
                    "(reader_timeout_s too short for this copy): nothing was kept; convert again"
                )

        try:
            layout = [(n, t.dtype, tuple(t.shape)) for n, t in gen.tensors.items()]
            total = sum(t.numel() * t.element_size() for t in gen.tensors.values())
            with Progress("convert", total, unit_name="tensor", quiet=quiet) as progress:

                def read() -> Iterator[tuple[str, torch.Tensor]]:
                    for name, tensor in gen.tensors.items():
                        progress.advance(tensor.numel() * tensor.element_size())
                        yield name, tensor

                config = write_checkpoint(
                    out,
                    read(),
                    hf_config,
                    fmt,
                    layout,
                    engine=engine,
                    params=params,
                    max_shard_bytes=max_shard_bytes,
                    verify=untorn,
                    force=force,
                    progress=progress,
                )
        finally:
            reader.release(gen)
    return config


# --------------------------------------------------------------------------------------------------
# the command line


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "convert",
        help="write a Hugging Face checkpoint in the format and names the daemon publishes",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument(
        "source", nargs="?", type=Path, help="a BF16 checkpoint directory (safetensors + config.json)"
    )
    p.add_argument("out", type=Path, help="the directory to write (empty or new)")
    p.add_argument("--format", dest="fmt", default=None, help=", ".join(f.value for f in Format))
    p.add_argument(
        "--int4-group",
        type=int,
        default=None,
        metavar="G",
        help="int4_w4a16: the group the engine loads (32)",
    )
    p.add_argument(
        "--int4-scale-dtype",
        choices=INT4_SCALE_DTYPE_NAMES,
        default=None,
        help="int4_w4a16: the dtype of the engine's weight_scale (bfloat16)",
    )
    p.add_argument(
        "--nvfp4-names",
        choices=[n.value for n in Nvfp4Names],
        default=None,
        help="nvfp4: ModelOpt's names (default) or compressed-tensors' (nvfp4-pack-quantized)",
    )
    p.add_argument(
        "--from-daemon", metavar="ENDPOINT", help="write the live generation of this daemon instead"
    )
    p.add_argument("--config", type=Path, help="the model's config.json (with --from-daemon)")
    p.add_argument(
        "--min-step", type=int, default=None, help="with --from-daemon: wait for this step or newer"
    )
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument(
        "--engine",
        choices=ENGINES,
        default="sglang",
        help="whose quantization_config to write (MXFP8 and the 4-bit formats differ by engine)",
    )
    p.add_argument("--num-first-layers-in-bf16", type=int, default=0)
    p.add_argument("--num-last-layers-in-bf16", type=int, default=0)
    p.add_argument("--ignore-pattern", action="append", default=[], help="fnmatch of modules kept BF16")
    p.add_argument(
        "--quantize-linears",
        action="store_true",
        default=None,
        help="block-FP8 the attention/dense linears too (DeepSeek-V3-style checkpoints)",
    )
    p.add_argument("--max-shard-size", type=int, default=DEFAULT_SHARD_BYTES, help="bytes per shard")
    p.add_argument(
        "--force",
        action="store_true",
        help="replace OUT if it already holds files (by default only a new or empty OUT is written)",
    )
    p.add_argument(
        "--quiet",
        action="store_true",
        help="no progress (by default: a bar on a terminal, else one line a shard on stderr)",
    )
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    try:
        if args.from_daemon:
            if args.config is None or args.source is not None or _params_given(args):
                print(
                    "refitd convert: --from-daemon takes OUT and --config config.json, no source (the "
                    "format and its parameters are the daemon's)",
                    file=sys.stderr,
                )
                return EXIT_USAGE
            hf_config = json.loads(args.config.read_text())
            written = convert_generation(
                args.from_daemon,
                args.out,
                hf_config,
                min_step=args.min_step,
                timeout=args.timeout,
                engine=args.engine,
                max_shard_bytes=args.max_shard_size,
                force=args.force,
                quiet=args.quiet,
            )
        else:
            if args.source is None or args.fmt is None:
                print("refitd convert: give SOURCE OUT --format FMT (or --from-daemon)", file=sys.stderr)
                return EXIT_USAGE
            written = convert_directory(
                args.source,
                args.out,
                Format.parse(args.fmt),
                engine=args.engine,
                num_first_layers_in_bf16=args.num_first_layers_in_bf16,
                num_last_layers_in_bf16=args.num_last_layers_in_bf16,
                ignore_patterns=tuple(args.ignore_pattern),
                quantize_linears=args.quantize_linears,
                params=format_params_of(args),
                max_shard_bytes=args.max_shard_size,
                force=args.force,
                quiet=args.quiet,
            )
    except (OSError, ValueError, KeyError, SafetensorError) as exc:
        print(f"refitd convert: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    if (written.get("quantization_config") or {}).get("quant_algo") == "NVFP4":
        print(f"refitd convert: note: {NO_INPUT_SCALE}", file=sys.stderr)
    print(f"refitd convert: wrote {args.out}")
    return EXIT_OK


def _params_given(args: argparse.Namespace) -> bool:
    return any(getattr(args, k) is not None for k in ("int4_group", "int4_scale_dtype", "nvfp4_names"))
