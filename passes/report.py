"""The HOT pass's output: one row per linear product it considered, and the report of one graph."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Iterator


PRODUCT_PATHS = ("fwd", "gx", "gw")


@dataclasses.dataclass(frozen=True)
class SiteRow:
    """One product site of one layer: a linear's or a convolution's (forward, grad_input,
    grad_weight), an attention's backward (path ``"attn"``, :mod:`.attention_precision`), or a value
    the forward saves for the backward (path ``"saved"``, :mod:`.saved_activations`).

    ``numerics`` names what a rewritten site computes: ``INT8 g per_token, W per_channel`` for HQ,
    ``INT8 rank 16 per_channel`` for HLA, each choice followed by its source where it is not the
    config's own value (``auto: device``, ``plan``, ``override``).

    ``saved_bytes_before``/``after`` are the bytes the backward keeps of this layer's input activation:
    ``x`` itself before, the int8 low-rank ``P_L x`` plus its scale after (the same compressed buffer is
    counted on every row that shares it). ``est_*_ms`` are the cost model's estimates of the original
    product and of its HOT variant. Sizes under dynamic shapes use their size hints.
    """

    module: str
    path: str  # "gx" (grad_input), "gw" (grad_weight), "fwd" (the forward, HotConfig.forward_bits), "attn", "saved"
    shape: str  # "L×N @ N×K" for gx, "N×L @ L×K" for gw
    dtype: str
    decision: str  # "HQ", "HLA+ABC", "float32" (an attention backward), "int8" or "f' 4-bit" (a saved value), "kept"
    reason: str
    saved_bytes_before: int | None = None
    saved_bytes_after: int | None = None
    est_original_ms: float | None = None
    est_hot_ms: float | None = None
    # The numerics of a rewritten site (bits, scales, rank) and where each choice came from.
    numerics: str = "-"

    @property
    def est_ms(self) -> float | None:
        """The estimate of what runs: HOT's variant where the site was rewritten, else the original."""
        return self.est_original_ms if self.decision == "kept" else self.est_hot_ms

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_COLUMNS = (
    "module", "path", "shape", "dtype", "decision", "est_original_ms", "est_hot_ms",
    "saved_bytes_before", "saved_bytes_after", "numerics", "reason",
)  # fmt: skip
_HEADERS = (
    "module", "path", "shape", "dtype", "decision", "est. orig", "est. HOT", "saved before", "saved after",
    "numerics", "why",
)  # fmt: skip


def _fmt_cell(column: str, value) -> str:
    if column.startswith("saved"):
        return _fmt_bytes(value)
    if column.startswith("est"):
        return "-" if value is None else f"{value:.3g} ms"
    if column == "module" and value == "":
        return "(root)"  # a linear called in the compiled module's own forward
    return str(value)


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


@dataclasses.dataclass
class Report:
    """The rows of one compiled graph, in graph order."""

    graph: str
    rows: list[SiteRow] = dataclasses.field(default_factory=list)

    def __iter__(self) -> Iterator[SiteRow]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def select(self, *, path: str | None = None, decision: str | None = None) -> list[SiteRow]:
        return [r for r in self.rows if (path is None or r.path == path) and (decision is None or r.decision == decision)]

    def products(self) -> list[SiteRow]:
        """The rows of linear and convolution products (paths ``fwd``, ``gx``, ``gw``)."""
        return [r for r in self.rows if r.path in PRODUCT_PATHS]

    def rewritten(self) -> list[SiteRow]:
        """The rows whose product the pass replaced (HQ or HLA+ABC)."""
        return [r for r in self.products() if r.decision != "kept"]

    def cells(self) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
        """Column headers and the formatted cells of every row (for text, Markdown or rich tables)."""
        return _HEADERS, [tuple(_fmt_cell(c, getattr(r, c)) for c in _COLUMNS) for r in self.rows]

    def table(self) -> str:
        """A plain-text table, one line per site."""
        headers, rows = self.cells()
        cells = [headers, *rows]
        widths = [max(len(row[i]) for row in cells) for i in range(len(_HEADERS))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return f"HOT report for graph {self.graph}\n" + "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps({"graph": self.graph, "rows": [r.as_dict() for r in self.rows]}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> Report:
        data = json.loads(text)
        return cls(data["graph"], [SiteRow(**row) for row in data["rows"]])
