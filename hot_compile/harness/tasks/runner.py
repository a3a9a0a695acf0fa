"""The task registry, each task's default HOT configuration, the task-1 ablation, and result tables."""

from __future__ import annotations

import dataclasses
import json
from typing import Callable, Sequence

import torch

from ...config import PAPER_RECIPE, HotConfig
from ...plan import PAPER_RANK
from .common import INDUCTOR, INDUCTOR_BF16, RunResult, Schedule, Task, Variant, gap, train_side_by_side


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    build: Callable[[bool], Task]  # tiny → task
    schedule: Schedule
    tiny_schedule: Schedule
    hot: HotConfig  # the configuration trained beside inductor fp32


def _gpt(tiny: bool) -> Task:
    from . import gpt

    return gpt.ByteLMTask(gpt.TINY, eval_windows=8) if tiny else gpt.ByteLMTask()


def _vit(tiny: bool) -> Task:
    from . import vit

    return vit.DigitsTask(vit.TINY, limit=64) if tiny else vit.DigitsTask()


def _cnn(tiny: bool) -> Task:
    from . import cnn

    return cnn.DigitsCNNTask(cnn.TINY, limit=64) if tiny else cnn.DigitsCNNTask(cnn.CNNSize())


def _minilm(tiny: bool) -> Task:
    from . import minilm

    return minilm.DocTopicTask(minilm.TINY) if tiny else minilm.DocTopicTask()


# Every task runs what `torch.compile(model, backend="hot")` gives, no option and no per-task setting:
# at a small task's sizes the default policy keeps the products whose estimate is too slow, and the
# report (and the rewritten fraction) says which.
DEFAULTS = HotConfig()
# The ablation and the gradient error study the numerics: every eligible product rewritten, whatever
# its size.
EVERY_PRODUCT = DEFAULTS.replace(policy="hot")


def _specs() -> dict[str, TaskSpec]:
    from . import cnn, gpt, minilm, vit

    return {
        "gpt": TaskSpec(_gpt, gpt.DEFAULT_SCHEDULE, gpt.TINY_SCHEDULE, DEFAULTS),
        "vit": TaskSpec(_vit, vit.DEFAULT_SCHEDULE, vit.TINY_SCHEDULE, DEFAULTS),
        "minilm": TaskSpec(_minilm, minilm.DEFAULT_SCHEDULE, minilm.TINY_SCHEDULE, DEFAULTS),
        "cnn": TaskSpec(_cnn, cnn.DEFAULT_SCHEDULE, cnn.TINY_SCHEDULE, DEFAULTS),
    }


TASKS = ("gpt", "vit", "minilm", "cnn")


def spec(name: str) -> TaskSpec:
    specs = _specs()
    if name not in specs:
        raise ValueError(f"unknown task {name!r}: accepted are {list(specs)}")
    return specs[name]


def comparison_variants(name: str, autocast: torch.dtype | None = None, **options) -> list[Variant]:
    """``backend="inductor"`` and ``backend="hot"`` with the task's configuration, and ``options`` on top
    of it; both in float32, or both under ``torch.autocast("cpu", autocast)``, where Inductor under the
    same autocast is the reference."""
    hot = dataclasses.replace(spec(name).hot, **options)
    if autocast is None:
        return [INDUCTOR, Variant("hot", hot)]
    if autocast != torch.bfloat16:
        raise ValueError(f"autocast={autocast}: the tasks train on the CPU, whose autocast takes torch.bfloat16 only")
    return [INDUCTOR_BF16, Variant("hot bf16", hot, autocast=autocast)]


def ablation_variants(base: HotConfig) -> list[Variant]:
    """Task 1's ablation: each part of HOT alone, on top of ``base``.

    * plain INT4: grad_input quantized to INT4 without the Hadamard transform, grad_weight exact;
    * HQ: grad_input by Hadamard quantization, grad_weight exact;
    * HLA: grad_weight by Hadamard low-rank INT8 (with ABC), grad_input exact;
    * HOT: both;
    * HOT rank 8: both, with the paper's rank instead of ``base``'s;
    * the paper's recipe (``PAPER_RECIPE``): INT4 per-tensor HQ with SAWB, rank 8 per-tensor HLA, on
      every linear, the loss head included.
    """
    return [
        INDUCTOR,
        Variant("plain INT4 gx", base.replace(hadamard=False, rewrite_gw=False)),
        Variant("HQ gx", base.replace(rewrite_gw=False)),
        Variant("HLA gw", base.replace(rewrite_gx=False)),
        Variant("HOT", base),
        Variant(f"HOT rank {PAPER_RANK}", base.replace(rank=PAPER_RANK)),
        Variant("paper recipe", base.replace(**PAPER_RECIPE)),
    ]


def run(
    name: str,
    variants: Sequence[Variant] | None = None,
    *,
    tiny: bool = False,
    steps: int | None = None,
    seed: int = 0,
    progress: Callable[[int, dict[str, float]], None] | None = None,
) -> tuple[Task, list[RunResult]]:
    s = spec(name)
    task = s.build(tiny)
    schedule = s.tiny_schedule if tiny else s.schedule
    if steps is not None:
        schedule = dataclasses.replace(schedule, steps=steps)
    results = train_side_by_side(
        task, variants if variants is not None else comparison_variants(name), schedule, seed=seed, progress=progress
    )
    return task, results


def _fmt_metric(task: Task, value: float) -> str:
    return f"{value:.2f}%" if task.higher_is_better else f"{value:.4f}"


def summary(task: Task, results: Sequence[RunResult]) -> str:
    """One line per variant: final metric, gap to the first (reference) variant, step times, saved bytes."""
    ref = results[0]
    rows = [("variant", task.metric, "gap", "rewritten", "first step (s)", "step (s)", "saved activations")]
    for r in results:
        g = gap(task, ref, r)
        rewritten = r.rewritten_fraction
        rows.append(
            (
                r.variant,
                _fmt_metric(task, r.final[task.metric]),
                "-" if r is ref else (f"{g:+.2f} pt" if task.higher_is_better else f"{100 * g:+.2f}%"),
                "-" if rewritten is None else f"{100 * rewritten:.0f}%",
                f"{r.first_step_seconds:.1f}",
                f"{r.median_step_seconds:.3f}",
                "-" if r.saved_bytes is None else f"{r.saved_bytes / 2**20:.2f} MiB",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def to_json(task: Task, results: Sequence[RunResult]) -> str:
    return json.dumps({"task": task.name, "metric": task.metric, "runs": [r.as_dict() for r in results]}, indent=2)
