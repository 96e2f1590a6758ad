"""Issue 34: what a first run on a GPU would break, found by reading CUDA's rules, each checked
against ``support.fake_cuda.FakeCuda``, the driver fake that enforces the rule in question (a
process sees only its visible GPUs but may map another's memory over IPC; contexts are counted per
process and GPU; a kernel fault is sticky; freed exported memory is poisoned and handed to the next
cudaMalloc; READ_ONLY registration may be unsupported; lanes run on threads). Every test here fails
on the code before the fix. ``bench/gpu_run.sh`` confirms or clears the same seven on a real GPU.
"""

from __future__ import annotations

import gc
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from support.daemons import RunningDaemon
from support.fake_cuda import FakeCuda

import transport.cuda_ipc
from adapters.base import RefitReader
from sidecar.cli.demo.synthetic import make_hf_config, make_state_dict
from sidecar.client.client import RefitClient
from sidecar.client.local import StagingWriter, pieces_device
from sidecar.client.pieces import Piece
from sidecar.config.settings import ArenaKind
from sidecar.daemon.memory.generations import Arenas
from sidecar.errors import ErrorKind, RefitError
from sidecar.numerics.formats import FP8_DTYPE, Format
from sidecar.numerics.kernels import fourbit_slab, slab
from sidecar.plan.build import RefitPlan, RefitSpec, TensorSpec
from transport.cuda_driver import CudaError, sticky_cuda_error
from transport.cuda_ipc import CudaIpcArena, HostPin
from transport.layout import Layout

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = Layout.build([("w", torch.bfloat16, (3, 5)), ("s", torch.float32, (4,))])
MODEL = dict(num_layers=2, num_experts=4)


@pytest.fixture
def cuda(monkeypatch):
    """``use(driver)``: every CUDA call of this "process" goes to ``driver`` (no NVML)."""
    monkeypatch.setattr(transport.cuda_ipc, "local_gpus", lambda nvml=None: [])

    def use(driver: FakeCuda) -> FakeCuda:
        monkeypatch.setattr(transport.cuda_ipc, "default_driver", lambda required=True: driver)
        return driver

    return use


# --------------------------------------------------------------------------------------------------
# 1. trainer ranks map staging on their own GPU


def test_a_rank_that_sees_only_its_gpu_maps_the_daemons_staging_as_peer_memory(cuda):
    """Slurm --gpus-per-task, Ray actors: the rank sees one GPU (its own, cuda:0 there), the daemon's
    staging lives on another. CUDA maps the allocation through IPC all the same; the writer must not
    look the arena's GPU up among the visible ones (GpuNotVisible before the fix)."""
    daemon = FakeCuda(gpus=2)
    staging = CudaIpcArena.create("refitd-staging", LAYOUT, gpu=0, driver=daemon)
    rank = cuda(daemon.process(visible=[daemon.uuids[1]]))  # CUDA_VISIBLE_DEVICES=1
    writer = StagingWriter(link=None)
    try:
        writer.open(staging.handle())
        assert writer.arena.device == 0 and rank.contexts == {0}  # its own GPU, nothing else
        writer.arena.tensor("w").fill_(2.5)
        assert torch.equal(staging.tensor("w"), torch.full((3, 5), 2.5, dtype=torch.bfloat16))
    finally:
        writer.close()
        gc.collect()
        staging.close()
    assert daemon.violations == []


def test_a_rank_that_sees_every_gpu_makes_no_context_on_the_staging_gpus(cuda):
    """``--gpus`` with every GPU visible: a rank on cuda:1 maps both lanes' staging on cuda:1 (a
    context on each staging GPU costs hundreds of MiB, and its copy would queue on that GPU's
    stream); the pieces' GPU wins over the current device."""
    daemon = FakeCuda(gpus=2)
    lanes = [CudaIpcArena.create(f"refitd-staging-{i}", LAYOUT, gpu=i, driver=daemon) for i in (0, 1)]
    handles = [a.handle() for a in lanes]
    rank = cuda(daemon.process(current=1))
    writer = StagingWriter(link=None)
    try:
        writer.open(handles[0])
        writer.open_lanes(handles, 2)
        assert (writer.arena.device, writer.others[1].device) == (1, 1) and rank.contexts == {1}
        writer.close()
        on_cpu = [Piece("w", torch.zeros(3, 5), (3, 5), (0, 0), True)]
        assert pieces_device(on_cpu) is None  # CPU tensors: no GPU of their own
        other = cuda(daemon.process(current=0))
        writer.device = 1  # the pieces' GPU (push_step sets it): not the current device
        writer.open(handles[0])
        assert writer.arena.device == 1 and other.contexts == {1}
    finally:
        writer.close()
        gc.collect()
        for a in lanes:
            a.close()


