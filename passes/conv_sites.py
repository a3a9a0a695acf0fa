"""Find the convolutions of a joint graph and the backward that autograd derived for each.

A convolution appears in the forward as ``convolution(x, W, b, stride, padding, dilation, transposed,
output_padding, groups)`` with a weight-like ``W`` (a parameter, or computed from parameters), and in
the backward as one ``convolution_backward(g, x, W, …, output_mask)`` whose ``getitem`` users are its
grad_input (0), grad_weight (1) and grad_bias (2). Every such convolution is a site, whatever its
dimension or groups; :func:`~hot_compile.passes.legality.why_illegal_conv` says which can be rewritten.
As a linear, a site's products are ``[T, Cout] @ [Cout, Cin·kh·kw]`` (grad_input, before the fold) and
``[Cout, T] @ [T, Cin·kh·kw]`` (grad_weight) over ``T = B·Ho·Wo`` tokens
(:mod:`hot_compile.runtime.conv_ops`).

Nothing here mutates the graph.
"""

from __future__ import annotations

import dataclasses
import math
import operator

import torch
import torch.fx as fx

from .sites import WeightLike, module_path, same_value

aten = torch.ops.aten


@dataclasses.dataclass
class ConvSite:
    conv: fx.Node  # forward aten.convolution
    module_path: str
    backward: fx.Node | None = None  # its aten.convolution_backward
    feeds_cross_entropy = False  # a convolution's output is not a classifier's logits here

    @property
    def forward(self) -> fx.Node:
        return self.conv

    @property
    def x(self) -> fx.Node:
        return self.conv.args[0]

    @property
    def weight(self) -> fx.Node:
        return self.conv.args[1]

    @property
    def activation(self) -> fx.Node:
        """The forward tensor grad_weight reads (what the forward saves for it)."""
        return self.x

    @property
    def stride(self) -> list:
        return list(self.conv.args[3])

    @property
    def padding(self) -> list:
        return list(self.conv.args[4])

    @property
    def dilation(self) -> list:
        return list(self.conv.args[5])

    @property
    def transposed(self) -> bool:
        return bool(self.conv.args[6])

    @property
    def groups(self) -> int:
        return self.conv.args[8]

    @property
    def kernel(self) -> list:
        return list(self.weight.meta["val"].shape[2:])

    def output(self, index: int) -> fx.Node | None:
        """The backward's ``getitem`` user for output ``index`` (0 grad_input, 1 grad_weight, 2 grad_bias)."""
        if self.backward is None:
            return None
        found = [u for u in self.backward.users if u.target is operator.getitem and u.args[1] == index]
        return found[0] if found else None

    @property
    def grad_input(self) -> fx.Node | None:
        return self.output(0)

    @property
    def grad_weight(self) -> fx.Node | None:
        return self.output(1)

    @property
    def shapes(self) -> tuple:
        """(T, Cout, Cin·kh·kw): the im2col linear's (L, N, K), as ints or SymInts."""
        out, w = self.conv.meta["val"].shape, self.weight.meta["val"].shape
        return math.prod(out[:1] + out[2:]), w[0], math.prod(w[1:])


def find_conv_sites(graph: fx.Graph, weight_like: WeightLike, backward: set[fx.Node]) -> list[ConvSite]:
    """Every forward convolution of a weight-like ``W`` with the backward convolution of the same op;
    ``backward`` is the graph's :func:`~hot_compile.passes.sites.backward_nodes`. Without the parameters
    known, ``W`` must be a graph input."""
    sites = []
    for node in graph.find_nodes(op="call_function", target=aten.convolution.default):
        weight = node.args[1]
        known = weight_like(weight) if weight_like.known else weight.op == "placeholder"
        if node not in backward and known and not weight_like(node.args[0]):
            sites.append(ConvSite(node, module_path(node)))
    for node in graph.find_nodes(op="call_function", target=aten.convolution_backward.default):
        if node not in backward:
            continue
        for site in sites:
            fwd, bwd = site.conv.meta.get("seq_nr"), node.meta.get("seq_nr")
            same_op = fwd is None or bwd is None or fwd == bwd  # as a linear's (sites._from_same_op)
            if site.backward is None and same_op and node.args[2] is site.weight and same_value(node.args[1], site.x):
                site.backward = node
                break
    return sites
