"""The report of the most recently compiled graph, and the reports kept beside Inductor's caches for
graphs that a cache hit serves without running the pass."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import threading

from ..passes.report import Report

_lock = threading.Lock()
_last: Report | None = None
_published = 0


def publish(report: Report | None) -> None:
    global _last, _published
    with _lock:
        _last = report
        _published += 1


def publications() -> int:
    """How many reports this process has published (a compile that publishes none was a cache hit)."""
    with _lock:
        return _published


def last_report() -> Report | None:
    """The report of the most recently compiled graph in this process (None before any).

    A graph served from the FX-graph or AOTAutograd cache skips the pass; its report is the one the
    pass wrote when it compiled that graph (see :func:`remember`), or None if there is none on disk.
    """
    with _lock:
        return _last


def _store(key: str) -> pathlib.Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return pathlib.Path(cache_dir()) / "hot_reports" / f"{key}.json"


def remember(key: str, report: Report) -> None:
    """Keep ``report`` beside Inductor's caches, for a later cache hit on the same graph."""
    path = _store(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(report.to_json())
    os.replace(tmp, path)  # atomic: concurrent compiles (one per rank) may write the same key


def recall(key: str, graph: str) -> Report | None:
    """The report :func:`remember` kept under ``key``, renamed to this compile's ``graph``."""
    try:
        report = Report.from_json(_store(key).read_text())
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return dataclasses.replace(report, graph=graph)