# --------------------------------------------------------------------------------------------------
# 2. a sticky CUDA error stops the daemon


def test_sticky_cuda_errors_are_told_from_the_others():
    fake = FakeCuda()
    fake.fault()
    with pytest.raises(CudaError) as raised:
        fake.malloc(0, 1 << 20)
    assert sticky_cuda_error(raised.value)
    assert sticky_cuda_error(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert sticky_cuda_error(RuntimeError("Triton Error [CUDA]: unspecified launch failure"))
    try:
        try:
            raise RuntimeError("CUDA error: misaligned address")
        except RuntimeError as inner:
            raise ValueError("unit 3 failed") from inner
    except ValueError as outer:
        assert sticky_cuda_error(outer)  # through the chain
    for benign in (
        RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        CudaError("cudaMalloc failed: cudaErrorMemoryAllocation (out of memory)"),
        ValueError("an illegal memory access was encountered"),  # not CUDA's
        None,
    ):
        assert not sticky_cuda_error(benign)


@pytest.mark.timeout(300)
def test_a_sticky_cuda_error_stops_the_daemon_and_tells_every_peer(tmp_path, cuda, monkeypatch):
    """A kernel faults in the quantization worker: every later CUDA call of the daemon would fail
    (the fake makes it sticky), so the daemon fails the step, tells the rank and the attached
    reader (ERROR, shutdown), and its serve loop ends instead of turning (and feeding the systemd
    watchdog) forever; ``refitd serve`` then exits 1 (``fatal`` set)."""
    import sidecar.daemon.worker as worker

    fake = cuda(FakeCuda())

    def faulting(*args, **kwargs):
        fake.fault()
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(worker, "run_unit", faulting)
    hf = make_hf_config("qwen3_5_moe", **MODEL)
    d = RunningDaemon(
        tmp_path, hf_config=hf, arena=ArenaKind.CUDA_IPC, world_size=1, max_frame_bytes=256 << 10
    )
    try:
        with RefitReader(d.endpoint, name="engine") as reader:
            reader.attach(timeout=30)
            with (
                RefitClient(d.endpoint, 0, 1, local=False, timeout=60) as client,
                pytest.raises(RefitError) as failed,
            ):
                client.push_step(0, make_state_dict("qwen3_5_moe", seed=0, **MODEL))
            assert failed.value.kind is ErrorKind.SHUTDOWN and "sticky CUDA error" in str(failed.value)
            d.thread.join(30)
            assert not d.thread.is_alive(), "the serve loop still turns after a sticky CUDA error"
            assert d.daemon.fatal is not None and "illegal memory access" in d.daemon.fatal
            told, deadline = None, time.monotonic() + 10
            while told is None and time.monotonic() < deadline:  # poll() gives None for a PONG
                told = reader.poll(1)
            assert told is not None and told.get("kind") == ErrorKind.SHUTDOWN.value
    finally:
        d.close()


def test_serve_exits_1_after_a_sticky_cuda_error(tmp_path, monkeypatch):
    """``refitd serve`` whose loop stopped on a sticky CUDA error exits 1 (Restart=on-failure,
    Slurm and Ray restart a failed process; a clean 0 would leave the node without a daemon)."""
    import json

    from sidecar.cli.main import main
    from sidecar.daemon.loop import Daemon

    def wedged(self, poll=None):
        self.fatal = "sticky CUDA error: CudaError: cudaErrorIllegalAddress"

    monkeypatch.setattr(Daemon, "serve_forever", wedged)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(make_hf_config("qwen3_5_moe", **MODEL)))
    argv = ["serve", "--hf-config", str(config), "--runtime-dir", str(tmp_path / "run"), "--world-size", "1"]
    assert main(argv) == 1


# --------------------------------------------------------------------------------------------------
# 3. staging of a failed step is never freed under an importer


