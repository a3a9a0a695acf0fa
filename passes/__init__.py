"""The HOT joint-graph pass: find → filter → legality → cost → decide → rewrite → report.

:func:`run_hot_pass` rewrites one joint graph in place under a :class:`HotConfig` and returns its
report. It depends only on the config and on the runtime (the custom ops it inserts and the device
profiles its cost model reads); :mod:`hot_compile.inductor_pass` wraps it for Inductor.
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx
from torch._dynamo.utils import counters
from torch.fx.experimental.symbolic_shapes import optimization_hint

from ..config import HotConfig
from ..runtime import ops
from ..runtime.devices import resolve_profile
from .cost_model import SiteCost, forward_cost, grad_input_cost, grad_weight_cost
from .decide import decide, why_not_selected
from .legality import why_illegal, why_illegal_forward
from .numerics import describe, gemm_note, resolve_numerics
from .rewrite_forward import forward_bias, rewrite_forward
from .report import Report, SiteRow
from .rewrite_grad_input import rewrite_grad_input
from .rewrite_grad_weight import CompressedActivations, rewrite_grad_weight
from .sites import LinearSite, WeightLike, backward_nodes, find_linear_sites, same_value
from .unbatch import unbatch_weight_products
from .unmatched import UnmatchedProduct, find_unmatched_products

__all__ = ["Report", "SiteRow", "run_hot_pass"]


def _hint(n) -> int:
    """A concrete size for estimates; never installs a guard on a symbolic size."""
    return optimization_hint(n)


def _bytes(val) -> int:
    return _hint(val.numel()) * val.element_size()


@dataclasses.dataclass
class _Planned:
    site: LinearSite
    config: HotConfig  # the site's own, overrides and plan applied
    path: str  # "fwd" | "gx" | "gw"
    decision: str  # "HQ" | "HLA+ABC" | "kept"
    reason: str
    cost: SiteCost | None
    buffers: tuple[fx.Node, fx.Node] | None = None  # the ABC buffers a rewritten gw reads
    replacement: fx.Node | None = None  # stands in for the original mm once everything is built


def _profile(site: LinearSite, config: HotConfig, profiles: dict):
    device = site.x2d.meta["val"].device
    if device not in profiles:
        profiles[device] = resolve_profile(device, config.device_profile)
    return profiles[device]


def _estimate(site: LinearSite, path: str, config: HotConfig, profile) -> tuple[int, SiteCost]:
    l, n, k = (_hint(d) for d in site.shapes)
    val = site.x2d.meta["val"]
    flops = profile.matmul_rate(val.dtype)
    if path == "fwd":
        return l * n * k, forward_cost(l, n, k, val.element_size(), flops, profile, config.forward_bits)
    if path == "gx":
        return l * n * k, grad_input_cost(l, n, k, val.element_size(), flops, profile, config.gx_bits)
    return l * n * k, grad_weight_cost(l, n, k, config.rank, val.element_size(), flops, profile, config.gw_bits)


def _shape(site: LinearSite, path: str) -> str:
    l, n, k = (_hint(d) for d in site.shapes)
    return {"fwd": f"{l}×{k} @ {k}×{n}", "gx": f"{l}×{n} @ {n}×{k}"}.get(path, f"{n}×{l} @ {l}×{k}")


def _other_backward_readers(graph: fx.Graph, backward: set[fx.Node], x2d: fx.Node) -> list[str]:
    """Live ``backward`` nodes that still read ``x2d``'s values (or the tensor it is a view of)."""
    family = {n for n in graph.nodes if same_value(n, x2d) or n is x2d}
    family |= {n.args[0] for n in family if n.op == "call_function" and n.args and isinstance(n.args[0], fx.Node)}
    return sorted(
        n.name for n in backward if n.users and any(a in family for a in n.all_input_nodes)
    )


