"""Loading NIXL, and living with it: which wheel, whether a UCX backend works here, and putting
Python's signal handlers back after a backend displaced them.

Nothing here raises on import: ``import transport.nixl`` must work where nixl is not installed.
``transport.nixl`` (the endpoint) calls :func:`_backend_created` after every backend it makes.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import signal
import threading
from typing import Any

from transport.process_env import nixl_log_level_chosen, ucx_backend_environment

log = logging.getLogger("transport.nixl")

ERROR_HANDLING = "peer"  # UCX error-handling mode: a lost peer fails the transfer instead of hanging it


_BACKENDS = ("nixl_cu13", "nixl_cu12")  # the wheels ``nixl`` chooses between; any one moves DRAM


@functools.cache
def _api() -> Any:
    """NIXL's ``_api`` module. The ``nixl`` meta package picks ``nixl_cuXX`` by the CUDA major it
    detects (torch's build, else an imported ``cuda.bindings``) and refuses if that wheel is absent;
    then take whichever backend wheel is installed, which moves DRAM alike."""
    try:
        from nixl import _api

        _route_logging()
        return _api
    except ImportError as exc:
        first = exc
    for name in _BACKENDS:
        try:
            module = importlib.import_module(f"{name}._api")
        except ImportError:
            continue
        _route_logging()
        log.warning(
            "nixl: %s; using %s directly (fine for DRAM; VRAM needs the wheel matching CUDA)", first, name
        )
        return module
    raise first


def _route_logging() -> None:
    """NIXL's import sets its ``nixl`` logger to print INFO lines on stdout, which would corrupt a
    daemon's or a demo's ``--json`` output: send them through the normal logging tree instead, from
    WARNING up (``NIXL_LOG_LEVEL`` still sets the level)."""
    nixl_log = logging.getLogger("nixl")
    for handler in list(nixl_log.handlers):
        nixl_log.removeHandler(handler)
    nixl_log.propagate = True
    if not nixl_log_level_chosen():
        nixl_log.setLevel(logging.WARNING)


def backend_module() -> str | None:
    """Which NIXL wheel is in use (``"nixl_cu13"``, ...), or None if NIXL is unavailable."""
    ok, _ = available()
    return _api().__name__.rsplit(".", 1)[0] if ok else None


@functools.cache
def available() -> tuple[bool, str]:
    """``(True, "")`` if NIXL imports and a UCX backend can be created here, else ``(False, why)``."""
    try:
        api = _api()
    except Exception as exc:  # ImportError, or a wheel that fails to load its libraries
        return False, f"nixl cannot be imported ({type(exc).__name__}: {exc}); pip install 'refitd[nixl]'"
    try:
        agent = api.nixl_agent(f"refitd-probe-{os.getpid()}", api.nixl_agent_config(backends=[]))
        if "UCX" not in agent.get_plugin_list():
            return False, f"nixl has no UCX plugin (plugins: {agent.get_plugin_list()})"
        params = agent.get_plugin_params("UCX")
        params["ucx_error_handling_mode"] = ERROR_HANDLING
        with ucx_backend_environment():
            agent.create_backend("UCX", params)
    except Exception as exc:
        return False, f"nixl cannot create a UCX backend here ({type(exc).__name__}: {exc})"
    finally:
        _backend_created()
    return True, ""


# --------------------------------------------------------------------------------------------------
# signal handlers: creating a UCX backend displaces them

_HANDLED = (signal.SIGHUP, signal.SIGINT, signal.SIGTERM)
_displaced = threading.Event()  # a UCX backend was created since Python's handlers were last put back


def _backend_created() -> None:
    _displaced.set()
    keep_signal_handlers()


def keep_signal_handlers() -> None:
    """Put Python's signal handlers back after UCX displaced them.

    Creating a UCX backend replaces the process's SIGHUP (and SIGINT, SIGTERM) disposition under
    Python's handler: a SIGHUP then never reaches Python, and the daemon's reload dies silently.
    Every backend this module creates marks the handlers displaced; this reinstalls them once per
    mark. Only the main thread may install handlers, so a backend made on another thread (a
    forwarder's) is put right by the main thread's next call: the daemon's loop calls this every tick,
    which costs one flag check when nothing happened.
    """
    if not _displaced.is_set() or threading.current_thread() is not threading.main_thread():
        return
    _displaced.clear()
    for sig in _HANDLED:
        handler = signal.getsignal(sig)
        if handler is not None:
            signal.signal(sig, handler)
