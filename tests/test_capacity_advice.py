"""A capacity error names the setting that binds on that arena, with a value that works (issue 31).

GPU arenas (``support.fake_cuda.FakeCuda``: the CUDA driver seam over host memory) sized from
``device_budget``, ``staging_bytes`` unset; the trainer pushes FP32 masters (twice the config's BF16
staging). The step is refused (CAPACITY) naming what to set; a daemon started with exactly that
starts, and the same FP32 step publishes byte for byte as ``convert()`` gives it. Before issue 31
the advice was "raise staging_bytes to at least N (or leave it unset)", which it was: a daemon
following it refused to start (the publish ring is the staging ring's size, beyond device_budget).
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from support.daemons import RunningDaemon
from support.fake_cuda import FakeCuda

import transport.cuda_ipc
from adapters.base import RefitReader
from sidecar.cli.demo.synthetic import make_hf_config, make_state_dict
from sidecar.client.client import RefitClient
from sidecar.config.settings import ArenaKind
from sidecar.errors import ErrorKind, RefitError
from sidecar.plan.build import plan_from_hf_config
from sidecar.plan.run import convert
from tests.test_memory_tiers import SPEC

pytestmark = pytest.mark.timeout(300)
MiB = 1 << 20
MODEL = dict(num_layers=3, num_experts=8, unaligned=True)


@pytest.fixture
def fake(monkeypatch):
    cuda = FakeCuda()
    monkeypatch.setattr(transport.cuda_ipc, "default_driver", lambda required=True: cuda)
    monkeypatch.setattr(transport.cuda_ipc, "local_gpus", lambda nvml=None: [])
    return cuda


def _fp32(model: str, step: int) -> dict[str, torch.Tensor]:
    return {
        n: t.float() if t.dtype == torch.bfloat16 else t
        for n, t in make_state_dict(model, seed=step, **MODEL).items()
    }


def _daemon(tmp_path, name: str, hf: dict, **settings) -> RunningDaemon:
    return RunningDaemon(
        tmp_path / name,
        hf_config=hf,
        arena=ArenaKind.CUDA_IPC,
        world_size=1,
        max_frame_bytes=256 << 10,
        **settings,
    )


@pytest.mark.parametrize(
    "model, budget_alone",
    [("qwen3_5_moe", False), ("qwen3_moe", True)],  # fused slabs outgrow a BF16 layer; per-expert ones do not
)
def test_fp32_masters_over_a_budget_sized_ring_get_advice_that_works(tmp_path, fake, model, budget_alone):
    hf = {**make_hf_config(model, **MODEL), "torch_dtype": "bfloat16"}
    spec = plan_from_hf_config(hf, dataclasses.replace(SPEC, model_type=model)).spec
    (tmp_path / "a").mkdir()
    d = _daemon(tmp_path, "a", hf, device_budget=4 * MiB)
    try:
        bf16 = make_state_dict(model, seed=0, **MODEL)
        with RefitClient(d.endpoint, 0, 1, local=False, timeout=120) as client:
            client.push_step(0, bf16)  # BF16 fits
            with pytest.raises(RefitError) as err:
                client.push_step(1, _fp32(model, 1))
    finally:
        d.close()
    message = str(err.value)
    assert err.value.kind is ErrorKind.CAPACITY, message
    assert "device_budget" in message and "or leave it unset" not in message
    settings = {k: int(v) for k, v in re.findall(r"set (\w+) to at least (\d+) B", message)}
    settings |= {k: int(v) for k, v in re.findall(r"(device_budget) to at least (\d+) B", message)}
    assert "device_budget" in settings, message
    assert ("staging_bytes" not in settings) == budget_alone, message
    (tmp_path / "b").mkdir()
    d = _daemon(tmp_path, "b", hf, **settings)  # the advice, followed: the daemon starts
    try:
        with RefitClient(d.endpoint, 0, 1, local=False, timeout=120) as client:
            client.push_step(1, _fp32(model, 1))  # and the FP32 step publishes
        expected = convert(_fp32(model, 1), spec)  # in the config's dtype
        with RefitReader(d.endpoint, name="check") as reader:
            gen = reader.wait(min_step=1, timeout=60)
            try:
                bad = [
                    n
                    for n, v in expected.items()
                    if not torch.equal(
                        gen.tensors[n].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)
                    )
                ]
                assert bad == [] and len(gen.tensors) == len(expected)
            finally:
                reader.release(gen)
        assert fake.peak[0] <= settings["device_budget"]
    finally:
        d.close()
