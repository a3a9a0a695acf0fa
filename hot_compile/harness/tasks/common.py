"""Side-by-side training: one model, several compile backends, one seed, one data order.

Every variant starts from the same initial weights (a deep copy of one model built under the task's
seed) and sees the same batches in the same order (drawn from a dedicated generator, so the random
seeds HOT's stochastic rounding draws from the default generator cannot shift the data). Each
variant's training steps run on a default-generator state of their own, so those seeds cannot shift
another variant's dropout either. Steps are
interleaved — step ``i`` of every variant before step ``i + 1`` of any — so a progress bar shows all
of them at once and a stopped run still compares like with like.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import statistics
import time
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch
import torch.nn as nn

import hot_compile
from hot_compile.config import HotConfig
from hot_compile.lqs import select_quantizers
from hot_compile.observability.memory import saved_for_backward_bytes
from hot_compile.passes.report import Report
from hot_compile.plan import QuantizerPlan

Batch = tuple[torch.Tensor, ...]


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way of compiling the model: ``config=None`` is ``backend="inductor"`` (the reference).

    ``calibrated``: the HQ gradient quantizer of each layer comes from :func:`hot_compile.select_quantizers`
    (LQS) on the task's calibration batches and the initial weights (``HotConfig.plan``).
    ``autocast``: the forward, training and evaluation alike, runs under ``torch.autocast("cpu", autocast)``,
    as a CPU user with bf16 hardware trains; ``None`` is float32.
    """

    name: str
    config: HotConfig | None = None
    calibrated: bool = False
    autocast: torch.dtype | None = None

    def compile(self, model: nn.Module, plan: QuantizerPlan | None = None) -> nn.Module:
        if self.config is None:
            return torch.compile(model, backend="inductor")
        config = self.config.replace(plan=plan) if self.calibrated else self.config
        return torch.compile(model, backend=hot_compile.backend(config))

    def precision(self) -> contextlib.AbstractContextManager:
        """The autocast region the variant's forwards run in (a no-op in float32)."""
        return precision(self.autocast)


def precision(autocast: torch.dtype | None) -> contextlib.AbstractContextManager:
    """``torch.autocast("cpu", autocast)``, or a region that changes nothing where ``autocast`` is None."""
    return torch.autocast("cpu", autocast or torch.bfloat16, enabled=autocast is not None)


INDUCTOR = Variant("inductor fp32")
INDUCTOR_BF16 = Variant("inductor bf16", autocast=torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """AdamW with linear warmup and cosine decay to 10% of ``lr``."""

    steps: int
    lr: float
    warmup: int = 0
    weight_decay: float = 0.01
    eval_every: int = 0  # 0: evaluate only at the end

    def factor(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - self.warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))


class Task(Protocol):
    """What the trainer needs of a task. ``model.forward(*batch)`` returns the training loss."""

    name: str
    metric: str  # the key of ``evaluate``'s result the comparison is judged on
    higher_is_better: bool

    def build_model(self) -> nn.Module: ...

    def batches(self, generator: torch.Generator) -> Iterator[Batch]: ...

    def evaluate(self, model: nn.Module) -> dict[str, float]: ...

    def calibration_batches(self) -> list[Batch]: ...

    def draw(self, count: int, generator: torch.Generator) -> Batch: ...


@dataclasses.dataclass
class RunResult:
    variant: str
    train_loss: list[float] = dataclasses.field(default_factory=list)
    evals: list[tuple[int, dict[str, float]]] = dataclasses.field(default_factory=list)
    step_seconds: list[float] = dataclasses.field(default_factory=list)
    saved_bytes: int | None = None
    report: Report | None = None
    plan: QuantizerPlan | None = None

    @property
    def final(self) -> dict[str, float]:
        return self.evals[-1][1] if self.evals else {}

    @property
    def rewritten_fraction(self) -> float | None:
        """The share of the model's linear products (forward and backward) the HOT pass rewrote (its report rows)."""
        if not self.report:
            return None
        return len(self.report.rewritten()) / len(self.report.products())

    @property
    def first_step_seconds(self) -> float:
        """The first step, which includes compiling the forward and the backward."""
        return self.step_seconds[0]

    @property
    def median_step_seconds(self) -> float:
        steady = self.step_seconds[2:] or self.step_seconds
        return statistics.median(steady)

    def as_dict(self) -> dict[str, Any]:
        return {
            "variant": self.variant,
            "final": self.final,
            "evals": [{"step": s, **m} for s, m in self.evals],
            "train_loss": self.train_loss,
            "first_step_seconds": self.first_step_seconds,
            "median_step_seconds": self.median_step_seconds,
            "saved_activation_bytes": self.saved_bytes,
            "rewritten_fraction": self.rewritten_fraction,
            "report": None if self.report is None else [r.as_dict() for r in self.report],
            "plan": None if self.plan is None else self.plan.as_dict(),
        }


