import pytest
import torch
from torch._inductor.utils import fresh_cache


@pytest.fixture(autouse=True, scope="session")
def session_cache():
    """One empty Inductor/AOTAutograd cache for the run: whatever earlier runs left on this machine
    never decides whether a test's compile runs the pass."""
    with fresh_cache():
        yield


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch: no automatic-dynamic carry-over between tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
