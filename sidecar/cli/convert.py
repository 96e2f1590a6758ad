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
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from sidecar.cli.plan import format_params_of
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
INDEX_NAME = "model.safetensors.index.json"
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
# reading a BF16 checkpoint directory, tensor by tensor


class CheckpointDir:
    """A safetensors checkpoint directory: which file holds each tensor, its dtype and shape."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self.path = path
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{path} holds no *.safetensors files: give a Hugging Face checkpoint directory")
        self.where: dict[str, Path] = {}
        self.specs: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 (safe_open is not iterable)
                    if name in self.where:
                        raise ValueError(f"{name} is in both {self.where[name].name} and {f.name}")
                    sl = st.get_slice(name)
                    self.where[name] = f
                    self.specs.append((name, tuple(sl.get_shape()), _st_dtype(sl.get_dtype())))
        self._open: dict[Path, Any] = {}

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        f = self.where[name]
        if f not in self._open:
            self._open[f] = safe_open(str(f), framework="pt")
        return self._open[f].get_tensor(name)


_ST_DTYPES = {
    "BF16": "bfloat16",
    "F16": "float16",
    "F32": "float32",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "U8": "uint8",
    "I64": "int64",
    "I32": "int32",
}


def _st_dtype(name: str) -> torch.dtype:
    if name not in _ST_DTYPES:
        raise ValueError(f"safetensors dtype {name} is not one a BF16 trainer checkpoint holds")
    return getattr(torch, _ST_DTYPES[name])


def convert_outputs(source: CheckpointDir, plan: RefitPlan | RefitSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """Every output of ``plan`` (built over ``source.specs``; a RefitSpec: the plan of it), unit by
    unit: each unit's inputs are read, quantized (in the plan's format parameters, as the daemon
    does), and dropped."""
    from sidecar.plan.run import run_unit

    if isinstance(plan, RefitSpec):
        plan = RefitPlan.build(source.specs, plan)
    for unit in plan.units:
        inputs = {n: source.get(n) for n in unit.inputs}
        if unit.fmt is None:
            yield from ((o.name, inputs[o.source]) for o in unit.outputs)
            continue
        outputs = {o.name: torch.empty(o.shape, dtype=o.dtype) for o in unit.outputs}
        run_unit(unit, inputs, outputs)
        yield from outputs.items()


# --------------------------------------------------------------------------------------------------
# writing


class ShardWriter:
    """Writes tensors into numbered safetensors shards of at most ``max_bytes`` (one tensor over it
    gets a shard of its own), then the index."""

    def __init__(self, out: Path, max_bytes: int) -> None:
        self.out, self.max_bytes = out, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[list[str]] = []
        self.total = 0
        self.written: list[tuple[str, torch.dtype, tuple[int, ...]]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self.flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total += size
        self.written.append((name, tensor.dtype, tuple(tensor.shape)))

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        n = len(self.files)
        save_file(self.pending, str(self.out / f"part-{n:05d}.tmp"), metadata={"format": "pt"})
        self.files.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def discard(self) -> None:
        """Remove every shard this writer saved (all still ``.tmp``: nothing is renamed before
        :meth:`finish`), so a conversion that fails part-way leaves no partial checkpoint."""
        for i in range(len(self.files) + 1):  # + 1: a shard whose save failed half-way
            (self.out / f"part-{i:05d}.tmp").unlink(missing_ok=True)
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> list[str]:
        self.flush()
        count, names, weight_map = len(self.files), [], {}
        for i, tensors in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            (self.out / f"part-{i:05d}.tmp").rename(self.out / final)
            names.append(final)
            weight_map.update({t: final for t in tensors})
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        return names


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
) -> dict[str, Any]:
    """Write ``tensors`` as shards + index + ``config.json`` (``hf_config`` with the matching
    ``quantization_config``) into ``out``; returns the config written. ``layout``: the ``(name,
    dtype, shape)`` of every tensor that ``tensors`` yields (the plan's outputs), from which the
    config is worked out before anything is written: a format or parameter the engine cannot load
    is refused with ``out`` untouched. ``verify`` runs once every shard is saved, before the
    shards are named and the index and config written (a live generation's copy checks it was not
    rewritten meanwhile). A failure while writing (a NaN found when a later unit is quantized, or
    ``verify`` raising) removes the shards already saved: ``out`` holds no partial checkpoint, and
    converting again into it works."""
    layout = [(n, d, tuple(s)) for n, d, s in layout]
    config = {k: v for k, v in hf_config.items() if k != "quantization_config"}
    qc = quantization_config_for(fmt, hf_config, layout, engine=engine, params=params)
    if qc is not None:
        config["quantization_config"] = qc
    out.mkdir(parents=True, exist_ok=True)
    leftovers = [
        p.name for p in out.iterdir() if p.suffix in (".safetensors", ".tmp") or p.name == INDEX_NAME
    ]
    if leftovers:
        raise ValueError(f"{out} already holds a checkpoint ({leftovers[:3]}): give an empty directory")
    writer = ShardWriter(out, max_shard_bytes)
    try:
        for name, tensor in tensors:
            writer.add(name, tensor)
        writer.flush()
        if verify is not None:
            verify()
    except BaseException:
        writer.discard()
        raise
    writer.finish()
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return config


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
) -> dict[str, Any]:
    """A BF16 checkpoint directory -> a quantized one (the daemon's plan and kernels).
    ``quantize_linears``: block-FP8 attention/dense/shared-expert linears too, as DeepSeek-V3's own
    checkpoint (``RefitSpec.quantize_linears``); a daemon started on the written ``config.json``
    follows it (its ``weight_block_size``). ``params``: the format parameters the engine holds
    (INT4 group and scale dtype, NVFP4 names: what its manifest would say at attach); one of another
    format than ``fmt`` away from its default is refused."""
    hf_config = json.loads((source / "config.json").read_text())
    if "quantization_config" in hf_config:
        raise ValueError(f"{source}/config.json has a quantization_config: convert takes a BF16 checkpoint")
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
    checkpoint = CheckpointDir(source)
    plan = RefitPlan.build(checkpoint.specs, spec)
    return write_checkpoint(
        out,
        convert_outputs(checkpoint, plan),
        hf_config,
        fmt,
        [(o.name, o.dtype, tuple(o.shape)) for o in plan.outputs],
        engine=engine,
        params=spec.params,
        max_shard_bytes=max_shard_bytes,
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
) -> dict[str, Any]:
    """The live generation of the daemon at ``endpoint`` -> a checkpoint directory, in the format
    and format parameters its status says (a daemon from before ``format_params``: the defaults)."""
    from adapters.base import RefitReader

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
            config = write_checkpoint(
                out,
                gen.tensors.items(),
                hf_config,
                fmt,
                layout,
                engine=engine,
                params=params,
                max_shard_bytes=max_shard_bytes,
                verify=untorn,
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
            )
    except (OSError, ValueError, KeyError) as exc:
        print(f"refitd convert: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    if (written.get("quantization_config") or {}).get("quant_algo") == "NVFP4":
        print(f"refitd convert: note: {NO_INPUT_SCALE}", file=sys.stderr)
    print(f"refitd convert: wrote {args.out}")
    return EXIT_OK


def _params_given(args: argparse.Namespace) -> bool:
    return any(getattr(args, k) is not None for k in ("int4_group", "int4_scale_dtype", "nvfp4_names"))
