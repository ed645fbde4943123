"""The ``nvrar`` command: one entry point, one subcommand per job.

Each subcommand lives in its own module, which exposes ``register(subparsers)``; the
module is imported only when its subcommand runs or help is printed, so ``nvrar plan``
never pays for the native module and ``nvrar bench`` never pays for the planner.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

__all__ = ["main"]

# subcommand -> module that registers it (a module may register several subcommands)
_SUBCOMMAND_MODULES = (
    "nvrar.bench",
    "nvrar.model.cli",
    "nvrar.bench.tune",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nvrar",
        description="nvrar: low-latency hierarchical all-reduce (NVRAR) tools.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in _SUBCOMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
