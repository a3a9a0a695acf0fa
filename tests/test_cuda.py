"""The CUDA path: numerics and the backend on a GPU (skipped without one; the CPU suite is the gate)."""

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import hot_compile
from hot_compile import HotConfig
from hot_compile.runtime import aten_impl
from tests import reference
from tests import tolerances as tol
from tests.data import make, rel_err
from tests.models import Block, MLP, grad_errors

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")
SEED = torch.tensor(5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ops_match_reference_on_cuda(dtype):
    g, w, x = make("gaussian", 400, 136), make("gaussian", 136, 72, 1), make("gaussian", 400, 72, 2)
    out = aten_impl.hq_grad_input(g.to(CUDA, dtype), w.to(CUDA, dtype), SEED.to(CUDA))
    assert out.device.type == "cuda" and out.dtype == dtype
    ref = reference.hq_grad_input(g.to(dtype).float(), w.to(dtype).float(), SEED)
    assert rel_err(out.cpu(), ref) < (tol.FP32_VS_REFERENCE if dtype == torch.float32 else tol.HQ_HALF_PRECISION)
    xq, xs = aten_impl.compress_activation(x.to(CUDA), rank=16)
    gw = aten_impl.hla_grad_weight(g.to(CUDA), xq, xs, SEED.to(CUDA), rank=16)
    assert rel_err(gw.cpu(), g.double().T @ x.double()) < tol.HLA_FULL_RANK


def test_backend_on_cuda_bf16_runs_hot_ops_and_triton():
    torch.manual_seed(0)
    model = Block(dim=64, heads=4).to(CUDA)
    compiled = torch.compile(model, backend="hot", options={"policy": "hot", "strict": True, "rank": 16})
    x = torch.randn(4, 64, 64, device=CUDA)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            compiled(x).float().square().mean().backward()

    _, code = run_and_get_code(step)
    (backward,) = [c for c in code if "hot_compile.hla_grad_weight" in c]
    assert "hot_compile.hq_grad_input" in backward and "triton" in backward
    assert any("_int_mm" in c for c in code)  # in the kernels of HOT's ops
    assert hot_compile.last_report().select(decision="HQ")


def test_cuda_grads_within_band():
    torch.manual_seed(0)
    model = MLP(64, 256, 64).to(CUDA)
    x = make("smooth", 4 * 64, 64).reshape(4, 64, 64).to(CUDA)
    errors = grad_errors(model, torch.compile(model, backend="hot", options={"policy": "hot", "strict": True}), x)
    assert max(errors.values()) < tol.E2E_GRAD


def test_int_mm_constraints_keep_small_sites_with_reason():
    model = MLP(12, 20, 12).to(CUDA)  # K = 12 is not a multiple of 8
    torch.compile(model, backend=hot_compile.backend(HotConfig(policy="hot", strict=True)))(
        torch.randn(4, 8, 12, device=CUDA)
    ).sum().backward()
    reasons = [r.reason for r in hot_compile.last_report() if r.decision == "kept"]
    assert any("CUDA _int_mm" in r for r in reasons)


def test_conv_sites_on_cuda():
    from tests.test_conv import small_resnet

    model = small_resnet().to(CUDA)
    compiled = torch.compile(model, backend="hot", options={"policy": "hot", "strict": True})
    errors = grad_errors(model, compiled, torch.randn(8, 3, 16, 16, device=CUDA))
    rewritten = {(r.module, r.path) for r in hot_compile.last_report() if r.decision != "kept"}
    assert {("2.conv1", "gx"), ("2.conv1", "gw"), ("2.conv2", "gw"), ("2.shortcut", "gw")} <= rewritten
    assert max(errors.values()) < tol.E2E_GRAD_CONV
