"""The CPU-side parts of the one-shot GPU check (tools/gpu_check.sh, tools/gpu_bench.py)."""

import subprocess
import sys

import pytest
import torch

from hot_compile.observability.memory import saved_for_backward_bytes
from tests import tool_scripts
from tests.tool_scripts import TOOLS


def _gpu_bench():
    return tool_scripts.load("gpu_bench")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_gpu_check_exits_cleanly_without_a_gpu(tmp_path):
    out = subprocess.run(
        ["bash", str(TOOLS / "gpu_check.sh")],
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "OUT": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "no CUDA device" in out.stderr


def test_gpu_bench_linear_stack_saved_bytes_on_cpu():
    """Each layer saves its input and GELU its own: four [2, 20, 64] float32 tensors at depth 2."""
    model = _gpu_bench().LinearStack(64, 2)
    x = torch.randn(2, 20, 64)
    saved = saved_for_backward_bytes(lambda: model(x).sum().backward(), model.parameters())
    assert model(x).shape == x.shape
    assert saved == 4 * x.numel() * x.element_size()
