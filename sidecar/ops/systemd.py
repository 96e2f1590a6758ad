"""Tell systemd how the daemon is doing (``Type=notify``), without libsystemd.

systemd starts a ``Type=notify`` service with ``$NOTIFY_SOCKET`` set to an ``AF_UNIX`` datagram
socket (a path, or ``@name`` for the abstract namespace). Each datagram is newline-separated
``KEY=VALUE`` lines (sd_notify(3)); refitd sends:

==============  ==================================================================================
``READY=1``      the control socket listens and the arenas exist: trainers may push (``on_ready``)
``STATUS=...``   one line for ``systemctl status``: last published step, step in progress, failure
``WATCHDOG=1``   every ``$WATCHDOG_USEC / 2`` from the serve loop, so a stuck loop gets restarted
``STOPPING=1``   shutdown began (``on_stopping``)
==============  ==================================================================================

Outside systemd (no ``$NOTIFY_SOCKET``) nothing is sent and nothing is logged. The environment is
read once, when :class:`SystemdNotifier` is built (``refitd serve`` passes ``os.environ``)::

    notifier = SystemdNotifier(os.environ)
    if notifier.enabled:
        Daemon(config, observers=[notifier])
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sidecar.ops.observers import Observer

if TYPE_CHECKING:  # pragma: no cover
    from sidecar.daemon.context import LoopContext as Daemon  # the serve loop, as it lends itself
    from sidecar.daemon.step import StepState
    from sidecar.errors import RefitError

log = logging.getLogger("refitd.systemd")

NOTIFY_SOCKET = "NOTIFY_SOCKET"
WATCHDOG_USEC = "WATCHDOG_USEC"
WATCHDOG_PID = "WATCHDOG_PID"
#: systemd asks for a keep-alive ping at least every ``WatchdogSec``; sd_watchdog_enabled(3)
#: recommends pinging at half that, so one late turn of the loop is not fatal.
WATCHDOG_FRACTION = 0.5
#: sd_notify(3) messages are small; longer STATUS lines are cut here (systemctl shows one line).
MAX_STATUS_CHARS = 400


def _address(value: str) -> str:
    """``$NOTIFY_SOCKET`` as ``socket.sendto`` wants it: ``@name`` is the abstract ``\\0name``."""
    return "\0" + value[1:] if value.startswith("@") else value


def sd_notify(state: str, *, env: Mapping[str, str] | None = None) -> bool:
    """Send ``state`` (e.g. ``"READY=1\\nSTATUS=serving"``) to ``$NOTIFY_SOCKET`` in one datagram.

    ``env`` defaults to ``os.environ``. Returns True if the datagram was sent; False, doing
    nothing, when the variable is unset or empty (not under systemd), and False with a debug log
    when the socket cannot be reached: a notification must never take the daemon down.
    """
    target = (os.environ if env is None else env).get(NOTIFY_SOCKET, "")
    return _send(target, state)


def _send(target: str, state: str) -> bool:
    if not target:
        return False
    if not target.startswith(("/", "@")):
        log.debug("ignoring $NOTIFY_SOCKET=%r: neither a path nor @abstract", target)
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(state.encode(), _address(target))
    except OSError as exc:
        log.debug("sd_notify to %s failed: %s", target, exc)
        return False
    return True


def watchdog_interval(env: Mapping[str, str], pid: int) -> float | None:
    """Seconds between ``WATCHDOG=1`` pings, or None when systemd watches no process, or another.

    ``$WATCHDOG_USEC`` is the unit's ``WatchdogSec=`` in microseconds; ``$WATCHDOG_PID``, when set,
    names the process it applies to (sd_watchdog_enabled(3)): a child that inherited the
    variables must not ping for its parent.
    """
    usec, owner = env.get(WATCHDOG_USEC, ""), env.get(WATCHDOG_PID, "")
    if not usec:
        return None
    if owner:
        try:
            if int(owner) != pid:
                return None
        except ValueError:
            log.warning("ignoring $%s=%r: not a process id", WATCHDOG_PID, owner)
            return None
    try:
        value = int(usec)
    except ValueError:
        value = 0
    if value <= 0:
        log.warning("ignoring $%s=%r: expected a positive number of microseconds", WATCHDOG_USEC, usec)
        return None
    return value / 1e6 * WATCHDOG_FRACTION


def describe(daemon: Daemon, failure: str | None = None, *, state: str = "serving") -> str:
    """The STATUS= line: e.g. ``serving; last published step 12; step 13 in progress (1/4 ranks committed)``."""
    parts = [state]
    last, step = daemon.last_step, daemon.step
    parts.append("no step published yet" if last is None else f"last published step {last}")
    if step is not None and (last is None or step.step > last):
        world = daemon.config.world_size
        parts.append(f"step {step.step} in progress ({len(step.committed)}/{world} ranks committed)")
    if failure:
        parts.append(failure)
    engines = len(daemon.engines)
    if engines:
        parts.append(f"{engines} engine worker{'s' if engines != 1 else ''} attached")
    return "; ".join(parts)


class SystemdNotifier(Observer):
    """READY, STATUS, WATCHDOG and STOPPING for a ``Type=notify`` unit; a no-op without systemd.

    ``env`` is read here and only here (``NOTIFY_SOCKET``, ``WATCHDOG_USEC``, ``WATCHDOG_PID``);
    ``pid`` is this process (``WATCHDOG_PID`` is compared with it).
    """

    def __init__(self, env: Mapping[str, str], *, pid: int | None = None) -> None:
        self.socket = env.get(NOTIFY_SOCKET, "")
        pid = os.getpid() if pid is None else pid
        self.watchdog_s = watchdog_interval(env, pid) if self.socket else None
        self._next_ping: float | None = None
        self._status = ""
        self._failure: str | None = None
        self._stopping = False
        self._warned = False

    @property
    def enabled(self) -> bool:
        return bool(self.socket)

    def send(self, *lines: str) -> bool:
        if not self.socket:
            return False
        sent = _send(self.socket, "\n".join(lines))
        if not sent and not self._warned:
            self._warned = True  # once: a dead socket would otherwise warn every watchdog period
            log.warning(
                "cannot notify systemd at $NOTIFY_SOCKET=%s; later failures are not logged", self.socket
            )
        return sent

    # -- Observer hooks ------------------------------------------------------------------------

    def on_ready(self, daemon: Daemon) -> None:
        self._status = describe(daemon)
        self.send("READY=1", self._status_line(self._status))
        if self.watchdog_s is not None:
            log.info("systemd watchdog: pinging every %.3g s", self.watchdog_s)
            self._next_ping = None  # ping on the first tick

    def on_tick(self, daemon: Daemon, now: float) -> None:
        if self._stopping or not self.socket:
            return
        if getattr(daemon, "fatal", None) is not None:
            return  # a sticky CUDA error: no more WATCHDOG=1 from a daemon that can do no GPU work
        if self.watchdog_s is not None and (self._next_ping is None or now >= self._next_ping):
            self.send("WATCHDOG=1")
            self._next_ping = now + self.watchdog_s
        self._refresh(daemon)

    # The two step hooks run before the daemon clears ``daemon.step``; the next tick (at most
    # ``heartbeat_interval_s / 4`` later) sends the new STATUS.

    def on_step_published(self, daemon: Daemon, record: dict[str, Any], state: StepState) -> None:
        self._failure = None

    def on_step_failed(self, daemon: Daemon, err: RefitError) -> None:
        where = f"step {err.step} failed" if err.step is not None else "a step failed"
        self._failure = f"{where} ({err.kind.value})"

    def on_stopping(self, daemon: Daemon) -> None:
        if self._stopping or not self.socket:
            return
        self._stopping = True
        self.send("STOPPING=1", self._status_line(describe(daemon, self._failure, state="stopping")))

    # -------------------------------------------------------------------------------------------

    def _refresh(self, daemon: Daemon) -> None:
        """Send STATUS= when the line changed (a step began, a rank committed, a step ended)."""
        if self._stopping or not self.socket:
            return
        status = describe(daemon, self._failure)
        if status != self._status:
            self._status = status
            self.send(self._status_line(status))

    @staticmethod
    def _status_line(text: str) -> str:
        return "STATUS=" + " ".join(text.split())[:MAX_STATUS_CHARS]
