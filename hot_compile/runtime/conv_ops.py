"""HOT for 2-D convolutions (groups = 1), as linear products over the implicit patch matrix.

A convolution ``y = conv2d(x, W)`` with ``x: [B, Cin, H, W]`` and ``W: [Cout, Cin, kh, kw]`` is the linear
``cols(x) Wmᵀ``: ``cols(x)`` the patches of ``x`` as ``[T, kh·kw·Cin]`` (``T = B·Ho·Wo`` tokens, row-major
over ``(b, oh, ow)``) and ``Wm`` the weight's columns in the same ``(kh, kw, Cin)`` order. With ``g`` the
upstream gradient as ``[T, Cout]``, its two backward products are a linear's:

* grad_input  ``= fold(g Wm)``: HQ's product (:func:`~hot_compile.runtime.ops.hq_grad_input`), whose
  patches the fold sums back onto the input;
* grad_weight ``= gᵀ cols(x)``: HLA's (:func:`~hot_compile.runtime.ops.hla_grad_weight`), contracted over
  the tokens, which compressing ``cols(x)`` projects as it does a linear's input.

What the forward saves is ``x``, not ``cols(x)`` (``kh·kw`` times larger at stride 1): ``x`` in int8
with one scale per channel (:func:`compress_conv_input`), gathered into patches in the backward.
Patches are gathered and folded channels-last (``(kh, kw, Cin)`` innermost-last), where each kernel
offset is one strided copy or add of contiguous rows; ``F.unfold``/``F.fold`` take several times longer
on the CPU.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from . import ops
from .quant import guard_scale, qmax


def compress_conv_input(x: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """``x: [B, C, ...]`` → (``round(x / s)`` in int8, ``s``: ``[1, C, 1, ...]`` float32, ``max|x|`` of
    each channel over ``qmax(bits)``): round to nearest. Plain aten, which Inductor fuses into the
    forward."""
    qm = qmax(bits)
    channel_dims = [d for d in range(x.dim()) if d != 1]
    scale = guard_scale(x.abs().amax(dim=channel_dims, keepdim=True).float() / qm)
    return torch.round(x.float() / scale).clamp(-qm, qm).to(torch.int8), scale


# Bytes of patches per window: a window's float patches stay in the last-level cache between the
# product that writes them and the fold or quantizer that reads them. Built whole,
# the patch matrix of a [32, 64, 56, 56] layer is 231 MB of fresh pages per call.
WINDOW_BYTES = 8 << 20


def _windows(batch: int, out_rows: int, out_cols: int, row_bytes: int) -> Iterator[tuple[slice, slice]]:
    """(images, output rows) windows covering ``[batch, out_rows, out_cols]`` tokens, each at most
    :data:`WINDOW_BYTES` of patches (one output row at least): whole images where they fit."""
    rows = max(1, WINDOW_BYTES // max(1, row_bytes * out_cols))
    if rows >= out_rows:
        images = max(1, rows // out_rows)
        for b in range(0, batch, images):
            yield slice(b, b + images), slice(0, out_rows)
        return
    for b in range(batch):
        for o in range(0, out_rows, rows):
            yield slice(b, b + 1), slice(o, o + rows)


def _tokens(grad_output: Tensor) -> Tensor:
    """``g: [B, Cout, Ho, Wo]`` as ``[T, Cout]``, tokens in the patches' order."""
    return grad_output.permute(0, 2, 3, 1).reshape(-1, grad_output.shape[1])


def _padded_nhwc(x: Tensor, padding) -> Tensor:
    """``x: [B, C, H, W]`` channels-last, zero-padded by ``padding``."""
    ph, pw = padding
    return F.pad(x.permute(0, 2, 3, 1), (0, 0, pw, pw, ph, ph)).contiguous()


