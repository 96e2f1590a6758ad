"""The memory tiers (DESIGN decision 10, sidecar.daemon.memory.tiers): generations in host memory,
page-locked; a GPU footprint bounded by ``device_budget`` whatever the model's size.

GPU-side code runs against ``support.fake_cuda.FakeCuda``, the CUDA driver seam over host memory
that counts every allocation and page-lock: a real daemon (serve loop, worker, rings) with
``arena = "cuda"`` stages, quantizes into its publish ring and copies into host generations, and
what a reader gets is compared byte for byte with ``convert()`` on the CPU.
"""

from __future__ import annotations

import gc
import json
import random
from pathlib import Path

import pytest
import torch
from support.daemons import RunningDaemon
from support.fake_cuda import FakeCuda

import transport.cuda_ipc
from adapters.base import RefitReader
from sidecar.cli.demo.synthetic import make_hf_config, make_state_dict
from sidecar.client.client import RefitClient
from sidecar.config.settings import (
    DEFAULT_DEVICE_BUDGET,
    ArenaKind,
    ConfigError,
    DaemonConfig,
    Residency,
)
from sidecar.daemon.memory.generations import Arenas, layouts
from sidecar.daemon.memory.staging import ring_groups
from sidecar.daemon.memory.tiers import BudgetTooSmall, PublishLayout, fit_device_tier
from sidecar.plan.build import EngineLayout, RefitSpec, plan_from_hf_config
from sidecar.plan.models import model_type_of
from sidecar.plan.run import convert
from transport.arena import ArenaKind as Kind
from transport.shm import shm_region

DATA = Path(__file__).parent / "data"
MiB = 1 << 20
SPEC = RefitSpec(model_type="qwen3_5_moe", fmt="block_fp8")


def model(layers: int = 3, experts: int = 8) -> dict:
    return dict(num_layers=layers, num_experts=experts, unaligned=True)


@pytest.fixture
def fake(monkeypatch):
    """Every CUDA call of the arenas goes to one FakeCuda (one GPU of 141 GiB)."""
    cuda = FakeCuda()
    monkeypatch.setattr(transport.cuda_ipc, "default_driver", lambda required=True: cuda)
    monkeypatch.setattr(transport.cuda_ipc, "local_gpus", lambda nvml=None: [])  # no NVML: ask the driver
    return cuda


# --------------------------------------------------------------------------------------------------
# settings


def test_tier_settings_default_and_parse(tmp_path):
    c = DaemonConfig(runtime_dir=tmp_path)
    assert c.device_budget == DEFAULT_DEVICE_BUDGET == 4 << 30
    assert c.generation_residency is Residency.HOST and c.gpus == () and c.host_generations
    c = DaemonConfig(
        runtime_dir=tmp_path,
        arena="cuda",
        device_budget="512MiB",
        gpus="1, GPU-abc",
        generation_residency="device",
    )
    assert (c.device_budget, c.gpus, c.arena_gpu) == (512 * MiB, ("1", "GPU-abc"), "1")
    assert not c.host_generations
    assert (
        DaemonConfig(runtime_dir=tmp_path, arena="cuda", gpu="GPU-abc", gpus="1,GPU-abc").arena_gpu
        == "GPU-abc"
    )


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"device_budget": "1MiB"}, "device_budget = 1048576: too small"),
        ({"generation_residency": "device"}, "generation_residency = 'device' needs arena = 'cuda'"),
        ({"arena": "cuda", "gpu": "2", "gpus": "0,1"}, "gpu = '2' is not among gpus"),
        ({"gpus": "0,0"}, "listed twice"),
        ({"gpus": "cuda:0"}, "neither a CUDA index"),
        ({"generation_residency": "ram"}, "choose one of host, device"),
        ({"arena": "cuda", "staging_regions": 0}, "give staging_regions >= 1"),
    ],
)
def test_tier_settings_are_checked_with_what_to_do(tmp_path, settings, message):
    with pytest.raises(ConfigError, match=message):
        DaemonConfig(runtime_dir=tmp_path, **settings)


def test_whole_step_staging_stays_allowed_with_device_generations(tmp_path):
    c = DaemonConfig(runtime_dir=tmp_path, arena="cuda", staging_regions=0, generation_residency="device")
    assert c.ring_regions == 0 and not c.host_generations


