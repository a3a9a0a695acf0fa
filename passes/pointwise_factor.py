"""The pointwise function ``f(x)`` through which the backward reads a saved ``x``, and whether it is a
derivative HOT's encoder computes itself: the legality half of
:mod:`.saved_activations`' derivative code.

Where the backward reads ``x`` only through ``f(x)`` times a gradient, the forward can save a 4-bit code
of ``f(x)`` in place of ``x``. When ``f`` is one of :data:`~hot_compile.runtime.aten_impl.DERIVATIVES`
(GELU's, exact or with tanh), the encoder computes it from ``x`` a row at a time; otherwise the forward
computes ``f(x)`` with the backward's own nodes and the encoder codes that buffer.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..runtime.aten_impl import DERIVATIVES, GIVEN

aten = torch.ops.aten
_MULTIPLY = (aten.mul.Tensor,)
# Views a pointwise function may read its input through (Inductor's decomposition reshapes a linear's
# 2-D output back to the activation's shape before the GELU).
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.permute.default, aten.squeeze.dim, aten.unsqueeze.default)
# Views that keep the rows in memory order, so that the encoder reads ``x`` through them in place.
_IN_ORDER_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.squeeze.dim, aten.unsqueeze.default)
# Where f is evaluated to name it: |x| ≤ 10 spans GELU's curvature and saturation.
_PROBE = torch.linspace(-10.0, 10.0, 2001, dtype=torch.float64)
# f evaluated in float32 is within 10⁻⁶ of the float64 formula; GELU's two forms differ by 9·10⁻⁴.
_MATCH_TOLERANCE = 1e-5


@dataclasses.dataclass
class PointwiseFactor:
    """The backward's pointwise function ``f(x)`` of a saved ``x``: its nodes, in graph order, and the
    node of ``f(x)``, whose every other reader multiplies it by a gradient. ``function``: the
    :data:`~hot_compile.runtime.aten_impl.DERIVATIVES` entry ``f`` is, :data:`~hot_compile.runtime.aten_impl.GIVEN`
    where it is none of them; ``reads_through``: for an entry, the in-order views (of ``nodes``) from
    ``x`` to the argument the entry is applied to, of ``f(x)``'s shape."""

    nodes: list[fx.Node]
    value: fx.Node
    function: str = GIVEN
    reads_through: list[fx.Node] = dataclasses.field(default_factory=list)

    def describe(self) -> str:
        if self.function != GIVEN:
            return f"{self.function}'(x)"
        return "·".join(dict.fromkeys(str(n.target).removeprefix("aten.").split(".")[0] for n in self.nodes))


def _pointwise(node: fx.Node) -> bool:
    return node.op == "call_function" and (node.target in _VIEWS or torch.Tag.pointwise in getattr(node.target, "tags", ()))


def pointwise_factor(placeholder: fx.Node, position: dict[fx.Node, int]) -> PointwiseFactor | None:
    """The one pointwise function of ``placeholder`` through which the backward reads it, where its
    value only multiplies other tensors (a derivative times a gradient); None otherwise.

    The function is the set of pointwise nodes (and views) computed from ``placeholder`` and
    constants alone. It qualifies when every reader of ``placeholder`` is in it, one of its nodes
    (``f(x)``, as many values as ``x``, an even number of them a row: two codes a byte) is read
    outside it, and only by ``mul`` nodes. ``position``: the backward graph's nodes in order.
    """
    inside: set[fx.Node] = {placeholder}
    nodes: list[fx.Node] = []
    frontier = list(placeholder.users)
    while frontier:  # users of the set whose every input is in it, until none is left
        grown = [n for n in frontier if n not in inside and _pointwise(n) and all(a in inside for a in n.all_input_nodes)]
        if not grown:
            break
        inside.update(grown)
        nodes.extend(grown)
        frontier = [u for n in grown for u in n.users]
    if not nodes or any(u not in inside for u in placeholder.users):
        return None
    read_outside = [n for n in nodes if any(u not in inside for u in n.users)]
    if len(read_outside) != 1:
        return None
    (value,) = read_outside
    val, x = value.meta.get("val"), placeholder.meta["val"]
    if not isinstance(val, torch.Tensor) or not val.is_floating_point() or val.dim() == 0:
        return None
    if not statically_known_true(val.numel() == x.numel()) or not statically_known_true(val.shape[-1] % 2 == 0):
        return None
    if any(u.target not in _MULTIPLY for u in value.users if u not in inside):
        return None
    factor = PointwiseFactor(sorted(nodes, key=position.__getitem__), value)
    if (named := known_derivative(placeholder, factor)) is not None:
        factor.function, factor.reads_through = named
    return factor


def known_derivative(placeholder: fx.Node, factor: PointwiseFactor) -> tuple[str, list[fx.Node]] | None:
    """The :data:`~hot_compile.runtime.aten_impl.DERIVATIVES` entry that ``factor`` computes, and the
    views it reads ``x`` through; None where it is none of them.

    The nodes must be a chain of in-order views of ``placeholder`` (the argument, of ``f(x)``'s shape),
    then pointwise arithmetic on the argument alone. That arithmetic, run on a probe of ``x``'s dtype,
    must agree with one entry's float64 formula within :data:`_MATCH_TOLERANCE`: the name comes from
    what the nodes compute, not from how a decomposition happens to spell it."""
    argument, chain = placeholder, []
    for node in factor.nodes:
        if node.target in _IN_ORDER_VIEWS and node.args[0] is argument:
            argument = node
            chain.append(node)
    arithmetic = [n for n in factor.nodes if n not in chain]
    earlier = {placeholder, *chain} - {argument}
    if any(n.target in _VIEWS or any(a in earlier for a in n.all_input_nodes) for n in arithmetic):
        return None
    shape, value_shape = argument.meta["val"].shape, factor.value.meta["val"].shape
    if factor.value not in arithmetic or len(shape) != len(value_shape):
        return None
    if not all(statically_known_true(a == b) for a, b in zip(shape, value_shape)):
        return None
    with unset_fake_temporarily():  # the partitioner runs under the graph's fake mode; the probe is real
        probe = _PROBE.to(placeholder.meta["val"].dtype)
        env: dict[fx.Node, torch.Tensor] = {argument: probe}
        try:
            for node in arithmetic:
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
                env[node] = node.target(*args, **kwargs)
        except (RuntimeError, TypeError, ValueError, NotImplementedError):
            return None  # an op that takes no plain CPU tensor: not one of the derivatives
        computed, exact = env[factor.value], probe.double()
        if not isinstance(computed, torch.Tensor) or computed.shape != exact.shape:
            return None
        for name, derivative in DERIVATIVES.items():
            if (computed.double() - derivative(exact)).abs().max() <= _MATCH_TOLERANCE:
                return name, chain
    return None

