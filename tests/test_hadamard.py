import pytest
import torch

from hot_compile.runtime import hadamard
from tests import reference
from tests import tolerances as tol

F64 = torch.float64


def test_hadamard_is_orthogonal_symmetric_sylvester():
    h = hadamard.hadamard_matrix(F64)
    assert torch.equal(h, reference.sylvester_hadamard())
    assert torch.equal(h, h.T)
    assert torch.equal(h @ h.T, 16 * torch.eye(16, dtype=F64))


@pytest.mark.parametrize("rank", range(1, 17))
def test_walsh_basis_is_lowest_sequency_rows(rank):
    assert torch.equal(hadamard.walsh_basis(rank, F64), reference.sequency_sorted_rows(rank))


def test_walsh_basis_sequency_increases():
    basis = hadamard.walsh_basis(16, F64)
    changes = (basis[:, 1:] != basis[:, :-1]).sum(1)
    assert changes.tolist() == list(range(16))


@pytest.mark.parametrize("order", [1, 2, 4, 8, 16])
def test_walsh_basis_of_every_order_is_lowest_sequency_rows(order):
    for rank in range(1, order + 1):
        assert torch.equal(hadamard.walsh_basis(rank, F64, order=order), reference.sequency_sorted_rows(rank, order))


@pytest.mark.parametrize("rank", [0, 17, -1])
def test_walsh_basis_rejects_bad_rank(rank):
    with pytest.raises(ValueError, match="rank"):
        hadamard.walsh_basis(rank)


def test_walsh_basis_rejects_an_order_not_a_power_of_two():
    with pytest.raises(ValueError, match="order"):
        hadamard.walsh_basis(2, order=12)


@pytest.mark.parametrize("remainder", [-1, 16])
def test_tail_basis_rejects_a_remainder_outside_a_block(remainder):
    with pytest.raises(ValueError, match="remainder"):
        hadamard.tail_basis(remainder, 8)


@pytest.mark.parametrize("rank", [1, 3, 4, 6, 8, 16])
@pytest.mark.parametrize("n", [1, 5, 15, 16, 17, 197])
def test_lowpass_matches_reference_and_keeps_at_most_rank_over_16_of_the_rows(rank, n):
    x = torch.randn(n, 6, dtype=F64)
    out = hadamard.lowpass(x, rank, hadamard.tail_basis(n % 16, rank, F64))
    assert out.shape == (hadamard.lowpass_rows(n, rank), 6)
    assert hadamard.lowpass_rows(n, rank) <= rank * n // 16
    torch.testing.assert_close(out, reference.lowpass(x, rank), rtol=0, atol=tol.FP64_EXACT * 16)


@pytest.mark.parametrize("n", [1, 5, 15, 16, 17, 197])
def test_lowpass_at_full_rank_is_orthogonal_up_to_16(n):
    p = reference.lowpass_matrix(n, 16)
    torch.testing.assert_close(p.T @ p, 16 * torch.eye(n, dtype=F64), rtol=0, atol=tol.FP64_EXACT * 16)


@pytest.mark.parametrize("n", [1, 15, 16, 17, 197, 6272])
def test_block_hadamard_matches_reference_2d_and_3d(n):
    gen = torch.Generator().manual_seed(n)
    h = reference.sylvester_hadamard()
    x2 = torch.randn(3, n, generator=gen, dtype=F64)
    torch.testing.assert_close(
        hadamard.block_hadamard(x2, 1), reference.block_transform(x2, h, 1), rtol=0, atol=tol.FP64_EXACT * 16
    )
    x3 = torch.randn(2, n, 5, generator=gen, dtype=F64)
    torch.testing.assert_close(
        hadamard.block_hadamard(x3, 1), reference.block_transform(x3, h, 1), rtol=0, atol=tol.FP64_EXACT * 16
    )


@pytest.mark.parametrize("n", [1, 15, 17, 197])
def test_inverse_round_trip_exact_fp64(n):
    # Integer-valued data: every partial sum is exact in fp64, so the round trip is bitwise.
    x = torch.randint(-1000, 1000, (4, n)).to(F64)
    twice = hadamard.block_hadamard(hadamard.block_hadamard(x, -1), -1) / 16
    assert torch.equal(twice[:, :n], x)
    assert torch.equal(twice[:, n:], torch.zeros_like(twice[:, n:]))
    real = torch.randn(4, n, dtype=F64)
    again = hadamard.block_hadamard(hadamard.block_hadamard(real, -1), -1)[:, :n] / 16
    torch.testing.assert_close(again, real, rtol=tol.FP64_EXACT, atol=tol.FP64_EXACT)


@pytest.mark.parametrize("n", [1, 15, 17, 197])
def test_padding_keeps_products_exact(n):
    g = torch.randn(7, n, dtype=F64)
    w = torch.randn(n, 5, dtype=F64)
    transformed = hadamard.block_hadamard(g, 1) @ hadamard.block_hadamard(w, 0) / 16
    torch.testing.assert_close(transformed, g @ w, rtol=tol.FP64_EXACT, atol=tol.FP64_EXACT)


@pytest.mark.parametrize("rank", [1, 8, 16])
@pytest.mark.parametrize("n", [15, 197])
def test_block_projection_matches_reference(rank, n):
    x = torch.randn(n, 6, dtype=F64)
    basis = hadamard.walsh_basis(rank, F64)
    out = hadamard.block_transform(x, basis, 0)
    assert out.shape == (rank * -(-n // 16), 6)
    torch.testing.assert_close(out, reference.block_transform(x, basis, 0), rtol=0, atol=tol.FP64_EXACT * 16)


def test_any_strides():
    x = torch.randn(40, 33, dtype=F64)
    h = reference.sylvester_hadamard()
    for view in (x.T, x[:, ::2], x.T[::3]):
        for dim in (0, 1):
            torch.testing.assert_close(
                hadamard.block_hadamard(view, dim), reference.block_transform(view, h, dim), rtol=0, atol=1e-11
            )


@pytest.mark.parametrize("n, padded", [(32, False), (40, True)])
def test_a_length_that_is_a_multiple_of_16_is_not_copied_under_symbolic_shapes(n, padded):
    """Padding copies the whole operand: a shape-generic trace tests ``n % 16`` (one kernel for each
    answer) rather than pad a length that transformer widths never need padded."""
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda g: hadamard.block_hadamard(g, 1), tracing_mode="symbolic")(torch.randn(8, n))
    assert any(node.target == torch.ops.aten.constant_pad_nd.default for node in gm.graph.nodes) == padded
