"""NIXL (UCX) bulk transfers between nodes' daemons: a small, polled wrapper around ``nixl_agent``.

The progress thread is off: a UCX progress thread spins a whole core even when idle, and polling
from the caller is faster (measured with NIXL 1.5.1 between two processes). The price is that
**both sides must be progressed**: the initiator by polling its transfer (``Transfer.poll`` / ``wait``), the passive
side by calling ``notifications()`` or ``progress()`` while it waits on anything else, e.g.
``while not sock.poll(1): ep.progress()``. A passive side blocked in ``recv()`` stalls the
transfer, READs and connection set-up included.

Nothing crossing the control channel is pickled. An endpoint's metadata (bytes) and its region
table (``[[addr, len], ...]``, plain ints) travel in msgpack; the peer rebuilds descriptors from the
ints and every transfer is checked against what the peer advertised before NIXL sees it.

    >>> ep = NixlEndpoint("daemon-node3")                      # doctest: +SKIP
    >>> reg = ep.register(arena_bytes)                         # a contiguous CPU tensor, or [(addr, len)]
    >>> hello = {"md": ep.metadata(), "regions": ep.regions_table(reg)}   # after registering
    >>> peer = ep.add_peer(their["md"], regions=their["regions"])
    >>> ep.write(peer, [(src, n)], [(their_addr, n)], b"step-7").wait(time.monotonic() + 30)
    >>> ep.close()

Metadata describes the registrations made before it was taken: register first, then send it (and
send it again after registering more; ``add_peer`` with newer metadata of a known peer updates it).

VRAM: ``register(cuda_tensor)`` registers it as ``VRAM`` on its device. That needs the CUDA build
of UCX bundled in the ``nixl-cuXX`` wheel that matches torch's CUDA major, GPUDirect RDMA (or
cuda_ipc on one node) for speed, and memory from ``cudaMalloc``: blocks from torch's
``expandable_segments`` allocator register but lose the fast path (nixl #1754, ucx #11548), so
allocate arenas from a plain ``torch.cuda.MemPool``. A peer advertises VRAM with
``add_peer(..., mem=Mem.VRAM, device=<its GPU index>)``. Only DRAM is exercised by the tests.

UCX picks its transports itself (cma for same-host RMA, tcp/ib across hosts). Restricting
``UCX_TLS`` easily breaks backend creation (``sm,self``, ``cma`` alone fail), so it is left unset
unless the constructor is given ``ucx_tls``.
"""

from __future__ import annotations

import enum
import logging
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from transport.nixl_runtime import (
    ERROR_HANDLING,
    _api,
    _backend_created,
    available,
    backend_module,
    keep_signal_handlers,
)
from transport.process_env import ucx_backend_environment

__all__ = [  # availability and the signal fix-up live in transport.nixl_runtime; reachable from here
    "ERROR_HANDLING",
    "Mem",
    "NixlEndpoint",
    "NixlError",
    "NixlTimeout",
    "Registration",
    "Transfer",
    "available",
    "backend_module",
    "keep_signal_handlers",
]

log = logging.getLogger(__name__)


class NixlError(RuntimeError):
    """A NIXL operation failed. ``peer`` and ``op`` (``"WRITE"``, ``"READ"``, ...) say which."""

    def __init__(self, message: str, *, peer: str | None = None, op: str | None = None):
        self.peer, self.op = peer, op
        super().__init__(message)


class NixlTimeout(NixlError, TimeoutError):
    """A transfer did not complete before its deadline (it has been released: cancelled if possible)."""


class Mem(str, enum.Enum):
    """Memory kinds a region can be. NIXL's names, so ``Mem.DRAM.value`` is what it expects."""

    DRAM = "DRAM"
    VRAM = "VRAM"


# --------------------------------------------------------------------------------------------------
# regions: plain (addr, len) ints, validated wherever they come from


def _regions(rows: Any, what: str) -> np.ndarray:
    """``rows`` (``[[addr, len], ...]`` or an N x 2 integer array) as an N x 2 int64 array of
    ``addr >= 0, len > 0``; ValueError naming ``what`` and the first bad row otherwise."""
    try:
        arr = np.asarray(rows if len(rows) else np.empty((0, 2), np.int64))
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{what}: give a list of [addr, len] pairs of ints") from None
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise ValueError(f"{what}: give [addr, len] pairs (got an array of shape {arr.shape})")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{what}: addr and len must be ints (got {arr.dtype}: {arr[:1].tolist()})")
    if arr.dtype.kind == "u" and len(arr) and int(arr.max()) >= 1 << 63:
        raise ValueError(f"{what}: an addr or len lies beyond 2**63")
    arr = arr.astype(np.int64, copy=False)
    bad = np.flatnonzero(
        (arr[:, 0] < 0) | (arr[:, 1] <= 0) | (arr[:, 0] > np.iinfo(np.int64).max - arr[:, 1])
    )
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"{what}[{i}] = {arr[i].tolist()}: addr must be >= 0 and len > 0")
    return arr


