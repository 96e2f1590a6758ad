"""First contact with a GPU (issue 34): confirm or clear, on a real GPU in a few minutes, each of the
seven things CUDA's rules said would break, and check each fix. One line per check::

    first-contact 1 ipc-own-gpu: PASS - ...

    python3 bench/first_contact.py [--out bench/results/first-contact.json] [--only 2 4]
    python3 bench/first_contact.py --dry-run   # no GPU: each check up to its first call that needs one

Verdicts: PASS (the fix holds on this GPU), FAIL (it does not: the line says what CUDA did),
SKIP (this machine cannot show it, e.g. one GPU), ERROR (the check itself broke), DRY-RUN.

1. ipc-own-gpu: a child process that sees one GPU (CUDA_VISIBLE_DEVICES=<its UUID>) maps the
   staging a "daemon" allocated on another GPU as the fixed StagingWriter does (on its own device),
   writes it, and nvidia-smi lists the child on its own GPU only. One GPU: same-GPU IPC only.
2. sticky-fault: a child launches a Triton kernel that stores out of bounds; every later CUDA call
   must fail, and ``sticky_cuda_error`` must recognise each error (the daemon's exit path).
3. free-under-import: what the old retire did: cudaFree while a child maps the memory, a cudaMalloc
   of the same size, then the child's late write; says whether it reached the new allocation.
4. read-only-pin: the READ_ONLY / pageable-page-table attributes, how ``pin_read_only`` pinned a
   read-only mapping, and H2D GB/s from it pinned vs pageable vs a pinned bounce buffer.
5. lru-threads: two threads prepare launches on the GPU through a small cache (no KeyError), and a
   DeepSeek-size set of output sets is prepared once (a second pass rebuilds no pointer table).
6. unpin-lanes: a D2H copy on cuda:1 into memory pinned on cuda:0, released at once: the copy must
   land whole (needs two GPUs; on one, ``active_devices`` is checked).
7. startup-pin: cudaHostRegister GiB/s, extrapolated to 2 x 331 GiB against TimeoutStartSec=300
   (what READY waited for before the fix; READY not waiting is tested against the fake driver).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MiB, GiB = 1 << 20, 1 << 30

from first_contact_children import Child, _handle, _wire  # noqa: E402 (bench/ is this script's folder)


class DryRunStop(Exception):
    """--dry-run: the check reached its first call that needs a GPU."""


class Gate:
    """``gpu(what)`` before a check's first call that needs a GPU; ``host_bytes`` sizes its host
    buffers (small in a dry run: the CPU machine only shows the preparation works)."""

    def __init__(self, dry: bool):
        self.dry = dry

    def host_bytes(self, nbytes: int) -> int:
        return 16 * MiB if self.dry else nbytes

    def gpu(self, what: str) -> None:
        if self.dry:
            raise DryRunStop(what)


CHECKS: list[tuple[int, str, object]] = []


def check(number: int, name: str):
    def register(fn):
        CHECKS.append((number, name, fn))
        return fn

    return register


# --------------------------------------------------------------------------------------------------
# the checks


def nvidia_smi_apps() -> list[tuple[str, str]] | None:
    """(pid, gpu uuid) of every compute process nvidia-smi lists; None without nvidia-smi."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return [tuple(x.strip() for x in line.split(",")[:2]) for line in out.splitlines() if "," in line]


