"""``push_step(step, export, declare=..., replicated=True)``: every rank reads the same gathered
export (Megatron-Bridge's ``export_hf_weights`` on every TP/EP rank) and each tensor is sent by one
rank. The export's collectives are stood in for by a barrier every rank's export passes at each
item (tests/test_megatron.py runs the real bridge over gloo): the ranks must read in lockstep, in
whatever order they reach ``push_step``; a rank that never begins is named in the others' errors; a
failed step still lets every rank leave the export."""

from __future__ import annotations

import threading

import pytest
import torch

from adapters.base import RefitReader
from sidecar.cli.demo.synthetic import make_hf_config, make_state_dict
from sidecar.client import RefitClient
from sidecar.client.replicated import owners
from sidecar.errors import RefitError
from sidecar.plan.build import RefitSpec, meta_state_dict, plan_from_hf_config
from sidecar.plan.run import convert

MODEL, FMT = "qwen3_moe", "mxfp8"
ARGS = {"num_layers": 2, "num_experts": 4}
#: a rank's export waits this long for the others at an item before the test calls it a deadlock
LOCKSTEP_S = 20.0


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def lockstep_export(sd: dict[str, torch.Tensor], barrier: threading.Barrier, change=None):
    """Every tensor whole, after a collective every rank's export must join (a TP gather)."""
    for name, t in sd.items():
        barrier.wait(LOCKSTEP_S)  # BrokenBarrierError: a rank stopped reading (the old deadlock)
        yield name, (change(name, t) if change else t.clone())