class _Ranges:
    """Byte ranges, overlapping ones merged; ``covers`` says, row by row, "inside one of them?".

    Adjacent ranges are kept apart: NIXL needs each descriptor inside one registered region."""

    def __init__(self, regions: np.ndarray | Iterable[tuple[int, int]]):
        merged: list[list[int]] = []
        for start, size in sorted((int(a), int(n)) for a, n in regions):
            if merged and start < merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], start + size)
            else:
                merged.append([start, start + size])
        spans = np.array(merged, dtype=np.int64).reshape(-1, 2)
        self.starts, self.ends = spans[:, 0].copy(), spans[:, 1].copy()

    def __len__(self) -> int:
        return len(self.starts)

    def covers(self, rows: np.ndarray) -> np.ndarray:
        """A bool per row of ``rows`` (N x 2 addr, len): whether it lies inside one range."""
        if not len(self.starts):
            return np.zeros(len(rows), dtype=bool)
        i = np.searchsorted(self.starts, rows[:, 0], side="right") - 1
        return (i >= 0) & (rows[:, 0] + rows[:, 1] <= self.ends[np.maximum(i, 0)])


@dataclass(eq=False, slots=True)
class Registration:
    """Memory registered with an endpoint's UCX backend; keep it (or close the endpoint) while in use."""

    mem: Mem
    device: int
    regions: tuple[tuple[int, int], ...]
    _dlist: Any = field(repr=False)
    _keep: Any = field(default=None, repr=False)  # the tensor, so its memory outlives the registration

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.regions)


@dataclass(slots=True)
class _Peer:
    mem: Mem
    device: int
    ranges: _Ranges


# --------------------------------------------------------------------------------------------------
# transfers


class Transfer:
    """One posted WRITE or READ. Poll it to completion (polling is what moves it); released when done.

    >>> t = ep.write(peer, local, remote, b"tag")            # doctest: +SKIP
    >>> t.wait(time.monotonic() + 30, progress=other_work)   # or: while t.poll() == "PROC": ...
    """

    def __init__(self, agent: Any, handle: Any, *, peer: str, op: str, nbytes: int):
        self.peer, self.op, self.nbytes = peer, op, nbytes
        self._agent, self._handle = agent, handle
        self._state = "PROC"

    def _post(self) -> None:
        self._settle(self._agent.transfer(self._handle), "post")

    def poll(self) -> str:
        """``"DONE"`` or ``"PROC"``; raises NixlError if the transfer failed or was released early."""
        if self._state in ("CANCELLED", "ERR"):
            what = "failed" if self._state == "ERR" else "was released before it completed"
            raise NixlError(f"{self.op} with peer {self.peer!r} {what}", peer=self.peer, op=self.op)
        if self._state == "PROC":
            try:
                state = self._agent.check_xfer_state(self._handle)
            except Exception as exc:
                self._state = "ERR"
                self.release()
                raise NixlError(
                    f"{self.op} of {self.nbytes} B with peer {self.peer!r} failed: {type(exc).__name__}: {exc}",
                    peer=self.peer,
                    op=self.op,
                ) from exc
            self._settle(state, "progress")
        return self._state

    def _settle(self, state: str, phase: str) -> None:
        if state == "ERR":
            self._state = "ERR"
            self.release()
            raise NixlError(
                f"{self.op} of {self.nbytes} B with peer {self.peer!r} failed during {phase} "
                "(the peer may have exited or deregistered the memory)",
                peer=self.peer,
                op=self.op,
            )
        self._state = state
        if state == "DONE":
            self.release()

    def wait(self, deadline: float, progress: Callable[[], object] | None = None) -> None:
        """Poll until done; ``deadline`` is a ``time.monotonic()`` instant. ``progress`` is called on
        each turn (serve the control channel, progress a co-located passive endpoint).
        On the deadline the transfer is released (cancelled if UCX can) and NixlTimeout raised."""
        while self.poll() == "PROC":
            if progress is not None:
                progress()
            if time.monotonic() > deadline:
                self.release()
                raise NixlTimeout(
                    f"{self.op} of {self.nbytes} B with peer {self.peer!r} did not complete by its deadline; "
                    "is the peer progressing its endpoint (polling notifications) while it waits?",
                    peer=self.peer,
                    op=self.op,
                )

    @property
    def done(self) -> bool:
        return self._state == "DONE"

    def release(self) -> None:
        """Free the handle (idempotent); an active transfer is cancelled if UCX can, else logged."""
        handle, self._handle = self._handle, None
        if handle is None:
            return
        if self._state == "PROC":
            self._state = "CANCELLED"
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as exc:  # an active transfer that cannot be cancelled: NIXL keeps it on a leak list
            log.warning("releasing %s with peer %s failed: %s", self.op, self.peer, exc)

    def __enter__(self) -> Transfer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


