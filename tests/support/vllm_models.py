"""vLLM 0.33.0's real model classes built on CPU, for ``make test-engines`` (tests/test_engine_vllm_models.py).

What is real: the model classes (``Qwen3MoeForCausalLM``, ``Qwen3_5MoeForConditionalGeneration``,
``DeepseekV3ForCausalLM`` and the MTP drafters), their ``load_weights``, vLLM's quantization configs
and quant methods (``Fp8MoEMethod``, ``ModelOptMxFp8FusedMoE``, ``UnquantizedFusedMoEMethod``), the
weight loaders, ``process_weights_after_loading``, layerwise reload and the distributed groups (gloo).
The config.json each model is built from is written by transformers' own config class.

What is replaced, because vLLM cannot make the choice without a GPU (no kernel ever runs here):

* the MoE kernel backend choice: ``quantization/fp8.py select_fp8_moe_backend`` answers NONE on a
  CPU without AMX and ``unquantized_fused_moe_method.select_unquantized_moe_backend`` answers CPU
  (whose ops the CUDA wheel lacks); both are made to answer TRITON, the layout Hopper uses;
* NVFP4's MoE backend choice (``oracle/nvfp4.py select_nvfp4_moe_backend``) answers EMULATION, vLLM's
  Triton experts that dequantize on the fly (no NVFP4 kernel class reports a CPU as supported); INT4
  W4A16's (``oracle/int_wna16.py select_wna16_moe_backend``) answers EMULATION likewise;
* per-tensor FP8's requantization of w1/w3 to one scale in ``process_weights_after_loading``
  (``_custom_ops.scaled_fp8_quant``, a ``vllm._C`` op that cannot load against the CPU torch) is the
  same arithmetic in torch;
* compressed-tensors MXFP4's Marlin preparation: ``torch.ops._C.gptq_marlin_repack`` registered as
  vLLM's own pure-torch reference of the layout, and ``MarlinExperts``' device check answers True
  (``tests/support/vllm_marlin.py``);
* the CPU's AMX, as vLLM sees it (``torch.cpu._is_amx_tile_supported``), answers False: on a CPU with AMX
  (Intel Sapphire Rapids and later) vLLM's CPU-only paths (the sgl-kernel weight packing of small
  unquantized linears in ``layers/utils.py dispatch_cpu_unquantized_gemm``, AMX attention and GDN
  convolution) call ``torch.ops._C`` ops of its CPU build that the CUDA wheel lacks; without AMX every
  host takes the path a GPU's model takes, as these tests check;
* Qwen3.5's CPU-only ``causal_conv1d_weight_pack`` (an AVX-512-BF16 prepack of the conv weight that
  a GPU never does) is made a no-op;
* ``torchvision::nms`` / ``qnms`` get their schemas defined before torchvision imports
  (``tests/engines/refitd_torchvision_shim.py``, installed with a ``.pth`` line by
  ``tests/setup_engines.sh``): the CUDA torchvision wheel's compiled ops do not load against the
  CPU torch, and its meta registrations need the operators to exist.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch


def import_vllm() -> Any:
    """vLLM, imported on its CPU platform with the torchvision shim in place."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import vllm

    _replace_backend_choice()
    return vllm


_PATCHED = False


def _replace_backend_choice() -> None:
    """The only replaced parts of vLLM (see the module docstring)."""
    global _PATCHED
    if _PATCHED:
        return
    from vllm.model_executor.layers import utils as layer_utils
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as unq
    from vllm.model_executor.layers.fused_moe.oracle import fp8 as fp8_oracle
    from vllm.model_executor.layers.fused_moe.oracle import unquantized as unq_oracle
    from vllm.model_executor.layers.quantization import fp8 as fp8_quant

    def fp8_triton(config, weight_key, activation_key, allow_vllm_cutlass=False):
        backend = fp8_oracle.Fp8MoeBackend.TRITON
        return backend, fp8_oracle.backend_to_kernel_cls(backend)[0]

    def unquantized_triton(moe_config):
        backend = unq_oracle.UnquantizedMoeBackend.TRITON
        return backend, unq_oracle.backend_to_kernel_cls(backend)[0]

    torch.cpu._is_amx_tile_supported = lambda: False  # see the module docstring
    fp8_quant.select_fp8_moe_backend = fp8_triton
    _replace_nvfp4_backend_choice()
    unq.select_unquantized_moe_backend = unquantized_triton

    class _NoPack:
        def __getattr__(self, name):
            if name == "causal_conv1d_weight_pack":
                raise AttributeError(name)
            return getattr(layer_utils.__dict__["_real_ops"], name)

    layer_utils.__dict__["_real_ops"] = layer_utils.ops
    layer_utils.ops = _NoPack()
    _replace_static_fp8_quant()
    from support import vllm_marlin

    vllm_marlin.install()  # MXFP4's Marlin repack and MarlinExperts' device check (vllm_marlin.py)
    _PATCHED = True


