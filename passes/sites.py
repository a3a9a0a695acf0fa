"""Find the backward matmul sites of every linear layer in an AOTAutograd joint graph.

A linear layer appears in the forward as ``addmm(b, x2d, Wᵀ)`` or ``mm(x2d, Wᵀ)`` (``x2d`` the input
flattened to ``[L, K]``): ``nn.Linear``, ``F.linear`` and ``x @ W.T`` write ``Wᵀ`` as a transpose of
``W: [N, K]``; GPT-2's ``Conv1D`` and ``x @ W`` store ``Wᵀ`` itself, ``[K, N]``. The weight is
weight-like: a parameter, or a value computed from parameters alone (a merged LoRA adapter, weight
norm), possibly cast. Where the pass is not told which graph inputs are parameters, only the first form
with a graph input as ``W`` is a site. The backward holds up to two ``mm`` nodes, recognised by operand
identity through transposes and views:

* grad_input  ``mm(g, W)`` → ``[L, K]``  (or its transpose ``mm(Wᵀ, gᵀ)``);
* grad_weight ``mm(gᵀ, x2d)`` → ``[N, K]`` (or its transpose ``mm(x2dᵀ, g)``, ``[K, N]``).

Nothing here mutates the graph.
"""

from __future__ import annotations

import dataclasses
import re

import torch
import torch.fx as fx

aten = torch.ops.aten
prims = torch.ops.prims

LINEAR_OPS = (aten.addmm.default, aten.mm.default)
_TRANSPOSE_OPS = (aten.permute.default, aten.t.default, aten.transpose.int)
_VIEW_OPS = (
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.alias.default,
    aten.squeeze.dim,
    aten.unsqueeze.default,
)
_CAST_OPS = (prims.convert_element_type.default, aten._to_copy.default)


@dataclasses.dataclass
class MatmulUse:
    """A backward ``mm`` computing one of a linear's gradients.

    ``grad`` is the operand holding the upstream gradient: ``g [L, N]``, or ``gᵀ`` when
    ``grad_transposed``. ``out_transposed`` means the mm yields the transpose of the gradient product
    (``[K, L]`` for grad_input, ``[K, N]`` for grad_weight).
    """

    node: fx.Node
    grad: fx.Node
    grad_transposed: bool
    out_transposed: bool


@dataclasses.dataclass
class LinearSite:
    linear: fx.Node  # forward addmm / mm
    x2d: fx.Node  # forward input, [L, K]
    weight: fx.Node  # the weight (after any cast), before the forward's transpose if it has one
    module_path: str
    grad_input: MatmulUse | None = None
    grad_weight: MatmulUse | None = None
    feeds_cross_entropy: bool = False  # the output is the logits of a softmax cross-entropy
    weight_kn: bool = False  # ``weight`` holds Wᵀ, [K, N] (Conv1D, x @ W) rather than W, [N, K]

    @property
    def forward(self) -> fx.Node:
        return self.linear

    @property
    def activation(self) -> fx.Node:
        """The forward tensor grad_weight reads (what the forward saves for it)."""
        return self.x2d

    @property
    def shapes(self) -> tuple:
        """(L, N, K) as ints or SymInts."""
        (l, k), w = self.x2d.meta["val"].shape, self.weight.meta["val"].shape
        return l, w[1] if self.weight_kn else w[0], k

    def weight_nk(self, weight):
        """``weight`` (this site's weight, or a value traced from it) as ``[N, K]``."""
        return weight.t() if self.weight_kn else weight


