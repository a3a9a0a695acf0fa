"""Seeing what the HOT pass did, through the channels torch.compile users already debug with.

* ``HotConfig.dump_dir`` (env ``HOT_DUMP_DIR``): one folder per compiled graph, named by its compile
  id (``0/1`` → ``0_1``), holding the joint graph before and after the pass, the partitioned forward
  and backward graphs, the report as Markdown and JSON, and an SVG picture of the backward region.
* ``TORCH_LOGS``: the module log ``hot_compile`` (INFO: one line per graph, DEBUG: one per site) and the
  artifacts ``hot_decisions`` (the per-site table) and ``hot_graphs`` (the graphs).
* ``TORCH_TRACE``: ``trace_structured`` artifacts under each compile id, which tlparse renders.

Inspecting must never break training: a failure here warns with :class:`HotInspectionWarning` and the
compile goes on (``HotConfig(strict=True)`` raises instead).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import html
import json
import logging
import os
import pathlib
import re
import threading
import warnings
from typing import Callable, Iterator, TypeVar

import networkx as nx
import torch
import torch.fx as fx
from torch._logging import getArtifactLogger, trace_structured
from torch._logging._internal import LazyString, log_state, register_artifact, register_log, trace_log

from .config import HotConfig
from .passes.provenance import META_KEY
from .passes.rewrite_grad_input import REWRITE as HQ
from .passes.rewrite_grad_weight import COMPRESS, REWRITE as HLA
from .report import Report

__all__ = [
    "DUMP_FILES",
    "HotInspectionWarning",
    "InspectedGraph",
    "JointGraphInspection",
    "backward_picture",
    "collect",
    "dump_folder_name",
    "graph_source",
    "inspection_requested",
    "record_partition",
    "report_json",
    "report_markdown",
    "summary",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

# "hot_compile" as a log name of torch._logging, so that set_logs(modules={"hot_decisions": True})
# alone finds a handler; TORCH_LOGS="+hot_compile" also works without it (an importable module).
register_log("hot_compile", "hot_compile")
register_artifact(
    "hot_decisions", "The HOT pass's decision for every linear product site, per graph", off_by_default=True
)
register_artifact(
    "hot_graphs",
    "Joint graph before and after the HOT pass, and the partitioned forward/backward graphs",
    off_by_default=True,
)
decisions_log = getArtifactLogger(__name__, "hot_decisions")
graphs_log = getArtifactLogger(__name__, "hot_graphs")

JOINT_BEFORE = "joint_before.py"
JOINT_AFTER = "joint_after.py"
REPORT_MD = "report.md"
REPORT_JSON = "report.json"
PICTURE = "backward.svg"
# What a dump folder holds after a training step compiled through backend="hot"; "inference.py"
# takes the place of forward/backward for a graph compiled without autograd.
DUMP_FILES = (JOINT_BEFORE, JOINT_AFTER, "forward.py", "backward.py", REPORT_MD, REPORT_JSON, PICTURE)
NO_COMPILE_ID = "no_compile_id"


class HotInspectionWarning(UserWarning):
    """A dump, log or trace of the HOT pass could not be produced; compiling went on."""


# ---------------------------------------------------------------------------------------------------
# Who is watching


@dataclasses.dataclass(frozen=True)
class InspectedGraph:
    """One run of the HOT pass, as :func:`collect` hands it out."""

    graph: str  # the compile id, e.g. "0/0"
    report: Report | None  # None when the pass failed
    error: str | None
    dump: pathlib.Path | None  # the dump folder, when one was written


_collect_lock = threading.Lock()
_collectors: list[list[InspectedGraph]] = []


@contextlib.contextmanager
def collect() -> Iterator[list[InspectedGraph]]:
    """Every graph the HOT pass runs on while the block is active, in compile order.

    While collecting, the pass bypasses the compile caches (see :func:`inspection_requested`), so a
    graph served from a cache still shows up."""
    seen: list[InspectedGraph] = []
    with _collect_lock:
        _collectors.append(seen)
    try:
        yield seen
    finally:
        with _collect_lock:
            _collectors.remove(seen)


def _module_log_requested() -> bool:
    # Set explicitly (TORCH_LOGS="hot_compile", set_logs, or setLevel): a level inherited from the
    # root logger (logging.basicConfig) is not a request to see the pass.
    level = logging.getLogger("hot_compile").level
    return logging.NOTSET < level <= logging.INFO


def _graphs_wanted(config: HotConfig) -> bool:
    return bool(config.dump_dir) or log_state.is_artifact_enabled("hot_graphs") or bool(trace_log.handlers)


def inspection_requested(config: HotConfig) -> bool:
    """Whether anyone asked to see the pass's work: a dump folder, the HOT log or its artifacts, or an
    active :func:`collect`. A cache hit skips the pass and would hide its work, so the pass bypasses
    the FX-graph and AOTAutograd caches while this holds (TORCH_TRACE alone does not count: tracing
    is often on in production, where caches matter)."""
    return bool(
        config.dump_dir
        or _collectors
        or _module_log_requested()
        or log_state.is_artifact_enabled("hot_decisions")
        or log_state.is_artifact_enabled("hot_graphs")
    )


# ---------------------------------------------------------------------------------------------------
# Rendering


def _graph_name(compile_id: object | None) -> str:
    return str(compile_id) if compile_id is not None else NO_COMPILE_ID


def dump_folder_name(compile_id: object | None) -> str:
    """A folder name for a compile id: ``0/1`` → ``0_1``; compiled autograd's ``!2/0/1`` → ``ca2_0_1``."""
    if compile_id is None:
        return NO_COMPILE_ID
    return re.sub(r"[^0-9A-Za-z]+", "_", str(compile_id).replace("!", "ca")).strip("_")


