"""Every workaround `make test-megatron` needs to run Megatron-Core 0.19.2 and Megatron-Bridge 0.6.2
on a CPU with gloo, in one place, each with its reason. None of them is refitd's: they let the real
Megatron code (model, parallel state, the bridge's import and export) run in CI without a GPU.

1. torch: PyPI's cp312 torch is a CUDA build (Megatron needs Python >= 3.12; the project's CPU torch
   wheel is cp311). tests/setup_megatron.sh installs it with --no-deps and tests/support/cuda_stubs.py
   gives its CUDA libraries empty stand-ins, so it imports; torch.cuda.is_available() is False.
2. TransformerEngine: ``megatron.bridge.peft.lora_layers`` imports ``transformer_engine.pytorch`` at
   module level (only for LoRA's isinstance checks), and TE is a CUDA-only build. :func:`install`
   puts a stand-in module whose classes match nothing; the model is built with Megatron's local
   (non-TE) layer spec, so no TE layer is ever made.
3. The model: Megatron's local layer spec (no TE layers), the ``allgather`` token dispatcher (the
   ``alltoall`` one makes a ``torch.cuda.Stream`` when it is built), no grouped GEMM and no fused
   permutation, router, RoPE, softmax, bias-activation, layer-norm or gradient-accumulation
   kernels (CUDA or TE only), weights made on the CPU in BF16: :func:`provider_settings`.

``install()`` is called first thing in every process of the Megatron tests (tests/megatron_rank.py).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from pathlib import Path

import torch


class _MissingType(type):
    """TE's attributes' attributes (``te.common.recipe.Format``...): more of the same."""

    def __getattr__(cls, key: str):
        if key.startswith("__"):
            raise AttributeError(key)
        return _Missing


class _Missing(metaclass=_MissingType):
    """A TE class or function: no object is an instance of it; never called on the CPU path."""


class _TEStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Workaround 2: every ``transformer_engine`` module imports, at version 0.0.0 (older than any
    feature Megatron asks for), and each of its attributes is a class no object is an instance of."""

    def find_spec(self, name, path=None, target=None):
        if name == "transformer_engine" or name.startswith(
            ("transformer_engine.", "transformer_engine_torch")
        ):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []
        module.__version__ = "0.0.0"

        def attr(key: str):
            if key.startswith("__"):
                raise AttributeError(key)
            return _Missing

        module.__getattr__ = attr


def _core_without_te() -> None:
    """Import every Megatron-Core module that looks for TransformerEngine before the stand-in
    exists: each then records that TE is absent and takes its non-TE path (a module that fails to
    import on the CPU is skipped: the model never uses it)."""
    import megatron.core

    root = Path(megatron.core.__file__).parent
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(errors="replace")
        if "transformer_engine" not in text:
            continue
        name = ".".join(("megatron", "core", *path.relative_to(root).with_suffix("").parts))
        name = name.removesuffix(".__init__")
        with contextlib.suppress(Exception):
            importlib.import_module(name)


def install() -> None:
    """Apply every workaround; call before importing megatron.bridge."""
    if any(isinstance(f, _TEStandIn) for f in sys.meta_path):
        return
    _core_without_te()
    sys.meta_path.append(_TEStandIn())
    try:
        importlib.import_module("megatron.bridge")
    finally:  # only the bridge's own modules saw it
        for name in [n for n in sys.modules if n.startswith("transformer_engine")]:
            del sys.modules[name]
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _TEStandIn)]


#: workaround 3: the provider's fields that pick CUDA- or TE-only code, and their CPU values
CPU_PROVIDER = dict(
    moe_token_dispatcher_type="allgather",
    moe_permute_fusion=False,
    moe_grouped_gemm=False,
    moe_router_fusion=False,
    gradient_accumulation_fusion=False,
    persist_layer_norm=False,
    bias_activation_fusion=False,
    masked_softmax_fusion=False,
    apply_rope_fusion=False,
    cross_entropy_loss_fusion=False,
    use_cpu_initialization=True,
    bf16=True,
    params_dtype=torch.bfloat16,
)


def provider_settings(provider) -> None:
    """Workaround 3 on a Megatron-Bridge model provider (before ``finalize()``)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    for key, value in CPU_PROVIDER.items():
        if not hasattr(provider, key):
            raise AttributeError(
                f"the Megatron provider has no {key!r}: update tests/support/megatron_cpu.py"
            )
        setattr(provider, key, value)

    def local_spec(config, *args, **kwargs):
        return get_gpt_layer_local_spec(
            num_experts=config.num_moe_experts, moe_grouped_gemm=False, qk_layernorm=config.qk_layernorm
        )

    provider.transformer_layer_spec = local_spec
