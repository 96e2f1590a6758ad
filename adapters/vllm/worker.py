"""The engine-touching surface, driven by ``llm.collective_rpc``: vLLM is imported inside functions,
so this module imports on a machine without vLLM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from adapters.vllm.carry import carried_input_scales, draft_checkpoint_namer
from adapters.vllm.checkpoint import build_manifest
from adapters.vllm.checks import check_vllm_constraints, fallback_note
from adapters.vllm.last_good import last_good_scales
from adapters.vllm.quant import PARAM_SOURCE_LAYERWISE, PARAM_SOURCE_LIVE
from adapters.vllm.reload_fixups import redo_skipped_post_load
from sidecar.errors import ErrorKind, RefitError
from sidecar.numerics.formats import Format
from sidecar.protocol.manifest import Manifest

log = logging.getLogger("adapters.vllm")


def _require_vllm(what: str) -> None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise ImportError(
            f"{what} runs inside vLLM's workers and needs vLLM installed (pip install vllm); the "
            "manifest and engine-argument helpers of adapters.vllm work without it"
        ) from None


def _layerwise_metadata() -> Callable[[torch.nn.Module], Any] | None:
    """vLLM's per-module reload info getter: ``reload.layerwise.get_layerwise_info`` (public in
    layerwise's ``__all__`` since it exists), else the older module-level ``LAYERWISE_INFO`` dict."""
    try:
        from vllm.model_executor.model_loader.reload import layerwise
    except ImportError:
        return None
    getter = getattr(layerwise, "get_layerwise_info", None)
    if callable(getter):
        return getter
    info = getattr(layerwise, "LAYERWISE_INFO", None)
    return info.get if info is not None else None


#: tensors vLLM's layerwise metadata never records (``reload/meta.py SKIP_TENSORS``: ``bias`` is
#: built after ``create_weights``; ``e_score_correction_bias`` is never loaded by a weight loader's
#: trigger) but that ``load_weights`` still fills from the checkpoint: read live, they stay in the
#: manifest (the FP32 router bias, attention and vision biases)
_UNRECORDED_FALLBACK = frozenset({"bias", "e_score_correction_bias"})


def _unrecorded() -> frozenset[str]:
    """Parameter names vLLM's layerwise metadata skips: its own ``SKIP_TENSORS`` when importable."""
    try:
        from vllm.model_executor.model_loader.reload.meta import SKIP_TENSORS
    except ImportError:
        return _UNRECORDED_FALLBACK
    return frozenset(SKIP_TENSORS) | _UNRECORDED_FALLBACK


def engine_parameters_and_source(
    model: torch.nn.Module,
) -> tuple[list[tuple[str, torch.dtype, tuple[int, ...]]], str]:
    """Every parameter as the loader sees it, and where that came from: the load-time metadata vLLM
    records for layerwise reload (``restore_metadata``: scales reshaped by
    ``process_weights_after_loading`` read as they load) when any module has it, else the live
    parameters (:data:`PARAM_SOURCE_LIVE`; the attach error then says so). The parameters the
    metadata skips by name (``reload/meta.py SKIP_TENSORS``: biases, ``e_score_correction_bias``)
    are never reshaped by processing and are read live, so the manifest checks them too."""
    getter = _layerwise_metadata()
    skipped = _unrecorded()
    modules = list(model.named_modules())
    metas = [getattr(getter(m), "restore_metadata", None) if getter is not None else None for _, m in modules]
    # a module recorded with nothing to load (e.g. MLA's attention, whose W_UV / W_UK_T
    # process_weights_after_loading derives from kv_b_proj) lists nothing, not its live tensors
    recorded = any(meta and meta[0] for meta in metas)
    out, seen = [], set()
    for (module_name, module), meta in zip(modules, metas):
        live = dict(module.named_parameters(recurse=False))
        if recorded:
            own = dict(meta[0]) if meta else {}
            own.update((n, p) for n, p in live.items() if n in skipped and n not in own)
        else:
            own = live
        prefix = f"{module_name}." if module_name else ""
        for n, p in own.items():
            if id(p) in seen and n in skipped:
                continue  # one parameter registered on two modules (the router bias on the experts)
            seen.add(id(p))
            out.append((prefix + n, p.dtype, tuple(p.shape)))
    return out, PARAM_SOURCE_LAYERWISE if recorded else PARAM_SOURCE_LIVE


