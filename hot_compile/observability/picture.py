"""The picture of a joint graph's backward region (``backward.svg`` in a dump): one box per op or
per module's group of ops, in dependency layers, with HOT's rewrites coloured."""

from __future__ import annotations

import collections
import dataclasses
import html

import networkx as nx
import torch
import torch.fx as fx

from ..passes.provenance import META_KEY
from ..passes import rewrite_conv
from ..passes.rewrite_grad_input import REWRITE as HQ
from ..passes.rewrite_grad_weight import COMPRESS, REWRITE as HLA


_REWRITE_COLORS = {
    HQ: "#f4a261",
    HLA: "#2a9d8f",
    COMPRESS: "#8ab17d",
    rewrite_conv.REWRITE_GX: "#f4a261",
    rewrite_conv.REWRITE_GW: "#2a9d8f",
    rewrite_conv.COMPRESS: "#8ab17d",
}
aten = torch.ops.aten
_FLOAT_MATMULS = {aten.mm.default, aten.bmm.default, aten.addmm.default, aten.convolution_backward.default}
_CHAR_W, _BOX_H, _ROW_GAP, _COL_GAP, _MARGIN, _LEGEND_H = 6.6, 34, 44, 14, 20, 70


@dataclasses.dataclass(frozen=True)
class _Box:
    lines: tuple[str, str]
    tip: str
    fill: str = "white"
    stroke: str = "#333"
    stroke_width: float = 1
    dash: str = ""

    @property
    def width(self) -> float:
        return max(len(t) for t in self.lines) * _CHAR_W + 12


def _tensor_text(node: fx.Node) -> str:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        dtype = str(val.dtype).removeprefix("torch.")
        return f"{dtype}[{', '.join(str(d) for d in val.shape)}]"
    return ""


def _op_text(node: fx.Node) -> str:
    if node.op == "call_function":
        return getattr(node.target, "__name__", str(node.target)).removesuffix(".default")
    return node.op


def _source_line(node: fx.Node) -> list[str]:
    return [line.strip() for line in (node.meta.get("stack_trace") or "").strip().splitlines()[-2:]]


def _group_key(node: fx.Node) -> str:
    """One box per HOT rewrite (its nodes share a provenance), one per node elsewhere."""
    info = node.meta.get(META_KEY)
    return f"{info['rewrite']}:{info['replaces']}" if info else node.name


def _box(members: list[fx.Node], is_input: bool) -> _Box:
    first = members[0]
    info = first.meta.get(META_KEY)
    if info:
        ops = collections.Counter(_op_text(n) for n in members)
        where = f"{info['module'] or '(root)'} {info['path']}: {len(members)} nodes for {info['replaces']}"
        counts = ", ".join(f"{op} ×{k}" for op, k in ops.most_common())
        return _Box(
            (info["rewrite"], where),
            "\n".join([f"{META_KEY}: {info}", counts, *_source_line(first)]),
            fill=_REWRITE_COLORS.get(info["rewrite"], "#e9c46a"),
        )
    tip = "\n".join([first.format_node(), *_source_line(first)])
    lines = (first.name, f"{_op_text(first)} {_tensor_text(first)}".strip())
    if first.target in _FLOAT_MATMULS:
        return _Box(lines, tip, stroke="#e63946", stroke_width=2.5)
    if is_input:
        return _Box(lines, tip, fill="#eeeeee", stroke="#888", dash=' stroke-dasharray="4,2"')
    return _Box(lines, tip)


def _layers(model: nx.DiGraph, region: set[str], inputs: set[str]) -> dict[str, int]:
    """Longest-path layers of the region; each input sits one layer above its first consumer."""
    layer: dict[str, int] = {}
    for key in nx.topological_sort(model.subgraph(region)):
        layer[key] = 1 + max((layer[p] for p in model.predecessors(key) if p in region), default=0)
    for key in inputs:
        layer[key] = min(layer[s] for s in model.successors(key) if s in region) - 1
    return layer


def _order_rows(model: nx.DiGraph, layer: dict[str, int], order: dict[str, int]) -> list[list[str]]:
    """Boxes per layer, each layer sorted by the mean relative position of its boxes' predecessors in
    the layers above (one barycenter sweep: far fewer crossing edges than graph order)."""
    rows: list[list[str]] = [[] for _ in range(max(layer.values()) + 1)]
    for key in sorted(layer, key=order.__getitem__):
        rows[layer[key]].append(key)
    position: dict[str, float] = {}  # 0..1 across its row
    for row in rows:
        in_graph_order = {key: (i + 0.5) / len(row) for i, key in enumerate(row)}

        def barycenter(key: str) -> float:
            placed = [position[p] for p in model.predecessors(key) if p in position]
            return sum(placed) / len(placed) if placed else in_graph_order[key]

        row.sort(key=barycenter)
        position.update((key, (i + 0.5) / len(row)) for i, key in enumerate(row))
    return [row for row in rows if row]


