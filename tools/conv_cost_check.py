"""Does the cost model price convolution sites right? Each backward product of a 3×3 convolution, timed.

For ResNet's four stage shapes at batch 32 (and a digit-sized one), in float32 and bfloat16, the
exact product (``convolution_backward`` with one output) and its HOT op (``conv_hq_grad_input``;
``conv_hla_grad_weight`` plus the forward's ``compress_conv_input``) are timed interleaved in one
process, medians of ``--repeats``, beside the cost model's estimates on this machine's profile. The
choice is right when "HOT is faster" agrees between the estimate and the medians.

    python tools/conv_cost_check.py --out benchmarks/conv-cost-zen4    # writes conv_cost.{json,md}
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch

from hot_compile.passes.cost_model import conv_grad_input_cost, conv_grad_weight_cost
from hot_compile.runtime import conv_ops, devices

# (batch, channels, size): ResNet-18/34's stages at 224², and a 32-channel map of an 8×8 digit.
SHAPES = ((32, 64, 56), (32, 128, 28), (32, 256, 14), (32, 512, 7), (64, 32, 8))


def _median_ms(fns: dict, repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def measure(b: int, c: int, size: int, dtype: torch.dtype, profile: devices.DeviceProfile, repeats: int) -> list[dict]:
    x, g = torch.randn(b, c, size, size, dtype=dtype), torch.randn(b, c, size, size, dtype=dtype)
    w, seed, geometry = torch.randn(c, c, 3, 3, dtype=dtype) / (3 * c**0.5), torch.tensor(1), ([1, 1], [1, 1], [1, 1])
    x_q, x_scale = conv_ops.compress_conv_input(x, 8)

    def exact(mask):
        return lambda: torch.ops.aten.convolution_backward(g, x, w, None, *geometry, False, [0, 0], 1, mask)

    def hla():
        conv_ops.compress_conv_input(x, 8)
        conv_ops.conv_hla_grad_weight(g, x_q, x_scale, seed, [3, 3], *geometry, 16, 8, True, dtype)

    ms = _median_ms(
        {
            "gx exact": exact([True, False, False]),
            "gw exact": exact([False, True, False]),
            "gx hot": lambda: conv_ops.conv_hq_grad_input(g, w, seed, [size, size], *geometry, 8, 8, True, True, "per_channel"),
            "gw hot": hla,
        },
        repeats,
    )
    t, k, flops, elem = b * size * size, 9 * c, profile.matmul_rate(dtype), x.element_size()
    estimates = {
        "gx": conv_grad_input_cost(t, c, k, x.numel(), 9, elem, flops, profile, 8),
        "gw": conv_grad_weight_cost(t, c, k, tuple(x.shape), 16, elem, flops, profile, 8),
    }
    rows = []
    for path, cost in estimates.items():
        measured_faster = ms[f"{path} hot"] < ms[f"{path} exact"]
        rows.append(
            {
                "shape": [b, c, size, size], "dtype": str(dtype).removeprefix("torch."), "path": path,
                "exact_ms": ms[f"{path} exact"], "hot_ms": ms[f"{path} hot"],
                "est_exact_ms": 1e3 * cost.original_s, "est_hot_ms": 1e3 * cost.hot_s,
                "right": (cost.hot_s < cost.original_s) == measured_faster,
            }
        )  # fmt: skip
    return rows


def markdown(rows: list[dict], command: str, profile: str) -> str:
    right = sum(r["right"] for r in rows)
    lines = [
        f"`{command}` (profile {profile}): the estimate puts the faster variant first for {right} of {len(rows)} products.",
        "",
        "| shape | dtype | product | exact ms | HOT ms | est. exact ms | est. HOT ms | choice |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {'×'.join(map(str, r['shape']))} | {r['dtype']} | {r['path']} | {r['exact_ms']:.1f} | {r['hot_ms']:.1f} | "
            f"{r['est_exact_ms']:.1f} | {r['est_hot_ms']:.1f} | {'right' if r['right'] else 'wrong'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    profile = devices.resolve_profile(torch.device("cpu"))
    rows = []
    for b, c, size in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            rows += measure(b, c, size, dtype, profile, args.repeats)
            print(json.dumps(rows[-2:]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "conv_cost.json").write_text(json.dumps(rows, indent=2))
    command = "python tools/conv_cost_check.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = markdown(rows, command.strip(), profile.name)
    (args.out / "conv_cost.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
