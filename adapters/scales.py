"""Float32 reciprocal preimages: the checkpoint value an engine's loader turns into the activation
scale it holds now (pure torch; no engine import).

refitd publishes no NVFP4 activation scale (SPEC §2.3), so each reload hands the engine, per expert,
the checkpoint tensor whose processing reproduces the scale the engine already holds. TRT-LLM's
NVFP4 MoE holds ``max(input_scale).reciprocal()`` (``adapters.trtllm.carry``), vLLM's ModelOpt
EMULATION path ``1.0 / max(input_scale)`` (``adapters.vllm.carry``: the same float32 operation, as
``1.0 / t`` is ``t.reciprocal()``), and compressed-tensors' paths apply ``1.0 / x`` once or twice
(``adapters.vllm.ct_carry``). The float32 reciprocal is not onto (about one float32 in seven is no
``fl(1 / x)``), so the first guess is checked, then its nearest float32 neighbours; a held value
none of them reaches is refused, never carried approximately.
"""

from __future__ import annotations

import torch

#: how many float32 neighbours either side of the first guess a preimage search tries
_STEPS = 4


def _neighbours(v: torch.Tensor) -> torch.Tensor:
    """``[2 * _STEPS + 1, *v.shape]``: ``v`` first, then its float32 neighbours, nearest first."""
    out, up, down = [v], v, v
    for _ in range(_STEPS):
        up = torch.nextafter(up, torch.full_like(up, float("inf")))
        down = torch.nextafter(down, torch.zeros_like(down))
        out += [up, down]
    return torch.stack(out)


def reciprocal_preimage(held: torch.Tensor, times: int) -> torch.Tensor | None:
    """Elementwise float32 ``v`` with ``1.0 / v`` applied ``times`` (1 or 2) times equal to ``held``
    bit for bit, computed with torch on ``held``'s device; None where some element has none."""
    held = held.to(torch.float32)
    guess = 1.0 / held if times == 1 else held.clone()
    cands = _neighbours(guess)
    image = cands
    for _ in range(times):
        image = 1.0 / image
    hit = image.view(torch.int32) == held.unsqueeze(0).view(torch.int32)
    if not bool(hit.any(dim=0).all()):
        return None
    first = hit.int().argmax(dim=0, keepdim=True)  # the nearest candidate that reproduces it
    return cands.gather(0, first).squeeze(0)


def exact_reciprocal_preimage(held: torch.Tensor, remedy: str = "") -> torch.Tensor:
    """A 0-d float32 ``v`` on the CPU with ``v.reciprocal() == held`` bit for bit (``held``: one
    value); ValueError when no float32 reaches it, ending with ``remedy`` (what the caller can do)."""
    k = held.detach().to("cpu", torch.float32).reshape(())
    v = reciprocal_preimage(k, 1)
    if v is None:
        raise ValueError(
            f"no float32 input_scale reproduces the held NVFP4 activation scale {float(k)!r} through 1/x; "
            "the engine's activation scale cannot be carried over exactly" + (f": {remedy}" if remedy else "")
        )
    return v
