"""The CURVE keys of TCP control channels: key files, and configuring ZeroMQ sockets with them.

A keypair is two text files in ZeroMQ's certificate format (``zmq.auth.load_certificate`` reads
them)::

    NAME.key       public-key and secret-key; mode 0600: the daemon's (or client's) own keypair
    NAME.key.pub   public-key only: hand it to whoever must trust NAME

A daemon that listens on ``tcp://`` with ``curve_secret_key`` is a CURVE server: every connection is
encrypted, and a ZAP handler lets in only the public keys in ``curve_allowed_keys`` (a ``*.key.pub``
file, or a folder of ``*.pub`` files). A client (``RefitClient`` / ``RefitReader`` ``curve=``, or a
trainer daemon's forwarders) needs the server's public key and its own keypair::

    curve = client_curve("inference.key.pub", "trainer.key")   # (server_public, public, secret)
    RefitReader("tcp://10.0.0.6:5555", curve=curve)

Parsing needs no zmq; only making keys and configuring sockets import it.

``refitd keygen`` (``sidecar.cli.keygen``) writes keypairs with :func:`write_keypair`; the daemon, the trainer client, the
forwarders and the engine readers use the functions here.
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("refitd.curve")

SECRET_SUFFIX = ".key"
PUBLIC_SUFFIX = ".key.pub"
_KEY_LINE = re.compile(r'^\s*(public|secret)-key\s*=\s*"([^"]{40})"\s*$', re.MULTILINE)

#: (server public key, client public key, client secret key), Z85 bytes
Curve = tuple[bytes, bytes, bytes]


# --------------------------------------------------------------------------------------------------
# files


def read_key_file(path: str | os.PathLike) -> tuple[bytes, bytes | None]:
    """(public, secret or None) from a key file; ValueError naming the file if it holds no key."""
    text = Path(path).read_text(encoding="utf-8")
    keys = {kind: value.encode() for kind, value in _KEY_LINE.findall(text)}
    if "public" not in keys:
        raise ValueError(f"{path} holds no CURVE public key; make keys with `refitd keygen NAME`")
    return keys["public"], keys.get("secret")


def allowed_keys(path: str | os.PathLike) -> set[bytes]:
    """The public keys in a key file, or in every ``*.pub`` file of a folder."""
    path = Path(path)
    files = sorted(path.glob("*.pub")) if path.is_dir() else [path]
    keys = {read_key_file(f)[0] for f in files}
    if not keys:
        raise ValueError(f"{path} holds no *.pub key files; copy the clients' NAME.key.pub files there")
    return keys


def own_keypair(
    secret_file: str | os.PathLike, public_file: str | os.PathLike | None = None
) -> tuple[bytes, bytes]:
    """(public, secret) of this side's keypair file (``public_file`` overrides its public key)."""
    public, secret = read_key_file(secret_file)
    if secret is None:
        raise ValueError(f"{secret_file} holds no secret key: give the NAME.key file, not NAME.key.pub")
    if public_file is not None:
        public = read_key_file(public_file)[0]
    return public, secret


def client_curve(server_public_file: str | os.PathLike, client_secret_file: str | os.PathLike) -> Curve:
    """The ``curve=`` argument of RefitClient / RefitReader from two key files."""
    public, secret = own_keypair(client_secret_file)
    return read_key_file(server_public_file)[0], public, secret


def _key_text(public: bytes, secret: bytes | None) -> str:
    kind = "Secret" if secret is not None else "Public"
    lines = [
        f"#   ****  Generated on {time.strftime('%Y-%m-%d %H:%M:%S')} by refitd keygen  ****",
        f"#   ZeroMQ CURVE {kind} Certificate",
        "#   DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions." if secret else "",
        "",
        "metadata",
        "curve",
        f'    public-key = "{public.decode()}"',
    ]
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    return "\n".join(lines) + "\n"


def write_keypair(directory: str | os.PathLike, name: str, *, force: bool = False) -> tuple[Path, Path]:
    """Write ``NAME.key`` (mode 0600) and ``NAME.key.pub``; FileExistsError unless ``force``."""
    import zmq

    if not zmq.has("curve"):
        raise RuntimeError("this libzmq was built without CURVE support; install pyzmq's wheel")
    directory = Path(directory)
    secret_path, public_path = directory / f"{name}{SECRET_SUFFIX}", directory / f"{name}{PUBLIC_SUFFIX}"
    if not force:
        for p in (secret_path, public_path):
            if p.exists():
                raise FileExistsError(f"{p} exists; pass --force to replace it")
    public, secret = zmq.curve_keypair()
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    fd = os.open(secret_path, flags, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(_key_text(public, secret))
    public_path.write_text(_key_text(public, None), encoding="utf-8")
    return secret_path, public_path


# --------------------------------------------------------------------------------------------------
# sockets


def set_client(sock: Any, curve: Curve | None) -> None:
    """Make ``sock`` a CURVE client of a server with public key ``curve[0]`` (no-op for None)."""
    if curve is None:
        return
    server_public, public, secret = curve
    sock.curve_serverkey = server_public
    sock.curve_publickey = public
    sock.curve_secretkey = secret


def curve_hint(curve: Curve | None) -> str:
    """What a silent CURVE server most likely means, for a client's timeout message."""
    if curve is None:
        return ""
    return (
        "; this connection uses CURVE, and a server that refuses the client's public key (not in its "
        "curve_allowed_keys) or was given the wrong server key never answers: check both keys"
    )


class AllowList:
    """A ZAP credentials provider: lets in the public keys it holds and logs the ones it refuses."""

    def __init__(self, keys: set[bytes]):
        self.keys = frozenset(keys)

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key in self.keys
        if not ok:
            log.warning(
                "refused a CURVE client whose public key %s is not in curve_allowed_keys", key.decode()
            )
        return ok


def start_authenticator(ctx: Any, allowed: set[bytes]) -> Any:
    """A ZAP handler on ``ctx`` enforcing ``allowed``; the caller stops it on close."""
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx, log=logging.getLogger("refitd.zap"))
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=AllowList(allowed))
    return auth


def set_server(sock: Any, public: bytes, secret: bytes) -> None:
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.curve_server = True


def unset_server(sock: Any) -> None:
    """Back to the NULL mechanism for the binds that follow (e.g. the local ipc:// endpoint)."""
    sock.curve_server = False  # NULL with no zap_domain: ZAP is not consulted