def _patches(padded: Tensor, kernel, stride, dilation, images: slice, rows: slice, out_cols: int) -> Tensor:
    """The patches of output ``rows`` of ``images`` as a strided view ``[b, rows, Wo, kh, kw, C]`` of
    ``padded`` (NHWC)."""
    (kh, kw), (sh, sw), (dh, dw) = kernel, stride, dilation
    part = padded[images, rows.start * sh :]
    n_rows = min(rows.stop - rows.start, (part.shape[1] - dh * (kh - 1) - 1) // sh + 1)
    st_b, st_h, st_w, st_c = part.stride()
    shape = (part.shape[0], n_rows, out_cols, kh, kw, part.shape[3])
    return part.as_strided(shape, (st_b, st_h * sh, st_w * sw, st_h * dh, st_w * dw, st_c))


@torch.library.custom_op("hot_compile::conv_hq_grad_input", mutates_args=())
def conv_hq_grad_input(
    grad_output: Tensor,
    weight: Tensor,
    seed: Tensor,
    input_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    grad_bits: int,
    weight_bits: int,
    per_token: bool,
    hadamard: bool,
    weight_quantizer: str,
) -> Tensor:
    """grad_input of a groups-1 ``conv2d`` by HQ: ``fold(q(g H) q(Hᵀ Wm))``, ``[B, Cin, H, W]``
    (``input_size`` the ``(H, W)`` of the input), in ``grad_output``'s dtype.

    One HQ product per window of output rows (its own seed, ``seed + window``), its patches added onto
    the input one kernel offset at a time, contiguous rows of channels each."""
    b, cout, ho, wo = grad_output.shape
    cin, (kh, kw) = weight.shape[1], weight.shape[2:]
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    weight_columns = weight.permute(0, 2, 3, 1).reshape(cout, -1)
    # In float32 (a sum of up to kh·kw patches per element), with room below and right for the stride's
    # overhang of the last window.
    acc = grad_output.new_zeros(b, input_size[0] + 2 * ph + sh, input_size[1] + 2 * pw + sw, cin, dtype=torch.float32)
    for index, (images, rows) in enumerate(_windows(b, ho, wo, kh * kw * cin * grad_output.element_size())):
        g = grad_output[images, :, rows]
        patches = ops.hq_grad_input(
            _tokens(g), weight_columns, seed + index, grad_bits, weight_bits, per_token, hadamard, weight_quantizer
        ).view(g.shape[0], g.shape[2], wo, kh, kw, cin)
        top = rows.start * sh
        for i in range(kh):
            for j in range(kw):
                window = acc[images, top + i * dh : top + i * dh + sh * g.shape[2] : sh, j * dw : j * dw + sw * wo : sw]
                window += patches[:, :, :, i, j]
    grad_input = acc[:, ph : ph + input_size[0], pw : pw + input_size[1]].permute(0, 3, 1, 2)
    return grad_input.to(grad_output.dtype, memory_format=torch.contiguous_format)


@conv_hq_grad_input.register_fake
def _(grad_output, weight, seed, input_size, stride, padding, dilation, grad_bits, weight_bits, per_token, hadamard, weight_quantizer):
    return grad_output.new_empty(grad_output.shape[0], weight.shape[1], *input_size)


@torch.library.custom_op("hot_compile::conv_hla_grad_weight", mutates_args=())
def conv_hla_grad_weight(
    grad_output: Tensor,
    x_q: Tensor,
    x_scale: Tensor,
    seed: Tensor,
    kernel: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    rank: int,
    bits: int,
    per_channel: bool,
    out_dtype: torch.dtype,
) -> Tensor:
    """grad_weight of a groups-1 ``conv2d`` by HLA on the patches of the saved int8 input, dequantized
    in ``grad_output``'s dtype: ``[Cout, Cin, kh, kw]`` in ``out_dtype``.

    A sum of HLA products over windows of output rows, each compressing its own patches (its own
    scales, seed ``seed + window``), gathered in int8 and dequantized a window at a time: neither the
    patch matrix nor a float copy of the input is ever built whole."""
    b, cout, ho, wo = grad_output.shape
    cin, (kh, kw) = x_q.shape[1], kernel
    x = _padded_nhwc(x_q, padding)  # int8: no float copy of the input is ever whole
    column_scale = x_scale.reshape(1, cin).repeat(1, kh * kw)
    total = torch.zeros(cout, kh * kw * cin, dtype=torch.float32, device=grad_output.device)
    # Windows sized by the float32 patches of the dequantization.
    for index, (images, rows) in enumerate(_windows(b, ho, wo, kh * kw * cin * 4)):
        cols = _patches(x, kernel, stride, dilation, images, rows, wo).reshape(-1, kh * kw * cin)
        cols = (cols.to(torch.float32) * column_scale).to(grad_output.dtype)
        cols_q, cols_scale = ops.compress_activation(cols, rank, bits, per_channel)
        g = _tokens(grad_output[images, :, rows])
        total += ops.hla_grad_weight(g, cols_q, cols_scale, seed + index, rank, bits, per_channel, torch.float32)
    return total.view(cout, kh, kw, cin).permute(0, 3, 1, 2).to(out_dtype).contiguous()


@conv_hla_grad_weight.register_fake
def _(grad_output, x_q, x_scale, seed, kernel, stride, padding, dilation, rank, bits, per_channel, out_dtype):
    return grad_output.new_empty(grad_output.shape[1], x_q.shape[1], *kernel, dtype=out_dtype)
