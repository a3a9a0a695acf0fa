"""hot-compile: HOT (Hadamard-based Optimized Training) as a torch.compile backend.

``torch.compile(model, backend="hot")`` compiles with Inductor after rewriting the backward matmuls
of every eligible linear layer into integer Hadamard-quantized (grad_input) and Hadamard low-rank
(grad_weight) products, saving an int8 low-rank activation instead of the input.
"""

from importlib.metadata import PackageNotFoundError, version as _dist_version

# torch before any submodule: with TORCH_LOGS="+hot_compile,hot_decisions" and this package imported
# first, torch's TORCH_LOGS parsing imports our subpackages (hot_compile.passes registers the log
# artifacts before their names are parsed), which must not find a module of ours half-imported.
import torch  # noqa: F401

from . import hadamard, kernels, ops, quant
from .backend import backend
from .config import PAPER_RECIPE, HotConfig
from .inspection import HotInspectionWarning
from .lqs import QuantizerPlan, calibrate
from .passes import HotPassWarning, joint_pass
from .report import Report, SiteRow, last_report

__all__ = [
    "HotConfig",
    "HotInspectionWarning",
    "HotPassWarning",
    "PAPER_RECIPE",
    "QuantizerPlan",
    "Report",
    "SiteRow",
    "backend",
    "calibrate",
    "hadamard",
    "kernels",
    "joint_pass",
    "last_report",
    "ops",
    "quant",
]

try:
    __version__ = _dist_version("hot-compile")
except PackageNotFoundError:  # imported from a source tree that is not installed
    __version__ = "0+unknown"
