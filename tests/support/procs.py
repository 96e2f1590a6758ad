"""Child-process entry points for the daemon integration tests (``tests/test_daemon.py``).

Each child is started with the ``spawn`` context and then obeys commands sent over a
``multiprocessing`` pipe, one at a time: a command is ``(name, kwargs)``, every reply is a plain
dict. Tensors never cross the pipe: a trainer rank builds the full synthetic state dict from the
step's seed and keeps only its own shards, and the reader builds the same state dict and converts
it with ``sidecar.plan.run.convert`` to know what the daemon must publish, byte for byte.

Sharding of the synthetic Qwen3.5-MoE model over ``world`` ranks (see :func:`rank_pieces`):

* the grouped expert slabs (``…mlp.experts.gate_up_proj``, ``…mlp.experts.down_proj``) are
  expert-parallel: rank r sends experts ``[r*E/world, (r+1)*E/world)``;
* a 2-D tensor whose chosen dim (alternating 0 and 1 by position) has at least ``world`` rows is
  tensor-parallel: split into ``world`` contiguous ranges along that dim;
* every other tensor is sent whole, as a plain tensor, by one owner rank (position mod world).

Faults (``fault={"kind": ..., "rank": r, ...}``) are applied by the rank they name only:
``omit`` (leave out this rank's slice of ``tensor``), ``overlap`` (take one expert of the next rank's
slice of ``tensor`` too), ``nan`` (a NaN in expert ``expert`` of ``tensor``), ``dtype`` (send this
rank's tensor-parallel slice of ``tensor`` as float32), ``die_after_ready`` (SIGKILL itself once the
daemon said READY, before sending any data), ``hold_begin`` (stop before BEGIN until told ``go``),
``stop_after_ready`` (a local rank: SIGSTOP itself once its staging is mapped and its copies are
planned, just before the first byte is written; on SIGCONT it writes them all, as a rank frozen by
the scheduler or a debugger would), ``hold_write`` (a local rank: stop just before writing until
told ``go``).
"""

from __future__ import annotations

import os
import signal
import threading
import time
import traceback
from typing import Any

import torch

MODEL = "qwen3_5_moe"
MODEL_ARGS: dict[str, Any] = {"num_layers": 2, "num_experts": 8, "unaligned": True}
WORLD = 4
SLAB_SUFFIXES = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def state_dict(seed: int) -> dict[str, torch.Tensor]:
    from sidecar.cli.demo.synthetic import make_state_dict

    return make_state_dict(MODEL, seed=seed, **MODEL_ARGS)


def hf_config() -> dict[str, Any]:
    from sidecar.cli.demo.synthetic import make_hf_config

    return make_hf_config(MODEL, **MODEL_ARGS)


def expected_outputs(seed: int, fmt: str) -> dict[str, torch.Tensor]:
    """What the daemon must publish for a step whose weights came from ``seed``."""
    from sidecar.plan.build import RefitSpec
    from sidecar.plan.run import convert

    return convert(state_dict(seed), RefitSpec(model_type=MODEL, fmt=fmt))


def _split(n: int, parts: int, index: int) -> tuple[int, int]:
    return n * index // parts, n * (index + 1) // parts


def rank_pieces(
    sd: dict[str, torch.Tensor], rank: int, world: int, fault: dict[str, Any] | None = None
) -> list[tuple[str, Any]]:
    """This rank's part of ``sd``: (name, Tensor | Shard) pairs, with ``fault`` applied if it is ours."""
    from sidecar.client.client import Shard

    mine = fault if fault is not None and fault.get("rank") == rank else None
    out: list[tuple[str, Any]] = []
    for position, (name, t) in enumerate(sd.items()):
        shape = tuple(t.shape)
        if name.endswith(SLAB_SUFFIXES):
            e0, e1 = _split(shape[0], world, rank)
            if mine is not None and mine.get("tensor") == name:
                if mine["kind"] == "omit":
                    continue
                if mine["kind"] == "overlap":
                    e1 += 1
                if mine["kind"] == "nan":
                    t = t.clone()
                    t[mine["expert"], 0, 0] = float("nan")
            out.append((name, Shard(t[e0:e1], shape, (e0, 0, 0))))
        elif t.dim() == 2 and shape[position % 2] >= world:
            dim = position % 2
            a, b = _split(shape[dim], world, rank)
            offsets = (a, 0) if dim == 0 else (0, a)
            part = t.narrow(dim, a, b - a)
            if mine is not None and mine["kind"] == "dtype" and mine.get("tensor") == name:
                part = part.float()
            out.append((name, Shard(part, shape, offsets)))
        elif position % world == rank:
            out.append((name, t))
    return out


