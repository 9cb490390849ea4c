"""The ``memctl`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from memctl._version import __version__

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memctl",
        description="Runtime memory manager for PyTorch training: compressed saved activations "
        "under a live memory budget.",
    )
    parser.add_argument("--version", action="version", version=f"memctl {__version__}")
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
