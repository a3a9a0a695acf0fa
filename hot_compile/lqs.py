"""Layer-wise quantizer selection (LQS): per-tensor or per-token scales for each layer's HQ gradient.

HQ quantizes the Hadamard-transformed upstream gradient ``g̃ = g B`` of every linear to INT4. One
scale for the whole tensor is cheapest; one scale per token (row) is worth it only where a few
tokens carry much larger gradients than the rest. :func:`calibrate` decides per layer from real
gradients: it runs a few eager forward/backward passes, quantizes each linear's ``g̃`` both ways
with the stochastic quantizer HQ uses, and picks per-token only when its error
``‖g̃ − deq(q(g̃))‖`` is below ``threshold`` × the per-tensor error (the official rule, threshold 0.5).

The result is a frozen :class:`QuantizerPlan`: hashable, with a deterministic ``repr`` (it is part of
the compile cache key), saved and loaded as JSON.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.nn as nn

from .hadamard import block_hadamard
from .quant import dequantize, quantize_stochastic

QUANTIZERS = ("per_tensor", "per_token")
DEFAULT_THRESHOLD = 0.5
FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class LayerChoice:
    """The quantizer chosen for one linear and the calibration errors it was chosen on."""

    module: str
    quantizer: str
    per_tensor_error: float
    per_token_error: float

    def __post_init__(self) -> None:
        if self.quantizer not in QUANTIZERS:
            raise ValueError(f"LayerChoice.quantizer={self.quantizer!r}: accepted values are {QUANTIZERS}")


@dataclasses.dataclass(frozen=True)
class QuantizerPlan:
    """Per-layer HQ gradient quantizers, keyed by module path (``blocks.0.mlp.fc1``).

    ``source`` says where the plan came from (the calibration that made it). Layers are kept sorted
    by module path, so two plans with the same choices compare, hash and ``repr`` equal.
    """

    layers: tuple[LayerChoice, ...]
    source: str

    def __post_init__(self) -> None:
        layers = tuple(sorted(self.layers, key=lambda c: c.module))
        paths = [c.module for c in layers]
        duplicates = sorted({p for p in paths if paths.count(p) > 1})
        if duplicates:
            raise ValueError(f"QuantizerPlan lists module(s) {duplicates} more than once")
        object.__setattr__(self, "layers", layers)

    def quantizer_for(self, module_path: str) -> str | None:
        """``"per_tensor"`` or ``"per_token"`` for a calibrated layer; None for one the plan does not cover."""
        for choice in self.layers:
            if choice.module == module_path:
                return choice.quantizer
        return None

    def as_dict(self) -> dict[str, str]:
        """Module path → quantizer."""
        return {c.module: c.quantizer for c in self.layers}

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": "hot_compile.QuantizerPlan",
                "version": FORMAT_VERSION,
                "source": self.source,
                "layers": [dataclasses.asdict(c) for c in self.layers],
            },
            indent=2,
        )

    @classmethod
    def from_json(cls, text: str) -> QuantizerPlan:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("format") != "hot_compile.QuantizerPlan":
            raise ValueError("not a hot_compile.QuantizerPlan JSON document")
        if data.get("version") != FORMAT_VERSION:
            raise ValueError(f"QuantizerPlan format version {data.get('version')!r}: this version reads {FORMAT_VERSION}")
        return cls(tuple(LayerChoice(**layer) for layer in data["layers"]), data["source"])

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> QuantizerPlan:
        with open(path, encoding="utf-8") as f:
            return cls.from_json(f.read())

    def table(self) -> str:
        width = max([len("module")] + [len(c.module) for c in self.layers])
        lines = [f"{'module'.ljust(width)}  quantizer   per-tensor err  per-token err"]
        lines += [
            f"{c.module.ljust(width)}  {c.quantizer.ljust(10)}  {c.per_tensor_error:14.4g}  {c.per_token_error:13.4g}"
            for c in self.layers
        ]
        return f"QuantizerPlan ({self.source})\n" + "\n".join(lines)


def _errors(grad: torch.Tensor, bits: int, seed: int) -> tuple[float, float]:
    """Squared quantization errors of ``grad``'s Hadamard transform: (per-tensor, per-token)."""
    transformed = block_hadamard(grad.reshape(-1, grad.shape[-1]).float(), 1)
    seed_t = torch.tensor(seed, dtype=torch.int64)
    out = []
    for per_token in (False, True):
        q, scale = quantize_stochastic(transformed, bits, seed_t, per_token=per_token)
        out.append((transformed - dequantize(q, scale)).square().sum().item())
    return out[0], out[1]


def calibrate(
    model: nn.Module,
    batches: Iterable[Sequence[Any] | Any],
    loss_fn: Callable[..., torch.Tensor],
    threshold: float = DEFAULT_THRESHOLD,
    *,
    bits: int = 4,
) -> QuantizerPlan:
    """Choose each ``nn.Linear``'s HQ gradient quantizer from real gradients.

    For each batch, ``loss_fn(model, batch)`` is run eagerly and differentiated with respect to the
    output of every linear (``torch.autograd.grad``: parameters' ``.grad`` are left untouched, no
    optimizer step is taken, and the default random generator is restored afterwards). Errors are
    summed over batches and over every call of a layer; a layer gets ``"per_token"`` only when
    ``per_token_error < threshold · per_tensor_error``. Module paths are those of
    ``model.named_modules()`` — the paths the HOT pass reports for the same model compiled
    (a ``torch.compile``-wrapped model is unwrapped first). Linears whose output never reaches the
    loss are left out of the plan.
    """
    if not 0 < threshold <= 1:
        raise ValueError(f"threshold={threshold!r}: accepted values are in (0, 1]")
    model = getattr(model, "_orig_mod", model)
    names = {m: name for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    if not names:
        raise ValueError("calibrate: the model has no nn.Linear layers")
    squared: dict[str, list[float]] = {}
    outputs: list[tuple[str, torch.Tensor]] = []

    def record(module: nn.Module, _inputs: Any, output: torch.Tensor) -> None:
        if output.requires_grad:
            outputs.append((names[module], output))

    handles = [m.register_forward_hook(record) for m in names]
    count = 0
    try:
        with torch.random.fork_rng(devices=[]):
            for index, batch in enumerate(batches):
                outputs.clear()
                loss = loss_fn(model, batch)
                grads = torch.autograd.grad(loss, [o for _, o in outputs], allow_unused=True)
                for call, ((name, _), grad) in enumerate(zip(outputs, grads)):
                    if grad is None:
                        continue
                    tensor_err, token_err = _errors(grad.detach(), bits, seed=index * 1009 + call)
                    acc = squared.setdefault(name, [0.0, 0.0])
                    acc[0] += tensor_err
                    acc[1] += token_err
                count += 1
    finally:
        for handle in handles:
            handle.remove()
        outputs.clear()
    if count == 0:
        raise ValueError("calibrate: no calibration batches")
    layers = []
    for name, (tensor_sq, token_sq) in squared.items():
        tensor_err, token_err = math.sqrt(tensor_sq), math.sqrt(token_sq)
        choice = "per_token" if token_err < threshold * tensor_err else "per_tensor"
        layers.append(LayerChoice(name, choice, tensor_err, token_err))
    return QuantizerPlan(tuple(layers), f"calibrate: {count} batch(es), INT{bits}, threshold {threshold}")
