"""Whether ``torch._int_mm`` is exact is measured, not read from the CPU's features: where oneDNN is
limited to an ISA without VNNI, its int8 GEMM saturates, and HOT's products must stay exact anyway, with
a warning that says why."""

import json
import os
import subprocess
import sys

import pytest
import torch

from hot_compile.runtime import int8_gemm

INT8_CPU = pytest.mark.skipif(not int8_gemm.CPU_INT8_INSTRUCTIONS, reason="needs a CPU with AVX512-VNNI or AMX")

# A product whose contraction (200) is long for its rows (20): HOT's VNNI engine leaves such shapes to
# torch._int_mm where that is exact (cpu_gemm.VNNI_CONTRACTION_PER_ROW).
LIMITED_PROCESS = r"""
import json, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from hot_compile.runtime import cpu_gemm, cpu_kernels, int8_gemm
import torch
torch.manual_seed(0)
a = torch.randint(-127, 128, (20, 200), dtype=torch.int8)
b = torch.randint(-127, 128, (200, 24), dtype=torch.int8)
calls = []
matmul = lambda x, y: calls.append(1) or int8_gemm.int8_matmul(x, y)
out = cpu_gemm.matmul_dequantized(a, b, torch.ones(20), torch.ones(24), 1.0, torch.float32, matmul)
print(json.dumps({
    "int_mm_exact": int8_gemm.int_mm_exact(),
    "kind": int8_gemm.int8_gemm_kind(torch.device("cpu")),
    "engine": cpu_gemm.fused_gemm(),
    "matmul_called": bool(calls),
    "error": (out.double() - a.double() @ b.double()).abs().max().item(),
    "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
}))
"""


@INT8_CPU
def test_int_mm_is_exact_on_a_cpu_with_int8_instructions():
    assert int8_gemm.int_mm_exact()
    assert int8_gemm.int8_gemm_kind(torch.device("cpu")) == "int_mm"


@INT8_CPU
def test_products_stay_exact_where_onednn_is_limited_to_an_isa_without_vnni():
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    done = subprocess.run([sys.executable, "-c", LIMITED_PROCESS], env=env, capture_output=True, text=True, timeout=300, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert not result["int_mm_exact"]  # the limit took effect: oneDNN's uint8 × int8 kernel saturates
    assert result["kind"] != "int_mm"
    assert result["error"] == 0
    assert result["engine"] and not result["matmul_called"]  # HOT's own GEMM, whatever the shape
    assert any("does not sum int8 products exactly" in w for w in result["warnings"])

