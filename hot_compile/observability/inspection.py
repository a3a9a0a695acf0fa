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
import json
import logging
import os
import pathlib
import re
import threading
import warnings
from typing import Callable, Iterator, TypeVar

import torch
import torch.fx as fx
from torch._logging import getArtifactLogger, trace_structured
from torch._logging._internal import LazyString, log_state, register_artifact, register_log, trace_log

from ..config import HotConfig
from ..passes.provenance import META_KEY
from ..passes.report import PRODUCT_PATHS, Report
from .picture import backward_picture

__all__ = [
    "DUMP_FILES",
    "HotInspectionWarning",
    "InspectedGraph",
    "JointGraphInspection",
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


# The kinds of rows a report holds, as the summary names them; products are always counted.
_ROW_KINDS = (("linear product site(s)", PRODUCT_PATHS), ("attention(s)", ("attn",)), ("saved value(s)", ("saved",)))


def summary(report: Report) -> str:
    """One line: per kind of site, how many, how many rewritten by which rewrite, how many kept."""
    parts = []
    for noun, paths in _ROW_KINDS:
        rows = [row for row in report.rows if row.path in paths]
        if not rows and paths is not PRODUCT_PATHS:
            continue
        decisions = collections.Counter(row.decision for row in rows)
        rewritten = sum(n for d, n in decisions.items() if d != "kept")
        detail = ", ".join(f"{n} {d}" for d, n in sorted(decisions.items()) if d != "kept")
        parts.append(f"{len(rows)} {noun}: {rewritten} rewritten" + (f" ({detail})" if detail else "") + f", {decisions.get('kept', 0)} kept")
    return "; ".join(parts)


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
