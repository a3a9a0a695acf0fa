"""The ``hot-compile`` command line."""

from __future__ import annotations

import argparse
import sys

from ..harness import bench, demo
from . import explain


def _version(_: argparse.Namespace) -> int:
    import torch

    import hot_compile

    print(f"hot-compile {hot_compile.__version__} (torch {torch.__version__})")
    return 0


def _calibrate_device(args: argparse.Namespace) -> int:
    from ..device_calibration import calibrate_device
    from ..runtime.devices import save_calibrated

    profile = calibrate_device(size=args.size, repeats=args.repeats)
    print(profile.to_json())
    if not args.no_save:
        print(f"saved to {save_calibrated(profile)}; the cost model uses it on this machine")
    return 0


def _build_kernels(_: argparse.Namespace) -> int:
    from ..runtime import cpu_kernels

    print(f"HOT's CPU kernels: {cpu_kernels.build()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hot-compile", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("version", help="print the versions of hot-compile and torch").set_defaults(run=_version)
    calibrate = sub.add_parser(
        "calibrate-device", help="measure this CPU's matmul, int8 and memory rates for the cost model"
    )
    calibrate.add_argument("--size", type=int, default=1024, help="matmul size of the micro-benchmarks")
    calibrate.add_argument("--repeats", type=int, default=15, help="timed repeats per micro-benchmark (median)")
    calibrate.add_argument("--no-save", action="store_true", help="print the profile without caching it")
    calibrate.set_defaults(run=_calibrate_device)
    sub.add_parser(
        "build-kernels", help="build HOT's CPU kernels for this machine now rather than at the first compile"
    ).set_defaults(run=_build_kernels)
    explain.add_parser(sub)
    demo.add_parser(sub)
    bench.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