def graph_source(graph: fx.Graph) -> str:
    """``graph`` as readable Python: FakeTensor dtype/shape/stride/device annotations, ``# File:`` comments
    with the user's source line, and the HOT provenance of every node the pass created."""
    owner = graph.owning_module
    if owner is not None and owner.graph is graph:
        return owner.print_readable(
            print_output=False, include_stride=True, include_device=True, additional_meta=[META_KEY]
        )
    code = graph.python_code("self", verbose=True, include_stride=True, include_device=True, additional_meta=[META_KEY])
    return code.src


def summary(report: Report) -> str:
    """One line: how many sites, how many rewritten by which rewrite, how many kept."""
    decisions = collections.Counter(row.decision for row in report.rows)
    rewritten = sum(n for d, n in decisions.items() if d != "kept")
    detail = ", ".join(f"{n} {d}" for d, n in sorted(decisions.items()) if d != "kept")
    return (
        f"{len(report.rows)} linear product site(s): {rewritten} rewritten"
        + (f" ({detail})" if detail else "")
        + f", {decisions.get('kept', 0)} kept"
    )


def _rewrites(graph: fx.Graph) -> dict[tuple[str, str, str, str], list[fx.Node]]:
    """The nodes the pass created, by (rewrite, module, path, name of the node they stand in for)."""
    groups: dict[tuple[str, str, str, str], list[fx.Node]] = collections.defaultdict(list)
    for node in graph.nodes:
        if META_KEY in node.meta:
            info = node.meta[META_KEY]
            groups[(info["rewrite"], info["module"], info["path"], info["replaces"])].append(node)
    return groups


def report_markdown(name: str, config: HotConfig, report: Report | None, error: str | None, graph: fx.Graph) -> str:
    """The dump's ``report.md``: the summary and per-site table (or the pass's error), the rewrites in
    ``graph`` with their node counts, and the settings."""
    lines = [f"# HOT pass on graph {name}", ""]
    if report is None:
        lines += [f"The pass failed and left the graph unchanged: {error}", ""]
    else:
        names, rows = report.cells()
        lines += [summary(report) + ".", ""]
        lines += ["| " + " | ".join(n.replace("_", " ") for n in names) + " |", "|" + "---|" * len(names)]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
        lines.append("")
    rewrites = _rewrites(graph)
    if rewrites:
        lines += ["## Nodes the pass created", ""]
        lines += ["| rewrite | module | path | stands in for | nodes |", "|---|---|---|---|---|"]
        lines += [f"| {r} | {m or '(root)'} | {p} | `{rep}` | {len(ns)} |" for (r, m, p, rep), ns in rewrites.items()]
        lines += ["", f"Each carries `node.meta[{META_KEY!r}]`; the graph files show it as a `# {META_KEY}:` comment."]
        lines.append("")
    lines += ["## Settings", "", f"`{config!r}`", ""]
    return "\n".join(lines)


def report_json(name: str, config: HotConfig, report: Report | None, error: str | None, graph: fx.Graph) -> str:
    """The dump's ``report.json``: the rows as ``SiteRow.as_dict()``, the error, the nodes of every
    rewrite in ``graph``, and the settings."""
    rewrites = [
        {"rewrite": r, "module": m, "path": p, "replaces": rep, "nodes": [n.name for n in ns]}
        for (r, m, p, rep), ns in _rewrites(graph).items()
    ]
    return json.dumps(
        {
            "graph": name,
            "error": error,
            "rows": [row.as_dict() for row in report.rows] if report else [],
            "rewrites": rewrites,
            "config": dataclasses.asdict(config),
        },
        indent=2,
        default=str,
    )


# ---------------------------------------------------------------------------------------------------
# The picture of the backward region

_REWRITE_COLORS = {HQ: "#f4a261", HLA: "#2a9d8f", COMPRESS: "#8ab17d"}
_FLOAT_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default}
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


# ---------------------------------------------------------------------------------------------------
# Writing