def _plan_and_rewrite(graph: fx.Graph, config: HotConfig, sites: list[LinearSite]) -> list[_Planned]:
    """Decide every site and insert the rewrites; the graph's old matmuls still stand afterwards."""
    created: list[fx.Node] = []
    compressed = CompressedActivations(graph, created)
    profiles: dict = {}
    planned: list[_Planned] = []
    try:
        for site in sites:
            profile = _profile(site, config, profiles)
            site_config = resolve_numerics(config.for_module(site.module_path), profile)
            # A forward is planned where forward_bits asks for it, and only in a training graph: an
            # inference graph (no backward product of the linear) compiles as under Inductor.
            trains = site.grad_input is not None or site.grad_weight is not None
            forward = site.linear if site_config.forward_bits is not None and trains else None
            for path, use in (("fwd", forward), ("gx", site.grad_input), ("gw", site.grad_weight)):
                if use is None:
                    continue
                skipped = why_not_selected(site.module_path, path, site_config, site.feeds_cross_entropy)
                if path == "fwd":
                    skipped = skipped or why_illegal_forward(site, forward_bias(site))
                else:
                    skipped = skipped or why_illegal(site, use, path, site_config)
                if skipped:
                    planned.append(_Planned(site, site_config, path, "kept", skipped, None))
                    continue
                mnk, cost = _estimate(site, path, site_config, profile)
                decision = decide(path, mnk, cost, site_config)
                entry = _Planned(site, site_config, path, "kept", decision.reason, cost)
                if decision.rewrite and path == "fwd":
                    entry.decision = "HQ"
                    entry.replacement = rewrite_forward(graph, site, site_config, created)
                elif decision.rewrite and path == "gx":
                    entry.decision = "HQ"
                    entry.replacement = rewrite_grad_input(graph, site, site_config, created)
                elif decision.rewrite:
                    entry.decision = "HLA+ABC"
                    entry.buffers = compressed.get(site, site_config)
                    entry.replacement = rewrite_grad_weight(graph, site, site_config, compressed, created)
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
        before = after = _bytes(site.x2d.meta["val"])
        if entry.buffers is not None:
            after = sum(_bytes(b.meta["val"]) for b in entry.buffers)
            readers = _other_backward_readers(graph, backward, site.x2d)
            if readers:
                after += before
                reason += f"; x is still read by backward op(s) {', '.join(readers)}, so it stays saved"
    return SiteRow(
        module=site.module_path,
        path=entry.path,
        shape=_shape(site, entry.path),
        dtype=str(site.x2d.meta["val"].dtype).removeprefix("torch."),
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
    note = gemm_note(entry.path, entry.config, shapes, site.x2d.meta["val"].device)
    return describe(entry.path, entry.config, config, site.module_path) + note


def _rewrite(graph: fx.Graph, config: HotConfig, weight_like: WeightLike, backward: set[fx.Node]):
    """Find, plan and rewrite the sites; returns the rewritten, the planned and the unmatched."""
    sites = find_linear_sites(graph, weight_like, backward)
    unmatched = find_unmatched_products(graph, sites, weight_like, backward)  # before the rewrites erase any
    planned = _plan_and_rewrite(graph, config, sites)
    rewritten = [p for p in planned if p.decision != "kept"]
    for device in {p.site.x2d.meta["val"].device for p in rewritten}:
        ops.prepare(device)
    for entry in rewritten:
        if entry.path == "fwd":
            old = entry.site.linear
        else:
            old = entry.site.grad_input.node if entry.path == "gx" else entry.site.grad_weight.node
        old.replace_all_uses_with(entry.replacement)
        graph.erase_node(old)
    return rewritten, planned, unmatched


def run_hot_pass(
    graph: fx.Graph, config: HotConfig, graph_name: str = "", parameters: frozenset[int] | None = None
) -> Report:
    """Rewrite ``graph`` in place according to ``config`` and return the per-site report.

    ``parameters``: the indices of the compiled function's inputs that are parameters. With them,
    weights stored as ``[K, N]`` and weights computed from parameters are sites too (see
    :mod:`~hot_compile.passes.sites`).

    Batch-1 ``bmm`` products of a weight (``einsum``) first become ``mm`` (:mod:`.unbatch`). All other
    new nodes are inserted next; only when every rewrite has been built are the old matmuls rewired and
    erased, so an exception leaves the graph as it was.
    """
    weight_like, backward = WeightLike(graph, parameters), backward_nodes(graph)
    unbatched = unbatch_weight_products(graph, weight_like, backward)
    if unbatched.replaced:  # the stand-ins are new nodes, some of them backward ones
        backward = backward_nodes(graph)
    try:
        rewritten, planned, unmatched = _rewrite(graph, config, weight_like, backward)
    except BaseException:
        unbatched.undo(graph)
        raise
    backward = backward_nodes(graph)  # again: the rows read the rewritten graph
    rows = [_row(graph, backward, entry, config) for entry in planned] + [_unmatched_row(u) for u in unmatched]
    hot = counters["hot"]
    hot["sites_found"] += len(rows)
    hot["sites_rewritten"] += len(rewritten)
    hot["sites_kept"] += len(rows) - len(rewritten)
    return Report(graph_name, rows)
