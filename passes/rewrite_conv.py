"""Convolution backward → HQ and HLA+ABC over the im2col matrix (:mod:`hot_compile.runtime.conv_ops`).

grad_input, ``getitem(convolution_backward, 0)``, becomes ``hot_compile::conv_hq_grad_input(g, W, seed)``;
grad_weight, ``getitem(…, 1)``, becomes ``hot_compile::conv_hla_grad_weight(g, x_q, s_x, seed)``, the
forward gaining ``(x_q, s_x) = compress_conv_input(x)`` before the convolution (convolutions that read
one input, a residual block's first convolution and its shortcut, share it). Once the rewritten
outputs are rewired, :func:`retire_conv_backward` leaves the ``convolution_backward`` only what is
still used of it.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..config import HotConfig
from ..runtime import conv_ops, ops
from .conv_sites import ConvSite
from .inline import insert_traced
from .provenance import provenance
from .rewrite_grad_weight import CompressedActivations

COMPRESS = "compress_conv_input"
REWRITE_GX = "conv_hq_grad_input"
REWRITE_GW = "conv_hla_grad_weight"
EXACT_REST = "conv_backward_without_input"
aten = torch.ops.aten


def _input_size(site: ConvSite) -> list[int]:
    return [int(d) for d in site.x.meta["val"].shape[2:]]


def rewrite_conv_grad_input(graph: fx.Graph, site: ConvSite, config: HotConfig, created: list[fx.Node]) -> fx.Node:
    """Insert the HQ computation of ``site``'s grad_input; returns the node to stand in for its getitem."""
    use = site.grad_input
    meta = provenance(REWRITE_GX, site.module_path, "gx", use, "backward")
    out_dtype, input_size = use.meta["val"].dtype, _input_size(site)

    def hq(grad, weight):
        seed = ops.draw_seed(grad)
        return conv_ops.conv_hq_grad_input(
            grad, weight, seed, input_size, site.stride, site.padding, site.dilation, config.gx_bits, config.gx_bits,
            config.gx_quantizer == "per_token", config.hadamard, config.weight_quantizer,
        ).to(out_dtype)

    return insert_traced(graph, hq, [site.backward.args[0], site.weight], before=use, meta=meta, created=created)


def compressed_conv_input(site: ConvSite, config: HotConfig, compressed: CompressedActivations) -> tuple[fx.Node, fx.Node]:
    """The int8 buffer of ``site``'s input that its HLA reads."""
    bits = config.gw_bits

    def compress(x):
        return conv_ops.compress_conv_input(x, bits)

    meta = provenance(COMPRESS, site.module_path, "gw", site.x, "forward")
    return compressed.buffers(site.x, (COMPRESS, bits), compress, meta, site.conv)


def rewrite_conv_grad_weight(
    graph: fx.Graph, site: ConvSite, config: HotConfig, compressed: CompressedActivations, created: list[fx.Node]
) -> fx.Node:
    """Insert the HLA computation of ``site``'s grad_weight; returns the node to stand in for its getitem."""
    use = site.grad_weight
    x_q, x_scale = compressed_conv_input(site, config, compressed)
    meta = provenance(REWRITE_GW, site.module_path, "gw", use, "backward")
    out_dtype, per_channel = use.meta["val"].dtype, config.gw_quantizer == "per_channel"

    def hla(grad, xq, xs):
        return conv_ops.conv_hla_grad_weight(
            grad, xq, xs, ops.draw_seed(grad), site.kernel, site.stride, site.padding, site.dilation,
            config.rank, config.gw_bits, per_channel, out_dtype,
        )

    return insert_traced(graph, hla, [site.backward.args[0], x_q, x_scale], before=use, meta=meta, created=created)


def _output_padding(site: ConvSite) -> list[int]:
    """What a transposed convolution of ``site``'s output adds to reach the input's size."""
    out = site.conv.meta["val"].shape[2:]
    return [
        size - ((o - 1) * s - 2 * p + d * (k - 1) + 1)
        for size, o, s, p, d, k in zip(_input_size(site), out, site.stride, site.padding, site.dilation, site.kernel)
    ]


def retire_conv_backward(graph: fx.Graph, site: ConvSite) -> None:
    """After the rewritten outputs' getitems are gone: drop ``site.backward`` if nothing else of it is
    used; with grad_weight still its own, narrow its output mask to what is used; with grad_weight
    rewritten, replace it by ops that do not read the input (the grad_input as the transposed
    convolution of ``g``, the grad_bias as ``g``'s sum), so that the forward need not save ``x`` for it."""
    node = site.backward
    used = [i for i in range(3) if site.output(i) is not None]
    if not used:
        graph.erase_node(node)
        return
    if 1 in used:
        node.update_arg(10, [i in used for i in range(3)])
        node.meta["val"] = tuple(v if i in used else None for i, v in enumerate(node.meta["val"]))
        return
    output_padding, dims = _output_padding(site), [d for d in range(site.conv.meta["val"].dim()) if d != 1]

    def rest(grad, weight):
        outputs = []
        if 0 in used:
            outputs.append(aten.convolution(grad, weight, None, site.stride, site.padding, site.dilation, True, output_padding, 1))
        if 2 in used:
            outputs.append(grad.sum(dims))
        return outputs

    meta = provenance(EXACT_REST, site.module_path, "gx" if 0 in used else "gw", node, "backward")
    stand_ins = insert_traced(graph, rest, [node.args[0], site.weight], before=node, meta=meta, created=[])
    for index, stand_in in zip(used, stand_ins):
        getitem = site.output(index)
        getitem.replace_all_uses_with(stand_in)
        graph.erase_node(getitem)
    graph.erase_node(node)