def _replace_nvfp4_backend_choice() -> None:
    """NVFP4 MoE: ``oracle/nvfp4.py select_nvfp4_moe_backend`` finds no backend on a CPU (each
    kernel class checks ``current_platform.is_cuda()``); made to answer EMULATION, vLLM's own Triton
    experts that dequantize NVFP4 on the fly (its fallback on GPUs without native FP4), whose
    ``convert_to_nvfp4_moe_kernel_format`` is pure torch (``input_scale`` -> ``1 / max``)."""
    from vllm.model_executor.layers.fused_moe.oracle import nvfp4 as nvfp4_oracle
    from vllm.model_executor.layers.quantization import modelopt

    def nvfp4_emulation(config, weight_key=None, activation_key=None):
        backend = nvfp4_oracle.NvFp4MoeBackend.EMULATION
        return backend, nvfp4_oracle.backend_to_kernel_cls(backend)[0]

    modelopt.select_nvfp4_moe_backend = nvfp4_emulation

    # INT4 W4A16 the same: ``oracle/int_wna16.py select_wna16_moe_backend`` -> EMULATION
    # (``Int4EmulationTritonExperts``: the int4 weights dequantized to BF16 in process_weights_after_loading)
    from vllm.model_executor.layers.fused_moe.oracle import int_wna16
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_wna16 as ct_wna16,
    )

    def wna16_emulation(
        config, weight_key, quant_config, may_have_zp, may_have_bias, allow_tile_padding=False
    ):
        backend = int_wna16.WNA16MoEBackend.EMULATION
        return backend, int_wna16.backend_to_kernel_cls(backend)[0]

    ct_wna16.select_wna16_moe_backend = wna16_emulation


def _replace_static_fp8_quant() -> None:
    """Per-tensor FP8 only: ``process_fp8_weight_tensor_strategy_moe`` requantizes w1 and w3 to one
    scale per expert with ``_custom_ops.scaled_fp8_quant(x, scale)``, a compiled op of ``vllm._C``
    that does not load against the CPU torch. Replaced by the same arithmetic in torch (the CUDA
    kernel multiplies by the reciprocal of the scale and saturates at +-448); anything else of
    ``scaled_fp8_quant`` (dynamic scales) raises."""
    from vllm import _custom_ops

    if hasattr(torch.ops._C, "static_scaled_fp8_quant"):
        return

    def scaled_fp8_quant(input, scale=None, num_token_padding=None, output=None, group_shape=None, **kw):
        if scale is None or num_token_padding or group_shape is not None or any(kw.values()):
            raise NotImplementedError("only the static per-tensor requantization runs on CPU in these tests")
        finfo = torch.finfo(torch.float8_e4m3fn)
        q = (input.float() * (1.0 / scale.float())).clamp(finfo.min, finfo.max).to(torch.float8_e4m3fn)
        if output is not None:
            output.copy_(q)
            q = output
        return q, scale

    _custom_ops.scaled_fp8_quant = scaled_fp8_quant


# --------------------------------------------------------------------------------------------------
# tiny configs, written by transformers' own classes