def shm_mappings() -> list[tuple[str, str]]:
    """``(segment name, permissions)`` of every POSIX shared-memory mapping of this process
    (``/proc/self/maps``; an unlinked segment still mapped shows ``(deleted)`` after its name)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                out.append((fields[5].strip()[len("/dev/shm/") :], fields[1]))
    return out


class Link:
    """The child's end of the pipe. Commands come as ``(name, kwargs, seq)``; every reply carries the
    seq of the command it answers, so the test can drop a reply it stopped waiting for."""

    def __init__(self, conn):
        self.conn, self.seq = conn, 0

    def recv(self) -> tuple[str, dict[str, Any]]:
        cmd, kw, self.seq = self.conn.recv()
        return cmd, kw

    def recv_signal(self) -> None:
        """A bare signal (``go``) inside the current command; it has no seq of its own."""
        self.conn.recv()

    def send(self, reply: dict[str, Any]) -> None:
        self.conn.send({**reply, "seq": self.seq})


def _error_reply(exc: BaseException) -> dict[str, Any]:
    from sidecar.errors import RefitError

    if isinstance(exc, RefitError):
        return {
            "ok": False,
            "kind": exc.kind.value,
            "message": exc.message,
            "rank": exc.rank,
            "step": exc.step,
            "at": time.monotonic(),
        }
    return {"ok": False, "kind": "exception", "message": "".join(traceback.format_exception(exc))}


# --------------------------------------------------------------------------------------------------
# trainer rank


def rank_main(conn, rank: int, world: int) -> None:
    """A trainer rank: ``connect``, ``push`` (seed, fault), ``close``, ``exit``."""
    from sidecar.client.client import RefitClient

    conn = Link(conn)
    client: RefitClient | None = None
    cache: dict[int, dict[str, torch.Tensor]] = {}
    while True:
        cmd, kw = conn.recv()
        try:
            if cmd == "exit":
                break
            if cmd == "connect":
                if client is not None:
                    client.close()
                client = RefitClient(
                    kw["endpoint"],
                    rank,
                    world,
                    local=kw["local"],
                    timeout=kw["timeout"],
                    mover=kw.get("mover", "auto"),
                )
                conn.send({"ok": True})
            elif cmd == "close":
                if client is not None:
                    client.close()
                client = None
                conn.send({"ok": True})
            elif cmd == "maps":
                conn.send({"ok": True, "maps": shm_mappings()})
            elif cmd == "push":
                seed, fault = kw["seed"], kw.get("fault")
                if seed not in cache:
                    cache.clear()
                    cache[seed] = state_dict(seed)
                pieces = rank_pieces(cache[seed], rank, world, fault)
                if fault is not None and fault.get("rank") == rank and fault["kind"] == "die_after_ready":
                    _die_after_ready(client, conn)
                if fault is not None and fault.get("rank") == rank and fault["kind"] == "hold_begin":
                    _hold_begin(client, conn)
                if fault is not None and fault.get("rank") == rank and fault["kind"] == "stop_after_ready":
                    _before_writing(client, lambda *_: _stop(conn))
                if fault is not None and fault.get("rank") == rank and fault["kind"] == "hold_write":
                    _before_writing(client, lambda *at: _hold(conn, *at))
                try:
                    result = client.push_step(kw["step"], pieces, timeout=kw.get("timeout"))
                finally:
                    _unhook(client)
                conn.send({"ok": True, "step": result.step, "generation": result.generation})
            else:
                conn.send({"ok": False, "kind": "exception", "message": f"unknown command {cmd!r}"})
        except Exception as exc:  # every failure goes back to the test as data
            conn.send(_error_reply(exc))
    if client is not None:
        client.close()


def _die_after_ready(client, conn) -> None:
    """Make ``client`` SIGKILL this process where it would start sending data (after READY)."""

    def die(*args, **kwargs):
        conn.send({"ok": False, "kind": "dying", "at": time.monotonic()})
        os.kill(os.getpid(), signal.SIGKILL)

    client._local.write_step = die  # whole-step staging
    client._write_ring = die  # a staging ring
    client._remote.stream = die  # frames (a NIXL pull starts after READY too, but streams first)


def _before_writing(client, then) -> None:
    """Run ``then(writer, step, deadline)`` once, when ``client`` (a local rank) is about to copy its first
    piece: its staging arena is mapped and its copies are planned (the writer's batches run next)."""
    writer = client._local
    own = writer._run

    def run(step, batches, deadline):
        del writer._run  # once: the instance attribute goes, the class method is back
        then(writer, step, deadline)
        return own(step, batches, deadline)

    writer._run = run


def _stop(conn) -> None:
    """SIGSTOP this process from the calling thread: every thread stops (no PING, no copy) until
    SIGCONT. Directed at this thread, not the process: a process-directed SIGSTOP is taken by
    whichever thread the kernel picks, and on a loaded machine the caller ran on for tens of
    milliseconds meanwhile (enough to write and commit the whole step)."""
    conn.send({"ok": False, "kind": "stopping", "at": time.monotonic(), "pid": os.getpid()})
    signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)


