"""adapters.vllm.carry's inverse of vLLM's NVFP4 input-scale processing (pure torch; the real-class
check is tests/test_engine_vllm_fourbit.py under ``make test-engines``)."""

from __future__ import annotations

import pytest
import torch

from adapters.scales import exact_reciprocal_preimage
from adapters.vllm.carry import _per_expert


@pytest.mark.parametrize("seed", range(3))
def test_reciprocal_preimage_reproduces_the_held_scale_bit_for_bit(seed):
    g = torch.Generator().manual_seed(seed)
    # what vLLM's EMULATION processing holds: float32(1 / v) of a checkpoint's input_scale v (not
    # every float32 is such a reciprocal: 1/x skips some values, and those are refused)
    loaded = torch.exp2(torch.randn(2000, generator=g) * 20).float()
    for k in (1.0 / loaded).float():
        v = exact_reciprocal_preimage(k)
        assert (1.0 / v).float().view(torch.int32) == k.view(torch.int32)


def test_per_expert_scales_by_backend():
    held = torch.tensor(40.0)
    emu = _per_expert(held, 3, "EMULATION")
    assert emu.shape == (3,) and torch.equal((1.0 / emu.max()).float(), held)
    per = torch.tensor([0.1, 0.2, 0.3])
    assert torch.equal(_per_expert(per, 3, "FLASHINFER_CUTLASS"), per)
    assert torch.equal(
        _per_expert(torch.tensor([[0.1, 0.2], [0.3, 0.1]]), 2, "VLLM_CUTLASS"), torch.tensor([0.2, 0.3])
    )
    assert torch.equal(_per_expert(None, 2, "MARLIN"), torch.ones(2))
    with pytest.raises(ValueError, match="shape"):
        _per_expert(torch.ones(5), 3, "VLLM_CUTLASS")
