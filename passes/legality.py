"""Legality: can a site be rewritten at all? (Whether it is worth it is ``decide.py``'s question.)"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..config import HotConfig
from ..runtime.hadamard import lowpass_rows
from .sites import LinearSite, MatmulUse

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SUPPORTED_DEVICES = ("cpu", "cuda")


def _cuda_int_mm_problem(site: LinearSite, path: str) -> str | None:
    """cuBLASLt's int8 GEMM needs M > 16 and K, N multiples of 8 (``torch._int_mm`` on CUDA); HLA's
    contraction is padded to a multiple of 8 by ``ops.int8_matmul``."""
    l, n, k = site.shapes
    if not statically_known_true(k % 8 == 0):
        return "CUDA _int_mm needs in_features a multiple of 8"
    if path == "fwd" and not statically_known_true(n % 8 == 0):
        return "CUDA _int_mm needs out_features a multiple of 8"
    if path in ("fwd", "gx") and not statically_known_true(l > 16):
        return "CUDA _int_mm needs more than 16 tokens"
    if path == "gw" and not statically_known_true(n > 16):
        return "CUDA _int_mm needs more than 16 out_features"
    return None


def _unsupported(values) -> str | None:
    for v in values:
        if v.dtype not in SUPPORTED_DTYPES:
            return f"dtype {v.dtype} is not one of float32/bfloat16/float16"
        if v.device.type not in SUPPORTED_DEVICES:
            return f"device {v.device.type} is not supported"
    return None


def why_illegal_forward(site: LinearSite, bias: fx.Node | None) -> str | None:
    """The reason ``site``'s forward product cannot run on integer operands, or None when it can."""
    out = site.linear.meta.get("val")
    values = [out, site.x2d.meta.get("val"), site.weight.meta.get("val")]
    values += [bias.meta.get("val")] if bias is not None else []
    if any(v is None for v in values):
        return "no fake-tensor metadata on the operands"
    problem = _unsupported(values)
    if problem:
        return problem
    if bias is not None and tuple(values[-1].shape) != (site.shapes[1],):
        return f"bias of shape {tuple(values[-1].shape)}, not [out_features]"
    if any(statically_known_true(d == 0) for d in site.shapes):
        return "zero-size matmul"
    if out.device.type == "cuda":
        return _cuda_int_mm_problem(site, "fwd")
    return None


def why_illegal(site: LinearSite, use: MatmulUse, path: str, config: HotConfig) -> str | None:
    """The reason the ``path`` ("gx"/"gw") site ``use`` cannot be rewritten, or None when it can.
    Decided without installing guards: unknown divisibility of a symbolic size is handled by padding,
    and a size that is only possibly zero is legal (the kernels accept empty inputs)."""
    out = use.node.meta.get("val")
    operands = [use.grad.meta.get("val"), site.x2d.meta.get("val"), site.weight.meta.get("val")]
    if out is None or any(v is None for v in operands):
        return "no fake-tensor metadata on the operands"
    problem = _unsupported((out, *operands))
    if problem:
        return problem
    if any(statically_known_true(d == 0) for d in site.shapes):
        return "zero-size matmul"
    if path == "gw" and statically_known_true(lowpass_rows(site.shapes[0], config.rank) == 0):
        return f"rank {config.rank} keeps no row of L = {site.shapes[0]} tokens"
    if out.device.type == "cuda":
        return _cuda_int_mm_problem(site, path)
    return None
