import pytest
import torch
from torch._inductor.utils import fresh_cache

from tests import cpu_builds
from tests.harness import pin_int8_path


@pytest.fixture(autouse=True, scope="session")
def session_cache(tmp_path_factory):
    """One empty Inductor/AOTAutograd cache and no calibrated device profile for the run: whatever
    earlier runs or ``hot-compile calibrate-device`` left on this machine never decides whether a
    test's compile runs the pass or what the cost model picks."""
    with fresh_cache(), pytest.MonkeyPatch.context() as patch:
        patch.setenv("HOT_CACHE_DIR", str(tmp_path_factory.mktemp("hot_cache")))
        yield


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch: no automatic-dynamic carry-over between tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(params=["int_mm", "u8s8", "float"])
def int8_path(request, monkeypatch):
    """Runs a test with each form of the integer product (``ops.int8_matmul``)."""
    pin_int8_path(monkeypatch, request.param)
    return request.param


@pytest.fixture
def native_int8(monkeypatch):
    """``torch._int_mm`` as the integer product, for tests that look for it in generated code."""
    pin_int8_path(monkeypatch, "int_mm")


@pytest.fixture(scope="session")
def cpu_build_folder(tmp_path_factory):
    return tmp_path_factory.mktemp("cpu_builds")


@pytest.fixture(params=["native", *cpu_builds.BUILDS])
def cpu_build(request, monkeypatch, cpu_build_folder):
    """Runs a test of HOT's CPU kernels on this machine's build of their library, then on the builds
    of the CPU classes below it (:mod:`tests.cpu_builds`): their vector code, which CI here would not
    otherwise run."""
    if request.param != "native":
        cpu_builds.use(cpu_builds.library(request.param, cpu_build_folder), monkeypatch)
    return request.param
