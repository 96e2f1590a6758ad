"""compressed-tensors NVFP4 W4A4's static activation global scales, carried over into every reload
(pure torch; ``adapters.vllm.carry.carried_input_scales`` calls :func:`carried_global_scales`).

vLLM 0.33.0's ``CompressedTensorsW4A4Nvfp4MoEMethod`` (``compressed_tensors_moe_w4a4_nvfp4.py``, not
``use_a16``) loads ``{moe}.{e}.{gate|up|down}_proj.input_global_scale`` per expert into
``w13_input_global_scale [E, 2]`` / ``w2_input_global_scale [E]`` (float32; compressed-tensors' global
scale ``g``, the reciprocal of ModelOpt's ``input_scale``). ``process_weights_after_loading`` passes
``a = 1.0 / g`` to ``oracle/nvfp4.py convert_to_nvfp4_moe_kernel_format`` and stores what comes back
as ``layer.w13_input_scale`` / ``layer.w2_input_scale`` (plain attributes the kernel's quant config
reads; the ``*_input_global_scale`` parameters stay as loaded). Per backend (:func:`processed`):

* EMULATION (any GPU without native FP4, the CPU here): ``1.0 / a.max()``, a 0-d float32, i.e.
  ``1 / (1 / g)`` twice rounded: every expert gets the ``v`` with ``fl(1 / fl(1 / v)) == held``;
* FlashInfer TRT-LLM / CUTLASS / CuteDSL (batched too) / B12X: ``a.max()`` over every expert and
  shard (all-reduced over the EP group under EPLB), repeated ``[E]``: every expert gets the ``v`` with
  ``fl(1 / v) == held``, whose maximum is the held value itself;
* vLLM CUTLASS and b12x: per expert, w13's gate/up maximum (``[E]``) and w2's ``[E]``: each expert
  its own ``v``; the MoE-EP CuteDSL megakernel keeps ``a`` ``[E, 2]`` / ``[E]`` as is;
* Marlin and Humming (NVFP4 weights, BF16 activations): the scales are dropped (None); the values
  the engine holds in its ``*_input_global_scale`` parameters are given back so nothing is left
  uninitialised.

The loaded parameters are tried first: when they still process into the held scale they are given
back unchanged (per-expert calibration kept, every parameter as the first load left it); otherwise
the preimage is computed from the held scale. Either is checked by running :func:`processed` on the
held scale's device (vLLM's own arithmetic there) and refused, naming why, unless it reproduces the
held scale bit for bit: a held value that no float32 reaches through the reciprocal is not carried.
"""

from __future__ import annotations

from typing import Any

import torch

from adapters.scales import reciprocal_preimage

__all__ = ["CT_NVFP4_W4A4_BACKENDS", "carried_global_scales", "processed", "reciprocal_preimage"]

#: ``1.0 / a.max()`` (oracle/nvfp4.py, EMULATION)
_TWICE = frozenset({"EMULATION"})
#: ``amax_for_moe_activation_quant(a).repeat(E)`` (``is_global_sf_supported_for_nvfp4_backend`` and
#: ``prepare_nvfp4_moe_layer_for_flashinfer_cutedsl``)
_SHARED = frozenset(
    {
        "FLASHINFER_TRTLLM",
        "FLASHINFER_CUTLASS",
        "FLASHINFER_CUTEDSL",
        "FLASHINFER_CUTEDSL_BATCHED",
        "FLASHINFER_B12X",
    }
)
#: w13's ``a.max(dim=1)`` per expert, w2's ``a`` (``prepare_nvfp4_moe_layer_for_fi_or_cutlass`` for
#: VLLM_CUTLASS, ``b12x_moe._per_expert_scale`` for B12X)
_PER_EXPERT = frozenset({"VLLM_CUTLASS", "B12X"})
#: ``a`` unchanged (the megakernel transforms the checkpoint tensors itself)
_AS_LOADED = frozenset({"FLASHINFER_MOE_EP_CUTEDSL"})
#: activation scales dropped (None): W4A16 kernels
_DROPPED = frozenset({"MARLIN", "HUMMING"})
#: every vLLM 0.33.0 NVFP4 MoE backend whose processing of the activation global scales is mirrored
CT_NVFP4_W4A4_BACKENDS = _TWICE | _SHARED | _PER_EXPERT | _AS_LOADED | _DROPPED


