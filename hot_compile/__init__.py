"""hot-compile: HOT (Hadamard-based Optimized Training) as a torch.compile backend."""

from . import hadamard, ops, quant

__all__ = ["hadamard", "ops", "quant"]
