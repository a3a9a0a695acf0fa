"""The HOT joint-graph pass: find → filter → legality → cost → decide → rewrite → report.

:func:`run_hot_pass` rewrites one joint graph in place under a :class:`HotConfig` and returns its
report. It depends only on the config and on the runtime (the custom ops it inserts and the device
profiles its cost model reads); :mod:`hot_compile.inductor_pass` wraps it for Inductor.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
import torch.fx as fx
from torch._dynamo.utils import counters
from torch.fx.experimental.symbolic_shapes import optimization_hint

from ..config import HotConfig
from ..runtime import ops
from ..runtime.devices import resolve_profile
from .attention_precision import AttentionSite, find_attention_backwards, products_attention_backward
from .attention_precision import replace_attention_backward, upcast_attention_backward, why_not_products
from .conv_sites import ConvSite, find_conv_sites
from .cost_model import (
    SiteCost,
    conv_grad_input_cost,
    conv_grad_weight_cost,
    forward_cost,
    grad_input_cost,
    grad_weight_cost,
)
from .decide import decide, why_not_selected
from .legality import why_illegal, why_illegal_conv, why_illegal_forward
from .numerics import describe, gemm_note, resolve_numerics
from .rewrite_forward import forward_bias, rewrite_forward
from .report import Report, SiteRow
from .rewrite_conv import compressed_conv_input, retire_conv_backward, rewrite_conv_grad_input, rewrite_conv_grad_weight
from .rewrite_grad_input import rewrite_grad_input
from .rewrite_grad_weight import CompressedActivations, rewrite_grad_weight
from .saved_activations import compress_saved_values, find_saved_values, saved_row
from .saved_activations import why_not_selected as why_saved_not_selected
from .saved_budget import compression_cost, keep_over_budget, step_floor
from .sites import LinearSite, WeightLike, backward_nodes, find_linear_sites, module_path, same_value
from .unbatch import unbatch_weight_products
from .unmatched import UnmatchedProduct, find_unmatched_products

__all__ = ["Report", "SiteRow", "run_hot_pass", "run_saved_pass"]


def _hint(n) -> int:
    """A concrete size for estimates; never installs a guard on a symbolic size."""
    return optimization_hint(n)


def _bytes(val) -> int:
    return _hint(val.numel()) * val.element_size()


Site = LinearSite | ConvSite

# Why a convolution's forward product has a kept row where forward_bits asks for integer forwards.
CONV_FORWARD_KEPT = "the integer forward covers linear layers; a convolution's forward stays exact"


@dataclasses.dataclass
class _Planned:
    site: Site
    config: HotConfig  # the site's own, overrides and plan applied
    path: str  # "fwd" | "gx" | "gw"
    decision: str  # "HQ" | "HLA+ABC" | "kept"
    reason: str
    cost: SiteCost | None
    buffers: tuple[fx.Node, fx.Node] | None = None  # the ABC buffers a rewritten gw reads
    replacement: fx.Node | None = None  # stands in for the original mm once everything is built


def _profile(device: torch.device, config: HotConfig, profiles: dict):
    """``device``'s profile, resolved once per pass (a calibrated one is read from disk)."""
    if device not in profiles:
        profiles[device] = resolve_profile(device, config.device_profile)
    return profiles[device]


def _estimate(site: Site, path: str, config: HotConfig, profile) -> tuple[int, SiteCost]:
    l, n, k = (_hint(d) for d in site.shapes)
    val = site.activation.meta["val"]
    flops = profile.matmul_rate(val.dtype)
    if isinstance(site, ConvSite):
        in_shape = tuple(_hint(d) for d in val.shape)
        if path == "gx":
            offsets = math.prod(_hint(d) for d in site.kernel)
            return l * n * k, conv_grad_input_cost(
                l, n, k, math.prod(in_shape), offsets, val.element_size(), flops, profile, config.gx_bits
            )
        return l * n * k, conv_grad_weight_cost(l, n, k, in_shape, config.rank, val.element_size(), flops, profile, config.gw_bits)
    if path == "fwd":
        return l * n * k, forward_cost(l, n, k, val.element_size(), flops, profile, config.forward_bits)
    if path == "gx":
        return l * n * k, grad_input_cost(l, n, k, val.element_size(), flops, profile, config.gx_bits)
    return l * n * k, grad_weight_cost(l, n, k, config.rank, val.element_size(), flops, profile, config.gw_bits)