def processed(
    backend: str, g13: torch.Tensor, g2: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """What vLLM 0.33.0's processing makes of loaded ``w13_input_global_scale [E, 2]`` and
    ``w2_input_global_scale [E]`` under ``backend``: ``(layer.w13_input_scale, layer.w2_input_scale)``,
    the same torch operations in the same order (module docstring)."""
    a13, a2 = 1.0 / g13, 1.0 / g2
    experts = g13.shape[0]
    if backend in _TWICE:
        return 1.0 / a13.max().to(torch.float32), 1.0 / a2.max().to(torch.float32)
    if backend in _SHARED:
        return a13.max().to(torch.float32).repeat(experts), a2.max().to(torch.float32).repeat(experts)
    if backend in _PER_EXPERT:
        return a13.max(dim=1).values.to(torch.float32), a2.to(torch.float32)
    if backend in _AS_LOADED:
        return a13, a2
    if backend in _DROPPED:
        return None, None
    raise ValueError(
        f"vLLM chose NVFP4 MoE backend {backend!r}, whose processing of compressed-tensors' activation "
        f"global scales refitd does not mirror (it knows {', '.join(sorted(CT_NVFP4_W4A4_BACKENDS))}); the "
        "held static activation scale cannot be carried over: pick one of those with moe_backend"
    )


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    a, b = a.detach().to(torch.float32), b.detach().to(torch.float32)
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.int32), b.contiguous().view(torch.int32)
    )


def _computed(backend: str, held13: torch.Tensor, held2: torch.Tensor, experts: int) -> tuple[Any, Any]:
    """``(g13 [E, 2], g2 [E])`` from the held scales under ``backend`` (None where none exists)."""
    if backend in _TWICE:
        v13, v2 = reciprocal_preimage(held13.reshape(()), 2), reciprocal_preimage(held2.reshape(()), 2)
        if v13 is None or v2 is None:
            return None, None
        return v13.expand(experts, 2).clone(), v2.expand(experts).clone()
    v13, v2 = reciprocal_preimage(held13, 1), reciprocal_preimage(held2, 1)
    if v13 is None or v2 is None:
        return None, None
    return (v13 if v13.dim() == 2 else v13.unsqueeze(1).expand(experts, 2).clone()), v2


def carried_global_scales(
    name: str, module: torch.nn.Module, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w13 [E, 2], w2 [E])`` float32 CPU checkpoint values of one W4A4 MoE layer that make vLLM's
    processing under ``backend`` reproduce the activation scales the layer holds now, bit for bit.
    Raises ValueError, naming the layer and why, when no float32 value does."""
    g13 = module.w13_input_global_scale.detach()
    g2 = module.w2_input_global_scale.detach()
    held13, held2 = getattr(module, "w13_input_scale", None), getattr(module, "w2_input_scale", None)
    want = processed(backend, g13, g2)
    if held13 is None or held2 is None:  # the backend dropped them (W4A16 kernels): keep the loaded values
        if want[0] is not None or want[1] is not None:
            raise ValueError(
                f"{name}: vLLM's {backend} MoE holds no activation scale after processing, which refitd "
                "expected it to keep; the static activation scale cannot be carried over"
            )
        return g13.to("cpu", torch.float32).clone(), g2.to("cpu", torch.float32).clone()
    if _same(want[0], held13) and _same(want[1], held2):  # the loaded values still process into it
        return g13.to("cpu", torch.float32).clone(), g2.to("cpu", torch.float32).clone()
    held13, held2 = held13.detach().to(torch.float32), held2.detach().to(torch.float32)
    bad = [
        float(x)
        for x in torch.cat([held13.reshape(-1), held2.reshape(-1)])
        if not 0 < float(x) < float("inf")
    ]
    if bad:
        raise ValueError(
            f"{name}: the engine holds NVFP4 activation scale {bad[0]!r}, which no finite positive "
            "input_global_scale reaches through vLLM's 1 / x; reload the engine from a calibrated checkpoint"
        )
    c13, c2 = _computed(backend, held13, held2, int(g13.shape[0]))
    back = processed(backend, c13, c2) if c13 is not None and c2 is not None else (None, None)
    if back[0] is None or not (_same(back[0], held13) and _same(back[1], held2)):
        times = "1 / (1 / x)" if backend in _TWICE else "1 / x"
        raise ValueError(
            f"{name}: no float32 input_global_scale reproduces the NVFP4 activation scale the engine holds "
            f"({held13.reshape(-1)[:2].tolist()} / {held2.reshape(-1)[:2].tolist()}) through {backend}'s {times} "
            "bit for bit, so it cannot be carried over exactly; reload the engine from a calibrated checkpoint"
        )
    return c13.to("cpu").clone(), c2.to("cpu").clone()