@check(1, "ipc-own-gpu")
def ipc_own_gpu(gate: Gate):
    import torch

    from transport.cuda_ipc import CudaIpcArena
    from transport.layout import Layout

    layout = Layout.build([("w", torch.float32, (1024,))])
    probe = {"ipc_handle": bytes(range(64)), "layout": layout.to_wire(), "kind": "cuda_ipc"}
    if _handle(_wire(probe)) != probe:  # the handle reaches the child as it left
        return "ERROR", "the handle does not survive its trip to the child"
    gate.gpu("default_driver() (cudaGetDeviceCount) and cudaMalloc of the daemon's staging")
    from transport.cuda_driver import default_driver

    uuids = default_driver().visible_uuids()
    staging = CudaIpcArena.create("refitd-first-contact", layout, gpu=len(uuids) - 1)
    staging.tensor("w").zero_()
    child = Child("map_staging", {"handle": _wire(staging.handle())}, env={"CUDA_VISIBLE_DEVICES": uuids[0]})
    got = child.report()
    apps = nvidia_smi_apps() if "error" not in got else None
    child.tell("exit")
    child.finish()
    if "error" in got:
        return "FAIL", f"a rank seeing only {uuids[0]} could not map staging on {uuids[-1]}: {got['error']}"
    written = bool(torch.all(staging.tensor("w") == 3.0))
    where = sorted({u for pid, u in apps or [] if pid == str(got["pid"])})
    contexts = (
        f"nvidia-smi lists the child on {where}" if where else "nvidia-smi lists no child (pid namespace?)"
    )
    hidden = (
        "another GPU, hidden from it"
        if len(uuids) > 1
        else "the same GPU (one GPU: the hidden case is SKIPPED)"
    )
    verdict = "PASS" if written and len(where) <= 1 else "FAIL"
    return (
        verdict,
        f"mapped staging of {hidden} on its cuda:{got['device']}, write landed={written}; {contexts}",
    )


@check(2, "sticky-fault")
def sticky_fault(gate: Gate):
    ping = Child("ping", {"n": 1}, env={"CUDA_VISIBLE_DEVICES": "0"})  # the children's plumbing
    got = ping.report()
    if ping.finish() != 0 or got.get("args") != {"n": 1} or got.get("visible") != "0":
        return "ERROR", f"a child process does not answer as expected: {got}"
    gate.gpu("a child launching an out-of-bounds Triton store")
    got = Child("fault", {}).report()
    if "error" in got:
        return "ERROR", got["error"]
    kernel, later = got["kernel"], [got["torch after"], got["cudaMalloc after"]]
    if not kernel["failed"]:
        return "ERROR", "the out-of-bounds store did not fault"
    if not all(c["failed"] for c in later):
        return "FAIL", f"not sticky here: later calls {later} (defect 2's premise cleared)"
    missed = [c["error"] for c in [kernel, *later] if not c["sticky"]]
    if missed:
        return "FAIL", f"sticky_cuda_error misses: {missed} (extend STICKY_CUDA_ERRORS)"
    return (
        "PASS",
        f"sticky as CUDA says ({kernel['error'][:120]}); every error recognised: the daemon exits 1",
    )


@check(3, "free-under-import")
def free_under_import(gate: Gate):
    nbytes = 2 * MiB
    gate.gpu("cudaMalloc + cudaIpcGetMemHandle")
    import torch

    from transport.cuda_driver import default_driver

    driver = default_driver()
    ptr = driver.malloc(0, nbytes)
    driver.memset(0, ptr, 0, nbytes)
    child = Child("late_write", {"ipc": driver.ipc_get_handle(0, ptr).hex(), "nbytes": nbytes})
    if "error" in (got := child.report()):
        return "ERROR", got["error"]
    driver.free(0, ptr)  # the old retire_staging: freed under the importer's mapping
    again = driver.malloc(0, nbytes)
    driver.memset(0, again, 0, nbytes)
    child.tell("write")
    wrote = child.report()
    torch.cuda.synchronize()
    leaked = int((driver.tensor(again, nbytes, 0, None) == 0x5A).sum())
    child.tell("exit")
    child.finish()
    driver.free(0, again)
    same = "the same address" if again == ptr else "another address"
    if leaked:
        return (
            "PASS",
            f"CONFIRMED: a late write through the freed mapping reached the new allocation ({same}, {leaked} B); staging is now quarantined",
        )
    return (
        "PASS",
        f"not observed here (new allocation at {same}; child wrote={wrote.get('wrote')}); still undefined behaviour, quarantined",
    )


