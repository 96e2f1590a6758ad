"""Binding the daemon's control socket.

An ``ipc://`` control socket is a file, and its mode is what the kernel checks when a process
connects. ZeroMQ creates it with ``bind(2)``, whose mode is ``0777`` less the process umask: under
``umask 0`` any local user that can reach the directory could connect. The runtime directory is
0700 (``sidecar.config.settings.prepare_runtime_dir``), but the socket itself must not depend on that, so
:func:`bind_control` narrows it to ``0600`` right after binding, whatever the umask, and checks it::

    bind_control(router, "ipc:///run/user/1000/refitd/control.sock")
"""

from __future__ import annotations

import contextlib
import os
import stat

import zmq

#: the mode of an ipc:// control socket: its owner (the daemon's user) only
CONTROL_SOCKET_MODE = 0o600


def ipc_path(endpoint: str) -> str | None:
    """The file of an ``ipc://`` endpoint; None for any other scheme (or an abstract socket)."""
    if not endpoint.startswith("ipc://"):
        return None
    path = endpoint.removeprefix("ipc://")
    return None if not path or path.startswith("@") else path


def bind_control(sock: zmq.Socket, endpoint: str) -> None:
    """``sock.bind(endpoint)``; an ipc:// socket file is then made ``0600`` whatever the umask.

    Raises ``OSError`` (after unbinding) if the mode cannot be set: a control socket other users
    could connect to is worse than none."""
    sock.bind(endpoint)
    path = ipc_path(endpoint)
    if path is None:
        return
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):  # never chmod what a link points to
            raise OSError(f"{path} is not a socket")
        os.chmod(path, CONTROL_SOCKET_MODE)
        st = os.lstat(path)
    except OSError as exc:
        _unbind(sock, endpoint)
        raise OSError(f"cannot make the control socket {path} private (chmod 600): {exc}") from None
    mode = stat.S_IMODE(st.st_mode)
    if mode != CONTROL_SOCKET_MODE or not stat.S_ISSOCK(st.st_mode):
        _unbind(sock, endpoint)
        raise OSError(
            f"the control socket {path} has mode {mode:04o} after chmod 600; refusing to serve on it"
        )


def _unbind(sock: zmq.Socket, endpoint: str) -> None:
    with contextlib.suppress(zmq.ZMQError):
        sock.unbind(endpoint)