# --------------------------------------------------------------------------------------------------
# groups cut to fit, and the budget fit


def plan_of(config: str, *, share: bool = False, fmt: str = "block_fp8"):
    hf = json.loads((DATA / config).read_text())
    spec = RefitSpec(model_type=model_type_of(hf), fmt=fmt)
    return plan_from_hf_config(hf, spec, share=(EngineLayout(ep=16, tp=1, nodes=2), 0) if share else None)


def test_layers_cut_into_parts_keep_every_input_and_unit_once():
    plan = plan_from_hf_config(make_hf_config("qwen3_5_moe", **model(experts=16)), SPEC)
    whole = ring_groups(plan)
    cap = max(g.nbytes for g in whole) // 3
    parts = ring_groups(plan, cap)
    assert len(parts) > len(whole)
    assert [g.index for g in parts] == list(range(len(parts)))
    assert sorted(n for g in parts for n in g.inputs) == sorted(i.name for i in plan.inputs)
    assert sorted(u for g in parts for u in g.units) == list(range(len(plan.units)))
    for g in parts:  # every unit reads inputs of its own group only
        assert all(set(plan.units[u].inputs) <= set(g.inputs) for u in g.units)
    cut = [g for g in parts if " part " in g.label]
    assert cut and all(g.nbytes <= cap for g in cut if len({plan.units[u].inputs for u in g.units}) > 1)
    same = ring_groups(plan, 10 * max(g.nbytes for g in whole))  # nothing to cut: as before
    assert [(g.label, g.inputs, g.units, g.nbytes) for g in same] == [
        (g.label, g.inputs, g.units, g.nbytes) for g in whole
    ]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("config", "share"),
    [
        ("qwen3.5-35b-a3b.config.json", False),
        ("deepseek_v3.config.json", True),
    ],
)
def test_the_default_budget_holds_real_models_on_one_gpu(config, share):
    """Whatever the model's size, the rings fit the 4 GiB default; the regions it plans hold the
    groups it cuts (what the daemon then carves). (The others: tests/test_plan_cli.py.)"""
    plan = plan_of(config, share=share)
    tier = fit_device_tier(plan, regions=4, budget=DEFAULT_DEVICE_BUDGET, host_generations=True)
    assert tier.device_bytes <= DEFAULT_DEVICE_BUDGET and tier.regions >= 1 and tier.generations == 0
    groups = ring_groups(plan, tier.max_group_bytes)
    _, outputs = layouts(plan)
    assert max(g.nbytes for g in groups) <= tier.staging_region
    assert max(PublishLayout(g, plan, outputs).size for g in groups) <= tier.publish_region


def test_a_budget_too_small_for_one_part_is_refused_naming_it():
    plan = plan_from_hf_config(make_hf_config("qwen3_5_moe", **model()), SPEC)
    with pytest.raises(
        BudgetTooSmall, match=r"cannot hold one ring region for '.+': its tensors read together"
    ):
        fit_device_tier(plan, regions=4, budget=64 << 10, host_generations=True)


def test_device_resident_generations_count_against_the_budget():
    plan = plan_of("qwen3.5-35b-a3b.config.json")
    with pytest.raises(
        BudgetTooSmall, match=r"generation_residency = 'device' puts 2 generations of 35\.39 GiB"
    ):
        fit_device_tier(plan, regions=4, budget=DEFAULT_DEVICE_BUDGET, host_generations=False)
    small = plan_from_hf_config(make_hf_config("qwen3_5_moe", **model()), SPEC)
    tier = fit_device_tier(small, regions=4, budget=64 * MiB, host_generations=False)
    _, outputs = layouts(small)
    assert tier.generations == 2 * outputs.size and tier.publish_region == 0 and tier.device_bytes <= 64 * MiB


# --------------------------------------------------------------------------------------------------
# the daemon on (fake) GPU arenas


def start(tmp_path: Path, hf: dict, **settings) -> RunningDaemon:
    return RunningDaemon(
        tmp_path, hf_config=hf, arena=ArenaKind.CUDA_IPC, world_size=1, max_frame_bytes=256 << 10, **settings
    )


