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

This module is the step protocol (BEGIN/READY, COMMIT/ACK/RESULT/LOADED) and the public API;
``sidecar.client.session`` is the connection (socket, HELLO/WELCOME, heartbeats, errors, a restarted
daemon, the per-step grants). The bytes move through components that get a narrow ``Link`` to the
session: ``sidecar.client.local.StagingWriter`` (same node), ``sidecar.client.remote.RemoteSender``
(NIXL or frames) and ``sidecar.client.ring.RingWriter`` (a staging ring: a layer group per SLOT).
``sidecar.client.pieces`` holds ``Shard``, ``StepResult`` and the pure helpers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from sidecar.client.local import StagingWriter, devices_of, pieces_device
from sidecar.client.pieces import Link, Piece, Shard, StepPieces, StepResult, host_copy, packed_rows, pieces
from sidecar.client.remote import RemoteSender
from sidecar.client.replicated import owned_items, piece_owners
from sidecar.client.ring import RingWriter
from sidecar.client.session import Session
from sidecar.client.stream import StreamFeed, write_stream
from sidecar.errors import DaemonRestarted, ErrorKind, RefitError
from sidecar.ops.gcpause import gc_paused
from transport.wire import Kind, Message, ProtocolError

__all__ = ["DaemonRestarted", "RefitClient", "RefitError", "Shard", "StepResult"]

log = logging.getLogger("refitd.client")
_ON_CPU = {-1}  # devices_of a step whose every piece is on the CPU


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
        self.mover = mover
        self._step_pieces = StepPieces()  # the last step's pieces and BEGIN rows, while unchanged
        # the connection, and the data paths given a narrow view of it (worker thread only)
        s = self._session = Session(endpoint, rank, world_size, want_local=self.want_local, curve=curve)
        link = Link(send=s.send, keepalive=s.keepalive, poll=s.poll, heartbeat=s.heartbeat)
        s.local = self._local = StagingWriter(link)
        s.remote = self._remote = RemoteSender(link, rank=rank, mover=mover)
        self._ring = RingWriter(s, self._local, self._remote)

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
        if self._session.closed:
            return
        self._session.closed = True
        self._executor.submit(self._close_on_worker).result()
        self._executor.shutdown(wait=True)
        self._session.term()

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
        if self._session.closed:
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
        on = devices_of(rows)
        ready = (
            []
            if on == _ON_CPU
            else [
                torch.cuda.current_stream(d).record_event()
                for d in {p.tensor.device for p in rows if p.tensor.is_cuda}
            ]
        )
        return self._executor.submit(
            self._push, step, rows, deadline, committed, loaded, ready, packed, on=on
        )

    def _close_on_worker(self) -> None:
        self._remote.close()
        self._session.drop()

    # ---- the session, as the step protocol (and tests' hooks) use it

    @property
    def instance(self) -> str | None:
        """The daemon instance of the latest WELCOME."""
        return self._session.instance

    @property
    def _welcome(self) -> dict[str, Any]:
        return self._session.welcome

    @property
    def _slots(self) -> dict[int, int]:
        return self._session.step.slots

    def _send(self, kind: Kind, fields: dict[str, Any], frames=()) -> None:
        self._session.send(kind, fields, frames)

    def _keepalive(self, step: int, deadline: float, what: str, *, silence_ok: bool = False) -> None:
        self._session.keepalive(step, deadline, what, silence_ok=silence_ok)

    def _poll(self, step: int, timeout: float = 0.0) -> None:
        self._session.poll(step, timeout)

    def _heartbeat(self) -> float:
        return self._session.heartbeat()

    def _frame_limit(self) -> int:
        return self._session.frame_limit()

    def _await(self, step: int, deadline: float, kinds: set[Kind]) -> Message:
        return self._session.wait_for(step, deadline, kinds)

    def _abort(self, step: int, reason: str) -> None:
        self._session.abort(step, reason)

    # ---- data

    def open_staging(self, ready: dict) -> None:
        """Map the staging arena(s) READY names (``RingWriter.open_staging``)."""
        self._ring.open_staging(ready)

    def granted_region(self, group: int, placed: int, arenas: int) -> tuple[int, int]:
        """(offset, staging arena) of the region SLOT granted ``group`` (``RingWriter.granted_region``)."""
        return self._ring.granted_region(group, placed, arenas)

    def _write_ring(
        self, step: int, pieces, ids, ready: dict, deadline: float, srcs=None, *, reg: Any = None
    ) -> tuple[str, str]:
        """Staging ring: write each layer group once its region is granted (``RingWriter.write``)."""
        return self._ring.write(step, pieces, ids, ready, deadline, srcs, reg=reg)

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
        *,
        on: set[int] | None = None,
    ) -> StepResult:
        """``on``: the pieces' devices (:func:`devices_of`), when the caller has them already."""
        try:
            self._session.begin(deadline)
            self._local.ready_events = ready or []
            self._local.device = pieces_device(pieces, on)  # GPU staging is mapped on the rank's own GPU
            self._session.hello(step, deadline, self._send)
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
                self._session.drop()  # whatever is queued on it belongs to this step: start afresh
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
