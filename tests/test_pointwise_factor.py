"""Which function the backward reads a saved value through (:mod:`hot_compile.passes.pointwise_factor`):
GELU's derivatives named from what the nodes compute, everything else left to the forward."""

import pytest
import torch
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

from hot_compile.passes.pointwise_factor import pointwise_factor
from hot_compile.runtime.aten_impl import GIVEN

aten = torch.ops.aten


def _factor_of(backward):
    """The factor of the first input of ``backward(x [4, 6], g [2, 2, 6])``, traced with Inductor's
    decompositions as the partitioner's backward graph holds it."""
    graph = make_fx(backward, decomposition_table=select_decomp_table())(torch.randn(4, 6), torch.randn(2, 2, 6)).graph
    x = next(iter(graph.find_nodes(op="placeholder")))
    return pointwise_factor(x, {n: i for i, n in enumerate(graph.nodes)})


@pytest.mark.parametrize("approximate, name", [("none", "gelu"), ("tanh", "gelu_tanh")])
def test_gelus_derivative_is_named_through_a_view(approximate, name):
    factor = _factor_of(lambda x, g: aten.gelu_backward(g, x.view(2, 2, 6), approximate=approximate))
    assert factor.function == name and [n.target for n in factor.reads_through] == [aten.view.default]
    assert factor.describe() == f"{name}'(x)"


@pytest.mark.parametrize(
    "backward, why",
    [
        (lambda x, g: aten.gelu_backward(g.permute(0, 2, 1), x.view(2, 2, 6).permute(0, 2, 1)), "a permuted view"),
        (lambda x, g: g * x.view(2, 2, 6).cos(), "another function"),
        (lambda x, g: aten.gelu_backward(g, x.view(2, 2, 6) * 1.001), "a scaled GELU"),
    ],
)
def test_anything_else_is_left_to_the_forward(backward, why):
    """A derivative read through a view that reorders the rows, or another function (even GELU's of a
    scaled input), keeps the nodes the forward computes f(x) with."""
    factor = _factor_of(backward)
    assert factor is not None and factor.function == GIVEN and factor.reads_through == [], why
