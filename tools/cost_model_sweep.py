"""How often does the cost model pick the faster variant? A sweep over linear-layer shapes.

For each shape ``(L, N, K)`` (tokens, out_features, in_features: the cost model's order) a fresh ``nn.Linear`` is compiled
twice in one process — ``backend="inductor"`` and ``backend="hot"`` with ``policy="hot"`` (rewrite
forced) — and a training step (forward, which holds the ABC compression, plus backward) is timed
with the variants interleaved. The cost model's prediction for the layer is its sites summed: the
forward where the default ``forward_bits`` rewrites it, grad_input and grad_weight; the choice is
right when "HOT is faster" agrees with the measured medians. The tool also counts the default
policy's decisions, site by site (``balanced`` gives only grad_weight, which saves memory, up to
``max_slowdown`` past the estimate's break-even).

    python tools/cost_model_sweep.py --out sweep.json           # 36 shapes, this machine's profile
    python tools/cost_model_sweep.py --quick                    # 6 shapes, for a smoke run
"""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib

import torch

import hot_compile
from hot_compile import HotConfig
from hot_compile.device_calibration import layer_site_costs, layer_step_seconds
from hot_compile.passes.decide import decide
from hot_compile.runtime import devices

TOKENS = (64, 512, 2048, 6272)
# (in_features, out_features)
FEATURES = ((64, 64), (256, 256), (384, 1536), (768, 768), (768, 3072), (3072, 768), (1024, 4096), (128, 2048), (2048, 128))


def predict(l: int, n: int, k: int, profile: devices.DeviceProfile) -> tuple[float, float]:
    """Estimated seconds (original, HOT) of one linear layer's step: its sites summed."""
    sites = layer_site_costs(l, n, k, profile).values()
    return sum(c.original_s for c in sites), sum(c.hot_s for c in sites)


def default_policy_agreement(rows: list[dict], profile: devices.DeviceProfile) -> tuple[int, int]:
    """How the default policy's per-site decisions compare with the measured faster variant, counted
    over the shapes where it rewrites all of a layer's sites or none (the two variants measured):
    (agreeing shapes, shapes where it rewrites only some)."""
    config = HotConfig()
    agree = partial = 0
    for r in rows:
        sites = layer_site_costs(r["L"], r["N"], r["K"], profile)
        rewrites = {decide(path, r["L"] * r["N"] * r["K"], cost, config).rewrite for path, cost in sites.items()}
        if len(rewrites) > 1:
            partial += 1
        else:
            agree += rewrites.pop() == (r["hot_ms"] < r["inductor_ms"])
    return agree, partial


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--profile", default="auto", help="device profile name (default: this machine's)")
    parser.add_argument("--quick", action="store_true", help="6 shapes instead of 36")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args(argv)

    profile = devices.resolve_profile(torch.device("cpu"), args.profile)
    shapes = [(l, n, k) for l, (k, n) in itertools.product(TOKENS, FEATURES)]
    if args.quick:
        shapes = shapes[::6]
    print(f"profile {profile.name}, torch {torch.__version__}, {torch.get_num_threads()} threads, hot-compile {hot_compile.__version__}")
    print("| L | N | K | est. orig ms | est. HOT ms | inductor ms | hot ms | measured hot/inductor | model right |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for l, n, k in shapes:
        est_orig, est_hot = predict(l, n, k, profile)
        ind, hot = layer_step_seconds(l, n, k, args.repeats)
        right = (est_hot < est_orig) == (hot < ind)
        rows.append(dict(L=l, N=n, K=k, est_original_ms=est_orig * 1e3, est_hot_ms=est_hot * 1e3,
                         inductor_ms=ind * 1e3, hot_ms=hot * 1e3, right=right))  # fmt: skip
        print(f"| {l} | {n} | {k} | {est_orig * 1e3:.3g} | {est_hot * 1e3:.3g} | {ind * 1e3:.3g} | {hot * 1e3:.3g} "
              f"| {hot / ind:.2f} | {'yes' if right else 'NO'} |", flush=True)  # fmt: skip
    agreement = sum(r["right"] for r in rows) / len(rows)
    print(f"\ncost model chose the faster variant for {sum(r['right'] for r in rows)}/{len(rows)} shapes ({agreement:.0%})")
    agree, partial = default_policy_agreement(rows, profile)
    print(
        f"the default policy's decisions: the faster variant for {agree}/{len(rows)} shapes, "
        f"{partial} shape(s) rewritten in part (not measured)"
    )
    if args.out:
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"profile": json.loads(profile.to_json()), "rows": rows, "agreement": agreement}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
