"""Per-layer numerics from real gradients: HLA's rank and, by layer-wise quantizer selection (LQS),
the scales of HQ's gradient.

:func:`select_quantizers` runs a few eager forward/backward passes and measures, for every linear:

* **rank.** HLA at rank 8 keeps the 8 lowest-sequency Walsh rows of each block of 16 tokens: exact
  where neighbouring tokens are alike, a fixed error where they are not (text). Per layer it compares
  the error of the rank-8 product ``‖gᵀx − (P₈g)ᵀ(P₈x)/16‖`` with the mini-batch sampling spread of
  the same gradient (how far one batch's ``gᵀx`` lies from the batches' mean), and takes rank 8 only
  where the error stays within ``ERROR_BUDGET`` of that spread: then the cut adds at most
  ``ERROR_BUDGET²`` (1%) to the gradient's mean squared error. Elsewhere the plan says nothing and the
  config's rank (16, no cut) holds.
* **quantizer (LQS).** HQ quantizes the Hadamard-transformed gradient ``g̃ = g B``. Per layer it
  quantizes ``g̃`` with one scale and with one per token, and picks per-token when its error
  ``‖g̃ − deq(q(g̃))‖`` is below ``threshold`` × the per-tensor error. The paper's rule is
  threshold 0.5 (``LQS_PAPER_THRESHOLD``): its per-token kernel cost more. Here per-token scales
  are free in the integer GEMM's epilogue, so the default threshold is 1.

The result is a :class:`~hot_compile.plan.QuantizerPlan`. ``calibrate`` is the former name of
:func:`select_quantizers`, kept for one release with a ``DeprecationWarning``.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.nn as nn

from .plan import ERROR_BUDGET, PAPER_RANK, LayerChoice, QuantizerPlan
from .runtime.hadamard import BLOCK, block_hadamard, lowpass, tail_basis
from .runtime.quant import dequantize, quantize_stochastic

DEFAULT_THRESHOLD = 1.0
LQS_PAPER_THRESHOLD = 0.5


def _errors(grad: torch.Tensor, bits: int, seed: int) -> tuple[float, float]:
    """Squared quantization errors of ``grad``'s Hadamard transform: (per-tensor, per-token)."""
    transformed = block_hadamard(grad.reshape(-1, grad.shape[-1]).float(), 1)
    seed_t = torch.tensor(seed, dtype=torch.int64)
    out = []
    for per_token in (False, True):
        q, scale = quantize_stochastic(transformed, bits, seed_t, dim=-1 if per_token else None)
        out.append((transformed - dequantize(q, scale)).square().sum().item())
    return out[0], out[1]


