"""Per-GPU work on a node with several GPUs (docs/multi_gpu.md, "Per-GPU work").

With ``gpus`` naming several GPUs the daemon places each layer group on one of them (bytes balanced,
round-robin where groups are alike): each GPU
has its own staging and publish rings within ``device_budget``, its own grants (a GPU whose groups
stall holds only its own regions) and its own quantization thread. Run against
``support.fake_cuda.FakeCuda`` with two to four GPUs (every allocation counted per device): a real
daemon (serve loop, workers, rings) publishes byte-exact into host generations, compared with
``convert()`` on the CPU.
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from support.daemons import RunningDaemon
from support.fake_cuda import FakeCuda
from support.waiting import wait_until

import transport.cuda_ipc
from adapters.base import RefitReader
from sidecar.cli.demo.synthetic import make_hf_config, make_state_dict
from sidecar.cli.serve import render_status
from sidecar.client.client import RefitClient, Shard
from sidecar.client.local import StagingWriter
from sidecar.client.placement import placed_row, ring_arenas
from sidecar.config.settings import DEFAULT_DEVICE_BUDGET, ArenaKind
from sidecar.daemon.memory.staging import RingStaging, balanced_lanes, region_size, ring_groups
from sidecar.daemon.memory.tiers import fit_device_tier
from sidecar.daemon.worker import QuantWorker
from sidecar.errors import ErrorKind, RefitError
from sidecar.plan.build import RefitSpec, plan_from_hf_config
from sidecar.plan.run import convert
from transport.wire import Kind, ProtocolError

MiB = 1 << 20
SPEC = RefitSpec(model_type="qwen3_5_moe", fmt="block_fp8")
MODEL = dict(num_layers=3, num_experts=16, unaligned=True)
HF = make_hf_config("qwen3_5_moe", **MODEL)
BUDGET = 8 * MiB  # four 2 MiB granules per GPU: layers are cut into parts to fit


@pytest.fixture
def fake(monkeypatch, request):
    """``request.param`` (default 2) fake GPUs behind every CUDA call of the arenas."""
    cuda = FakeCuda(gpus=getattr(request, "param", 2))
    monkeypatch.setattr(transport.cuda_ipc, "default_driver", lambda required=True: cuda)
    monkeypatch.setattr(transport.cuda_ipc, "local_gpus", lambda nvml=None: [])  # no NVML: ask the driver
    # a local rank in this process maps the fake's "device memory" (host memory): no CUDA stream to copy on
    monkeypatch.setattr(StagingWriter, "_copy_stream", lambda self, arena=None: contextlib.nullcontext())
    return cuda


def start(tmp_path: Path, gpus: str, **settings) -> RunningDaemon:
    return RunningDaemon(
        tmp_path,
        hf_config=HF,
        arena=ArenaKind.CUDA_IPC,
        gpus=gpus,
        device_budget=BUDGET,
        max_frame_bytes=256 << 10,
        **{"world_size": 1, **settings},
    )


def device_of(fake: FakeCuda, t: torch.Tensor) -> int | None:
    """The fake GPU whose memory holds ``t``'s bytes (None: host memory)."""
    ptr = t.data_ptr()
    for base, (device, buf) in fake.buffers.items():
        if base <= ptr < base + buf.nbytes:
            return device
    return None


def rank_items(sd: dict[str, torch.Tensor], rank: int, world: int) -> list:
    """Rank ``rank``'s part: tensors with enough rows split along dim 0, the rest alternately."""
    out = []
    for i, (name, t) in enumerate(sd.items()):
        if t.dim() >= 1 and t.shape[0] >= world:
            a, b = t.shape[0] * rank // world, t.shape[0] * (rank + 1) // world
            out.append((name, Shard(t[a:b], tuple(t.shape), (a,) + (0,) * (t.dim() - 1))))
        elif i % world == rank:
            out.append((name, t))
    return out


def push_all(clients: list[RefitClient], step: int, sd: dict) -> list:
    """Every client pushes its part of ``sd`` at once; results (or the RefitErrors) by rank."""
    with ThreadPoolExecutor(len(clients)) as pool:
        futures = [pool.submit(c.push_step, step, rank_items(sd, c.rank, len(clients))) for c in clients]
        out = []
        for f in futures:
            try:
                out.append(f.result())
            except RefitError as exc:
                out.append(exc)
        return out


