"""What one HOT setting costs a training step: the hot variants with and without it, in one process.

Runs of ``tools/bench.py`` minutes apart differ by more than a few percent on a shared VM. Here each
hot variant is compiled twice, at the defaults and with ``--options`` on top, and the four runners
take their steps in turn, in a rotating order (:func:`hot_compile.harness.bench_cases.take_steps`), so
that both sides of each ratio meet the same machine.

    python tools/option_cost.py --model vit --options '{"compress_saved": false}' --out benchmarks/DIR
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

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=bench_cases.MODELS, required=True)
    parser.add_argument("--options", type=json.loads, required=True, help="HotConfig settings of the other side, as JSON")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per runner (default 10)")
    parser.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    variants = ("hot-fp32", "hot-bf16")
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
    command = "python tools/option_cost.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [f"`{command}`", "", f"| {args.model} | defaults ms | with {json.dumps(args.options)} ms | with / defaults |", "|---|---|---|---|"]
    for v in variants:
        base, other = ms[f"{v}, defaults"], ms[f"{v}, with options"]
        lines.append(f"| {v} | {base:.1f} | {other:.1f} | {other / base:.3f} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"option_cost_{args.model}.json").write_text(json.dumps({"command": command, "median_ms": ms}, indent=2))
    (args.out / f"option_cost_{args.model}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
