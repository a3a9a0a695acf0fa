"""HOT's gradient error on a task's real loss, next to the mini-batch sampling noise.

One training step's gradient is itself an estimate: a batch of 32 gives a gradient that differs from
a batch of 256's by the sampling noise ``‖g₃₂ − g₂₅₆‖ / ‖g₃₂‖`` (float64, exact arithmetic). HOT adds
its own error ``‖ĝ₃₂ − g₃₂‖ / ‖g₃₂‖`` (the compiled step against the float64 one on the same batch).
With independent errors the squares add: an error at most 0.1 × the noise adds at most 1% to the
variance SGD already lives with. Every number covers all parameters' gradients as one vector, with
the model in eval mode (no dropout: the float64 and compiled steps see the same function).

Under ``torch.autocast`` the compiled step's error holds bf16's own, so the error of
``backend="inductor"`` under the same autocast stands beside it: what HOT adds is the difference.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
import torch.nn as nn

import hot_compile

from .common import Task, precision

BATCH = 32
REFERENCE_BATCH = 256


@dataclasses.dataclass(frozen=True)
class GradientError:
    error: float  # ‖ĝ − g‖ / ‖g‖ on the batch
    inductor_error: float  # the same of backend="inductor" in the same precision
    sampling_noise: float  # ‖g − g_reference‖ / ‖g‖
    rewritten: int  # report rows rewritten
    sites: int  # report rows

    @property
    def ratio(self) -> float:
        return self.error / self.sampling_noise

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "ratio": self.ratio}


def _gradient(model: nn.Module, batch: tuple, autocast: torch.dtype | None = None) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    with precision(autocast):
        loss = model(*batch)
    loss.backward()
    return torch.cat([p.grad.flatten().double() for p in model.parameters() if p.grad is not None])


def _float64(model: nn.Module, batch: tuple) -> torch.Tensor:
    exact = copy.deepcopy(model).double()
    return _gradient(exact, tuple(t.double() if t.is_floating_point() else t for t in batch))


def gradient_error(
    task: Task,
    options: dict[str, Any],
    *,
    seed: int = 0,
    batch: int = BATCH,
    reference_batch: int = REFERENCE_BATCH,
    autocast: torch.dtype | None = None,
) -> GradientError:
    """The error of ``torch.compile(model, backend="hot", options=options)`` on one step of ``task``'s
    loss, beside Inductor's and the sampling noise, the compiled steps under ``torch.autocast("cpu",
    autocast)`` where it is given. ``seed`` fixes the initial weights and the sentences, images or
    windows drawn (the first ``batch`` of the ``reference_batch`` drawn)."""
    torch.manual_seed(seed)
    model = task.build_model().eval()
    drawn = task.draw(reference_batch, torch.Generator().manual_seed(seed))
    small = tuple(t[:batch] for t in drawn)
    exact = _float64(model, small)
    noise = ((exact - _float64(model, drawn)).norm() / exact.norm()).item()

    def error_of(compiled: nn.Module) -> float:
        return ((_gradient(compiled, small, autocast) - exact).norm() / exact.norm()).item()

    inductor_error = error_of(torch.compile(copy.deepcopy(model), backend="inductor"))
    error = error_of(torch.compile(model, backend="hot", options=options))
    report = hot_compile.last_report()
    if report is None:
        return GradientError(error, inductor_error, noise, 0, 0)
    return GradientError(error, inductor_error, noise, len(report.rewritten()), len(report.products()))
