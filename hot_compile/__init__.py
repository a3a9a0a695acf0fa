"""hot-compile: HOT (Hadamard-based Optimized Training) as a torch.compile backend.

``torch.compile(model, backend="hot")`` compiles with Inductor after rewriting the backward matmuls
of every eligible linear layer into integer Hadamard-quantized (grad_input) and Hadamard low-rank
(grad_weight) products, saving an int8 low-rank activation instead of the input.

Layers, each importing only those below it: ``runtime`` (numerics, custom ops, device profiles) →
``config`` / ``plan`` → ``passes`` (the graph rewrite) → ``observability`` (reports, dumps, logs) →
this API (``backend``, ``inductor_pass``, ``lqs``, ``device_calibration``) → ``harness`` (benchmarks,
demo, training tasks) → ``cli``.
"""

from importlib.metadata import PackageNotFoundError, version as _dist_version

# torch before any submodule: with TORCH_LOGS="+hot_compile,hot_decisions" and this package imported
# first, torch's TORCH_LOGS parsing imports our subpackages (the observability layer registers the log
# artifacts before their names are parsed), which must not find a module of ours half-imported.
import torch  # noqa: F401

from .backend import backend
from .config import PAPER_RECIPE, HotConfig
from .inductor_pass import HotPassWarning, joint_pass
from .lqs import calibrate, select_quantizers
from .observability.inspection import HotInspectionWarning
from .observability.report import last_report
from .passes.report import Report, SiteRow
from .plan import QuantizerPlan

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
    "joint_pass",
    "last_report",
    "select_quantizers",
]

try:
    __version__ = _dist_version("hot-compile")
except PackageNotFoundError:  # imported from a source tree that is not installed
    __version__ = "0+unknown"