def write_config(root: Path, model_type: str, *, moe_intermediate_size: int = 128) -> Path:
    """A tiny ``config.json`` for ``model_type`` saved by transformers' config class; returns its folder."""
    from transformers import DeepseekV3Config, Qwen3_5MoeConfig, Qwen3MoeConfig

    common = dict(vocab_size=256, hidden_size=256, max_position_embeddings=512, tie_word_embeddings=False)
    i = moe_intermediate_size
    if model_type == "qwen3_moe":
        cfg = Qwen3MoeConfig(
            **common,
            architectures=["Qwen3MoeForCausalLM"],
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=128,
            intermediate_size=256,
            moe_intermediate_size=i,
            num_experts=4,
            num_experts_per_tok=2,
        )
    elif model_type == "qwen3_5_moe":
        text = dict(
            **common,
            num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"],
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=128,
            linear_num_key_heads=1,
            linear_num_value_heads=2,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            moe_intermediate_size=i,
            shared_expert_intermediate_size=128,
            num_experts=4,
            num_experts_per_tok=2,
            mtp_num_hidden_layers=1,
        )
        vision = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=256)
        cfg = Qwen3_5MoeConfig(
            text_config=text,
            vision_config=vision,
            tie_word_embeddings=False,
            architectures=["Qwen3_5MoeForConditionalGeneration"],
        )
    elif model_type == "deepseek_v3":
        cfg = DeepseekV3Config(
            **common,
            architectures=["DeepseekV3ForCausalLM"],
            num_hidden_layers=2,
            first_k_dense_replace=1,
            intermediate_size=256,
            moe_intermediate_size=i,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            q_lora_rank=128,
            kv_lora_rank=128,
            qk_nope_head_dim=64,
            qk_rope_head_dim=64,
            v_head_dim=64,
            num_nextn_predict_layers=1,
            topk_method="noaux_tc",  # as DeepSeek-V3's config.json (transformers does not write it)
        )
    else:
        raise ValueError(model_type)
    out = root / f"{model_type}-i{i}"
    cfg.save_pretrained(out)
    return out


def config_dict(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "config.json").read_text())


# --------------------------------------------------------------------------------------------------
# an engine: vLLM's config objects, the distributed groups, the model (and its MTP drafter)


def init_distributed(config, rank: int = 0, world_size: int = 1, init_method: str | None = None) -> None:
    """vLLM's world and model-parallel groups on gloo (once per process), under ``config``."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        return
    if init_method is None:
        from support.net import free_port

        init_method = f"tcp://127.0.0.1:{free_port()}"
    with set_current_vllm_config(config):
        ps.init_distributed_environment(
            world_size=world_size,
            rank=rank,
            local_rank=rank,
            distributed_init_method=init_method,
            backend="gloo",
        )
        ps.initialize_model_parallel(world_size, 1)


def vllm_config(folder: Path, engine_args: Mapping[str, Any], *, tp: int = 1, mtp: bool = False):
    """``VllmConfig`` for the model in ``folder`` with ``vllm_engine_args``' settings."""
    from vllm.config import (
        DeviceConfig,
        LoadConfig,
        ModelConfig,
        ParallelConfig,
        SpeculativeConfig,
        VllmConfig,
    )

    kw: dict[str, Any] = {}
    if engine_args.get("hf_overrides"):
        kw["hf_overrides"] = dict(engine_args["hf_overrides"])
    if engine_args.get("language_model_only"):
        kw["language_model_only"] = True
    if engine_args.get("hf_config_path"):  # NeMo-RL's vllm_kwargs (integrations.nemo_rl_vllm)
        kw["hf_config_path"] = str(engine_args["hf_config_path"])
    mc = ModelConfig(
        model=str(folder),
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype=engine_args.get("dtype", "bfloat16"),
        quantization=engine_args.get("quantization"),
        **kw,
    )
    parallel = ParallelConfig(tensor_parallel_size=tp)
    spec = None
    if mtp:
        spec = SpeculativeConfig(
            method="mtp", num_speculative_tokens=1, target_model_config=mc, target_parallel_config=parallel
        )
    return VllmConfig(
        model_config=mc,
        device_config=DeviceConfig("cpu"),
        load_config=LoadConfig(load_format="dummy"),
        parallel_config=parallel,
        speculative_config=spec,
    )


def build_model(config, *, draft: bool = False) -> torch.nn.Module:
    """The model (or its MTP drafter) as vLLM's loader creates it: default dtype and device set,
    under ``set_current_vllm_config``; parameters uninitialised, nothing processed yet."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    model_config = config.speculative_config.draft_model_config if draft else config.model_config
    # each attention layer registers its name in the config's forward context, once per config;
    # a second model of the same config (a test's reference) registers its own, then the first's return
    context = config.compilation_config.static_forward_context
    kept = dict(context)
    context.clear()
    try:
        with (
            set_current_vllm_config(config),
            set_default_torch_dtype(model_config.dtype),
            torch.device("cpu"),
        ):
            return initialize_model(vllm_config=config, model_config=model_config)
    finally:
        if kept:
            context.clear()
            context.update(kept)


def process(config, model: torch.nn.Module, *, draft: bool = False) -> None:
    """vLLM's own ``process_weights_after_loading`` (what its loader runs after the first load)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    model_config = config.speculative_config.draft_model_config if draft else config.model_config
    with set_current_vllm_config(config):
        process_weights_after_loading(model, model_config, torch.device("cpu"))


