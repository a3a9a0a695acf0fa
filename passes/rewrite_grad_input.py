"""grad_input → HQ: ``mm(g, W)`` becomes ``hot_compile::hq_grad_input(g, W, seed)`` (integer Hadamard
quantization)."""

from __future__ import annotations

import torch.fx as fx

from ..config import HotConfig
from ..runtime import ops
from .inline import insert_traced
from .provenance import provenance
from .sites import LinearSite, strip_transposes

REWRITE = "hq_grad_input"


def rewrite_grad_input(graph: fx.Graph, site: LinearSite, config: HotConfig, created: list[fx.Node]) -> fx.Node:
    """Insert the HQ computation of ``site``'s grad_input; returns the node to stand in for the mm."""
    use = site.grad_input
    meta = provenance(REWRITE, site.module_path, "gx", use.node, "backward")
    source, flipped = strip_transposes(use.grad)
    transposed = use.grad_transposed != flipped
    out_dtype = use.node.meta["val"].dtype

    def hq(grad, weight):
        g = grad.t() if transposed else grad
        out = ops.hq_grad_input(
            g,
            site.weight_nk(weight),
            ops.draw_seed(g),
            config.gx_bits,
            config.gx_bits,
            config.gx_quantizer == "per_token",
            config.hadamard,
            config.weight_quantizer,
        ).to(out_dtype)
        return out.t() if use.out_transposed else out

    return insert_traced(graph, hq, [source, site.weight], before=use.node, meta=meta, created=created)
