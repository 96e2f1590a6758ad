"""The trainer side: ``RefitClient.push_step()`` hands one rank's BF16 weights to the node's daemon.

    with RefitClient("ipc:///run/refitd/control.sock", rank=rank, world_size=world) as client:
        for step in range(steps):
            train(...)
            client.push_step(step, {"model.embed_tokens.weight": emb,             # a whole tensor
                                    "model.layers.0.mlp.experts.gate_up_proj":    # this rank's experts
                                        Shard(local_experts, global_shape=(E, 2 * I, H), offsets=(e0, 0, 0))})

Same-node clients (``ipc://``) write straight into the daemon's staging arena: one copy, and the
trainer's own memory is never exported. When the daemon stages through a ring of regions (GPU
arenas by default), each layer group is written once the daemon grants it a region (SLOT). Remote clients let the daemon READ their pieces over NIXL
when both sides have it (sidecar.daemon.pull: a contiguous CPU copy of each piece is registered for the
step), else stream raw frames over ZeroMQ under credits granted by the daemon (ZeroMQ's high-water
mark counts messages, not bytes); ``StepResult.mover`` says which. Any failure, on any
rank or in the daemon, raises the same ``RefitError`` on every rank.

While it builds, sends and copies a step's pieces the client pauses Python's cyclic garbage
collection (``sidecar.ops.gcpause``; never when the trainer already turned it off): a step of thousands of
tensors would otherwise trigger collections that walk the trainer's whole heap.

ZeroMQ sockets are not thread-safe: every socket operation happens on the client's one worker
thread, which also runs ``push_step_async``'s futures.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from sidecar.cli.keygen import curve_hint, set_client
from sidecar.errors import DaemonRestarted, ErrorKind, RefitError
from sidecar.ops.gcpause import gc_paused
from transport import nixl
from transport.cuda_ipc import open_any_arena
from transport.shm import ShmArena
from transport.wire import Kind, Limits, Message, ProtocolError, decode, dtype_name, encode

__all__ = ["DaemonRestarted", "RefitClient", "RefitError", "Shard", "StepResult"]

log = logging.getLogger("refitd.client")

DONE_BATCH_BYTES = 32 << 20  # local path: tell the daemon about written pieces at least this often
DONE_BATCH_PIECES = 512
#: local path: while copying pieces, look for an ERROR (and keep the daemon's heartbeat) this often,
#: not after every piece (a poll costs more than copying a small tensor)
POLL_INTERVAL_S = 0.001
#: a send the socket cannot take at once (no connection yet: e.g. a server refusing our CURVE key)
#: is retried this often until the step's deadline, never blocked on
SEND_RETRY_S = 0.05
#: on close, queued messages (an ABORT) get this long to leave; close() never waits longer
CLOSE_LINGER_MS = 100
#: local path: pieces of at most this many bytes are copied together (one foreach copy per PIECE_DONE
#: batch), not one torch call each
FOREACH_COPY_BYTES = 256 << 10


@dataclass(frozen=True, slots=True)
class Shard:
    """A slice of one global tensor held by this rank: ``global[offsets[d] : offsets[d] + tensor.shape[d]]``."""

    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "global_shape", tuple(int(d) for d in self.global_shape))
        object.__setattr__(self, "offsets", tuple(int(d) for d in self.offsets))


@dataclass(frozen=True, slots=True)
class StepResult:
    step: int
    generation: int
    bytes_in: int
    bytes_out: int
    seconds: dict[str, float]
    loads: list[dict[str, Any]] = field(default_factory=list)  # wait="loaded": each engine worker's ack
    # disaggregated trainer node: each inference daemon's forwarding state as this step went live
    peers: dict[str, dict[str, Any]] = field(default_factory=dict)
    # how this rank's bytes moved: "staging" (same node), "nixl" (the daemon READ them), "zmq" (frames),
    # "nixl+zmq" (some pieces each way); mover_reason says why NIXL was not (or not wholly) used
    mover: str = ""
    mover_reason: str = ""


@dataclass(slots=True)
class _Piece:
    name: str
    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    whole: bool = False  # the whole global tensor (offsets all 0): written without slicing

    def wire(self) -> list[Any]:
        shape = list(self.tensor.shape)
        return [
            self.name,
            dtype_name(self.tensor.dtype),
            shape if self.whole else list(self.global_shape),
            list(self.offsets),
            shape,
        ]


class RefitClient:
    """One trainer rank's connection to the daemon. ``close()`` (or ``with``) releases it."""

    def __init__(
        self,
        endpoint: str,
        rank: int,
        world_size: int,
        *,
        local: bool | None = None,
        timeout: float = 600.0,
        curve: tuple[bytes, bytes, bytes] | None = None,
        mover: str = "auto",
    ):
        """``curve``: (server public, client public, client secret) keys for a CURVE ``tcp://``
        endpoint, e.g. ``sidecar.cli.keygen.client_curve("node.key.pub", "trainer.key")``.
        ``mover``: ``"auto"`` lets a daemon that offers it pull remote shards over NIXL; ``"zmq"``
        always streams frames."""
        if mover not in ("auto", "zmq"):
            raise ValueError(f"mover={mover!r}: choose 'auto' or 'zmq'")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} must lie in [0, world_size={world_size})")
        self.endpoint, self.rank, self.world_size = endpoint, rank, world_size
        self.want_local = endpoint.startswith("ipc://") if local is None else local
        self.timeout, self.curve = timeout, curve
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"refitd-rank{rank}")
        self._ctx = zmq.Context()
        self._sock: zmq.Socket | None = None  # created and used on the worker thread only
        self._staging: ShmArena | None = None
        self._welcome: dict[str, Any] = {}
        self.instance: str | None = None  # the daemon instance of the latest WELCOME
        self._step_instance: str | None = None  # this step's daemon (None until its WELCOME)
        self._deadline = float("inf")  # the step in flight's: every wait and send ends by it
        self._credits = 0
        self._last_heard = 0.0
        self._last_sent = 0.0
        self._closed = False
        self.mover = mover
        self._nixl_ep: nixl.NixlEndpoint | None = None  # worker thread only, made on first use
        self._nixl_broken = ""  # why NIXL set-up failed here: frames from then on
        self._pulling = False  # the daemon may be READing: progress the endpoint while waiting
        self._pulled: dict[str, Any] | None = None  # the step's PULLED, whenever it arrives
        self._slots: dict[int, int] = {}  # staging ring: group -> region offset granted this step
        self._streams: dict[int, torch.cuda.Stream] = {}  # GPU staging: the copy stream per device
        self._ready_events: list = []  # CUDA events: the step's tensors are written once they fire

    # ------------------------------------------------------------------------------------------
    # public API

    def push_step(
        self,
        step: int,
        named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
        *,
        wait: str = "published",
        timeout: float | None = None,
    ) -> StepResult | Future:
        """Push this rank's part of ``step``.

        ``wait="published"`` (default) returns the StepResult once every rank's data is quantized and
        published; ``wait="loaded"`` also waits until every engine worker attached at publication
        loaded it (RefitError naming each worker that failed, or none attached); ``wait="committed"``
        returns as soon as the daemon holds all of this rank's bytes (the trainer may then change its
        tensors), with a Future for the publication. With a staging ring that is when the rank's last
        layer group is written, which waits for the groups before it to be quantized.
        """
        if wait not in ("published", "loaded", "committed"):
            raise ValueError(f"wait={wait!r}: choose 'published', 'loaded' or 'committed'")
        committed = threading.Event()
        future = self._submit(step, named_tensors, timeout, committed, loaded=wait == "loaded")
        if wait in ("published", "loaded"):
            return future.result()
        while not committed.wait(0.05):
            if future.done():
                future.result()  # raises the step's error
                break
        return future

    def push_step_async(
        self,
        step: int,
        named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
        *,
        timeout: float | None = None,
    ) -> Future:
        """Like ``push_step`` but returns at once with a Future of the StepResult.

        The tensors must stay unchanged until the future is done (or use ``wait="committed"``).
        """
        return self._submit(step, named_tensors, timeout, threading.Event())

    def close(self) -> None:
        """Release the connection. Never blocks for long: a step in flight stops at its next wait
        (within a heartbeat) with an UNAVAILABLE error, and queued messages get CLOSE_LINGER_MS."""
        if self._closed:
            return
        self._closed = True
        self._executor.submit(self._close_on_worker).result()
        self._executor.shutdown(wait=True)
        self._ctx.term()

    def __enter__(self) -> RefitClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------

    def _submit(self, step, named_tensors, timeout, committed, *, loaded: bool = False) -> Future:
        if self._closed:
            raise RefitError("the client is closed", kind=ErrorKind.UNAVAILABLE, rank=self.rank, step=step)
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        pieces = _pieces(named_tensors)
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        # on the caller's thread: its current streams hold the work that wrote the tensors
        ready = [
            torch.cuda.current_stream(d).record_event()
            for d in {p.tensor.device for p in pieces if p.tensor.is_cuda}
        ]
        return self._executor.submit(self._push, step, pieces, deadline, committed, loaded, ready)

    def _close_on_worker(self) -> None:
        if self._nixl_ep is not None:
            self._nixl_ep.close()
            self._nixl_ep = None
        self._drop_connection()

    def _drop_connection(self) -> None:
        """Forget the daemon this client talked to: its socket (and anything queued on it either
        way) and its staging mapping. The next push says HELLO on a fresh socket."""
        if self._staging is not None:
            self._staging.close()
            self._staging = None
        if self._sock is not None:
            self._sock.close(linger=CLOSE_LINGER_MS)
            self._sock = None
        self._welcome, self._slots, self._credits = {}, {}, 0

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            self._sock = self._ctx.socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)
            set_client(self._sock, self.curve)
            self._sock.connect(self.endpoint)
        return self._sock

    def _send(self, kind: Kind, fields: dict[str, Any], frames=()) -> None:
        """Send without ever blocking past the step's deadline. A socket that cannot take the message
        (no connection: a server refusing our CURVE key never completes the handshake) is retried
        until then, and the step fails with TIMEOUT."""
        self._send_within(kind, fields, frames, wait=True)

    def _try_send(self, kind: Kind, fields: dict[str, Any]) -> None:
        """A courtesy message (PING, ABORT): dropped if the socket cannot take it at once."""
        self._send_within(kind, fields, (), wait=False)

    def _send_within(self, kind: Kind, fields: dict[str, Any], frames, *, wait: bool) -> None:
        sock, parts = self._socket(), encode(Message(kind, fields, list(frames)))
        while True:
            try:
                sock.send_multipart(parts, zmq.NOBLOCK, copy=False)
                break
            except zmq.Again:
                left = self._deadline - time.monotonic()
                if not wait:
                    return
                if left <= 0:
                    step = fields.get("step")
                    raise RefitError(
                        f"rank {self.rank} could not send {kind.name} to {self.endpoint} within the step's "
                        "timeout: no connection to the daemon came up" + curve_hint(self.curve),
                        kind=ErrorKind.TIMEOUT,
                        rank=self.rank,
                        step=step if isinstance(step, int) else None,
                    ) from None
                if self._closed:
                    raise self._closed_error(fields.get("step")) from None
                sock.poll(int(min(left, SEND_RETRY_S) * 1000) + 1, zmq.POLLOUT)
        self._last_sent = time.monotonic()

    def _closed_error(self, step: Any) -> RefitError:
        return RefitError(
            "the client was closed while the step was in flight",
            kind=ErrorKind.UNAVAILABLE,
            rank=self.rank,
            step=step if isinstance(step, int) else None,
        )

    def _push(
        self,
        step: int,
        pieces: list[_Piece],
        deadline: float,
        committed: threading.Event,
        loaded: bool = False,
        ready: list | None = None,
    ) -> StepResult:
        try:
            self._slots, self._ready_events, self._deadline = {}, ready or [], deadline
            self._hello(step, deadline)
            with gc_paused():
                begin = {"step": step, "rank": self.rank, "pieces": [p.wire() for p in pieces]}
            srcs, reg, why = None, None, ""
            if not self._welcome.get("local"):
                for event in self._ready_events:  # the trainer's writes land before reading to host
                    event.synchronize()
                with gc_paused():
                    srcs = [_cpu(p.tensor) for p in pieces]
                    offer, reg, why = self._nixl_offer(srcs)
                if offer is not None:
                    begin["nixl"] = offer
            try:
                self._send(Kind.BEGIN, begin)
                ready = self._await(step, deadline, {Kind.READY}).fields
                ids = ready.get("pieces", [])
                if len(ids) != len(pieces):
                    raise ProtocolError(f"READY lists {len(ids)} pieces, this rank declared {len(pieces)}")
                if "skip" in ready:  # outside the daemon's node share: those pieces are not sent
                    pieces, ids, srcs = _without_skipped(ready["skip"], pieces, ids, srcs)
                self._credits = int(ready.get("credit_frames", 1))
                if "ring" in ready:
                    mover, why = self._write_ring(step, pieces, ids, ready, deadline, srcs)
                elif "staging" in ready:
                    self._write_local(step, pieces, ids, ready["staging"], deadline)
                    mover = "staging"
                else:
                    mover, why = self._send_remote(step, pieces, srcs, ids, ready, reg, why, deadline)
            finally:
                self._pulling = False
                if reg is not None:
                    self._nixl_ep.deregister(reg)
            self._send(Kind.COMMIT, {"step": step, "rank": self.rank})
            self._await(step, deadline, {Kind.ACK})
            committed.set()
            result = self._await(step, deadline, {Kind.RESULT}).fields
            loads: list[dict[str, Any]] = []
            if loaded:
                report = self._await(step, deadline, {Kind.LOADED}).fields
                if not report.get("ok"):
                    raise RefitError(str(report.get("message")), kind=ErrorKind.ENGINE, step=step)
                loads = list(report.get("results", []))
            return StepResult(
                step=step,
                generation=int(result["generation"]),
                bytes_in=int(result["bytes_in"]),
                bytes_out=int(result["bytes_out"]),
                seconds=dict(result.get("seconds", {})),
                loads=loads,
                peers=dict(result.get("peers") or {}),
                mover=mover,
                mover_reason=why,
            )
        except RefitError as exc:
            if exc.kind in (ErrorKind.TIMEOUT, ErrorKind.UNAVAILABLE):
                self._drop_connection()  # whatever is queued on it belongs to this step: start afresh
            raise
        except ProtocolError as exc:
            self._abort(step, f"protocol error: {exc}")
            raise RefitError(str(exc), kind=ErrorKind.PROTOCOL, rank=self.rank, step=step) from None
        except (ValueError, TypeError, RuntimeError) as exc:
            self._abort(step, f"{type(exc).__name__}: {exc}")
            raise RefitError(
                f"rank {self.rank} could not send its data: {exc}",
                kind=ErrorKind.INVALID,
                rank=self.rank,
                step=step,
            ) from exc

    def _abort(self, step: int, reason: str) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._try_send(Kind.ABORT, {"step": step, "rank": self.rank, "reason": reason})

    def _hello(self, step: int, deadline: float) -> None:
        self._send(
            Kind.HELLO,
            {
                "rank": self.rank,
                "world_size": self.world_size,
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "local": self.want_local,
            },
        )
        self._last_heard = time.monotonic()
        self._step_instance = None  # until WELCOME: stale replies to an earlier connection are ignored
        welcome = self._await(step, deadline, {Kind.WELCOME}, silence_ok=True).fields
        instance = welcome.get("instance")
        if self.instance is not None and instance != self.instance:
            log.warning(
                "rank %d: the daemon at %s restarted between steps (instance %s -> %s); reconnected",
                self.rank,
                self.endpoint,
                self.instance,
                instance,
                extra={"step": step, "rank": self.rank},
            )
            if self._staging is not None:  # the old daemon's segment: never written again
                self._staging.close()
                self._staging = None
        self._welcome, self.instance = welcome, instance
        self._step_instance = instance if isinstance(instance, str) else None

    # ---- waiting

    def _keepalive(self, step: int, deadline: float, what: str, *, silence_ok: bool = False) -> None:
        """Raise on a passed deadline (aborting the step) or a silent daemon; ping when one is due."""
        if self._closed:
            raise self._closed_error(step)
        now = time.monotonic()
        if now > deadline:
            self._abort(step, f"rank {self.rank} timed out {what}")
            hint = curve_hint(self.curve) if "WELCOME" in what else ""  # never heard from the daemon
            raise RefitError(
                f"rank {self.rank} timed out {what}{hint}", kind=ErrorKind.TIMEOUT, rank=self.rank, step=step
            )
        if not silence_ok and now - self._last_heard > self._silence_limit():
            raise RefitError(
                f"the daemon at {self.endpoint} stopped answering ({now - self._last_heard:.1f} s of silence)"
                + curve_hint(self.curve),
                kind=ErrorKind.UNAVAILABLE,
                rank=self.rank,
                step=step,
            )
        if now - self._last_sent > self._heartbeat():
            self._try_send(Kind.PING, {"step": step, "rank": self.rank})

    def _heartbeat(self) -> float:
        return float(self._welcome.get("heartbeat_interval_s", 1.0))

    def _silence_limit(self) -> float:
        return max(3 * self._heartbeat(), float(self._welcome.get("rank_timeout_s", 10.0)))

    def _await(self, step: int, deadline: float, kinds: set[Kind], *, silence_ok: bool = False) -> Message:
        """The next message of ``kinds`` for ``step``; raises on an ERROR for it, a timeout or a silent daemon."""
        sock = self._socket()
        what = "waiting for " + "/".join(k.name for k in kinds)
        while True:
            self._keepalive(step, deadline, what, silence_ok=silence_ok)
            wait = min(self._heartbeat(), max(0.001, deadline - time.monotonic()))
            if self._pulling:  # the daemon READs from this process: progress the endpoint meanwhile
                self._progress_nixl()
                wait = 0.001
            if not sock.poll(int(wait * 1000)):
                continue
            msg = self._recv(sock)
            self._last_heard = time.monotonic()
            if self._handle_async(msg, step):
                continue
            if msg.kind in kinds and msg.get("step", step) == step:
                return msg

    def _recv(self, sock: zmq.Socket) -> Message:
        frames = sock.recv_multipart(copy=False)
        with gc_paused():  # a READY lists every piece (and the staging layout): many small objects
            return decode(frames, Limits(max_header_bytes=256 << 20))

    def _handle_async(self, msg: Message, step: int) -> bool:
        """Credits and errors that may arrive at any time; True if consumed. Raises DaemonRestarted
        when a reply comes from another daemon instance than this step's, or the daemon no longer
        knows this client."""
        instance = msg.get("instance")
        unknown = msg.kind is Kind.ERROR and msg.get("kind") == ErrorKind.UNKNOWN_PEER.value
        if self._step_instance is None:  # waiting for WELCOME: replies to what an earlier step sent
            if unknown:
                log.debug("rank %d ignored a stale reply before WELCOME: %s", self.rank, msg.get("message"))
                return True
        elif unknown or (isinstance(instance, str) and instance != self._step_instance):
            self._restarted(step, instance if isinstance(instance, str) else None)
        if msg.kind is Kind.CREDIT:
            if msg.get("step") == step:
                self._credits += int(msg.get("frames", 1))
            return True
        if msg.kind is Kind.SLOT:
            if msg.get("step") == step:
                self._slots[int(msg.require("group", int))] = int(msg.require("offset", int))
            return True
        if msg.kind is Kind.PULLED:
            if msg.get("step") == step:
                self._pulled = msg.fields
            return True
        if msg.kind is Kind.ERROR:
            err = RefitError.from_wire(msg.fields)
            if err.step in (None, step):
                raise err
            return True  # a stale error about an earlier step
        return msg.kind is Kind.PONG

    def _restarted(self, step: int, new: str | None) -> None:
        """The step's daemon is gone (or forgot this client): drop the connection, fail the step once."""
        old = self._step_instance
        self._step_instance = None
        if new is not None:
            self.instance = new  # the next WELCOME from it is no news
        self._drop_connection()
        if new is None or new == old:
            what = f"the daemon (instance {old}) no longer knows this client"
        else:
            what = f"daemon restarted (instance {old} -> {new})"
        log.warning(
            "rank %d: %s; step %d was lost", self.rank, what, step, extra={"step": step, "rank": self.rank}
        )
        raise DaemonRestarted(
            f"{what}; step {step} was lost, push again", old=old, new=new, rank=self.rank, step=step
        )

    def _poll_async(self, step: int) -> None:
        self._progress_nixl()
        sock = self._socket()
        while sock.poll(0):
            msg = self._recv(sock)
            self._last_heard = time.monotonic()
            self._handle_async(msg, step)

    # ---- data

    def _write_local(
        self, step: int, pieces: list[_Piece], ids: list[int], handle: dict, deadline: float
    ) -> None:
        """Whole-step staging: every piece into its tensor's slot of the arena."""
        self._open_staging(handle)
        views = self._staging.tensors()  # device-to-device copies through the mapped handle on GPUs
        self._copy_in(step, ((p, pid, views[p.name]) for p, pid in zip(pieces, ids)), deadline)

    def _write_ring(self, step: int, pieces, ids, ready: dict, deadline: float, srcs=None) -> tuple[str, str]:
        """Staging ring: write each of this rank's layer groups once the daemon grants it a region
        (SLOT), in whatever order the grants come; the daemon quantizes a group, then reuses its
        region for a later one. Same node: straight into the region; else ZeroMQ frames."""
        placement = ready.get("placement")
        if not isinstance(placement, list) or len(placement) != len(pieces):
            raise ProtocolError(
                f"READY places {len(placement or ())} pieces, this rank declared {len(pieces)}"
            )
        local = "staging" in ready
        if local:
            self._open_staging(ready["staging"])
        groups: dict[int, list[tuple[_Piece, int, int, Any]]] = {}
        for i, (piece, pid, (group, rel)) in enumerate(zip(pieces, ids, placement)):
            src = srcs[i] if srcs is not None else None  # remote: the host copy made for the step
            groups.setdefault(int(group), []).append((piece, pid, int(rel), src))
        sock = self._socket()
        while groups:
            granted = [g for g in groups if g in self._slots]
            if not granted:
                self._keepalive(step, deadline, "waiting for a staging region (SLOT)")
                if sock.poll(int(self._heartbeat() * 1000)):
                    msg = self._recv(sock)
                    self._last_heard = time.monotonic()
                    self._handle_async(msg, step)
                continue
            for g in granted:
                rows, offset = groups.pop(g), self._slots.pop(g)
                if local:
                    self._write_group(step, rows, offset, deadline)
                else:
                    host = [r[3] for r in rows] if srcs is not None else None
                    self._stream_remote(step, [r[0] for r in rows], [r[1] for r in rows], deadline, srcs=host)
        if local:
            return "staging", ""
        return "zmq", str(ready.get("mover_reason") or "")

    def _open_staging(self, handle: dict) -> None:
        if self._staging is None or self._staging.name != handle.get("name"):
            if self._staging is not None:
                self._staging.close()
            self._staging = open_any_arena(handle, writable=True)

    def _write_group(self, step: int, rows, offset: int, deadline: float) -> None:
        """One granted group: each piece into its tensor's place in the region at ``offset``."""
        view = self._staging.view
        dests = ((p, pid, view(offset + rel, p.tensor.dtype, p.global_shape)) for p, pid, rel, _ in rows)
        self._copy_in(step, dests, deadline)

    def _copy_in(self, step: int, dests, deadline: float) -> None:
        """Copy each ``(piece, id, its global tensor in staging)``; PIECE_DONE every batch."""
        # many small copies make many small objects: no collections meanwhile
        with gc_paused(), self._copy_stream():
            self._copy_pieces(step, dests, deadline)

    @contextlib.contextmanager
    def _copy_stream(self) -> Iterator[None]:
        """GPU staging: the copies run on a stream of the client's own, which first waits for what
        the trainer had queued when it called push_step (the work that wrote the tensors). They then
        neither queue behind the trainer's later work nor hold it up, and PIECE_DONE waits for the
        copies alone, not for the whole device."""
        if self._staging is None or getattr(self._staging, "kind", "shm") == "shm":
            yield
            return
        device = torch.device("cuda", self._staging.device)
        stream = self._streams.get(device.index)
        if stream is None:
            stream = self._streams[device.index] = torch.cuda.Stream(device)
        for event in self._ready_events:
            stream.wait_event(event)
        with torch.cuda.stream(stream):
            yield

    def _copy_pieces(self, step: int, dests, deadline: float) -> None:
        batch, batch_bytes, region = [], 0, None
        next_poll = 0.0
        regions: list[torch.Tensor] = []  # small copies wait for one foreach copy before PIECE_DONE
        srcs: list[torch.Tensor] = []
        for piece, pid, full in dests:
            src = piece.tensor
            if piece.whole and full.shape == src.shape:
                region = full
            else:
                region = full[tuple(slice(o, o + s) for o, s in zip(piece.offsets, src.shape))]
            nbytes = src.numel() * src.element_size()
            if (
                nbytes <= FOREACH_COPY_BYTES
                and region.shape == src.shape
                and region.dtype == src.dtype
                and region.device == src.device
            ):
                regions.append(region)
                srcs.append(src)
            else:
                region.copy_(src)
            batch.append(pid)
            batch_bytes += nbytes
            if batch_bytes >= DONE_BATCH_BYTES or len(batch) >= DONE_BATCH_PIECES:
                _copy_all(regions, srcs)
                self._pieces_done(step, batch, region)
                batch, batch_bytes = [], 0
            now = time.monotonic()
            if now >= next_poll:
                self._poll_async(step)
                self._keepalive(step, deadline, "writing its shards")
                next_poll = now + POLL_INTERVAL_S
        if batch:
            _copy_all(regions, srcs)
            self._pieces_done(step, batch, region)

    def _pieces_done(self, step: int, batch: list[int], last: torch.Tensor | None) -> None:
        if last is not None and last.is_cuda:  # copies are asynchronous: they land before the daemon reads
            torch.cuda.current_stream(last.device).synchronize()  # the copy stream (_copy_stream)
        self._send(Kind.PIECE_DONE, {"step": step, "pieces": batch})

    def _nixl_offer(self, srcs: list[torch.Tensor]) -> tuple[dict[str, Any] | None, Any, str]:
        """BEGIN's ``nixl`` field (agent metadata, one ``[addr, nbytes]`` per piece) with the step's
        registration, or ``(None, None, why not)``."""
        if self.mover == "zmq":
            return None, None, "mover=zmq"
        if "nixl" not in self._welcome.get("pull", ()):
            return None, None, "the daemon does not offer NIXL pulls"
        if self._nixl_broken:
            return None, None, self._nixl_broken
        ok, why = nixl.available()
        if not ok:
            return None, None, f"NIXL is unavailable here: {why}"
        rows = [(t.data_ptr(), t.numel() * t.element_size()) for t in srcs]
        regions = [[a, n] if n else [0, 0] for a, n in rows]
        try:
            if self._nixl_ep is None:
                self._nixl_ep = nixl.NixlEndpoint(
                    f"refitd-client-{socket.gethostname()}-{os.getpid()}-r{self.rank}-{id(self):x}"
                )
        except (nixl.NixlError, ValueError, TypeError) as exc:  # no endpoint: frames from now on
            self._nixl_broken = f"NIXL set-up failed here: {type(exc).__name__}: {exc}"
            return None, None, self._nixl_broken
        reg = None
        try:  # this step's copies only: frames for this step if they cannot be registered
            live = [(a, n) for a, n in rows if n]
            reg = self._nixl_ep.register(live) if live else None
            md = self._nixl_ep.metadata()
        except (nixl.NixlError, ValueError, TypeError) as exc:
            if reg is not None:
                self._nixl_ep.deregister(reg)
            return None, None, f"NIXL registration failed here: {type(exc).__name__}: {exc}"
        return {"md": md, "regions": regions}, reg, ""

    def _send_remote(self, step, pieces, srcs, ids, ready, reg, why, deadline) -> tuple[str, str]:
        """Frames for the pieces the daemon does not pull; then wait until it pulled the rest (frames
        for any whose READ failed). Returns the mover and why NIXL was not (wholly) used."""
        pull = set(ready.get("pull") or ()) if reg is not None else set()
        why = why or str(ready.get("mover_reason") or "")
        self._pulling, self._pulled = bool(pull), None
        rest = [i for i, pid in enumerate(ids) if pid not in pull]
        self._stream_remote(
            step, [pieces[i] for i in rest], [ids[i] for i in rest], deadline, srcs=[srcs[i] for i in rest]
        )
        if not pull:
            return "zmq", why
        sock = self._socket()
        while self._pulled is None:  # it may have arrived already, while frames were streamed
            self._keepalive(step, deadline, "waiting for the daemon to pull its shards (PULLED)")
            self._progress_nixl()
            if sock.poll(1):
                msg = self._recv(sock)
                self._last_heard = time.monotonic()
                self._handle_async(msg, step)
        pulled, self._pulled, self._pulling = self._pulled, None, False
        failed = set(pulled.get("failed") or ())
        if failed:
            why = str(pulled.get("reason") or "the NIXL READ failed")
            again = [i for i, pid in enumerate(ids) if pid in failed]
            self._stream_remote(
                step,
                [pieces[i] for i in again],
                [ids[i] for i in again],
                deadline,
                srcs=[srcs[i] for i in again],
            )
            return "zmq", why
        return ("nixl+zmq" if rest else "nixl"), why

    def _progress_nixl(self) -> None:
        if self._pulling and self._nixl_ep is not None:
            try:
                self._nixl_ep.progress()
            except nixl.NixlError as exc:  # the daemon's READ then fails and it says so
                self._pulling = False
                self._nixl_broken = f"progressing the NIXL endpoint failed: {exc}"

    def _stream_remote(
        self, step: int, pieces: list[_Piece], ids: list[int], deadline: float, srcs=None
    ) -> None:
        limit = int(self._welcome.get("max_frame_bytes", 64 << 20))
        next_poll = 0.0
        for start in range(0, len(pieces), DONE_BATCH_PIECES):
            # many small frames make many small objects: at most one collection per run of pieces
            with gc_paused():
                for i in range(start, min(start + DONE_BATCH_PIECES, len(pieces))):
                    piece, pid = pieces[i], ids[i]
                    src = srcs[i] if srcs is not None else _cpu(piece.tensor)
                    whole = tuple(src.shape)
                    for rel, shape in _blocks(whole, src.element_size(), limit):
                        while self._credits <= 0:
                            self._await_credit(step, deadline)
                        if shape and shape != whole:
                            block = src[tuple(slice(o, o + s) for o, s in zip(rel, shape))]
                        else:
                            block = src
                        data = block.reshape(-1).view(torch.uint8).numpy() if block.numel() else b""
                        offsets = [o + r for o, r in zip(piece.offsets, rel)]
                        self._send(
                            Kind.SHARD,
                            {"step": step, "piece": pid, "offsets": offsets, "shape": list(shape)},
                            [data],
                        )
                        self._credits -= 1
                        now = time.monotonic()
                        if now >= next_poll:  # credits and errors; waiting for credit polls anyway
                            self._poll_async(step)
                            next_poll = now + POLL_INTERVAL_S

    def _await_credit(self, step: int, deadline: float) -> None:
        sock = self._socket()
        self._keepalive(step, deadline, "waiting for the daemon to take its data (credit)")
        self._progress_nixl()
        if sock.poll(1 if self._pulling else int(self._heartbeat() * 1000)):
            msg = self._recv(sock)
            self._last_heard = time.monotonic()
            self._handle_async(msg, step)


