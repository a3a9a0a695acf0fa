"""What one HOT setting costs a training step: the hot variants with and without it, in one process.

Runs of ``tools/bench.py`` minutes apart differ by more than a few percent on a shared VM. Here each
hot variant is compiled twice, at the defaults and with ``--options`` on top, and the runners take
their steps in turn, in a rotating order (:func:`hot_compile.harness.bench_cases.take_steps`), so
that both sides of each ratio meet the same machine. Two ratios are reported: of the two sides'
median steps, and the median over rounds of the ratio within a round, which a drift of the machine's
speed over seconds moves less.

    python tools/option_cost.py --model vit --options '{"compress_saved": false}' --out benchmarks/DIR
    python tools/option_cost.py --model vit --variants hot-bf16 --steps 40 --options '{"compress_saved": false}' --out DIR
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

WARMUP = 3


def main(argv: list[str] | None = None) -> int:
    import torch

    from hot_compile.harness import bench_cases
    from hot_compile.harness.bench import paired_ratio

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=bench_cases.MODELS, required=True)
    parser.add_argument("--options", type=json.loads, required=True, help="HotConfig settings of the other side, as JSON")
    parser.add_argument(
        "--variants", type=lambda v: tuple(v.split(",")), default=("hot-fp32", "hot-bf16"), metavar="A,B",
        help="the hot variants measured (default: hot-fp32,hot-bf16)",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per runner (default 10)")
    parser.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    variants = args.variants
    if not variants or any(v not in ("hot-fp32", "hot-bf16") for v in variants):
        parser.error(f"--variants {','.join(variants)}: accepted are hot-fp32 and hot-bf16")
    spec = bench_cases.BenchSpec(models=(args.model,), variants=variants, fresh_cache=False)
    case = bench_cases.build_case(args.model, spec)
    if isinstance(case, str):
        print(f"{args.model}: skipped, {case}")
        return 0
    sides = {"defaults": spec.hot_options(), "with options": {**spec.hot_options(), **args.options}}
    runners = {(v, side): bench_cases.Runner(v, case, fresh_cache=False, options=o) for v in variants for side, o in sides.items()}
    for runner in runners.values():
        runner.first_step()
    bench_cases.take_steps(list(runners.values()), WARMUP, args.steps)
    ms = {f"{v}, {side}": statistics.median(r.fwd_bwd) * 1e3 for (v, side), r in runners.items()}
    paired = {v: paired_ratio(runners[v, "with options"].fwd_bwd, runners[v, "defaults"].fwd_bwd) for v in variants}
    command = "python tools/option_cost.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [
        f"`{command}`",
        "",
        f"| {args.model} | defaults ms | with {json.dumps(args.options)} ms | with / defaults | with / defaults, paired by round |",
        "|---|---|---|---|---|",
    ]
    for v in variants:
        base, other = ms[f"{v}, defaults"], ms[f"{v}, with options"]
        lines.append(f"| {v} | {base:.1f} | {other:.1f} | {other / base:.3f} | {paired[v]:.3f} |")
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"command": command, "median_ms": ms, "paired_ratio": paired}
    (args.out / f"option_cost_{args.model}.json").write_text(json.dumps(record, indent=2))
    (args.out / f"option_cost_{args.model}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