def test_staging_of_a_failed_step_is_never_freed_while_a_rank_maps_it(cuda):
    """A rank of a failed step still maps staging. Freeing it (cudaFree before the importer's
    cudaIpcCloseMemHandle) is undefined behaviour, and the next cudaMalloc of the same size may
    return the same memory: the rank's late write would land in the new staging. It is kept
    (quarantined) instead, and the lane's next retirement swaps the two back: no more allocations."""
    daemon = cuda(FakeCuda())
    specs = [TensorSpec(f"t.{i}.weight", torch.bfloat16, (8, 4)) for i in range(3)]
    plan = RefitPlan.build(specs, RefitSpec(model_type="qwen3_moe", fmt="bf16"))
    arenas = Arenas.for_plan("refitd-t34", plan, kind=ArenaKind.CUDA_IPC, gpu=0)
    rank = daemon.process()
    try:
        old = arenas.staging
        mapped = CudaIpcArena.open(old.handle(), writable=True, driver=rank)  # the rank's mapping
        arenas.staging_tainted = True
        arenas.retire_staging()
        gc.collect()  # nothing of the daemon's keeps the old arena's memory alive now
        fresh = arenas.staging
        assert daemon.violations == []
        mapped.tensor("t.1.weight").fill_(7.0)  # the rank's late copy
        for name in ("t.0.weight", "t.1.weight", "t.2.weight"):
            assert not fresh.tensor(name).view(torch.uint8).any(), f"{name}: a late write reached staging"

        mallocs = daemon.calls["malloc"]
        arenas.staging_tainted = True  # a second failed step: the first staging comes back, zeroed
        arenas.retire_staging()
        assert arenas.staging is old and daemon.calls["malloc"] == mallocs
        assert not old.tensor("t.1.weight").view(torch.uint8).any()
        assert arenas.quarantine == {0: fresh}
        mapped.close()
        del mapped
        gc.collect()
    finally:
        arenas.close()
        gc.collect()
    assert daemon.violations == []


# --------------------------------------------------------------------------------------------------
# 4. READ_ONLY host registration unsupported


def _reader_loads(tmp_path, fake: FakeCuda, caplog) -> tuple[list[bool], RefitReader]:
    hf = make_hf_config("qwen3_5_moe", **MODEL)
    pinned = []
    with RunningDaemon(tmp_path, hf_config=hf, world_size=1) as d:  # shm arenas, host generations
        sd = make_state_dict("qwen3_5_moe", seed=3, **MODEL)
        with RefitClient(d.endpoint, 0, 1, timeout=60) as client:
            for step in range(2):
                client.push_step(step, sd)
                with RefitReader(d.endpoint, name="engine", pin=True) as reader:
                    for _ in range(2):
                        gen = reader.wait(min_step=step, timeout=60)
                        assert reader.wait_pinned(30)
                        pinned.append(gen.pinned)
                        reader.release(gen)
    return pinned, reader


def test_a_reader_pins_without_read_only_where_the_driver_refuses_it(tmp_path, cuda, caplog):
    """A driver without READ_ONLY registration (cudaErrorNotSupported) on a platform that maps
    pageable memory through the host's page tables (Grace, HMM): the read-only mapping is
    registered without the flag, and engines copy by DMA (before: pageable, with a warning)."""
    fake = cuda(FakeCuda(read_only_register=False, pageable_host_page_tables=True))
    pinned, reader = _reader_loads(tmp_path, fake, caplog)
    assert pinned[1] and pinned[3] and reader.pin_failure is None
    assert [ro for _, _, ro in fake.registrations] == [False, False] and fake.registered == {}
    assert fake.calls["host_register"] == 4  # each reader: READ_ONLY (refused), then plain


def test_a_reader_that_cannot_pin_says_why_once(tmp_path, cuda, caplog):
    """x86 without HMM: neither registration works on a read-only mapping; the copies stay pageable,
    the reason names the device attribute, and it is logged once per reader, not per generation."""
    fake = cuda(FakeCuda(read_only_register=False))
    with caplog.at_level(logging.WARNING, logger="refitd.reader"):
        pinned, reader = _reader_loads(tmp_path, fake, caplog)
    assert not any(pinned) and fake.registered == {}
    assert "READ_ONLY_HOST_REGISTER_SUPPORTED" in (reader.pin_failure or "")
    warned = [r for r in caplog.records if "could not page-lock" in r.getMessage()]
    assert len(warned) == 2  # one per reader (two readers here), not one per generation


