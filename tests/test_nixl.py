"""NIXL between two processes over POSIX-shm arenas, with metadata and region tables in msgpack.

The test process is the initiator; a spawned child is the passive target. They meet on a ZeroMQ
PAIR socket at an ``ipc://`` path in a temp dir and exchange ``{"md": metadata, "regions": table}``
as msgpack (never pickled descriptors). Neither agent runs a progress thread: each side progresses
its endpoint while it waits on the socket (``while not sock.poll(1): ep.progress()``), which is
what lets the other side's WRITEs, READs and notifications complete.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
import zmq

from transport.layout import Layout
from transport.nixl import Mem, NixlEndpoint, NixlError, _Ranges, _regions, available
from transport.shm import ShmArena, segment_name

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20
INBOX, OUTBOX = 6 * MiB, 5 * MiB + 123  # the target's WRITE destination and READ source
SEED = 1234
DEADLINE_S = 30.0

NIXL_OK, NIXL_WHY = available()
needs_nixl = pytest.mark.skipif(not NIXL_OK, reason=f"NIXL unavailable: {NIXL_WHY}")


def _pattern(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _base(arena: ShmArena) -> torch.Tensor:
    """The whole segment as one uint8 tensor: what is registered and advertised."""
    return arena.segment.view(0, torch.uint8, (arena.size,))


def _send(sock: zmq.Socket, obj: dict[str, Any]) -> None:
    sock.send(msgpack.packb(obj, use_bin_type=True))


def _recv(sock: zmq.Socket, ep: NixlEndpoint, deadline: float) -> dict[str, Any]:
    """The next control message, progressing ``ep`` while none has arrived (bounded by ``deadline``)."""
    while not sock.poll(1):
        ep.progress()
        if time.monotonic() > deadline:
            raise TimeoutError("no control message before the deadline")
    return msgpack.unpackb(sock.recv(), raw=False)


# --------------------------------------------------------------------------------------------------
# the passive target (child process)


def _target(address: str) -> None:
    arena = ShmArena.create(
        segment_name("refitd-test", "nixl"),
        Layout.build([("inbox", torch.uint8, (INBOX,)), ("outbox", torch.uint8, (OUTBOX,))]),
    )
    arena.tensor("outbox").copy_(_pattern(OUTBOX, SEED))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.connect(address)
    ep = NixlEndpoint("target")
    try:
        base = _base(arena)
        reg = ep.register(base)
        addr = base.data_ptr()
        slots = {s.name: [addr + s.offset, s.nbytes] for s in arena.layout}
        _send(sock, {"md": ep.metadata(), "regions": ep.regions_table(reg), "slots": slots})
        deadline = time.monotonic() + DEADLINE_S
        hello = _recv(sock, ep, deadline)
        ep.add_peer(hello["md"])
        received: list[bytes] = []
        while True:
            cmd = _recv(sock, ep, time.monotonic() + DEADLINE_S)
            if cmd["op"] == "notif":  # wait for a notification from the initiator
                end = time.monotonic() + DEADLINE_S
                while cmd["tag"] not in received and time.monotonic() < end:
                    received += ep.notifications().get("initiator", [])
                _send(sock, {"received": received})
            elif cmd["op"] == "bytes":  # the inbox, to check a WRITE byte for byte
                _send(sock, {"data": arena.tensor("inbox").numpy().tobytes()})
            elif cmd["op"] == "close":
                break
    finally:
        ep.close()
        ep.close()  # idempotent
        arena.close()
        arena.unlink()
        _send(sock, {"closed": True})
        sock.close(linger=1000)
        ctx.term()


# --------------------------------------------------------------------------------------------------
# the initiator (this process)


class Pair:
    def __init__(self, ep: NixlEndpoint, sock: zmq.Socket, arena: ShmArena, hello: dict[str, Any]):
        self.ep, self.sock, self.arena = ep, sock, arena
        self.regions, self.slots = hello["regions"], hello["slots"]
        self.peer = ep.add_peer(hello["md"], regions=hello["regions"])

    def ask(self, **cmd: Any) -> dict[str, Any]:
        _send(self.sock, cmd)
        return _recv(self.sock, self.ep, time.monotonic() + DEADLINE_S)

    def local(self, name: str) -> tuple[torch.Tensor, int]:
        t = self.arena.tensor(name)
        return t, t.data_ptr()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    if not NIXL_OK:
        pytest.skip(f"NIXL unavailable: {NIXL_WHY}")
    address = f"ipc://{tmp_path_factory.mktemp('nixl')}/ctl.sock"
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.bind(address)
    child = mp.get_context("spawn").Process(target=_target, args=(address,), daemon=True)
    child.start()
    arena = ShmArena.create(
        segment_name("refitd-test", "nixl-init"),
        Layout.build([("src", torch.uint8, (INBOX,)), ("dst", torch.uint8, (OUTBOX,))]),
    )
    ep = NixlEndpoint("initiator")
    try:
        ep.register(_base(arena))
        hello = _recv(sock, ep, time.monotonic() + DEADLINE_S + 30)  # the child imports torch first
        _send(sock, {"md": ep.metadata()})
        yield Pair(ep, sock, arena, hello)
        _send(sock, {"op": "close"})
        assert _recv(sock, ep, time.monotonic() + DEADLINE_S) == {"closed": True}
    finally:
        ep.close()
        ep.close()
        arena.close()
        arena.unlink()
        sock.close(linger=0)
        ctx.term()
        child.join(timeout=DEADLINE_S)
        if child.is_alive():
            child.kill()
            child.join()
    assert child.exitcode == 0


@needs_nixl
def test_write_is_byte_exact_and_notifies_the_target(pair):
    """Three WRITE descriptors fill the target's inbox out of order; its notification arrives."""
    src, src_addr = pair.local("src")
    src.copy_(_pattern(INBOX, SEED + 1))
    inbox, _ = pair.slots["inbox"]
    cuts = [0, MiB + 7, 4 * MiB, INBOX]
    pieces = [(cuts[i], cuts[i + 1] - cuts[i]) for i in range(3)][::-1]
    t = pair.ep.write(
        pair.peer, [(src_addr + o, n) for o, n in pieces], [(inbox + o, n) for o, n in pieces], b"step-7"
    )
    t.wait(time.monotonic() + DEADLINE_S)
    assert t.done and t.poll() == "DONE"
    assert b"step-7" in pair.ask(op="notif", tag=b"step-7")["received"]
    assert pair.ask(op="bytes")["data"] == src.numpy().tobytes()


