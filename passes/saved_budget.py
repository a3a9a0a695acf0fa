"""What compressing a saved value costs a step, and which values ``policy="balanced"`` affords: the
profitability of :mod:`.saved_activations`, whose legality (:func:`~.saved_activations.why_kept`) runs
first."""

from __future__ import annotations

from torch.fx.experimental.symbolic_shapes import optimization_hint

from ..runtime.aten_impl import GIVEN
from .cost_model import SiteCost, saved_compression_cost
from .saved_activations import DERIVATIVE_BITS, ROW_BITS, SavedValue, derivative_dtype


def compression_cost(s: SavedValue, profile) -> SiteCost:
    """The estimated added time and the bytes of ``s``'s code (:func:`~.cost_model.saved_compression_cost`)."""
    val = s.forward.meta["val"]
    numel = optimization_hint(val.numel())
    rows = numel // max(optimization_hint(val.shape[-1]), 1) if val.dim() else 1
    if s.factor is None:
        return saved_compression_cost(numel, rows, val.element_size(), ROW_BITS, 1, profile)
    # A known derivative is computed by the encoder, from x; another f(x) is a buffer the forward writes.
    width = 0 if s.factor.function != GIVEN else derivative_dtype(val.dtype).itemsize
    return saved_compression_cost(numel, rows, val.element_size(), DERIVATIVE_BITS, 2, profile, derivative_bytes=width)


def keep_over_budget(costed: list[tuple[SavedValue, SiteCost]], budget_s: float, why: str) -> None:
    """Compress the values that save the most bytes per estimated second first, while their added
    time stays within ``budget_s``; the others are kept, with ``why``."""

    def bytes_per_second(item):
        cost = item[1]
        return (cost.saved_bytes_before - cost.saved_bytes_after) / cost.hot_s

    spent = 0.0
    for s, cost in sorted(costed, key=bytes_per_second, reverse=True):
        if spent + cost.hot_s <= budget_s:
            spent += cost.hot_s
        else:
            s.reason = why
