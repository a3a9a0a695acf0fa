"""The ``hot-compile`` command line."""

from __future__ import annotations

import argparse
import sys


def _version(_: argparse.Namespace) -> int:
    import torch

    import hot_compile

    print(f"hot-compile {hot_compile.__version__} (torch {torch.__version__})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hot-compile", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("version", help="print the versions of hot-compile and torch").set_defaults(run=_version)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
