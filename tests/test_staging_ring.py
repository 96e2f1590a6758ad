"""Staging as a ring of regions: the bookkeeping (``sidecar.daemon.memory.ring``), the layer groups and
the daemon's ring (``sidecar.daemon.memory.staging``), and whole steps streamed through one or more regions by
local and remote ranks at once, byte-exact against ``convert()``, with failures mid-stream.

The daemon runs in a thread of the test process (its real serve loop, sockets and shared memory);
the ranks are clients in threads of their own.
"""

from __future__ import annotations

import collections
import itertools
import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from support.daemons import daemon_factory

from adapters.base import RefitReader
from sidecar.cli.demo.synthetic import make_hf_config, make_state_dict
from sidecar.client.client import RefitClient, Shard
from sidecar.config.settings import (
    DEFAULT_GPU_REGIONS,
    ArenaKind,
    ConfigError,
    DaemonConfig,
    prepare_runtime_dir,
)
from sidecar.daemon.loop import Daemon
from sidecar.daemon.memory.ring import RingError, SlotState, StagingRing
from sidecar.daemon.memory.staging import RingStaging, region_size, ring_groups
from sidecar.daemon.pull import Pull, PullSide
from sidecar.errors import ErrorKind, RefitError
from sidecar.plan.build import RefitPlan, RefitSpec, plan_from_hf_config
from sidecar.plan.run import convert
from transport import nixl
from transport.layout import ALIGN
from transport.shm import ShmSegment, shm_region
from transport.wire import Kind

DATA = Path(__file__).parent / "data"
MODEL = dict(num_layers=3, num_experts=4, unaligned=True)
CONFIG = make_hf_config("qwen3_5_moe", **MODEL)
SPEC = RefitSpec(model_type="qwen3_5_moe", fmt="block_fp8")
NIXL_OK, NIXL_WHY = nixl.available()
needs_nixl = pytest.mark.skipif(not NIXL_OK, reason=f"NIXL is unavailable: {NIXL_WHY}")


# --------------------------------------------------------------------------------------------------
# the ring's bookkeeping (sidecar.daemon.memory.ring)


def test_ring_cycle_and_offsets():
    ring = StagingRing(regions=3, region_bytes=1024, base_offset=512)
    assert ring.size == 3072 and [s.offset for s in ring.slots] == [512, 1536, 2560]
    a = ring.claim(owner=0)
    b = ring.claim(owner=1)
    assert (a.index, b.index, a.state) == (0, 1, SlotState.CLAIMED)
    ring.fill(b.index, b.ticket, contents=["piece 9"], nbytes=1000)
    ring.fill(a.index, a.ticket, contents=["piece 4"])
    first = ring.take()
    assert first.index == 1 and first.contents == ["piece 9"] and first.state is SlotState.DRAINING
    assert ring.take().index == 0 and ring.take() is None  # filled order, not index order
    assert ring.release(1, first.ticket) == []
    assert ring.count(SlotState.FREE) == 2 and ring.count(SlotState.DRAINING) == 1


def test_ring_waiters_are_granted_in_order_on_release():
    ring = StagingRing(regions=1, region_bytes=256)
    s = ring.claim("r0")
    assert ring.claim("r1") is None and ring.claim("r2") is None and ring.claim("r1") is None
    assert ring.waiting == ["r1", "r2"]
    ring.fill(s.index, s.ticket)
    taken = ring.take()
    (granted,) = ring.release(taken.index, taken.ticket)
    assert granted.owner == "r1" and granted.ticket != s.ticket and ring.waiting == ["r2"]
    assert ring.claim("r3") is None  # a newcomer queues behind r2 rather than jumping it


def test_ring_per_owner_limit_keeps_one_rank_from_taking_every_region():
    ring = StagingRing(regions=3, region_bytes=256, per_owner=1)
    a = ring.claim("fast")
    assert ring.claim("fast") is None and ring.waiting == ["fast"]  # at its limit: queued
    b = ring.claim("slow")
    assert b.owner == "slow"  # "fast" waits on its limit, not on a region: "slow" is not held up
    (again,) = ring.fill(a.index, a.ticket)  # writing done: "fast" is under its limit again
    assert again.owner == "fast" and ring.waiting == []
    assert ring.count(SlotState.CLAIMED) == 2 and ring.count(SlotState.FILLED) == 1


