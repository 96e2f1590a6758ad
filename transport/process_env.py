"""The process environment that libraries under transport/ take their settings from: the one place
transport/ reads (and, for ``UCX_TLS``, writes) ``os.environ``.

refitd's own settings never come from here: the daemon's come from ``sidecar.config``, which
transport/ never imports, and reach transport/ as arguments. The three variables below belong to
CUDA, NIXL and UCX, which read them from the process environment themselves and offer no other
way to set them, so transport/ must look at the same place:

- ``CUDA_VISIBLE_DEVICES`` is CUDA's: the driver applies it when it initializes. transport.gpus
  reads it to map an NVML UUID to this process's CUDA index when CUDA is not initialized, and
  names it in the error for a GPU the process cannot see.
- ``NIXL_LOG_LEVEL`` is NIXL's: its import sets the ``nixl`` logger's level from it.
  transport.nixl_runtime quiets NIXL's INFO default to WARNING only when the operator chose no level.
- ``UCX_TLS`` is UCX's: UCX reads it from the environment when a backend's context is made. NIXL's
  only other route, the UCX backend's ``engine_config`` parameter, splits its value on commas, so
  it cannot carry a list of transports (``tcp,cma``), and an exported ``UCX_TLS`` wins over it
  anyway. ``NixlEndpoint(ucx_tls=...)`` therefore sets the variable while its backend is made and
  puts the process's value back (:func:`ucx_backend_environment`).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Mapping

CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
NIXL_LOG_LEVEL = "NIXL_LOG_LEVEL"
UCX_TLS = "UCX_TLS"

# Held while any UCX backend is made: the environment is the whole process's, and a backend made
# on another thread meanwhile (a forwarder's) must see neither another endpoint's UCX_TLS nor a
# half-restored one.
_UCX_ENV_LOCK = threading.Lock()


def cuda_visible_devices(env: Mapping[str, str] | None = None) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` in ``env`` (default: this process's, the one its CUDA driver applies);
    None when unset (every GPU visible)."""
    return (os.environ if env is None else env).get(CUDA_VISIBLE_DEVICES)


def nixl_log_level_chosen() -> bool:
    """Whether the operator set ``NIXL_LOG_LEVEL`` (NIXL then leveled its own logger from it)."""
    return bool(os.environ.get(NIXL_LOG_LEVEL))


@contextlib.contextmanager
def ucx_backend_environment(ucx_tls: str | None = None) -> Iterator[None]:
    """Make one UCX backend inside this block: with ``UCX_TLS=ucx_tls`` when given (else the
    process's own value, usually unset), the process's value back afterwards; one block at a time
    in the process."""
    with _UCX_ENV_LOCK:
        if ucx_tls is None:
            yield
            return
        old = os.environ.get(UCX_TLS)
        os.environ[UCX_TLS] = ucx_tls
        try:
            yield
        finally:
            if old is None:
                os.environ.pop(UCX_TLS, None)
            else:
                os.environ[UCX_TLS] = old
