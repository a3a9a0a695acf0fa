"""forward → INT8: ``addmm(b, x2d, Wᵀ)`` (or ``mm``) becomes ``hot_compile::int8_linear(x2d, W, b)``.

Not the paper's (HOT leaves the forward exact): both operands Hadamard-transformed along the
contraction and rounded to nearest, one scale per token and one per output feature, as SwitchBack,
Jetfire and HALO quantize the forward. ``HotConfig.forward_bits=None`` leaves the forward alone.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..config import HotConfig
from ..runtime import ops
from .inline import insert_traced
from .provenance import provenance
from .sites import LinearSite

REWRITE = "int8_linear"
aten = torch.ops.aten


def forward_bias(site: LinearSite) -> fx.Node | None:
    """The bias of ``site``'s forward ``addmm`` (``None`` for ``mm``)."""
    return site.linear.args[0] if site.linear.target is aten.addmm.default else None


def rewrite_forward(graph: fx.Graph, site: LinearSite, config: HotConfig, created: list[fx.Node]) -> fx.Node:
    """Insert the integer forward product of ``site``; returns the node to stand in for the addmm/mm."""
    meta = provenance(REWRITE, site.module_path, "fwd", site.linear, "forward")
    bias = forward_bias(site)
    out_dtype = site.linear.meta["val"].dtype

    def linear(x, weight, *maybe_bias):
        bias = maybe_bias[0] if maybe_bias else None
        return ops.int8_linear(x, site.weight_nk(weight), bias, config.forward_bits).to(out_dtype)

    operands = [site.x2d, site.weight] + ([bias] if bias is not None else [])
    return insert_traced(graph, linear, operands, before=site.linear, meta=meta, created=created)
