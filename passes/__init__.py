"""The HOT joint-graph pass: find → legality → decide → rewrite → report.

``HotJointPass`` is an Inductor ``CustomGraphPass`` for ``joint_custom_post_pass``. A failure inside
it leaves the graph exactly as it was (every inserted node is removed before anything is rewired) and
warns once; ``HotConfig(strict=True)`` raises instead.
"""

from __future__ import annotations

import pathlib
import warnings

import torch
import torch.fx as fx
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.fx.experimental.symbolic_shapes import optimization_hint

from ..config import HotConfig
from ..report import Report, SiteRow, publish
from .decide import decide
from .legality import why_illegal
from .rewrite_grad_input import rewrite_grad_input
from .rewrite_grad_weight import CompressedActivations, rewrite_grad_weight
from .sites import LinearSite, backward_nodes, find_linear_sites, same_value

__all__ = ["HotJointPass", "HotPassWarning", "joint_pass", "run_hot_pass"]


class HotPassWarning(UserWarning):
    """The HOT pass could not rewrite a graph; it was compiled unchanged."""


def _hint(n) -> int:
    return optimization_hint(n)


def _bytes(val) -> int:
    return _hint(val.numel()) * val.element_size()


def _shape(site: LinearSite, path: str) -> str:
    l, n, k = (_hint(d) for d in site.shapes)
    return f"{l}×{n} @ {n}×{k}" if path == "gx" else f"{n}×{l} @ {l}×{k}"


def _other_backward_readers(graph: fx.Graph, x2d: fx.Node) -> list[str]:
    """Live backward nodes that still read ``x2d``'s values (or the tensor it is a view of)."""
    backward = backward_nodes(graph)
    family = {n for n in graph.nodes if same_value(n, x2d) or n is x2d}
    family |= {n.args[0] for n in family if n.op == "call_function" and n.args and isinstance(n.args[0], fx.Node)}
    return sorted(
        n.name for n in backward if n.users and any(a in family for a in n.all_input_nodes)
    )


def run_hot_pass(graph: fx.Graph, config: HotConfig, graph_name: str = "") -> Report:
    """Rewrite ``graph`` in place according to ``config`` and return the per-site report."""
    sites = find_linear_sites(graph)
    created: list[fx.Node] = []
    compressed = CompressedActivations(graph, config, created)
    planned: list[tuple[LinearSite, str, str, str]] = []  # site, path, decision, reason
    replacements: list[tuple[fx.Node, fx.Node]] = []
    try:
        for site in sites:
            for path, use in (("gx", site.grad_input), ("gw", site.grad_weight)):
                if use is None:
                    continue
                decision = decide(site.module_path, path, config)
                illegal = why_illegal(site, use)
                if illegal or not decision.rewrite:
                    planned.append((site, path, "kept", illegal or decision.reason))
                    continue
                if path == "gx":
                    new = rewrite_grad_input(graph, site, config, created)
                    planned.append((site, path, "HQ", decision.reason))
                else:
                    new = rewrite_grad_weight(graph, site, config, compressed, created)
                    planned.append((site, path, "HLA+ABC", decision.reason))
                replacements.append((use.node, new))
    except BaseException:
        for node in reversed(created):
            graph.erase_node(node)
        raise
    for old, new in replacements:
        old.replace_all_uses_with(new)
        graph.erase_node(old)

    rows = []
    for site, path, decision, reason in planned:
        before = after = None
        if path == "gw":
            before = after = _bytes(site.x2d.meta["val"])
            if decision == "HLA+ABC":
                x_q, x_scale = compressed.get(site)
                after = _bytes(x_q.meta["val"]) + _bytes(x_scale.meta["val"])
                readers = _other_backward_readers(graph, site.x2d)
                if readers:
                    after += before
                    reason += f"; x is still read by backward op(s) {', '.join(readers)}, so it stays saved"
        rows.append(
            SiteRow(
                module=site.module_path,
                path=path,
                shape=_shape(site, path),
                dtype=str(site.x2d.meta["val"].dtype).removeprefix("torch."),
                decision=decision,
                reason=reason,
                saved_bytes_before=before,
                saved_bytes_after=after,
            )
        )
    hot = counters["hot"]
    hot["sites_found"] += len(rows)
    hot["sites_rewritten"] += len(replacements)
    hot["sites_kept"] += len(rows) - len(replacements)
    return Report(graph_name, rows)


def _source_files() -> tuple[str, ...]:
    import hot_compile

    here = pathlib.Path(__file__).parent
    package = pathlib.Path(hot_compile.__file__).parent
    return tuple(str(p) for d in (here, package) for p in sorted(d.glob("*.py")))


class HotJointPass(CustomGraphPass):
    """Inductor joint-graph pass applying HOT under a fixed :class:`HotConfig`."""

    def __init__(self, config: HotConfig | None = None):
        self.config = config or HotConfig()

    def __call__(self, graph: fx.Graph) -> None:
        compile_id = torch._guards.CompileContext.current_compile_id()
        name = str(compile_id) if compile_id is not None else "<no compile id>"
        try:
            report = run_hot_pass(graph, self.config, name)
        except Exception as exc:
            if self.config.strict:
                raise
            counters["hot"]["graphs_failed"] += 1
            warnings.warn(
                f"hot_compile: the HOT pass failed on graph {name} and left it unchanged "
                f"({type(exc).__name__}: {exc})",
                HotPassWarning,
                stacklevel=2,
            )
            return
        publish(report)

    def uuid(self) -> bytes:
        # The FX-graph and AOTAutograd caches key on this: it must change with the pass's code and
        # every setting, or a cache hit would skip the pass (or replay another config's rewrite).
        return get_hash_for_files(_source_files(), extra=f"{self.config!r}|{torch.__version__}")


def joint_pass(config: HotConfig | None = None) -> HotJointPass:
    """The HOT pass for ``torch._inductor.config.joint_custom_post_pass``."""
    return HotJointPass(config)
