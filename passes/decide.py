"""Profitability: given a legal site, rewrite it or keep it, and say why.

The decision applies the site's policy (after per-module overrides) to the cost model's estimates.
"""

from __future__ import annotations

import dataclasses

from ..config import HotConfig
from .cost_model import SiteCost

# Below this many multiply-adds a HOT variant is dominated by its fixed per-call costs; the reason
# of a kept site says so.
TINY_MNK = 1 << 20


@dataclasses.dataclass(frozen=True)
class Decision:
    rewrite: bool
    reason: str


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**14 else f"{n} B"


def _estimate(cost: SiteCost) -> str:
    ratio = cost.speedup
    verdict = f"{ratio:.2f}× faster" if ratio >= 1 else f"{1 / ratio:.2f}× slower"
    return f"est. {verdict} ({cost.hot_s * 1e3:.3g} ms vs {cost.original_s * 1e3:.3g} ms)"


def why_not_selected(module_path: str, path: str, config: HotConfig, loss_head: bool) -> str | None:
    """The reason ``config`` (resolved for ``module_path``) leaves the ``path`` site alone whatever it
    costs, or None: the filters that need no estimate, checked before the cost model runs."""
    if config.policy == "off":
        return "policy='off'"
    if path != "fwd" and not (config.rewrite_gx if path == "gx" else config.rewrite_gw):
        return f"rewrite_{path}=False"
    if not config.selects(module_path):
        return "excluded by include/exclude globs"
    if loss_head and config.exact_loss_head:
        return (
            "kept exact: the output feeds a softmax cross-entropy, whose gradient (softmax minus one-hot) "
            "is a few spikes per row that every layer below inherits (exact_loss_head=True)"
        )
    return None


def decide(path: str, mnk: int, cost: SiteCost, config: HotConfig) -> Decision:
    """Rewrite or keep a ``path`` ("fwd"/"gx"/"gw") site under ``config`` (already resolved for its module and
    passed by :func:`why_not_selected`), given its ``M·N·K`` and cost estimate."""
    estimate = _estimate(cost)
    saving = ""
    if path == "gw" and cost.saved_bytes_before is not None:
        saving = f"; ABC saves {_mib(cost.saved_bytes_before - cost.saved_bytes_after)}"
    faster = cost.hot_s < cost.original_s
    tiny = f"M·N·K = {mnk:.3g} below {TINY_MNK:.3g}, fixed costs dominate; " if mnk < TINY_MNK and not faster else ""

    if config.policy == "hot":
        return Decision(True, f"policy='hot': {estimate}{saving}")
    if config.policy == "memory" and path == "gw":
        return Decision(True, f"policy='memory': {estimate}{saving}")
    if config.policy in ("speed", "memory"):
        if faster:
            return Decision(True, f"rewritten: {estimate}{saving}")
        return Decision(False, f"kept: {tiny}{estimate}")
    # balanced
    bound = 1 + config.max_slowdown
    if cost.hot_s <= bound * cost.original_s:
        return Decision(True, f"rewritten: {estimate}, within max_slowdown={config.max_slowdown:g}{saving}")
    return Decision(False, f"kept: {tiny}{estimate}, over max_slowdown={config.max_slowdown:g}")
