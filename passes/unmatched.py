"""Backward products of a weight that no site claims, each with the reason it is kept.

Every backward ``mm`` or ``bmm`` that autograd derived (by ``seq_nr``) from a forward product of an
activation and a weight gets a report row: rewritten through its site, or kept with the reason found
here. Nothing here mutates the graph.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from .sites import (
    LINEAR_OPS,
    LinearSite,
    WeightLike,
    linear_like,
    module_path,
    storage_source,
    strip_transposes,
    view_root,
    why_not_a_site,
)

aten = torch.ops.aten


@dataclasses.dataclass
class UnmatchedProduct:
    """A backward ``mm`` or ``bmm`` of a forward product of a weight that the pass does not rewrite
    because it found no site for it: the forward is no site, or the product matches neither gradient
    of its site."""

    node: fx.Node
    module_path: str
    path: str  # "gx" or "gw", by :func:`gradient_path`
    reason: str
    site: LinearSite | None = None  # the site of its forward product, if that is one


def batched_weight(node: fx.Node, weight_like: WeightLike) -> fx.Node | None:
    """The weight operand of a forward ``bmm`` of an activation and a weight (``einsum`` writes a linear
    this way), or None. Without the parameters known, the operand that is a graph input (through
    views, permutes and casts) when the other is not: the best guess, for the report alone."""

    def is_weight(n: fx.Node) -> bool:
        return weight_like(n) if weight_like.known else storage_source(n).op == "placeholder"

    a, b = (view_root(strip_transposes(arg)[0]) for arg in node.args[:2])
    if is_weight(a) != is_weight(b):
        return a if is_weight(a) else b
    return None


def gradient_path(node: fx.Node, weight: fx.Node) -> str:
    """Which gradient a backward product of a linear with weight ``weight`` computes: grad_input
    (``"gx"``) reads the weight, grad_weight (``"gw"``) only the activation and the upstream gradient."""
    source = storage_source(weight)
    return "gx" if any(storage_source(arg) is source for arg in node.args[:2]) else "gw"


def find_unmatched_products(
    graph: fx.Graph, sites: list[LinearSite], weight_like: WeightLike, backward: set[fx.Node]
) -> list[UnmatchedProduct]:
    """Every backward ``mm`` or ``bmm`` that autograd derived (by ``seq_nr``) from a forward product of
    an activation and a weight and that no site claims, with the reason: no such product goes
    unreported. ``backward`` is the graph's :func:`backward_nodes`, before any rewrite."""
    claimed = {use.node for site in sites for use in (site.grad_input, site.grad_weight) if use is not None}
    site_of = {site.linear: site for site in sites}
    forwards: dict[int, tuple[fx.Node, fx.Node, str | None]] = {}
    for node in graph.nodes:
        if node.op != "call_function" or node in backward or node.meta.get("seq_nr") is None:
            continue
        if node.target in LINEAR_OPS and (operands := linear_like(node, weight_like)) is not None:
            reason = None if node in site_of else why_not_a_site(node, *operands[1:], weight_like)
            forwards[node.meta["seq_nr"]] = (node, operands[1], reason)
        elif node.target is aten.bmm.default and (weight := batched_weight(node, weight_like)) is not None:
            reason = (
                "a batched matmul (bmm) of a weight over a batch of more than one is not a site"
                if weight_like.known
                else "a batched matmul (bmm), as einsum writes a linear, and the pass was not told which "
                "graph inputs are parameters (backend='hot' tells it; joint_pass() alone does not)"
            )
            forwards[node.meta["seq_nr"]] = (node, weight, reason)
    found = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in (aten.mm.default, aten.bmm.default):
            continue
        if node not in backward or node in claimed or (forward := forwards.get(node.meta.get("seq_nr"))) is None:
            continue
        linear, weight, reason = forward
        path = gradient_path(node, weight)
        site = site_of.get(linear)
        reason = reason or "matches neither gradient of this linear (g @ W, gᵀ @ x) through transposes and views"
        found.append(UnmatchedProduct(node, module_path(linear), path, f"not rewritten: {reason}", site))
    return found
