"""The engine side's base: wait for a published generation, read it, release it.

    reader = RefitReader("ipc:///run/refitd/control.sock", name="vllm-worker-0")
    gen = reader.wait(min_step=0, timeout=60)       # blocks until a generation >= step 0 is live
    for name, tensor in gen.tensors.items():         # views into daemon-owned memory: read them only
        params[name].copy_(tensor)
    reader.release(gen)                              # the daemon may now reuse that generation

The daemon never writes into a generation a reader holds; a reader that does not release within the
daemon's ``reader_timeout_s`` (because it died or hung) loses its hold. A live reader that was just
slow is never left with a silently torn copy: the daemon bumps the generation's epoch (a read-only
shared page, ``transport.epochs``) before writing into it and sends REVOKED, ``gen.intact()``
compares the epoch with the one the generation was handed out at, and ``release`` raises
:class:`~sidecar.errors.HoldRevoked` when it changed (after still sending the RELEASE). Views of a shared-memory
arena are mapped read-only: a stray write faults in the reader instead of corrupting what every
engine loads. Views of a GPU (CUDA-IPC) arena are writable (CUDA has no read-only mapping): readers
are trusted not to write. Not thread-safe: use one reader per thread.

Once attached, a reader pings the daemon from a background thread every ``heartbeat_interval_s`` the
daemon announced, whether or not its owner is calling it (an engine busy serving between refits is
not gone). A reader that stops pinging (its process died or hung, without DETACH) is dropped by the
daemon after ``reader_timeout_s``: it loses its holds and leaves ``status``. The socket is shared with
that thread under a lock; messages the thread reads while the owner is not waiting are kept for it.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from sidecar.errors import ErrorKind, HoldRevoked, RefitError
from sidecar.protocol.manifest import Manifest
from transport.cuda_ipc import open_any_arena
from transport.curve import curve_hint, set_client
from transport.epochs import EpochView, fence
from transport.shm import ShmArena
from transport.wire import STREAM_VERSION, Kind, Limits, Message, decode, encode

__all__ = ["Generation", "RefitReader"]

_READER_LIMITS = Limits(max_header_bytes=256 << 20)
#: a waiting reader pings after this much silence: a reply from a new daemon instance means it restarted
PING_S = 1.0
#: a send the socket cannot take at once (no connection yet) is retried this often until the deadline
SEND_RETRY_S = 0.05
#: messages the heartbeat thread may keep for the owner (answers to its own requests: a few at most)
_INBOX_LIMIT = 1024

log = logging.getLogger("refitd.reader")


@dataclass(eq=False)
class Generation:
    """One published step: checkpoint names to tensor views (read them only). Release it when loaded."""

    index: int
    step: int
    tensors: Mapping[str, torch.Tensor]
    segment: str
    released: bool = field(default=False)
    on_gpu: bool = False  # views into a CUDA-IPC arena (device memory)
    instance: str | None = None  # the daemon start that published it
    device: int | None = None  # CUDA index the arena is mapped on in this process (on_gpu only)
    epoch: int | None = None  # the generation's epoch when it was handed out (None: the daemon sent none)
    epochs: EpochView | None = field(default=None, repr=False)  # the daemon's epoch page, read-only
    revoked: bool = False  # the daemon said (REVOKED) it dropped this hold to write a newer step
    reader: str = ""  # the reader it was handed to (for HoldRevoked)
    reader_timeout_s: float | None = None  # the daemon's limit, as announced at attach
    #: host memory page-locked in this process (a host-tier generation read by an engine with a
    #: GPU): copies out of it are DMAs, and may be asynchronous (``non_blocking=True``)
    pinned: bool = False

    def intact(self) -> bool:
        """Whether no byte of this generation was rewritten since it was handed out: True means a
        copy made out of it (and finished) holds exactly the published step. False means the daemon
        dropped this reader's hold after ``reader_timeout_s`` and began writing a newer step into it:
        the copy may be torn. On a GPU arena, asynchronous copies out of it are finished first.
        Costs one shared-memory load (no round trip to the daemon)."""
        if (self.on_gpu or self.pinned) and not self.released:
            _finish_copies(self)
        return self._epoch_unchanged()

    def _epoch_unchanged(self) -> bool:
        if self.epochs is None or self.epoch is None:  # a daemon that sends no epochs: only REVOKED tells
            return not self.revoked
        fence()  # the re-read below may not be satisfied before the copy's own loads
        return self.epochs.read(self.index) == self.epoch

    def revoked_error(self) -> HoldRevoked:
        return HoldRevoked(
            reader=self.reader, generation=self.index, step=self.step, reader_timeout_s=self.reader_timeout_s
        )


def _finish_copies(gen: Generation) -> None:
    """Wait for copies out of ``gen``'s GPU arena: they run on the streams of the GPU it is mapped on
    and of the engine's current GPU (a copy's destination), which may be different chips. Out of a
    page-locked host generation: the engine's current GPU, if this process uses one."""
    if not gen.on_gpu and not torch.cuda.is_initialized():
        return  # pinned by a driver torch never used: nothing of torch's is in flight
    devices = {torch.cuda.current_device()}
    if gen.device is not None:
        devices.add(gen.device)
    for device in sorted(devices):
        torch.cuda.synchronize(device)


