"""The ``refitd`` command line: one subcommand per job, each in its own module.

Every subcommand module exposes ``add_parser(subparsers)`` returning its parser, with
``set_defaults(run=<callable(args) -> int>)``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from sidecar import __version__

#: subcommand name -> module that defines it
COMMANDS = {
    "serve": "sidecar.serve_cli",
    "plan": "sidecar.plan_cli",
    "demo": "sidecar.demo",
    "keygen": "sidecar.keygen",
}

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="refitd", description="refitd: BF16 trainer weights in, versioned FP8 generations out."
    )
    parser.add_argument("--version", action="version", version=f"refitd {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    version = sub.add_parser("version", help="print the version and exit")
    version.set_defaults(run=lambda args: print(f"refitd {__version__}") or EXIT_OK)
    for module in COMMANDS.values():
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return EXIT_USAGE
    return int(args.run(args) or EXIT_OK)


if __name__ == "__main__":
    sys.exit(main())