def test_ring_refuses_stale_tickets_and_wrong_states():
    ring = StagingRing(regions=2, region_bytes=256)
    s = ring.claim(0)
    with pytest.raises(RingError, match="release: region 0 is claimed, expected draining"):
        ring.release(s.index, s.ticket)
    with pytest.raises(RingError, match="region 0 holds 256 bytes; the producer says it wrote 300"):
        ring.fill(s.index, s.ticket, nbytes=300)
    with pytest.raises(RingError, match="region 5 does not exist"):
        ring.fill(5, s.ticket)
    ring.reset()
    with pytest.raises(RingError, match=r"ticket \d+ is stale"):
        ring.fill(s.index, s.ticket)
    assert ring.count(SlotState.FREE) == 2


def test_ring_drop_frees_a_dead_ranks_claims_and_grants_them():
    ring = StagingRing(regions=2, region_bytes=256)
    a, b = ring.claim("dead"), ring.claim("dead")
    ring.fill(b.index, b.ticket)
    assert ring.claim("live") is None
    granted = ring.drop("dead")
    assert [(g.owner, g.index) for g in granted] == [("live", a.index)]
    assert ring.slots[b.index].state is SlotState.FILLED  # whole bytes stay for the step to judge


def test_ring_bookkeeping_holds_under_random_operations():
    """Random producers and a consumer: no region is ever granted twice, every queue stays consistent."""
    rng = random.Random(1234)
    ring = StagingRing(regions=4, region_bytes=256, per_owner=2)
    held: dict[int, tuple[int, object]] = {}  # index -> (ticket, owner) as producers believe
    draining: list = []
    for _ in range(5000):
        op = rng.random()
        if op < 0.35:
            owner = rng.randrange(5)
            s = ring.claim(owner)
            grants = [s] if s else []
        elif op < 0.6 and held:
            index = rng.choice(list(held))
            ticket, _ = held.pop(index)
            grants = ring.fill(index, ticket)
        elif op < 0.8:
            s = ring.take()
            if s:
                draining.append(s)
            grants = []
        elif op < 0.97 and draining:
            s = draining.pop(rng.randrange(len(draining)))
            grants = ring.release(s.index, s.ticket)
        elif op < 0.99:
            owner = rng.randrange(5)
            for s in ring.held_by(owner):
                held.pop(s.index, None)
            grants = ring.drop(owner)
        else:
            ring.reset()
            held.clear()
            draining.clear()
            grants = []
        for g in grants:
            assert g.index not in held, "a region was granted while a producer still held it"
            held[g.index] = (g.ticket, g.owner)
        states = collections.Counter(s.state for s in ring.slots)
        assert states[SlotState.CLAIMED] == len(held)
        assert states[SlotState.DRAINING] == len(draining)
        assert sorted(ring._free) == sorted(s.index for s in ring.slots if s.state is SlotState.FREE)
        assert len(set(ring.waiting)) == len(ring.waiting)
        assert all(len(ring.held_by(o)) <= 2 for o in range(5))
        if ring._free:  # nobody waits for a free region it is allowed to take
            assert all(len(ring.held_by(o)) >= 2 for o in ring.waiting)


def test_ring_rejects_bad_geometry():
    with pytest.raises(ValueError, match="at least 1 region"):
        StagingRing(regions=0, region_bytes=256)
    with pytest.raises(ValueError, match="positive multiple of 256"):
        StagingRing(regions=2, region_bytes=100)


# --------------------------------------------------------------------------------------------------
# layer groups and the daemon's ring (sidecar.daemon.memory.staging)


def small_plan(fmt: str = "block_fp8") -> RefitPlan:
    return plan_from_hf_config(CONFIG, RefitSpec(model_type="qwen3_5_moe", fmt=fmt))


class Offsets:
    """Stands in for an arena: ``view`` returns where it was asked to look."""

    def view(self, offset, dtype, shape):
        return (offset, dtype, tuple(shape))


