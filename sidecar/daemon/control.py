"""Controlling a running daemon: SIGHUP's reload and the drain on stop.

``reload`` applies what may change safely (timeouts, logging, drain) and names what needs a
restart; ``drain`` lets the step in flight publish (or fail) within shutdown_timeout_s when
drain=finish. Both run on the serve loop (sidecar.daemon.loop); the stop flags stay on the daemon.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from sidecar.config.settings import RELOADABLE, DrainMode

log = logging.getLogger("refitd.daemon")


def reload(daemon, load_config: Callable[[], Any]) -> list[str]:
    """Re-read the configuration (``load_config() -> DaemonConfig``); apply the reloadable keys that
    changed, log the others as needing a restart. An invalid configuration keeps the current one.
    Returns the keys applied."""
    try:
        new = load_config()
    except ValueError as exc:  # ConfigError: keep the running configuration
        log.error("SIGHUP: the new configuration is invalid, keeping the current one:\n%s", exc)
        return []
    old, changed, refused = daemon.config.to_dict(), [], []
    for key, value in new.to_dict().items():
        if value != old.get(key):
            (changed if key in RELOADABLE else refused).append(key)
    if changed:
        daemon.config = daemon.config.replace(**{k: getattr(new, k) for k in changed})
        logging.getLogger("refitd").setLevel(daemon.config.log_level.level)
        log.info("SIGHUP: reloaded %s", ", ".join(f"{k}={getattr(daemon.config, k)}" for k in changed))
    if refused:
        log.warning(
            "SIGHUP: %s changed but needs a restart; still running with the old values",
            ", ".join(refused),
        )
    if not changed and not refused:
        log.info("SIGHUP: the configuration is unchanged")
    return changed


def drain(daemon, poll: Callable[[Any], None] | None = None) -> None:
    """On stop: with drain=finish, tick until the step in flight publishes (or fails), at most
    shutdown_timeout_s, or until a second stop request (``daemon._force``)."""
    if daemon.step is None or daemon.config.drain is not DrainMode.FINISH:
        return
    daemon.draining = True
    deadline = time.monotonic() + daemon.config.shutdown_timeout_s
    log.info(
        "draining: waiting up to %.0f s for step %d to finish",
        daemon.config.shutdown_timeout_s,
        daemon.step.step,
    )
    while daemon.step is not None and time.monotonic() < deadline and not daemon._force:
        daemon.tick()
        if poll is not None:
            poll(daemon)
