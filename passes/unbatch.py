"""Batch-1 ``bmm`` of a weight → ``mm``: the form in which ``einsum`` writes a linear.

``torch.einsum("bld,df->blf", x, W)`` folds ``b`` and ``l`` into one row dimension and lowers to
``bmm(x.view(1, L, K), W.view(1, K, N))``; autograd's two products for it are batch-1 ``bmm`` as well.
Each such product (the forward, and the backward products with its ``seq_nr``) becomes ``mm`` of its
operands with the batch dimension squeezed, then ``unsqueeze(0)``: the same values, in the form whose
gradients :mod:`~hot_compile.passes.sites` recognises. A 3-D operand ``permute(t, [0, 2, 1])`` becomes
the 2-D transpose of ``t``'s squeeze, and each tensor is squeezed once, because the matchers identify
operands by node identity through transposes.

:meth:`Unbatched.undo` puts the ``bmm`` nodes back, so a pass that fails after this step still leaves
the graph as it was.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .inline import insert_traced
from .provenance import provenance
from .sites import WeightLike, module_path
from .unmatched import batched_weight, gradient_path

REWRITE = "unbatch_bmm"
aten = torch.ops.aten


@dataclasses.dataclass
class Unbatched:
    """Each ``bmm`` replaced, with its args and meta (to rebuild it) and the node standing in for it;
    and every node created."""

    replaced: list[tuple[fx.Node, tuple, dict, fx.Node]] = dataclasses.field(default_factory=list)
    created: list[fx.Node] = dataclasses.field(default_factory=list)

    def undo(self, graph: fx.Graph) -> None:
        rebuilt: dict[fx.Node, fx.Node] = {}
        for old, args, meta, stand_in in self.replaced:
            with graph.inserting_after(stand_in):
                bmm = graph.call_function(aten.bmm.default, tuple(rebuilt.get(a, a) for a in args))
            bmm.meta.update(meta)
            stand_in.replace_all_uses_with(bmm)
            rebuilt[old] = bmm
        for node in reversed(self.created):
            graph.erase_node(node)


def _batch_one(node: fx.Node) -> bool:
    return all(statically_known_true(arg.meta["val"].shape[0] == 1) for arg in node.args[:2])


def _is_batch_transpose(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is aten.permute.default and list(node.args[1]) == [0, 2, 1]


class _Operands:
    """One 2-D stand-in per 3-D batch-1 operand, shared by every product that reads it."""

    def __init__(self, graph: fx.Graph, created: list[fx.Node]):
        self.graph, self.created = graph, created
        self.memo: dict[fx.Node, fx.Node] = {}

    def as_2d(self, node: fx.Node, meta: dict) -> fx.Node:
        if node not in self.memo:
            if _is_batch_transpose(node):
                source = self.as_2d(node.args[0], meta)
                fn, operand = (lambda t: t.t()), source
            else:
                fn, operand = (lambda t: t.squeeze(0)), node
            after = operand.next
            while after.op == "placeholder":
                after = after.next
            self.memo[node] = insert_traced(self.graph, fn, [operand], before=after, meta=meta, created=self.created)
        return self.memo[node]


def unbatch_weight_products(graph: fx.Graph, weight_like: WeightLike, backward: set[fx.Node]) -> Unbatched:
    """Rewrite every batch-1 forward ``bmm`` of an activation and a weight, and the backward ``bmm``
    autograd derived from it, as ``mm``; ``backward`` is the graph's ``backward_nodes``. Nothing is
    rewritten where the parameters are unknown: the weight would be a guess."""
    if not weight_like.known:
        return Unbatched()
    forwards: dict[int, fx.Node] = {}
    for node in graph.find_nodes(op="call_function", target=aten.bmm.default):
        if node not in backward and node.meta.get("seq_nr") is not None and _batch_one(node):
            if (weight := batched_weight(node, weight_like)) is not None:
                forwards[node.meta["seq_nr"]] = weight
    unbatched = Unbatched()
    operands = _Operands(graph, unbatched.created)
    for node in list(graph.find_nodes(op="call_function", target=aten.bmm.default)):
        weight = forwards.get(node.meta.get("seq_nr"))
        if weight is None or not _batch_one(node):
            continue
        path = gradient_path(node, weight) if node in backward else "fwd"
        meta = provenance(REWRITE, module_path(node), path, node, "backward" if node in backward else "forward")
        a, b = (operands.as_2d(arg, meta) for arg in node.args[:2])
        stand_in = insert_traced(
            graph, lambda x, y: torch.mm(x, y).unsqueeze(0), [a, b], before=node, meta=meta, created=unbatched.created
        )
        node.replace_all_uses_with(stand_in)
        unbatched.replaced.append((node, node.args, dict(node.meta), stand_in))
        graph.erase_node(node)
    return unbatched