@needs_nixl
def test_read_is_byte_exact_and_notifies_the_target(pair):
    """A READ pulls the target's outbox (written before the handshake) while the target polls."""
    dst, dst_addr = pair.local("dst")
    dst.zero_()
    outbox, size = pair.slots["outbox"]
    t = pair.ep.read(pair.peer, [(dst_addr, size)], [(outbox, size)], b"read-done")
    t.wait(time.monotonic() + DEADLINE_S, progress=pair.ep.progress)
    assert torch.equal(dst, _pattern(OUTBOX, SEED))
    assert b"read-done" in pair.ask(op="notif", tag=b"read-done")["received"]


@needs_nixl
def test_standalone_notification_reaches_the_target(pair):
    pair.ep.send_notif(pair.peer, b"hello")
    assert b"hello" in pair.ask(op="notif", tag=b"hello")["received"]


@needs_nixl
def test_transfers_outside_what_the_peer_advertised_are_refused(pair):
    """Our own check names the peer, the op and the range; NIXL is never asked."""
    _, src_addr = pair.local("src")
    start, length = pair.regions[0]
    with pytest.raises(NixlError, match="lies outside the regions the peer advertised") as err:
        pair.ep.write(pair.peer, [(src_addr, 4096)], [(start + length - 100, 4096)])
    assert (err.value.peer, err.value.op) == ("target", "WRITE")
    with pytest.raises(NixlError, match="outside the regions"):
        pair.ep.read(pair.peer, [(src_addr, 64)], [(start - 64, 64)])
    with pytest.raises(ValueError, match="sizes must match"):
        pair.ep.write(pair.peer, [(src_addr, 64)], [(start, 128)])
    with pytest.raises(ValueError, match="not inside memory registered"):
        pair.ep.write(pair.peer, [(src_addr - (1 << 30), 64)], [(start, 64)])
    with pytest.raises(NixlError, match="add_peer its metadata first"):
        pair.ep.write("nobody", [(src_addr, 64)], [(start, 64)])


@needs_nixl
def test_nixl_itself_refuses_memory_the_peer_never_registered(pair):
    """Even if a peer lies in its table, NIXL rejects a range without a remote key."""
    _, src_addr = pair.local("src")
    start, length = pair.regions[0]
    pair.ep.set_peer_regions(pair.peer, [[start, length + (1 << 20)]])
    try:
        with pytest.raises(NixlError, match="NIXL refused the transfer"):
            pair.ep.write(pair.peer, [(src_addr, 4096)], [(start + length, 4096)])
    finally:
        pair.ep.set_peer_regions(pair.peer, pair.regions)


# --------------------------------------------------------------------------------------------------
# without a peer


@needs_nixl
def test_endpoint_lifecycle():
    with NixlEndpoint("lonely") as ep:
        buf = torch.zeros(4096, dtype=torch.uint8)
        reg = ep.register(buf)
        assert reg.mem is Mem.DRAM and reg.nbytes == 4096
        assert ep.regions_table(reg) == [[buf.data_ptr(), 4096]]
        assert isinstance(ep.metadata(), bytes)
        with pytest.raises(NixlError, match="peer metadata was refused"):
            ep.add_peer(ep.metadata())
        ep.deregister(reg)
        ep.deregister(reg)  # idempotent
    with pytest.raises(NixlError, match="is closed"):
        ep.metadata()
    ep.close()