def worker(config, model: torch.nn.Module, draft: torch.nn.Module | None = None, rank: int = 0):
    """The parts of vLLM's ``Worker`` the adapter touches: ``model_runner.get_model()`` /
    ``get_draft_model()`` and the encoder/multimodal cache resets, the configs, device and rank.
    The runner's cache resets count their calls (vLLM's own runner clears its caches there)."""
    resets: dict[str, int] = {"encoder": 0, "mm": 0, "lora": 0}

    def count(key):
        def reset():
            resets[key] += 1

        return reset

    runner = SimpleNamespace(
        get_model=lambda: model,
        get_draft_model=lambda: draft,
        reset_encoder_cache=count("encoder"),
        reset_mm_cache=count("mm"),
        reset_lora_state=count("lora"),
        resets=resets,
    )
    return SimpleNamespace(
        model_runner=runner,
        device=torch.device("cpu"),
        vllm_config=config,
        model_config=config.model_config,
        speculative_config=config.speculative_config,
        rank=rank,
    )


def load_mismatches(model: torch.nn.Module, expected) -> tuple[list[str], int]:
    """Compare every parameter of a loaded ``model`` with ``expected(name, param)`` (None: engine-only
    state, not compared): (a line per parameter whose dtype, shape or bytes differ, how many compared)."""
    wrong, checked = [], 0
    for name, p in model.named_parameters():
        want = expected(name, p)
        if want is None:
            continue
        checked += 1
        same = p.dtype == want.dtype and p.shape == want.shape
        if not (
            same and torch.equal(p.detach().reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
        ):
            wrong.append(
                f"{name}: engine {p.dtype} {tuple(p.shape)}, generation {want.dtype} {tuple(want.shape)}"
            )
    return wrong, checked


# --------------------------------------------------------------------------------------------------
# streamed refit: the daemon's groups, and adapters.stream's own steps with the daemon's side recorded


def stream_groups(params, spec, *, keep_bf16=()) -> list[list[str]]:
    """The layer groups refitd's daemon streams a generation of ``params`` (``(name, shape, dtype)``)
    planned with ``spec`` in: what its STREAM message lists (``sidecar.daemon.streams.StreamGroups``)."""
    from sidecar.daemon.streams import StreamGroups
    from sidecar.plan.refit_plan import RefitPlan

    return StreamGroups.of(RefitPlan.build(list(params), spec, keep_bf16=keep_bf16), key=0).names


class StreamedSteps:
    """A vLLM worker's streamed steps run by ``adapters.stream``'s own code: an ``EngineWorker`` with
    the worker's ``streamed_group_loader`` takes all but the last group as GROUP messages would
    bring them (``_load_groups``), then the step is published (``_finish``: the rest, the engine's
    finish, the acknowledgement). This object stands in for the reader's connection to the daemon
    and records what each step was acknowledged with (``acks``: ``(step, ok, error)``)."""

    instance = None  # the daemon start (none: the steps are handed over here)

    def __init__(self, worker, groups: list[list[str]]):
        from adapters.engine import EngineWorker
        from adapters.vllm.worker import streamed_group_loader

        loader = streamed_group_loader(worker)
        if loader is None:
            raise AssertionError("the worker does not stream (streamed_group_loader returned None)")
        self.groups, self.acks, self.sent = groups, [], []
        self.engine = EngineWorker(
            "ipc:///nowhere", name="vllm-streamed", manifest=lambda: None, load=None, load_group=loader
        )
        self.engine.reader = self

    def release(self, gen, *, ok: bool = True, error: str | None = None, seconds: float | None = None):
        if gen.segment != "live":  # the live generation's release (no acknowledgement): not recorded
            self.acks.append((gen.step, ok, error))

    def _send(self, kind, fields, **kw) -> None:
        self.sent.append((kind, fields))

    def step(self, live: tuple[int, dict], step: int, tensors: dict):
        """Stream ``tensors`` as ``step`` on top of ``live`` (``(step, tensors)``, what the engine
        holds); the ``LoadResult``."""
        from adapters.base import Generation
        from adapters.stream import StreamedStep, _finish, _load_groups

        held = Generation(live[0], live[0], live[1], segment="live")
        gen = Generation(step, step, tensors, segment="step")
        stream = StreamedStep(step, step, None, gen, held, self.groups)
        failed = _load_groups(self.engine, stream, list(range(len(self.groups) - 1)))
        return failed if failed is not None else _finish(self.engine, stream, gen)
