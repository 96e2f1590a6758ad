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

This module is the session (HELLO/WELCOME, BEGIN/READY, COMMIT/ACK/RESULT, heartbeats, errors, a
restarted daemon); the bytes move through two components that get a narrow ``Link`` to it:
``sidecar.client.local.StagingWriter`` (same node) and ``sidecar.client.remote.RemoteSender`` (NIXL
or frames). ``sidecar.client.pieces`` holds ``Shard``, ``StepResult`` and the pure helpers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import zmq

from sidecar.client.local import StagingWriter
from sidecar.client.pieces import Link, Piece, Shard, StepPieces, StepResult, host_copy, packed_rows, pieces
from sidecar.client.placement import placed_row, ring_arenas
from sidecar.client.remote import RemoteSender
from sidecar.client.replicated import owned_items, piece_owners
from sidecar.client.stream import StreamFeed, write_stream
from sidecar.errors import DaemonRestarted, ErrorKind, RefitError
from sidecar.ops.gcpause import gc_paused
from transport.curve import curve_hint, set_client
from transport.wire import Kind, Limits, Message, ProtocolError, decode, encode

__all__ = ["DaemonRestarted", "RefitClient", "RefitError", "Shard", "StepResult"]

log = logging.getLogger("refitd.client")

#: a send the socket cannot take at once (no connection yet: e.g. a server refusing our CURVE key)
#: is retried this often until the step's deadline, never blocked on
SEND_RETRY_S = 0.05
#: on close, queued messages (an ABORT) get this long to leave; close() never waits longer
CLOSE_LINGER_MS = 100


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
        endpoint, e.g. ``transport.curve.client_curve("node.key.pub", "trainer.key")``.
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
        self._welcome: dict[str, Any] = {}
        self.instance: str | None = None  # the daemon instance of the latest WELCOME
        self._step_instance: str | None = None  # this step's daemon (None until its WELCOME)
        #: this push's number, in its HELLO and every message after it; the daemon names it in every
        #: answer, and answers naming another (a late answer to a push that failed) are ignored
        self._attempt = 0
        self._deadline = float("inf")  # the step in flight's: every wait and send ends by it
        self._last_heard = 0.0
        self._last_sent = 0.0
        self._closed = False
        self.mover = mover
        self._slots: dict[int, int] = {}  # staging ring: group -> region offset granted this step
        #: several GPUs: group -> the staging arena (index) its SLOT named; absent: arena 0
        self._slot_arenas: dict[int, int] = {}
        self._step_pieces = StepPieces()  # the last step's pieces and BEGIN rows, while unchanged
        #: while waiting for READY: the ranks the daemon last said have not begun (its PONGs)
        self._waiting_for: list[int] = []
        # the two data paths, given a narrow view of this connection (worker thread only)
        link = Link(send=self._send, keepalive=self._keepalive, poll=self._poll, heartbeat=self._heartbeat)
        self._local = StagingWriter(link)
        self._remote = RemoteSender(link, rank=rank, mover=mover)

    # ------------------------------------------------------------------------------------------
    # public API

    def push_step(
        self,
        step: int,
        named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
        *,
        wait: str = "published",
        timeout: float | None = None,
        declare: Mapping[str, Any] | Iterable[tuple[str, Any]] | None = None,
        replicated: bool = False,
    ) -> StepResult | Future:
        """Push this rank's part of ``step``.

        ``named_tensors``: a mapping or (name, value) pairs; a value is a tensor (this rank sends all
        of it), a ``Shard`` or a list of them, or a DTensor (``sidecar.client.dtensor``: this rank's
        local shard where it lies, never gathered). With ``declare`` (the same kind of mapping, of
        meta tensors: ``sidecar.plan.build.meta_state_dict(config)``) ``named_tensors`` is a stream
        (a Megatron-Bridge export): BEGIN declares ``declare``'s pieces, then the stream is read on
        this thread one item at a time, each written to the daemon as it comes and never kept, so
        the whole model is never held at once. Each item must be one of the declared pieces; a
        missing, extra, repeated or mismatched one fails the step (nothing is published). The stream
        is read only once this rank's BEGIN is out.

        ``replicated=True``: every rank passes the same whole tensors (a gathered export read on
        every rank, e.g. ``bridge.export_hf_weights(model)`` on every TP/EP/PP rank, with the same
        ``declare``), and each tensor is sent by exactly one rank, the bytes spread over the ranks
        (``sidecar.client.replicated``); every rank reads the whole stream (its collectives run in
        lockstep) and drops what another rank sends as it comes. Every rank of the step makes this
        same call; one that never does is named in the others' errors.

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
        future = self._start(step, named_tensors, timeout, committed, wait == "loaded", declare, replicated)
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
        declare: Mapping[str, Any] | Iterable[tuple[str, Any]] | None = None,
        replicated: bool = False,
    ) -> Future:
        """Like ``push_step`` but returns at once with a Future of the StepResult; with ``declare``
        once the stream is read (on this thread), its last items possibly still being written.

        The tensors must stay unchanged until the future is done (or use ``wait="committed"``).
        """
        return self._start(step, named_tensors, timeout, threading.Event(), False, declare, replicated)

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

    def _start(self, step, named_tensors, timeout, committed, loaded, declare, replicated) -> Future:
        """Submit the step; a stream (``declare``) is then read on this thread."""
        if declare is None:
            if replicated:
                named_tensors = owned_items(named_tensors, self.rank, self.world_size)
            return self._submit(step, named_tensors, timeout, committed, loaded=loaded)
        feed = StreamFeed()
        future = self._submit(
            step, declare, timeout, committed, loaded=loaded, feed=feed, replicated=replicated
        )
        feed.pour(named_tensors, future)  # on this thread: the trainer's export runs here
        return future

    def _submit(
        self, step, named_tensors, timeout, committed, *, loaded: bool = False, feed=None, replicated=False
    ) -> Future:
        if self._closed:
            raise RefitError("the client is closed", kind=ErrorKind.UNAVAILABLE, rank=self.rank, step=step)
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        if feed is not None:  # a stream: BEGIN declares these pieces (meta tensors), the feed brings the data
            rows = pieces(named_tensors)
            deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
            if replicated:  # this rank declares what it sends; the others' items are dropped as they come
                owner = piece_owners(rows, self.world_size)
                rows = [p for p in rows if owner[p.name] == self.rank]
                feed.others = frozenset(n for n, r in owner.items() if r != self.rank)
                feed.drain_until = deadline
            feed.declared = rows
            return self._executor.submit(self._push, step, rows, deadline, committed, loaded, [], None, feed)
        rows, packed = self._step_pieces.of(named_tensors)
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        # on the caller's thread: its current streams hold the work that wrote the tensors
        ready = [
            torch.cuda.current_stream(d).record_event()
            for d in {p.tensor.device for p in rows if p.tensor.is_cuda}
        ]
        return self._executor.submit(self._push, step, rows, deadline, committed, loaded, ready, packed)

    def _close_on_worker(self) -> None:
        self._remote.close()
        self._drop_connection()

    def _drop_connection(self) -> None:
        """Forget the daemon this client talked to: its socket (and anything queued on it either
        way) and its staging mapping. The next push says HELLO on a fresh socket."""
        self._local.close()
        if self._sock is not None:
            self._sock.close(linger=CLOSE_LINGER_MS)
            self._sock = None
        self._welcome, self._slots, self._remote.credits = {}, {}, 0

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
        if "attempt" not in fields:
            fields = {**fields, "attempt": self._attempt}
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
        pieces: list[Piece],
        deadline: float,
        committed: threading.Event,
        loaded: bool = False,
        ready: list | None = None,
        packed: bytes | None = None,
        feed: StreamFeed | None = None,
    ) -> StepResult:
        try:
            self._slots, self._local.ready_events, self._deadline = {}, ready or [], deadline
            self._slot_arenas = {}
            self._hello(step, deadline)
            # the rows packed once (StepPieces): the daemon compares them with the last step's
            begin = {
                "step": step,
                "rank": self.rank,
                "pieces": packed_rows(pieces) if packed is None else packed,
            }
            srcs, reg, why = None, None, ""
            if not self._welcome.get("local") and feed is None:
                for event in self._local.ready_events:  # the trainer's writes land before reading to host
                    event.synchronize()
                with gc_paused():
                    srcs = [host_copy(p.tensor) for p in pieces]
                    offer, reg, why = self._remote.offer(srcs, self._welcome)
                if offer is not None:
                    begin["nixl"] = offer
            try:
                self._send(Kind.BEGIN, begin)
                if feed is not None:
                    feed.begun.set()  # the trainer's thread may read the stream now
                ready = self._await(step, deadline, {Kind.READY}).fields
                ids = ready.get("pieces", [])
                if len(ids) != len(pieces):
                    raise ProtocolError(f"READY lists {len(ids)} pieces, this rank declared {len(pieces)}")
                if "skip" in ready:  # outside the daemon's node share: those pieces are not sent
                    pieces, ids, srcs = _without_skipped(ready["skip"], pieces, ids, srcs)
                self._remote.credits = int(ready.get("credit_frames", 1))
                if feed is not None:
                    mover, why = write_stream(self, step, pieces, ids, ready, feed, deadline)
                elif "ring" in ready:
                    mover, why = self._write_ring(step, pieces, ids, ready, deadline, srcs, reg=reg)
                elif "staging" in ready:
                    self._local.write_step(step, pieces, ids, ready["staging"], deadline)
                    mover = "staging"
                else:
                    limit = self._frame_limit()
                    mover, why = self._remote.send(step, pieces, srcs, ids, ready, reg, why, deadline, limit)
            finally:
                self._remote.finish(reg)
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
        """Open a new attempt: what the daemon still sends about an earlier one is ignored from now on."""
        self._attempt += 1
        self._waiting_for = []
        self._send(
            Kind.HELLO,
            {
                "rank": self.rank,
                "world_size": self.world_size,
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "local": self.want_local,
                "attempt": self._attempt,
                "step": step,
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
            self._local.close()  # the old daemon's segment: never written again
        self._welcome, self.instance = welcome, instance
        self._step_instance = instance if isinstance(instance, str) else None

    # ---- waiting

    def _keepalive(self, step: int, deadline: float, what: str, *, silence_ok: bool = False) -> None:
        """Raise on a passed deadline (aborting the step) or a silent daemon; ping when one is due."""
        if self._closed:
            raise self._closed_error(step)
        now = time.monotonic()
        if now > deadline:
            hint = curve_hint(self.curve) if "WELCOME" in what else ""  # never heard from the daemon
            if "READY" in what and self._waiting_for:
                hint = (
                    f": rank(s) {self._waiting_for} of {self.world_size} never began step {step} (no BEGIN "
                    "reached the daemon); every rank must call push_step for every step, at the same point "
                    "(a gathered export: the same call on every rank, with replicated=True)"
                )
            self._abort(step, f"rank {self.rank} timed out {what}{hint}")
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

    def _frame_limit(self) -> int:
        return int(self._welcome.get("max_frame_bytes", 64 << 20))

    def _silence_limit(self) -> float:
        return max(3 * self._heartbeat(), float(self._welcome.get("rank_timeout_s", 10.0)))

    def _await(self, step: int, deadline: float, kinds: set[Kind], *, silence_ok: bool = False) -> Message:
        """The next message of ``kinds`` for ``step``; raises on an ERROR for it, a timeout or a silent daemon."""
        sock = self._socket()
        what = "waiting for " + "/".join(k.name for k in kinds)
        while True:
            self._keepalive(step, deadline, what, silence_ok=silence_ok)
            wait = min(self._heartbeat(), max(0.001, deadline - time.monotonic()))
            if self._remote.pulling:  # the daemon READs from this process: progress the endpoint meanwhile
                self._remote.progress()
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
        knows this client. A message naming an attempt other than this push's answers an earlier
        push (its late COMMIT, say) and is ignored, an ERROR included; one naming none (a step's
        failure told before this push's HELLO reached the daemon) is taken as before."""
        attempt = msg.get("attempt")
        if attempt is not None and attempt != self._attempt:
            log.debug(
                "rank %d ignored %s answering its attempt %r (now %d): %s",
                self.rank,
                msg.kind.name,
                attempt,
                self._attempt,
                msg.get("message", ""),
            )
            return True
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
                self._remote.credits += int(msg.get("frames", 1))
            return True
        if msg.kind is Kind.SLOT:
            if msg.get("step") == step:
                group = int(msg.require("group", int))
                self._slots[group] = int(msg.require("offset", int))
                if "arena" in msg.fields:  # several GPUs: the staging arena of the region
                    self._slot_arenas[group] = int(msg.require("arena", int))
            return True
        if msg.kind is Kind.PULLED:
            if msg.get("step") == step:
                self._remote.pulled.append(msg.fields)
            return True
        if msg.kind is Kind.ERROR:
            err = RefitError.from_wire(msg.fields)
            if err.step in (None, step):
                raise err
            return True  # a stale error about an earlier step
        if msg.kind is Kind.PONG:
            waiting = msg.get("waiting_for")
            if msg.get("step") == step and isinstance(waiting, list):
                self._waiting_for = [r for r in waiting if type(r) is int]
            return True
        return False

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

    def _poll(self, step: int, timeout: float = 0.0) -> None:
        """Take in what the daemon sent (credits, grants, errors: raised), waiting up to ``timeout``
        seconds for the first message; progresses a NIXL pull first."""
        self._remote.progress()
        sock = self._socket()
        wait = int(timeout * 1000)
        while sock.poll(wait):
            msg = self._recv(sock)
            self._last_heard = time.monotonic()
            self._handle_async(msg, step)
            wait = 0

    # ---- data

    def open_staging(self, ready: dict) -> None:
        """Map the staging arena READY names (a local rank), and, where the ring spreads over
        several GPUs, every GPU's (``stagings``: the arena SLOT's ``arena`` indexes)."""
        self._local.open(ready["staging"])
        arenas = ring_arenas(ready)
        if arenas > 1:
            self._local.open_lanes(ready.get("stagings"), arenas)

    def granted_region(self, group: int, placed: int, arenas: int) -> tuple[int, int]:
        """(offset, staging arena) of the region SLOT granted ``group``: ProtocolError when SLOT
        names an arena the ring does not have, or another than READY placed the group in (its
        writes would land in a region nobody reads as that group's). The step then fails on every
        rank (the client ABORTs it) and the last published generation stays live."""
        arena = self._slot_arenas.get(group, 0)
        if arena != placed or not 0 <= arena < arenas:
            raise ProtocolError(
                f"SLOT grants group {group} a region in staging arena {arena}, but READY placed it in "
                f"arena {placed} of {arenas}: the daemon and the client disagree; run the same refitd "
                "version on both"
            )
        return self._slots[group], arena

    def _write_ring(
        self, step: int, pieces, ids, ready: dict, deadline: float, srcs=None, *, reg: Any = None
    ) -> tuple[str, str]:
        """Staging ring: write each of this rank's layer groups once the daemon grants it a region
        (SLOT), in whatever order the grants come; the daemon quantizes a group, then reuses its
        region for a later one. Same node: straight into the region; else ZeroMQ frames, except the
        pieces READY says the daemon READs over NIXL (``reg``: this step's registration), each
        group's as it is granted: this rank waits for their PULLEDs, and sends frames for any
        whose READ failed."""
        placement = ready.get("placement")
        if not isinstance(placement, list) or len(placement) != len(pieces):
            raise ProtocolError(
                f"READY places {len(placement or ())} pieces, this rank declared {len(pieces)}"
            )
        local = "staging" in ready
        if local:
            self.open_staging(ready)
        pull = set(ready.get("pull") or ()) if reg is not None and not local else set()
        groups: dict[int, list[tuple[Piece, int, int, Any]]] = {}
        placed: dict[int, int] = {}  # group -> the staging arena READY places it in
        by_id: dict[int, tuple[Piece, Any]] = {}  # pulled pieces: sent as frames only if their READ fails
        arenas = ring_arenas(ready)
        for i, (piece, pid, row) in enumerate(zip(pieces, ids, placement)):
            src = srcs[i] if srcs is not None else None  # remote: the host copy made for the step
            group, rel, arena = placed_row(row, arenas)
            placed[group] = arena
            if pid in pull:
                by_id[pid] = (piece, src)
            else:
                groups.setdefault(group, []).append((piece, pid, rel, src))
        waiting, why = set(by_id), str(ready.get("mover_reason") or "")
        self._remote.pulled, self._remote.pulling = [], bool(waiting)
        framed = sum(len(rows) for rows in groups.values())
        while groups or waiting:
            failed, failed_why = self._remote.take_pulled(waiting)
            if failed:  # their group is granted (its READ was posted): frames go at once
                why, framed = failed_why, framed + len(failed)
                ps, hs = [by_id[p][0] for p in failed], [by_id[p][1] for p in failed]
                self._remote.stream(step, ps, failed, deadline, self._frame_limit(), hs)
            granted = [g for g in groups if g in self._slots]
            if not granted:
                if groups or waiting:
                    what = "a staging region (SLOT)" if groups else "the daemon to pull its shards (PULLED)"
                    self._keepalive(step, deadline, f"waiting for {what}")
                    self._poll(step, 0.001 if self._remote.pulling else self._heartbeat())
                continue
            for g in granted:
                offset, arena = self.granted_region(g, placed[g], arenas)
                rows = groups.pop(g)
                del self._slots[g]
                if local:
                    self._local.write_group(step, rows, offset, deadline, arena)
                else:
                    host = [r[3] for r in rows] if srcs is not None else None
                    rps, rids = [r[0] for r in rows], [r[1] for r in rows]
                    self._remote.stream(step, rps, rids, deadline, self._frame_limit(), host)
        self._remote.pulling = False
        if local:
            return "staging", ""
        if not by_id or framed == len(pieces):
            return "zmq", why
        return ("nixl+zmq" if framed else "nixl"), why


def _without_skipped(skip: Any, pieces: list[Piece], ids: list[Any], srcs: list | None) -> tuple:
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
