"""A sticky CUDA error in the daemon: tell every peer, then exit non-zero for a restart.

After an illegal address or a launch failure every later CUDA call of the process fails (CUDA's
sticky errors, ``transport.cuda_driver.sticky_cuda_error``): the step fails, the replacement
staging cannot be allocated, and no later step can succeed. A daemon that kept serving would stay
wedged while its loop still fed the systemd watchdog. Instead the first such error fails the step in
flight, tells every trainer rank, reader and forwarder (ERROR, kind ``shutdown``), stops the serve
loop at once (no draining), stops feeding the watchdog (``SystemdNotifier`` reads ``fatal``) and
``refitd serve`` exits with status 1, so ``Restart=on-failure``, Slurm or Ray starts a new instance;
clients re-attach to it as after any restart.
"""

from __future__ import annotations

import logging
from typing import Any

from sidecar.errors import ErrorKind, RefitError
from transport.cuda_driver import sticky_cuda_error

log = logging.getLogger("refitd.daemon")


def stop_on_sticky(daemon: Any, exc: BaseException | None) -> bool:
    """True when ``exc`` is a sticky CUDA error (the daemon is then stopping: the caller does
    nothing more with it); the first one tells every peer and stops the loop."""
    if not sticky_cuda_error(exc):
        return False
    if daemon.fatal is not None:
        return True
    daemon.fatal = f"sticky CUDA error: {type(exc).__name__}: {exc}"
    log.critical(
        "%s; every later CUDA call of this process fails, so the daemon exits (status 1) for its "
        "supervisor (systemd Restart=on-failure, Slurm, Ray) to start a fresh one",
        daemon.fatal,
        exc_info=exc,
    )
    err = RefitError(
        f"the daemon stops: {daemon.fatal}. Its GPU context is unusable until the process restarts; "
        "its supervisor restarts it and clients re-attach to the new instance (push the step again)",
        kind=ErrorKind.SHUTDOWN,
    )
    try:
        if daemon.step is not None:
            daemon.fail_step(RefitError(err.message, kind=err.kind, step=daemon.step.step))
    except Exception:  # the failure path may itself call CUDA (copy-out, staging): go on stopping
        log.exception("failing the step in flight after a sticky CUDA error")
    for peer in list(daemon.peers.values()):
        daemon.send_error(peer.identity, err, untagged=True)
    daemon.request_stop()
    daemon.request_stop()  # a second request: stop at once, no draining (nothing can run on the GPU)
    return True