def run_ranks(world: int, body) -> list:
    """``body(rank)`` on a thread per rank; each rank's return value or exception."""
    out: list = [None] * world

    def run(rank: int) -> None:
        try:
            out[rank] = body(rank)
        except BaseException as exc:  # handed to the test
            out[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(LOCKSTEP_S * 6)
        assert not t.is_alive(), "a rank hung"
    return out


def published_equals_convert(d, sd, spec, step) -> None:
    expected = convert(sd, spec)
    with RefitReader(d.endpoint) as reader:
        gen = reader.wait(min_step=step)
        try:
            bad = [n for n, t in expected.items() if not same_bytes(gen.tensors[n], t)]
        finally:
            reader.release(gen)
    assert not bad, bad[:5]


def test_owners_send_each_name_once_and_spread_the_bytes():
    sizes = [(f"t{i}", (i % 7 + 1) * 100) for i in range(50)]
    for world in (1, 2, 3, 8):
        owner = owners(sizes, world)
        assert set(owner) == {n for n, _ in sizes} and set(owner.values()) <= set(range(world))
        load = [sum(s for n, s in sizes if owner[n] == r) for r in range(world)]
        assert max(load) - min(load) <= 700  # within one tensor's bytes
        assert owners(list(reversed(sizes)), world) == owner  # whatever order a rank lists them in


@pytest.mark.parametrize("mode", ["staging", "ring", "frames"])
def test_every_rank_passes_the_whole_export_and_each_tensor_is_sent_once(mode, daemons):
    config = make_hf_config(MODEL, **ARGS)
    extra = {"staging_regions": 2} if mode == "ring" else {}
    d = daemons(hf_config=config, world_size=2, format=FMT, **extra)
    spec = plan_from_hf_config(config, RefitSpec(model_type=MODEL, fmt=FMT)).spec
    declare = meta_state_dict(config)
    clients = [RefitClient(d.endpoint, rank=r, world_size=2, local=mode != "frames") for r in range(2)]
    try:
        for step in range(2):
            sd = make_state_dict(MODEL, seed=step, **ARGS)
            barrier = threading.Barrier(2)
            results = run_ranks(
                2,
                lambda r, step=step, sd=sd, barrier=barrier: clients[r].push_step(
                    step, lockstep_export(sd, barrier), declare=declare, replicated=True
                ),
            )
            for r in results:
                assert not isinstance(r, BaseException), r
            assert all(r.bytes_in > 0 for r in results)  # both ranks sent a share
            published_equals_convert(d, sd, spec, step)
    finally:
        for c in clients:
            c.close()


@pytest.mark.parametrize("first", [0, 1])
def test_a_rank_inside_the_export_before_the_other_calls_push_step_does_not_deadlock(first, daemons):
    """The first rank is blocked in the export's collective, waiting for the other, before the
    other calls push_step at all: BEGIN went out before the stream was read, so READY comes."""
    config = make_hf_config(MODEL, **ARGS)
    d = daemons(hf_config=config, world_size=2, format=FMT)
    spec = plan_from_hf_config(config, RefitSpec(model_type=MODEL, fmt=FMT)).spec
    declare = meta_state_dict(config)
    sd = make_state_dict(MODEL, seed=3, **ARGS)
    barrier = threading.Barrier(2)
    clients = [RefitClient(d.endpoint, rank=r, world_size=2) for r in range(2)]
    in_export = threading.Event()

    def waiting_export():
        in_export.set()
        yield from lockstep_export(sd, barrier)

    def body(rank: int):
        if rank != first:
            assert in_export.wait(LOCKSTEP_S)
            deadline = threading.Event()
            while barrier.n_waiting == 0 and not deadline.wait(0.01):  # the first rank is in the collective
                pass
        export = waiting_export() if rank == first else lockstep_export(sd, barrier)
        return clients[rank].push_step(0, export, declare=declare, replicated=True)

    try:
        for r in run_ranks(2, body):
            assert not isinstance(r, BaseException), r
        published_equals_convert(d, sd, spec, 0)
    finally:
        for c in clients:
            c.close()


def test_replicated_whole_tensors_without_a_stream(daemons):
    config = make_hf_config(MODEL, **ARGS)
    d = daemons(hf_config=config, world_size=3, format=FMT)
    spec = plan_from_hf_config(config, RefitSpec(model_type=MODEL, fmt=FMT)).spec
    sd = make_state_dict(MODEL, seed=1, **ARGS)
    clients = [RefitClient(d.endpoint, rank=r, world_size=3) for r in range(3)]
    try:
        for step in range(2):
            for r in run_ranks(3, lambda r, step=step: clients[r].push_step(step, dict(sd), replicated=True)):
                assert not isinstance(r, BaseException), r
            published_equals_convert(d, sd, spec, step)
        with pytest.raises(ValueError, match="whole tensors"):
            clients[0].push_step(2, [("x", [torch.zeros(1)])], replicated=True)
    finally:
        for c in clients:
            c.close()


def test_a_rank_that_never_began_is_named_in_every_other_ranks_error(daemons):
    config = make_hf_config(MODEL, **ARGS)
    d = daemons(hf_config=config, world_size=3, format=FMT, heartbeat_interval_s=0.1)
    declare = meta_state_dict(config)
    sd = make_state_dict(MODEL, seed=0, **ARGS)
    clients = [RefitClient(d.endpoint, rank=r, world_size=3) for r in range(2)]  # rank 2 never comes
    try:
        results = run_ranks(
            2,
            lambda r: clients[r].push_step(0, iter(sd.items()), declare=declare, replicated=True, timeout=3),
        )
        for r in results:
            assert isinstance(r, RefitError), r
            assert "rank(s) [2] of 3 never began step 0" in str(r), str(r)
    finally:
        for c in clients:
            c.close()


def test_a_failed_replicated_step_lets_every_rank_finish_the_export(daemons, wait_until):
    """Rank 0's own tensor is wrong: the step fails on both ranks, and both read the export to its
    end (a rank that stopped would leave the other waiting in a collective); the next step
    publishes. The export goes on past the bad tensor only once the daemon failed the step."""
    config = make_hf_config(MODEL, **ARGS)
    d = daemons(hf_config=config, world_size=2, format=FMT)
    spec = plan_from_hf_config(config, RefitSpec(model_type=MODEL, fmt=FMT)).spec
    declare = meta_state_dict(config)
    sd = make_state_dict(MODEL, seed=0, **ARGS)
    owner = owners(((n, t.nbytes) for n, t in sd.items()), 2)
    bad = next(n for n in sd if owner[n] == 0)  # rank 0's first tensor in the stream
    assert list(sd).index(bad) < len(sd) // 2
    clients = [RefitClient(d.endpoint, rank=r, world_size=2) for r in range(2)]
    try:
        barrier = threading.Barrier(2)
        read = [0, 0]

        def export(rank: int):
            failed = False
            for name, t in sd.items():
                barrier.wait(LOCKSTEP_S)
                if read[rank] and not failed and list(sd)[read[rank] - 1] == bad:
                    wait_until("the daemon failing the step", lambda: d.daemon.step is None)
                    failed = True
                read[rank] += 1
                yield name, (t.float() if name == bad else t.clone())

        results = run_ranks(2, lambda r: clients[r].push_step(0, export(r), declare=declare, replicated=True))
        for r in results:
            assert isinstance(r, RefitError) and "is not what declare= lists" in str(r), r
        assert not barrier.broken and read == [len(sd), len(sd)]
        barrier = threading.Barrier(2)
        results = run_ranks(
            2,
            lambda r: clients[r].push_step(1, lockstep_export(sd, barrier), declare=declare, replicated=True),
        )
        for r in results:
            assert not isinstance(r, BaseException), r
        published_equals_convert(d, sd, spec, 1)
    finally:
        for c in clients:
            c.close()