def engine_parameters(model: torch.nn.Module) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """:func:`engine_parameters_and_source` without the source."""
    return engine_parameters_and_source(model)[0]


def _config_context(worker: Any) -> contextlib.AbstractContextManager:
    """``set_current_vllm_config(worker.vllm_config)``: vLLM's own ``start_weight_update`` /
    ``update_weights`` / ``finish_weight_update`` and ``Worker.reload_weights`` run under it, and
    ``get_current_vllm_config()`` raises outside it (vLLM PR #31747)."""
    try:
        from vllm.config import set_current_vllm_config
    except ImportError:
        return contextlib.nullcontext()
    return set_current_vllm_config(worker.vllm_config)


def _model(worker: Any) -> torch.nn.Module:
    """The worker's model through ``model_runner.get_model()`` (what vLLM's worker uses)."""
    runner = worker.model_runner
    get_model = getattr(runner, "get_model", None)
    return get_model() if callable(get_model) else runner.model


def _draft(worker: Any) -> tuple[torch.nn.Module, Any] | None:
    """The speculative drafter (MTP) and its model config, as vLLM 0.33's
    ``Worker.start_draft_weight_update`` targets them (``model_runner.get_draft_model()``,
    ``speculative_config.draft_model_config``); None without a drafter."""
    get_draft = getattr(worker.model_runner, "get_draft_model", None)
    draft = get_draft() if callable(get_draft) else None
    if draft is None:
        return None
    spec = getattr(worker, "speculative_config", None) or getattr(
        worker.vllm_config, "speculative_config", None
    )
    draft_config = getattr(spec, "draft_model_config", None)
    if draft_config is None:
        raise RefitError(
            "the worker has a draft model but no speculative_config.draft_model_config; refitd reloads the "
            "drafter with its own model config, as vLLM's start_draft_weight_update does",
            kind=ErrorKind.ENGINE,
        )
    return draft, draft_config


def _layerwise_reload(model: torch.nn.Module, weights, model_config: Any) -> None:
    """One layerwise-reload session over ``weights``. A ``load_weights`` that fails still has its
    session finalized (the error re-raised): vLLM's ``initialize_layerwise_reload`` skips a layer
    whose session is still open, so an unfinalized failure would leave the next reload of this
    model (a streamed step's rollback of the drafter, or the next whole load) mixing the failed
    load's buffered weights into its own."""
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    initialize_layerwise_reload(model)
    try:
        model.load_weights(weights)
    except BaseException:
        try:
            finalize_layerwise_reload(model, model_config)
        except Exception:  # the load's own error is the one to report
            log.exception("closing the failed layerwise reload of %s", type(model).__name__)
        raise
    finalize_layerwise_reload(model, model_config)


def _reload_draft(draft: torch.nn.Module, weights, draft_config: Any) -> None:
    """The drafter as ``start_draft_weight_update`` -> ``update_weights`` -> ``finish_weight_update``
    reloads it: through the unquantized target head (``share_source_lm_heads``), then the quantized
    copies re-derived (``restore_quantized_lm_heads``); a drafter's ``load_weights`` picks its own
    names (``mtp.*``, DeepSeek's ``model.layers.{N}.*``) out of the whole generation."""
    try:
        from vllm.model_executor.layers.quantization.online.lm_head import (
            restore_quantized_lm_heads,
            share_source_lm_heads,
        )
    except ImportError:
        _layerwise_reload(draft, weights, draft_config)
        return
    share_source_lm_heads(draft)
    try:
        _layerwise_reload(draft, weights, draft_config)
    except BaseException:
        restore_quantized_lm_heads(draft, refresh=False)
        raise
    restore_quantized_lm_heads(draft)


