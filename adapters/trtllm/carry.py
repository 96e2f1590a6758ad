"""NVFP4 W4A4's static activation scales, carried over from a TRT-LLM engine into every reload (pure torch).

TRT-LLM's NVFP4 MoE (``NVFP4FusedMoEMethod``, ``_torch/modules/fused_moe/quantization.py``) holds one
0-d float32 ``fc31_input_scale`` and one ``fc2_input_scale`` per MoE module: the *reciprocal* of the
largest checkpoint ``input_scale`` over every expert (``tmp_fc31_input_scale.max().reciprocal()``,
@a98a9061 ``load_quant_scales``; ``torch.stack(fc31_values).max().reciprocal()`` in the newest stored
copy's ``process_weights_after_loading``). refitd publishes no ``input_scale`` (SPEC §2.3), and
@a98a9061 reads ``weights[f"{e}.w1.input_scale"]`` for *every* expert of the module (a KeyError
without them). So every reload is given, per expert, the checkpoint value ``v`` with
``float32(1 / v) == held`` bit for bit: the maximum over equal values is ``v``, its reciprocal is the
held scale, and the alphas TRT-LLM recomputes from it and the new ``weight_scale_2``
(``1 / (fc31_input_scale * (1 / weight_scale_2))``) are what a checkpoint carrying that activation
scale gives. Gate and up get the same ``v`` (TRT-LLM asserts ``allclose(w1_input_scale,
w3_input_scale)``).

``load_format="dummy"`` fills every float parameter uniformly in [-1e-3, 1e-3]
(``_torch/pyexecutor/model_loader.py``), so a held scale there means the engine never loaded a
calibrated one (2688 / amax <= 1e-3 would need activations above 2.6e6): refused, unless the caller
gives a calibrated checkpoint ``input_scale`` (amax / 2688) for every expert.
"""

from __future__ import annotations

from typing import Any

import torch

from adapters.scales import exact_reciprocal_preimage

#: the NVFP4 MoE parameters a module holds its activation scales in (NVFP4FusedMoEMethod.create_weights)
NVFP4_INPUT_PARAMS = ("fc31_input_scale", "fc2_input_scale")
#: what load_format="dummy" leaves in a float parameter: uniform in [-DUMMY_BOUND, DUMMY_BOUND]
DUMMY_BOUND = 1e-3


def _usable(held: torch.Tensor) -> bool:
    x = float(held.detach().float().reshape(-1)[0])
    return x > DUMMY_BOUND and x < float("inf")


def nvfp4_input_scales(
    module: Any, override: float | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The checkpoint ``input_scale`` of every expert's gate/up and of its down_proj, as 0-d float32,
    that make ``module`` (an NVFP4 MoE implementation) reproduce the activation scales it holds now.

    ``override`` is a calibrated checkpoint input scale (amax / 2688) used for every projection. None
    when the module holds no usable scale (dummy-loaded, non-positive, infinite): the manifest then
    says so and the attach is refused.
    """
    if override is not None:
        value = torch.tensor(float(override), dtype=torch.float32)
        if not (float(value) > 0 and float(value) < float("inf")):
            raise ValueError(
                f"input_scale={override!r}: a calibrated NVFP4 input scale is positive and finite"
            )
        return value, value.clone()
    held = [getattr(module, p).detach() for p in NVFP4_INPUT_PARAMS]
    if not all(_usable(h) for h in held):
        return None
    fc31, fc2 = (exact_reciprocal_preimage(h, "pass input_scale= to refit_attach") for h in held)
    return fc31, fc2
