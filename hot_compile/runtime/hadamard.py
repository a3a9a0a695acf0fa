"""Block-16 Walsh–Hadamard transforms, the low-pass Walsh basis, and HLA's low-pass projection.

The ±1 matrices are built in-graph from ``arange`` and bit operations, so a traced function that uses
them carries no tensor constants and Inductor folds the entries into the consuming kernel. The one
exception, :func:`tail_basis`, depends on the length's remainder mod 16 and is built eagerly, to be
passed to compiled code as an input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 16
_BLOCK_BITS = 4  # BLOCK == 2 ** _BLOCK_BITS
_ORDERS = (1, 2, 4, 8, 16)


def _parity(v: torch.Tensor) -> torch.Tensor:
    """Parity of the low four bits of an integer tensor (popcount mod 2)."""
    v = v ^ (v >> 2)
    v = v ^ (v >> 1)
    return v & 1


def _sign_of_parity(rows: torch.Tensor, cols: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # Sylvester: H[i, j] = (-1) ** popcount(i & j)
    return (1 - 2 * _parity(rows.unsqueeze(-1) & cols)).to(dtype)


def hadamard_matrix(dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
    """The Sylvester Hadamard matrix of order 16: entries ±1, symmetric, ``H @ H.T == 16 * I``."""
    idx = torch.arange(BLOCK, device=device)
    return _sign_of_parity(idx, idx, dtype)


def walsh_basis(
    rank: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None, order: int = BLOCK
) -> torch.Tensor:
    """The ``rank`` rows of the Hadamard matrix of ``order`` (a power of two up to 16) with the lowest
    sequency, as ``[rank, order]``.

    The row of sequency ``k`` (``k`` sign changes) is Sylvester row ``bitreverse(k ^ (k >> 1))``: the
    Gray code of ``k`` with its ``log2(order)`` bits reversed. Rows are returned in increasing sequency.
    """
    if order not in _ORDERS:
        raise ValueError(f"order must be one of {_ORDERS}, got {order!r}")
    if not 1 <= rank <= order:
        raise ValueError(f"rank must be in 1..{order}, got {rank!r}")
    bits = order.bit_length() - 1
    k = torch.arange(rank, device=device)
    gray = k ^ (k >> 1)
    rows = torch.zeros_like(gray)
    for bit in range(bits):
        rows = rows | (((gray >> bit) & 1) << (bits - 1 - bit))
    return _sign_of_parity(rows, torch.arange(order, device=device), dtype)


def lowpass_rows(n, rank: int):
    """Rows of the rank-``rank`` low-pass projection of a length-``n`` dimension (:func:`lowpass`):
    ``rank`` per whole block of 16, and ``⌊rank·q/16⌋`` per power-of-two part ``q`` of the ``n mod 16``
    left over; at most ``⌊rank·n/16⌋``. Works on ints and SymInts without a guard."""
    if rank & (rank - 1) == 0:
        # The same count for a power-of-two rank, in a form whose bounds the symbolic-shape solver sees
        # (rows ≥ 1 when n ≥ 16/rank), where the sum below would make a compile guard on them.
        return rank * n // BLOCK
    rows = rank * (n // BLOCK)
    for bit in range(_BLOCK_BITS):
        kept = rank * 2**bit // BLOCK
        if kept:
            rows = rows + (n // 2**bit) % 2 * kept
    return rows


def tail_basis(
    remainder: int, rank: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
) -> torch.Tensor:
    """The projection of the last ``remainder`` (< 16) positions of a dimension, as ``[rank, 16]``
    acting on them zero-padded to 16; rows past ``lowpass_rows(remainder, rank)`` are zero.

    The positions split into powers of two ``q``, largest first (13 = 8 + 4 + 1). Each part keeps the
    ``⌊rank·q/16⌋`` lowest-sequency rows of the order-``q`` Hadamard matrix scaled by ``√(16/q)``, so
    that the ``/16`` of a block of 16 normalizes every part: at ``rank = 16`` the projection is exact,
    and at ``rank = 16/2^j`` it averages groups of ``2^j`` positions, as it does within whole blocks.
    """
    if not 0 <= remainder < BLOCK:
        raise ValueError(f"remainder must be in 0..{BLOCK - 1}, got {remainder!r}")
    basis = torch.zeros(rank, BLOCK, dtype=dtype, device=device)
    row = col = 0
    for order in _ORDERS[-2::-1]:
        if remainder & order:
            kept = rank * order // BLOCK
            if kept:
                part = walsh_basis(kept, dtype, device, order) * (BLOCK / order) ** 0.5
                basis[row : row + kept, col : col + order] = part
                row += kept
            col += order
    return basis


def lowpass(x: torch.Tensor, rank: int, tail: torch.Tensor) -> torch.Tensor:
    """HLA's low-pass projection ``P_L x`` of a 2-D ``x`` along its rows: ``[lowpass_rows(L, rank), K]``.

    Whole blocks of 16 rows keep their ``rank`` lowest-sequency Walsh components; the ``L mod 16`` rows
    left over are projected by ``tail`` (:func:`tail_basis` of ``L mod 16``, given as data so that a
    shape-generic compile does not specialize on it). Padding the last block to 16 rows instead would
    keep ``rank·⌈L/16⌉`` rows: 104 where ``⌊rank·L/16⌋`` is 98 at L = 197, rank 8.
    """
    n = x.shape[0]
    whole = n // BLOCK * BLOCK
    head = block_transform(x[:whole], walsh_basis(rank, device=x.device), 0)  # [rank·(n // 16), K]
    # The rows after the last whole block, zero-padded to 16, gathered rather than sliced: a slice
    # would be empty when 16 divides L, and a compile would specialize on that.
    rows = whole + torch.arange(BLOCK, device=x.device)
    rest = torch.where((rows < n).unsqueeze(1), x[rows.clamp(max=n - 1)], 0.0)  # [16, K]
    return torch.cat([head, tail.to(x.dtype) @ rest])[: lowpass_rows(n, rank)]


def padded_length(n):
    """``n`` rounded up to a multiple of 16 (works on ints and SymInts without a guard)."""
    return (n + BLOCK - 1) // BLOCK * BLOCK


def block_transform(x: torch.Tensor, basis: torch.Tensor, dim: int) -> torch.Tensor:
    """Apply ``basis`` (``[r, 16]``) to consecutive groups of 16 along ``dim``.

    ``dim`` of length ``n`` is zero-padded to ``16·⌈n/16⌉`` (zeros add nothing to any later
    contraction over it) and comes out with length ``r·⌈n/16⌉``: group ``b`` of the output holds
    ``basis @ x[16b : 16b+16]``. Computed in ``x``'s dtype; any strides are accepted.

    Along the last dimension the product is one matmul of the ``[rows·nb, 16]`` blocks with
    ``basisᵀ``; along any other dimension a batched matmul with the basis (a view for contiguous
    ``x``). On an AVX2 CPU the matmul transformed a [6272, 3072] tensor in 43 ms against 194 ms for
    16 multiply-adds of strided slices, which Inductor fused with the quantizer but fed with a
    scalar load per tap. A sum over a length-16 axis measured worst of all: Inductor parallelised
    that tiny axis and opened a thread team for every output row.
    """
    dim = dim % x.dim()
    n = x.shape[dim]
    # A guard under a shape-generic compile (one kernel for lengths that are multiples of 16, as
    # transformer widths are, another for the rest): padding copies the whole operand.
    if n % BLOCK:
        x = F.pad(x, [0, 0] * (x.dim() - 1 - dim) + [0, padded_length(n) - n])
    basis = basis.to(x.dtype)
    blocks = x.unflatten(dim, (-1, BLOCK))  # [..., nb, 16, rest...]
    if dim == x.dim() - 1:
        y = torch.mm(blocks.reshape(-1, BLOCK), basis.t())  # [rows·nb, r]
        return y.view(*blocks.shape[:-1], basis.shape[0]).flatten(-2)
    lead, rest = blocks.shape[: dim + 1], blocks.shape[dim + 2 :]
    stacked = blocks.flatten(dim + 2).flatten(0, dim)  # [prod(lead), 16, prod(rest)]
    # An explicit bmm: matmul's broadcasting logic tests the batch size (a guard under dynamic shapes).
    y = torch.bmm(basis.expand(stacked.shape[0], -1, -1), stacked)  # [prod(lead), r, prod(rest)]
    return y.unflatten(0, lead).unflatten(-1, rest).flatten(dim, dim + 1)


def block_hadamard(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` times ``blockdiag(H, H, …)`` along ``dim`` (padded to a multiple of 16). Applying it twice
    gives ``16·x`` (padded)."""
    return block_transform(x, hadamard_matrix(x.dtype, x.device), dim)
