"""Saved weight casts → recomputed in the backward: the legality and the rewrite of one decision of
:mod:`.saved_activations`.

Under autocast a linear reads its weight's bf16 cast in the forward and, for its grad_input, in the
backward. The partitioner saves that cast rather than recompute it (a value the backward's product
materialises is never free to recompute, by its heuristic), so the forward hands the backward a bf16
copy of every such weight: on ViT-S under bf16 autocast, 13.5 of the 156 MiB it saves. The parameter
itself outlives the step, so the backward can redo the cast from it: the same values, bit for bit,
for one read of the parameter and one write of the cast (:func:`~.cost_model.recompute_cost`).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .sites import WeightLike

aten, prims = torch.ops.aten, torch.ops.prims
# Ops a chain from a parameter to a saved value may take besides views: each element of the result is
# a function of the same element of the input, exact to redo.
CASTS = (prims.convert_element_type.default, aten._to_copy.default, aten.clone.default, aten._unsafe_view.default)


def _redoable(node: fx.Node) -> bool:
    if node.op != "call_function" or len(node.all_input_nodes) != 1:
        return False
    if not (node.target in CASTS or getattr(node.target, "is_view", False)):
        return False
    val, source = node.meta.get("val"), node.all_input_nodes[0].meta.get("val")
    return isinstance(val, torch.Tensor) and isinstance(source, torch.Tensor) and val.device == source.device


def cast_chain(node: fx.Node, weight_like: WeightLike) -> tuple[fx.Node, ...]:
    """``(parameter, *ops)``: the forward's nodes from one parameter, which the graph does not write, to
    the saved ``node`` through :data:`CASTS` and views alone, on one device, in order; ``()`` where
    ``node`` is not computed so."""
    chain = []
    while _redoable(node):
        chain.append(node)
        node = node.all_input_nodes[0]
    if not chain or node.op != "placeholder" or not weight_like(node) or _mutated(node):
        return ()
    return (node, *reversed(chain))


def _mutated(placeholder: fx.Node) -> bool:
    """Whether the graph writes into ``placeholder`` (AOTAutograd's input mutation, a ``copy_`` into it):
    the backward would then read the written values, not the ones the forward cast."""
    return any(u.target is aten.copy_.default and u.args[0] is placeholder for u in placeholder.users)


def insert_recompute(
    graph: fx.Graph, chain: tuple[fx.Node, ...], source: fx.Node, stands_for: fx.Node, before: fx.Node, meta: dict
) -> None:
    """Copy ``chain``'s ops into the backward ``graph`` before ``before``, reading ``source`` (the
    backward's placeholder of ``chain[0]``), with ``meta`` (their provenance), and let them stand for
    ``stands_for``, the placeholder of the saved value, which is erased."""
    env = {chain[0]: source}
    with graph.inserting_before(before):
        for node in chain[1:]:
            env[node] = graph.node_copy(node, env.__getitem__)
            env[node].meta.update(meta)
    stands_for.replace_all_uses_with(env[chain[-1]])
    graph.erase_node(stands_for)
