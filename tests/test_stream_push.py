"""A streamed step: ``push_step(step, export, declare=meta_state_dict(config))`` with ``export`` a
generator of ``(name, tensor)`` pairs, as Megatron-Bridge yields them: written one item at a time
(never all held at once), published byte for byte as ``convert`` of the same tensors, through
whole-step staging, a staging ring and remote frames; a wrong stream fails the step and publishes
nothing."""

from __future__ import annotations

import weakref

import pytest
import torch

from adapters.base import RefitReader
from sidecar.cli.demo.synthetic import make_hf_config, make_state_dict
from sidecar.client import RefitClient
from sidecar.client.stream import FEED_DEPTH
from sidecar.daemon.memory.staging import ring_groups
from sidecar.errors import RefitError
from sidecar.plan.build import RefitSpec, meta_state_dict, plan_from_hf_config
from sidecar.plan.run import convert

MODEL, FMT = "qwen3_moe", "mxfp8"
ARGS = {"num_layers": 2, "num_experts": 4}


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


class Export:
    """A generator over a state dict that makes each tensor as it yields it (a fresh copy, like a
    bridge's gathered tensor) and counts how many of the yielded ones are alive at once."""

    def __init__(self, sd: dict[str, torch.Tensor]):
        self.sd, self.alive, self.most = sd, 0, 0

    def _gone(self) -> None:
        self.alive -= 1

    def __call__(self, names=None):
        for name in self.sd if names is None else names:
            t = self.sd[name].clone()
            self.alive += 1
            self.most = max(self.most, self.alive)
            weakref.finalize(t, self._gone)
            yield name, t
            del t


def held_at_most(mode: str, plan, regions: int, n: int) -> int:
    """How many exported tensors may be alive at once: the feed's queue, the item being written and
    the generator's own; a ring also holds the items of up to ``regions`` ungranted layer groups
    (``sidecar.client.stream``'s backpressure), which must stay well below the model's ``n``."""
    bound = FEED_DEPTH + 3
    if mode == "ring":
        bound += sum(sorted((len(g.inputs) for g in ring_groups(plan)), reverse=True)[:regions])
    assert bound < n * 2 // 3, f"the model is too small for the bound to mean anything ({bound} of {n})"
    return bound


@pytest.mark.parametrize("mode", ["staging", "ring", "frames"])
def test_a_streamed_export_publishes_convert_bytes(mode, daemons):
    regions = 2
    # a ring may hold two ungranted layers' items while the daemon is slow to grant: four layers
    # leave that at half the model
    args = {**ARGS, "num_layers": 4} if mode == "ring" else ARGS
    config = make_hf_config(MODEL, **args)
    extra = {"staging_regions": regions} if mode == "ring" else {}
    d = daemons(hf_config=config, world_size=1, format=FMT, **extra)
    plan = plan_from_hf_config(config, RefitSpec(model_type=MODEL, fmt=FMT))
    spec = plan.spec
    declare = meta_state_dict(config)
    with (
        RefitClient(d.endpoint, rank=0, world_size=1, local=mode != "frames") as client,
        RefitReader(d.endpoint) as reader,
    ):
        for step in range(2):
            sd = make_state_dict(MODEL, seed=step, **args)
            export = Export(sd)
            result = client.push_step(step, export(), declare=declare)
            assert result.mover == ("zmq" if mode == "frames" else "staging")
            # staging and frames write each item at once; a ring holds an item until its layer
            # group is granted a region: at most ``regions`` layers' tensors, never the model's
            bound = held_at_most(mode, plan, regions, len(sd))
            assert export.most <= bound, f"{export.most} of {len(sd)} exported tensors alive at once"
            expected = convert(sd, spec)
            gen = reader.wait(min_step=step)
            try:
                bad = [n for n, t in expected.items() if not same_bytes(gen.tensors[n], t)]
            finally:
                reader.release(gen)
            assert not bad, bad[:5]


def test_a_wrong_stream_fails_the_step_and_publishes_nothing(daemons):
    config = make_hf_config(MODEL, **ARGS)
    d = daemons(hf_config=config, world_size=1, format=FMT)
    declare = meta_state_dict(config)
    sd = make_state_dict(MODEL, seed=0, **ARGS)
    names = list(sd)
    with RefitClient(d.endpoint, rank=0, world_size=1) as client:
        client.push_step(0, Export(sd)(), declare=declare)
        cases = {
            "without 1 declared": Export(sd)(names[:-1]),
            "arrived twice": Export(sd)([*names, names[0]]),
            "declare= does not list": iter([*sd.items(), ("model.extra.weight", torch.zeros(2))]),
            "is not what declare= lists": iter(
                [(n, t.float() if i == 0 else t) for i, (n, t) in enumerate(sd.items())]
            ),
        }
        for step, (what, export) in enumerate(cases.items(), start=1):
            with pytest.raises(RefitError, match=what):
                client.push_step(step, export, declare=declare)

        def broken():
            yield names[0], sd[names[0]]
            raise OSError("bridge lost its rank")

        with pytest.raises(RefitError, match="bridge lost its rank"):
            client.push_step(9, broken(), declare=declare)
        with RefitReader(d.endpoint) as reader:  # still step 0's generation, whole
            gen = reader.wait()
            try:
                expected = convert(sd, plan_from_hf_config(config, RefitSpec(model_type=MODEL, fmt=FMT)).spec)
                assert gen.step == 0 and all(same_bytes(gen.tensors[n], t) for n, t in expected.items())
            finally:
                reader.release(gen)
        # the daemon keeps serving: a good stream publishes after all that
        assert client.push_step(10, Export(sd)(), declare=declare).step == 10


def test_one_rank_streams_while_another_sends_nothing(daemons):
    """Megatron-style: the first rank of a TP group streams the bridge's gathered tensors, the other
    pushes an empty step; the generation is convert's of the stream."""
    from concurrent.futures import ThreadPoolExecutor

    config = make_hf_config(MODEL, **ARGS)
    d = daemons(hf_config=config, world_size=2, format=FMT)
    spec = plan_from_hf_config(config, RefitSpec(model_type=MODEL, fmt=FMT)).spec
    sd = make_state_dict(MODEL, seed=5, **ARGS)
    with (
        RefitClient(d.endpoint, rank=0, world_size=2) as first,
        RefitClient(d.endpoint, rank=1, world_size=2) as other,
        ThreadPoolExecutor(1) as pool,
    ):
        empty = pool.submit(other.push_step, 0, {})
        result = first.push_step(0, Export(sd)(), declare=meta_state_dict(config))
        assert empty.result(timeout=60).generation == result.generation
    with RefitReader(d.endpoint) as reader:
        gen = reader.wait(min_step=0)
        try:
            assert all(same_bytes(gen.tensors[n], t) for n, t in convert(sd, spec).items())
        finally:
            reader.release(gen)