def _lowpass_error(grad: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``gᵀx`` and its rank-8 HLA error ``gᵀx − (P₈g)ᵀ(P₈x)/16``, unquantized, in float32."""
    g2, x2 = grad.reshape(-1, grad.shape[-1]).float(), x.reshape(-1, x.shape[-1]).float()
    tail = tail_basis(g2.shape[0] % BLOCK, PAPER_RANK, device=g2.device)
    exact = g2.t() @ x2
    return exact, exact - lowpass(g2, PAPER_RANK, tail).t() @ lowpass(x2, PAPER_RANK, tail) / BLOCK


@dataclasses.dataclass
class _LayerStats:
    quantizer_squared: list[float] = dataclasses.field(default_factory=lambda: [0.0, 0.0])
    gradients: list[torch.Tensor] = dataclasses.field(default_factory=list)  # one gᵀx per batch
    errors: list[torch.Tensor] = dataclasses.field(default_factory=list)  # its rank-8 error per batch

    def choice(self, name: str, threshold: float) -> LayerChoice:
        tensor_err, token_err = (math.sqrt(v) for v in self.quantizer_squared)
        quantizer = "per_token" if token_err < threshold * tensor_err else "per_tensor"
        rank = rank8_error = spread = None
        if self.gradients:
            grads = torch.stack(self.gradients)
            norm = grads.square().sum(dim=(1, 2)).mean().sqrt()
            rank8_error = (torch.stack(self.errors).square().sum(dim=(1, 2)).mean().sqrt() / norm).item()
            if len(self.gradients) > 1:
                # The spread of one batch's gradient around the batches' mean, as an unbiased estimate.
                deviation = (grads - grads.mean(0)).square().sum(dim=(1, 2)).sum() / (len(grads) - 1)
                spread = (deviation.sqrt() / norm).item()
                if rank8_error <= ERROR_BUDGET * spread:
                    rank = PAPER_RANK
        return LayerChoice(name, quantizer, tensor_err, token_err, rank, rank8_error, spread)


def select_quantizers(
    model: nn.Module,
    batches: Iterable[Sequence[Any] | Any],
    loss_fn: Callable[..., torch.Tensor],
    threshold: float = DEFAULT_THRESHOLD,
    *,
    bits: int = 4,
) -> QuantizerPlan:
    """Choose each ``nn.Linear``'s HLA rank and HQ gradient quantizer from real gradients.

    For each batch, ``loss_fn(model, batch)`` is run eagerly and differentiated with respect to the
    output of every linear (``torch.autograd.grad``: parameters' ``.grad`` are left untouched, no
    optimizer step is taken, and the default random generator is restored afterwards).

    * Rank 8 where the rank-8 error of the layer's ``gᵀx`` is at most ``ERROR_BUDGET`` times its
      sampling spread across the batches (both as root-mean-square over batches, relative to
      ``‖gᵀx‖``); at least two batches are needed to measure a spread.
    * ``"per_token"`` where ``per_token_error < threshold · per_tensor_error`` (errors of ``bits``-bit
      stochastic rounding of the Hadamard-transformed gradient, summed over batches and calls).

    Module paths are those of ``model.named_modules()`` — the paths the HOT pass reports for the same
    model compiled (a ``torch.compile``-wrapped model is unwrapped first). Linears whose output never
    reaches the loss are left out of the plan.
    """
    if not 0 < threshold <= 1:
        raise ValueError(f"threshold={threshold!r}: accepted values are in (0, 1]")
    model = getattr(model, "_orig_mod", model)
    names = {m: name for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    if not names:
        raise ValueError("select_quantizers: the model has no nn.Linear layers")
    stats: dict[str, _LayerStats] = {}
    outputs: list[tuple[str, torch.Tensor, torch.Tensor]] = []

    def record(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        if output.requires_grad:
            outputs.append((names[module], inputs[0].detach(), output))

    handles = [m.register_forward_hook(record) for m in names]
    count = 0
    try:
        with torch.random.fork_rng(devices=[]):
            for index, batch in enumerate(batches):
                outputs.clear()
                loss = loss_fn(model, batch)
                grads = torch.autograd.grad(loss, [o for _, _, o in outputs], allow_unused=True)
                batch_sums: dict[str, list[torch.Tensor]] = {}
                for call, ((name, x, _), grad) in enumerate(zip(outputs, grads)):
                    if grad is None:
                        continue
                    layer = stats.setdefault(name, _LayerStats())
                    for i, err in enumerate(_errors(grad.detach(), bits, seed=index * 1009 + call)):
                        layer.quantizer_squared[i] += err
                    exact, error = _lowpass_error(grad.detach(), x)
                    sums = batch_sums.setdefault(name, [torch.zeros_like(exact), torch.zeros_like(error)])
                    sums[0] += exact
                    sums[1] += error
                for name, (exact, error) in batch_sums.items():
                    stats[name].gradients.append(exact)
                    stats[name].errors.append(error)
                count += 1
    finally:
        for handle in handles:
            handle.remove()
        outputs.clear()
    if count == 0:
        raise ValueError("select_quantizers: no calibration batches")
    layers = tuple(layer.choice(name, threshold) for name, layer in stats.items())
    return QuantizerPlan(
        layers, f"select_quantizers: {count} batch(es), INT{bits}, threshold {threshold}, rank budget {ERROR_BUDGET}"
    )


def calibrate(*args, **kwargs) -> QuantizerPlan:
    """Deprecated: the former name of :func:`select_quantizers` (``hot-compile calibrate-device``
    calibrates the cost model's device rates instead)."""
    warnings.warn(
        "hot_compile.calibrate is deprecated and will be removed in the next release; "
        "use hot_compile.select_quantizers",
        DeprecationWarning,
        stacklevel=2,
    )
    return select_quantizers(*args, **kwargs)
