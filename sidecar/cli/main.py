"""The ``refitd`` command line: one subcommand per job, each in its own module.

Every subcommand module exposes ``add_parser(subparsers)`` returning its parser, with
``set_defaults(run=<callable(args) -> int>)``.

``main`` imports only the module of the subcommand it runs: ``refitd status`` (polled by readiness
checks), ``refitd --version`` and ``refitd --help`` never import torch, which the other subcommands'
modules do at import time.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from sidecar import __version__
from sidecar.config.environment import brief_openmp_spin

#: subcommand name -> module that defines it
COMMANDS = {
    "serve": "sidecar.cli.serve",
    "plan": "sidecar.cli.plan",
    "demo": "sidecar.cli.demo.command",
    "keygen": "sidecar.cli.keygen",
    "convert": "sidecar.cli.convert",
}

#: every subcommand -> its one-line help, for listing them (``refitd --help``, a bad command) without
#: importing their modules; tests/test_cli_light.py checks it against the modules' own parsers
SUBCOMMAND_HELP = {
    "serve": "run the daemon in the foreground",
    "status": "ask a running daemon how it is doing",
    "plan": "show what a refit of a model would quantize and publish (no weights needed)",
    "demo": "run refitd end to end on a small synthetic model (CPU) and verify it",
    "keygen": "write a CURVE keypair (NAME.key, NAME.key.pub) for TCP control channels",
    "convert": "write a Hugging Face checkpoint in the format and names the daemon publishes",
}
#: subcommands defined by a module other than the one ``COMMANDS`` names them after
SUBCOMMAND_MODULE = {**COMMANDS, "status": "sidecar.cli.serve"}

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    """The full parser: every subcommand's module imported."""
    return _build_parser(set(COMMANDS.values()))


def _build_parser(modules: set[str]) -> argparse.ArgumentParser:
    """The parser with the subcommands of ``modules`` defined in full; every other subcommand is
    listed (name and help, for ``--help`` and "invalid choice") but its module is not imported."""
    parser = argparse.ArgumentParser(
        prog="refitd", description="refitd: BF16 trainer weights in, versioned FP8 generations out."
    )
    parser.add_argument("--version", action="version", version=f"refitd {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    version = sub.add_parser("version", help="print the version and exit")
    version.set_defaults(run=lambda args: print(f"refitd {__version__}") or EXIT_OK)
    for name, text in SUBCOMMAND_HELP.items():  # in this order, as in ``refitd --help``
        if name in sub.choices:  # added with another of its module's subcommands
            continue
        if SUBCOMMAND_MODULE[name] in modules:
            importlib.import_module(SUBCOMMAND_MODULE[name]).add_parser(sub)
        else:
            sub.add_parser(name, help=text)
    listed = {SUBCOMMAND_MODULE[name] for name in SUBCOMMAND_HELP}
    for module in COMMANDS.values():  # one SUBCOMMAND_HELP does not list yet
        if module in modules and module not in listed:
            importlib.import_module(module).add_parser(sub)
    return parser


def _requested_command(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names: its first word not starting with ``-`` (no top-level option
    takes a value), or None."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    brief_openmp_spin()  # before torch loads (sidecar.config.environment says why)
    argv = sys.argv[1:] if argv is None else list(argv)
    module = SUBCOMMAND_MODULE.get(_requested_command(argv) or "")
    parser = _build_parser({module} if module else set())
    args = parser.parse_args(argv)
    if args.command in SUBCOMMAND_HELP and not getattr(args, "run", None):  # only listed: define it all
        parser = build_parser()
        args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return EXIT_USAGE
    return int(args.run(args) or EXIT_OK)


if __name__ == "__main__":
    sys.exit(main())
