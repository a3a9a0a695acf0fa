"""Profitability: given a legal site, rewrite it or keep it, and say why."""

from __future__ import annotations

import dataclasses

from ..config import HotConfig


@dataclasses.dataclass(frozen=True)
class Decision:
    rewrite: bool
    reason: str


def decide(module_path: str, path: str, config: HotConfig) -> Decision:
    if config.policy == "off":
        return Decision(False, "policy='off'")
    if not (config.rewrite_gx if path == "gx" else config.rewrite_gw):
        return Decision(False, f"rewrite_{path}=False")
    if not config.selects(module_path):
        return Decision(False, "excluded by include/exclude globs")
    return Decision(True, "policy='hot': the paper's recipe")