def _shape(site: Site, path: str) -> str:
    l, n, k = (_hint(d) for d in site.shapes)
    product = {"fwd": f"{l}×{k} @ {k}×{n}", "gx": f"{l}×{n} @ {n}×{k}"}.get(path, f"{n}×{l} @ {l}×{k}")
    if isinstance(site, LinearSite):
        return product
    kernel = "×".join(str(_hint(d)) for d in site.kernel)
    return f"conv {kernel}/{','.join(map(str, site.stride))}: {product}"


def _uses(site: Site, forward_bits) -> list[tuple[str, object]]:
    """The products of ``site`` to plan, by path: a forward where ``forward_bits`` asks for it, and only
    in a training graph (an inference graph compiles as under Inductor), then the backward ones."""
    trains = site.grad_input is not None or site.grad_weight is not None
    forward = site.forward if forward_bits is not None and trains else None
    return [("fwd", forward), ("gx", site.grad_input), ("gw", site.grad_weight)]


def _why_not_rewritable(site: Site, path: str, use, config: HotConfig) -> str | None:
    if isinstance(site, ConvSite):
        return CONV_FORWARD_KEPT if path == "fwd" else why_illegal_conv(site, path, config)
    if path == "fwd":
        return why_illegal_forward(site, forward_bias(site))
    return why_illegal(site, use, path, config)


def _insert_rewrite(graph, site: Site, path: str, config: HotConfig, compressed, created) -> fx.Node:
    """Insert ``site``'s ``path`` rewrite; returns the node to stand in for the original product."""
    if isinstance(site, ConvSite):
        if path == "gx":
            return rewrite_conv_grad_input(graph, site, config, created)
        return rewrite_conv_grad_weight(graph, site, config, compressed, created)
    if path == "fwd":
        return rewrite_forward(graph, site, config, created)
    if path == "gx":
        return rewrite_grad_input(graph, site, config, created)
    return rewrite_grad_weight(graph, site, config, compressed, created)


def _buffers(site: Site, config: HotConfig, compressed: CompressedActivations) -> tuple[fx.Node, fx.Node]:
    """The compressed buffers ``site``'s rewritten grad_weight reads."""
    if isinstance(site, ConvSite):
        return compressed_conv_input(site, config, compressed)
    return compressed.get(site, config)


def _original(site: Site, path: str) -> fx.Node:
    """The node a rewrite of ``site``'s ``path`` product stands in for."""
    if path == "fwd":
        return site.forward
    if isinstance(site, ConvSite):
        return site.grad_input if path == "gx" else site.grad_weight
    return site.grad_input.node if path == "gx" else site.grad_weight.node


def _other_backward_readers(graph: fx.Graph, backward: set[fx.Node], activation: fx.Node) -> list[str]:
    """Live ``backward`` nodes that still read ``activation``'s values (or the tensor it is a view of)."""
    family = {n for n in graph.nodes if same_value(n, activation) or n is activation}
    family |= {n.args[0] for n in family if n.op == "call_function" and n.args and isinstance(n.args[0], fx.Node)}
    return sorted(
        n.name for n in backward if n.users and any(a in family for a in n.all_input_nodes)
    )


def _plan_and_rewrite(graph: fx.Graph, config: HotConfig, sites: list[Site], profiles: dict) -> list[_Planned]:
    """Decide every site and insert the rewrites; the graph's old matmuls still stand afterwards."""
    created: list[fx.Node] = []
    compressed = CompressedActivations(graph, created)
    planned: list[_Planned] = []
    try:
        for site in sites:
            profile = _profile(site.activation.meta["val"].device, config, profiles)
            site_config = resolve_numerics(config.for_module(site.module_path), profile)
            for path, use in _uses(site, site_config.forward_bits):
                if use is None:
                    continue
                skipped = why_not_selected(site.module_path, path, site_config, site.feeds_cross_entropy)
                skipped = skipped or _why_not_rewritable(site, path, use, site_config)
                if skipped:
                    planned.append(_Planned(site, site_config, path, "kept", skipped, None))
                    continue
                mnk, cost = _estimate(site, path, site_config, profile)
                decision = decide(path, mnk, cost, site_config)
                entry = _Planned(site, site_config, path, "kept", decision.reason, cost)
                if decision.rewrite:
                    entry.decision = "HLA+ABC" if path == "gw" else "HQ"
                    entry.replacement = _insert_rewrite(graph, site, path, site_config, compressed, created)
                    if path == "gw":
                        entry.buffers = _buffers(site, site_config, compressed)
                planned.append(entry)
    except BaseException:
        for node in reversed(created):
            graph.erase_node(node)
        raise
    return planned


