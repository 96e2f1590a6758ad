"""Errors that cross process boundaries as data and come back as typed exceptions.

On the wire an error is ``{"kind": ErrorKind value, "message": str, "rank": int | None, "step": int | None}``
(an ``ERROR`` message). Every trainer rank of a failed step receives the same one, so every rank
raises the same ``RefitError`` naming the cause and the failing rank.
"""

from __future__ import annotations

import enum
import operator
from typing import Any


class ErrorKind(str, enum.Enum):
    PROTOCOL = "protocol"  # a malformed or out-of-order message
    INVALID = "invalid"  # shapes, dtypes or names that disagree with the plan
    COVERAGE = "coverage"  # gaps or overlaps between the ranks' shards
    NON_FINITE = "non_finite"  # NaN or Inf in a tensor
    STEP_ORDER = "step_order"  # a step that does not increase
    RANK_DIED = "rank_died"  # a trainer rank stopped responding mid-step
    TIMEOUT = "timeout"  # the step did not complete within its timeout
    ABORTED = "aborted"  # a rank (or the operator) aborted the step
    CAPACITY = "capacity"  # an arena too small for what the step needs
    BUSY = "busy"  # the daemon cannot take the step now (e.g. readers hold every generation)
    SHUTDOWN = "shutdown"  # the daemon is stopping
    UNAVAILABLE = "unavailable"  # no daemon answered
    ENGINE = "engine"  # an engine worker failed to attach or to load a generation
    UNKNOWN_PEER = "unknown_peer"  # the daemon does not know this peer (it restarted): introduce yourself
    UNAUTHORIZED = "unauthorized"  # a request this peer may not make (forwarding from a non-trainer)
    RESTARTED = "restarted"  # the daemon restarted mid-step (a new instance): the step was lost, push again
    REVOKED = "revoked"  # a reader's hold was dropped after reader_timeout_s and the generation rewritten
    INTERNAL = "internal"  # a bug: please report it

    @classmethod
    def parse(cls, value: Any) -> ErrorKind:
        try:
            return cls(value)
        except ValueError:
            return cls.INTERNAL


class RefitError(RuntimeError):
    """A step failed. ``kind``, ``rank`` (the failing rank, if one) and ``step`` say where and why."""

    def __init__(
        self,
        message: str,
        *,
        kind: ErrorKind = ErrorKind.INTERNAL,
        rank: int | None = None,
        step=None,
        rolled_back=(),
    ):
        # rank and step are integers or None: anything else (a peer's malformed field) is dropped
        # here, so formatting or sending the error can never fail on it
        rank, step = _int_or_none(rank), _int_or_none(step)
        self.kind, self.rank, self.step, self.message = ErrorKind.parse(kind), rank, step, str(message)
        #: streamed refit: the engine workers that had loaded part of this (failed) step and were told
        #: to reload those parts from the last good generation (names; empty when none had)
        self.rolled_back: tuple[str, ...] = _names(rolled_back)
        where = []
        if step is not None:
            where.append(f"step {step}")
        if rank is not None:
            where.append(f"rank {rank}")
        prefix = f"[{self.kind.value}{': ' + ', '.join(where) if where else ''}] "
        super().__init__(prefix + message)

    def to_wire(self) -> dict[str, Any]:
        fields = {"kind": self.kind.value, "message": self.message, "rank": self.rank, "step": self.step}
        if self.rolled_back:
            fields["rolled_back"] = list(self.rolled_back)
        return fields

    @classmethod
    def from_wire(cls, fields: dict[str, Any]) -> RefitError:
        return cls(
            str(fields.get("message", "unknown error")),
            kind=ErrorKind.parse(fields.get("kind")),
            rank=fields.get("rank"),
            step=fields.get("step"),
            rolled_back=fields.get("rolled_back", ()),
        )


class DaemonRestarted(RefitError):
    """The daemon restarted while a step was in flight (a reply came from a new instance, or the
    daemon no longer knew this client): the step was lost. The client has already dropped its old
    connection; the next call (``push_step`` again) introduces itself to the new daemon."""

    def __init__(self, message: str, *, old: str | None, new: str | None, rank: int | None = None, step=None):
        super().__init__(message, kind=ErrorKind.RESTARTED, rank=rank, step=step)
        self.old, self.new = old, new


MAX_ROLLED_BACK = 256  # engine names an error carries (a peer's list is cut there)


def _names(value: Any) -> tuple[str, ...]:
    """A list of engine worker names from anyone (a peer's field): strings only, bounded."""
    if not isinstance(value, (list, tuple)):
        return ()
    return tuple(v[:200] for v in value[:MAX_ROLLED_BACK] if isinstance(v, str))


def _int_or_none(value: Any) -> int | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # int, numpy integers
    except Exception:  # a list, a string, or an object whose __index__ misbehaves
        return None


class HoldRevoked(RefitError):
    """A reader held a generation past the daemon's ``reader_timeout_s``: the daemon dropped the hold
    and began writing a newer step into that generation while the reader may still have been copying
    out of it. What the reader copied may be torn (a mix of two steps): do not serve it; load the next
    generation. ``generation`` and ``step`` say which, ``reader_timeout_s`` the limit that elapsed."""

    def __init__(self, *, reader: str, generation: int, step: int | None, reader_timeout_s: float | None):
        limit = "reader_timeout_s" if reader_timeout_s is None else f"reader_timeout_s={reader_timeout_s:g} s"
        super().__init__(
            f"reader {reader!r} held generation {generation} (step {step}) longer than the daemon's {limit}: "
            "the daemon dropped the hold and is writing a newer step into it, so what was copied out of it may "
            "be torn (a mix of two steps). Do not serve it: load the next generation. Release generations "
            "sooner after copying, or raise reader_timeout_s (--reader-timeout) above the engine's load time",
            kind=ErrorKind.REVOKED,
            step=step,
        )
        self.reader, self.generation, self.reader_timeout_s = reader, generation, reader_timeout_s