class RefitReader:
    def __init__(
        self,
        endpoint: str,
        *,
        name: str | None = None,
        timeout: float = 600.0,
        manifest: Manifest | None = None,
        curve: tuple[bytes, bytes, bytes] | None = None,
        device: int | None = None,
        streaming: bool = False,
        pin: bool | None = None,
    ):
        """``curve``: (server public, client public, client secret) keys for a CURVE ``tcp://``
        endpoint (``transport.curve.client_curve``); engines on the daemon's node use ipc:// instead.
        ``device``: for GPU arenas, the CUDA index to map them on (default: the arena's own GPU,
        which must be visible to this process; another GPU reads it as peer memory over NVLink).
        ``streaming``: ask the daemon for streamed refit (``adapters.stream``: each layer group of a
        step as it is written); :meth:`wait` and whole-generation reading are unchanged either way.
        ``pin``: page-lock host-tier generations in this process (``cudaHostRegister``, read-only),
        so the engine's copies to its GPU are DMAs; None (the default) pins when this process
        already uses CUDA (an engine worker), never creating a CUDA context for it."""
        self.device = device
        self.streaming = streaming
        self.pin = pin
        self._pins: dict[str, Any] = {}  # segment name -> its page-locking (transport.host_pins)
        self.pin_failure: str | None = None  # why a generation could not be page-locked, if one could not
        self.endpoint = endpoint
        self.curve = curve
        self.manifest = manifest
        self.attach_info: dict[str, Any] = {}
        self.name = name or f"reader-{os.getpid()}"
        self.timeout = timeout
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        set_client(self._sock, curve)
        self._sock.connect(endpoint)
        self._attached = False
        self.instance: str | None = None
        self._arenas: dict[str, ShmArena] = {}
        self._arena_instance: dict[str, str | None] = {}  # segment name -> the daemon start it belongs to
        self._epochs: dict[str, EpochView] = {}  # epoch page name -> its read-only mapping
        self._held: list[Generation] = []
        self._closed = False
        self._io = threading.Lock()  # the socket, shared with the heartbeat thread
        self._inbox: collections.deque[Message] = collections.deque(maxlen=_INBOX_LIMIT)
        self._last_sent = 0.0
        self.last_heard = time.monotonic()  # when the daemon last said anything (PONGs included)
        self._ping_s = PING_S  # replaced by the daemon's heartbeat_interval_s at attach
        self._stop_beat = threading.Event()
        self._beat: threading.Thread | None = None

    # ------------------------------------------------------------------------------------------

    def wait(self, min_step: int | None = None, timeout: float | None = None) -> Generation:
        """The live generation once its step is >= ``min_step`` (None: whatever is live)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        self._ensure_attached(deadline)
        self._send(Kind.WAIT, {"min_step": min_step})
        while True:
            msg = self._recv(deadline, f"a generation with step >= {min_step}", ping=True)
            if self._from_new_instance(msg) or _unknown_peer(msg):
                # the daemon restarted: attach again (same name and manifest) and re-ask
                log.warning(
                    "reader %s: the daemon at %s restarted (instance %s -> %s); attaching again",
                    self.name,
                    self.endpoint,
                    self.instance,
                    msg.get("instance"),
                )
                self._attached = False
                self._ensure_attached(deadline)
                self._send(Kind.WAIT, {"min_step": min_step}, deadline=deadline)
                continue
            if msg.kind is Kind.ERROR:
                raise RefitError.from_wire(msg.fields)
            if msg.kind is not Kind.GENERATION:
                continue
            gen = self._generation(msg.fields)
            if min_step is not None and gen.step < min_step:  # answer to an earlier, abandoned wait
                self.release(gen)
                continue
            return gen

    def release(
        self, gen: Generation, *, ok: bool = True, error: str | None = None, seconds: float | None = None
    ) -> None:
        """Hand ``gen`` back; its views must not be used afterwards. Idempotent.

        An engine worker also acknowledges with it: ``ok=False`` and ``error`` say that loading the
        generation failed; the daemon reports it, naming this reader, to the trainer.

        Raises :class:`~sidecar.errors.HoldRevoked` (after sending the RELEASE) when the daemon
        dropped this hold after ``reader_timeout_s`` and rewrote the generation: what was copied
        out of it may be torn and must not be served.
        """
        if gen.released:
            return
        if (
            gen.on_gpu or gen.pinned
        ):  # copies out of it may be asynchronous: finish them before handing it back
            _finish_copies(gen)
        gen.released = True
        torn = not gen._epoch_unchanged()
        if gen in self._held:
            self._held.remove(gen)
        if gen.instance != self.instance:  # a daemon that is gone handed it out: nobody to tell
            self._forget_arenas()  # and its segment is unmapped once no held generation uses it
        else:
            fields: dict[str, Any] = {"generation": gen.index, "step": gen.step, "ok": ok}
            if error is not None:
                fields["error"] = str(error)
            if seconds is not None:
                fields["seconds"] = float(seconds)
            self._send(Kind.RELEASE, fields)
        if torn:
            raise gen.revoked_error()

    def attach(self, timeout: float | None = None) -> dict[str, Any]:
        """Attach now (``wait`` does it on demand); returns the daemon's ATTACHED fields.

        With a manifest, the daemon checks its plan against it and refuses (RefitError listing every
        mismatch) an engine that cannot load what it publishes.
        """
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        self._attached = False
        self._ensure_attached(deadline)
        return self.attach_info

    def status(self, timeout: float = 10.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        self._send(Kind.STATUS, {})
        while True:
            msg = self._recv(deadline, "STATUS_REPLY")
            if msg.kind is Kind.STATUS_REPLY:
                return msg.fields

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop_beat.set()
        if self._beat is not None:
            self._beat.join(timeout=5)
        for gen in list(self._held):
            try:
                self.release(gen)
            except HoldRevoked as exc:  # closing: nothing is loaded from it any more; say so, go on
                log.warning("reader %s: closing with a revoked generation: %s", self.name, exc)
        with contextlib.suppress(zmq.ZMQError):
            self._send(Kind.DETACH, {}, wait=False)
        for name, arena in self._arenas.items():
            self._unpin(name)
            arena.close()
        self._arenas.clear()
        self._arena_instance.clear()
        self._epochs.clear()  # unmapped once no Generation refers to them
        self._sock.close(linger=100)
        self._ctx.term()

    def __enter__(self) -> RefitReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------

    def _send(
        self, kind: Kind, fields: dict[str, Any], *, wait: bool = True, deadline: float | None = None
    ) -> None:
        """Never blocks past ``deadline`` (default: this reader's timeout from now): a DEALER whose
        connection never came up (a refused CURVE key) cannot take messages, and the call fails with
        TIMEOUT. ``wait=False`` for courtesy messages: dropped if they cannot leave at once."""
        parts = encode(Message(kind, fields))
        if deadline is None:
            deadline = time.monotonic() + self.timeout
        while True:
            try:
                with self._io:  # shared with the heartbeat thread
                    self._sock.send_multipart(parts, zmq.NOBLOCK)
                    self._last_sent = time.monotonic()
                return
            except zmq.Again:
                left = deadline - time.monotonic()
                if not wait:
                    return
                if left <= 0:
                    raise RefitError(
                        f"could not send {kind.name} to {self.endpoint} within the timeout: no connection "
                        "to the daemon came up" + curve_hint(self.curve),
                        kind=ErrorKind.TIMEOUT,
                    ) from None
                with self._io:
                    self._sock.poll(int(min(left, SEND_RETRY_S) * 1000) + 1, zmq.POLLOUT)

    def _recv(self, deadline: float, what: str, *, ping: bool = False) -> Message:
        """The next message; ``ping``: after PING_S of silence ask the daemon for a PONG, whose
        instance tells whether it restarted meanwhile (a WAIT sent to a dead daemon is never answered)."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self._send(Kind.WAIT, {"cancel": True}, wait=False)
                raise RefitError(
                    f"no answer from {self.endpoint} within the timeout while waiting for {what}"
                    + curve_hint(self.curve),
                    kind=ErrorKind.TIMEOUT,
                )
            msg = self.poll(min(left, self._ping_s, 1.0))
            if msg is not None:
                return msg

    def poll(self, seconds: float) -> Message | None:
        """The next message for the owner within ``seconds``, else None (pinging if due). REVOKED
        is noted on the generation it names and a PONG of this daemon start only refreshes
        :attr:`last_heard`; neither is returned."""
        with self._io:
            if self._inbox:
                return self._inbox.popleft()
            self._ping_if_due()  # the heartbeat thread skips its turn while we hold the socket
            if self._sock.poll(max(0, int(seconds * 1000))):
                msg = decode(self._sock.recv_multipart(copy=False), _READER_LIMITS)
                self.last_heard = time.monotonic()
                if msg.kind is Kind.REVOKED and not self._from_new_instance(msg):
                    self._note_revoked(msg)
                elif msg.kind is not Kind.PONG or self._from_new_instance(msg):
                    return msg
        return None

    def _from_new_instance(self, msg: Message) -> bool:
        instance = msg.get("instance")
        return self.instance is not None and isinstance(instance, str) and instance != self.instance

    def _note_revoked(self, msg: Message) -> None:
        """The daemon dropped our hold on a generation to write a newer step into it (REVOKED): mark
        it, and say so now (the owner learns it from ``intact()`` / ``release``)."""
        index, step = msg.get("generation"), msg.get("step")
        hit = [g for g in self._held if g.index == index and g.step == step and g.instance == self.instance]
        for gen in hit:
            gen.revoked = True
        log.warning(
            "reader %s: the daemon dropped its hold on generation %s (step %s) after reader_timeout_s=%s and "
            "is writing a newer step into it%s",
            self.name,
            index,
            step,
            msg.get("reader_timeout_s"),
            ": a copy still in progress there may be torn" if hit else "",
        )

    def _ping_if_due(self) -> None:
        """Ping if nothing was sent for a heartbeat interval (caller holds ``_io``); never blocks."""
        if self._attached and time.monotonic() - self._last_sent >= self._ping_s:
            with contextlib.suppress(zmq.Again):
                self._sock.send_multipart(encode(Message(Kind.PING, {})), zmq.NOBLOCK)
                self._last_sent = time.monotonic()

    def _heartbeat(self) -> None:
        """The heartbeat thread: ping every interval; keep whatever arrives meanwhile for the owner."""
        while not self._stop_beat.wait(self._ping_s / 2):
            if not self._io.acquire(blocking=False):
                continue  # the owner is using the socket: it pings itself while it waits
            try:
                if self._closed:
                    return
                while self._sock.poll(0):
                    msg = decode(self._sock.recv_multipart(copy=False), _READER_LIMITS)
                    self.last_heard = time.monotonic()
                    if msg.kind is Kind.REVOKED and not self._from_new_instance(msg):
                        self._note_revoked(msg)
                    elif msg.kind is not Kind.PONG or self._from_new_instance(msg):
                        self._inbox.append(msg)  # a PONG from a new daemon instance tells of a restart
                self._ping_if_due()
            except Exception:  # a garbled answer must not end the heartbeat (the owner sees errors)
                log.debug("reader %s: heartbeat turn failed", self.name, exc_info=True)
            finally:
                self._io.release()

    def _start_heartbeat(self) -> None:
        if self._beat is None and not self._closed:
            self._beat = threading.Thread(
                target=self._heartbeat, name=f"refitd-reader-{self.name}", daemon=True
            )
            self._beat.start()

    def _ensure_attached(self, deadline: float) -> None:
        if self._attached:
            return
        fields: dict[str, Any] = {"name": self.name, "pid": os.getpid()}
        if self.streaming:
            fields["stream"] = STREAM_VERSION
        if self.manifest is not None:
            fields["manifest"] = self.manifest.to_wire()
        self._send(Kind.ATTACH, fields, deadline=deadline)
        while True:
            msg = self._recv(deadline, "ATTACHED")
            if msg.kind is Kind.ATTACHED:
                break
            if msg.kind is Kind.ERROR and not _unknown_peer(msg):  # that one answers an earlier message
                raise RefitError.from_wire(msg.fields)
        self.attach_info = dict(msg.fields)
        self.instance, self._attached = msg.get("instance"), True
        self._forget_arenas()
        ping = msg.get("heartbeat_interval_s")
        if isinstance(ping, (int, float)) and ping > 0:
            self._ping_s = float(ping)
        self._start_heartbeat()

    def _forget_arenas(self) -> None:
        """Unmap the segments of previous daemon instances that no held generation still uses (a
        generation held across a restart keeps its segment mapped until it is released)."""
        in_use = {g.segment for g in self._held}
        for name in [n for n, i in self._arena_instance.items() if i != self.instance and n not in in_use]:
            del self._arena_instance[name]
            self._unpin(name)
            self._arenas.pop(name).close()
        # epoch pages of previous starts: dropped here, unmapped when no Generation refers to them
        current = self.attach_info.get("epochs")
        keep = {g.epochs.name for g in self._held if g.epochs is not None}
        keep.add(current.get("name") if isinstance(current, dict) else None)
        for name in [n for n in self._epochs if n not in keep]:
            del self._epochs[name]

    def _generation(self, fields: dict[str, Any]) -> Generation:
        handle = fields["arena"]
        arena = self._arenas.get(handle["name"])
        if arena is None or arena.layout.to_wire() != handle["layout"]:
            if arena is not None:
                self._unpin(handle["name"])
                arena.close()
            arena = self._arenas[handle["name"]] = open_any_arena(handle, writable=False, device=self.device)
            self._arena_instance[handle["name"]] = self.instance
            if handle.get("kind") == "shm" and self._should_pin():
                self._pin(handle["name"], arena)
        gen = Generation(
            int(fields["generation"]),
            int(fields["step"]),
            arena.tensors(),
            arena.name,
            on_gpu=handle.get("kind") == "cuda_ipc",
            instance=self.instance,
            device=getattr(arena, "device", None) if handle.get("kind") == "cuda_ipc" else None,
            reader=self.name,
            reader_timeout_s=_number_or_none(self.attach_info.get("reader_timeout_s")),
            pinned=self._pinned(handle["name"]),
        )
        epoch, page = fields.get("epoch"), fields.get("epochs")
        if isinstance(epoch, int) and not isinstance(epoch, bool) and isinstance(page, dict):
            gen.epoch, gen.epochs = epoch, self._epoch_view(page)
        self._held.append(gen)
        return gen

    def _should_pin(self) -> bool:
        if self.pin is not None:
            return self.pin
        return torch.cuda.is_available() and torch.cuda.is_initialized()

    def _pin(self, name: str, arena: Any) -> None:
        """Page-lock a host generation's read-only mapping on this process's GPU, on a thread
        (``transport.host_pins``): the first load does not wait for it (its copies are pageable
        until the pin lands; ``Generation.pinned`` says which at hand-out). Where CUDA does not
        support READ_ONLY registration the mapping is registered without the flag where the
        platform allows it; a failure is logged once and kept in :attr:`pin_failure`."""
        from transport.cuda_ipc import default_driver
        from transport.host_pins import BackgroundPins, pin_read_only

        try:
            driver = default_driver()
            device = driver.current_device()
        except Exception as exc:
            self._pin_failed(name, str(exc))
            return

        def pin(arena: Any) -> Any:
            got, why = pin_read_only(arena, driver=driver, device=device)
            if why is not None:
                self._pin_failed(name, why)
            return got

        self._pins[name] = BackgroundPins([arena], pin, what=f"reader {self.name}")

    def _pin_failed(self, name: str, why: str) -> None:
        if self.pin_failure is None:  # once: every generation would say the same
            log.warning(
                "reader %s: could not page-lock generation %s (copies stay pageable): %s",
                self.name,
                name,
                why,
            )
        self.pin_failure = why

    def _pinned(self, name: str) -> bool:
        pins = self._pins.get(name)
        return pins is not None and bool(pins.pins)

    def wait_pinned(self, timeout: float | None = None) -> bool:
        """Wait until every page-lock started is done (pinned or failed); False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for pins in list(self._pins.values()):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not pins.wait(left):
                return False
        return True

    def _unpin(self, name: str) -> None:
        pins = self._pins.pop(name, None)
        if pins is not None:
            pins.release()

    def _epoch_view(self, handle: dict[str, Any]) -> EpochView:
        """The daemon's epoch page, mapped read-only once per daemon start (kept, like its arenas,
        while a generation handed out by that start is held)."""
        name = str(handle.get("name"))
        view = self._epochs.get(name)
        if view is None:
            view = self._epochs[name] = EpochView.attach(handle)
        return view


def _number_or_none(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _unknown_peer(msg: Message) -> bool:
    return msg.kind is Kind.ERROR and msg.get("kind") == ErrorKind.UNKNOWN_PEER.value