@pytest.mark.parametrize("fmt", ["block_fp8", "mxfp8", "fp8_per_tensor", "bf16"])
def test_groups_partition_inputs_and_units_one_group_per_layer(fmt):
    plan = small_plan(fmt)
    groups = ring_groups(plan)
    names = [n for g in groups for n in g.inputs]
    assert sorted(names) == sorted(i.name for i in plan.inputs) and len(names) == len(set(names))
    assert sorted(u for g in groups for u in g.units) == list(range(len(plan.units)))
    for g in groups:
        assert all(set(plan.units[u].inputs) <= set(g.inputs) for u in g.units)
        layers = {plan.units[u].layer for u in g.units}
        assert len(layers) == 1, (g.label, layers)
        if layers == {None}:
            assert len(g.units) == 1 and g.label == g.inputs[0]  # embedding, norm, lm_head: alone
        spans = sorted((s.offset, s.offset + s.nbytes) for s in g.layout)
        assert all(start % ALIGN == 0 for start, _ in spans)
        assert all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(spans))
    assert {"layer 0", "layer 1", "layer 2", "layer mtp.0"} <= {g.label for g in groups}
    position = {i.name: k for k, i in enumerate(plan.inputs)}
    firsts = [position[g.inputs[0]] for g in groups]
    assert firsts == sorted(firsts)  # granted in the order trainers declare


