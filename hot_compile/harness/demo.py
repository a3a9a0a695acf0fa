"""``hot-compile demo``: train one model with ``backend="inductor"`` fp32 and ``backend="hot"`` side by side.

The model is task 1 (``hot_compile.harness.tasks.gpt``): a byte-level GPT-style language model on the text of
CPython's documentation (``pydoc_data.topics``), both runs from one seed and one data order. At the
end it prints the final held-out losses, the step times, the activation bytes each backend saves for
the backward, and HOT's per-layer decisions, and writes a PNG of both loss curves.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import shutil
import sys

DEFAULT_OUT = "hot_demo"
EXIT_MISSING = 2
EXIT_FAILED = 1


def missing_requirements() -> list[str]:
    """What the demo needs and this environment lacks, each with how to get it."""
    missing = []
    for module, package in (("matplotlib", "matplotlib"), ("tqdm", "tqdm")):
        if importlib.util.find_spec(module) is None:
            missing.append(f"the Python package {package} (pip install 'hot-compile[demo]')")
    if importlib.util.find_spec("pydoc_data") is None:
        missing.append("pydoc_data, the documentation topics of the CPython standard library (a full Python install)")
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        compiler = get_cpp_compiler()
    except Exception as exc:  # Inductor raises its own error types when no compiler is configured
        compiler, reason = None, f"{type(exc).__name__}: {exc}"
    else:
        reason = f"{compiler!r} was not found on PATH"
    if compiler is None or shutil.which(compiler) is None:
        missing.append(f"a C++ compiler for Inductor's CPU code ({reason}; e.g. apt-get install g++)")
    return missing


def plot_losses(results, task, path: str) -> None:
    """Training loss (exponential moving average) and held-out loss of every run, on one chart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    for result, color in zip(results, ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")):
        smoothed, ema = [], None
        for value in result.train_loss:
            ema = value if ema is None else 0.95 * ema + 0.05 * value
            smoothed.append(ema)
        steps = range(1, len(smoothed) + 1)
        ax.plot(steps, result.train_loss, color=color, alpha=0.15, linewidth=0.8)
        ax.plot(steps, smoothed, color=color, label=f"{result.variant}: train (EMA)")
        evals = [(s, m[task.metric]) for s, m in result.evals]
        ax.plot(*zip(*evals), color=color, marker="o", linestyle="--", label=f"{result.variant}: held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per byte)")
    ax.set_title("byte-level GPT on the CPython docs: inductor fp32 vs hot")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    missing = missing_requirements()
    if missing:
        print("hot-compile demo cannot run; missing:", file=sys.stderr)
        for item in missing:
            print(f"  - {item}", file=sys.stderr)
        return EXIT_MISSING

    import torch
    from tqdm import tqdm

    from .tasks import runner
    from .tasks.common import INDUCTOR, Variant, train_side_by_side

    spec = runner.spec("gpt")
    task = spec.build(args.tiny)
    schedule = spec.tiny_schedule if args.tiny else spec.schedule
    if args.steps is not None:
        schedule = dataclasses.replace(schedule, steps=args.steps)
    size, hot = task.size, spec.hot
    print(
        f"hot-compile demo: byte-level GPT ({size.layers} layers, width {size.dim}, {size.heads} heads, "
        f"context {size.context}, batch {size.batch}) on {len(task.train_data):,} bytes of CPython docs, "
        f"held-out {len(task.eval_data):,} bytes\n"
        f"{schedule.steps} steps each for backend='inductor' (fp32) and backend='hot' with no options "
        f"(policy={hot.policy!r}; numerics per site, in the report below), seed {args.seed}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads\n"
        "the first step of each backend compiles its forward and backward graphs"
    )
    os.makedirs(args.out, exist_ok=True)
    with tqdm(total=schedule.steps, unit="step", desc="training", dynamic_ncols=True) as bar:

        def progress(step: int, losses: dict[str, float]) -> None:
            bar.set_postfix({name: f"{loss:.3f}" for name, loss in losses.items()}, refresh=False)
            bar.update(1)

        try:
            results = train_side_by_side(
                task, [INDUCTOR, Variant("hot", hot)], schedule, seed=args.seed, progress=progress
            )
        except FloatingPointError as exc:
            bar.close()
            print(f"hot-compile demo: training diverged: {exc}", file=sys.stderr)
            return EXIT_FAILED

    reference, hot = results
    print("\n" + runner.summary(task, results))
    g = runner.gap(task, reference, hot)
    print(
        f"\nheld-out loss: inductor fp32 {reference.final['eval_loss']:.4f}, hot {hot.final['eval_loss']:.4f} "
        f"({100 * g:+.2f}% relative)"
    )
    print(
        f"step time (median after compile): inductor {reference.median_step_seconds * 1e3:.1f} ms, "
        f"hot {hot.median_step_seconds * 1e3:.1f} ms"
    )
    print(
        f"activations saved for backward: inductor {reference.saved_bytes:,} B, hot {hot.saved_bytes:,} B "
        f"({hot.saved_bytes / reference.saved_bytes:.2f}×)"
    )
    if hot.report is not None:
        print(
            f"linear products rewritten (forward and backward): {len(hot.report.rewritten())} of {len(hot.report.products())} "
            f"({100 * hot.rewritten_fraction:.0f}%)\n\n{hot.report.table()}"
        )
    else:
        print("\nno HOT report: the pass did not run")

    png = os.path.join(args.out, "loss.png")
    plot_losses(results, task, png)
    with open(os.path.join(args.out, "results.json"), "w", encoding="utf-8") as f:
        f.write(runner.to_json(task, results) + "\n")
    print(f"\nloss curves: {png}\nall numbers: {os.path.join(args.out, 'results.json')}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "demo",
        help="train a byte-level GPT with inductor fp32 and hot side by side; print and plot the results",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=None, help="training steps per backend (default: the task's)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the data order")
    parser.add_argument("--tiny", action="store_true", help="a one-layer model for a few steps (seconds, for tests)")
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"folder for loss.png and results.json (default {DEFAULT_OUT})")
    parser.set_defaults(run=run)
