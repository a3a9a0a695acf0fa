"""Calibration: the rank rule, layer-wise quantizer selection, side effects, JSON round trip, and the
compiled graph."""

import pytest
import torch
import torch.nn as nn

import hot_compile

from hot_compile import HotConfig
from hot_compile.lqs import LQS_PAPER_THRESHOLD, select_quantizers
from hot_compile.plan import LayerChoice, QuantizerPlan
from tests.harness import aot_compile
from tests.models import MLP, Block


def _batches(count=3, shape=(4, 32, 32), seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=gen) for _ in range(count)]


def _mean_square(model, x):
    return model(x).square().mean()


class Probe(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 64)

    def forward(self, x):
        return self.fc(x)


def _same_row_gradient(model, x):
    # Every token's upstream gradient is the same vector: per-token scales equal the per-tensor one.
    return (model(x) * torch.linspace(-1, 1, 64)).sum()


def _scaled_one_hot_rows(model, x):
    # Token t's upstream gradient is a_t · e_(t mod 64), a_t in 1..5: after the Hadamard transform
    # each row is ±a_t in one block of 16 and 0 elsewhere, exact in INT4 with a per-row scale but
    # not with one scale for all rows.
    tokens = x.shape[:-1].numel()
    t = torch.arange(tokens)
    direction = torch.zeros(tokens, 64)
    direction[t, t % 64] = (1 + t % 5).float()
    return (model(x) * direction.view(*x.shape[:-1], 64)).sum()


def _quantizers(plan: QuantizerPlan) -> dict[str, str]:
    return {module: settings["gx_quantizer"] for module, settings in plan.as_dict().items()}


def test_paper_rule_picks_per_token_only_where_it_halves_the_error():
    torch.manual_seed(0)
    probe = Probe()
    uniform = select_quantizers(probe, _batches(), _same_row_gradient, LQS_PAPER_THRESHOLD)
    assert _quantizers(uniform) == {"fc": "per_tensor"}
    assert uniform.layers[0].per_token_error == pytest.approx(uniform.layers[0].per_tensor_error, rel=0.1)
    varied = select_quantizers(probe, _batches(), _scaled_one_hot_rows, LQS_PAPER_THRESHOLD)
    assert _quantizers(varied) == {"fc": "per_token"}
    assert varied.layers[0].per_token_error < 0.05 * varied.layers[0].per_tensor_error


def test_threshold_is_the_rule():
    torch.manual_seed(0)
    model = MLP()
    plan = select_quantizers(model, _batches(), _mean_square, LQS_PAPER_THRESHOLD)
    ratio = max(c.per_token_error / c.per_tensor_error for c in plan.layers)
    loose = select_quantizers(model, _batches(), _mean_square, threshold=min(1.0, ratio * 1.01))
    assert set(_quantizers(loose).values()) == {"per_token"}
    with pytest.raises(ValueError, match="threshold"):
        select_quantizers(model, _batches(), _mean_square, threshold=0)


def test_calibration_leaves_no_trace():
    torch.manual_seed(0)
    model = Block()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    plan = select_quantizers(model, _batches(2), _mean_square)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not model._forward_hooks and not any(m._forward_hooks for m in model.modules())
    assert [c.module for c in plan.layers] == sorted(["attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"])


def test_plan_is_deterministic_and_round_trips_through_json(tmp_path):
    torch.manual_seed(0)
    model = Block()
    plan = select_quantizers(model, _batches(2), _mean_square)
    again = select_quantizers(model, _batches(2), _mean_square)
    assert plan == again and repr(plan) == repr(again) and hash(plan) == hash(again)

    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = QuantizerPlan.load(path)
    assert loaded == plan and repr(loaded) == repr(plan) and hash(loaded) == hash(plan)
    assert loaded.source == plan.source and "threshold 1.0" in loaded.source
    assert loaded.quantizer_for("mlp.fc1") == plan.quantizer_for("mlp.fc1")
    assert loaded.quantizer_for("no.such.layer") is None and loaded.settings_for("no.such.layer") == {}


def test_calibrate_is_a_deprecated_alias_of_select_quantizers():
    torch.manual_seed(0)
    model = MLP()
    with pytest.warns(DeprecationWarning, match="select_quantizers"):
        old = hot_compile.calibrate(model, _batches(2), _mean_square)
    assert old == select_quantizers(model, _batches(2), _mean_square)


def test_plan_order_does_not_matter_and_bad_plans_fail(tmp_path):
    a = LayerChoice("b", "per_token", 2.0, 0.5)
    b = LayerChoice("a", "per_tensor", 1.0, 0.9)
    assert QuantizerPlan((a, b), "hand-made") == QuantizerPlan((b, a), "hand-made")
    with pytest.raises(ValueError, match="more than once"):
        QuantizerPlan((a, a), "hand-made")
    with pytest.raises(ValueError, match="per_tensor"):
        LayerChoice("a", "per_channel", 1.0, 1.0)
    with pytest.raises(ValueError, match="rank"):
        LayerChoice("a", "per_token", 1.0, 1.0, rank=32)
    path = tmp_path / "other.json"
    path.write_text('{"layers": []}')
    with pytest.raises(ValueError, match="QuantizerPlan"):
        QuantizerPlan.load(path)


