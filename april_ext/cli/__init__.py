"""The ``april-ext`` command line. Each subcommand lives in its own module, which exposes
``add_parser(subparsers)`` (registering its parser with ``set_defaults(func=...)``, a function taking
the parsed arguments and returning an exit code); registering a subcommand is one line in COMMANDS."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from april_ext.errors import AprilError

COMMANDS: list[str] = [
    "april_ext.cli.train",
    "april_ext.cli.simulate",
    "april_ext.cli.serve",
    "april_ext.cli.bench",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="april-ext", description="Active Partial Rollouts (APRIL) for LLM RL.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMANDS:
        importlib.import_module(module).add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    # The command line as given, for a subcommand that starts itself again (train --nproc-per-node).
    args.argv = argv
    try:
        return int(args.func(args))
    except AprilError as err:
        where = f" (rank {os.environ['RANK']})" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
        print(f"april-ext {args.command}{where}: error: {err}", file=sys.stderr)
        return 2