def _row(graph: fx.Graph, backward: set[fx.Node], entry: _Planned, config: HotConfig) -> SiteRow:
    site, reason = entry.site, entry.reason
    before = after = None
    if entry.path == "gw":
        before = after = _bytes(site.activation.meta["val"])
        if entry.buffers is not None:
            after = sum(_bytes(b.meta["val"]) for b in entry.buffers)
            readers = _other_backward_readers(graph, backward, site.activation)
            if readers:
                after += before
                reason += f"; x is still read by backward op(s) {', '.join(readers)}, so it stays saved"
    return SiteRow(
        module=site.module_path,
        path=entry.path,
        shape=_shape(site, entry.path),
        dtype=str(site.activation.meta["val"].dtype).removeprefix("torch."),
        decision=entry.decision,
        reason=reason,
        saved_bytes_before=before,
        saved_bytes_after=after,
        est_original_ms=entry.cost.original_s * 1e3 if entry.cost else None,
        est_hot_ms=entry.cost.hot_s * 1e3 if entry.cost else None,
        numerics="-" if entry.decision == "kept" else _numerics(entry, config),
    )


def _unmatched_row(product: UnmatchedProduct) -> SiteRow:
    a, b = (arg.meta["val"].shape for arg in product.node.args[:2])
    # A site's product that no matcher recognised may not be rewritable at all: that reason comes first.
    illegal = product.site and why_illegal_forward(product.site, None)
    return SiteRow(
        module=product.module_path,
        path=product.path,
        shape=" @ ".join("×".join(str(_hint(d)) for d in dims) for dims in (a, b)),
        dtype=str(product.node.meta["val"].dtype).removeprefix("torch."),
        decision="kept",
        reason=f"not rewritten: {illegal}" if illegal else product.reason,
    )


def _numerics(entry: _Planned, config: HotConfig) -> str:
    site = entry.site
    shapes = tuple(_hint(d) for d in site.shapes)
    note = gemm_note(entry.path, entry.config, shapes, site.activation.meta["val"].device)
    return describe(entry.path, entry.config, config, site.module_path) + note


def _rewrite(graph: fx.Graph, config: HotConfig, weight_like: WeightLike, backward: set[fx.Node], profiles: dict):
    """Find, plan and rewrite the sites; returns the rewritten, the planned and the unmatched."""
    linear_sites = find_linear_sites(graph, weight_like, backward)
    unmatched = find_unmatched_products(graph, linear_sites, weight_like, backward)  # before the rewrites erase any
    order = {node: i for i, node in enumerate(graph.nodes)}
    sites = sorted(linear_sites + find_conv_sites(graph, weight_like, backward), key=lambda s: order[s.forward])
    planned = _plan_and_rewrite(graph, config, sites, profiles)
    rewritten = [p for p in planned if p.decision != "kept"]
    for device in {p.site.activation.meta["val"].device for p in rewritten}:
        ops.prepare(device)
    for entry in rewritten:
        old = _original(entry.site, entry.path)
        old.replace_all_uses_with(entry.replacement)
        graph.erase_node(old)
    for site in {id(p.site): p.site for p in rewritten if isinstance(p.site, ConvSite)}.values():
        retire_conv_backward(graph, site)
    return rewritten, planned, unmatched


def _attention_row(site: AttentionSite, decision: str, reason: str) -> SiteRow:
    numerics = {
        "float32": "float32 backward, gradients cast back",
        "products": "products of the scores: float32 scores, P and dS rounded to bf16",
    }
    return SiteRow(
        module=site.module_path,
        path="attn",
        shape="×".join(str(_hint(d)) for d in site.shape),
        dtype=str(site.dtype).removeprefix("torch."),
        decision=decision,
        reason=reason,
        numerics=numerics.get(decision, "-"),
    )


def _plan_attention(graph: fx.Graph, config: HotConfig, backward: set[fx.Node], profiles: dict, created: list[fx.Node]):
    """Insert a faster backward beside each half-precision CPU attention backward where the device
    profile says there is one (products of the scores, else float32); returns a row for each attention, and
    the (site, stand-ins) pairs to rewire once every other rewrite is built."""
    rows, replaced = [], []
    sites = find_attention_backwards(graph, backward)
    profile = _profile(torch.device("cpu"), config, profiles) if sites else None
    for site in sites:
        skipped = "policy='off'" if config.policy == "off" else None
        if skipped is None and not config.selects(site.module_path):
            skipped = "excluded by include/exclude globs"
        not_products = why_not_products(site) if profile.attention_backward_products else "not faster on this device"
        if skipped is None and not_products and not profile.fp32_attention_backward:
            skipped = f"kept: the bf16 kernel is not the slower one on this device (profile {profile.name})"
        if skipped:
            rows.append(_attention_row(site, "kept", skipped))
        elif not_products is None:
            replaced.append((site, products_attention_backward(graph, site, created)))
            rows.append(_attention_row(site, "products", f"faster than either fused kernel on this device (profile {profile.name})"))
        else:
            replaced.append((site, upcast_attention_backward(graph, site, created)))
            reason = f"the half-precision kernel is the slower one on this device (profile {profile.name}); products: {not_products}"
            rows.append(_attention_row(site, "float32", reason))
    return rows, replaced


