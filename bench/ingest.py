"""Ingest throughput of a real ``refitd serve``: local (shm) and remote (ZeroMQ) trainer pushes.

Baselines, measured in the same run on the same bytes (one flat BF16 buffer; the step's tensors are
views into it, so every row moves exactly the same memory):
  memcpy   ``dst.copy_(src)`` into a preallocated tensor; the same into a POSIX shm mapping
           (``transport.shm.ShmSegment``); and tensor by tensor into a shm arena carved like the
           daemon's staging arena -- the data movement of the local path with no protocol around it.
  raw zmq  DEALER -> ROUTER between two processes, over ipc:// and tcp://127.0.0.1, in frames of the
           sizes the client sends (one per tensor, split at max_frame_bytes), the receiver writing
           into a preallocated buffer with ``recv_into`` (and with ``recv(copy=False)`` + ``copy_``,
           which is what the daemon does) -- no credits, no headers: the ceiling of the remote path.
refitd (a daemon subprocess per configuration, ``--format bf16`` so quantization does not hide the
transport): ``RefitClient(local=True)`` and ``local=False`` over ipc:// and tcp://; "committed" is
push_step until the daemon holds every byte (ingest), "published" until the generation is live.
Then one ``--format block_fp8`` step end to end, and the per-step overhead of a step of 10,000
small tensors against a step of one tensor of the same total bytes.
Staging ring (``--staging-regions N``): the same step, local client to "published", ``--format bf16``
and ``block_fp8``, on whole-step staging (``--staging-regions 0``) and on rings of 1, 2 and 4 regions
of the largest layer group; each against the whole-step row of its format in time and in the staging
arena's bytes (the daemon's status); plus a remote (ipc://) bf16 pair, whole step against ring 2.
The four daemons of a format run side by side and take their steps in turns, so that load from
elsewhere on the machine falls on every row alike; the best step is reported beside the median.

    python bench/ingest.py [--mib 256] [--repeat 5] [--skip-tcp] [--ring] [--json PATH]

``--ring`` runs only the staging-ring section.

Medians over ``--repeat`` steps after warm-up steps (the first touches of fresh shm pages are
reported apart). Sized for a 2-core, 24 GiB machine: the default run takes about a minute and
under 2 GiB of memory (the daemon's three arenas are 3 x --mib of /dev/shm).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import zmq

#: ``python bench/ingest.py`` puts bench/ first on sys.path, where bench/transport.py (the transport
#: benchmark) hides the ``transport`` package; the repository root goes ahead of it.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from adapters.base import RefitReader
from sidecar.cli.demo.synthetic import make_hf_config
from sidecar.client.client import RefitClient
from sidecar.client.pieces import blocks
from sidecar.errors import RefitError
from sidecar.plan.models import get_model
from transport.layout import Layout
from transport.shm import ShmArena, ShmSegment

MiB = 1 << 20
HIDDEN, INTER = 1024, 256  # synthetic qwen3_5_moe: each expert adds 6*H*I bytes per layer (+MTP)
LAYERS = 4
MAX_FRAME = 64 * MiB  # the daemon's default max_frame_bytes, hence the client's frame size
SMALL_N, SMALL_NUMEL = 10_000, 64
READY_TIMEOUT_S = 90.0
STEP_TIMEOUT_S = 30.0
#: A second, smaller overhead step: the quantization worker wakes the serve loop with one message per
#: unit on an inproc PUSH whose send HWM is 1000 and raises zmq.Again past it, which kills the worker
#: thread; a local step of 10,000 one-unit tensors overflows it (found by this benchmark). 900 fits.
BELOW_WAKE_HWM = 900
ZMQ_MODES = ("recv_into", "recv_copy", "recv_copy_np")
WARMUP_STEPS = 2  # two publish generations: both get their first touch before timing
#: On one daemon the remote steps run before the local ones. The other way round the daemon dies on
#: the first SHARD: the staging arena's cached views were first made on the quantization worker under
#: torch.inference_mode(), so they are inference tensors, and the serve loop's ``dest.copy_(src)``
#: outside inference mode raises RuntimeError, which no handler catches (found by this benchmark).
REMOTE_FIRST = True
#: Staging-ring section: region counts (0: whole-step staging, the baseline), the formats, and the
#: region counts that also get a remote (ipc://) bf16 row.
RING_REGIONS = (0, 1, 2, 4)
RING_FORMATS = ("bf16", "block_fp8")
RING_REMOTE = (0, 2)


# --------------------------------------------------------------------------------------------------
# the data


def synthetic_config(mib: int) -> dict[str, Any]:
    """A qwen3_5_moe config.json whose BF16 state dict is about ``mib`` MiB (the expert count sets it)."""

    def nbytes(experts: int) -> int:
        cfg = make_hf_config(
            "qwen3_5_moe", num_layers=LAYERS, hidden=HIDDEN, intermediate=INTER, num_experts=experts
        )
        return sum(_numel(s) * d.itemsize for _, s, d in get_model("qwen3_5_moe").parameters(cfg))

    base, per = nbytes(1), nbytes(2) - nbytes(1)
    experts = max(1, round((mib * MiB - base) / per) + 1)
    return make_hf_config(
        "qwen3_5_moe", num_layers=LAYERS, hidden=HIDDEN, intermediate=INTER, num_experts=experts
    )


def state_dict_over(flat: torch.Tensor, params: list[tuple[str, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
    """Views of ``flat``, back to back, one per ``(name, shape)``."""
    out, off = {}, 0
    for name, shape in params:
        n = _numel(shape)
        out[name] = flat[off : off + n].view(shape)
        off += n
    assert off == flat.numel()
    return out


def random_flat(numel: int, seed: int = 0) -> torch.Tensor:
    flat = torch.empty(numel, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(seed)
    chunk = 1 << 24
    for i in range(0, numel, chunk):
        n = min(chunk, numel - i)
        flat[i : i + n] = torch.randn(n, generator=gen, dtype=torch.float32).mul_(0.02)
    return flat


def frames_of(sd: dict[str, torch.Tensor], limit: int = MAX_FRAME) -> list:
    """The data frames ``RefitClient`` sends for ``sd`` on the remote path, as uint8 numpy views."""
    frames = []
    for t in sd.values():
        for rel, shape in blocks(tuple(t.shape), t.element_size(), limit):
            block = t[tuple(slice(o, o + s) for o, s in zip(rel, shape))] if shape else t
            frames.append(block.reshape(-1).view(torch.uint8).numpy())
    return frames


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


# --------------------------------------------------------------------------------------------------
# timing helpers


def timed(fn: Callable[[], object], repeat: int, warmup: int = 1) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------------------
# baselines: memcpy


def memcpy_baselines(flat: torch.Tensor, sd: dict[str, torch.Tensor], repeat: int) -> dict[str, dict]:
    nbytes = flat.numel() * flat.element_size()
    out: dict[str, dict] = {}
    dst = torch.empty_like(flat)
    out["memcpy"] = {"seconds": timed(lambda: dst.copy_(flat), repeat)}

    prefix = f"refitd-bench-{os.getpid()}-{secrets.token_hex(3)}"
    seg = ShmSegment.create(f"{prefix}-flat", nbytes)
    try:
        view = seg.view(0, torch.bfloat16, (flat.numel(),))
        t0 = time.perf_counter()
        view.copy_(flat)  # first touch: tmpfs allocates the pages
        first = time.perf_counter() - t0
        out["memcpy_shm"] = {"seconds": timed(lambda: view.copy_(flat), repeat, warmup=0), "first_s": first}
    finally:
        seg.close()
        seg.unlink()

    layout = Layout.build((n, t.dtype, tuple(t.shape)) for n, t in sd.items())
    arena = ShmArena.create(f"{prefix}-arena", layout)
    try:
        views = arena.tensors()

        def per_tensor() -> None:
            for name, t in sd.items():
                views[name].copy_(t)

        out["memcpy_shm_tensors"] = {"seconds": timed(per_tensor, repeat)}
    finally:
        arena.close()
        arena.unlink()
    for row in out.values():
        row["bytes"] = nbytes
    return out


# --------------------------------------------------------------------------------------------------
# baselines: raw ZeroMQ between two processes


def zmq_receiver(endpoint: str, total: int) -> None:
    """ROUTER: per round, a command {mode, frames}; then that many data frames into one buffer; 'done'.

    Modes: ``recv_into`` (libzmq copies the message into our buffer), ``recv_copy`` (``recv(copy=False)``
    then ``torch`` ``copy_``, with torch's default intra-op threads, as the daemon's serve loop does) and
    ``recv_copy_np`` (the same with a single-threaded ``np.copyto``).
    """
    import msgpack
    import numpy as np

    buf = torch.empty(total, dtype=torch.uint8)
    buf.fill_(0)  # fault the pages in once, as the daemon's staging arena is after its first steps
    npbuf = buf.numpy()
    view = memoryview(npbuf)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.bind(endpoint)
    try:
        while True:
            ident, cmd = sock.recv_multipart()
            req = msgpack.unpackb(cmd)
            if req["mode"] == "stop":
                sock.send_multipart([ident, b"bye"])
                return
            sock.send_multipart([ident, b"go"])
            off = 0
            for _ in range(req["frames"]):
                sock.recv()  # identity
                if req["mode"] == "recv_into":
                    off += sock.recv_into(view[off:])
                else:  # recv_copy is what the daemon does: a zero-copy frame, then torch copy_
                    frame = sock.recv(copy=False)
                    n = len(frame.buffer)
                    if n and req["mode"] == "recv_copy_np":
                        np.copyto(npbuf[off : off + n], np.frombuffer(frame.buffer, dtype=np.uint8))
                    elif n:
                        buf[off : off + n].copy_(torch.frombuffer(frame.buffer, dtype=torch.uint8))
                    off += n
            if off != total:
                raise SystemExit(f"receiver: got {off} bytes, expected {total}")
            sock.send_multipart([ident, b"done"])
    finally:
        sock.close(linger=0)
        ctx.term()


def zmq_baseline(endpoint: str, frames: list, repeat: int, modes: tuple[str, ...]) -> dict[str, dict]:
    import msgpack

    total = sum(f.nbytes for f in frames)
    proc = subprocess.Popen(
        [sys.executable, __file__, "--zmq-receiver", endpoint, "--zmq-total", str(total)],
        cwd=Path(__file__).resolve().parent.parent,
    )
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)

    def expect(what: bytes, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not sock.poll(100):
            if proc.poll() is not None:
                raise RuntimeError(f"zmq receiver exited with {proc.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"zmq receiver: no {what!r} within {timeout_s:.0f} s")
        got = sock.recv()
        if got != what:
            raise RuntimeError(f"zmq receiver said {got!r}, expected {what!r}")

    def one(mode: str) -> float:
        sock.send(msgpack.packb({"mode": mode, "frames": len(frames)}))
        expect(b"go", READY_TIMEOUT_S)
        t0 = time.perf_counter()
        for f in frames:
            sock.send(f, copy=False)
        expect(b"done", 60)
        return time.perf_counter() - t0

    out = {}
    try:
        for mode in modes:
            first = one(mode)  # connection, the receiver's page faults, zmq buffers
            out[mode] = {"seconds": [one(mode) for _ in range(repeat)], "first_s": first, "bytes": total}
        sock.send(msgpack.packb({"mode": "stop"}))
        expect(b"bye", 10)
        proc.wait(timeout=10)
    finally:
        sock.close(linger=0)
        ctx.term()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return out


# --------------------------------------------------------------------------------------------------
# the daemon


class DaemonProc:
    """``python -m sidecar.cli serve`` in a fresh runtime dir; ready once it answers STATUS."""

    def __init__(
        self,
        *args: str,
        tcp_port: int | None = None,
        config: dict | None = None,
        label: str,
        cwd: Path | None = None,
    ):
        """``cwd``: the checkout whose ``sidecar`` runs (``python -m`` imports from there first);
        default this one."""
        self.tmp = Path(tempfile.mkdtemp(prefix="refitd-bench-"))
        self.runtime = self.tmp / "run"
        self.label = label
        argv = [sys.executable, "-m", "sidecar.cli", "serve", "--runtime-dir", str(self.runtime)]
        argv += ["--log-level", "warning", *args]
        if config is not None:
            path = self.tmp / "config.json"
            path.write_text(json.dumps(config))
            argv += ["--hf-config", str(path)]
        if tcp_port is not None:
            self.endpoint = f"tcp://127.0.0.1:{tcp_port}"
            argv += ["--listen", self.endpoint]
        else:
            self.endpoint = f"ipc://{self.runtime}/control.sock"
        self.log = open(self.tmp / "daemon.log", "w+b")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            argv, stdout=self.log, stderr=subprocess.STDOUT, cwd=cwd or Path(__file__).resolve().parent.parent
        )
        self.next_step = 0
        self.startup_s = self._wait_ready()

    def _wait_ready(self) -> float:
        t0 = time.monotonic()
        deadline = t0 + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon {self.label} exited with {self.proc.returncode}:\n{self.tail()}")
            if self.endpoint.startswith("ipc://") and not self.runtime.joinpath("control.sock").exists():
                time.sleep(0.05)
                continue
            reader = RefitReader(self.endpoint, name="bench-status")
            try:
                self.status = reader.status(timeout=1.0)
                return time.monotonic() - t0
            except RefitError:
                pass
            finally:
                reader.close()
        raise RuntimeError(f"daemon {self.label} not ready within {READY_TIMEOUT_S:.0f} s:\n{self.tail()}")

    def tail(self, n: int = 2000) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-n:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> DaemonProc:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def daemon(*args: str, **kw: Any) -> Iterator[DaemonProc]:
    d = DaemonProc(*args, **kw)
    try:
        yield d
    finally:
        d.stop()


def push_steps(d: DaemonProc, sd: dict[str, torch.Tensor], **kw: Any) -> dict:
    """:func:`timed_steps`, or ``{"error": ...}`` (with the daemon's last log lines) if a step fails."""
    try:
        return timed_steps(d, sd, **kw)
    except (RefitError, RuntimeError) as exc:
        print(f"{d.label}: {exc}\n{d.tail()}", file=sys.stderr, flush=True)
        return {"error": str(exc).splitlines()[0], "daemon_log_tail": d.tail()}


def timed_push(d: DaemonProc, client: RefitClient, sd: dict[str, torch.Tensor]) -> tuple[float, float, Any]:
    """One step of ``sd`` on ``d``: (seconds to "committed", seconds to "published", StepResult)."""
    step, d.next_step = d.next_step, d.next_step + 1
    t0 = time.perf_counter()
    future = client.push_step(step, sd, wait="committed")
    t1 = time.perf_counter()
    result = future.result()
    return t1 - t0, time.perf_counter() - t0, result


def timed_steps(d: DaemonProc, sd: dict[str, torch.Tensor], *, local: bool, repeat: int, warmup: int) -> dict:
    """One client, ``warmup + repeat`` steps; each timed to "committed" and to "published"."""
    committed, published, phases, first = [], [], [], []
    endpoint = d.endpoint
    with RefitClient(endpoint, rank=0, world_size=1, local=local, timeout=STEP_TIMEOUT_S) as client:
        for k in range(warmup + repeat):
            if k == warmup:  # CPU time of the timed steps: this process (the client), the daemon's
                cpu0 = (time.process_time(), process_cpu_s(d.proc.pid))
            to_commit, to_publish, result = timed_push(d, client, sd)
            if k < warmup:
                first.append({"committed_s": to_commit, "published_s": to_publish})
                continue
            committed.append(to_commit)
            published.append(to_publish)
            phases.append(result.seconds)
        cpu = (time.process_time() - cpu0[0], process_cpu_s(d.proc.pid) - cpu0[1])
        used_local = bool(client._welcome.get("local"))
    if used_local != local:
        raise RuntimeError(f"asked for local={local}, the daemon granted local={used_local}")
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    daemon_phases = {k: statistics.median(p[k] for p in phases) for k in phases[0]} if phases else {}
    return {
        "bytes": nbytes,
        "tensors": len(sd),
        "committed_s": committed,
        "published_s": published,
        "warmup": first,
        "daemon_phases_median_s": daemon_phases,
        # CPU seconds per timed step: less swayed than wall time by load from elsewhere (nan: no /proc)
        "client_cpu_s": cpu[0] / repeat if repeat else 0.0,
        "daemon_cpu_s": cpu[1] / repeat if repeat else 0.0,
    }


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far, every thread (Linux /proc; else nan)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def step_overhead(n: int, repeat: int, startup: dict) -> dict:
    """A step of ``n`` x [SMALL_NUMEL] bf16 against one tensor of the same bytes, each on its own daemon
    (the plan is fixed by the first step's names). Remote first: see REMOTE_FIRST."""
    small = random_flat(n * SMALL_NUMEL, seed=1)
    many = {f"bench.small.{i}.weight": small[i * SMALL_NUMEL : (i + 1) * SMALL_NUMEL] for i in range(n)}
    one = {"bench.big.weight": small}
    arena = "--staging-bytes", "16MiB", "--publish-bytes", "16MiB"
    out: dict[str, Any] = {"n": n, "bytes": small.numel() * small.element_size()}
    for key, tensors in (("one", one), ("many", many)):
        with daemon(
            "--model-type", "qwen3_moe", "--format", "bf16", *arena, label=f"overhead {n} {key}"
        ) as d:
            startup[f"overhead_{n}_{key}"] = d.startup_s
            out[key] = {
                "remote_ipc": push_steps(d, tensors, local=False, repeat=repeat, warmup=1),
                "local": push_steps(d, tensors, local=True, repeat=repeat, warmup=WARMUP_STEPS),
            }
    return out


def daemon_status(d: DaemonProc) -> dict:
    reader = RefitReader(d.endpoint, name="bench-status")
    try:
        return reader.status(timeout=10.0)
    finally:
        reader.close()


def interleaved_steps(
    daemons: dict[str, DaemonProc], sd: dict[str, torch.Tensor], *, local: bool, repeat: int, warmup: int
) -> dict[str, dict]:
    """:func:`timed_steps` on several daemons at once, one client each: the warm-up steps, then
    ``repeat`` rounds of one timed step per daemon, in an order that rotates every round, so load
    from elsewhere on the machine falls on every row alike. A daemon whose step fails gets
    ``{"error": ...}`` and leaves the rotation."""
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    rows = {
        key: {"bytes": nbytes, "tensors": len(sd), "committed_s": [], "published_s": [], "warmup": []}
        for key in daemons
    }
    phases: dict[str, list[dict]] = {key: [] for key in daemons}
    live = list(daemons)

    def one(key: str, client: RefitClient, timed: bool) -> None:
        to_commit, to_publish, result = timed_push(daemons[key], client, sd)
        if not timed:
            rows[key]["warmup"].append({"committed_s": to_commit, "published_s": to_publish})
            return
        rows[key]["committed_s"].append(to_commit)
        rows[key]["published_s"].append(to_publish)
        rows[key]["movers"] = sorted({*rows[key].get("movers", ()), result.mover})
        phases[key].append(result.seconds)

    with contextlib.ExitStack() as stack:
        clients = {
            key: stack.enter_context(
                RefitClient(d.endpoint, rank=0, world_size=1, local=local, timeout=STEP_TIMEOUT_S)
            )
            for key, d in daemons.items()
        }
        schedule = [(k, False) for k in daemons for _ in range(warmup)]
        for r in range(repeat):
            order = list(daemons)[r % len(daemons) :] + list(daemons)[: r % len(daemons)]
            schedule += [(k, True) for k in order]
        for key, timed in schedule:
            if key not in live:
                continue
            try:
                one(key, clients[key], timed)
            except (RefitError, RuntimeError) as exc:
                d = daemons[key]
                print(f"{d.label}: {exc}\n{d.tail()}", file=sys.stderr, flush=True)
                rows[key] = {"error": str(exc).splitlines()[0], "daemon_log_tail": d.tail()}
                live.remove(key)
        for key in live:
            if bool(clients[key]._welcome.get("local")) != local:
                rows[key] = {"error": f"asked for local={local}, the daemon granted another"}
    for key in live:
        if "error" not in rows[key] and phases[key]:
            rows[key]["daemon_phases_median_s"] = {
                k: statistics.median(p[k] for p in phases[key]) for k in phases[key][0]
            }
    return rows


def ring_section(config: dict, sd: dict[str, torch.Tensor], repeat: int, startup: dict) -> dict:
    """Whole-step staging against staging rings, on one daemon per (format, regions), same step.

    Per format the daemons of every region count run side by side and take their steps in turns
    (:func:`interleaved_steps`). Each row: local push_step timed to "published" (and "committed"),
    the daemon's per-phase medians, and its staging arena as ``status["staging"]``. The bf16 daemons
    in RING_REMOTE first take remote (ipc://) steps, then the local ones (see REMOTE_FIRST)."""
    out: dict[str, Any] = {"regions": list(RING_REGIONS), "formats": list(RING_FORMATS), "rows": {}}
    for fmt in RING_FORMATS:
        with contextlib.ExitStack() as stack:
            daemons: dict[str, DaemonProc] = {}
            for regions in RING_REGIONS:
                key = f"{fmt}/r{regions}"
                try:
                    d = DaemonProc(
                        "--format", fmt, "--staging-regions", str(regions), config=config, label=f"ring {key}"
                    )
                except RuntimeError as exc:
                    print(f"ring {key}: {exc}", file=sys.stderr, flush=True)
                    out["rows"][key] = {"local": {"error": str(exc).splitlines()[0]}}
                    continue
                stack.enter_context(d)
                startup[f"ring_{fmt}_r{regions}"] = d.startup_s
                daemons[key] = d
                out["rows"][key] = {}
            remote = {
                k: d for k, d in daemons.items() if fmt == "bf16" and int(k.split("/r")[1]) in RING_REMOTE
            }
            if remote:
                got = interleaved_steps(remote, sd, local=False, repeat=repeat, warmup=WARMUP_STEPS)
                for key, row in got.items():
                    out["rows"][key]["remote_ipc"] = row
            got = interleaved_steps(daemons, sd, local=True, repeat=repeat, warmup=WARMUP_STEPS)
            for key, row in got.items():
                out["rows"][key]["local"] = row
            for key, d in daemons.items():
                try:
                    status = daemon_status(d)
                except RefitError as exc:
                    out["rows"][key]["status_error"] = str(exc)
                    continue
                out["rows"][key]["staging"] = status.get("staging")
                out["rows"][key]["history_seconds"] = [h.get("seconds") for h in status.get("history", [])]
        print(f"staging ring {fmt} done", flush=True)
    return out


def _published(row: dict | None) -> float | None:
    if not row or "error" in row or not row.get("published_s"):
        return None
    return statistics.median(row["published_s"])


def ring_table(ring: dict, nbytes: int) -> str:
    rows = ring["rows"]
    head = (
        f"{'staging':<26}{'median ms':>10}{'GB/s':>7}{'vs whole':>9}{'best ms':>9}{'vs whole':>9}"
        f"{'staging MiB':>12}{'vs whole':>9}{'groups':>7}  daemon medians ms: receive/quantize/tail/publish"
        "  (how the bytes moved)"
    )
    lines = [
        f"staging ring: one {nbytes / MiB:.1f} MiB BF16 step, push_step to published; median and best "
        "of the timed steps; 'vs whole' is time / whole-step time of the same format and path, and "
        "staging arena bytes / whole-step staging bytes",
        "",
        head,
    ]
    paths = [("local", fmt) for fmt in ring["formats"]] + [("remote_ipc", "bf16")]
    for path, fmt in paths:
        base_row = rows.get(f"{fmt}/r0", {})
        base_s = _published(base_row.get(path))
        base_best = min(base_row[path]["published_s"]) if base_s else None
        base_bytes = (base_row.get("staging") or {}).get("bytes")
        for regions in ring["regions"]:
            row = rows.get(f"{fmt}/r{regions}")
            if row is None or path not in row:
                continue
            where = "local" if path == "local" else "remote ipc"
            label = f"{where} {fmt}, " + ("whole step" if regions == 0 else f"ring {regions}")
            r = row[path]
            if "error" in r:
                lines.append(f"{label:<26}  FAILED: {r['error']}")
                continue
            s, best = statistics.median(r["published_s"]), min(r["published_s"])
            staging = row.get("staging") or {}
            sbytes = staging.get("bytes")
            groups = (staging.get("ring") or {}).get("groups", "-")
            t_ratio = f"{s / base_s:.2f}x" if base_s else "-"
            best_ratio = f"{best / base_best:.2f}x" if base_best else "-"
            b_ratio = f"{sbytes / base_bytes:.3f}" if sbytes and base_bytes else "-"
            smib = f"{sbytes / MiB:.1f}" if sbytes else "-"
            ph = r.get("daemon_phases_median_s", {})
            phases = "/".join(
                f"{ph.get(k, 0) * 1e3:.0f}" for k in ("receive", "quantize", "quantize_tail", "publish")
            )
            movers = "+".join(r.get("movers", ()))
            lines.append(
                f"{label:<26}{s * 1e3:>10.1f}{gbps(nbytes, s):>7.2f}{t_ratio:>9}{best * 1e3:>9.1f}{best_ratio:>9}"
                f"{smib:>12}{b_ratio:>9}{groups!s:>7}  {phases}" + (f"  ({movers})" if movers else "")
            )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# reporting


def med(row: dict, key: str = "seconds") -> float:
    return statistics.median(row[key])


def table(results: dict) -> str:
    nbytes = results["meta"]["bytes"]
    base = results["baselines"]
    lines = [
        f"ingest of one step: {nbytes / MiB:.1f} MiB BF16 in {results['meta']['tensors']} tensors "
        f"({results['meta']['frames']} client frames); median of {results['meta']['repeat']}",
        "",
        f"{'baseline':<44}{'ms':>9}{'GB/s':>8}",
    ]
    labels = {
        "memcpy": "memcpy: dst.copy_(src), private memory",
        "memcpy_shm": "memcpy into a shm mapping (warm)",
        "memcpy_shm_tensors": "memcpy per tensor into a shm arena (warm)",
        "zmq_ipc/recv_into": "raw zmq ipc, recv_into prealloc",
        "zmq_ipc/recv_copy": "raw zmq ipc, recv(copy=False) + torch copy_",
        "zmq_ipc/recv_copy_np": "raw zmq ipc, recv(copy=False) + np.copyto",
        "zmq_tcp/recv_into": "raw zmq tcp, recv_into prealloc",
        "zmq_tcp/recv_copy": "raw zmq tcp, recv(copy=False) + torch copy_",
        "zmq_tcp/recv_copy_np": "raw zmq tcp, recv(copy=False) + np.copyto",
    }
    for key, label in labels.items():
        if key in base:
            s = med(base[key])
            extra = ""
            if "first_s" in base[key]:
                extra = f"   (first: {gbps(base[key]['bytes'], base[key]['first_s']):.2f} GB/s)"
            lines.append(f"{label:<44}{s * 1e3:>9.1f}{gbps(nbytes, s):>8.2f}{extra}")
    lines += ["", f"{'refitd':<44}{'ms':>9}{'GB/s':>8}  ratio"]
    memcpy, memcpy_shm = med(base["memcpy"]), med(base["memcpy_shm_tensors"])
    for key, label, ref, ref_name in [
        ("local", "local ingest (committed)", memcpy, "memcpy"),
        ("remote_ipc", "remote ipc ingest (committed)", base.get("zmq_ipc/recv_into"), "raw zmq ipc"),
        ("remote_tcp", "remote tcp ingest (committed)", base.get("zmq_tcp/recv_into"), "raw zmq tcp"),
    ]:
        row = results["refitd"].get(key)
        if row is None or ref is None:
            continue
        if "error" in row:
            lines.append(f"{label:<44}  FAILED: {row['error']}")
            continue
        ref = ref if isinstance(ref, float) else med(ref)
        s = statistics.median(row["committed_s"])
        ratio = f"{ref / s:.2f}x {ref_name}"
        if key == "local":
            ratio += f", {memcpy_shm / s:.2f}x shm per-tensor memcpy"
        elif key == "remote_ipc" and "zmq_ipc/recv_copy" in base:
            ratio += f", {med(base['zmq_ipc/recv_copy']) / s:.2f}x recv+copy"
        elif key == "remote_tcp" and "zmq_tcp/recv_copy" in base:
            ratio += f", {med(base['zmq_tcp/recv_copy']) / s:.2f}x recv+copy"
        lines.append(f"{label:<44}{s * 1e3:>9.1f}{gbps(nbytes, s):>8.2f}  {ratio}")
        p = statistics.median(row["published_s"])
        lines.append(f"{'  ... to published, bf16 passthrough':<44}{p * 1e3:>9.1f}{gbps(nbytes, p):>8.2f}")
    fp8 = results["refitd"].get("local_block_fp8")
    if fp8 and "error" in fp8:
        lines.append(f"{'local, block_fp8':<44}  FAILED: {fp8['error']}")
    elif fp8:
        p, c = statistics.median(fp8["published_s"]), statistics.median(fp8["committed_s"])
        lines.append(f"{'local, block_fp8, committed':<44}{c * 1e3:>9.1f}{gbps(nbytes, c):>8.2f}")
        lines.append(
            f"{'local, block_fp8, published (end to end)':<44}{p * 1e3:>9.1f}{gbps(nbytes, p):>8.2f}"
            f"  quantize busy {fp8['daemon_phases_median_s'].get('quantize', 0) * 1e3:.0f} ms"
        )
    if results.get("overhead"):
        lines.append(overhead_table(results))
    return "\n".join(lines)


def overhead_table(results: dict) -> str:
    lines: list[str] = []
    for ov in results.get("overhead", {}).values():
        n = ov["n"]
        lines += [
            "",
            f"per-step overhead: {n} x [{SMALL_NUMEL}] bf16 vs one [{n * SMALL_NUMEL}] bf16 "
            f"({ov['bytes'] / MiB:.2f} MiB)",
            f"{'path':<22}{'one tensor ms':>14}{f'{n} tensors ms':>18}{'us/tensor':>11}"
            f"{'CPU us/tensor: client':>24}{'daemon':>8}",
        ]
        for path in ("local", "remote_ipc"):
            for phase in ("committed_s", "published_s"):
                label = f"{path} {phase[:-2]}"
                err = ov["one"][path].get("error") or ov["many"][path].get("error")
                if err:
                    lines.append(f"{label:<22}  FAILED: {err}")
                    continue
                one = statistics.median(ov["one"][path][phase])
                many = statistics.median(ov["many"][path][phase])
                cpu = ""
                if phase == "published_s" and "client_cpu_s" in ov["many"][path]:  # per step, both phases
                    c, dm = (
                        (ov["many"][path][k] - ov["one"][path][k]) / n * 1e6
                        for k in ("client_cpu_s", "daemon_cpu_s")
                    )
                    cpu = f"{c:>24.2f}{dm:>8.2f}"
                lines.append(
                    f"{label:<22}{one * 1e3:>14.2f}{many * 1e3:>18.1f}{(many - one) / n * 1e6:>11.1f}{cpu}"
                )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="size of one step in MiB of BF16 (default 256)")
    ap.add_argument("--repeat", type=int, default=5, help="timed steps / repetitions per row (median)")
    ap.add_argument("--skip-tcp", action="store_true", help="skip the tcp://127.0.0.1 rows")
    ap.add_argument("--small", type=int, default=SMALL_N, help="tensors in the overhead step")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--ring", action="store_true", help="run only the staging-ring section")
    ap.add_argument(
        "--overhead-only",
        action="store_true",
        help="run only the per-step overhead section (--small tensors)",
    )
    ap.add_argument("--zmq-receiver", help=argparse.SUPPRESS)
    ap.add_argument("--zmq-total", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.zmq_receiver:
        zmq_receiver(args.zmq_receiver, args.zmq_total)
        return 0
    if args.repeat < 1 or args.mib < 1:
        ap.error("--repeat and --mib must be at least 1")

    if args.overhead_only:
        return overhead_only(args)

    t_start = time.perf_counter()
    config = synthetic_config(args.mib)
    params = [(n, s) for n, s, _ in get_model("qwen3_5_moe").parameters(config)]
    flat = random_flat(sum(_numel(s) for _, s in params))
    sd = state_dict_over(flat, params)
    frames = frames_of(sd)
    nbytes = flat.numel() * flat.element_size()
    results: dict[str, Any] = {
        "meta": {
            "bytes": nbytes,
            "tensors": len(sd),
            "frames": len(frames),
            "max_frame_bytes": MAX_FRAME,
            "repeat": args.repeat,
            "warmup_steps": WARMUP_STEPS,
            "experts": config["text_config"]["num_experts"],
            "torch": torch.__version__,
            "pyzmq": zmq.__version__,
            "libzmq": zmq.zmq_version(),
            "threads": torch.get_num_threads(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "machine": platform.machine(),
            "loadavg_start": os.getloadavg(),
        },
        "baselines": {},
        "refitd": {},
    }
    print(f"step: {nbytes / MiB:.1f} MiB in {len(sd)} tensors, {len(frames)} frames", flush=True)
    startup: dict[str, float] = {}
    if not args.ring:
        full_run(args, config, flat, sd, frames, results, startup)
    results["ring"] = ring_section(config, sd, args.repeat, startup)
    print("staging ring done", flush=True)
    results["meta"]["daemon_startup_s"] = startup
    results["meta"]["wall_s"] = time.perf_counter() - t_start
    results["meta"]["loadavg_end"] = os.getloadavg()

    print()
    if not args.ring:
        print(table(results))
        print()
    print(ring_table(results["ring"], nbytes))
    load = ", ".join(f"{v:.1f}" for v in results["meta"]["loadavg_end"])
    starts = ", ".join(f"{v:.1f}" for v in startup.values())
    print(f"\n(wall {results['meta']['wall_s']:.0f} s; daemon startups {starts} s; load average {load})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


def overhead_only(args: argparse.Namespace) -> int:
    """``--overhead-only``: the per-step overhead rows for ``--small`` tensors, nothing else."""
    t_start = time.perf_counter()
    startup: dict[str, float] = {}
    results: dict[str, Any] = {"overhead": {str(args.small): step_overhead(args.small, args.repeat, startup)}}
    results["meta"] = {
        "repeat": args.repeat,
        "daemon_startup_s": startup,
        "wall_s": time.perf_counter() - t_start,
        "loadavg_end": os.getloadavg(),
    }
    print(overhead_table(results))
    load = ", ".join(f"{v:.1f}" for v in results["meta"]["loadavg_end"])
    print(f"\n(wall {results['meta']['wall_s']:.0f} s; load average {load})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


def full_run(
    args: argparse.Namespace,
    config: dict,
    flat: torch.Tensor,
    sd: dict[str, torch.Tensor],
    frames: list,
    results: dict,
    startup: dict,
) -> None:
    """Baselines, the refitd rows and the per-step overhead (everything but the staging ring)."""
    base = results["baselines"]
    base.update(memcpy_baselines(flat, sd, args.repeat))
    print("memcpy baselines done", flush=True)
    with tempfile.TemporaryDirectory(prefix="refitd-bench-zmq-") as tmp:
        got = zmq_baseline(f"ipc://{tmp}/raw.sock", frames, args.repeat, ZMQ_MODES)
    base.update({f"zmq_ipc/{k}": v for k, v in got.items()})
    if not args.skip_tcp:
        got = zmq_baseline(f"tcp://127.0.0.1:{free_port()}", frames, args.repeat, ZMQ_MODES)
        base.update({f"zmq_tcp/{k}": v for k, v in got.items()})
    print("zmq baselines done", flush=True)

    ref = results["refitd"]
    with daemon("--format", "bf16", config=config, label="bf16 ipc") as d:
        startup["bf16_ipc"] = d.startup_s
        # remote first: see REMOTE_FIRST
        ref["remote_ipc"] = push_steps(d, sd, local=False, repeat=args.repeat, warmup=WARMUP_STEPS)
        ref["local"] = push_steps(d, sd, local=True, repeat=args.repeat, warmup=WARMUP_STEPS)
    if not args.skip_tcp:
        with daemon("--format", "bf16", config=config, tcp_port=free_port(), label="bf16 tcp") as d:
            startup["bf16_tcp"] = d.startup_s
            ref["remote_tcp"] = push_steps(d, sd, local=False, repeat=args.repeat, warmup=WARMUP_STEPS)
    with daemon("--format", "block_fp8", config=config, label="block_fp8 ipc") as d:
        startup["block_fp8_ipc"] = d.startup_s
        ref["local_block_fp8"] = push_steps(d, sd, local=True, repeat=args.repeat, warmup=WARMUP_STEPS)
    print("refitd ingest done", flush=True)

    # per-step overhead: names outside the routed-expert regexes pass through as bf16
    overhead = {}
    for n in sorted({BELOW_WAKE_HWM, args.small}):
        overhead[str(n)] = step_overhead(n, args.repeat, startup)
    results["overhead"] = overhead


if __name__ == "__main__":
    sys.exit(main())