def carried_scales(worker: Any) -> dict[str, torch.Tensor]:
    """The NVFP4 activation scales the worker holds (adapters.vllm.carry): the target model's and its
    MTP drafter's, each named as its ``load_weights`` takes them from a generation; empty for
    formats without held activation scales. Read before a reload (it re-materializes them)."""
    carried = carried_input_scales(_model(worker).named_modules())
    draft = _draft(worker)
    if draft is not None:
        namer = draft_checkpoint_namer(worker.model_config.hf_config.to_dict())
        carried.update(carried_input_scales(draft[0].named_modules(), namer))
    return carried


def reload_draft(worker: Any, tensors: Mapping[str, torch.Tensor]) -> None:
    """Reload the MTP drafter, if the worker has one, from the whole generation ``tensors`` (with
    the carried activation scales, :func:`carried_scales`, already among them), as
    :func:`load_generation` does after the target model: :func:`_reload_draft`, its lm_heads
    shared and restored. The streamed path runs it once a step's target groups are all loaded and
    finalized (``adapters.vllm.stream.LayerwiseGroups.finish``): the sequence a whole load runs,
    from the same complete generation."""
    draft = _draft(worker)
    if draft is None:
        return
    with _config_context(worker), torch.device(worker.device):
        _reload_draft(draft[0], ordered_weights(tensors), draft[1])


def _reset_caches(worker: Any) -> None:
    """What ``GPUModelRunner.reload_weights`` clears after a reload: state derived from the old
    weights (LoRA, encoder outputs, multimodal inputs' cache)."""
    for name in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
        reset = getattr(worker.model_runner, name, None)
        if callable(reset):
            reset()


def complete_reload(worker: Any, tensors: Mapping[str, torch.Tensor]) -> None:
    """What :func:`load_generation` does after the target's reload, for a streamed step whose
    target groups are all in and finalized: :func:`reload_draft` from the whole generation, then
    the runner's cache resets (state derived from the old weights)."""
    reload_draft(worker, tensors)
    _reset_caches(worker)


def _deep_gemm_e8m0() -> bool | None:
    """vLLM's ``is_deep_gemm_e8m0_used()`` (None when this vLLM has no such function)."""
    try:
        from vllm.utils.deep_gemm import is_deep_gemm_e8m0_used
    except ImportError:
        return None
    return bool(is_deep_gemm_e8m0_used())


