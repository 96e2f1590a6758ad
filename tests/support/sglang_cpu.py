"""SGLang 0.5.23's real model classes and weight updater on this CPU (``.venv-sglang``, make test-sglang).

Two imports SGLang makes cannot work without CUDA, and nothing they provide ever runs here (no
forward pass, no kernel): the CUDA torchvision's ``_meta_registrations`` registers fake kernels for
``torchvision::nms`` / ``qnms``, ops its CUDA library would define (their schemas are defined here
first, as for vLLM); and ``RotaryEmbedding.__init__`` on a non-CUDA, non-``SGLANG_USE_CPU_ENGINE``
device imports ``vllm._custom_ops.rotary_embedding`` as its fallback kernel (a module whose function
raises if called is put in its place; ``SGLANG_USE_CPU_ENGINE=1`` would need sgl-kernel's CPU build).
Everything else is SGLang's own code: ``ServerArgs``, ``publish``, its gloo process groups,
``ModelConfig``, ``get_model`` (dummy or safetensors load format) and ``WeightUpdater``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import socket
import sys
import types
from pathlib import Path
from typing import Any

import torch

from adapters.sglang import LOADER

_shims: list[Any] = []


def _no_kernel(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("no kernel runs in refitd's CPU tests of SGLang (a rotary fallback kernel was called)")


def cuda_free_torchvision() -> None:
    """Define the ``torchvision::nms`` / ``qnms`` schemas the CUDA torchvision registers fake kernels
    for, so that it imports without its CUDA op library (vLLM and SGLang import torchvision)."""
    if not _shims:
        try:  # defined already (.venv-engines' import shim, tests/engines/refitd_torchvision_shim.py)
            torch.ops.torchvision.nms  # noqa: B018
        except (AttributeError, RuntimeError):
            lib = torch.library.Library("torchvision", "DEF")
            for op in ("nms", "qnms"):
                with contextlib.suppress(RuntimeError):  # already defined (a real torchvision op library)
                    lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            _shims.append(lib)
        else:
            _shims.append(None)


def import_sglang() -> Any:
    """Import SGLang's loader and model modules on CPU (the shims above first); returns ``sglang``.
    ImportError, with nothing of this process changed, where SGLang is not installed (``.venv``: the
    stand-in ``vllm`` module below would otherwise stay behind for every later test)."""
    if importlib.util.find_spec("sglang") is None:
        raise ImportError("No module named 'sglang': run `make test-sglang`")
    if len(_shims) < 2:
        cuda_free_torchvision()
        _shims.append(True)
        if "vllm" not in sys.modules:
            ops = types.ModuleType("vllm._custom_ops")
            ops.rotary_embedding = _no_kernel
            pkg = types.ModuleType("vllm")
            pkg._custom_ops = ops
            sys.modules["vllm"], sys.modules["vllm._custom_ops"] = pkg, ops
    import sglang
    import sglang.srt.model_executor.model_runner_components.weight_updater
    import sglang.srt.model_loader

    return sglang


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_distributed: list[bool] = []


def build_model(model_dir: Path, *, load_format: str = "dummy", **server_args: Any) -> torch.nn.Module:
    """SGLang's model for ``model_dir`` (config.json, and safetensors for ``load_format="auto"``),
    built and loaded by ``sglang.srt.model_loader.get_model`` on CPU, world of one (gloo);
    ``server_args``: more ``ServerArgs`` fields (``moe_runner_backend``)."""
    import_sglang()
    from sglang.srt import runtime_context as rc
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.layers.moe.utils import initialize_moe_config
    from sglang.srt.model_loader import get_model
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(
        model_path=str(model_dir),
        device="cpu",
        dtype="bfloat16",
        load_format=load_format,
        skip_tokenizer_init=True,
        tp_size=1,
        custom_weight_loader=[LOADER],
        **server_args,
    )
    rc.publish(args, role="scheduler", ranks=rc.SpawnRanks(world_rank=0))
    initialize_moe_config()  # what the scheduler does after publish: the MoE backend flags of ``args``
    if not _distributed:
        ps.init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
            backend="gloo",
        )
        ps.initialize_model_parallel(backend="gloo")
        _distributed.append(True)
    config = ModelConfig.from_server_args(args)
    return get_model(
        model_config=config,
        load_config=LoadConfig(load_format=load_format),
        device_config=DeviceConfig("cpu"),
    )


def weight_updater(model: torch.nn.Module) -> Any:
    """SGLang's ``WeightUpdater`` over ``model``, with refitd's loader listed as a custom loader (what
    ``ModelRunner.init_weight_updater`` builds from ``--custom-weight-loader``)."""
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    def _unused(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the tensor update path does not call this")

    return WeightUpdater(
        tp_rank=0,
        device="cpu",
        gpu_id=0,
        model_config=None,
        custom_weight_loaders=[LOADER],
        get_model=lambda: model,
        update_model_fields=_unused,
        recapture_cuda_graph=_unused,
        get_model_runner=_unused,
    )
