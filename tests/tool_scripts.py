"""The scripts under ``tools/``, imported as modules for their tests."""

import importlib.util
import pathlib
from types import ModuleType

TOOLS = pathlib.Path(__file__).parent.parent / "tools"


def load(name: str) -> ModuleType:
    """``tools/{name}.py`` as a module, its ``main`` not run."""
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