def run_hot_pass(
    graph: fx.Graph, config: HotConfig, graph_name: str = "", parameters: frozenset[int] | None = None
) -> Report:
    """Rewrite ``graph`` in place according to ``config`` and return the per-site report.

    ``parameters``: the indices of the compiled function's inputs that are parameters. With them,
    weights stored as ``[K, N]`` and weights computed from parameters are sites too (see
    :mod:`~hot_compile.passes.sites`).

    Batch-1 ``bmm`` products of a weight (``einsum``) first become ``mm`` (:mod:`.unbatch`). All other
    new nodes are inserted next (the float32 attention backwards of :mod:`.attention_precision`, then
    the products' rewrites); only when every rewrite has been built are the old nodes rewired and
    erased, so an exception leaves the graph as it was.
    """
    weight_like, backward = WeightLike(graph, parameters), backward_nodes(graph)
    unbatched = unbatch_weight_products(graph, weight_like, backward)
    if unbatched.replaced:  # the stand-ins are new nodes, some of them backward ones
        backward = backward_nodes(graph)
    attention_nodes: list[fx.Node] = []
    profiles: dict = {}
    try:
        attention_rows, upcast = _plan_attention(graph, config, backward, profiles, attention_nodes)
        rewritten, planned, unmatched = _rewrite(graph, config, weight_like, backward, profiles)
    except BaseException:
        for node in reversed(attention_nodes):
            graph.erase_node(node)
        unbatched.undo(graph)
        raise
    for site, stand_ins in upcast:
        replace_attention_backward(graph, site, stand_ins)
    backward = backward_nodes(graph)  # again: the rows read the rewritten graph
    rows = [_row(graph, backward, entry, config) for entry in planned] + [_unmatched_row(u) for u in unmatched]
    rows += attention_rows
    hot = counters["hot"]
    hot["sites_found"] += len(rows)
    hot["sites_rewritten"] += len(rewritten) + len(upcast)
    hot["sites_kept"] += len(rows) - len(rewritten) - len(upcast)
    return Report(graph_name, rows)


def run_saved_pass(
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    num_fwd_outputs: int,
    config: HotConfig,
    parameters: frozenset[int] | None = None,
    products: Sequence[SiteRow] = (),
) -> list[SiteRow]:
    """Compress what the partitioned forward ``fw`` saves for ``bw`` (:mod:`.saved_activations`) in
    place; returns a row for each saved activation. ``parameters`` as for :func:`run_hot_pass`.

    Under ``policy="balanced"`` the compression adds at most ``max_slowdown`` of the step's estimated
    floor (:func:`~.saved_budget.step_floor`: the graph's ``products``, the joint pass's rows, as they
    run, its fused attention, and the traffic of what the forward saves), so the budget is a share of
    the step it slows, never more: the values that save the most bytes per estimated second go first,
    and the rest are kept. ``"hot"`` and ``"memory"`` compress every eligible value."""
    saved = find_saved_values(fw, bw, num_fwd_outputs, parameters)
    profiles: dict = {}
    costs, balanced = {}, []
    for s in saved:
        module = module_path(s.forward)
        module_config = config.for_module(module)
        s.reason = s.reason or why_saved_not_selected(module_config, module)
        if module_config.saved_derivative_bits is None:
            s.factor = None
        if s.reason is None:
            costs[id(s)] = compression_cost(s, _profile(s.forward.meta["val"].device, config, profiles))
            if module_config.policy == "balanced":
                balanced.append((s, costs[id(s)]))
    products_s = sum(r.est_ms or 0.0 for r in products) / 1e3
    floor_s = step_floor((fw, bw), saved, products_s, lambda device: _profile(device, config, profiles))
    budget = config.max_slowdown * floor_s
    keep_over_budget(
        balanced,
        budget,
        f"kept: over the budget of policy='balanced', max_slowdown={config.max_slowdown:g} × the step's estimated "
        f"floor {floor_s * 1e3:.3g} ms = {budget * 1e3:.3g} ms of added time, spent on the values that save most per ms",
    )
    compress_saved_values(fw, bw, saved)
    rows = [saved_row(s, costs.get(id(s))) for s in saved]
    counters["hot"]["saved_compressed"] += sum(r.decision != "kept" for r in rows)
    return rows
