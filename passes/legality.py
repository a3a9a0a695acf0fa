"""Legality: can a site be rewritten at all? (Whether it is worth it is ``decide.py``'s question.)"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .sites import LinearSite, MatmulUse

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SUPPORTED_DEVICES = ("cpu", "cuda")


def why_illegal(site: LinearSite, use: MatmulUse) -> str | None:
    """The reason ``use`` cannot be rewritten, or None when it can."""
    out = use.node.meta.get("val")
    operands = [use.grad.meta.get("val"), site.x2d.meta.get("val"), site.weight.meta.get("val")]
    if out is None or any(v is None for v in operands):
        return "no fake-tensor metadata on the operands"
    for v in (out, *operands):
        if v.dtype not in SUPPORTED_DTYPES:
            return f"dtype {v.dtype} is not one of float32/bfloat16/float16"
        if v.device.type not in SUPPORTED_DEVICES:
            return f"device {v.device.type} is not supported"
    if any(statically_known_true(d == 0) for d in site.shapes):
        return "zero-size matmul"
    return None
