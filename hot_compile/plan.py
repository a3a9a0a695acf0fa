"""A per-layer numerics plan (rank and HQ gradient quantizer per linear), as
:func:`hot_compile.select_quantizers` measures it and :class:`hot_compile.HotConfig` takes it: frozen,
hashable, with a deterministic ``repr`` (it is part of the compile cache key), saved and loaded as
JSON."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

QUANTIZERS = ("per_tensor", "per_token")
# The paper's HLA rank: 8 of each 16-token Walsh block.
PAPER_RANK = 8
# The largest error of a rank-8 product relative to the layer's mini-batch sampling spread: the cut
# then adds at most 1% to the mean squared error of that layer's gradient.
ERROR_BUDGET = 0.1
FORMAT_VERSION = 2


@dataclasses.dataclass(frozen=True)
class LayerChoice:
    """The numerics chosen for one linear and the calibration errors they were chosen on.

    ``rank`` is set only where the rank-8 error (``rank8_error``, relative to ``‖gᵀx‖``) is within
    ``ERROR_BUDGET`` of the sampling spread (``sampling_spread``, relative likewise); None leaves the
    config's rank.
    """

    module: str
    quantizer: str
    per_tensor_error: float
    per_token_error: float
    rank: int | None = None
    rank8_error: float | None = None
    sampling_spread: float | None = None

    def __post_init__(self) -> None:
        if self.quantizer not in QUANTIZERS:
            raise ValueError(f"LayerChoice.quantizer={self.quantizer!r}: accepted values are {QUANTIZERS}")
        if self.rank is not None and (type(self.rank) is not int or not 1 <= self.rank <= 16):
            raise ValueError(f"LayerChoice.rank={self.rank!r}: accepted values are None or an int in 1..16")


@dataclasses.dataclass(frozen=True)
class QuantizerPlan:
    """Per-layer HQ gradient quantizers, keyed by module path (``blocks.0.mlp.fc1``).

    ``source`` says where the plan came from (the calibration that made it). Layers are kept sorted
    by module path, so two plans with the same choices compare, hash and ``repr`` equal.
    """

    layers: tuple[LayerChoice, ...]
    source: str

    def __post_init__(self) -> None:
        layers = tuple(sorted(self.layers, key=lambda c: c.module))
        paths = [c.module for c in layers]
        duplicates = sorted({p for p in paths if paths.count(p) > 1})
        if duplicates:
            raise ValueError(f"QuantizerPlan lists module(s) {duplicates} more than once")
        object.__setattr__(self, "layers", layers)

    def quantizer_for(self, module_path: str) -> str | None:
        """``"per_tensor"`` or ``"per_token"`` for a calibrated layer; None for one the plan does not cover."""
        for choice in self.layers:
            if choice.module == module_path:
                return choice.quantizer
        return None

    def settings_for(self, module_path: str) -> dict[str, Any]:
        """The HotConfig settings the plan makes for ``module_path`` (``gx_quantizer``, and ``rank``
        where calibration found a lower rank within budget); empty for a layer it does not cover."""
        for choice in self.layers:
            if choice.module == module_path:
                return {"gx_quantizer": choice.quantizer, **({"rank": choice.rank} if choice.rank else {})}
        return {}

    def as_dict(self) -> dict[str, dict[str, Any]]:
        """Module path → its settings."""
        return {c.module: self.settings_for(c.module) for c in self.layers}

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": "hot_compile.QuantizerPlan",
                "version": FORMAT_VERSION,
                "source": self.source,
                "layers": [dataclasses.asdict(c) for c in self.layers],
            },
            indent=2,
        )

    @classmethod
    def from_json(cls, text: str) -> QuantizerPlan:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("format") != "hot_compile.QuantizerPlan":
            raise ValueError("not a hot_compile.QuantizerPlan JSON document")
        if data.get("version") not in (1, FORMAT_VERSION):  # version 1 had no rank fields
            raise ValueError(f"QuantizerPlan format version {data.get('version')!r}: this version reads {FORMAT_VERSION}")
        return cls(tuple(LayerChoice(**layer) for layer in data["layers"]), data["source"])

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> QuantizerPlan:
        with open(path, encoding="utf-8") as f:
            return cls.from_json(f.read())

    def table(self) -> str:
        width = max([len("module")] + [len(c.module) for c in self.layers])
        lines = [f"{'module'.ljust(width)}  quantizer   per-tensor err  per-token err  rank  rank-8 err  spread"]
        lines += [
            f"{c.module.ljust(width)}  {c.quantizer.ljust(10)}  {c.per_tensor_error:14.4g}  {c.per_token_error:13.4g}"
            f"  {str(c.rank or '-'):>4}  {_fmt(c.rank8_error):>10}  {_fmt(c.sampling_spread):>6}"
            for c in self.layers
        ]
        return f"QuantizerPlan ({self.source})\n" + "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"
