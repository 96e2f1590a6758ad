"""Timeouts, in seconds, and what SIGTERM does to a step in flight.

A step not sealed within ``step_timeout_s`` is aborted; a trainer rank silent for
``rank_timeout_s`` mid-step is declared dead (ranks ping every ``heartbeat_interval_s``, which must
be shorter); a reader holding a generation the daemon needs is dropped after ``reader_timeout_s`` (a
step whose timeout would come first fails at once, naming the reader), and an attached reader that
stops pinging is dropped after ``reader_timeout_s`` of silence; shutdown escalates after
``shutdown_timeout_s``. ``forward_timeout_s`` bounds how long a forwarder waits on a peer, and how
long it may hold a generation for one transfer (so it must be below ``reader_timeout_s``). All of
these can change on SIGHUP (``RELOADABLE``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from sidecar.config import values as v
from sidecar.config.values import DrainMode, knob


@dataclass(frozen=True, kw_only=True)
class TimeoutSettings:
    """Timeouts, in seconds, and what SIGTERM does to a step in flight. (one group of :class:`sidecar.config.settings.DaemonConfig`)"""

    TITLE: ClassVar[str] = "timeouts"

    step_timeout_s: float = field(
        default=300.0,
        metadata=knob("--step-timeout", v.seconds, "SECONDS", "abort a step not sealed by then"),
    )
    rank_timeout_s: float = field(
        default=10.0, metadata=knob("--rank-timeout", v.seconds, "SECONDS", "a rank silent this long is dead")
    )
    heartbeat_interval_s: float = field(
        default=1.0, metadata=knob("--heartbeat-interval", v.seconds, "SECONDS", "rank ping interval")
    )
    reader_timeout_s: float = field(
        default=30.0,
        metadata=knob("--reader-timeout", v.seconds, "SECONDS", "drop a silent reader, or its hold"),
    )
    shutdown_timeout_s: float = field(
        default=10.0,
        metadata=knob("--shutdown-timeout", v.seconds, "SECONDS", "escalate shutdown after this"),
    )
    forward_timeout_s: float = field(
        default=20.0,
        metadata=knob(
            "--forward-timeout",
            v.seconds,
            "SECONDS",
            "give up on a peer after this",
            note="below reader_timeout_s",
        ),
    )
    drain: DrainMode = field(
        default=DrainMode.ABORT,
        metadata=knob(
            "--drain",
            v.choice(DrainMode),
            "MODE",
            "SIGTERM: abort the step in flight, or finish it",
            note="SIGTERM mid-step: abort it, or finish it (within shutdown_timeout_s)",
        ),
    )
