"""Observers: how operations features (systemd notify, metrics, timelines) watch the daemon.

The serve loop calls each observer's hooks at fixed points; an observer never changes what the
daemon does, and an observer that raises is logged and ignored (a metrics bug must not fail a step).
Subclass ``Observer`` and override what you need:

    class Printer(Observer):
        def on_step_published(self, daemon, record, state):
            print(record["step"], record["seconds"]["total"])

    Daemon(config, observers=[Printer()])
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from sidecar.daemon.context import LoopContext as Daemon  # the serve loop, as it lends itself
    from sidecar.daemon.step import StepState
    from sidecar.errors import ErrorKind, RefitError

log = logging.getLogger("refitd.observers")


class Observer:
    """No-op hooks; each is called on the serve loop's thread."""

    def on_ready(self, daemon: Daemon) -> None:
        """The control socket listens and the arenas are allocated: pushes can be taken."""

    def on_tick(self, daemon: Daemon, now: float) -> None:
        """Once per turn of the serve loop (at least every ``heartbeat_interval_s / 4``)."""

    def on_unit_done(self, daemon: Daemon, step: int, unit: int, start: float, seconds: float) -> None:
        """The worker finished one unit of ``step`` (``start`` is ``time.monotonic()``)."""

    def on_step_published(self, daemon: Daemon, record: dict[str, Any], state: StepState) -> None:
        """A step went live; ``record`` is what the trainers got (seconds per phase, bytes)."""

    def on_step_failed(self, daemon: Daemon, err: RefitError) -> None:
        """A step failed on every rank with ``err``."""

    def on_step_loaded(self, daemon: Daemon, report: dict[str, Any]) -> None:
        """Every engine worker attached at publish time acknowledged the step, or timed out."""

    def on_message_error(self, daemon: Daemon, kind: ErrorKind) -> None:
        """A message was answered with an error of ``kind`` (``internal``: a bug met handling it)."""

    def on_hold_revoked(self, daemon: Daemon, reader: str, generation: int, step: int | None) -> None:
        """A step claimed ``generation`` while ``reader`` still held it (after reader_timeout_s)."""

    def on_stopping(self, daemon: Daemon) -> None:
        """The daemon is shutting down (before arenas are freed)."""


def notify(observers: list[Observer], hook: str, *args: Any) -> None:
    for observer in observers:
        try:
            getattr(observer, hook)(*args)
        except Exception:  # an observer must never take the daemon down
            log.exception("observer %s failed in %s", type(observer).__name__, hook)