def assert_published(endpoint: str, step: int, sd: dict) -> None:
    """A reader gets host tensors byte-identical to convert() on the CPU, of step ``step``."""
    expected = convert(sd, SPEC)
    with RefitReader(endpoint, name="check") as reader:
        gen = reader.wait(min_step=step, timeout=60)
        try:
            assert gen.step == step and not gen.on_gpu
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


def watch_workers(monkeypatch) -> list[tuple[str, int, list[torch.Tensor], list[torch.Tensor]]]:
    """Record every unit a worker thread runs: (thread name, unit index, its inputs, its outputs)."""
    seen: list = []
    lock = threading.Lock()
    real_one, real_batch = QuantWorker._run_one, QuantWorker._run_batch

    def note(job) -> None:
        if isinstance(job, tuple):
            with lock:
                seen.append(
                    (
                        threading.current_thread().name,
                        job[1].index,
                        list(job[2].values()),
                        list(job[3].values()),
                    )
                )

    def run_one(self, job):
        note(job)
        return real_one(self, job)

    def run_batch(self, run):
        for job in run:
            note(job)
        return real_batch(self, run)

    monkeypatch.setattr(QuantWorker, "_run_one", run_one)
    monkeypatch.setattr(QuantWorker, "_run_batch", run_batch)
    return seen


# --------------------------------------------------------------------------------------------------
# the ring's lanes: placement and grants per GPU


def test_groups_are_balanced_over_gpus_and_each_gpu_grants_on_its_own():
    """Two lanes of one region each: groups placed bytes-balanced in plan order. Lane 0's first
    group never fills (its GPU stalls); lane 1 is still granted, drains and is granted again,
    group after group, to its end; lane 0 then goes on where it stopped. Deterministic: no
    threads, no sleeps."""
    plan = plan_from_hf_config(HF, SPEC)
    groups = ring_groups(plan)
    ring = RingStaging(plan, regions=1, capacity=region_size(groups), lanes=2)
    assert ring.lanes == 2 and ring.regions == 1 and ring.wire()["arenas"] == 2
    lanes = [ring.lane_of(g.index) for g in ring.groups]
    assert lanes == balanced_lanes([g.nbytes for g in ring.groups], 2) and set(lanes) == {0, 1}
    for g in ring.groups:
        name = g.inputs[0]
        assert ring.placement(name) == (g.index, g.layout.slots[name].offset, ring.lane_of(g.index))
    first = ring.start()
    lane0 = [g.index for g in ring.groups if ring.lane_of(g.index) == 0]
    lane1 = [g.index for g in ring.groups if ring.lane_of(g.index) == 1]
    assert [g for g, _ in first] == [lane0[0], lane1[0]] and ring.lane_groups(1) == len(lane1)

    def run(group: int) -> list:
        for name in ring.groups[group].inputs:
            ring.tensor_complete(name)
        grants = []
        for u in ring.groups[group].units:
            ring.unit_submitted(u)
            grants += ring.unit_done(u)
        return grants

    for k, group in enumerate(lane1):  # lane 0's first group holds its only region all along
        assert [g for g, _ in run(group)] == lane1[k + 1 : k + 2], group
        assert ring.held(0) == [ring.groups[lane0[0]].label]
    assert ring.held(1) == []
    for k, group in enumerate(lane0):
        assert [g for g, _ in run(group)] == lane0[k + 1 : k + 2]
    assert ring.held() == []


def test_balanced_lanes_are_round_robin_for_alike_groups_and_spread_unlike_ones():
    assert balanced_lanes([5] * 7, 3) == [0, 1, 2, 0, 1, 2, 0]
    assert balanced_lanes([10, 1, 1, 1, 10, 1], 2) == [0, 1, 1, 1, 1, 0]  # never 10 + 10 on one
    assert balanced_lanes([3, 3], 1) == [0, 0]


def test_one_gpu_ring_and_wire_are_as_before():
    """One lane: READY's ring and placement rows carry no arena (the single-GPU wire, unchanged)."""
    plan = plan_from_hf_config(HF, SPEC)
    ring = RingStaging(plan, regions=2, capacity=2 * region_size(ring_groups(plan)))
    assert "arenas" not in ring.wire() and all(len(ring.placement(i.name)) == 2 for i in plan.inputs)
    assert ring_arenas({"ring": ring.wire()}) == 1


