"""Legality: can a site be rewritten at all? (Whether it is worth it is ``decide.py``'s question.)"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..config import HotConfig
from ..runtime.hadamard import lowpass_rows
from .conv_sites import ConvSite
from .sites import LinearSite, MatmulUse

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SUPPORTED_DEVICES = ("cpu", "cuda")


def _cuda_int_mm_problem(site: LinearSite | ConvSite, path: str) -> str | None:
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


def unsupported(values) -> str | None:
    """Why tensors of `values` cannot be HOT operands (dtype, device); None when they can."""
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
    problem = unsupported(values)
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
    return unsupported((out, *operands)) or _size_problem(site, path, config, out.device, "matmul", "L")


def _size_problem(
    site: LinearSite | ConvSite, path: str, config: HotConfig, device: torch.device, what: str, tokens: str
) -> str | None:
    """What the sizes of a backward product (``site.shapes``, ``(L, N, K)`` of its linear) rule out: an
    empty product, a rank that keeps no token row, CUDA's int8 GEMM constraints."""
    if any(statically_known_true(d == 0) for d in site.shapes):
        return f"zero-size {what}"
    if path == "gw" and statically_known_true(lowpass_rows(site.shapes[0], config.rank) == 0):
        return f"rank {config.rank} keeps no row of {tokens} = {site.shapes[0]} tokens"
    if device.type == "cuda":
        return _cuda_int_mm_problem(site, path)
    return None


def why_illegal_conv(site: ConvSite, path: str, config: HotConfig) -> str | None:
    """The reason the ``path`` ("gx"/"gw") product of the convolution ``site`` cannot be rewritten, or
    None when it can: a 2-D, groups-1, non-transposed convolution of supported dtype and device."""
    if site.backward is None:
        return "no convolution_backward of this convolution in the graph"
    weight = site.weight.meta.get("val")
    values = [site.conv.meta.get("val"), site.x.meta.get("val"), weight, site.backward.args[0].meta.get("val")]
    if any(v is None for v in values):
        return "no fake-tensor metadata on the operands"
    if site.transposed:
        return "transposed convolution: HOT covers the forward convolution's backward products"
    if weight.dim() != 4:
        return f"{weight.dim() - 2}-D convolution: HOT covers 2-D convolutions"
    if site.groups != 1:
        kind = "depthwise" if statically_known_true(values[1].shape[1] == site.groups) else "grouped"
        return (
            f"{kind} convolution (groups={site.groups}): each group contracts {weight.shape[1]} input "
            "channel(s) per output, too few for an integer product to pay; kept exact"
        )
    problem = unsupported(values)
    if problem:
        return problem
    if not all(isinstance(d, int) for d in values[1].shape[2:]):
        return "the input's spatial size is symbolic: the rewritten backward builds grad_input at a fixed input size"
    return _size_problem(site, path, config, values[0].device, "convolution", "T")
