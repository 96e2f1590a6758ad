"""``refitd keygen``: write a CURVE keypair for TCP control channels (the keys themselves:
``transport.curve``)."""

from __future__ import annotations

import argparse
import sys

from transport.curve import write_keypair

# --------------------------------------------------------------------------------------------------
# the command


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "keygen", help="write a CURVE keypair (NAME.key, NAME.key.pub) for TCP control channels"
    )
    p.add_argument("name", help="file name stem, e.g. the node's host name")
    p.add_argument("--dir", default=".", help="folder to write the two files into (default: here)")
    p.add_argument("--force", action="store_true", help="replace existing files")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    try:
        secret, public = write_keypair(args.dir, args.name, force=args.force)
    except (FileExistsError, RuntimeError, OSError) as exc:
        print(f"refitd keygen: {exc}", file=sys.stderr)
        return 1
    print(
        f"wrote {secret} (secret, mode 0600: keep it on this node) and {public} (public: share it)\n"
        "\n"
        "A daemon listening on a non-loopback tcp:// address:\n"
        f"  refitd serve --listen tcp://*:5555 --curve-secret-key {secret} --curve-allowed-keys CLIENTS\n"
        "  (CLIENTS: a client's NAME.key.pub, or a folder of *.pub files of every allowed client)\n"
        "A trainer daemon forwarding to inference daemons:\n"
        f"  refitd serve --layout disaggregated --role trainer --peers tcp://HOST:5555 --curve-secret-key {secret} "
        "--curve-server-key INFERENCE.key.pub\n"
        "A Python client or engine reader:\n"
        f"  curve=transport.curve.client_curve('SERVER.key.pub', '{secret}')"
    )
    return 0
