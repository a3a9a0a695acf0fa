"""``python -m hot_compile.harness.tasks TASK``: train a task with inductor fp32 and hot side by side and print
the comparison (the numbers in BENCHMARKS.md). ``ablation`` runs task 1 with each part of HOT alone;
``gradient-error`` measures one step's gradient error of every task against its sampling noise."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from . import runner


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hot_compile.harness.tasks", description=__doc__)
    parser.add_argument("task", choices=[*runner.TASKS, "ablation", "gradient-error"])
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: the task's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tasks", type=lambda v: v.split(","), default=list(runner.TASKS), metavar="A,B",
        help=f"the tasks gradient-error measures (default: all of {','.join(runner.TASKS)})",
    )  # fmt: skip
    parser.add_argument(
        "--autocast", choices=["bf16"], default=None,
        help="run the compiled steps under torch.autocast('cpu', torch.bfloat16); Inductor bf16 is the reference",
    )  # fmt: skip
    parser.add_argument("--tiny", action="store_true", help="tiny model and data, a few steps")
    parser.add_argument("--json", metavar="PATH", help="also write every number (curves, reports) as JSON")
    parser.add_argument(
        "--options", type=json.loads, default={}, metavar="JSON",
        help="HotConfig settings of the hot variant on top of the task's, e.g. '{\"forward_bits\": 8}'",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.autocast and args.task == "ablation":
        parser.error("--autocast applies to a task's comparison and to gradient-error, not to the ablation")
    if args.task == "gradient-error":
        return _gradient_errors(args)

    name = "gpt" if args.task == "ablation" else args.task
    if args.task == "ablation":
        variants = runner.ablation_variants(runner.EVERY_PRODUCT.replace(**args.options))
    else:
        variants = runner.comparison_variants(name, torch.bfloat16 if args.autocast else None, **args.options)

    def progress(step: int, losses: dict[str, float]) -> None:
        if step % 50 == 0:
            print(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in losses.items()), flush=True)

    task, results = runner.run(name, variants, tiny=args.tiny, steps=args.steps, seed=args.seed, progress=progress)
    print(runner.summary(task, results))
    for result in results:
        print(f"{result.variant}: " + ", ".join(f"step {s}: {m[task.metric]:.4f}" for s, m in result.evals))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(runner.to_json(task, results) + "\n")
    return 0


def _gradient_errors(args: argparse.Namespace) -> int:
    from .gradient_noise import gradient_error

    measured = {}
    autocast = torch.bfloat16 if args.autocast else None
    for name in args.tasks:
        spec = runner.spec(name)
        options = {"policy": runner.EVERY_PRODUCT.policy, **args.options}
        result = gradient_error(spec.build(args.tiny), options, seed=args.seed, autocast=autocast)
        measured[name] = {"options": options, "autocast": args.autocast, **result.as_dict()}
        print(
            f"{name}: gradient error {result.error:.4f} (inductor {result.inductor_error:.4f}), sampling noise "
            f"{result.sampling_noise:.4f} (ratio {result.ratio:.3f}), {result.rewritten}/{result.sites} products rewritten",
            flush=True,
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(json.dumps(measured, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
