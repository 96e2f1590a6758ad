"""The daemon's identity and sockets: where it listens, who may connect, what a message may hold.

``runtime_dir`` holds the sockets and the daemon's state and is made mode 0700, which is what keeps
other users off the sockets. ``listen`` is the control endpoint: ``ipc://PATH`` inside
``runtime_dir`` (default ``ipc://<runtime_dir>/control.sock``), or ``tcp://HOST:PORT`` for remote
clients, only ever when given explicitly. CURVE secures TCP control channels (``refitd keygen NAME``
writes ``NAME.key`` and ``NAME.key.pub``): ``curve_secret_key`` is this daemon's keypair file
(``curve_public_key`` defaults to the public key inside it), ``curve_allowed_keys`` a public-key
file, or a folder of ``*.pub`` files, of the clients allowed in; a daemon refuses to listen on a
non-loopback TCP address without them. Wire limits: the largest data frame and header accepted,
the frames a remote client may have in flight before it waits for credit, and the pieces all ranks
may declare in one step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from sidecar.config import values as v
from sidecar.config.groups.common import OPT_PATH as _OPT_PATH
from sidecar.config.groups.common import OPT_TEXT as _OPT_TEXT
from sidecar.config.values import MiB, knob, parse_size


@dataclass(frozen=True, kw_only=True)
class IdentitySettings:
    """The daemon's identity and sockets: where it listens, who may connect, what a message may hold. (one group of :class:`sidecar.config.settings.DaemonConfig`)"""

    TITLE: ClassVar[str] = "identity and sockets"

    runtime_dir: Path = field(
        metadata=knob(
            "--runtime-dir",
            v.to_path,
            "DIR",
            "sockets and state (made mode 0700)",
            is_path=True,
            example='"/run/refitd"',
            note="default: $RUNTIME_DIRECTORY, $XDG_RUNTIME_DIR/refitd, /tmp/refitd-<uid>",
        )
    )
    listen: str | None = field(
        default=None,
        metadata=knob(
            "--listen",
            _OPT_TEXT,
            "URL",
            "ipc://PATH in runtime_dir, or tcp://HOST:PORT",
            example='"tcp://*:5555"',
            note="default: ipc://<runtime_dir>/control.sock",
        ),
    )
    curve_secret_key: Path | None = field(
        default=None,
        metadata=knob(
            "--curve-secret-key",
            _OPT_PATH,
            "PATH",
            "this daemon's CURVE keypair (NAME.key)",
            is_path=True,
            example='"/etc/refitd/node.key"',
            note="`refitd keygen node`; needed to listen on a non-loopback tcp://",
        ),
    )
    curve_public_key: Path | None = field(
        default=None,
        metadata=knob(
            "--curve-public-key",
            _OPT_PATH,
            "PATH",
            "its public key (default: from NAME.key)",
            is_path=True,
            example='"/etc/refitd/node.key.pub"',
            note="default: read from curve_secret_key",
        ),
    )
    curve_allowed_keys: Path | None = field(
        default=None,
        metadata=knob(
            "--curve-allowed-keys",
            _OPT_PATH,
            "PATH",
            "clients' public keys: file or dir",
            is_path=True,
            example='"/etc/refitd/clients"',
            note="a *.key.pub file or a folder of them",
        ),
    )
    max_frame_bytes: int = field(
        default=64 * MiB,
        metadata=knob(
            "--max-frame-bytes",
            parse_size,
            "SIZE",
            "largest data frame accepted",
            example='"64MiB"',
            commented=False,
        ),
    )
    max_header_bytes: int = field(
        default=16 * MiB,
        metadata=knob(
            "--max-header-bytes",
            parse_size,
            "SIZE",
            "largest header accepted",
            example='"16MiB"',
            commented=False,
        ),
    )
    credit_frames: int = field(
        default=8, metadata=knob("--credit-frames", v.count, "N", "frames a remote client may have in flight")
    )
    max_step_pieces: int = field(
        default=1 << 20,
        metadata=knob(
            "--max-step-pieces",
            v.count,
            "N",
            "pieces all ranks may declare in one step",
            note="pieces all ranks may declare in one step",
        ),
    )