def _hold(conn, writer, step: int, deadline: float) -> None:
    """Say ``holding`` and wait for the test's ``go``, pinging the daemon meanwhile (a rank silent
    for rank_timeout_s mid-step is declared dead)."""
    conn.send({"ok": False, "kind": "holding", "at": time.monotonic()})
    while not conn.conn.poll(0.05):
        writer._keepalive(step, deadline, 0.0)
    conn.recv_signal()


_HOOKED: dict[int, Any] = {}  # id(client) -> its own _send, while a hook replaces it


def _hold_begin(client, conn) -> None:
    """Make ``client`` stop just before sending BEGIN (it has its WELCOME): it says ``holding`` on
    the pipe and sends BEGIN only when the test answers ``go``. A failure broadcast meanwhile is
    then read only after BEGIN went out: the BEGIN crosses the ERROR."""
    own = client._send

    def send(kind, fields, frames=()):
        from transport.wire import Kind

        if kind is Kind.BEGIN:
            conn.send({"ok": False, "kind": "holding", "at": time.monotonic()})
            conn.recv_signal()  # the test's "go"
        return own(kind, fields, frames)

    _HOOKED[id(client)] = own
    client._send = send


def _unhook(client) -> None:
    if _HOOKED.pop(id(client), None) is not None:
        del client._send
    local = getattr(client, "_local", None)
    if local is not None:
        vars(local).pop("_run", None)  # a _before_writing hook the step never reached


# --------------------------------------------------------------------------------------------------
# engine reader


def reader_main(conn) -> None:
    """An engine reader: ``open``, ``wait`` (min_step, seed, fmt, release), ``check`` the held
    generation against a seed again, ``release``, ``status``, ``close``, ``exit``."""
    from adapters.base import RefitReader

    conn = Link(conn)
    reader: RefitReader | None = None
    held = None
    expected: dict[tuple[int, str], dict[str, torch.Tensor]] = {}

    def compare(gen, seed: int, fmt: str) -> list[str]:
        key = (seed, fmt)
        if key not in expected:
            expected.clear()
            expected[key] = expected_outputs(seed, fmt)
        want = expected[key]
        problems = []
        if set(gen.tensors) != set(want):
            problems.append(
                f"names differ: missing {sorted(set(want) - set(gen.tensors))[:5]}, "
                f"extra {sorted(set(gen.tensors) - set(want))[:5]}"
            )
        for name, w in want.items():
            got = gen.tensors.get(name)
            if got is None:
                continue
            if got.dtype != w.dtype or tuple(got.shape) != tuple(w.shape):
                problems.append(f"{name}: {got.dtype} {tuple(got.shape)} != {w.dtype} {tuple(w.shape)}")
            elif not torch.equal(got.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8)):
                problems.append(f"{name}: bytes differ")
        return problems

    while True:
        cmd, kw = conn.recv()
        try:
            if cmd == "exit":
                break
            if cmd == "open":
                reader = RefitReader(kw["endpoint"], name=kw.get("name", "test-reader"))
                conn.send({"ok": True})
            elif cmd == "wait":
                if held is not None and kw.get("release_held", True):
                    reader.release(held)
                held = reader.wait(min_step=kw["min_step"], timeout=kw["timeout"])
                problems = compare(held, kw["seed"], kw["fmt"]) if kw.get("seed") is not None else []
                reply = {"ok": True, "step": held.step, "generation": held.index, "problems": problems}
                if kw.get("release", True):
                    reader.release(held)
                    held = None
                conn.send(reply)
            elif cmd == "check":
                if held is None:
                    conn.send({"ok": False, "kind": "exception", "message": "no generation held"})
                else:
                    problems = compare(held, kw["seed"], kw["fmt"])
                    conn.send({"ok": True, "step": held.step, "problems": problems})
            elif cmd == "release":
                if held is not None:
                    reader.release(held)
                    held = None
                conn.send({"ok": True})
            elif cmd == "status":
                conn.send({"ok": True, "status": reader.status(timeout=kw["timeout"])})
            elif cmd == "close":
                held = None
                if reader is not None:
                    reader.close()
                reader = None
                conn.send({"ok": True})
            else:
                conn.send({"ok": False, "kind": "exception", "message": f"unknown command {cmd!r}"})
        except Exception as exc:
            conn.send(_error_reply(exc))
    if reader is not None:
        reader.close()
