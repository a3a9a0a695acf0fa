"""Plain float64 reference implementations of the HOT numerics, for tests.

Built independently of the fast path: matrices come from the Sylvester recursion and an explicit
sequency sort, transforms are dense matmuls with ``kron(I, basis)``, and quantizers are the textbook
formulas. Only the stochastic-rounding noise is shared with the fast path (:func:`hash_uniform`), so
both can be compared draw for draw.
"""

from __future__ import annotations

import torch

from hot_compile.plan import PAPER_RANK
from hot_compile.runtime.aten_impl import SALT_GRAD_INPUT, SALT_GRAD_WEIGHT, SALT_WEIGHT
from hot_compile.runtime.hadamard import BLOCK
from hot_compile.runtime.quant import SAWB_C1, SAWB_C2, hash_uniform, qmax

F64 = torch.float64


def sylvester_hadamard(order: int = BLOCK) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=F64)
    while h.shape[0] < order:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def sequency_sorted_rows(rank: int, order: int = BLOCK) -> torch.Tensor:
    h = sylvester_hadamard(order)
    changes = [(int((h[i, 1:] != h[i, :-1]).sum()), i) for i in range(order)]
    return h[[i for _, i in sorted(changes)[:rank]]]


def lowpass_matrix(n: int, rank: int) -> torch.Tensor:
    """HLA's ``P_L`` for length ``n``: block-diagonal over parts of 16, then the powers of two of
    ``n mod 16``, largest first; a part of length ``q`` keeps its ``⌊rank·q/16⌋`` lowest-sequency
    Hadamard rows, times ``√(16/q)``."""
    parts = [BLOCK] * (n // BLOCK) + [q for q in (8, 4, 2, 1) if n % BLOCK & q]
    blocks = [sequency_sorted_rows(rank * q // BLOCK, q) * (BLOCK / q) ** 0.5 for q in parts]
    return torch.block_diag(*blocks)


def block_matrix(n: int, basis: torch.Tensor) -> torch.Tensor:
    """``blockdiag(basis, basis, …)`` acting on a length-``n`` vector: ``[r·⌈n/16⌉, n]`` (the
    columns of the zero padding dropped)."""
    blocks = -(-n // BLOCK)
    return torch.kron(torch.eye(blocks, dtype=F64), basis.to(F64))[:, :n]


def block_transform(x: torch.Tensor, basis: torch.Tensor, dim: int) -> torch.Tensor:
    xm = x.to(F64).movedim(dim, -1)
    return (xm @ block_matrix(xm.shape[-1], basis).T).movedim(-1, dim)


def _amax(v: torch.Tensor, dim: int | None) -> torch.Tensor:
    return v.abs().amax() if dim is None else v.abs().amax(dim, keepdim=True)


def stochastic(v: torch.Tensor, bits: int, noise: torch.Tensor, dim: int | None = None):
    """Stochastic rounding at the max scale, over the whole tensor or over ``dim`` (one scale per
    slice across it)."""
    qm = qmax(bits)
    v = v.to(F64)
    amax = _amax(v, dim)
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / qm)
    q = torch.sign(v) * torch.floor(v.abs() / scale + noise.to(F64))
    return q.clamp(-qm, qm), scale


def nearest(v: torch.Tensor, bits: int, dim: int | None = None):
    qm = qmax(bits)
    v = v.to(F64)
    amax = _amax(v, dim)
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / qm)
    return torch.round(v / scale).clamp(-qm, qm), scale


def sawb(v: torch.Tensor, bits: int):
    qm = qmax(bits)
    v = v.to(F64)
    amax = v.abs().amax()
    clip = SAWB_C1 * v.pow(2).mean().sqrt() - SAWB_C2 * v.abs().mean()
    clip = torch.where(clip > 0, torch.minimum(clip, amax), amax)
    scale = torch.where(clip == 0, torch.ones_like(clip), clip / qm)
    return torch.round(v / scale).clamp(-qm, qm), scale


def hq_grad_input(g, w, seed, *, grad_bits=8, weight_bits=8, per_token=True, weight_quantizer="per_channel"):
    n, k = w.shape
    gt = block_transform(g.reshape(-1, n), sylvester_hadamard(), 1)
    qg, sg = stochastic(gt, grad_bits, hash_uniform(gt, seed, SALT_GRAD_INPUT), -1 if per_token else None)
    wt = block_transform(w, sylvester_hadamard(), 0)
    if weight_quantizer == "sawb":
        qw, sw = sawb(wt, weight_bits)
    else:
        dim = 0 if weight_quantizer == "per_channel" else None
        qw, sw = stochastic(wt, weight_bits, hash_uniform(wt, seed, SALT_WEIGHT), dim)
    return ((qg @ qw) * sg * sw / BLOCK).reshape(*g.shape[:-1], k)


def lowpass(x: torch.Tensor, rank: int) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1]).to(F64)
    return lowpass_matrix(x2.shape[0], rank) @ x2


def compress_activation(x, *, rank=16, bits=8, per_channel=True):
    return nearest(lowpass(x, rank), bits, 0 if per_channel else None)


def hla_grad_weight(g, x_q, x_scale, seed, *, rank=16, bits=8, per_channel=True):
    pg = lowpass(g, rank)
    qg, sg = stochastic(pg, bits, hash_uniform(pg, seed, SALT_GRAD_WEIGHT), 0 if per_channel else None)
    return (qg.T @ x_q.to(F64)) * sg.t() * x_scale.to(F64) / BLOCK


def lowpass_product(g, x, rank=PAPER_RANK):
    """The unquantized HLA target ``(P_L g)ᵀ (P_L x) / 16``."""
    return lowpass(g, rank).T @ lowpass(x, rank) / BLOCK


def int8_linear(x, w, bias=None, *, bits=8):
    n, k = w.shape
    qx, sx = nearest(block_transform(x.reshape(-1, k).to(F64), sylvester_hadamard(), 1), bits, -1)
    qw, sw = nearest(block_transform(w.to(F64), sylvester_hadamard(), 1), bits, -1)
    out = (qx @ qw.T) * sx * sw.T / BLOCK
    if bias is not None:
        out = out + bias.to(F64)
    return out.reshape(*x.shape[:-1], n)
