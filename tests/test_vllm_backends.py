"""vLLM 0.33.0's 4-bit MoE backends per GPU (``adapters/vllm/backends.py``): what ``check_vllm_constraints``
refuses for the GPU the worker recorded (``manifest.info["device_capability"]``, faked here; the real
worker's recording runs in tests/test_engine_vllm_fourbit.py under ``make test-engines``)."""

from __future__ import annotations

import pytest

import adapters.vllm as av
from adapters.vllm.backends import four_bit_moe_backends
from sidecar.numerics.formats import Format
from sidecar.plan.constraints import EngineConstraints
from sidecar.protocol.manifest import EngineKind, Manifest


def _manifest(fmt: Format, capability: int | None, *, h: int = 2048, i: int = 768, tp: int = 1) -> Manifest:
    constraints = EngineConstraints(
        engine=EngineKind.VLLM, expert_format=fmt, hidden_size=h, intermediate_size=i, moe_tp_size=tp
    )
    return Manifest(
        engine=EngineKind.VLLM,
        engine_version="0.33.0",
        moe_backend="test",
        expert_format=fmt,
        tensors=(),
        constraints=constraints,
        info={"device_capability": capability},
    )


@pytest.mark.parametrize("capability", [75, 80, 86, 89, 90, 100, 103, 110, 120, 121])
@pytest.mark.parametrize("fmt", [Format.NVFP4, Format.INT4_W4A16, Format.MXFP4])
def test_four_bit_runs_on_every_gpu_from_turing_at_aligned_shapes(fmt, capability):
    assert av.check_vllm_constraints(_manifest(fmt, capability)) == []


def test_mxfp4_backend_is_cutlass_on_sm100_to_sm119_and_marlin_elsewhere():
    assert four_bit_moe_backends(Format.MXFP4, 100, 2048, 768) == ["CUTLASS_MXFP4_MXFP4"]
    assert four_bit_moe_backends(Format.MXFP4, 110, 2048, 768) == ["CUTLASS_MXFP4_MXFP4"]
    for sm in (80, 90, 120):
        assert four_bit_moe_backends(Format.MXFP4, sm, 2048, 768) == ["MARLIN"]


def test_mxfp4_below_turing_is_refused_with_vllms_reason():
    (problem,) = av.check_vllm_constraints(_manifest(Format.MXFP4, 70))
    assert "no MXFP4 MoE backend on SM70" in problem and "SM75" in problem and "MarlinExperts" in problem
    assert "int4_w4a16" in problem  # what works instead


def test_mxfp4_marlin_repack_tile_refuses_hidden_not_a_multiple_of_64_where_marlin_runs():
    h = 32 * 9  # a multiple of MXFP4's 32 (the K rule passes), not of Marlin's 64-wide N tile
    for sm in (80, 90, 120):
        problems = av.check_vllm_constraints(_manifest(Format.MXFP4, sm, h=h))
        assert (
            len(problems) == 1 and f"hidden_size = {h}" in problems[0] and "tile_n_size = 64" in problems[0]
        )
        assert "SM100-SM119" in problems[0]
    assert av.check_vllm_constraints(_manifest(Format.MXFP4, 100, h=h)) == []  # CUTLASS has no such tile


def test_int4_w4a16_falls_back_from_marlin_to_triton_never_refused():
    # Marlin wants H % 128 and I/tp % 64 (check_moe_marlin_supports_config); Triton WNA16 takes the rest
    assert "MARLIN" in four_bit_moe_backends(Format.INT4_W4A16, 90, 2048, 768)
    odd = four_bit_moe_backends(Format.INT4_W4A16, 90, 32 * 9, 32 * 3)
    assert odd[0] == "TRITON" and "MARLIN" not in odd
    assert four_bit_moe_backends(Format.INT4_W4A16, 100, 2048, 768)[0] == "FLASHINFER_TRTLLM"
    assert av.check_vllm_constraints(_manifest(Format.INT4_W4A16, 70, h=32 * 9, i=32 * 3)) == []


def test_nvfp4_on_hopper_is_not_refused_and_w4a4_kernels_need_sm100():
    assert four_bit_moe_backends(Format.NVFP4, 90, 2048, 768) == ["MARLIN", "EMULATION"]
    assert four_bit_moe_backends(Format.NVFP4, 100, 2048, 768)[0] == "FLASHINFER_TRTLLM"


@pytest.mark.parametrize("fmt", [Format.MXFP4, Format.BLOCK_FP8])
def test_no_gpu_recorded_means_no_per_gpu_rule(fmt):
    assert av.check_vllm_constraints(_manifest(fmt, None, h=32 * 9, i=256)) == []
