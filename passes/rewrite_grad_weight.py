"""grad_weight → HLA with activation buffer compression (ABC).

The forward gains ``(x_q, s_x) = hot_compile::compress_activation(x2d)`` right after ``x2d``, marked
MUST_SAVE so the partitioner saves the int8 low-rank buffer rather than recomputing it from ``x`` in
the backward; linears that share an input share one compressed buffer. The backward ``mm(gᵀ, x2d)``
becomes ``hot_compile::hla_grad_weight(g, x_q, s_x, seed)``.
"""

from __future__ import annotations

from typing import Callable

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ..config import HotConfig
from ..runtime import ops
from .inline import insert_traced
from .provenance import provenance
from .sites import LinearSite, same_value, strip_transposes

COMPRESS = "compress_activation"
REWRITE = "hla_grad_weight"


class CompressedActivations:
    """One compressed buffer per distinct forward input and numerics: q, k and v projections share
    theirs, as do the convolutions that read one input."""

    def __init__(self, graph: fx.Graph, created: list[fx.Node]):
        self.graph, self.created = graph, created
        self.entries: list[tuple[fx.Node, tuple, tuple[fx.Node, fx.Node]]] = []

    def buffers(self, x: fx.Node, numerics: tuple, compress: Callable, meta: dict, before: fx.Node) -> tuple[fx.Node, fx.Node]:
        """``compress(x)``'s two nodes, inserted before ``before`` unless an input of the same values and
        ``numerics`` has them already; marked MUST_SAVE so the partitioner saves them rather than
        recomputing them from ``x`` in the backward."""
        for seen, entry_numerics, buffers in self.entries:
            if entry_numerics == numerics and same_value(seen, x):
                return buffers
        buffers = insert_traced(self.graph, compress, [x], before=before, meta=meta, created=self.created)
        for node in buffers:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        self.entries.append((x, numerics, buffers))
        return buffers

    def get(self, site: LinearSite, config: HotConfig) -> tuple[fx.Node, fx.Node]:
        """The ABC buffer of a linear's input: its rank-``config.rank`` projection in ``gw_bits``."""
        rank, bits, per_channel = config.rank, config.gw_bits, config.gw_quantizer == "per_channel"

        def compress(x):
            return ops.compress_activation(x, rank, bits, per_channel)

        meta = provenance(COMPRESS, site.module_path, "gw", site.x2d, "forward")
        return self.buffers(site.x2d, (COMPRESS, rank, bits, per_channel), compress, meta, site.x2d.next)


def rewrite_grad_weight(
    graph: fx.Graph,
    site: LinearSite,
    config: HotConfig,
    compressed: CompressedActivations,
    created: list[fx.Node],
) -> fx.Node:
    """Insert the HLA computation of ``site``'s grad_weight; returns the node to stand in for the mm."""
    use = site.grad_weight
    x_q, x_scale = compressed.get(site, config)
    out_dtype = use.node.meta["val"].dtype
    meta = provenance(REWRITE, site.module_path, "gw", use.node, "backward")
    source, flipped = strip_transposes(use.grad)
    transposed = use.grad_transposed != flipped

    def hla(grad, xq, xs):
        g = grad.t() if transposed else grad
        per_channel = config.gw_quantizer == "per_channel"
        out = ops.hla_grad_weight(g, xq, xs, ops.draw_seed(g), config.rank, config.gw_bits, per_channel, out_dtype)
        return out.t() if use.out_transposed else out

    return insert_traced(graph, hla, [source, x_q, x_scale], before=use.node, meta=meta, created=created)