# --------------------------------------------------------------------------------------------------
# 5. the kernels' caches under the per-GPU threads


def _outs(experts: int, fmt: Format) -> list:
    shape = (16, 64)
    return [
        [(torch.empty(shape, dtype=FP8_DTYPE), torch.empty(fmt.scale_shape(shape), dtype=fmt.scale_dtype))]
        for _ in range(experts)
    ]


@pytest.mark.parametrize("cache", ["slab", "fourbit"])
def test_a_cache_lookup_racing_an_eviction_on_another_gpus_thread(monkeypatch, cache):
    """Thread A finds its entry; before it moves it to the end, thread B (another GPU's worker)
    inserts one and evicts A's. Unlocked, A's ``move_to_end`` raised KeyError. The interleaving is
    forced: the entry's identity check lets B run (and waits for it, at most a few seconds)."""
    fmt = Format.MXFP8
    x = torch.zeros(2, 16, 64, dtype=torch.bfloat16)
    mine, theirs = _outs(2, fmt), _outs(2, fmt)
    if cache == "slab":
        names = slab.default_names(2, 1)

        def lookup(outs):
            return slab.prepare_outputs(x, fmt, outs, lambda: names)

        entry_type, module = slab.PreparedOutputs, slab
    else:

        def lookup(outs):
            return fourbit_slab._pointer_tables(x, fmt, outs)

        entry_type, module = fourbit_slab._Tables, fourbit_slab
    for attr in ("PREPARED_CACHE_SIZE", "TABLES_CACHE_SIZE"):  # the old module-level sizes
        monkeypatch.setattr(module, attr, 1, raising=False)
    lru = getattr(module, "_prepared" if cache == "slab" else "_tables")
    if hasattr(lru, "capacity"):
        monkeypatch.setattr(lru, "capacity", 1)
    lru.clear()
    first = lookup(mine)
    errors: list[BaseException] = []
    same = entry_type.same
    racing = threading.Event()

    def other_gpu():
        try:
            lookup(theirs)  # a new entry: evicts ``mine`` (capacity 1)
        except BaseException as exc:
            errors.append(exc)

    def same_then_race(self, tensors):
        if not racing.is_set():
            racing.set()
            t = threading.Thread(target=other_gpu)
            t.start()
            t.join(3)  # locked: B waits for A's lookup to end, so this times out
        return same(self, tensors)

    monkeypatch.setattr(entry_type, "same", same_then_race)
    try:
        again = lookup(mine)
    except KeyError as exc:
        pytest.fail(f"a lookup racing an eviction raised KeyError: {exc!r}")
    finally:
        lru.clear()
    assert again is first and errors == []


def test_the_caches_hold_every_output_set_of_a_deepseek_plan_on_eight_gpus():
    """DeepSeek-V3: 58 MoE layers x 2 slabs x 2 generations per GPU; a cache smaller than that
    rebuilds (and host-syncs) a pointer table on every launch."""
    needed = 58 * 2 * 2 * 8
    sizes = [
        getattr(slab, "PREPARED_CACHE_SIZE", None) or slab._prepared.capacity,  # before the fix: 512
        getattr(fourbit_slab, "TABLES_CACHE_SIZE", None) or fourbit_slab._tables.capacity,
    ]
    assert min(sizes) >= needed, sizes


# --------------------------------------------------------------------------------------------------
# 6. unpin and unmap wait for every lane


def test_unpinning_waits_for_every_gpus_copies_not_only_the_first(cuda):
    """Two lanes: a D2H copy on cuda:1 is still in flight when the pin (made on cuda:0) is released
    from a finalizer. cudaHostUnregister under it is a violation; every GPU with a context is
    synchronized first (before: cuda:0 only)."""
    fake = cuda(FakeCuda(gpus=2))
    host = torch.zeros(1 << 16, dtype=torch.uint8)
    pin = HostPin(fake, 0, host.data_ptr(), host.nbytes, read_only=False)
    copying, done = threading.Event(), threading.Event()

    def lane1_copy():
        copying.set()
        done.wait(5)  # the copy takes a while
        host.fill_(1)

    fake.launch(1, lane1_copy)
    assert copying.wait(5)
    releaser = threading.Thread(target=pin.release)  # a GC finalizer, on whatever thread
    releaser.start()
    releaser.join(0.5)
    done.set()
    releaser.join(10)
    assert fake.violations == [] and fake.registered == {}
    assert bool(host.eq(1).all())


