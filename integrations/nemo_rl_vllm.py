"""The vLLM side of refitd's NeMo-RL transport: quantized generations loaded by vLLM's own loader.

NeMo-RL (NVIDIA-NeMo/RL@7ea279ab) runs a custom ``refit_transport`` inside every vLLM worker through
its worker extension ``VllmInternalWorkerExtensionWithCheckpointEngine`` (``nemo_rl/models/generation/
vllm/vllm_backend.py:1227``; the mixin is ``vllm/checkpoint_engine.py:VllmCheckpointEngineMixin``):

* ``init_checkpoint_engine`` (checkpoint_engine.py:98) sets ``self.checkpoint_engine`` on the vLLM
  worker, then ``init_checkpoint_engine_process_group`` (:120) calls the transport's
  ``init_rollout_process_group`` from that worker, ``self`` being vLLM's ``Worker`` with NeMo-RL's
  extension mixed in (``model_runner``, ``vllm_config``, ``device``);
* ``_update_weights_from_checkpoint_engine_async`` (:139) loads each batch ``receive_weight_batches``
  yields with ``self._load_weights`` -> ``_load_hf_weights`` (vllm_backend.py:201), which sends any
  engine whose quant config is ``Fp8Config`` / ``ModelOptMxFp8Config`` through
  ``quantization/fp8.py:load_weights`` (:476): ``cast_tensor_to_fp8_blockwise`` of every FP8 weight
  it is handed (re-quantizing), then ``model.load_weights`` into processed kernel parameters with no
  ``process_weights_after_loading`` (only ``_maybe_process_fp8_kv_cache``, for an FP8 KV cache). A
  loop that gets no batch loads nothing and returns True.

So :func:`find_worker` reads the worker off the caller's frame (the object whose
``checkpoint_engine`` is this transport) and :func:`load_in_worker` loads the daemon's generation
into it through refitd's vLLM adapter (``adapters.vllm.RefitWorkerExtension.refit_attach`` /
``refit_load``: vLLM's layerwise reload, ``process_weights_after_loading``, the MTP drafter, the
runner's cache resets); the transport then yields nothing. NeMo-RL's ``worker_extension_cls`` is
fixed (vllm_worker.py:586, beside ``**vllm_kwargs``, so a second one is a TypeError), which is why
the transport finds the worker rather than naming an extension.

The engine must be built in refitd's format. NeMo-RL's own ``vllm_cfg.precision: fp8`` cannot be it:
``init_fp8`` (fp8.py:189) quantizes every linear in 128x128 blocks and patches vLLM's
``process_weights_after_loading`` (``apply_fp8_patches``, :124), and ``grpo.py:1346`` overwrites
``vllm_kwargs.hf_overrides`` with ``policy.hf_config_overrides`` (which the policy's own
``from_pretrained`` reads too). vLLM's ``hf_config_path`` (``ModelConfig.hf_config_path``: "Name or
path of the Hugging Face config to use", vLLM 0.33.0) is not touched: :func:`write_engine_config`
writes the model's ``config.json`` with the ``quantization_config`` of
``adapters.vllm.vllm_engine_args``, and ``vllm_kwargs`` name it with the matching ``quantization``::

    python -m integrations.nemo_rl_vllm --hf-config /models/m --format block_fp8 --out /models/m-refitd
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sidecar.errors import ErrorKind, RefitError

#: NeMo-RL's FP8 module; ``fp8_patches_applied`` is True in a process ``apply_fp8_patches`` patched
NEMO_RL_FP8 = "nemo_rl.models.generation.vllm.quantization.fp8"
#: what a NeMo-RL user sets when the engine and the daemon disagree on the format
NEMO_RL_ENGINE_HINT = (
    "\n  NeMo-RL: start vLLM in the daemon's format with policy.generation.vllm_kwargs.quantization and "
    ".hf_config_path, as `python -m integrations.nemo_rl_vllm --hf-config ... --format <the daemon's format> "
    "--out DIR` prints them (vllm_cfg.precision stays bfloat16)"
)
#: how far up the caller's frames :func:`find_worker` looks
FRAMES = 8


def find_worker(transport: Any, frame: Any = None) -> Any | None:
    """The vLLM worker whose ``checkpoint_engine`` is ``transport``, found as ``self`` in one of the
    calling frames (NeMo-RL's mixin methods); None when the transport runs elsewhere."""
    frame = frame if frame is not None else sys._getframe(1)
    for _ in range(FRAMES):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if (
            owner is not None
            and owner is not transport
            and getattr(owner, "checkpoint_engine", None) is transport
            and hasattr(owner, "model_runner")
        ):
            return owner
        frame = frame.f_back
    return None


def refuse_nemo_rl_fp8() -> None:
    """NeMo-RL's own FP8 (``vllm_cfg.precision: fp8``) patched this process's vLLM: refitd's
    generation would meet patched processing and an engine quantized in NeMo-RL's layout."""
    fp8 = sys.modules.get(NEMO_RL_FP8)
    if fp8 is not None and getattr(fp8, "fp8_patches_applied", False):
        raise RefitError(
            "NeMo-RL's own FP8 (policy.generation.vllm_cfg.precision: fp8) patched this vLLM and quantizes every "
            "linear itself; with refitd keep precision: bfloat16 and start vLLM in refitd's format instead: "
            "policy.generation.vllm_kwargs.quantization and .hf_config_path from "
            "`python -m integrations.nemo_rl_vllm --hf-config ... --format ... --out DIR`",
            kind=ErrorKind.ENGINE,
        )


def extension(worker: Any) -> Any:
    """refitd's ``RefitWorkerExtension`` over NeMo-RL's vLLM worker (one per worker, kept on it): its
    methods run with ``self`` reading and writing the worker's attributes, as if vLLM had mixed the
    extension in with NeMo-RL's."""
    from adapters.vllm import RefitWorkerExtension

    class OnNemoRLWorker(RefitWorkerExtension):
        def __init__(self, target: Any) -> None:
            object.__setattr__(self, "_target", target)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._target, name)

        def __setattr__(self, name: str, value: Any) -> None:
            setattr(self._target, name, value)

    ext = getattr(worker, "_refitd_extension", None)
    if ext is None:
        ext = OnNemoRLWorker(worker)
        worker._refitd_extension = ext
    return ext