def _pieces(named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> list[_Piece]:
    """Normalize user input (tensors, Shards, lists of Shards) into pieces, validating each."""
    with gc_paused():  # many small objects at once: no collections meanwhile
        return _pieces_of(named_tensors)


def _pieces_of(named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> list[_Piece]:
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    pieces = []
    for name, value in items:
        for v in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(v, torch.Tensor):
                pieces.append(_Piece(name, v, tuple(v.shape), (0,) * v.dim(), True))
                continue
            if not isinstance(v, Shard):
                raise TypeError(f"{name!r}: expected a tensor or a Shard, got {type(v).__name__}")
            t, g, o = v.tensor, v.global_shape, v.offsets
            if not (len(g) == len(o) == t.dim()) or any(
                oo < 0 or oo + s > gg for oo, s, gg in zip(o, t.shape, g)
            ):
                raise ValueError(
                    f"{name!r}: shard of shape {list(t.shape)} at offsets {list(o)} does not fit the global "
                    f"shape {list(g)}"
                )
            pieces.append(_Piece(name, t, g, o))
    return pieces


def _without_skipped(skip: Any, pieces: list[_Piece], ids: list[Any], srcs: list | None) -> tuple:
    """``pieces``, ``ids`` and ``srcs`` without the pieces READY listed under ``skip`` (they lie
    outside the node share the daemon publishes)."""
    if not isinstance(skip, list) or any(type(pid) is not int for pid in skip) or not set(skip) <= set(ids):
        shown = f"a list of {len(skip)}" if isinstance(skip, list) else f"a {type(skip).__name__}"
        raise ProtocolError(
            f"READY's skip must list piece ids READY gave this rank, got {shown} that does not: the "
            "daemon and the client disagree on the protocol; run the same refitd version on both"
        )
    drop = set(skip)
    keep = [i for i, pid in enumerate(ids) if pid not in drop]
    if len(keep) < len(ids):
        log.debug("skipping %d piece(s) outside the daemon's node share", len(ids) - len(keep))
    return (
        [pieces[i] for i in keep],
        [ids[i] for i in keep],
        None if srcs is None else [srcs[i] for i in keep],
    )


def _copy_all(dests: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for each pair, in one call for a batch of small tensors; empties both lists."""
    if dests:
        torch._foreach_copy_(dests, srcs)
        dests.clear()
        srcs.clear()


def _cpu(tensor: torch.Tensor) -> torch.Tensor:
    src = tensor.detach()
    return (src.cpu() if src.device.type != "cpu" else src).contiguous()


def _blocks(
    shape: tuple[int, ...], itemsize: int, limit: int
) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Split a C-contiguous ``shape`` into contiguous sub-blocks of at most ``limit`` bytes each.

    Each block fixes the leading indices, takes a range along one dim and all of the dims after it.
    """
    nd = len(shape)
    if itemsize > limit:
        raise ValueError(f"a single element of {itemsize} bytes exceeds the frame limit {limit}")
    if nd == 0 or itemsize * _prod(shape) <= limit:
        yield (0,) * nd, shape
        return
    k = next(k for k in range(1, nd + 1) if itemsize * _prod(shape[k:]) <= limit)
    row = itemsize * _prod(shape[k:])
    step = max(1, limit // row)
    for lead in itertools.product(*(range(d) for d in shape[: k - 1])):
        for r0 in range(0, shape[k - 1], step):
            r1 = min(shape[k - 1], r0 + step)
            yield (*lead, r0, *(0,) * (nd - k)), (*(1,) * len(lead), r1 - r0, *shape[k:])


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
