"""The engine-touching surface: the Ray worker extension. TensorRT-LLM is imported inside its methods."""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch

from adapters.trtllm.carry import NVFP4_INPUT_PARAMS, nvfp4_input_scales
from adapters.trtllm.checkpoint import build_manifest
from adapters.trtllm.checks import check_trtllm_constraints
from sidecar.numerics.formats import Format
from sidecar.plan.build import Layer, layer_of_name
from sidecar.protocol.manifest import Manifest

log = logging.getLogger("adapters.trtllm")


def _require_tensorrt_llm() -> Any:
    try:
        import tensorrt_llm
    except ImportError as exc:
        raise RuntimeError(
            "adapters.trtllm.RefitWorkerExtension runs inside TensorRT-LLM's Ray workers and needs "
            "tensorrt_llm importable there (pip install tensorrt-llm); the pure helpers "
            "(trtllm_llm_args, build_manifest, check_trtllm_constraints) work without it"
        ) from exc
    return tensorrt_llm


def _moe_impl(module: torch.nn.Module) -> torch.nn.Module:
    """The module holding a MoE layer's weights: a ``ConfigurableMoE``'s ``backend`` (the default with
    ``ENABLE_CONFIGURABLE_MOE=1``), else the layer itself."""
    impl = getattr(module, "backend", None)
    return impl if isinstance(impl, torch.nn.Module) else module


def _resolved_moe(module: torch.nn.Module) -> str:
    return type(_moe_impl(module)).__name__


def _moe_quant_method(model: torch.nn.Module) -> str:
    """The resolved quant method class of the model's MoE modules (``CutlassFusedMoE._get_quant_method``
    may pick the DeepGEMM block-FP8 method); several joined by commas, "" when none says."""
    names = set()
    for name, m in model.named_modules():
        if name.endswith(".experts"):
            method = getattr(_moe_impl(m), "quant_method", None)
            if method is not None:
                names.add(type(method).__name__)
    return ",".join(sorted(names))


def _mxfp8_reload_path() -> bool:
    """Whether this TensorRT-LLM build has the MXFP8 MoE reload path: ``MXFP8CutlassFusedMoEMethod``
    exists and swizzles its scales in its own ``process_weights_after_loading`` (older builds swizzle
    while loading, which a partial reload cannot redo, or cannot run the MXFP8 MoE forward at all)."""
    try:
        from tensorrt_llm._torch.modules.fused_moe import quantization
    except ImportError:
        return False
    method = getattr(quantization, "MXFP8CutlassFusedMoEMethod", None)
    return method is not None and "process_weights_after_loading" in vars(method)


def _sync_copies(device: torch.device) -> None:
    """Wait for the host-to-device copies queued on ``device``'s current stream: TRT-LLM's loader
    reads the tensors from worker threads that do not order themselves after that stream."""
    torch.cuda.current_stream(device).synchronize()


