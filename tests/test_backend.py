"""End to end: torch.compile(backend="hot") through Inductor."""

import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch._inductor.utils import fresh_cache, run_and_get_code

import hot_compile
from hot_compile import HotConfig
from tests import tolerances as tol
from tests.data import make
from tests.models import MLP, Block, grad_errors


def _smooth(batch, tokens, dim, seed=0):
    return make("smooth", batch * tokens, dim, seed).reshape(batch, tokens, dim)


def _grads(model, compiled, x, seed=0):
    torch.manual_seed(seed)
    model.zero_grad()
    compiled(x).square().mean().backward()
    return {k: p.grad.clone() for k, p in model.named_parameters()}


def test_trains_without_importing_hot_compile():
    script = textwrap.dedent(
        """
        import sys, torch
        import torch.nn.functional as F

        class MLP(torch.nn.Module):
            def __init__(self, dim, hidden, out):
                super().__init__()
                self.fc1, self.fc2 = torch.nn.Linear(dim, hidden), torch.nn.Linear(hidden, out)

            def forward(self, x):
                return self.fc2(F.gelu(self.fc1(x)))

        assert "hot_compile" not in sys.modules
        torch.manual_seed(0)
        for model, shape in ((MLP(32, 64, 16), (8, 32, 32)), (torch.nn.Sequential(MLP(32, 128, 32), MLP(32, 64, 16)), (4, 32, 32))):
            compiled = torch.compile(model, backend="hot", options={"strict": True, "policy": "hot"})
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)
            x = torch.randn(*shape)
            target = x[..., :16].tanh()  # learnable: a fixed function of the input
            losses = []
            for _ in range(10):
                opt.zero_grad()
                loss = (compiled(x) - target).square().mean()
                loss.backward()
                opt.step()
                losses.append(loss.item())
            print(type(model).__name__, [round(l, 4) for l in losses])
            assert losses[-1] < 0.7 * losses[0], losses
            assert sys.modules["hot_compile"].last_report().rewritten()
        assert "hot_compile" in sys.modules  # loaded by the entry point, not by us
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    print(out.stdout)
    assert out.returncode == 0, out.stderr[-3000:]


def test_grads_within_band_and_hot_ops_in_backward_code():
    torch.manual_seed(0)
    model = Block()
    compiled = torch.compile(model, backend=hot_compile.backend(HotConfig(strict=True, policy="hot")))
    x = torch.randn(2, 48, 32)
    errors, code = run_and_get_code(grad_errors, model, compiled, x)
    print({k: round(v, 3) for k, v in errors.items()})
    assert max(errors.values()) < tol.E2E_GRAD
    # The kernels HOT's ops run are compiled too (at their first call): pick the model's backward.
    (backward_code,) = [c for c in code if "hot_compile.hla_grad_weight" in c]
    assert backward_code.count("torch.ops.hot_compile.hq_grad_input.default(") == 4  # qkv, proj, fc1, fc2
    assert backward_code.count("torch.ops.hot_compile.hla_grad_weight.default(") == 4
    report = hot_compile.last_report()
    assert len(report.select(path="gx", decision="HQ")) == 4
    assert len(report.select(path="gw", decision="HLA+ABC")) == 4


def test_rank_8_grads_on_token_smooth_input():
    torch.manual_seed(0)
    model = MLP()
    options = {"strict": True, "policy": "hot", "rank": 8}
    errors = grad_errors(model, torch.compile(model, backend="hot", options=options), _smooth(4, 64, 32))
    assert max(errors.values()) < tol.E2E_GRAD_RANK8_SMOOTH
    rows = hot_compile.last_report().select(path="gw", decision="HLA+ABC")
    assert len(rows) == 2 and all("rank 8" in r.numerics for r in rows)


def test_numerics_name_where_each_width_comes_from():
    """A width left "auto" is the device's, one an override sets is the override's, per module."""
    options = {"strict": True, "policy": "hot", "overrides": {"fc1": {"gw_bits": 6}}}
    torch.compile(MLP(), backend="hot", options=options)(torch.randn(4, 40, 32)).sum().backward()
    widest = hot_compile.runtime.devices.resolve_profile(torch.device("cpu"), "auto").widest_bits_at_narrowest_rate()
    numerics = {row.module: row.numerics for row in hot_compile.last_report().select(path="gw", decision="HLA+ABC")}
    assert numerics == {"fc1": "INT6 (override) rank 16 per_channel", "fc2": f"INT{widest} (auto: device) rank 16 per_channel"}


def test_policy_off_is_bitwise_inductor():
    torch.manual_seed(0)
    model, x = Block(), torch.randn(2, 40, 32)
    inductor = _grads(model, torch.compile(model, backend="inductor"), x)
    torch._dynamo.reset()
    off = _grads(model, torch.compile(model, backend="hot", options={"policy": "off"}), x)
    for name in inductor:
        assert torch.equal(inductor[name], off[name]), name
    report = hot_compile.last_report()  # every product and saved value found, and kept by the policy alone
    assert len(report.products()) == 12 and all(r.reason == "policy='off'" for r in report.products())  # 4 linears: fwd, gx, gw
    assert report.select(path="saved") and all(r.decision == "kept" for r in report)


def _saved_bytes(compiled, x, params):
    """Bytes the compiled forward saves for backward, by dtype, parameters excluded."""
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    seen, by_dtype = set(), {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in param_storages and ptr not in seen:
            seen.add(ptr)
            by_dtype[t.dtype] = by_dtype.get(t.dtype, 0) + t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = compiled(x)
    out.sum().backward()
    return by_dtype


def test_saved_activations_are_int8():
    model, x = MLP(64, 256, 64), torch.randn(8, 100, 64)
    params = list(model.parameters())
    ind = torch.compile(model, backend="inductor")
    ind(x)
    before = _saved_bytes(ind, x, params)
    torch._dynamo.reset()
    hot = torch.compile(model, backend="hot", options={"strict": True, "policy": "hot", "compress_saved": False})
    hot(x)
    after = _saved_bytes(hot, x, params)
    print(f"saved for backward: inductor {before}, hot {after}")
    # inductor keeps x (800×64), the GELU input and output (800×256 each); HOT keeps the GELU input
    # (GELU's backward needs it) and two int8 buffers of the Walsh-transformed tokens (800×64 and
    # 800×256 at rank 16) with one float32 scale per channel
    assert before == {torch.float32: 4 * 800 * (64 + 2 * 256)}
    assert after[torch.int8] == 800 * (64 + 256)
    assert after[torch.float32] == 4 * 800 * 256 + 4 * (64 + 256)
    assert len(hot_compile.last_report().select(path="gw", decision="HLA+ABC")) == 2
    for row in hot_compile.last_report().select(path="gw"):
        print(f"{row.module}: {row.saved_bytes_before} B → {row.saved_bytes_after} B")


@pytest.fixture
def fx_graph_cache():
    with fresh_cache(), torch._inductor.config.patch(fx_graph_cache=True):
        yield


def test_report_of_a_cache_hit_is_the_one_its_compile_made(fx_graph_cache):
    from torch._dynamo.utils import counters

    model = MLP()
    reports, found = [], []
    for tokens in (64, 16, 64):  # the middle compile's report differs from the others
        torch._dynamo.reset()
        before = counters["hot"]["sites_found"]
        compiled = torch.compile(model, backend="hot", options={"strict": True, "policy": "hot"})
        _grads(model, compiled, torch.randn(4, tokens, 32))
        found.append(counters["hot"]["sites_found"] - before)
        reports.append(hot_compile.last_report())
    assert found[0] > 0 and found[1] > 0 and found[2] == 0  # the last compile was served from a cache
    assert reports[1].rows != reports[0].rows
    assert reports[2].rows == reports[0].rows and reports[2].select(decision="HLA+ABC")


def test_changing_config_recompiles_despite_cache(fx_graph_cache):
    model, x = MLP(), torch.randn(4, 64, 32)

    def run(**options):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="hot", options={"strict": True, "policy": "hot", **options})
        return _grads(model, compiled, x)

    first = run(gx_bits=4)
    other = run(gx_bits=8)
    again = run(gx_bits=4)
    assert any(not torch.equal(first[k], other[k]) for k in first)
    assert all(torch.equal(first[k], again[k]) for k in first)


def test_pass_failure_keeps_training(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(hot_compile.inductor_pass, "run_hot_pass", broken)
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(4, 40, 32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hot = _grads(model, torch.compile(model, backend="hot"), x)
    assert [str(w.message) for w in caught if issubclass(w.category, hot_compile.HotPassWarning)]
    torch._dynamo.reset()
    inductor = _grads(model, torch.compile(model, backend="inductor"), x)
    assert all(torch.equal(hot[k], inductor[k]) for k in hot)


def test_joint_pass_inside_an_inductor_pipeline():
    model = MLP()
    # fresh caches: outside backend="hot" nothing recalls the report of a graph served from a cache
    with fresh_cache(), torch._inductor.config.patch(joint_custom_post_pass=hot_compile.joint_pass(HotConfig(strict=True, policy="hot"))):
        compiled = torch.compile(model, backend="inductor")
        compiled(torch.randn(4, 40, 32)).sum().backward()
    assert len(hot_compile.last_report().select(path="gx", decision="HQ")) == 1  # input has no grad: fc2 only


def test_inductor_options_pass_through_and_bad_keys_fail():
    model = MLP()
    compiled = torch.compile(model, backend="hot", options={"rank": 4, "policy": "hot", "epilogue_fusion": False, "strict": True})
    compiled(torch.randn(4, 40, 32)).sum().backward()
    rewritten = hot_compile.last_report().select(path="gw", decision="HLA+ABC")
    assert len(rewritten) == 2 and all("rank 4" in r.numerics for r in rewritten)
    with pytest.raises(Exception, match="no_such_key"):
        torch._dynamo.reset()
        torch.compile(MLP(), backend="hot", options={"no_such_key": 1})(torch.randn(2, 32))