# --------------------------------------------------------------------------------------------------
# the endpoint


class NixlEndpoint:
    """One NIXL agent with a UCX backend and no progress thread; owns its registrations and peers.

    ``name`` must be unique among the agents that will talk to each other (e.g. ``refitd-<host>``).
    ``ucx_tls`` sets ``UCX_TLS`` while the backend is created (left as the process has it by
    default; transport.process_env says why it must go through the environment);
    ``error_handling`` is UCX's mode, ``"peer"`` so that a dead peer fails transfers.

    Not thread-safe (the agent runs with NIXL's thread sync off): use it from one thread, the one
    that also polls it.
    """

    def __init__(self, name: str, *, ucx_tls: str | None = None, error_handling: str = ERROR_HANDLING):
        if not isinstance(name, str) or not name:
            raise ValueError(f"endpoint name {name!r}: give a non-empty string unique among the peers")
        ok, why = available()
        if not ok:
            raise NixlError(why)
        api = _api()
        self.name = name
        self._agent: Any = None
        try:
            agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=[]))
            params = agent.get_plugin_params("UCX")
            params["ucx_error_handling_mode"] = error_handling
            with ucx_backend_environment(ucx_tls):
                try:
                    agent.create_backend("UCX", params)
                finally:
                    _backend_created()
        except Exception as exc:
            hint = f" with UCX_TLS={ucx_tls!r}: keep a wire-up transport such as tcp in it" if ucx_tls else ""
            raise NixlError(f"endpoint {name!r}: cannot create the UCX backend{hint} ({exc})") from exc
        self._agent = agent
        self._regs: list[Registration] = []
        self._local: dict[tuple[Mem, int], _Ranges] = {}
        self._peers: dict[str, _Peer] = {}
        self._inbox: dict[str, list[bytes]] = {}
        self._transfers: weakref.WeakSet[Transfer] = weakref.WeakSet()

    # ---- identity and peers

    def metadata(self) -> bytes:
        """This agent's metadata (a few hundred bytes) for the peer's ``add_peer``; take it after
        registering, since it carries the registrations' remote keys."""
        return bytes(self._live().get_agent_metadata())

    def add_peer(
        self,
        metadata: bytes,
        *,
        regions: Sequence[Sequence[int]] | None = None,
        mem: Mem | str = Mem.DRAM,
        device: int = 0,
    ) -> str:
        """Load a peer's metadata (again, to update it); returns its name. ``regions`` is the peer's
        ``regions_table``: remote ranges of later transfers must lie inside it."""
        if not isinstance(metadata, (bytes, bytearray, memoryview)) or not metadata:
            raise ValueError("peer metadata must be the non-empty bytes of the peer's metadata()")
        try:
            raw = self._live().add_remote_agent(bytes(metadata))
        except Exception as exc:
            raise NixlError(
                f"endpoint {self.name!r}: peer metadata was refused ({exc}); give another endpoint's "
                "metadata() (agent names must differ)",
                op="add_peer",
            ) from exc
        peer = raw.decode() if isinstance(raw, (bytes, bytearray)) else str(raw)
        self._peers.setdefault(peer, _Peer(Mem.DRAM, 0, _Ranges(())))
        if regions is not None:
            self.set_peer_regions(peer, regions, mem=mem, device=device)
        return peer

    def set_peer_regions(
        self, peer: str, regions: Sequence[Sequence[int]], *, mem: Mem | str = Mem.DRAM, device: int = 0
    ) -> None:
        """Replace what ``peer`` advertised (its ``regions_table``, received over the control channel)."""
        self._peer(peer, "set_peer_regions")
        ranges = _Ranges(_regions(regions, f"regions advertised by {peer!r}"))
        self._peers[peer] = _Peer(Mem(mem), _device(device), ranges)

    def remove_peer(self, name: str) -> None:
        """Forget ``name`` and disconnect from it (idempotent)."""
        if self._peers.pop(name, None) is not None and self._agent is not None:
            try:
                self._agent.remove_remote_agent(name)
            except Exception as exc:
                log.warning("endpoint %s: removing peer %s failed: %s", self.name, name, exc)

    @property
    def peers(self) -> list[str]:
        return list(self._peers)

    # ---- memory

    def register(self, regions: Sequence[tuple[int, int]] | torch.Tensor) -> Registration:
        """Register memory with UCX: a contiguous tensor (CPU -> DRAM, CUDA -> VRAM on its device), or
        ``[(addr, len)]`` of host memory the caller keeps alive (a POSIX-shm arena, pinned buffers)."""
        agent = self._live()
        keep = None
        if isinstance(regions, torch.Tensor):
            t = regions
            if not t.is_contiguous() or t.numel() == 0:
                raise ValueError(f"register a contiguous, non-empty tensor (got shape {tuple(t.shape)})")
            mem, device = (Mem.VRAM, t.device.index or 0) if t.is_cuda else (Mem.DRAM, 0)
            if t.device.type not in ("cpu", "cuda"):
                raise ValueError(f"tensors on {t.device} cannot be registered; use CPU or CUDA memory")
            rows, keep = [(t.data_ptr(), t.numel() * t.element_size())], t
        else:
            mem, device = Mem.DRAM, 0
            rows = [(int(a), int(n)) for a, n in _regions(regions, "register(regions)")]
            if not rows:
                raise ValueError("register([]): give at least one (addr, len) region")
        try:
            dlist = agent.register_memory([(a, n, device, "") for a, n in rows], mem.value)
        except Exception as exc:
            raise NixlError(
                f"endpoint {self.name!r}: registering {len(rows)} {mem.value} region(s) failed ({exc})",
                op="register",
            ) from exc
        reg = Registration(mem, device, tuple(rows), dlist, keep)
        self._regs.append(reg)
        self._index_local()
        return reg

    def deregister(self, reg: Registration) -> None:
        """Deregister ``reg`` (idempotent). Peers still holding its table will see transfers fail."""
        if reg in self._regs:
            self._regs.remove(reg)
            self._index_local()
            if self._agent is not None:
                try:
                    self._agent.deregister_memory(reg._dlist)
                except Exception as exc:
                    log.warning("endpoint %s: deregistering %s failed: %s", self.name, reg, exc)

    @staticmethod
    def regions_table(reg: Registration) -> list[list[int]]:
        """``[[addr, len], ...]`` of plain ints: what to send a peer (in msgpack) for its ``add_peer``."""
        return [[a, n] for a, n in reg.regions]

    # ---- transfers

    def write(
        self, peer: str, local: Sequence[Sequence[int]], remote: Sequence[Sequence[int]], notif: bytes = b""
    ) -> Transfer:
        """Post a WRITE of ``local[i]`` into the peer's ``remote[i]``; the peer gets ``notif`` when done."""
        return self._xfer("WRITE", peer, local, remote, notif)

    def read(
        self, peer: str, local: Sequence[Sequence[int]], remote: Sequence[Sequence[int]], notif: bytes = b""
    ) -> Transfer:
        """Post a READ of the peer's ``remote[i]`` into ``local[i]``; the peer gets ``notif`` when done."""
        return self._xfer("READ", peer, local, remote, notif)

    def _xfer(self, op: str, peer: str, local: Any, remote: Any, notif: bytes) -> Transfer:
        agent = self._live()
        target = self._peer(peer, op)
        if not isinstance(notif, (bytes, bytearray)):
            raise TypeError(f"{op} notif must be bytes, not {type(notif).__name__}")
        src = _regions(local, f"{op} local")
        dst = _regions(remote, f"{op} remote")
        if not len(src) or len(src) != len(dst):
            raise ValueError(
                f"{op} with {peer!r}: {len(src)} local and {len(dst)} remote regions; give equal, non-zero counts"
            )
        if len(bad := np.flatnonzero(src[:, 1] != dst[:, 1])):
            i = int(bad[0])
            raise ValueError(
                f"{op} with {peer!r}: local[{i}] is {src[i, 1]} B but remote[{i}] is {dst[i, 1]} B; sizes must match"
            )
        local_mem, local_dev = self._local_kind(op, src)
        if not len(target.ranges):
            raise NixlError(
                f"{op} with {peer!r}: the peer advertised no regions; pass its regions_table to add_peer",
                peer=peer,
                op=op,
            )
        if len(bad := np.flatnonzero(~target.ranges.covers(dst))):
            i = int(bad[0])
            a, n = dst[i].tolist()
            raise NixlError(
                f"{op} with {peer!r}: remote[{i}] = [{a:#x}, +{n}) lies outside the regions the peer "
                f"advertised ({len(target.ranges)} range(s)); refresh its region table",
                peer=peer,
                op=op,
            )
        try:
            ldescs = agent.get_xfer_descs(_descs(src, local_dev), local_mem.value)
            rdescs = agent.get_xfer_descs(_descs(dst, target.device), target.mem.value)
            handle = agent.initialize_xfer(op, ldescs, rdescs, peer, bytes(notif))
        except Exception as exc:
            raise NixlError(
                f"{op} with {peer!r}: NIXL refused the transfer ({type(exc).__name__}: {exc}); "
                "was the peer's metadata taken after it registered this memory?",
                peer=peer,
                op=op,
            ) from exc
        t = Transfer(agent, handle, peer=peer, op=op, nbytes=int(src[:, 1].sum()))
        self._transfers.add(t)
        t._post()
        return t

    def _local_kind(self, op: str, rows: np.ndarray) -> tuple[Mem, int]:
        """The one (memory kind, device) of the registrations holding every row of ``rows``."""
        todo = np.ones(len(rows), dtype=bool)
        kinds = []
        for kind, ranges in self._local.items():
            hit = todo & ranges.covers(rows)
            if hit.any():
                kinds.append(kind)
                todo &= ~hit
        if len(missing := np.flatnonzero(todo)):
            i = int(missing[0])
            a, n = rows[i].tolist()
            raise ValueError(
                f"{op}: local[{i}] = [{a:#x}, +{n}) is not inside memory registered with endpoint {self.name!r}"
            )
        if len(kinds) > 1:
            raise ValueError(f"{op}: local regions span {sorted(kinds)}; one transfer takes one memory kind")
        return kinds[0]

    def _index_local(self) -> None:
        by_kind: dict[tuple[Mem, int], list[tuple[int, int]]] = {}
        for r in self._regs:
            by_kind.setdefault((r.mem, r.device), []).extend(r.regions)
        self._local = {k: _Ranges(v) for k, v in by_kind.items()}

    # ---- notifications and progress

    def progress(self) -> None:
        """Drive UCX progress and keep arriving notifications for ``notifications()``."""
        for peer, msgs in self._live().get_new_notifs().items():
            name = peer.decode() if isinstance(peer, bytes) else str(peer)
            self._inbox.setdefault(name, []).extend(bytes(m) for m in msgs)

    def notifications(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, by peer name (drives progress too)."""
        self.progress()
        inbox, self._inbox = self._inbox, {}
        return inbox

    def send_notif(self, peer: str, message: bytes) -> None:
        """A standalone notification to ``peer`` (small control data; not authenticated)."""
        self._peer(peer, "send_notif")
        try:
            self._live().send_notif(peer, bytes(message))
        except Exception as exc:
            raise NixlError(f"notification to {peer!r} failed ({exc})", peer=peer, op="send_notif") from exc

    # ---- lifecycle

    def close(self) -> None:
        """Release transfers, remove peers, deregister memory, drop the agent (idempotent)."""
        if self._agent is None:
            return
        for t in list(self._transfers):
            t.release()
        for peer in list(self._peers):
            self.remove_peer(peer)
        for reg in list(self._regs):
            self.deregister(reg)
        self._agent = None

    def __enter__(self) -> NixlEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _live(self) -> Any:
        if self._agent is None:
            raise NixlError(f"endpoint {self.name!r} is closed")
        return self._agent

    def _peer(self, peer: str, op: str) -> _Peer:
        try:
            return self._peers[peer]
        except KeyError:
            raise NixlError(
                f"{op}: {peer!r} is not a peer of endpoint {self.name!r} (known: {sorted(self._peers)}); "
                "add_peer its metadata first",
                peer=peer,
                op=op,
            ) from None


def _descs(rows: np.ndarray, device: int) -> np.ndarray:
    """N x 3 ``(addr, len, device)`` uint64 rows, the form ``get_xfer_descs`` takes fastest."""
    out = np.empty((len(rows), 3), dtype=np.uint64)
    out[:, :2] = rows
    out[:, 2] = device
    return out


def _device(device: Any) -> int:
    if isinstance(device, bool) or not isinstance(device, int) or device < 0:
        raise ValueError(f"device = {device!r}: give a GPU index >= 0 (0 for DRAM)")
    return device