def _val(node: fx.Node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def strip_transposes(node: fx.Node) -> tuple[fx.Node, bool]:
    """Follow 2-D transposes back to their source; returns (source, whether an odd number was seen)."""
    flipped = False
    while node.op == "call_function" and node.target in _TRANSPOSE_OPS:
        if node.target is aten.permute.default and list(node.args[1]) not in ([1, 0], [-1, -2], [1, -2], [-1, 0]):
            break
        if node.target is aten.transpose.int and sorted(d % 2 for d in node.args[1:3]) != [0, 1]:
            break
        src = node.args[0]
        if not isinstance(src, fx.Node) or _val(src) is None or _val(src).dim() != 2:
            break
        node, flipped = src, not flipped
    return node, flipped


def _through(node: fx.Node, ops: tuple) -> fx.Node:
    """The node ``node``'s values come from, followed back through ``ops`` (each reading its first argument)."""
    while node.op == "call_function" and node.target in ops and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def view_root(node: fx.Node) -> fx.Node:
    """The tensor ``node`` is a reshape of."""
    return _through(node, _VIEW_OPS)


def is_view(node: fx.Node) -> bool:
    """Whether ``node`` is a reshape or a permute of its first argument, which Inductor computes nothing for."""
    return node.op == "call_function" and node.target in _TRANSPOSE_OPS + _VIEW_OPS


def viewed_tensor(node: fx.Node) -> fx.Node:
    """The tensor ``node`` is a reshape or a permute of (``node`` itself if it is neither)."""
    return _through(node, _TRANSPOSE_OPS + _VIEW_OPS)


def same_value(a: fx.Node, b: fx.Node) -> bool:
    """Two nodes hold the same values: identical, or row-major reshapes of one tensor to one shape."""
    if a is b:
        return True
    va, vb = _val(a), _val(b)
    return (
        va is not None
        and vb is not None
        and view_root(a) is view_root(b)
        and tuple(va.shape) == tuple(vb.shape)
        and va.dtype == vb.dtype
    )


def _weight_source(node: fx.Node) -> fx.Node:
    """The graph input a weight comes from, through casts and views (autocast inserts a cast)."""
    return _through(node, _CAST_OPS + _VIEW_OPS)


def storage_source(node: fx.Node) -> fx.Node:
    """The node whose values ``node`` holds, through any permutes, views and casts."""
    return _through(node, _TRANSPOSE_OPS + _VIEW_OPS + _CAST_OPS)


_ROOT = re.compile(r"^L\['[^']*'\]\.?")
_ITEM = re.compile(r"\._modules\['([^']*)'\]|\['([^']*)'\]|\[(\d+)\]")


def module_path(node: fx.Node) -> str:
    """The dotted module path (``blocks.0.mlp.fc1``) of the innermost module that created ``node``;
    ``""`` for code in the compiled module's own ``forward``."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    if not stack:
        return ""
    raw = list(stack.values())[-1][0]
    path = _ITEM.sub(lambda m: "." + next(g for g in m.groups() if g is not None), _ROOT.sub("", raw))
    return path.lstrip(".")


def backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes that depend on a tangent input: the backward region of a joint graph.

    Found by walking users, not node order: earlier joint passes (Inductor's pattern replacements)
    may leave the graph out of topological order until its final sort.
    """
    region: set[fx.Node] = set()
    frontier = [n for n in graph.find_nodes(op="placeholder") if n.name.startswith("tangents")]
    while frontier:
        node = frontier.pop()
        if node not in region:
            region.add(node)
            frontier.extend(node.users)
    return region


class WeightLike:
    """Which nodes are weight-like: parameters, and values computed from parameters alone (constants
    allowed). ``parameters`` are the indices of the compiled function's inputs that are parameters, as
    the backend knows them; None where nobody told the pass (``joint_pass()`` installed by hand)."""

    def __init__(self, graph: fx.Graph, parameters: frozenset[int] | None):
        self.known = parameters is not None
        self._params = {
            n for n in graph.find_nodes(op="placeholder") if getattr(n.meta.get("desc"), "idx", None) in (parameters or ())
        }
        self._memo: dict[fx.Node, bool] = {}

    def __call__(self, node: fx.Node) -> bool:
        if node not in self._memo:
            # Iterative: a weight computed from parameters can sit deep in the graph.
            stack = [node]
            while stack:
                n = stack[-1]
                pending = [a for a in n.all_input_nodes if a not in self._memo]
                if pending:
                    stack.extend(pending)
                    continue
                stack.pop()
                if n.op == "placeholder":
                    self._memo[n] = n in self._params
                else:
                    inputs = n.all_input_nodes
                    self._memo[n] = n.op == "get_attr" or (
                        n.op == "call_function" and all(self._memo[a] for a in inputs)
                    )
        return self._memo[node]


def linear_like(node: fx.Node, weight_like: WeightLike) -> tuple[fx.Node, fx.Node, bool] | None:
    """(x2d, weight, weight_kn) of a forward product written as a linear, or None.

    With the parameters known: ``x @ Wᵀ`` with a weight-like 2-D ``W``, transposed or stored as
    ``[K, N]``, and ``x`` not weight-like. Without: the transposed form, whatever ``W`` is, and ``x @ W``
    with ``W`` a graph input and ``x`` none (:func:`why_not_a_site` tells which of these are sites)."""
    mat1, mat2 = (node.args[1], node.args[2]) if node.target is aten.addmm.default else node.args[:2]
    weight, flipped = strip_transposes(mat2)
    val = _val(weight)
    if val is None or val.dim() != 2:
        return None
    if not weight_like.known:
        if flipped:
            return mat1, weight, False
        graph_input = _weight_source(weight).op == "placeholder" and _weight_source(mat1).op != "placeholder"
        return (mat1, weight, True) if graph_input else None
    if weight_like(weight) and not weight_like(mat1):
        return mat1, weight, not flipped
    return None


def why_not_a_site(node: fx.Node, weight: fx.Node, weight_kn: bool, weight_like: WeightLike) -> str | None:
    """Why a linear-like forward product is no site, or None when it is one."""
    if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
        return "an addmm with alpha or beta other than 1 is not a linear layer's product"
    source = _weight_source(weight)
    if not weight_like.known and (weight_kn or source.op != "placeholder"):
        form = "stored as [in, out]" if weight_kn else f"computed in the graph (by {source.name})"
        return (
            f"the weight is {form}, and the pass was not told which graph inputs are parameters "
            "(backend='hot' tells it; joint_pass() alone does not)"
        )
    return None


def _from_same_op(mm: fx.Node, site: LinearSite) -> bool:
    # Autograd copies the forward op's seq_nr onto its backward nodes; it tells apart linears that
    # share an input (q, k, v) or a weight (tied embeddings).
    fwd, bwd = site.linear.meta.get("seq_nr"), mm.meta.get("seq_nr")
    return fwd is None or bwd is None or fwd == bwd


def _classify(mm: fx.Node, site: LinearSite) -> tuple[str, MatmulUse] | None:
    if not _from_same_op(mm, site):
        return None
    a, b = mm.args[:2]
    (sa, fa), (sb, fb) = strip_transposes(a), strip_transposes(b)
    # grad_input: g @ W  or  Wᵀ @ gᵀ, W being [N, K] (a weight stored as [K, N] appears transposed)
    if sb is site.weight and fb == site.weight_kn:
        return "gx", MatmulUse(mm, a, grad_transposed=False, out_transposed=False)
    if sa is site.weight and fa != site.weight_kn:
        return "gx", MatmulUse(mm, b, grad_transposed=True, out_transposed=True)
    # grad_weight: gᵀ @ x2d  or  x2dᵀ @ g
    if same_value(sb, site.x2d) and not fb:
        return "gw", MatmulUse(mm, a, grad_transposed=True, out_transposed=False)
    if same_value(sa, site.x2d) and fa:
        return "gw", MatmulUse(mm, b, grad_transposed=False, out_transposed=True)
    return None


# Ops whose result holds (some of) their input's values unchanged.
_VALUE_PRESERVING_OPS = _VIEW_OPS + _CAST_OPS + (aten.slice.Tensor, aten.clone.default)


def _same_tensor_users(node: fx.Node) -> list[fx.Node]:
    """``node`` and the nodes that hold its values reshaped, cast (autocast casts logits to fp32) or
    sliced (a causal language model's loss drops the last position's logits)."""
    found, frontier = [], [node]
    while frontier:
        n = frontier.pop()
        found.append(n)
        frontier += [u for u in n.users if u.op == "call_function" and u.target in _VALUE_PRESERVING_OPS]
    return found


def _single_user(node: fx.Node, target) -> fx.Node | None:
    users = [u for u in node.users if u.target is target]
    return users[0] if len(users) == 1 else None


def _log_softmax_of(z: fx.Node) -> fx.Node | None:
    """The node computing ``log_softmax(z, -1)`` from ``z``: ``aten._log_softmax``, or its decomposition
    ``s − log(Σ exp s)`` with ``s = z − amax(z)``, as it stands in a joint graph."""
    for user in z.users:
        if user.target is aten._log_softmax.default:
            return user
        if user.target is not aten.sub.Tensor or user.args[0] is not z or not isinstance(user.args[1], fx.Node):
            continue
        if user.args[1].target is not aten.amax.default or user.args[1].args[0] is not z:
            continue
        exp = _single_user(user, aten.exp.default)
        total = exp and _single_user(exp, aten.sum.dim_IntList)
        log = total and _single_user(total, aten.log.default)
        for result in (log.users if log else ()):
            if result.target is aten.sub.Tensor and result.args[:2] == (user, log):
                return result
    return None


_NLL_OPS = (aten.gather.default, aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)


def feeds_cross_entropy(linear: fx.Node) -> bool:
    """Whether ``linear``'s output (through views and casts) is the logits of a softmax cross-entropy:
    a log-softmax whose result the negative log-likelihood reads (``gather`` of the target's log-prob
    once decomposed)."""
    for z in _same_tensor_users(linear):
        log_probs = _log_softmax_of(z)
        if log_probs is not None and any(
            u.target in _NLL_OPS for n in _same_tensor_users(log_probs) for u in n.users
        ):
            return True
    return False


def find_linear_sites(graph: fx.Graph, weight_like: WeightLike, backward: set[fx.Node]) -> list[LinearSite]:
    """Every forward linear of the joint graph with its backward gradient matmuls; ``backward`` is the
    graph's :func:`backward_nodes`."""
    sites: list[LinearSite] = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in LINEAR_OPS or node in backward:
            continue
        operands = linear_like(node, weight_like)
        if operands is not None and why_not_a_site(node, *operands[1:], weight_like) is None:
            site = LinearSite(node, operands[0], operands[1], module_path(node), weight_kn=operands[2])
            site.feeds_cross_entropy = feeds_cross_entropy(node)
            sites.append(site)
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not aten.mm.default or node not in backward:
            continue
        for site in sites:
            found = _classify(node, site)
            if found is None:
                continue
            kind, use = found
            if kind == "gx" and site.grad_input is None:
                site.grad_input = use
                break
            if kind == "gw" and site.grad_weight is None:
                site.grad_weight = use
                break
    return sites