def ordered_weights(tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """A generation in the order vLLM's loaders need: grouped slabs last (Qwen3.5's loader switches
    to its fused-expert mapping for the rest of a call once it has seen a slab)."""
    slab = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
    return sorted(tensors.items(), key=lambda kv: kv[0].endswith(slab))


def load_generation(worker: Any, tensors: Mapping[str, torch.Tensor], expert_format: Format) -> None:
    """Hand a generation to vLLM's own loader; copies go host -> device from the shared views.

    Under ``set_current_vllm_config(worker.vllm_config)``, as vLLM's worker does: vLLM's layerwise
    reload (what its weight-transfer engines and ``reload_weights(is_checkpoint_format=True)`` run)
    of the model, then of the MTP drafter when there is one (``get_draft_model()``, as
    ``start_draft_weight_update`` does), then the runner's cache resets that vLLM's own
    ``reload_weights`` does. A vLLM without layerwise reload falls back to
    ``model_runner.reload_weights``; one with neither can only take BF16 (loading FP8 into
    already-processed kernel parameters would corrupt them).

    NVFP4 W4A4's static activation scales, the target's and the MTP drafter's (carry.py), are
    carried into the reload from the worker's :class:`~adapters.vllm.last_good.LastGoodScales`:
    read from the engine, unless a load failed since the last good one (the model may then hold
    garbage), when the ones read for that load are carried again.
    """
    record = last_good_scales(worker)
    if expert_format is Format.NVFP4:  # (the drafter's load_weights picks its own names out of them)
        tensors = {**tensors, **record.for_load(lambda: carried_scales(worker))}
    _load_whole(worker, ordered_weights(tensors), expert_format)
    record.succeeded()


def _load_whole(worker: Any, weights: list[tuple[str, torch.Tensor]], expert_format: Format) -> None:
    """:func:`load_generation`'s reload of ``weights`` (the carried scales among them)."""
    model = _model(worker)
    draft = _draft(worker)
    runner = worker.model_runner
    try:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload  # noqa: F401
    except ImportError:
        pass
    else:
        with _config_context(worker), torch.device(worker.device):
            _layerwise_reload(model, weights, worker.model_config)
            if draft is not None:
                _reload_draft(draft[0], weights, draft[1])
        _reset_caches(worker)
        return
    if hasattr(runner, "reload_weights"):
        with _config_context(worker):
            runner.reload_weights(weights_iterator=iter(weights))
        return
    if expert_format.quantized:
        raise RefitError(
            "this vLLM has no layerwise reload (vllm.model_executor.model_loader.reload); reloading FP8 "
            "weights into processed kernel parameters would corrupt them: upgrade vLLM",
            kind=ErrorKind.ENGINE,
        )
    with _config_context(worker):
        model.load_weights(weights)


#: the attribute each vLLM 0.33.0 MoE quant method keeps its resolved kernel backend in
_BACKEND_ATTRS = (
    "fp8_backend",
    "mxfp8_backend",
    "nvfp4_backend",
    "wna16_backend",
    "mxfp4_backend",
    "backend",
)


def _resolved_backend(model: torch.nn.Module) -> str:
    """The first MoE layer's resolved quant method class, its kernel backend if it says, and its
    experts class (``experts_cls``: compressed-tensors MXFP4 keeps ``mxfp4_backend = MARLIN`` while
    choosing ``CutlassExpertsMxfp4`` on SM100)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None and any(hasattr(module, w) for w in ("w13_weight", "w13_weight_packed")):
            backend = next((getattr(method, a) for a in _BACKEND_ATTRS if getattr(method, a, None)), None)
            kind = type(method).__name__
            if backend is not None:
                kind = f"{kind}/{getattr(backend, 'name', backend)}"
            experts = getattr(method, "experts_cls", None)
            return f"{kind}/{experts.__name__}" if isinstance(experts, type) else kind
    return ""


def _device_capability() -> int | None:
    """``current_platform.get_device_capability().to_int()`` on CUDA (90 = Hopper), else None: the GPU
    :func:`adapters.vllm.backends.four_bit_gpu_problems` checks the 4-bit MoE backends against."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return None
    if not current_platform.is_cuda():
        return None
    capability = current_platform.get_device_capability()
    return int(capability.to_int()) if capability is not None else None


def streamed_group_loader(worker: Any) -> Any:
    """The streaming ``load_group`` for ``worker``, or None (whole generations through
    :func:`load_generation`) on a vLLM without layerwise reload. The target model takes the layer
    groups in one layerwise session (``adapters.vllm.stream.LayerwiseGroups``); an MTP drafter is
    reloaded by :func:`reload_draft` from the complete generation when the step is sealed, after
    that session is finalized and before the step is acknowledged, and the runner's caches are
    reset (:func:`complete_reload`), as :func:`load_generation` does after the target."""
    from adapters.vllm.stream import WorkerAccess, layerwise_group_loader

    access = WorkerAccess(
        _model, _config_context, ordered_weights, carry=carried_scales, complete=complete_reload
    )
    return layerwise_group_loader(worker, access)


class RefitWorkerExtension:
    """Mixed into every vLLM worker by ``LLM(worker_extension_cls="adapters.vllm.RefitWorkerExtension")``.

    ``self`` is vLLM's worker (``model_runner``, ``device``, ``model_config``, ``vllm_config``, ``rank``).
    Drive it from the driver with ``llm.collective_rpc``::

        llm.collective_rpc("refit_attach", args=("ipc:///run/refitd/control.sock",))
        results = refit_engine(llm, min_step=0)     # every worker loads; raises naming any that failed
        llm.collective_rpc("refit_detach")
    """

    def refit_manifest(self) -> Manifest:
        _require_vllm("RefitWorkerExtension.refit_manifest")
        import vllm

        parallel = self.vllm_config.parallel_config
        ep = (
            parallel.tensor_parallel_size * parallel.data_parallel_size
            if parallel.enable_expert_parallel
            else 1
        )
        with _config_context(self):
            model = _model(self)
            params, source = engine_parameters_and_source(model)
            draft = _draft(self)
            manifest = build_manifest(
                params,
                self.model_config.hf_config.to_dict(),
                self.vllm_config.quant_config,
                draft_params=engine_parameters_and_source(draft[0])[0] if draft is not None else (),
                tp_size=parallel.tensor_parallel_size,
                ep_size=ep,
                engine_version=vllm.__version__,
                moe_backend=_resolved_backend(model),
                param_source=source,
                deep_gemm_e8m0=_deep_gemm_e8m0(),
            )
        # the GPU the 4-bit MoE backend rules are checked against (check_vllm_constraints)
        return dataclasses.replace(
            manifest, info={**manifest.info, "device_capability": _device_capability()}
        )

    def refit_attach(
        self, endpoint: str, name: str | None = None, timeout: float = 600.0, streaming: bool | None = None
    ) -> dict[str, Any]:
        """Attach with this worker's manifest: refused locally (:func:`check_vllm_constraints`, naming
        the engine setting that works) or by the daemon (listing every mismatch). ``streaming=False``
        loads whole generations only (default: streamed where this vLLM has layerwise reload)."""
        _require_vllm("RefitWorkerExtension.refit_attach")
        from adapters.engine import EngineWorker

        manifest = self.refit_manifest()
        hf_config = self.model_config.hf_config.to_dict()
        # what vLLM skips on a reload for the MoE backend it resolved (reload_fixups.py)
        redo_skipped_post_load(_model(self))
        draft = _draft(self)
        if draft is not None:
            redo_skipped_post_load(draft[0])
        fmt = manifest.expert_format
        self._refit = EngineWorker(
            endpoint,
            name=name or f"vllm-rank{self.rank}",
            manifest=manifest,
            load=lambda gen: load_generation(self, gen.tensors, fmt),
            # streamed refit through layerwise reload (None: whole generations, see streamed_group_loader)
            load_group=streamed_group_loader(self),
            streaming=streaming,
            timeout=timeout,
            check=lambda m: check_vllm_constraints(m, hf_config),
        )
        try:
            return self._refit.attach()
        except RefitError as exc:
            note = fallback_note(manifest)
            if not note:
                raise
            raise RefitError(exc.message + note, kind=exc.kind, rank=exc.rank, step=exc.step) from exc

    def refit_load(self, min_step: int | None = None, timeout: float | None = None) -> dict[str, Any]:
        """Load the next generation >= ``min_step``; a result dict even on failure, so the driver
        names every failed worker."""
        _require_vllm("RefitWorkerExtension.refit_load")
        worker = getattr(self, "_refit", None)
        name = getattr(worker, "name", f"vllm-rank{getattr(self, 'rank', '?')}")
        t0 = time.perf_counter()
        try:
            if worker is None:
                raise RefitError("refit_load before refit_attach", kind=ErrorKind.ENGINE)
            return worker.load_next(min_step=min_step, timeout=timeout).to_dict()
        except Exception as exc:
            log.exception("refit load failed on %s", name)
            error = f"{type(exc).__name__}: {exc}"
            return {
                "worker": name,
                "step": None,
                "ok": False,
                "seconds": time.perf_counter() - t0,
                "error": error,
            }

    def refit_detach(self) -> None:
        worker = getattr(self, "_refit", None)
        if worker is not None:
            worker.detach()
            self._refit = None


def refit_engine(llm: Any, min_step: int | None = None, timeout: float | None = None) -> list:
    """Driver side: every worker loads the next generation >= ``min_step``; RefitError naming every
    failed worker (an empty result list is a failure). Resets the prefix cache after a success."""
    from adapters.engine import check_results

    results = check_results(llm.collective_rpc("refit_load", args=(min_step, timeout)), step=min_step)
    reset: Callable[[], Any] | None = getattr(llm, "reset_prefix_cache", None)
    if reset is not None:
        reset()
    return results