def _write(folder: pathlib.Path, name: str, text: str) -> None:
    """Write ``folder/name`` unless it already holds ``text`` (tools watching the folder, and make-like
    diffs of two runs, then see only what changed); atomically, so a reader never sees half a file."""
    path = folder / name
    try:
        if path.read_text(encoding="utf-8") == text:
            return
    except FileNotFoundError:
        pass
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{name}.{os.getpid()}.{threading.get_ident()}.tmp"
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _guarded(what: str, name: str, strict: bool, fn: Callable[[], T]) -> T | None:
    """``fn()``, or None with a warning when it fails (raised instead when ``strict``)."""
    try:
        return fn()
    except Exception as exc:
        if strict:
            raise
        warnings.warn(
            f"hot_compile: could not {what} for graph {name} ({type(exc).__name__}: {exc}); compiling goes on",
            HotInspectionWarning,
            stacklevel=3,
        )
        return None


def _trace_graph(artifact: str, text: str) -> None:
    trace_structured("artifact", metadata_fn=lambda: {"name": artifact, "encoding": "string"}, payload_fn=lambda: text)


class JointGraphInspection:
    """Shows one run of the HOT pass on one joint graph: create it before the pass (it snapshots the
    graph's source while it is still unchanged, when anyone will look at it), call :meth:`finish`
    after."""

    def __init__(self, graph: fx.Graph, config: HotConfig, compile_id: object | None):
        self.config = config
        self.name = _graph_name(compile_id)
        self.folder = pathlib.Path(config.dump_dir) / dump_folder_name(compile_id) if config.dump_dir else None
        self.before: str | None = None
        if _graphs_wanted(config):
            self.before = _guarded("render the joint graph", self.name, config.strict, lambda: graph_source(graph))

    def finish(self, graph: fx.Graph, report: Report | None = None, error: BaseException | None = None) -> None:
        """Log, trace and dump the outcome: ``report`` after a successful pass, ``error`` after a failed
        one (then nothing here raises, so the pass's own error is the one that surfaces)."""
        message = None if error is None else f"{type(error).__name__}: {error}"
        strict = self.config.strict and error is None
        _guarded("log the HOT decisions", self.name, strict, lambda: self._log(report, message))
        after = None
        if self.before is not None:
            after = _guarded("show the joint graphs", self.name, strict, lambda: self._show_graphs(graph))
        written = None
        if self.folder is not None:
            write = functools.partial(self._dump, graph, after, report, message)
            written = _guarded(f"write the HOT dump to {self.folder}", self.name, strict, write)
        with _collect_lock:
            for seen in _collectors:
                seen.append(InspectedGraph(self.name, report, message, written))

    def _log(self, report: Report | None, error: str | None) -> None:
        # torch's log formatter prefixes each line with the compile id ("[0/0]"), so lines omit it.
        if report is None:
            log.info("HOT pass failed and left the graph unchanged (%s)", error)
            return
        log.info("HOT pass: %s", LazyString(summary, report))
        for row in report.rows:
            log.debug(
                "HOT site %s %s %s %s: %s, numerics %s (why: %s)",
                row.module or "(root)", row.path, row.shape, row.dtype, row.decision, row.numerics, row.reason,
            )  # fmt: skip
        decisions_log.debug("%s", LazyString(report.table))
        trace_structured(
            "artifact",
            metadata_fn=lambda: {"name": "hot_decisions", "encoding": "json"},
            payload_fn=lambda: {"graph": self.name, "rows": [row.as_dict() for row in report.rows]},
        )

    def _show_graphs(self, graph: fx.Graph) -> str:
        after = graph_source(graph)
        graphs_log.debug("HOT joint graph before the pass:\n%s", self.before)
        graphs_log.debug("HOT joint graph after the pass:\n%s", after)
        _trace_graph("hot_joint_graph_before", self.before)
        _trace_graph("hot_joint_graph_after", after)
        return after

    def _dump(self, graph: fx.Graph, after: str | None, report: Report | None, error: str | None) -> pathlib.Path:
        folder = self.folder
        if self.before is not None:
            _write(folder, JOINT_BEFORE, self.before)
        _write(folder, JOINT_AFTER, after if after is not None else graph_source(graph))
        _write(folder, REPORT_MD, report_markdown(self.name, self.config, report, error, graph))
        _write(folder, REPORT_JSON, report_json(self.name, self.config, report, error, graph))
        _write(folder, PICTURE, backward_picture(graph, f"HOT backward region of graph {self.name}"))
        log.info("HOT dump in %s", folder)
        return folder


def record_partition(gm: fx.GraphModule, config: HotConfig, kind: str) -> None:
    """Show a graph the partitioner produced (``kind``: "forward", "backward" or "inference") in the
    dump folder of the current compile id, the ``hot_graphs`` log and the trace."""
    if not _graphs_wanted(config):
        return
    compile_id = torch._guards.CompileContext.current_compile_id()

    def show() -> None:
        text = graph_source(gm.graph)
        graphs_log.debug("HOT %s graph:\n%s", kind, text)
        _trace_graph(f"hot_{kind}_graph", text)
        if config.dump_dir:
            _write(pathlib.Path(config.dump_dir) / dump_folder_name(compile_id), f"{kind}.py", text)

    _guarded(f"show the {kind} graph", _graph_name(compile_id), config.strict, show)
