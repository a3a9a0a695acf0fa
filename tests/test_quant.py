import pytest
import torch

from hot_compile.runtime import quant
from tests import reference
from tests import tolerances as tol
from tests.data import make, rel_err

SEED = torch.tensor(7)


# One scale per tensor, per row (a token of g) and per column (a channel of P·x, or of B·W).
SCALE_SHAPES = {None: (), -1: (33, 1), 0: (1, 40)}


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("dim", SCALE_SHAPES)
def test_stochastic_matches_reference_and_range(bits, dim):
    v = make("gaussian", 33, 40)
    q, s = quant.quantize_stochastic(v, bits, SEED, dim=dim)
    assert q.dtype == torch.int8 and s.dtype == torch.float32
    assert s.shape == SCALE_SHAPES[dim]
    qm = 2 ** (bits - 1) - 1
    assert q.abs().max() <= qm
    ref_q, ref_s = reference.stochastic(v, bits, quant.hash_uniform(v, SEED), dim)
    torch.testing.assert_close(s.double(), ref_s, rtol=1e-6, atol=0)
    assert (q.double() != ref_q).float().mean() <= tol.LEVEL_MISMATCH_FRACTION


@pytest.mark.parametrize("bits", range(2, 9))
def test_sawb_and_nearest_match_reference(bits):
    v = make("lognormal", 50, 30)
    quantizers = (
        (quant.quantize_sawb, reference.sawb),
        (quant.quantize_nearest, reference.nearest),
        (lambda v, bits: quant.quantize_nearest(v, bits, dim=0), lambda v, bits: reference.nearest(v, bits, 0)),
    )
    for fast, ref in quantizers:
        q, s = fast(v, bits)
        ref_q, ref_s = ref(v, bits)
        torch.testing.assert_close(s.double(), ref_s, rtol=1e-5, atol=0)
        assert (q.double() != ref_q).float().mean() <= tol.LEVEL_MISMATCH_FRACTION


def test_sawb_clips_below_max_on_heavy_tails():
    v = make("lognormal", 64, 64)
    assert quant.sawb_clip(v) < v.abs().max()


def test_sawb_falls_back_to_max_for_constant_data():
    v = torch.full((8, 8), 3.0)
    assert quant.sawb_clip(v) == 3.0
    q, s = quant.quantize_sawb(v, 4)
    torch.testing.assert_close(quant.dequantize(q, s), v)


@pytest.mark.parametrize("bits", [1, 9, 4.0, True])
def test_bad_bits_rejected(bits):
    with pytest.raises(ValueError, match="bits"):
        quant.qmax(bits)


def _all_quantizers(v):
    yield quant.quantize_stochastic(v, 4, SEED)
    yield quant.quantize_stochastic(v, 4, SEED, dim=-1)
    yield quant.quantize_sawb(v, 4)
    yield quant.quantize_nearest(v, 8)


def test_zero_input_gives_zeros_and_finite_scale():
    v = torch.zeros(5, 16)
    for q, s in _all_quantizers(v):
        assert not q.any()
        assert torch.isfinite(s).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_gives_non_finite_dequantized(bad):
    v = make("gaussian", 6, 16)
    v[2, 3] = bad
    for q, s in _all_quantizers(v):
        deq = quant.dequantize(q, s)
        assert not torch.isfinite(deq[2]).all()


@pytest.mark.parametrize("dim", SCALE_SHAPES)
def test_stochastic_rounding_is_unbiased(dim):
    v = make("gaussian", 10, 100)
    mean = sum(
        quant.dequantize(*quant.quantize_stochastic(v, 4, torch.tensor(s), dim=dim)) for s in range(tol.SR_DRAWS)
    ) / tol.SR_DRAWS
    single = rel_err(quant.dequantize(*quant.quantize_stochastic(v, 4, SEED, dim=dim)), v)
    reached = rel_err(mean, v)
    print(f"SR mean of {tol.SR_DRAWS} draws: rel err {reached:.4f} (one draw {single:.3f}, bound {tol.SR_MEAN})")
    assert reached < tol.SR_MEAN


def test_hash_uniform_is_uniform_and_seeded():
    like = torch.empty(200_000)
    u = quant.hash_uniform(like, SEED)
    assert u.min() >= 0 and u.max() < 1
    counts = torch.histc(u, bins=16, min=0, max=1)
    expected = like.numel() / 16
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 50  # 15 dof: p ≈ 1e-5
    assert abs(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1]) < 0.01
    assert torch.equal(u, quant.hash_uniform(like, SEED))
    assert not torch.equal(u, quant.hash_uniform(like, SEED + 1))
    assert not torch.equal(u, quant.hash_uniform(like, SEED, salt=1))


def _pair_chi2(u: torch.Tensor, v: torch.Tensor, bins: int = 32) -> float:
    """χ² of the joint histogram of (u, v) against independent uniforms; ``bins² − 1`` degrees of freedom."""
    counts = torch.bincount((u * bins).long() * bins + (v * bins).long(), minlength=bins * bins).double()
    expected = u.numel() / bins**2
    return ((counts - expected) ** 2 / expected).sum().item()


@pytest.mark.parametrize("seed", [1, 7])
def test_hash_noise_of_elements_a_stride_apart_and_of_consecutive_seeds_is_independent(seed):
    # Strides of rows of common layer widths and of block sizes; a single mixing round on consecutive
    # indices gave χ² of 8836 (seed 7) and 48178 (seed 1) at stride 3072.
    like = torch.empty(1 << 22)
    u = quant.hash_uniform(like, torch.tensor(seed))
    for stride in (1, 2, 16, 64, 256, 384, 768, 1536, 3072):
        assert _pair_chi2(u[:-stride], u[stride:]) < tol.PAIR_CHI2_1023_DOF, stride
    assert _pair_chi2(u, quant.hash_uniform(like, torch.tensor(seed + 1))) < tol.PAIR_CHI2_1023_DOF
    assert _pair_chi2(u, quant.hash_uniform(like, torch.tensor(seed), salt=1)) < tol.PAIR_CHI2_1023_DOF


def _mix32_reference(h: int) -> int:
    mask = 0xFFFFFFFF
    h ^= h >> 16
    h = (h * 0x7FEB352D) & mask
    h ^= h >> 15
    h = (h * 0x2C1B3C6D) & mask
    return h ^ (h >> 16)


@pytest.mark.parametrize("seed, salt", [(0, 0), (7, 1), (2**31 - 2, 2), (123456789, 5)])
def test_hash_uniform_is_the_32bit_formula_eager_and_compiled(seed, salt):
    # The int32-lane implementation must give exactly the unsigned 32-bit words of the formula: the
    # indices 32a + c and 32a + 16 + c share the word 16a + c, whose hash gives the low and the high
    # 16 bits of their noise.
    like = torch.empty(3, 37)
    expected = []
    for i in range(like.numel()):
        word = (i >> 5) * 16 + i % 16
        h = _mix32_reference((word * 0x85EBCA6B + seed * 0x61C88647 + salt * 0x3C6EF372) & 0xFFFFFFFF)
        expected.append(((h >> (i & 16)) & 0xFFFF) / 2**16)
    u = quant.hash_uniform(like, torch.tensor(seed), salt)
    assert u.flatten().tolist() == expected
    compiled = torch.compile(quant.hash_uniform, backend="inductor", fullgraph=True)
    big = torch.empty(300, 77)
    assert torch.equal(compiled(big, torch.tensor(seed), salt), quant.hash_uniform(big, torch.tensor(seed), salt))