@check(4, "read-only-pin")
def read_only_pin(gate: Gate):
    import torch

    from transport.layout import Layout
    from transport.shm import ShmArena, open_arena

    nbytes = gate.host_bytes(1 * GiB)
    writer = ShmArena.create("refitd-first-contact-ro", Layout.build([("b", torch.uint8, (nbytes,))]))
    writer.tensor("b").fill_(7)
    reader = open_arena(writer.handle(), writable=False)
    try:
        gate.gpu("cudaDeviceGetAttribute(cudaDevAttrReadOnlyHostRegisterSupported)")
        from transport.cuda_driver import _import_cudart, default_driver
        from transport.host_pins import pin_read_only

        cudart, _ = _import_cudart()
        attrs = {}
        for name in (
            "ReadOnlyHostRegisterSupported",
            "PageableMemoryAccessUsesHostPageTables",
            "HostRegisterSupported",
        ):
            attr = getattr(cudart.cudaDeviceAttr, f"cudaDevAttr{name}", None)
            attrs[name] = None if attr is None else int(cudart.cudaDeviceGetAttribute(attr, 0)[1])
        src = reader.tensor("b")
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        pageable = _gbps(lambda: dst.copy_(src), nbytes)
        driver = default_driver()
        pin, why = pin_read_only(reader, driver=driver, device=0)
        pinned = _gbps(lambda: dst.copy_(src, non_blocking=True), nbytes) if pin is not None else None
        how = "none" if pin is None else ("READ_ONLY" if pin.read_only else "plain (no READ_ONLY)")
        if pin is not None:
            pin.release()
        bounce = _bounce_gbps(src, dst)
        ok = bool(torch.all(dst[: 1 << 20] == 7))
    finally:
        reader.close()
        writer.close()
        writer.unlink()
    rates = f"H2D pinned {pinned or 0:.1f} GB/s, pageable {pageable:.1f} GB/s, 64 MiB pinned bounce {bounce:.1f} GB/s"
    verdict = "PASS" if pin is not None and ok else "FAIL"
    return verdict, f"attributes {attrs}; pinned: {how}{'' if why is None else f' ({why[:160]})'}; {rates}"


def _gbps(copy, nbytes: int, reps: int = 3) -> float:
    import torch

    copy()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        copy()
    torch.cuda.synchronize()
    return nbytes * reps / (time.perf_counter() - t0) / 1e9


def _bounce_gbps(src, dst, chunk: int = 64 * MiB) -> float:
    """Host -> pinned bounce (two, alternating) -> GPU, chunk by chunk: what a bounce fallback gets."""
    import torch

    bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    events = [torch.cuda.Event(), torch.cuda.Event()]

    def copy():
        for k, start in enumerate(range(0, src.numel(), chunk)):
            n = min(chunk, src.numel() - start)
            buf, event = bufs[k % 2], events[k % 2]
            event.synchronize()
            buf[:n].copy_(src[start : start + n])
            dst[start : start + n].copy_(buf[:n], non_blocking=True)
            event.record()

    return _gbps(copy, src.numel(), reps=2)


@check(5, "lru-threads")
def lru_threads(gate: Gate):
    import torch

    from sidecar.numerics.formats import FP8_DTYPE, Format
    from sidecar.numerics.kernels import slab

    fmt, shape = Format.BLOCK_FP8, (128, 128)
    gate.gpu("output tensors on cuda:0")

    def outs():
        q = torch.empty(shape, dtype=FP8_DTYPE, device="cuda")
        return [[(q, torch.empty(fmt.scale_shape(shape), dtype=fmt.scale_dtype, device="cuda"))]]

    x = torch.zeros(1, *shape, dtype=torch.bfloat16, device="cuda")
    names = slab.default_names(1, 1)
    sets = [outs() for _ in range(58 * 2 * 2 * 8)]  # DeepSeek-V3 on 8 lanes: 1,856 output sets
    errors: list[str] = []
    capacity, slab._prepared.capacity = slab._prepared.capacity, 8

    def hammer(mine):
        try:
            for i in range(2000):
                slab.prepare_outputs(x, fmt, mine[i % len(mine)], lambda: names)
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=hammer, args=(sets[k::2][:16],)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    slab._prepared.capacity = capacity
    slab._prepared.clear()
    built = [0]
    table = slab.pointer_table

    def counted(*a, **k):
        built[0] += 1
        return table(*a, **k)

    slab.pointer_table = counted
    try:
        for _ in range(2):
            first = built[0]
            for s in sets:
                slab.prepare_outputs(x, fmt, s, lambda: names)
    finally:
        slab.pointer_table = table
    rebuilt = built[0] - first
    verdict = "PASS" if not errors and rebuilt == 0 else "FAIL"
    return (
        verdict,
        f"racing threads: {errors[:1] or 'no error'}; second pass over {len(sets)} output sets rebuilt {rebuilt} tables",
    )