def load_in_worker(worker: Any, endpoint: str, *, name: str, min_step: int, timeout: float) -> dict[str, Any]:
    """Attach ``worker`` on first use (its manifest checked against the daemon's plan), then load the
    generation >= ``min_step`` through refitd's vLLM adapter. Raises naming the worker on failure
    (NeMo-RL counts a raised refit as failed; the worker keeps its last good generation)."""
    refuse_nemo_rl_fp8()
    ext = extension(worker)
    if getattr(worker, "_refit", None) is None:
        try:
            ext.refit_attach(endpoint, name=name, timeout=timeout)
        except RefitError as exc:
            raise RefitError(
                exc.message + NEMO_RL_ENGINE_HINT, kind=exc.kind, rank=exc.rank, step=exc.step
            ) from exc
    result = ext.refit_load(min_step=min_step, timeout=timeout)
    if not result.get("ok"):
        raise RefitError(
            f"{result.get('worker')}: {result.get('error')}", kind=ErrorKind.ENGINE, step=min_step
        )
    return result


def detach(worker: Any) -> None:
    extension(worker).refit_detach()


def engine_settings(
    hf_config: Mapping[str, Any],
    fmt: str,
    *,
    num_first_layers_in_bf16: int = 0,
    num_last_layers_in_bf16: int = 0,
    text_only: bool = False,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the ``config.json`` vLLM reads through ``hf_config_path``, NeMo-RL's ``vllm_kwargs`` beside
    it but ``hf_config_path``) for an engine refitd refits in ``fmt``: ``adapters.vllm.vllm_engine_args``'
    quantization. Give the daemon the same format and BF16 layers."""
    from adapters.vllm import vllm_engine_args
    from sidecar.plan.build import RefitSpec
    from sidecar.plan.models import get_model, model_type_of

    model_type = model_type_of(hf_config)
    spec = RefitSpec(
        model_type=get_model(model_type).model_type,
        fmt=fmt,
        num_first_layers_in_bf16=num_first_layers_in_bf16,
        num_last_layers_in_bf16=num_last_layers_in_bf16,
    )
    args = vllm_engine_args(spec, hf_config, include_vision=not text_only)
    config = {k: v for k, v in hf_config.items() if k != "quantization_config"}
    qc = (args.get("hf_overrides") or {}).get("quantization_config")
    if qc is not None:
        config["quantization_config"] = qc
    kwargs: dict[str, Any] = {"quantization": args.get("quantization")}
    if args.get("language_model_only"):
        kwargs["language_model_only"] = True
    return config, kwargs


def write_engine_config(out: str | Path, hf_config: Mapping[str, Any], fmt: str, **settings: Any) -> dict:
    """Write ``out/config.json`` (:func:`engine_settings`); return the ``vllm_kwargs`` to set."""
    config, kwargs = engine_settings(hf_config, fmt, **settings)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {**kwargs, "hf_config_path": str(out)}


def main(argv: list[str] | None = None) -> int:
    from integrations.push import read_hf_config

    p = argparse.ArgumentParser(
        prog="python -m integrations.nemo_rl_vllm",
        description="Write the config.json NeMo-RL's vLLM starts from (vllm_kwargs.hf_config_path) so that it "
        "holds refitd's format, and print the vllm_kwargs lines.",
    )
    p.add_argument("--hf-config", required=True, help="the model's config.json or directory")
    p.add_argument("--format", required=True, help="the daemon's format (block_fp8, mxfp8, nvfp4, bf16, ...)")
    p.add_argument("--out", required=True, help="a directory for the engine's config.json")
    p.add_argument("--num-first-layers-in-bf16", type=int, default=0)
    p.add_argument("--num-last-layers-in-bf16", type=int, default=0)
    p.add_argument("--text-only", action="store_true", help="a multimodal model trained on text only")
    a = p.parse_args(argv)
    try:
        kwargs = write_engine_config(
            a.out,
            read_hf_config(a.hf_config, where="--hf-config"),
            a.format,
            num_first_layers_in_bf16=a.num_first_layers_in_bf16,
            num_last_layers_in_bf16=a.num_last_layers_in_bf16,
            text_only=a.text_only,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from adapters.vllm import VLLM_ENV

    print("policy:\n  generation:\n    vllm_kwargs:")
    for key, value in kwargs.items():
        print(f"      {key}: {json.dumps(value)}")
    if VLLM_ENV:
        print("# and in the vLLM workers' environment: " + " ".join(f"{k}={v}" for k, v in VLLM_ENV.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