class RefitWorkerExtension:
    """Mixed into TRT-LLM's Ray GPU worker (``ray_worker_extension_cls``); ``self.engine`` is its
    PyExecutor and ``self.device_id`` its GPU. Every attribute is prefixed ``refit_`` / ``_refit_``
    because TRT-LLM refuses an extension that shadows a worker attribute.

        llm._collective_rpc("refit_attach", args=(endpoint,))
        results = llm._collective_rpc("refit_load", args=(step, 600.0))
        llm._collective_rpc("refit_detach")
    """

    def refit_attach(
        self,
        endpoint: str,
        name: str | None = None,
        input_scale: float | None = None,
        hf_config: Mapping[str, Any] | None = None,
    ) -> dict:
        """Attach this worker to the daemon with the model's manifest (refused if plans differ).

        ``hf_config`` is the config the daemon plans from (default: the engine's pretrained config);
        pass it when they differ in form (a Qwen3.5 multimodal config names its text weights
        ``model.language_model.*``). ``input_scale`` gives per-tensor FP8 or NVFP4 experts a calibrated
        static activation scale (the checkpoint's ``input_scale``) when the engine holds none (dummy load).
        """
        from adapters.engine import EngineWorker

        tensorrt_llm = _require_tensorrt_llm()
        model = self.engine.model_engine.model
        if hf_config is None:
            pretrained = model.model_config.pretrained_config
            hf_config = pretrained.to_dict() if hasattr(pretrained, "to_dict") else dict(vars(pretrained))
        self._refit_fp8_input = self._refit_capture_input_scales(model, input_scale)
        manifest = self._refit_manifest(model, getattr(tensorrt_llm, "__version__", ""), hf_config)
        self._refit_format = manifest.expert_format
        rank = getattr(self.engine.model_engine, "global_rank", None)
        self._refit_worker = EngineWorker(
            endpoint,
            name=name or f"trtllm-{rank if rank is not None else self.device_id}",
            manifest=manifest,
            load=self._refit_apply,
            check=lambda m: check_trtllm_constraints(m, hf_config),
        )
        info = self._refit_worker.attach()
        return {"moe_backend": manifest.moe_backend, "expert_format": manifest.expert_format.value, **info}

    def refit_load(self, min_step: int | None = None, timeout: float | None = None) -> dict:
        """Wait for a generation (the engine keeps serving), load it with the engine drained,
        acknowledge it to the daemon; returns a LoadResult as a dict.

        A load that fails after the reload began leaves this worker's weights torn: the error goes
        to the daemon and to ``refit_engine``'s caller, which must not serve before the next
        successful refit (every generation is complete, so it repairs everything).
        """
        worker = getattr(self, "_refit_worker", None)
        if worker is None:
            raise RuntimeError(
                "refit_load before refit_attach: call llm._collective_rpc('refit_attach', ...) first"
            )
        return worker.load_next(min_step=min_step, timeout=timeout).to_dict()

    def refit_detach(self) -> None:
        worker = getattr(self, "_refit_worker", None)
        if worker is not None:
            worker.detach()
            self._refit_worker = None

    # ---- internals

    def _refit_manifest(self, model: torch.nn.Module, version: str, hf_config: Mapping[str, Any]) -> Manifest:
        from tensorrt_llm._utils import get_sm_version

        config = model.model_config
        mapping = config.mapping
        backends = {_resolved_moe(m) for n, m in model.named_modules() if n.endswith(".experts")}
        params = [(n, p.dtype, tuple(p.shape)) for n, p in model.named_parameters()]
        return build_manifest(
            params,
            hf_config,
            moe_backend=",".join(sorted(backends)) if len(backends) > 1 else next(iter(backends), ""),
            quant_method=_moe_quant_method(model),
            mxfp8_reload_path=_mxfp8_reload_path(),
            requested_backend=str(getattr(config, "moe_backend", "")),
            sm=get_sm_version(),
            tp_size=mapping.tp_size,
            moe_tp_size=getattr(mapping, "moe_tp_size", mapping.tp_size),
            moe_ep_size=getattr(mapping, "moe_ep_size", 1),
            engine_version=version,
            input_scales=bool(self._refit_fp8_input) or None,
        )

    def _refit_capture_input_scales(self, model: torch.nn.Module, override: float | None) -> dict:
        """MoE modules' static input scales, read once at attach: {module: (gate/up, down, experts)} in
        checkpoint terms (the ``input_scale`` every expert is given on reload).

        Per-tensor FP8: after loading only the maxima survive (``fc31_input_dequant``, ``1 /
        fc2_quant``); giving every expert those values reproduces the same maxima on reload (``1 /
        fc2_quant`` to within one rounding, taken once here, so it does not drift across refits).
        NVFP4: ``fc31_input_scale`` / ``fc2_input_scale`` hold ``1 / max(input_scale)``; every expert
        gets the exact float32 preimage (``adapters.trtllm.carry``), so the reload reproduces them bit
        for bit. Dummy-loaded (uniform in [-1e-3, 1e-3]) or non-positive scales are not usable: the
        manifest then says so and the attach is refused, unless ``override`` gives a calibrated scale.
        """
        scales: dict = {}
        for name, layer in model.named_modules():
            m = _moe_impl(layer)  # ConfigurableMoE: the parameters live on its backend
            if name.endswith(".experts") and all(hasattr(m, p) for p in NVFP4_INPUT_PARAMS):
                carried = nvfp4_input_scales(m, override)
                if carried is None:
                    return {}
                scales[name] = (*carried, int(m.num_experts))
                continue
            if not (
                name.endswith(".experts") and hasattr(m, "fc31_input_dequant") and hasattr(m, "fc2_quant")
            ):
                continue
            if override is not None:
                fc31 = fc2 = float(override)
            else:
                fc31 = float(m.fc31_input_dequant.detach().float().cpu())
                fc2 = 1.0 / float(m.fc2_quant.detach().float().cpu())
            if not (fc31 > 0 and fc2 > 0 and fc31 < float("inf") and fc2 < float("inf")):
                return {}
            scales[name] = (fc31, fc2, int(m.num_experts))
        return scales

    def _refit_input_scale_tensors(self) -> dict[str, torch.Tensor]:
        """``{module}.{e}.{gate|up|down}_proj.input_scale`` for every expert (the mappers rename them
        with the weights; a TRT-LLM module name is also a valid checkpoint prefix for them)."""
        out = {}
        for module, (fc31, fc2, experts) in self._refit_fp8_input.items():
            a, b = (torch.as_tensor(x, dtype=torch.float32).reshape(()) for x in (fc31, fc2))
            for e in range(experts):
                out[f"{module}.{e}.gate_proj.input_scale"] = a
                out[f"{module}.{e}.up_proj.input_scale"] = a
                out[f"{module}.{e}.down_proj.input_scale"] = b
        return out

    def _refit_apply(self, gen: Any) -> None:
        """Load one generation with the engine drained (``control_action``, as rlhf_utils does)."""
        with self.engine.control_action():
            self._refit_reload(gen)
            self._refit_finalize()

    def _refit_reload(self, gen: Any) -> None:
        """``pre_reload_weights`` once, then one partial ``reload`` per layer (copied host to device)."""
        model_engine = self.engine.model_engine
        model = model_engine.model
        device = torch.device("cuda", torch.cuda.current_device())
        live = [m for m in model.modules() if not getattr(m, "_weights_removed", False)]
        for module in live:  # capability preflight first: nothing is torn if a module refuses
            if hasattr(module, "check_reload_capability"):
                module.check_reload_capability()
        for module in live:
            if hasattr(module, "pre_reload_weights"):
                module.pre_reload_weights()
        groups: dict[Layer, list[str]] = defaultdict(list)
        for name in gen.tensors:
            groups[layer_of_name(name)].append(name)
        static = self._refit_format in (Format.FP8_PER_TENSOR, Format.NVFP4)
        extra = self._refit_input_scale_tensors() if static else {}
        for layer, names in groups.items():
            # one layer per call: Qwen3.5's mapper packs in_proj_qkv+z and in_proj_b+a within a call
            weights = {n: gen.tensors[n].to(device, non_blocking=True) for n in names}
            weights.update({n: t.to(device) for n, t in extra.items() if layer_of_name(n) == layer})
            _sync_copies(device)  # the loader's threads must not read half-copied tensors
            model_engine.model_loader.reload(model, weights, allow_partial_loading=True)
            del weights

    def _refit_finalize(self) -> None:
        """Exactly rlhf_utils.WorkerExtension.update_weights(None): process + post-load every module,
        finalize the MoE load balancer, reset the prefix cache, release cached memory."""
        model_engine = self.engine.model_engine
        for module in model_engine.model.modules():
            if getattr(module, "_weights_removed", False):
                continue
            if hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()
            if hasattr(module, "post_load_weights"):
                module.post_load_weights()
        balancer = getattr(model_engine, "moe_load_balancer", None)
        if balancer is not None and hasattr(balancer, "finalize_model"):  # a MoeLoadBalancer
            balancer.register_weight_slots_after_to_cuda()
            balancer.finalize_model()
        torch.cuda.synchronize()
        self.engine.reset_prefix_cache()
        torch.cuda.empty_cache()


def refit_engine(llm: Any, min_step: int | None = None, timeout: float | None = None) -> list[Any]:
    """Load the next generation (step >= ``min_step``) on every worker of ``llm``; checked results.

    Raises RefitError naming every failed worker; no result at all is a failure too.
    """
    from adapters.engine import check_results

    started = time.monotonic()
    results = llm._collective_rpc("refit_load", args=(min_step, timeout))
    checked = check_results(list(results or []), step=min_step)
    log.info(
        "trtllm refit: %d workers loaded step >= %s in %.2fs",
        len(checked),
        min_step,
        time.monotonic() - started,
    )
    return checked
