"""Passthrough inputs written straight into the generation (sidecar.daemon.memory.direct).

A tensor the daemon publishes unchanged lands in the generation being written, from a local rank's
copy or from a remote rank's frames, instead of in staging and then again in the generation. These
tests check which inputs qualify, that the data really skips staging, that the published bytes are
exact, that a NaN in such a tensor is still refused with the last good generation kept, and that a
step whose generation was still held when READY went out stages everything as before.

The daemon runs its real serve loop in a thread of the test process (so the test can look into its
staging arena); trainers and readers are the real ``RefitClient`` and ``RefitReader``.
"""

from __future__ import annotations

import threading

import pytest
import torch
from support.daemons import daemon_factory
from support.waiting import wait_until

from adapters.base import RefitReader
from sidecar.cli.demo.synthetic import make_hf_config, make_state_dict
from sidecar.client.client import RefitClient
from sidecar.daemon.memory.direct import direct_offsets
from sidecar.daemon.memory.generations import layouts
from sidecar.errors import ErrorKind, RefitError
from sidecar.plan.build import RefitPlan, RefitSpec, TensorSpec
from sidecar.plan.run import convert
from transport.layout import Layout, Slot

MODEL = dict(num_layers=2, num_experts=2)
CONFIG = make_hf_config("qwen3_5_moe", **MODEL)
REPLY_S = 30.0


def weights(seed: int) -> dict[str, torch.Tensor]:
    return make_state_dict("qwen3_5_moe", seed=seed, **MODEL)


def plan_for(fmt: str) -> RefitPlan:
    specs = [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in weights(0).items()]
    return RefitPlan.build(specs, RefitSpec(model_type="qwen3_5_moe", fmt=fmt))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def exact(gen_tensors, step: int, fmt: str) -> bool:
    expected = convert(weights(step), RefitSpec(model_type="qwen3_5_moe", fmt=fmt))
    return set(gen_tensors) == set(expected) and all(
        torch.equal(_bytes(gen_tensors[n]), _bytes(expected[n])) for n in expected
    )


# ---- which inputs qualify


def test_every_passthrough_is_direct_at_its_own_offset_and_no_quantized_input_is():
    for fmt in ("bf16", "block_fp8", "mxfp8", "fp8_per_tensor"):
        plan = plan_for(fmt)
        _, outputs = layouts(plan)
        direct = direct_offsets(plan, outputs)
        quantized = {n for u in plan.units if u.fmt is not None for n in u.inputs}
        passthrough = {i.name for i in plan.inputs} - quantized
        assert set(direct) == passthrough, fmt
        assert all(direct[n] == outputs.slots[n].offset for n in direct), fmt
        if fmt == "bf16":
            assert not quantized and len(direct) == len(plan.inputs)
        else:
            assert quantized and any(".mlp.experts." in n for n in quantized)


def test_an_output_slot_that_does_not_hold_the_input_verbatim_is_not_direct():
    plan = plan_for("bf16")
    _, outputs = layouts(plan)
    name = next(i.name for i in plan.inputs if i.dtype == torch.bfloat16 and len(i.shape) == 2)
    slot = outputs.slots[name]
    changed = [
        Slot(s.name, torch.float16, s.shape, s.offset, s.nbytes) if s.name == name else s
        for s in outputs.slots.values()
    ]
    direct = direct_offsets(plan, Layout(changed))
    assert name not in direct and len(direct) == len(plan.inputs) - 1
    assert slot.offset == outputs.slots[name].offset


# ---- a real daemon


@pytest.fixture
def start(tmp_path):
    factory = daemon_factory(tmp_path, hf_config=CONFIG, world_size=1, step_timeout_s=30.0)
    yield next(factory)
    next(factory, None)


def push(endpoint: str, step: int, *, local: bool = True, seed: int | None = None, sd=None, mover="zmq"):
    """One step from one rank; a remote rank streams frames unless ``mover="auto"`` (NIXL if here)."""
    with RefitClient(endpoint, 0, 1, local=local, timeout=REPLY_S, mover=mover) as client:
        return client.push_step(step, weights(step if seed is None else seed) if sd is None else sd)


def staged(d, name: str) -> torch.Tensor:
    return d.daemon.arenas.staging.tensor(name)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("local", [True, False], ids=["local", "remote"])