@needs_nixl
def test_ucx_tls_holds_while_the_backend_is_made_then_the_process_value_returns(monkeypatch):
    """``ucx_tls`` is what UCX sees while the backend is made (``cma`` alone has no wire-up
    transport and fails; ``tcp`` works over a process value of ``cma``), and the process's own
    ``UCX_TLS`` is back afterwards, whether the backend was made or not."""
    monkeypatch.setenv("UCX_TLS", "cma")
    with NixlEndpoint("tls-tcp", ucx_tls="tcp"):
        assert os.environ["UCX_TLS"] == "cma"
    monkeypatch.delenv("UCX_TLS")
    with pytest.raises(NixlError, match="with UCX_TLS='cma': keep a wire-up transport"):
        NixlEndpoint("tls-cma", ucx_tls="cma")
    assert "UCX_TLS" not in os.environ


def test_region_rows_are_validated():
    assert _regions([[1, 2], (3, 4)], "t").tolist() == [[1, 2], [3, 4]]
    assert _regions(np.array([[5, 6]], dtype=np.uint64), "t").tolist() == [[5, 6]]
    for bad, why in [
        ([[1]], "pairs"),
        ([[1, 2, 3]], "pairs"),
        ([[1, 2], [3]], "list of"),
        ([[1, 0]], r"t\[0\] = \[1, 0\]: addr must be >= 0 and len > 0"),
        ([[0, 1], [-1, 4]], r"t\[1\]"),
        ([[1.0, 4]], "must be ints"),
        (7, "list of"),
    ]:
        with pytest.raises(ValueError, match=why):
            _regions(bad, "t")


def test_ranges_cover_only_inside_one_region():
    r = _Ranges([(100, 50), (0, 10), (120, 10), (150, 10)])  # (120, 10) overlaps (100, 50): merged
    inside = [(0, 10), (100, 50), (149, 1), (150, 10)]
    outside = [(5, 10), (95, 10), (145, 10), (160, 1)]  # (145, 10) straddles two adjacent ranges
    assert r.covers(np.array(inside)).all() and not r.covers(np.array(outside)).any()
    assert not _Ranges([]).covers(np.array([[0, 1]])).any()


def _python(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_import_works_without_nixl():
    """``import transport.nixl`` never needs nixl; ``available()`` says why it is off."""
    code = (
        "import sys; sys.modules.update(nixl=None, nixl_cu12=None, nixl_cu13=None)\n"
        "import transport.nixl as n\n"
        "ok, why = n.available(); assert not ok and 'cannot be imported' in why, why\n"
        "assert n.backend_module() is None; print('ok')"
    )
    assert _python(code) == "ok"


@pytest.mark.skipif(importlib.util.find_spec("nixl_cu12") is None, reason="nixl-cu12 is not installed")
def test_one_backend_wheel_is_enough():
    """With only nixl-cu12, the meta package may refuse (it wants the wheel of the CUDA major it
    detects, e.g. 13 from cuda-bindings even with CPU torch); the wrapper then uses nixl_cu12."""
    code = (
        "import sys; sys.modules['nixl_cu13'] = None\n"
        "import transport.nixl as n\n"
        "print(n.available(), n.backend_module())"
    )
    assert _python(code) == "(True, '') nixl_cu12"


_SIGHUP_AFTER_A_BACKEND = """
import os, select, signal, sys, threading
from transport import nixl

got = []
ran_r, ran_w = os.pipe()  # the Python handler itself says it ran: the main thread blocks on that


def on_hup(*_):
    got.append("hup")
    os.write(ran_w, b"h")


signal.signal(signal.SIGHUP, on_hup)
where = sys.argv[1]
if where == "thread":  # a forwarder's endpoint: the main thread's next keep_signal_handlers() fixes it
    t = threading.Thread(target=lambda: nixl.NixlEndpoint("refitd-sig-thread"))
    t.start()
    t.join()
    nixl.keep_signal_handlers()
else:
    ep = nixl.NixlEndpoint("refitd-sig-main")
os.kill(os.getpid(), signal.SIGHUP)
# a displaced disposition never runs on_hup: the pipe stays empty and select gives up after 10 s
select.select([ran_r], [], [], 10)
print(",".join(got))
"""


@needs_nixl
@pytest.mark.parametrize("where", ["main", "thread"])
def test_python_handlers_survive_a_ucx_backend(where):
    """Creating a UCX backend displaces SIGHUP's disposition under Python's handler (the daemon's
    reload would die silently); the endpoint puts Python's handlers back itself, on the main thread
    at once, and from another thread at the main thread's next ``keep_signal_handlers()``."""
    out = subprocess.run(
        [sys.executable, "-c", _SIGHUP_AFTER_A_BACKEND, where],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and out.stdout.strip() == "hup", (
        out.returncode,
        out.stdout,
        out.stderr[-2000:],
    )
