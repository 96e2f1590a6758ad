"""The runtime directory: where it is by default, and making sure nobody else can enter it.

``runtime_dir`` holds the daemon's sockets and state; mode 0700 is what keeps other users off the
sockets, so :func:`prepare_runtime_dir` refuses a directory others can reach, a link, or one owned by
someone else.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path

from sidecar.config.values import CONTROL_SOCKET, ConfigError, Problem


def default_listen(runtime_dir: Path) -> str:
    return f"ipc://{Path(runtime_dir) / CONTROL_SOCKET}"


def default_runtime_dir(env: Mapping[str, str], *, uid: int | None = None) -> Path:
    """``$RUNTIME_DIRECTORY`` (systemd's ``RuntimeDirectory=``; the first, if it lists several), else
    ``$XDG_RUNTIME_DIR/refitd``, else ``/tmp/refitd-<uid>``. Empty or relative values are skipped."""
    return _default_runtime_dir(env, uid)[0]


def _default_runtime_dir(env: Mapping[str, str], uid: int | None) -> tuple[Path, str]:
    systemd = env.get("RUNTIME_DIRECTORY", "").split(":")[0]
    if os.path.isabs(systemd):
        return Path(systemd), "the default from $RUNTIME_DIRECTORY"
    xdg = env.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(xdg):
        return Path(xdg) / "refitd", "the default from $XDG_RUNTIME_DIR"
    uid = os.getuid() if uid is None else uid
    return Path(f"/tmp/refitd-{uid}"), "the default /tmp/refitd-<uid>"


def prepare_runtime_dir(path: Path, *, uid: int | None = None) -> Path:
    """Create the runtime directory ``path`` (a DaemonConfig's ``runtime_dir``) with mode 0700 if it is missing (its parent must exist), and check it:
    a directory, not a link, owned by ``uid`` (default: this process's), that nobody else can enter."""
    uid = os.geteuid() if uid is None else uid
    where = "choose another directory with --runtime-dir or REFITD_RUNTIME_DIR"
    try:
        os.mkdir(path, 0o700)
        os.chmod(path, 0o700)  # mkdir's mode passes through the umask
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError(
            [Problem(f"cannot create runtime_dir {path}: {exc.strerror or exc}; {where}", ("runtime_dir",))]
        ) from None
    st = os.lstat(path)
    mode = stat.S_IMODE(st.st_mode)
    problems = []
    if stat.S_ISLNK(st.st_mode):
        problems.append(f"runtime_dir {path} is a symbolic link; give the directory itself, or {where}")
    elif not stat.S_ISDIR(st.st_mode):
        problems.append(f"runtime_dir {path} exists and is not a directory; {where}")
    elif st.st_uid != uid:
        problems.append(
            f"runtime_dir {path} is owned by uid {st.st_uid}, not uid {uid} that refitd runs as; {where}"
        )
    elif mode & 0o077:
        problems.append(
            f"runtime_dir {path} has mode {mode:04o}: group or others can reach its sockets; "
            f"run `chmod 700 {path}`, or {where}"
        )
    elif mode & 0o700 != 0o700:
        problems.append(f"runtime_dir {path} has mode {mode:04o}: refitd needs rwx; run `chmod 700 {path}`")
    if problems:
        raise ConfigError(Problem(p, ("runtime_dir",)) for p in problems)
    return path
