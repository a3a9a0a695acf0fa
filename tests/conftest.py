import pytest
import torch


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch: no automatic-dynamic carry-over between tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