def _hq_gradient_scales(graphs, module):
    """The gradient quantizer the HQ op of ``module`` was built with."""
    (hq,) = [
        n
        for n in graphs.joint.graph.nodes
        if n.target is torch.ops.hot_compile.hq_grad_input.default and n.meta["hot_compile"]["module"] == module
    ]
    per_token = hq.args[5]
    return "per_token" if per_token else "per_tensor"


@pytest.mark.parametrize("as_file", [False, True])
def test_plan_changes_the_compiled_quantizer(tmp_path, as_file):
    plan = QuantizerPlan(
        (LayerChoice("fc1", "per_tensor", 1.0, 0.9), LayerChoice("fc2", "per_token", 1.0, 0.2)), "hand-made"
    )
    if as_file:
        plan.save(tmp_path / "plan.json")
    x = torch.randn(4, 32, 32, requires_grad=True)

    def compile_with(config):
        torch._dynamo.reset()
        compiled, graphs = aot_compile(MLP(), config)
        compiled(x).square().mean().backward()
        return graphs

    base = HotConfig(policy="hot", strict=True, gx_quantizer="per_tensor")
    without = compile_with(base)
    assert [_hq_gradient_scales(without, m) for m in ("fc1", "fc2")] == ["per_tensor", "per_tensor"]
    with_plan = compile_with(base.replace(plan=str(tmp_path / "plan.json") if as_file else plan))
    assert [_hq_gradient_scales(with_plan, m) for m in ("fc1", "fc2")] == ["per_tensor", "per_token"]


class TokenProbe(nn.Module):
    """Two linears on one input: the evidence for a rank is per layer and per data."""

    def __init__(self, dim=32):
        super().__init__()
        self.fc1 = nn.Linear(dim, 64)
        self.fc2 = nn.Linear(64, dim)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _image_like(count, seed):
    """Tokens of a smooth field: 16-token blocks of neighbours that differ little (patches of a
    natural image, frames of audio)."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.arange(64, dtype=torch.float32)[:, None] / 64
    out = []
    for _ in range(count):
        freq = torch.rand(4, 1, 32, generator=gen) * 2
        phase = torch.rand(4, 1, 32, generator=gen) * 6.28
        out.append(torch.sin(6.28 * freq * t + phase) + 0.01 * torch.randn(4, 64, 32, generator=gen))
    return out


def _text_like(count, seed):
    """Tokens drawn independently from a vocabulary of embeddings: neighbours are unrelated."""
    gen = torch.Generator().manual_seed(seed)
    vocab = torch.randn(256, 32, generator=gen)
    return [vocab[torch.randint(0, 256, (4, 64), generator=gen)] for _ in range(count)]


def _smooth_target_loss(model, x):
    # A smooth per-token target, so the upstream gradient is as smooth along tokens as the input.
    return (model(x) - x.roll(1, dims=1)).square().mean()


def test_rank_follows_the_data_image_like_tokens_get_rank_8_text_like_ones_keep_16():
    torch.manual_seed(0)
    model = TokenProbe()
    image = select_quantizers(model, _image_like(4, 1), _smooth_target_loss)
    text = select_quantizers(model, _text_like(4, 1), _smooth_target_loss)
    assert {c.module: c.rank for c in image.layers} == {"fc1": 8, "fc2": 8}
    assert {c.module: c.rank for c in text.layers} == {"fc1": None, "fc2": None}
    for image_choice, text_choice in zip(image.layers, text.layers):
        assert image_choice.rank8_error <= 0.1 * image_choice.sampling_spread
        assert text_choice.rank8_error > 0.1 * text_choice.sampling_spread
    assert image.settings_for("fc1")["rank"] == 8 and "rank" not in text.settings_for("fc1")


def test_one_batch_measures_no_spread_and_keeps_the_rank():
    plan = select_quantizers(TokenProbe(), _image_like(1, 1), _smooth_target_loss)
    assert all(c.rank is None and c.sampling_spread is None and c.rank8_error is not None for c in plan.layers)


def test_calibrated_rank_reaches_the_compiled_graph_and_the_report():
    torch.manual_seed(0)
    model = TokenProbe()
    plan = select_quantizers(model, _image_like(4, 1), _smooth_target_loss)
    compiled, graphs = aot_compile(model, HotConfig(policy="hot", strict=True, plan=plan))
    _smooth_target_loss(compiled, _image_like(1, 2)[0]).backward()
    compress = [n for n in graphs.joint.graph.nodes if n.target is torch.ops.hot_compile.compress_activation.default]
    assert [n.args[1] for n in compress] == [8, 8]  # the ranks of fc1's and fc2's inputs
    rows = [r for r in hot_compile.last_report() if r.path == "gw"]
    assert rows and all(r.decision == "HLA+ABC" and "rank 8 (plan)" in r.numerics for r in rows)