def push_and_check(d: RunningDaemon, step: int, sd: dict) -> None:
    """A remote rank (frames: the fake's memory is the daemon's) pushes ``sd``; a reader gets host
    tensors byte-identical to convert() on the CPU."""
    with RefitClient(d.endpoint, 0, 1, local=False, timeout=120) as client:
        client.push_step(step, sd)
    expected = convert(sd, SPEC)
    with RefitReader(d.endpoint, name="check") as reader:
        gen = reader.wait(min_step=step, timeout=60)
        try:
            assert gen.step == step and not gen.on_gpu
            assert all(t.device.type == "cpu" for t in gen.tensors.values())
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


@pytest.mark.timeout(300)
def test_daemon_publishes_through_the_device_rings_into_pinned_host_generations(tmp_path, fake):
    """arena = cuda, generations on the host: the GPU holds only the staging and publish rings
    (within the budget, layers cut into parts to fit), both generations are host shm page-locked
    while the daemon runs and unlocked when it stops, and two steps publish byte-exact."""
    hf = make_hf_config("qwen3_5_moe", **model(experts=64))
    plan = plan_from_hf_config(hf, SPEC)
    largest = max(g.nbytes for g in ring_groups(plan))
    budget = 8 * MiB  # four 2 MiB granules: a whole layer and its outputs cannot fit
    assert largest > budget // 2
    d = start(tmp_path, hf, device_budget=budget)
    try:
        arenas = d.daemon.arenas
        assert (
            arenas.gen_kind is Kind.SHM
            and arenas.staging.kind is Kind.CUDA_IPC
            and arenas.publish_arena is not None
        )
        assert len(arenas.ring.groups) > len(ring_groups(plan))  # cut into parts
        assert [a.kind for a in (g.arena for g in arenas.generations)] == [Kind.SHM, Kind.SHM]
        # what a trainer node's forwarder registers with NIXL (DRAM) and WRITEs from: the host generation
        assert all(shm_region(g.arena) is not None for g in arenas.generations)
        assert arenas.pinning.wait(30)  # page-locked on a thread, after READY (issue 34)
        pinned = {p.ptr: p.nbytes for p in arenas.pins}
        assert len(pinned) == 2 and dict((k, v[0]) for k, v in fake.registered.items()) == pinned
        assert not any(read_only for _, read_only in fake.registered.values())
        for step in range(2):
            push_and_check(d, step, make_state_dict("qwen3_5_moe", seed=step, **model(experts=64)))
        assert fake.peak[0] <= budget and fake.device_bytes_now == arenas.device_bytes() <= budget
        tiers = d.status()["tiers"]
        assert tiers["generations"] == "shm" and tiers["device_bytes"] == fake.peak[0]
        assert tiers["device_budget"] == budget and tiers["pinned_bytes"] == sum(pinned.values())
        assert len(fake.allocations) == 2  # staging ring, publish ring: nothing per step
    finally:
        d.close()
    assert fake.registered == {} and fake.calls["host_unregister"] == 2
    del d, arenas
    gc.collect()  # the last views (the worker's queue, the loop's caches) go with the daemon
    assert fake.device_bytes_now == 0 and fake.calls["free"] == fake.calls["malloc"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layers", [2, 6])
def test_device_memory_stays_within_the_budget_whatever_the_model_size(layers, fake):
    """A model three times larger (and layers with twice the experts) takes the same device memory:
    the rings are sized by the budget, the generations (which grow) are in host memory."""
    hf = make_hf_config("qwen3_5_moe", **model(layers=layers, experts=8 * layers // 2))
    plan = plan_from_hf_config(hf, SPEC)
    budget = 12 * MiB
    arenas = Arenas.for_plan(
        f"refitd-test-{random.getrandbits(32):08x}",
        plan,
        kind=Kind.CUDA_IPC,
        staging_regions=4,
        host_generations=True,
        budget=budget,
    )
    try:
        arenas.apply_plan(plan)
        _, outputs = layouts(plan)
        assert arenas.generations[0].arena.size == outputs.size and fake.peak[0] <= budget
        assert sum(n for _, n in fake.allocations) == fake.peak[0] == arenas.device_bytes()
    finally:
        arenas.close()
    assert fake.registered == {} and fake.device_bytes_now == 0


def test_serve_refuses_a_layout_the_budget_cannot_hold(tmp_path, capsys):
    """`refitd serve` exits 78 (EX_CONFIG) naming the group and the bytes, before any CUDA call."""
    from sidecar.cli.main import main

    path = DATA / "qwen3.5-35b-a3b.config.json"  # its 1 GiB embedding alone needs more than 64 MiB
    code = main(
        [
            *("serve", "--runtime-dir", str(tmp_path / "run"), "--hf-config", str(path)),
            *("--arena", "cuda", "--device-budget", "64MiB"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 78, err
    assert "device_budget = 64.0 MiB (67108864 B) cannot hold one ring region for" in err
    assert "Raise device_budget to at least" in err


def test_shm_arenas_are_as_before(tmp_path, fake):
    """The CPU path: no device memory, nothing page-locked, generations and whole-step staging in shm."""
    plan = plan_from_hf_config(make_hf_config("qwen3_5_moe", **model()), SPEC)
    arenas = Arenas.for_plan(
        f"refitd-test-{random.getrandbits(32):08x}", plan, budget=1, host_generations=True
    )
    try:
        assert arenas.publish_arena is None and arenas.publish_ring is None and arenas.pins == []
        assert {a.kind for a in arenas.all_arenas()} == {Kind.SHM}
        assert arenas.staging.size == layouts(plan)[0].size
    finally:
        arenas.close()
    assert fake.calls == {}


def test_a_reader_page_locks_host_generations_read_only_and_unlocks_them(tmp_path, fake):
    """An engine's reader (pin=True; by default: a process already using CUDA) registers its
    read-only mapping of each host generation once (READ_ONLY), reads it, and unregisters it when
    it closes; a reader that does not pin registers nothing."""
    hf = make_hf_config("qwen3_5_moe", **model())
    with RunningDaemon(tmp_path, hf_config=hf, world_size=1) as d:  # the CPU path: shm arenas
        sd = make_state_dict("qwen3_5_moe", seed=3, **model())
        with RefitClient(d.endpoint, 0, 1, timeout=60) as client:
            client.push_step(0, sd)
            client.push_step(1, sd)
        expected = convert(sd, SPEC)
        with RefitReader(d.endpoint, name="plain") as plain:
            plain.release(plain.wait(min_step=1, timeout=60))
        assert fake.calls["host_register"] == 0
        with RefitReader(d.endpoint, name="engine", pin=True) as reader:
            for k in range(2):  # the same generation twice: pinned once (on a thread: issue 34)
                gen = reader.wait(min_step=1, timeout=60)
                assert reader.wait_pinned(30) and not gen.on_gpu
                assert gen.pinned or k == 0  # the first hand-out does not wait for the page-lock
                assert all(
                    torch.equal(gen.tensors[n].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))
                    for n, v in expected.items()
                )
                reader.release(gen)
            assert len(fake.registered) == 1 and all(ro for _, ro in fake.registered.values())
            ((_ptr, (nbytes, _)),) = fake.registered.items()
            assert nbytes >= sum(t.numel() * t.element_size() for t in gen.tensors.values())
        assert fake.registered == {} and fake.calls["host_unregister"] == 1


@pytest.mark.timeout(300)
def test_device_resident_generations_stay_on_the_gpu_within_the_budget(tmp_path, fake, monkeypatch):
    """generation_residency = device (small models): no publish ring, nothing page-locked, the
    kernels write both device generations directly, all of it within the budget; byte-exact."""
    import adapters.base

    monkeypatch.setattr(adapters.base, "_finish_copies", lambda gen: None)  # no torch CUDA streams here
    hf = make_hf_config("qwen3_5_moe", **model())
    budget = 32 * MiB
    d = start(tmp_path, hf, device_budget=budget, generation_residency="device")
    try:
        arenas = d.daemon.arenas
        assert arenas.gen_kind is Kind.CUDA_IPC and arenas.publish_arena is None and arenas.pins == []
        sd = make_state_dict("qwen3_5_moe", seed=5, **model())
        with RefitClient(d.endpoint, 0, 1, local=False, timeout=120) as client:
            client.push_step(0, sd)
        expected = convert(sd, SPEC)
        with RefitReader(d.endpoint, name="check") as reader:
            gen = reader.wait(min_step=0, timeout=60)
            assert gen.on_gpu
            assert all(
                torch.equal(gen.tensors[n].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))
                for n, v in expected.items()
            )
            reader.release(gen)
        assert len(fake.allocations) == 3 and fake.peak[0] <= budget and fake.registered == {}
    finally:
        d.close()


def test_device_resident_generations_beyond_the_budget_are_refused(fake):
    plan = plan_from_hf_config(make_hf_config("qwen3_5_moe", **model()), SPEC)
    with pytest.raises(BudgetTooSmall, match="generation_residency = 'device' puts 2 generations"):
        Arenas.for_plan("refitd-test-x", plan, kind=Kind.CUDA_IPC, staging_regions=4, budget=4 * MiB)
    assert fake.allocations == []


@pytest.mark.timeout(300)
def test_the_reference_engine_loads_host_generations_of_a_gpu_arena_daemon(tmp_path, fake):
    """An EngineWorker with the reference engine attached to a daemon on (fake) GPU arenas loads the
    host-tier generation, page-locking its mapping read-only, and holds exactly the published bytes."""
    from concurrent.futures import ThreadPoolExecutor

    from adapters.engine import EngineWorker
    from adapters.reference import ReferenceEngine, sample_inputs

    hf = make_hf_config("qwen3_5_moe", **model(layers=2, experts=4))
    engine = ReferenceEngine.from_config(hf, expert_format="block_fp8")
    d = start(tmp_path, hf, device_budget=8 * MiB)
    try:
        worker = EngineWorker(
            d.endpoint, name="ref-0", manifest=engine.manifest(), load=lambda g: engine.load(g.tensors)
        )
        worker.reader = RefitReader(
            d.endpoint, name="ref-0", manifest=engine.manifest(), timeout=60, pin=True
        )
        worker.attach()
        sd = make_state_dict("qwen3_5_moe", seed=11, **model(layers=2, experts=4))
        with ThreadPoolExecutor(1) as pool, RefitClient(d.endpoint, 0, 1, local=False, timeout=120) as client:
            loading = pool.submit(worker.load_next, 0, 60)
            result = client.push_step(0, sd, wait="loaded", timeout=60)
            assert loading.result().ok and result.loads[0]["ok"]
        assert any(ro for _, ro in fake.registered.values())  # the engine's read-only page-lock
        expected = ReferenceEngine.from_config(hf, expert_format="block_fp8")
        expected.load(convert(sd, SPEC))
        inputs = sample_inputs(engine.vocab_size)
        assert torch.equal(engine.forward(inputs), expected.forward(inputs))
        worker.detach()
    finally:
        d.close()


def test_gpus_the_daemon_cannot_see_are_refused_at_start(tmp_path, fake):
    """`gpus` names what the daemon may use: an index or a UUID this process does not see is a
    configuration error (INVALID: exit 78) before anything is allocated."""
    from sidecar.daemon.setup import make_arenas
    from sidecar.errors import ErrorKind, RefitError

    for gpus, message in (
        ("0,3", "cuda:3 does not exist: this process sees 1 GPU"),
        ("GPU-feed", "cannot see"),
    ):
        config = DaemonConfig(
            runtime_dir=tmp_path, arena="cuda", gpus=gpus, publish_bytes="1MiB", staging_bytes="1MiB"
        )
        with pytest.raises(RefitError, match=message) as err:
            make_arenas("refitd-test-gpus", config, None)
        assert err.value.kind is ErrorKind.INVALID and f"gpus = {list(config.gpus)}" in str(err.value)
    assert fake.allocations == []
    config = DaemonConfig(
        runtime_dir=tmp_path,
        arena="cuda",
        gpus=f"0,{fake.uuids[0]}",
        publish_bytes="1MiB",
        staging_bytes="1MiB",
    )
    arenas = make_arenas("refitd-test-gpus", config, None)
    try:
        assert arenas.staging.device == 0 and arenas.gen_kind is Kind.SHM
    finally:
        arenas.close()