@check(6, "unpin-lanes")
def unpin_lanes(gate: Gate):
    import torch

    gate.gpu("torch.cuda.device_count()")
    from transport.cuda_driver import default_driver
    from transport.cuda_ipc import HostPin

    driver = default_driver()
    if torch.cuda.device_count() < 2:
        torch.zeros(1, device="cuda:0")
        return "SKIP", f"one GPU; active_devices() = {driver.active_devices()} (a context on cuda:0 only)"
    n = 512 * MiB
    host = torch.empty(n, dtype=torch.uint8)
    pin = HostPin(driver, 0, host.data_ptr(), n, read_only=False)
    src = torch.full((n,), 0x33, dtype=torch.uint8, device="cuda:1")
    with torch.cuda.device(1):
        host.copy_(src, non_blocking=True)  # on cuda:1's stream, into memory pinned on cuda:0
    pin.release()  # at once, as a finalizer might: must wait for cuda:1
    whole = bool(torch.all(host == 0x33))
    return (
        "PASS" if whole else "FAIL"
    ), f"the cuda:1 copy landed whole={whole}; active_devices() = {driver.active_devices()}"


@check(7, "startup-pin")
def startup_pin(gate: Gate):
    import torch

    from transport.layout import Layout
    from transport.shm import ShmArena

    nbytes = gate.host_bytes(4 * GiB)
    arena = ShmArena.create("refitd-first-contact-pin", Layout.build([("b", torch.uint8, (nbytes,))]))
    arena.tensor("b").fill_(1)  # the pages exist, as a daemon's generations do
    try:
        gate.gpu(f"cudaHostRegister of a {nbytes / GiB:g} GiB host generation")
        from transport.cuda_driver import default_driver
        from transport.cuda_ipc import pin_shm_arena

        driver = default_driver()
        t0 = time.perf_counter()
        pin = pin_shm_arena(arena, driver=driver, device=0, read_only=False)
        seconds = time.perf_counter() - t0
        pin.release()
    finally:
        arena.close()
        arena.unlink()
    rate = nbytes / GiB / seconds
    whole = 662 / rate
    return "PASS", (
        f"cudaHostRegister {rate:.1f} GiB/s: 2 x 331 GiB would take {whole:.0f} s before READY "
        f"({'CONFIRMED' if whole > 150 else 'cleared'} against TimeoutStartSec=300); now on a thread after READY"
    )


# --------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dry-run", action="store_true", help="no GPU: run each check up to its first GPU call"
    )
    parser.add_argument("--only", type=int, nargs="*", help="check numbers to run (default: all)")
    parser.add_argument("--out", type=Path, help="write the lines as JSON too")
    args = parser.parse_args(argv)
    gate, results, bad = Gate(args.dry_run), [], 0
    for number, name, fn in CHECKS:
        if args.only and number not in args.only:
            continue
        t0 = time.monotonic()
        try:
            verdict, detail = fn(gate)
        except DryRunStop as stop:
            verdict, detail = "DRY-RUN", f"prepared; stops before {stop}"
        except Exception as exc:
            verdict, detail = "ERROR", f"{type(exc).__name__}: {exc}"[:400]
        bad += verdict in ("FAIL", "ERROR")
        print(
            f"first-contact {number} {name}: {verdict} - {detail} ({time.monotonic() - t0:.1f} s)", flush=True
        )
        results.append({"check": number, "name": name, "verdict": verdict, "detail": detail})
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
