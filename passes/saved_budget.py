"""What compressing a saved value costs a step, and which values ``policy="balanced"`` affords: the
profitability of :mod:`.saved_activations`, whose legality (:func:`~.saved_activations.why_kept`) runs
first. The budget is a share of the step's floor (:func:`step_floor`)."""

from __future__ import annotations

from collections.abc import Callable

import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import optimization_hint

from ..runtime.aten_impl import GIVEN
from .attention_precision import ATTENTION_BACKWARDS, ATTENTION_FORWARDS, arguments
from .cost_model import SiteCost, attention_flops, recompute_cost, saved_compression_cost, saved_traffic_time
from .saved_activations import DERIVATIVE_BITS, ROW_BITS, SavedValue, derivative_dtype


def compression_cost(s: SavedValue, profile) -> SiteCost:
    """The estimated added time and the bytes of ``s``'s code (:func:`~.cost_model.saved_compression_cost`),
    or of its recomputation (:func:`~.cost_model.recompute_cost`)."""
    val = s.forward.meta["val"]
    numel = optimization_hint(val.numel())
    if s.recompute:
        return recompute_cost(numel, s.recompute[0].meta["val"].element_size(), val.element_size(), profile)
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


def attention_seconds(node: fx.Node, profile) -> float:
    """A fused attention forward or backward at the device's attention rate."""
    backward = node.target in ATTENTION_BACKWARDS
    q, k, v = (a.meta["val"] for a in node.args[int(backward) : int(backward) + 3])
    b, h, l, e = (optimization_hint(d) for d in q.shape)
    s, ev = optimization_hint(k.shape[-2]), optimization_hint(v.shape[-1])
    flops = attention_flops(b, h, l, s, e, ev, backward, bool(arguments(node).get("is_causal")))
    return flops / profile.attention_rate(q.dtype) + profile.kernel_overhead


def step_floor(graphs: tuple[fx.GraphModule, ...], saved: list[SavedValue], products_s: float, profile_of: Callable) -> float:
    """Seconds a training step takes at least, at the profile's rates: its products as they run (``products_s``, the joint
    pass's estimate), every fused attention of its ``graphs`` (:func:`attention_seconds`), and the write
    and read of every tensor in ``saved``, as the partitioner chose them
    (:func:`~.cost_model.saved_traffic_time`). Norms, pointwise kernels and casts are left out, so a
    share of this floor is at most that share of the step. ``profile_of`` maps a device to its profile."""
    total = products_s
    for graph in graphs:
        for target in ATTENTION_FORWARDS + ATTENTION_BACKWARDS:
            for node in graph.graph.find_nodes(op="call_function", target=target):
                total += attention_seconds(node, profile_of(node.args[0].meta["val"].device))
    for s in saved:
        val = s.forward.meta["val"]
        total += saved_traffic_time(optimization_hint(val.numel()) * val.element_size(), profile_of(val.device))
    return total