@pytest.mark.parametrize("fmt", ["bf16", "block_fp8"])
def test_passthroughs_skip_staging_and_publish_exact(start, fmt, local):
    """Every passthrough input reaches the generation without a byte in staging (it stays zero),
    from a local rank's copy and from a remote rank's frames alike; quantized inputs still go
    through staging; what is published is exact, step after step in both generations."""
    d = start(format=fmt)
    plan_direct = None
    for step in (1, 2, 3):
        result = push(d.endpoint, step, local=local)
        if plan_direct is None:
            plan_direct = dict(d.daemon.arenas.direct)
            assert plan_direct, "the plan has passthrough inputs"
        with RefitReader(d.endpoint, name="check", timeout=REPLY_S) as reader:
            gen = reader.wait(min_step=step)
            assert gen.index == result.generation
            assert exact(gen.tensors, step, fmt)
            reader.release(gen)
    assert result.mover == ("staging" if local else "zmq")
    sd = weights(3)
    for name, t in sd.items():
        s = staged(d, name)
        if name in plan_direct:
            assert not bool(s.view(torch.uint8).any()), f"{name} was written into staging"
        elif t.numel():
            assert torch.equal(_bytes(s), _bytes(t)), f"{name} (quantized) is not in staging"
    if fmt == "block_fp8":
        assert len(plan_direct) < len(sd)


@pytest.mark.timeout(120)
def test_a_rank_pulled_over_nixl_stages_everything(start):
    """NIXL READs land in the staging arena (the memory the daemon registered): a step with a rank
    pulled that way writes nothing directly, and still publishes exactly."""
    pytest.importorskip("nixl")
    d = start(format="bf16")
    for step in (1, 2):
        result = push(d.endpoint, step, local=False, mover="auto")
        if "nixl" not in result.mover:
            pytest.skip(f"the daemon did not pull over NIXL here: {result.mover_reason}")
        with RefitReader(d.endpoint, name="check", timeout=REPLY_S) as reader:
            gen = reader.wait(min_step=step)
            assert exact(gen.tensors, step, "bf16")
            reader.release(gen)
    sd = weights(2)
    assert all(torch.equal(_bytes(staged(d, n)), _bytes(t)) for n, t in sd.items() if t.numel())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("local", [True, False], ids=["local", "remote"])
def test_nan_in_a_direct_passthrough_is_refused_and_the_last_good_generation_stays(start, local):
    """The finiteness check still reads every passthrough (after the local ranks commit): a NaN
    in a norm weight fails the step naming it; the live generation still holds the last good step
    byte for byte, and the next good step publishes."""
    d = start(format="bf16")
    push(d.endpoint, 1, local=local)
    bad = weights(2)
    name = next(n for n in bad if "norm" in n and bad[n].is_floating_point())
    assert name in d.daemon.arenas.direct
    bad[name] = bad[name].clone()
    bad[name].view(-1)[0] = float("nan")
    with pytest.raises(RefitError, match=f"{name}.*NaN or Inf") as info:
        push(d.endpoint, 2, local=local, sd=bad)
    assert info.value.kind is ErrorKind.NON_FINITE
    with RefitReader(d.endpoint, name="check", timeout=REPLY_S) as reader:
        gen = reader.wait()
        assert gen.step == 1 and exact(gen.tensors, 1, "bf16")
        reader.release(gen)
    push(d.endpoint, 3, local=local)
    with RefitReader(d.endpoint, name="check", timeout=REPLY_S) as reader:
        gen = reader.wait(min_step=3)
        assert exact(gen.tensors, 3, "bf16")
        reader.release(gen)


@pytest.mark.timeout(120)
def test_a_step_whose_generation_is_held_at_ready_stages_everything(start):
    """When READY goes out while a reader still holds the generation the step must write, nothing
    is written directly (the generation is not the step's yet): every piece goes to staging, and
    once the reader releases it the step publishes exactly."""
    d = start(format="bf16", reader_timeout_s=20.0)
    push(d.endpoint, 1)
    with RefitReader(d.endpoint, name="holder", timeout=REPLY_S) as reader:
        held = reader.wait(min_step=1)
        push(d.endpoint, 2)  # the other generation
        out: dict = {}
        pusher = threading.Thread(target=lambda: out.update(r=push(d.endpoint, 3)), daemon=True)
        pusher.start()
        wait_until("the step blocked on the held generation", lambda: d.status().get("blocked"))
        reader.release(held)
        pusher.join(REPLY_S)
        assert out["r"].generation == held.index
        gen = reader.wait(min_step=3)
        assert exact(gen.tensors, 3, "bf16")
        reader.release(gen)
    sd = weights(3)
    assert all(torch.equal(_bytes(staged(d, n)), _bytes(t)) for n, t in sd.items() if t.numel())
