"""Side-by-side CUDA benchmark: inductor vs hot, fp32 and bf16 autocast, CUDA-event timing.

Models: the ViT-B MLP block (768→3072→GELU→768) and a ViT-B-sized linear stack (4 × 768→768 with
GELU), both at L = 6272 tokens ([32, 196, 768]). Per variant: median fwd+bwd and backward-alone
milliseconds over ``--iters`` steps after warm-up (inputs rotated among 4 buffers), bytes saved for
backward (saved_tensors_hooks, dedup by storage, parameters excluded), peak allocated memory, and
the max per-parameter gradient error vs fp64. Prints a Markdown table; writes JSON and the table
under ``--out``.

    python tools/gpu_bench.py --out "$OUT"
"""

from __future__ import annotations

import argparse
import copy
import json
import pathlib
import statistics

import torch
import torch.nn as nn
import torch.nn.functional as F

from hot_compile.harness.models import MLP
from hot_compile.observability.memory import saved_for_backward_bytes


class LinearStack(nn.Module):
    def __init__(self, dim=768, depth=4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = F.gelu(layer(x))
        return x


def run_variant(model, backend, dtype, xs, grad, iters):
    compiled = torch.compile(model, backend=backend, options={"policy": "hot"} if backend == "hot" else None)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == "bf16")

    def forward(x):
        with autocast:
            return compiled(x).float()

    for i in range(3):
        forward(xs[i % len(xs)]).backward(grad)
    torch.cuda.synchronize()
    step, bwd = [], []
    for i in range(iters):
        x = xs[i % len(xs)]
        start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        start.record()
        out = forward(x)
        mid.record()
        out.backward(grad)
        end.record()
        torch.cuda.synchronize()
        step.append(start.elapsed_time(end))
        bwd.append(mid.elapsed_time(end))
    torch.cuda.reset_peak_memory_stats()
    saved = saved_for_backward_bytes(lambda: forward(xs[0]).backward(grad), model.parameters())
    peak = torch.cuda.max_memory_allocated()
    model.zero_grad()
    forward(xs[0]).backward(grad)
    reference = copy.deepcopy(model).double()
    reference.zero_grad()
    reference(xs[0].double()).backward(grad.double())
    ref = dict(reference.named_parameters())
    err = max(
        ((p.grad.double() - ref[n].grad).norm() / ref[n].grad.norm()).item() for n, p in model.named_parameters()
    )
    torch._dynamo.reset()
    return {"step_ms": statistics.median(step), "bwd_ms": statistics.median(bwd), "saved_bytes": saved,
            "peak_bytes": peak, "grad_err": err}  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=196)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    rows = []
    for name, factory in (("vit-b mlp block", lambda: MLP(768, 3072)), ("vit-b linear stack", LinearStack)):
        model = factory().cuda()
        xs = [torch.randn(args.batch, args.tokens, 768, device="cuda") for _ in range(4)]
        grad = torch.randn(args.batch, args.tokens, 768, device="cuda") / 100
        for dtype in ("fp32", "bf16"):
            results = {b: run_variant(model, b, dtype, xs, grad, args.iters) for b in ("inductor", "hot")}
            ind, hot = results["inductor"], results["hot"]
            rows.append({"model": name, "dtype": dtype, **{f"{b}_{k}": v for b, r in results.items() for k, v in r.items()}})
            print(f"{name} {dtype}: bwd hot/inductor {hot['bwd_ms'] / ind['bwd_ms']:.2f}", flush=True)
    lines = [
        "| model | dtype | inductor bwd ms | hot bwd ms | bwd ratio | step ratio | saved MiB ind → hot | peak MiB ind → hot | hot grad err |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['dtype']} | {r['inductor_bwd_ms']:.2f} | {r['hot_bwd_ms']:.2f} "
            f"| {r['hot_bwd_ms'] / r['inductor_bwd_ms']:.2f} | {r['hot_step_ms'] / r['inductor_step_ms']:.2f} "
            f"| {r['inductor_saved_bytes'] / 2**20:.0f} → {r['hot_saved_bytes'] / 2**20:.0f} "
            f"| {r['inductor_peak_bytes'] / 2**20:.0f} → {r['hot_peak_bytes'] / 2**20:.0f} | {r['hot_grad_err']:.3f} |"
        )
    table = "\n".join([f"{torch.cuda.get_device_name()}, torch {torch.__version__}", "", *lines])
    print(table)
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_bench.md").write_text(table + "\n")
        (out / "gpu_bench.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