def classification_metrics(logits: torch.Tensor, labels: torch.Tensor, prefix: str = "") -> dict[str, float]:
    """Accuracy in percent and mean cross-entropy; the test split's keys are ``accuracy`` and
    ``test_loss``, another split's carry ``prefix`` (``val_accuracy``, ``val_loss``)."""
    loss = torch.nn.functional.cross_entropy(logits, labels).item()
    return {
        f"{prefix}accuracy": 100.0 * (logits.argmax(-1) == labels).float().mean().item(),
        f"{prefix}loss" if prefix else "test_loss": loss,
    }


def saved_activation_bytes(model: nn.Module, batch: Batch, precision: contextlib.AbstractContextManager) -> int:
    """Bytes the forward of ``model`` (run in ``precision``) keeps for its backward on ``batch``,
    parameters excluded.

    Counted by storage through ``saved_tensors_hooks`` (each storage once), then the backward runs
    so the graph is freed; gradients are cleared and no optimizer step is taken.
    """

    def step() -> None:
        with precision:
            loss = model(*batch)
        loss.backward()

    total = saved_for_backward_bytes(step, model.parameters())
    model.zero_grad(set_to_none=True)
    return total


class _Run:
    def __init__(self, variant: Variant, model: nn.Module, schedule: Schedule, plan: QuantizerPlan | None):
        self.variant, self.model = variant, model
        # Training mode set here, not inherited: Hugging Face's from_pretrained returns a model in
        # eval mode, and a mode that flips after the first step recompiles the whole graph.
        model.train()
        self.compiled = variant.compile(model, plan)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=schedule.lr, weight_decay=schedule.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule.factor)
        self.result = RunResult(variant.name, plan=plan if variant.calibrated else None)
        # The default generator's state of this run alone: dropout draws from it, and so do the seeds
        # of HOT's stochastic rounding, whose number depends on the configuration. Shared, one
        # variant's draws would change another's dropout masks.
        self.rng = torch.get_rng_state()

    def step(self, batch: Batch) -> float:
        start = time.perf_counter()
        outside = torch.get_rng_state()
        torch.set_rng_state(self.rng)
        self.optimizer.zero_grad(set_to_none=True)
        with self.variant.precision():
            loss = self.compiled(*batch)
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        value = loss.item()
        self.rng = torch.get_rng_state()
        torch.set_rng_state(outside)
        self.result.step_seconds.append(time.perf_counter() - start)
        if self.variant.config is not None and self.result.report is None:
            self.result.report = hot_compile.last_report()
        self.result.train_loss.append(value)
        if not math.isfinite(value):
            raise FloatingPointError(f"{self.variant.name}: training loss became {value}")
        return value


def _evaluate(task: Task, variant: Variant, model: nn.Module) -> dict[str, float]:
    # Evaluation runs the eager module: HOT rewrites training graphs only (an inference graph compiles
    # as under Inductor), so evaluation is the same function under every variant of one precision,
    # and no variant pays for an extra inference-graph compile.
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), variant.precision():
            return task.evaluate(model)
    finally:
        model.train(was_training)


def train_side_by_side(
    task: Task,
    variants: Sequence[Variant],
    schedule: Schedule,
    *,
    seed: int = 0,
    progress: Callable[[int, dict[str, float]], None] | None = None,
) -> list[RunResult]:
    """Train ``task``'s model once per variant, interleaved step by step; returns one result per variant.

    ``progress(step, {variant: loss})`` is called after every step.
    """
    # Caches off: a graph served from Inductor's or AOTAutograd's cache skips the HOT pass (no
    # report) and the compile (a first-step time that is not one), for one variant but not another.
    with torch.compiler.config.patch(force_disable_caches=True):
        torch.manual_seed(seed)
        initial = task.build_model()
        plan = None
        if any(v.calibrated for v in variants):
            plan = select_quantizers(initial, task.calibration_batches(), lambda model, batch: model(*batch))
        runs = [_Run(v, copy.deepcopy(initial), schedule, plan) for v in variants]
        data = task.batches(torch.Generator().manual_seed(seed))
        batch: Batch | None = None
        for step in range(schedule.steps):
            batch = next(data)
            losses = {run.variant.name: run.step(batch) for run in runs}
            if progress is not None:
                progress(step, losses)
            last = step + 1 == schedule.steps
            if last or (schedule.eval_every and (step + 1) % schedule.eval_every == 0):
                for run in runs:
                    run.result.evals.append((step + 1, _evaluate(task, run.variant, run.model)))
        if batch is not None:
            for run in runs:
                run.result.saved_bytes = saved_activation_bytes(run.compiled, batch, run.variant.precision())
    return [run.result for run in runs]


def gap(task: Task, reference: RunResult, other: RunResult) -> float:
    """How much worse ``other`` ends than ``reference`` on the task's metric (positive = worse):
    relative for losses, in percentage points for accuracies."""
    ref, val = reference.final[task.metric], other.final[task.metric]
    if task.higher_is_better:
        return ref - val  # accuracies are in percent already
    return (val - ref) / ref