def test_placement_rows_and_arena_counts_are_checked():
    assert placed_row([3, 4096], 1) == (3, 4096, 0) and placed_row([3, 4096, 1], 2) == (3, 4096, 1)
    for row, arenas, message in (
        ([3, 4096, 2], 2, "staging arena 2, but its ring has 2"),
        ([3, 4096, -1], 2, "staging arena -1"),
        ([3, "x"], 1, "not \\[group, offset\\]"),
        ([3, 4096, 1, 0], 2, "not \\[group, offset\\]"),
    ):
        with pytest.raises(ProtocolError, match=message):
            placed_row(row, arenas)
    for bad in (0, -2, "2", 1.5):
        with pytest.raises(ProtocolError, match="staging arenas: it must be a positive integer"):
            ring_arenas({"ring": {"arenas": bad}})


@pytest.mark.parametrize("gpus", [2, 4, 8])
def test_the_budget_holds_each_gpus_share_of_a_real_model(gpus):
    """fit_device_tier per GPU: every GPU's rings within the default budget; with more GPUs each
    holds fewer regions only once its share of groups is smaller than the regions asked for."""
    import json

    hf = json.loads((Path(__file__).parent / "data" / "qwen3.5-35b-a3b.config.json").read_text())
    plan = plan_from_hf_config(hf, SPEC)
    one = fit_device_tier(plan, regions=4, budget=DEFAULT_DEVICE_BUDGET, host_generations=True)
    each = fit_device_tier(plan, regions=4, budget=DEFAULT_DEVICE_BUDGET, host_generations=True, gpus=gpus)
    assert each.device_bytes <= DEFAULT_DEVICE_BUDGET and each.groups == one.groups
    assert (
        each.regions == min(one.regions, -(-one.groups // gpus)) and each.staging_region == one.staging_region
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fake", [4], indirect=True)
@pytest.mark.parametrize("layers", [2, 6])
def test_each_gpus_device_memory_stays_within_the_budget_whatever_the_model_size(layers, fake):
    """Four GPUs, a model three times larger: each GPU allocates its staging and publish ring once,
    within the budget, the same bytes whatever the model (the generations grow in host memory)."""
    import random

    from sidecar.daemon.memory.generations import Arenas

    hf = make_hf_config("qwen3_5_moe", num_layers=layers, num_experts=8 * layers // 2, unaligned=True)
    plan = plan_from_hf_config(hf, SPEC)
    arenas = Arenas.for_plan(
        f"refitd-test-{random.getrandbits(32):08x}",
        plan,
        kind=ArenaKind.CUDA_IPC,
        staging_regions=4,
        host_generations=True,
        budget=BUDGET,
        gpus=[0, 1, 2, 3],
    )
    try:
        assert arenas.lanes == 4 and sorted(d for d, _ in fake.allocations) == [0, 0, 1, 1, 2, 2, 3, 3]
        assert all(fake.peak[k] <= BUDGET for k in range(4))
        assert arenas.device_bytes_per_gpu() == [fake.peak[k] for k in range(4)]
        lanes = {arenas.ring.lane_of(g.index) for g in arenas.ring.groups}
        assert lanes == {0, 1, 2, 3}
    finally:
        arenas.close()
    assert fake.registered == {} and fake.device_bytes_now == 0


def test_a_local_rank_refuses_a_ready_without_every_gpus_staging_handle(fake):
    writer = StagingWriter(link=None)
    for handles in (None, [{"kind": "cuda_ipc"}], "x"):
        with pytest.raises(ProtocolError, match="spreads the staging ring over 2 GPU arenas"):
            writer.open_lanes(handles, 2)
    with pytest.raises(ProtocolError, match="no staging arena 1 is mapped"):
        writer.lane(1)


# --------------------------------------------------------------------------------------------------
# the daemon on two (fake) GPUs


@pytest.mark.timeout(300)
def test_groups_are_quantized_on_their_gpu_within_each_budget_byte_exact(tmp_path, fake, monkeypatch):
    """gpus = two UUIDs: each GPU holds a staging ring and a publish ring (nothing else, nothing per
    step), within the budget; every unit runs on its GPU's worker thread, reading staging and
    writing a publish region on that GPU; two steps publish byte-exact into the host generations;
    status lists both GPUs' rings."""
    seen = watch_workers(monkeypatch)
    d = start(tmp_path, ",".join(fake.uuids))
    try:
        arenas = d.daemon.arenas
        assert arenas.lanes == 2 and [a.device for a in arenas.stagings] == [0, 1]
        assert [a.device for a in arenas.publish_arenas] == [0, 1]
        assert sorted(dev for dev, _ in fake.allocations) == [0, 0, 1, 1]
        ring = arenas.ring
        for step in range(2):
            with RefitClient(d.endpoint, 0, 1, local=False, timeout=120) as client:
                client.push_step(step, make_state_dict("qwen3_5_moe", seed=step, **MODEL))
            assert_published(d.endpoint, step, make_state_dict("qwen3_5_moe", seed=step, **MODEL))
        assert fake.peak[0] <= BUDGET and fake.peak[1] <= BUDGET
        assert arenas.device_bytes_per_gpu() == [fake.live[0], fake.live[1]]
        assert len(fake.allocations) == 4  # nothing allocated per step
        plan = d.daemon.plan
        assert sorted(u for _, u, _, _ in seen) == sorted(list(range(len(plan.units))) * 2)
        for thread, unit, inputs, outputs in seen:
            lane = ring.lane_of(ring.unit_group[unit])
            assert thread == f"refitd-quant-gpu{lane}", (unit, thread)
            assert {device_of(fake, t) for t in inputs if t.numel()} <= {lane}
            if plan.units[unit].fmt is not None:  # quantized into its GPU's publish ring
                assert {device_of(fake, t) for t in outputs if t.numel()} <= {lane, None}
                assert any(device_of(fake, t) == lane for t in outputs if t.numel())
        assert {thread for thread, *_ in seen} == {"refitd-quant-gpu0", "refitd-quant-gpu1"}
        status = d.status()
        rings = status["tiers"]["rings"]
        assert [(r["device"], r["gpu"]) for r in rings] == [(0, fake.uuids[0]), (1, fake.uuids[1])]
        assert [r["device_bytes"] for r in rings] == [fake.live[0], fake.live[1]]
        assert sum(r["groups"] for r in rings) == len(ring.groups) and all(r["held"] == [] for r in rings)
        text = render_status(status)
        assert "on 2 GPUs, each within a 8.0 MiB budget" in text
        assert f"cuda:0 ({fake.uuids[0]}): staging" in text and f"cuda:1 ({fake.uuids[1]}): staging" in text
    finally:
        d.close()
    assert fake.registered == {}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fake", [3], indirect=True)
def test_a_local_rank_writes_each_group_into_its_gpus_staging_arena(tmp_path, fake, monkeypatch):
    """gpus = 0,1,2 by index; a local rank (same node: D2D through the mapped handles) and a remote
    one: the local rank maps every GPU's staging arena READY lists and writes each granted group
    into the arena SLOT names (the GPU READY placed it on); two steps publish byte-exact."""
    writes: list[tuple[int, int]] = []
    real = StagingWriter.write_group

    def write_group(self, step, rows, offset, deadline, arena=0):
        writes.append((arena, self.lane(arena).device))
        return real(self, step, rows, offset, deadline, arena)

    monkeypatch.setattr(StagingWriter, "write_group", write_group)
    d = start(tmp_path, "0,1,2", world_size=2)
    try:
        assert d.daemon.arenas.lanes == 3
        with (
            RefitClient(d.endpoint, 0, 2, timeout=120) as c0,
            RefitClient(d.endpoint, 1, 2, local=False, timeout=120) as c1,
        ):
            for step in range(2):
                sd = make_state_dict("qwen3_5_moe", seed=20 + step, **MODEL)
                r0, r1 = push_all([c0, c1], step, sd)
                assert (r0.mover, r1.mover) == ("staging", "zmq")
                assert_published(d.endpoint, step, sd)
        assert {a for a, _ in writes} == {0, 1, 2} and all(a == dev for a, dev in writes)
        assert max(fake.peak.values()) <= BUDGET
    finally:
        d.close()


@pytest.mark.timeout(300)
def test_a_slot_naming_an_unknown_arena_fails_the_step_on_every_rank(tmp_path, fake):
    """A SLOT naming a staging arena READY did not list (or another than READY placed the group
    in) is a protocol error: the client aborts, the step fails on every rank, the last good
    generation stays live and intact, and the daemon publishes the next step."""
    d = start(tmp_path, "0,1", world_size=2)
    try:
        with (
            RefitClient(d.endpoint, 0, 2, timeout=120) as c0,
            RefitClient(d.endpoint, 1, 2, local=False, timeout=120) as c1,
        ):
            good = make_state_dict("qwen3_5_moe", seed=1, **MODEL)
            assert all(r.step == 1 for r in push_all([c0, c1], 1, good))
            real_send = d.daemon.send
            for step, bad_arena in ((2, 7), (3, 0)):  # unknown; a GPU lane 1's groups are not placed on

                def send(identity, kind, fields=None, frames=(), bad=bad_arena):
                    if kind is Kind.SLOT and fields.get("arena") == 1:
                        fields = {**fields, "arena": bad}
                    return real_send(identity, kind, fields, frames)

                d.daemon.send = send
                results = push_all([c0, c1], step, make_state_dict("qwen3_5_moe", seed=step, **MODEL))
                d.daemon.send = real_send
                assert all(isinstance(r, RefitError) for r in results), results
                # the rank that got the SLOT aborts (PROTOCOL), the daemon fails the step on every rank
                told = [(r.kind, str(r)) for r in results]
                assert len(results) == 2 and all(f"staging arena {bad_arena}" in m for _, m in told), told
                assert {k for k, _ in told} <= {ErrorKind.PROTOCOL, ErrorKind.ABORTED}, told
                # both ranks may fail on the SLOT itself: the daemon ends the step at their ABORT
                status = wait_until(
                    "the step to end", lambda: (s := d.status())["step_in_progress"] is None and s
                )
                assert status["live"]["step"] == 1
                assert_published(d.endpoint, 1, good)
            again = make_state_dict("qwen3_5_moe", seed=4, **MODEL)
            assert all(r.step == 4 for r in push_all([c0, c1], 4, again))
            assert_published(d.endpoint, 4, again)
            assert d.daemon.arenas.retired_staging >= 1  # both GPUs' staging retired after a failure
    finally:
        d.close()


def test_one_gpu_listed_twice_or_pinned_by_gpu_stays_one_gpu(tmp_path, fake):
    """An index and the UUID of the same GPU are one GPU; ``gpu`` pins the arenas to one; device
    resident generations stay on one: one lane, as before."""
    from sidecar.config.settings import DaemonConfig
    from sidecar.daemon.setup import make_arenas

    for settings in (
        {"gpus": f"0,{fake.uuids[0]}"},
        {"gpus": "0,1", "gpu": "1"},
        {"gpus": "0,1", "generation_residency": "device"},
    ):
        config = DaemonConfig(
            runtime_dir=tmp_path, arena="cuda", publish_bytes="1MiB", staging_bytes="1MiB", **settings
        )
        arenas = make_arenas("refitd-test-lanes", config, None)
        try:
            assert arenas.lanes == 1 and len(arenas.stagings) == 1, settings
        finally:
            arenas.close()


@pytest.mark.timeout(300)
def test_a_unit_failing_on_one_gpus_thread_fails_the_step_everywhere_and_retires_every_staging(
    tmp_path, fake, monkeypatch
):
    """A quantization that raises on GPU 1's worker thread only: the step fails on both ranks
    (the local one and the remote one), the last good generation stays live, every GPU's staging
    arena is replaced before the next step (the local rank had all of them mapped writable), the
    next step publishes byte-exact, and closing the daemon leaves no quantization thread behind."""
    from sidecar.daemon import worker as worker_mod

    real, armed, hit = worker_mod.run_unit, threading.Event(), []

    def run_unit(unit, inputs, outputs):
        if armed.is_set() and threading.current_thread().name == "refitd-quant-gpu1" and unit.fmt is not None:
            hit.append(unit.index)
            raise RuntimeError("a kernel fault on cuda:1")
        return real(unit, inputs, outputs)

    monkeypatch.setattr(worker_mod, "run_unit", run_unit)
    d = start(tmp_path, "0,1", world_size=2)
    try:
        with (
            RefitClient(d.endpoint, 0, 2, timeout=120) as c0,
            RefitClient(d.endpoint, 1, 2, local=False, timeout=120) as c1,
        ):
            good = make_state_dict("qwen3_5_moe", seed=1, **MODEL)
            assert all(r.step == 1 for r in push_all([c0, c1], 1, good))
            before = [a.name for a in d.daemon.arenas.stagings]
            armed.set()
            results = push_all([c0, c1], 2, make_state_dict("qwen3_5_moe", seed=2, **MODEL))
            armed.clear()
            assert hit and all(isinstance(r, RefitError) for r in results), results
            assert all("a kernel fault on cuda:1" in str(r) for r in results), results
            assert_published(d.endpoint, 1, good)
            again = make_state_dict("qwen3_5_moe", seed=3, **MODEL)
            assert all(r.step == 3 for r in push_all([c0, c1], 3, again))
            assert_published(d.endpoint, 3, again)
            after = [a.name for a in d.daemon.arenas.stagings]
            assert len(after) == 2 and all(a != b for a, b in zip(before, after)), (before, after)
    finally:
        d.close()
    assert not [t.name for t in threading.enumerate() if t.name.startswith("refitd-quant-gpu")]
