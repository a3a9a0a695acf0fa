"""The forward's encoders moved down next to the product that reads their input, so that they do not
split Inductor's kernels.

Inductor's C++ code generator puts a run of consecutive nodes it generates code for into one kernel,
compiled on its own, and an extern call (a product, an attention, any of HOT's ops) ends the run. An
extern's lowering makes buffers of its inputs there, so under autocast the casts of a linear's
weight and bias are computed just before its product. HOT inserts each encoder of a value the backward
reads (``compress_activation``, ``encode_rows``, ``encode_derivative`` and the ``draw_seed`` that feeds
it) right after that value: between a GELU and the next product's casts, which the encoder leaves in
a kernel of their own. In the MLP block that is two kernels more than Inductor alone compiles.

:func:`sink_encoders` moves each run of encoders down while their inputs are live anyway: past nodes
after which something still reads each input, and past the first extern call if each input is read
there or later (the product of the same activation), else to just before that node. So no input
lives longer than it did, but for the encoder's own call after a product that reads it.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .attention_precision import ATTENTION_FORWARDS
from .sites import LINEAR_OPS, is_view, viewed_tensor

aten = torch.ops.aten
HOT_NAMESPACE = "hot_compile"
# aten ops Inductor runs as extern calls; the others it generates code for, or falls back on singly.
_EXTERN_ATEN = frozenset(
    (*LINEAR_OPS, *ATTENTION_FORWARDS, aten.bmm.default, aten.baddbmm.default, aten.convolution.default, aten._int_mm.default)
)


def _is_hot_op(node: fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and node.target.namespace == HOT_NAMESPACE


def is_extern(node: fx.Node) -> bool:
    """Whether Inductor runs ``node`` as a call of its own, ending the kernel being generated."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    return node.target.namespace not in ("aten", "prims") or node.target in _EXTERN_ATEN


def encoders(graph: fx.Graph) -> set[fx.Node]:
    """HOT's ops (and the ``getitem`` nodes that unpack them) whose values reach only the graph's
    output, which saves them for the backward, or other such nodes: the encoders of saved values, not
    products."""
    found: set[fx.Node] = set()
    # Users come after a node, so each node is seen after all of its users.
    for node in reversed(graph.nodes):
        if node.op != "call_function":
            continue
        if not (_is_hot_op(node) or (node.target is operator.getitem and _is_hot_op(node.args[0]))):
            continue
        if node.users and all(user.op == "output" or user in found for user in node.users):
            found.add(node)
    return found


def _last_reads(graph: fx.Graph, moving: set[fx.Node]) -> dict[fx.Node, int]:
    """The position of the last node other than an encoder or a view that reads each tensor (through
    its views); the output node counts, as it keeps what the forward saves."""
    last: dict[fx.Node, int] = {}
    for i, node in enumerate(graph.nodes):
        if node in moving or is_view(node):
            continue
        for a in node.all_input_nodes:
            last[viewed_tensor(a)] = i
    return last


def _moves(graph: fx.Graph) -> list[tuple[list[fx.Node], fx.Node, bool]]:
    """Each run of encoders to move, with the node it goes next to and whether it goes after it."""
    moving = encoders(graph)
    last_read = _last_reads(graph, moving)
    moves = []
    pending: list[fx.Node] = []
    inputs: set[fx.Node] = set()
    for i, node in enumerate(graph.nodes):
        if node in moving:
            pending.append(node)
            inputs.update(viewed_tensor(a) for a in node.all_input_nodes if a not in moving)
            continue
        if not pending or is_view(node):
            continue
        live_past = all(last_read.get(x, -1) > i for x in inputs)
        if node.op == "output" or is_extern(node) or not live_past:
            # After an extern the inputs outlive anyway (the product of the same activation): its
            # lowering computes its other inputs (a weight's cast) in the kernel before it. Before any
            # other extern, and before the last reader of an input, so that no input lives longer.
            after = is_extern(node) and all(last_read.get(x, -1) >= i for x in inputs)
            if after or node.prev is not pending[-1]:
                moves.append((pending, node, after))
            pending, inputs = [], set()
    return moves


def sink_encoders(graph: fx.Graph) -> int:
    """Move each of the forward ``graph``'s encoders down (see the module's docstring); returns how many
    nodes moved. The moves are all found before the first is made."""
    moves = _moves(graph)
    for run, node, after in moves:
        anchor = node
        for encoder in run:
            if after:
                anchor.append(encoder)
                anchor = encoder
            else:
                node.prepend(encoder)
    return sum(len(run) for run, _, _ in moves)
