"""Trace a plain-PyTorch function and splice its nodes into a joint graph.

The function is traced with ``make_fx`` and Inductor's decomposition table under the graph's own fake
mode, so the spliced nodes are already in post-decomposition form and carry ``meta["val"]``, which the
partitioner and Inductor read.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch.fx as fx
from torch._dispatch.python import enable_python_dispatcher
from torch._dynamo.utils import detect_fake_mode
from torch._inductor.decomposition import select_decomp_table
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree


def _fake_inputs(inputs: Sequence[fx.Node]):
    vals = [n.meta["val"] for n in inputs]
    mode = detect_fake_mode(vals)
    if mode is not None:
        vals = [mode.from_tensor(v) if isinstance(v, FakeTensor) else v for v in vals]
    return vals, mode


def insert_traced(
    graph: fx.Graph,
    fn: Callable[..., object],
    inputs: Sequence[fx.Node],
    *,
    before: fx.Node,
    meta: dict,
    created: list[fx.Node],
):
    """Insert ``fn(*inputs)`` before ``before``; returns the output node(s) in ``fn``'s structure.

    Every inserted node gets ``meta`` merged into its meta and is appended to ``created`` (so a caller
    can remove them all if a later step fails).
    """
    vals, mode = _fake_inputs(inputs)
    with mode or contextlib.nullcontext(), enable_python_dispatcher():
        traced = make_fx(fn, select_decomp_table(), tracing_mode="real")(*vals)
    env: dict[fx.Node, fx.Node] = dict(zip((n for n in traced.graph.nodes if n.op == "placeholder"), inputs))
    result = None
    with graph.inserting_before(before):
        for node in traced.graph.nodes:
            if node.op == "call_function":
                new = graph.node_copy(node, env.__getitem__)
                new.meta.update(meta)
                created.append(new)
                env[node] = new
            elif node.op == "output":
                result = pytree.tree_map(lambda a: env[a] if isinstance(a, fx.Node) else a, node.args[0])
            elif node.op != "placeholder":
                raise NotImplementedError(f"cannot splice a {node.op} node ({node.format_node()})")
    return result

