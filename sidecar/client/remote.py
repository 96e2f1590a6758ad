"""Remote ranks: the daemon READs their pieces over NIXL when both sides have it, else they stream
raw frames over ZeroMQ under credits the daemon grants (ZeroMQ's high-water mark counts messages,
not bytes). ``StepResult.mover`` says which: "nixl", "zmq" or "nixl+zmq" (some pieces each way).

    sender = RemoteSender(link, rank=0, mover="auto")
    offer, reg, why = sender.offer(host_copies, welcome)        # BEGIN's ``nixl`` field, or why not
    mover, why = sender.send(step, pieces, host_copies, ids, ready, reg, why, deadline, frame_limit)
    sender.finish(reg)                                          # deregister this step's copies

Through a staging ring the client streams each group's frames after its SLOT and takes the PULLEDs
of the groups the daemon READs (``take_pulled``) as they come.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import torch

from sidecar.client import pieces as P
from sidecar.client.pieces import Link, Piece, blocks, host_copy
from sidecar.ops.gcpause import gc_paused
from transport import nixl
from transport.wire import Kind


class RemoteSender:
    """A remote rank's data path (the client's worker thread only): the NIXL offer and pull, frames."""

    def __init__(self, link: Link, *, rank: int, mover: str) -> None:
        self.link, self.rank, self.mover = link, rank, mover
        self.credits = 0  # frames the daemon will take now (READY's credit_frames, then CREDIT)
        self.pulled: list[dict[str, Any]] = []  # the step's PULLEDs not yet taken, as they arrived
        self.pulling = False  # the daemon may be READing: progress the endpoint while waiting
        self._ep: nixl.NixlEndpoint | None = None  # made on first use
        self._broken = ""  # why NIXL set-up failed here: frames from then on

    def offer(
        self, srcs: list[torch.Tensor], welcome: dict[str, Any]
    ) -> tuple[dict[str, Any] | None, Any, str]:
        """BEGIN's ``nixl`` field (agent metadata, one ``[addr, nbytes]`` per piece) with the step's
        registration, or ``(None, None, why not)``."""
        if self.mover == "zmq":
            return None, None, "mover=zmq"
        if "nixl" not in welcome.get("pull", ()):
            return None, None, "the daemon does not offer NIXL pulls"
        if self._broken:
            return None, None, self._broken
        ok, why = nixl.available()
        if not ok:
            return None, None, f"NIXL is unavailable here: {why}"
        rows = [(t.data_ptr(), t.numel() * t.element_size()) for t in srcs]
        regions = [[a, n] if n else [0, 0] for a, n in rows]
        try:
            if self._ep is None:
                self._ep = nixl.NixlEndpoint(
                    f"refitd-client-{socket.gethostname()}-{os.getpid()}-r{self.rank}-{id(self):x}"
                )
        except (nixl.NixlError, ValueError, TypeError) as exc:  # no endpoint: frames from now on
            self._broken = f"NIXL set-up failed here: {type(exc).__name__}: {exc}"
            return None, None, self._broken
        reg = None
        try:  # this step's copies only: frames for this step if they cannot be registered
            live = registered_spans(srcs, rows)
            reg = self._ep.register(live) if live else None
            md = self._ep.metadata()
        except (nixl.NixlError, ValueError, TypeError) as exc:
            if reg is not None:
                self._ep.deregister(reg)
            return None, None, f"NIXL registration failed here: {type(exc).__name__}: {exc}"
        return {"md": md, "regions": regions}, reg, ""

    def send(
        self,
        step: int,
        pieces: list[Piece],
        srcs: list[torch.Tensor],
        ids: list[int],
        ready: dict[str, Any],
        reg: Any,
        why: str,
        deadline: float,
        limit: int,
    ) -> tuple[str, str]:
        """Frames for the pieces the daemon does not pull; then wait until it pulled the rest (frames
        for any whose READ failed). Returns the mover and why NIXL was not (wholly) used."""
        pull = set(ready.get("pull") or ()) if reg is not None else set()
        why = why or str(ready.get("mover_reason") or "")
        self.pulling, self.pulled = bool(pull), []
        rest = [i for i, pid in enumerate(ids) if pid not in pull]
        self.stream(
            step, [pieces[i] for i in rest], [ids[i] for i in rest], deadline, limit, [srcs[i] for i in rest]
        )
        if not pull:
            return "zmq", why
        while not self.pulled:  # it may have arrived already, while frames were streamed
            self.link.keepalive(step, deadline, "waiting for the daemon to pull its shards (PULLED)")
            self.link.poll(step, 0.001)
        pulled, self.pulled, self.pulling = self.pulled[0], [], False
        failed = set(pulled.get("failed") or ())
        if failed:
            why = str(pulled.get("reason") or "the NIXL READ failed")
            again = [i for i, pid in enumerate(ids) if pid in failed]
            self.stream(
                step,
                [pieces[i] for i in again],
                [ids[i] for i in again],
                deadline,
                limit,
                [srcs[i] for i in again],
            )
            return "zmq", why
        return ("nixl+zmq" if rest else "nixl"), why

    def take_pulled(self, waiting: set[int]) -> tuple[list[int], str]:
        """Staging ring: the PULLEDs received so far (one per group READ). Drops the pieces the
        daemon READ from ``waiting``; returns those whose READ failed (send them as frames: their
        group holds its region until they arrive) and why it failed."""
        failed: list[int] = []
        why = ""
        for msg in self.pulled:
            waiting.difference_update(msg.get("pieces") or ())
            bad = [pid for pid in msg.get("failed") or () if pid in waiting]
            if bad:
                waiting.difference_update(bad)
                failed += bad
                why = str(msg.get("reason") or "the NIXL READ failed")
        self.pulled = []
        self.pulling = bool(waiting)
        return failed, why

    def finish(self, reg: Any) -> None:
        """The step's data is sent (or failed): stop progressing, deregister its host copies."""
        self.pulling = False
        if reg is not None and self._ep is not None:
            self._ep.deregister(reg)

    def progress(self) -> None:
        """Let the daemon's READ advance (NIXL needs the target's endpoint progressed)."""
        if self.pulling and self._ep is not None:
            try:
                self._ep.progress()
            except nixl.NixlError as exc:  # the daemon's READ then fails and it says so
                self.pulling = False
                self._broken = f"progressing the NIXL endpoint failed: {exc}"

    def stream(
        self,
        step: int,
        pieces: list[Piece],
        ids: list[int],
        deadline: float,
        limit: int,
        srcs: list[torch.Tensor] | None = None,
    ) -> None:
        """Each piece as SHARD frames of at most ``limit`` bytes, one credit each."""
        next_poll = 0.0
        for start in range(0, len(pieces), P.DONE_BATCH_PIECES):
            # many small frames make many small objects: at most one collection per run of pieces
            with gc_paused():
                for i in range(start, min(start + P.DONE_BATCH_PIECES, len(pieces))):
                    piece, pid = pieces[i], ids[i]
                    src = srcs[i] if srcs is not None else host_copy(piece.tensor)
                    whole = tuple(src.shape)
                    for rel, shape in blocks(whole, src.element_size(), limit):
                        while self.credits <= 0:
                            self._await_credit(step, deadline)
                        if shape and shape != whole:
                            block = src[tuple(slice(o, o + s) for o, s in zip(rel, shape))]
                        else:
                            block = src
                        data = block.reshape(-1).view(torch.uint8).numpy() if block.numel() else b""
                        offsets = [o + r for o, r in zip(piece.offsets, rel)]
                        self.link.send(
                            Kind.SHARD,
                            {"step": step, "piece": pid, "offsets": offsets, "shape": list(shape)},
                            [data],
                        )
                        self.credits -= 1
                        now = time.monotonic()
                        if now >= next_poll:  # credits and errors; waiting for credit polls anyway
                            self.link.poll(step, 0.0)
                            next_poll = now + P.POLL_INTERVAL_S

    def _await_credit(self, step: int, deadline: float) -> None:
        self.link.keepalive(step, deadline, "waiting for the daemon to take its data (credit)")
        self.link.poll(step, 0.001 if self.pulling else self.link.heartbeat())

    def close(self) -> None:
        """Close the NIXL endpoint; idempotent."""
        if self._ep is not None:
            self._ep.close()
            self._ep = None


def registered_spans(srcs: list[torch.Tensor], rows: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The host memory to register for ``srcs`` (``rows``: their ``(addr, nbytes)``): per storage,
    the one span from its first piece's start to its last piece's end. Views of one buffer (10,000
    small tensors of a flat parameter buffer) are one registration, not 10,000 (each costs UCX
    ~20 us); every piece's descriptor still lies inside one registered region, as NIXL needs."""
    spans: dict[int, list[int]] = {}
    for t, (a, n) in zip(srcs, rows):
        if not n:
            continue
        key = t.untyped_storage().data_ptr()
        span = spans.get(key)
        if span is None:
            spans[key] = [a, a + n]
        else:
            span[0], span[1] = min(span[0], a), max(span[1], a + n)
    return [(lo, hi - lo) for lo, hi in spans.values()]