# --------------------------------------------------------------------------------------------------
# 7. page-locking host generations off the READY path


@pytest.mark.timeout(300)
def test_the_daemon_is_ready_before_its_host_generations_are_page_locked(tmp_path, cuda):
    """Page-locking 2 x 331 GiB takes minutes: the daemon must reach READY (serve, take steps)
    without waiting for it. The fake holds every cudaHostRegister until the test lets it go; the
    daemon starts, a step publishes, and only then are the generations pinned."""
    fake = cuda(FakeCuda())
    fake.register_gate = threading.Event()
    hf = make_hf_config("qwen3_5_moe", **MODEL)
    started: list[RunningDaemon] = []
    starting = threading.Thread(
        target=lambda: started.append(
            RunningDaemon(
                tmp_path, hf_config=hf, arena=ArenaKind.CUDA_IPC, world_size=1, max_frame_bytes=256 << 10
            )
        )
    )
    starting.start()
    starting.join(60)
    ready = bool(started)
    if not ready:  # the fix is missing: let the start finish, then fail
        fake.register_gate.set()
        starting.join(120)
    d = started[0]
    try:
        assert ready, "the daemon waited for page-locking before READY"
        with RefitClient(d.endpoint, 0, 1, local=False, timeout=120) as client:
            client.push_step(0, make_state_dict("qwen3_5_moe", seed=0, **MODEL))
        assert fake.registered == {}  # still pinning: the step ran on pageable memory
        fake.register_gate.set()
        assert d.daemon.arenas.pinning.wait(30) and len(d.daemon.arenas.pins) == 2
        assert d.status()["tiers"]["pinned_bytes"] == sum(p.nbytes for p in d.daemon.arenas.pins)
    finally:
        fake.register_gate.set()
        d.close()
    assert fake.registered == {}


@pytest.mark.timeout(300)
def test_an_engine_workers_first_load_does_not_wait_for_its_page_lock(tmp_path, cuda):
    """Each engine TP worker page-locks the generations it maps (2 x 331 GiB for DeepSeek-V3): its
    first load must not wait for that. The fake holds cudaHostRegister; the reader hands the
    generation out (unpinned, copies pageable), and it is pinned once the registration completes."""
    fake = cuda(FakeCuda())
    hf = make_hf_config("qwen3_5_moe", **MODEL)
    with RunningDaemon(tmp_path, hf_config=hf, world_size=1) as d:  # shm arenas: nothing pinned by the daemon
        with RefitClient(d.endpoint, 0, 1, timeout=60) as client:
            client.push_step(0, make_state_dict("qwen3_5_moe", seed=0, **MODEL))
        fake.register_gate = threading.Event()
        got: list = []
        with RefitReader(d.endpoint, name="tp-worker-3", pin=True) as reader:
            loading = threading.Thread(target=lambda: got.append(reader.wait(min_step=0, timeout=60)))
            loading.start()
            loading.join(30)
            handed_out = bool(got)
            fake.register_gate.set()
            loading.join(90)
            assert handed_out, "the first load waited for the page-lock"
            assert not got[0].pinned and reader.wait_pinned(30) and len(fake.registered) == 1
            reader.release(got[0])
    assert fake.registered == {}


# --------------------------------------------------------------------------------------------------
# bench/gpu_run.sh's first-contact section, without a GPU


@pytest.mark.timeout(300)
def test_gpu_run_dry_run_prepares_every_first_contact_check():
    """``bash bench/gpu_run.sh --dry-run`` runs each first-contact check up to its first call that
    needs a GPU, one line per check, and exits 0: the first lent device runs them for real."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    run = subprocess.run(
        ["bash", "bench/gpu_run.sh", "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    lines = [line for line in run.stdout.splitlines() if line.startswith("first-contact ")]
    names = [
        "ipc-own-gpu",
        "sticky-fault",
        "free-under-import",
        "read-only-pin",
        "lru-threads",
        "unpin-lanes",
        "startup-pin",
    ]
    assert [line.split(":")[0] for line in lines] == [
        f"first-contact {n} {name}" for n, name in enumerate(names, 1)
    ]
    assert all(": DRY-RUN - prepared; stops before " in line for line in lines), lines