def test_qwen3_5_35b_a3b_stages_through_four_regions_in_a_tenth_of_the_memory():
    """The real config: 48 groups; the largest is a decoder layer (routed experts plus attention);
    four regions of it are under a tenth of staging the whole step."""
    config = json.loads((DATA / "qwen3.5-35b-a3b.config.json").read_text())
    plan = plan_from_hf_config(config, SPEC)
    groups = ring_groups(plan)
    whole = sum(-(-i.nbytes // ALIGN) * ALIGN for i in plan.inputs)
    largest = max(groups, key=lambda g: g.nbytes)
    assert largest.label.startswith("layer ") and len(groups) == 48
    experts = 256 * (2 * 512 * 2048 + 2048 * 512) * 2  # gate_up + down of one layer, bf16
    assert experts < largest.nbytes < experts * 1.1
    assert DEFAULT_GPU_REGIONS * region_size(groups) < whole / 10


def test_ring_grants_groups_in_plan_order_and_frees_a_region_after_its_last_unit():
    plan = small_plan()
    ring = RingStaging(plan, regions=2, capacity=2 * region_size(ring_groups(plan)))
    first = ring.start()
    assert [g for g, _ in first] == [0, 1] and [s.offset for _, s in first] == [0, ring.region_bytes]
    g0, g2 = ring.groups[0], ring.groups[2]
    with pytest.raises(ValueError, match=f"belongs to {g2.label}, which holds no staging region now"):
        ring.view(Offsets(), g2.inputs[0])
    name = g0.inputs[0]
    assert ring.view(Offsets(), name)[0] == 0 + g0.layout.slots[name].offset
    for n in g0.inputs:
        ring.tensor_complete(n)
    assert [ring.unit_submitted(u) for u in g0.units] == [False] * (len(g0.units) - 1) + [True]
    for u in g0.units[:-1]:
        assert ring.unit_done(u) == []
    granted = ring.unit_done(g0.units[-1])
    assert [(g, s.offset) for g, s in granted] == [(2, 0)]  # group 2 takes group 0's region
    assert ring.granted(2) and not ring.granted(0)
    assert not ring.resident(g0.inputs[0]) and ring.resident(ring.groups[1].inputs[0])
    assert ring.held() == [ring.groups[1].label, g2.label]
    ring.reset()
    assert ring.held() == [] and not ring.resident(ring.groups[1].inputs[0])
    assert [g for g, _ in ring.start()] == [0, 1]  # a new step starts from the first group


def test_ring_refuses_to_free_a_region_whose_inputs_never_completed():
    plan = small_plan()
    ring = RingStaging(plan, regions=1, capacity=region_size(ring_groups(plan)))
    ring.start()
    units = ring.groups[0].units
    for u in units[:-1]:
        ring.unit_done(u)
    with pytest.raises(ValueError, match="every unit ran before its inputs were complete"):
        ring.unit_done(units[-1])


def test_a_region_too_small_for_the_largest_group_is_refused_naming_the_sizes():
    plan = small_plan()
    need = region_size(ring_groups(plan))
    with pytest.raises(ValueError) as err:
        RingStaging(plan, regions=2, capacity=2 * need - 1)
    text = str(err.value)
    assert (
        f"2 regions of {need - ALIGN} bytes" in text and f"raise staging_bytes to at least {2 * need}" in text
    )
    with pytest.raises(ValueError, match="at least 1 region"):
        RingStaging(plan, regions=0, capacity=need)


def test_staging_regions_setting_defaults_to_a_ring_on_gpu_arenas_only(tmp_path):
    assert DaemonConfig(runtime_dir=tmp_path).ring_regions == 0
    assert DaemonConfig(runtime_dir=tmp_path, arena=ArenaKind.CUDA_IPC).ring_regions == DEFAULT_GPU_REGIONS
    assert DaemonConfig(runtime_dir=tmp_path, arena=ArenaKind.CUDA_IPC, staging_regions=0).ring_regions == 0
    assert DaemonConfig(runtime_dir=tmp_path, staging_regions=3).ring_regions == 3
    with pytest.raises(ConfigError, match="staging_regions = -1: give 0 to stage whole steps"):
        DaemonConfig(runtime_dir=tmp_path, staging_regions=-1)


# --------------------------------------------------------------------------------------------------
# whole steps through the ring, in a running daemon


@pytest.fixture
def running(tmp_path):
    """A daemon in a thread, two ranks, frames of 64 KiB under two credits (many per tensor)."""
    factory = daemon_factory(
        tmp_path, hf_config=CONFIG, world_size=2, max_frame_bytes=64 << 10, credit_frames=2
    )
    yield next(factory)
    next(factory, None)


def weights(seed: int) -> dict[str, torch.Tensor]:
    return make_state_dict("qwen3_5_moe", seed=seed, **MODEL)


def rank_items(sd: dict[str, torch.Tensor], rank: int, world: int = 2) -> list:
    """Rank ``rank``'s part: every tensor with enough rows split along dim 0, the rest alternately."""
    out = []
    for i, (name, t) in enumerate(sd.items()):
        if t.dim() >= 1 and t.shape[0] >= world:
            a, b = t.shape[0] * rank // world, t.shape[0] * (rank + 1) // world
            out.append((name, Shard(t[a:b], tuple(t.shape), (a,) + (0,) * (t.dim() - 1))))
        elif i % world == rank:
            out.append((name, t))
    return out


def push_all(clients, step: int, sd) -> list:
    """Every client pushes its part of ``sd`` at once; results (or the exceptions) by rank."""
    with ThreadPoolExecutor(len(clients)) as pool:
        futures = [pool.submit(c.push_step, step, rank_items(sd, c.rank, len(clients))) for c in clients]
        out = []
        for f in futures:
            try:
                out.append(f.result())
            except RefitError as exc:
                out.append(exc)
        return out


def assert_published(endpoint: str, step: int, sd, fmt: str = "block_fp8") -> None:
    expected = convert(sd, RefitSpec(model_type="qwen3_5_moe", fmt=fmt))
    with RefitReader(endpoint, name="check") as reader:
        gen = reader.wait(min_step=step, timeout=30)
        try:
            assert gen.step == step
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


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("regions", "fmt", "mover"),
    [(1, "block_fp8", "zmq"), (3, "mxfp8", "auto"), (2, "fp8_per_tensor", "auto")],
)
def test_local_and_remote_ranks_stream_steps_through_the_ring_byte_exact(running, regions, fmt, mover):
    """Rank 0 writes into the ring's regions, rank 1's pieces go into them as frames (mover=zmq, or
    no NIXL here) or are READ over NIXL a group at a time; with one region the step goes through
    strictly one group at a time. Staging is smaller than the step."""
    d = running(staging_regions=regions, format=fmt)
    status = d.status()
    ring = status["staging"]["ring"]
    assert (ring["regions"], ring["groups"]) == (regions, len(d.daemon.arenas.ring.groups))
    assert status["staging"]["bytes"] == regions * ring["region_bytes"] < status["plan"]["bytes_in"]
    assert status["pull"]["nixl"] is NIXL_OK
    pulled = mover == "auto" and NIXL_OK
    with (
        RefitClient(d.endpoint, 0, 2, timeout=60) as c0,
        RefitClient(d.endpoint, 1, 2, local=False, timeout=60, mover=mover) as c1,
    ):
        for step in range(2):
            sd = weights(10 + step)
            r0, r1 = push_all([c0, c1], step, sd)
            assert (r0.step, r1.step, r0.generation) == (step, step, r1.generation)
            assert (r0.mover, r1.mover) == ("staging", "nixl" if pulled else "zmq"), r1.mover_reason
            assert r0.bytes_in == status["plan"]["bytes_in"]
            assert_published(d.endpoint, step, sd, fmt)
    assert d.status()["staging"]["ring"]["held"] == []


@pytest.mark.timeout(120)
def test_nan_mid_stream_fails_every_rank_and_the_next_step_publishes(running):
    """A NaN in layer 1's experts fails the step on both ranks while later groups wait for regions;
    the last good step stays live and the ring starts over for the next step."""
    d = running(staging_regions=2)
    with (
        RefitClient(d.endpoint, 0, 2, timeout=60) as c0,
        RefitClient(d.endpoint, 1, 2, local=False, timeout=60) as c1,
    ):
        good = weights(1)
        push_all([c0, c1], 1, good)
        bad = weights(2)
        slab = next(n for n in bad if ".layers.1." in n and n.endswith("gate_up_proj"))
        bad[slab][-1, 0, 0] = float("nan")  # the last expert: rank 1's half
        results = push_all([c0, c1], 2, bad)
        assert all(isinstance(r, RefitError) and r.kind is ErrorKind.NON_FINITE for r in results), results
        assert len({str(r) for r in results}) == 1 and "NaN" in str(results[0])
        status = d.status()
        assert status["live"]["step"] == 1 and status["step_in_progress"] is None
        assert status["staging"]["ring"]["held"] == []
        assert_published(d.endpoint, 1, good)
        again = weights(3)
        push_all([c0, c1], 3, again)
        assert_published(d.endpoint, 3, again)


def watch_ring_reads(d, monkeypatch, fail=lambda group: False) -> list[tuple[int, int]]:
    """Check every NIXL READ the daemon posts: each piece lands inside the region its group holds
    right now, granted and not yet being quantized. Returns ``(group, region)`` per READ, in order;
    ``fail(group)`` True makes that group's READ fail to post (its rank then sends frames)."""
    real, reads = PullSide.start, []
    ring, staging = d.daemon.arenas.ring, d.daemon.arenas.staging

    def start(side, arena, rank, identity, offer, targets, notif):
        base = shm_region(staging)[0]
        groups = {ring.group_of[d.daemon.step.pieces[pid][1]] for pid, _, _ in targets}
        assert len(groups) == 1, groups  # one READ per rank and group
        group = groups.pop()
        slot = ring.ring.slots[ring.grants[group].slot.index]
        assert slot.owner == group and slot.state is SlotState.CLAIMED, (group, slot)
        for _, view, _ in targets:
            lo = view.data_ptr() - base
            assert slot.offset <= lo and lo + view.numel() * view.element_size() <= slot.offset + slot.nbytes
        reads.append((group, slot.index))
        if fail(group):
            raise nixl.NixlError("injected")
        return real(side, arena, rank, identity, offer, targets, notif)

    monkeypatch.setattr(PullSide, "start", start)
    return reads


@needs_nixl
@pytest.mark.timeout(120)
@pytest.mark.parametrize("regions", [1, 2])
def test_a_remote_rank_is_read_over_nixl_a_group_at_a_time_into_its_granted_region(
    running, monkeypatch, regions
):
    """Staging is a ring and the remote rank offers NIXL: the daemon READs each layer group's
    pieces of it into the region that group was just granted (never one being quantized), one READ
    per group, and the rank sends no frame; the rank's metadata is loaded once per step, not per
    READ. Byte-exact, two steps (the ring starts over)."""
    d = running(staging_regions=regions)
    reads = watch_ring_reads(d, monkeypatch)
    loaded = []
    add_peer = nixl.NixlEndpoint.add_peer
    monkeypatch.setattr(
        nixl.NixlEndpoint, "add_peer", lambda ep, md, **kw: loaded.append(md) or add_peer(ep, md, **kw)
    )
    groups = d.daemon.arenas.ring.groups
    with (
        RefitClient(d.endpoint, 0, 2, timeout=60) as c0,
        RefitClient(d.endpoint, 1, 2, local=False, timeout=60) as c1,
    ):
        for step in range(2):
            sd = weights(20 + step)
            r0, r1 = push_all([c0, c1], step, sd)
            assert (r0.mover, r1.mover, r1.mover_reason) == ("staging", "nixl", "")
            assert_published(d.endpoint, step, sd)
            assert [g for g, _ in reads] == [g.index for g in groups]  # plan order, each once
            assert {r for _, r in reads} == set(range(regions))
            assert len(loaded) == step + 1  # each step registers (and offers) its own host copies
            reads.clear()
    status = d.status()
    assert status["pull"]["ranks"]["1"]["mover"] == "nixl" and status["staging"]["ring"]["held"] == []


@needs_nixl
@pytest.mark.timeout(120)
def test_a_ring_group_whose_read_fails_goes_as_frames_and_the_step_publishes(running, monkeypatch):
    """The READ of every other group cannot be posted: the daemon says PULLED failed for those
    pieces and the rank sends them as frames into the region the group still holds."""
    d = running(staging_regions=2)
    watch_ring_reads(d, monkeypatch, fail=lambda group: group % 2 == 1)
    with (
        RefitClient(d.endpoint, 0, 2, timeout=60) as c0,
        RefitClient(d.endpoint, 1, 2, local=False, timeout=60) as c1,
    ):
        sd = weights(30)
        _, r1 = push_all([c0, c1], 0, sd)
        assert r1.mover == "nixl+zmq" and "injected" in r1.mover_reason, (r1.mover, r1.mover_reason)
        assert_published(d.endpoint, 0, sd)
    assert d.status()["staging"]["ring"]["held"] == []


class NoPull(RefitClient):
    """Ignores READY's ``pull``: sends every piece as frames, each group after its SLOT."""

    def _write_ring(self, step, pieces, ids, ready, deadline, srcs=None, **kw):
        return super()._write_ring(step, pieces, ids, ready, deadline, srcs, reg=None)


class Stalled:
    """A READ that never finishes (a slow network): polls PROC until released."""

    def poll(self):
        return "PROC"

    def release(self):
        pass


@needs_nixl
@pytest.mark.timeout(120)
def test_frames_for_a_piece_the_daemon_is_reading_fail_the_step_and_the_daemon_serves_on(
    running, monkeypatch
):
    """A remote rank offers NIXL, then sends frames for the pieces READY said the daemon READs
    while those READs are still in flight. Taking them would complete the group, free its region
    and grant it to the next group under the READ still writing it: the daemon refuses the first
    such frame (PROTOCOL) and the next step, with the READs working, publishes."""
    d = running(staging_regions=2, world_size=1)
    real = PullSide.start

    def stalled(side, arena, rank, identity, offer, targets, notif):
        pull = Pull(rank, identity, [t[0] for t in targets], Stalled())
        side.inflight.append(pull)
        return pull

    monkeypatch.setattr(PullSide, "start", stalled)
    sd = weights(40)
    with NoPull(d.endpoint, 0, 1, local=False, timeout=60) as hostile, pytest.raises(RefitError) as err:
        hostile.push_step(0, rank_items(sd, 0, 1))
    assert err.value.kind is ErrorKind.PROTOCOL and "listed under pull" in str(err.value)
    monkeypatch.setattr(PullSide, "start", real)
    with RefitClient(d.endpoint, 0, 1, local=False, timeout=60) as client:
        assert client.push_step(1, rank_items(sd, 0, 1)).mover == "nixl"
    assert_published(d.endpoint, 1, sd)


class Eager(RefitClient):
    """Writes (claims) every group at once, without waiting for the daemon's SLOTs."""

    def _write_ring(self, step, pieces, ids, ready, deadline, srcs=None, **kw):
        if "staging" in ready:
            self._send(Kind.PIECE_DONE, {"step": step, "pieces": list(ids)})
            return "staging", ""
        self._remote.stream(step, pieces, ids, deadline, self._frame_limit())
        return "zmq", ""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("local", [True, False])
def test_writing_a_group_before_its_slot_is_a_protocol_error_and_the_daemon_serves_on(running, local):
    d = running(staging_regions=1, world_size=1)
    sd = weights(4)
    eager = Eager(d.endpoint, 0, 1, local=local, timeout=60, mover="zmq")  # frames, not pulls
    with eager, pytest.raises(RefitError) as err:
        eager.push_step(0, rank_items(sd, 0, 1))
    assert err.value.kind is ErrorKind.PROTOCOL
    assert "before the daemon granted that group a staging region (SLOT)" in str(err.value)
    with RefitClient(d.endpoint, 0, 1, local=local, timeout=60) as client:
        client.push_step(1, rank_items(sd, 0, 1))
    assert_published(d.endpoint, 1, sd)


def test_a_configured_staging_too_small_for_a_layer_group_stops_the_daemon_naming_sizes(
    tmp_path, monkeypatch
):
    """Refused at start, before any step, and the segments made so far are gone."""
    cfg_path = tmp_path / "config.json"
    cfg_path.write_text(json.dumps(CONFIG))
    config = DaemonConfig(
        runtime_dir=tmp_path / "run", hf_config=cfg_path, staging_regions=4, staging_bytes=64 << 10
    )
    prepare_runtime_dir(config.runtime_dir)
    instance = f"{random.getrandbits(64):016x}"
    monkeypatch.setattr("sidecar.daemon.loop.secrets.token_hex", lambda n: instance)
    made = []
    real_create = ShmSegment.create
    monkeypatch.setattr(
        ShmSegment,
        "create",
        classmethod(lambda cls, name, size: made.append(name) or real_create(name, size)),
    )
    with pytest.raises(ValueError, match=r"the staging arena holds 65536 bytes: 4 regions of 16384 bytes"):
        Daemon(config)
    assert made and all(name.startswith("refitd-") and instance[:8] in name for name in made)
    assert [n for n in made if (Path("/dev/shm") / n).exists()] == []


def _cuda_reason() -> str | None:
    from transport.cuda_driver import cuda_available, cuda_unavailable_reason

    return (
        None if cuda_available() and torch.cuda.is_available() else (cuda_unavailable_reason() or "no CUDA")
    )


@pytest.mark.timeout(300)
@pytest.mark.skipif(_cuda_reason() is not None, reason=f"needs a CUDA GPU: {_cuda_reason()}")
def test_gpu_arenas_stage_through_the_default_ring_device_to_device(running):
    """``arena = "cuda"`` with no ``staging_regions``: the default ring of four regions on the GPU; a
    trainer's CUDA tensors go device to device into it, the Triton kernels quantize each group, and
    the generation equals ``convert()`` on the CPU byte for byte, two steps running."""
    d = running(arena=ArenaKind.CUDA_IPC, world_size=1)
    status = d.status()
    assert status["staging"]["ring"]["regions"] == DEFAULT_GPU_REGIONS
    with RefitClient(d.endpoint, 0, 1, timeout=120) as client:
        for step in range(2):
            sd = weights(30 + step)
            result = client.push_step(step, {n: t.cuda() for n, t in sd.items()})
            assert result.mover == "staging"
            expected = convert(sd, SPEC)
            with RefitReader(d.endpoint, name="check") as reader:
                gen = reader.wait(min_step=step, timeout=60)
                bad = [
                    n
                    for n, v in expected.items()
                    if not torch.equal(
                        gen.tensors[n].cpu().reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)
                    )
                ]
                reader.release(gen)
            assert bad == []


def test_more_regions_than_groups_cost_no_memory():
    """A ring never holds more regions than the plan has groups: the rest would sit idle."""
    plan = small_plan()
    groups = ring_groups(plan)
    ring = RingStaging(plan, regions=len(groups) + 5, capacity=len(groups) * region_size(groups))
    assert ring.regions == len(groups) and ring.region_bytes == region_size(groups)
    assert [g for g, _ in ring.start()] == list(range(len(groups)))
    from sidecar.daemon.memory.generations import Arenas

    arenas = Arenas.for_plan(
        f"refitd-test-{random.getrandbits(32):08x}", plan, staging_regions=len(groups) + 5
    )
    try:
        assert arenas.staging.size == len(groups) * region_size(groups) and arenas.ring.regions == len(groups)
    finally:
        arenas.close()
