"""Seeded test data: Gaussian, heavy-tailed, outlier-channel and token-smooth tensors."""

import torch

KINDS = ("gaussian", "lognormal", "outlier")


def make(kind: str, rows: int, cols: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    if kind == "gaussian":
        out = base
    elif kind == "lognormal":
        out = base.exp() * torch.randn(rows, cols, generator=gen, dtype=torch.float64).sign()
    elif kind == "outlier":
        out = base.clone()
        out[:, ::37] *= 50.0  # a few channels 50× larger, as in transformer activations and grads
    elif kind == "smooth":
        # Slowly varying along rows (tokens): a few low-frequency components plus small noise.
        t = torch.arange(rows, dtype=torch.float64)[:, None] / rows
        freq = torch.randint(1, 4, (1, cols), generator=gen).double()
        phase = torch.rand(1, cols, generator=gen, dtype=torch.float64) * 6.28
        out = torch.sin(6.28 * freq * t + phase) + 0.02 * base
    else:
        raise ValueError(kind)
    return out.to(dtype)


def rel_err(approx: torch.Tensor, exact: torch.Tensor) -> float:
    exact = exact.double()
    return ((approx.double() - exact).norm() / exact.norm()).item()