def backward_picture(graph: fx.Graph, title: str) -> str:
    """An SVG of the backward region of a joint graph (what depends on a tangent) and the values it
    reads from the forward. Each HOT rewrite is one box filled by its kind; float matmuls left in the
    backward are outlined in red. Hovering a box shows its FX node (or the rewrite's ops) and source."""
    members: dict[str, list[fx.Node]] = collections.defaultdict(list)
    for node in graph.nodes:
        members[_group_key(node)].append(node)
    model = nx.DiGraph()
    model.add_nodes_from(members)
    model.add_edges_from(
        (_group_key(a), key)
        for key, group in members.items()
        for n in group
        for a in n.all_input_nodes
        if _group_key(a) != key
    )
    tangents = [n.name for n in graph.find_nodes(op="placeholder") if n.name.startswith("tangents")]
    outputs = {n.name for n in graph.find_nodes(op="output")}
    region = set(tangents).union(*(nx.descendants(model, t) for t in tangents)) - outputs
    inputs = {p for key in region for p in model.predecessors(key)} - region
    parts: list[str] = []
    if region:
        order = {key: i for i, key in enumerate(members)}
        rows = _order_rows(model, _layers(model, region, inputs), order)
        boxes = {key: _box(members[key], key in inputs) for key in region | inputs}
        row_widths = [sum(boxes[k].width for k in row) + _COL_GAP * max(len(row) - 1, 0) for row in rows]
        canvas_w = max(row_widths) + 2 * _MARGIN
        at: dict[str, tuple[float, float]] = {}  # top-left corner of each box
        for i, row in enumerate(rows):
            x = _MARGIN + (canvas_w - 2 * _MARGIN - row_widths[i]) / 2
            for key in row:
                at[key] = (x, _MARGIN + _LEGEND_H + i * (_BOX_H + _ROW_GAP))
                x += boxes[key].width + _COL_GAP
        drawn = [key for key in members if key in region or key in inputs]  # graph order: stable output
        edges = [(src, dst) for dst in drawn if dst in region for src in model.predecessors(dst)]
        for src, dst in edges:  # every source is in the region or one of its inputs
            x0, y0 = at[src][0] + boxes[src].width / 2, at[src][1] + _BOX_H
            x1, y1 = at[dst][0] + boxes[dst].width / 2, at[dst][1]
            bend = (y1 - y0) / 2
            parts.append(
                f'<path d="M{x0:.1f},{y0:.1f} C{x0:.1f},{y0 + bend:.1f} {x1:.1f},{y1 - bend:.1f} {x1:.1f},{y1:.1f}" '
                'fill="none" stroke="#999" stroke-width="1" marker-end="url(#arrow)"/>'
            )
        parts += [_box_svg(boxes[key], *at[key]) for key in drawn]
        height = _MARGIN * 2 + _LEGEND_H + len(rows) * (_BOX_H + _ROW_GAP)
    else:
        canvas_w, height = 640, _MARGIN * 2 + _LEGEND_H + 40
        parts.append(f'<text x="{_MARGIN}" y="{_MARGIN + _LEGEND_H + 20}">This graph has no backward region.</text>')
    rewrites = sum(1 for key in region | inputs if META_KEY in members[key][0].meta)
    header = f"{title}: {len(region)} backward boxes, {len(inputs)} inputs from the forward, {rewrites} HOT rewrites"
    return "\n".join(
        [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{canvas_w:.0f}" height="{height:.0f}" '
            'font-family="DejaVu Sans Mono, Menlo, monospace" font-size="11">',
            '<defs><marker id="arrow" viewBox="0 0 8 8" refX="8" refY="4" markerWidth="6" markerHeight="6" '
            'orient="auto"><path d="M0,0 L8,4 L0,8 z" fill="#999"/></marker></defs>',
            '<rect width="100%" height="100%" fill="white"/>',
            f'<text x="{_MARGIN}" y="{_MARGIN + 4}" font-size="13" font-weight="bold">{html.escape(header)}</text>',
            _legend(),
            *parts,
            "</svg>",
            "",
        ]
    )


def _legend() -> str:
    items = [_Box((f"HOT: {rewrite}", ""), "", fill=color) for rewrite, color in _REWRITE_COLORS.items()]
    items += [
        _Box(("float matmul", ""), "", stroke="#e63946", stroke_width=2.5),
        _Box(("from the forward", ""), "", fill="#eeeeee", stroke="#888", dash=' stroke-dasharray="4,2"'),
    ]
    out, x = [], _MARGIN
    for item in items:
        out.append(
            f'<rect x="{x:.1f}" y="{_MARGIN + 22}" width="14" height="14" fill="{item.fill}" stroke="{item.stroke}" '
            f'stroke-width="{item.stroke_width}"{item.dash}/>'
        )
        out.append(f'<text x="{x + 20:.1f}" y="{_MARGIN + 33}">{html.escape(item.lines[0])}</text>')
        x += 20 + len(item.lines[0]) * _CHAR_W + 24
    return "\n".join(out)


def _box_svg(box: _Box, x: float, y: float) -> str:
    return (
        f"<g><title>{html.escape(box.tip)}</title>"
        f'<rect x="{x:.1f}" y="{y:.1f}" width="{box.width:.1f}" height="{_BOX_H}" rx="4" fill="{box.fill}" '
        f'stroke="{box.stroke}" stroke-width="{box.stroke_width}"{box.dash}/>'
        f'<text x="{x + 6:.1f}" y="{y + 14:.1f}" font-weight="bold">{html.escape(box.lines[0])}</text>'
        f'<text x="{x + 6:.1f}" y="{y + 28:.1f}">{html.escape(box.lines[1])}</text></g>'
    )
