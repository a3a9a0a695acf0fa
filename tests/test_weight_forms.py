"""Weight matmuls however a model writes them: ``x @ W.T``, ``matmul(x, W)``, GPT-2's ``Conv1D``
(``addmm(b, x, W)`` with ``W: [in, out]``), ``einsum``, and weights computed from parameters (a merged
LoRA adapter, weight norm). Each test asserts what was rewritten, or what was reported kept and why."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hot_compile
from hot_compile import HotConfig
from tests import tolerances as tol
from tests.data import make
from tests.harness import aot_compile
from tests.models import grad_errors, gradient_errors

aten = torch.ops.aten
STRICT = HotConfig(strict=True, policy="hot")


def _smooth(batch, tokens, dim, seed=0):
    return make("smooth", batch * tokens, dim, seed).reshape(batch, tokens, dim)


def _decisions(report):
    return sorted((r.path, r.decision) for r in report)


class Spelled(nn.Module):
    """Linear layers written with operators on bare parameters, in both weight layouts."""

    def __init__(self, dim=32, hidden=64):
        super().__init__()
        self.w_out_in = nn.Parameter(torch.randn(hidden, dim) / dim**0.5)  # x @ W.T, W: [out, in]
        self.w_in_out = nn.Parameter(torch.randn(hidden, hidden) / hidden**0.5)  # matmul(x, W), W: [in, out]
        self.w_einsum = nn.Parameter(torch.randn(hidden, hidden) / hidden**0.5)  # einsum, W: [out, in]
        self.w_last = nn.Parameter(torch.randn(hidden, dim) / hidden**0.5)  # x @ W, W: [in, out]

    def forward(self, x):
        h = F.gelu(x @ self.w_out_in.T)
        h = F.gelu(torch.matmul(h, self.w_in_out))
        h = F.gelu(torch.einsum("bld,fd->blf", h, self.w_einsum))
        return h @ self.w_last



class SpelledAsLinears(nn.Module):
    """:class:`Spelled`'s function written with ``nn.Linear`` layers, under its parameter names."""

    _OUT_IN = ("w_out_in", "w_einsum")  # the weights Spelled stores as [out, in], as nn.Linear does

    def __init__(self, spelled: Spelled):
        super().__init__()
        for name, weight in spelled.named_parameters():
            out_in = weight if name in self._OUT_IN else weight.t()
            linear = nn.Linear(out_in.shape[1], out_in.shape[0], bias=False)
            with torch.no_grad():
                linear.weight.copy_(out_in)
            self.add_module(name, linear)

    def forward(self, x):
        h = F.gelu(self.w_out_in(x))
        h = F.gelu(self.w_einsum(F.gelu(self.w_in_out(h))))
        return self.w_last(h)


def test_products_written_with_operators_are_sites():
    """``x @ W.T``, ``matmul``, ``einsum`` and ``x @ W``: every product rewritten, the gradients as
    close to float64 as those of the same model written with ``nn.Linear``."""
    torch.manual_seed(0)
    model = Spelled()
    linears = SpelledAsLinears(model)
    x = _smooth(4, 50, 32)
    compiled, graphs = aot_compile(model, STRICT)
    errors = grad_errors(model, compiled, x)
    assert max(errors.values()) < tol.E2E_GRAD_INT8_FORWARD, errors
    # four forwards and grad_weights, and the grad_inputs of the three layers whose input needs one
    assert _decisions(hot_compile.last_report().products()) == sorted([("fwd", "HQ")] * 4 + [("gx", "HQ")] * 3 + [("gw", "HLA+ABC")] * 4)
    assert not graphs.nodes("backward", aten.mm.default) and not graphs.nodes("backward", aten.bmm.default)
    linear_errors = grad_errors(linears, aot_compile(linears, STRICT)[0], x)
    assert max(errors.values()) < 2 * max(linear_errors.values()), (errors, linear_errors)


def test_gpt2_conv1d_layers_are_sites():
    pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    class Conv1DMLP(nn.Module):
        def __init__(self, dim=32):
            super().__init__()
            self.c_fc, self.c_proj = Conv1D(4 * dim, dim), Conv1D(dim, 4 * dim)

        def forward(self, x):
            return self.c_proj(F.gelu(self.c_fc(x)))

    torch.manual_seed(0)
    model = Conv1DMLP()
    compiled, _ = aot_compile(model, STRICT)
    x = _smooth(4, 50, 32).requires_grad_()
    errors = grad_errors(model, compiled, x)
    assert max(errors.values()) < tol.E2E_GRAD_INT8_FORWARD, errors
    report = hot_compile.last_report()
    assert {(r.module, r.path) for r in report.rewritten()} == {(m, p) for m in ("c_fc", "c_proj") for p in ("fwd", "gx", "gw")}


def test_batched_products_of_a_weight_are_reported_kept():
    class Expanded(nn.Module):
        def __init__(self, dim=32, out=48):
            super().__init__()
            self.w = nn.Parameter(torch.randn(dim, out) / dim**0.5)

        def forward(self, x):
            return torch.bmm(x, self.w.expand(x.shape[0], -1, -1))

    aot_compile(Expanded(), STRICT)[0](torch.randn(2, 40, 32, requires_grad=True)).square().mean().backward()
    rows = hot_compile.last_report().products()
    assert sorted(r.path for r in rows) == ["gw", "gx"]
    assert all(r.decision == "kept" and "batched matmul (bmm) of a weight over a batch" in r.reason for r in rows)


def test_a_failing_pass_puts_einsum_products_back(monkeypatch):
    """einsum's batch-1 ``bmm`` become ``mm`` before the sites are found; a pass that fails afterwards
    leaves the graph with its ``bmm`` nodes, as it found it."""
    from hot_compile import passes
    from hot_compile.passes.provenance import META_KEY

    def fail(*args):
        raise RuntimeError("planning failed")

    monkeypatch.setattr(passes, "_plan_and_rewrite", fail)
    model = Spelled()
    with pytest.warns(hot_compile.HotPassWarning, match="planning failed"):
        compiled, graphs = aot_compile(model, HotConfig(policy="hot"))
        compiled(_smooth(2, 40, 32).requires_grad_()).sum().backward()
    assert len(graphs.nodes("joint", aten.bmm.default)) == 3  # the einsum's forward and its two gradients
    assert not [n for n in graphs.nodes("joint") if META_KEY in n.meta]


class ComputedWeights(nn.Module):
    """A LoRA adapter merged into its weight, then a weight-normalized linear."""

    def __init__(self, dim=32, rank=4):
        super().__init__()
        self.base = nn.Linear(dim, dim)
        self.lora_a = nn.Parameter(torch.randn(rank, dim) / dim)
        self.lora_b = nn.Parameter(torch.randn(dim, rank) / rank)
        self.normed = nn.utils.parametrizations.weight_norm(nn.Linear(dim, dim))

    def forward(self, x):
        merged = F.linear(x, self.base.weight + self.lora_b @ self.lora_a, self.base.bias)
        return self.normed(F.gelu(merged))


def test_weights_computed_from_parameters_are_sites_and_their_parameters_get_gradients():
    torch.manual_seed(0)
    model = ComputedWeights()
    compiled, _ = aot_compile(model, STRICT)
    errors = grad_errors(model, compiled, _smooth(4, 50, 32).requires_grad_())
    for name in ("lora_a", "lora_b", "normed.parametrizations.weight.original0", "normed.parametrizations.weight.original1"):
        assert errors[name] < tol.E2E_GRAD_INT8_FORWARD, (name, errors)
    report = hot_compile.last_report()
    assert {(r.module, r.path) for r in report.rewritten()} == {(m, p) for m in ("", "normed") for p in ("fwd", "gx", "gw")}
    assert not [r for r in report.products() if r.decision == "kept"]  # B @ A, a product of two weights, is no site


@pytest.mark.parametrize(
    "model_cls,kept_reasons,rewritten",
    [
        (ComputedWeights, ["computed in the graph"] * 2, set()),
        (Spelled, ["stored as [in, out]"] * 2 + ["a batched matmul (bmm), as einsum writes a linear"], {"fwd", "gx", "gw"}),
    ],
)
def test_without_the_parameters_such_weights_are_reported_kept(model_cls, kept_reasons, rewritten):
    """``joint_pass()`` installed by hand is not told which inputs are parameters: ``x @ W.T`` on a graph
    input is still a site (Spelled's first product), the others get a row for each backward product
    saying why."""
    from torch._inductor.utils import fresh_cache

    with fresh_cache(), torch._inductor.config.patch(joint_custom_post_pass=hot_compile.joint_pass(STRICT)):
        torch.compile(model_cls())(torch.randn(2, 40, 32, requires_grad=True)).sum().backward()
    report = hot_compile.last_report()
    kept = [r for r in report if r.decision == "kept"]
    assert sorted(r.path for r in kept) == sorted(["gw", "gx"] * len(kept_reasons))
    assert sorted(next((k for k in kept_reasons if k in r.reason), r.reason) for r in kept) == sorted(kept_reasons * 2)
    assert all("not told which graph inputs are parameters" in r.reason for r in kept)
    assert {r.path for r in report.rewritten()} == rewritten


def _gpt2(layers=2):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=layers, n_embd=64, n_head=4, vocab_size=128, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _causal_lm_loss(model):
    def loss(ids):
        logits = model(input_ids=ids).logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    return loss


def _as_linears(model: nn.Module) -> nn.Module:
    """``model`` with every GPT-2 ``Conv1D`` replaced by the ``nn.Linear`` that computes the same."""
    from transformers.pytorch_utils import Conv1D

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Conv1D):
                linear = nn.Linear(*child.weight.shape)
                with torch.no_grad():
                    linear.weight.copy_(child.weight.t())
                    linear.bias.copy_(child.bias)
                setattr(parent, name, linear)
    return model


def _gradient_errors(model: nn.Module, options: dict) -> tuple[dict[str, float], list]:
    """Per-parameter relative gradient error of one compiled causal-LM step against float64, and the
    backward rows of its report."""
    reference = copy.deepcopy(model).double()
    ids = torch.randint(0, 128, (4, 48), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    torch.compile(_causal_lm_loss(model), backend="hot", options=options, fullgraph=True)(ids).backward()
    _causal_lm_loss(reference)(ids).backward()
    return gradient_errors(model, reference), [r for r in hot_compile.last_report() if r.path in ("gx", "gw")]


@pytest.mark.parametrize("exact_loss_head", [True, False])
def test_gpt2_every_weight_product_is_rewritten(exact_loss_head):
    """2 layers of 4 Conv1D projections and the tied LM head: 9 linear products, 18 backward ones;
    the gradients as close to float64 as those of the same model written with nn.Linear."""
    options = {"policy": "hot", "strict": True, "exact_loss_head": exact_loss_head}
    errors, backward = _gradient_errors(_gpt2(), options)
    assert len(backward) == 18
    rewritten = {r.module for r in backward if r.decision != "kept"}
    assert len(rewritten) == (8 if exact_loss_head else 9) and ("lm_head" in rewritten) != exact_loss_head
    assert all("softmax cross-entropy" in r.reason for r in backward if r.decision == "kept")
    assert max(errors.values()) < tol.E2E_GRAD_GPT2, errors
    if not exact_loss_head:
        linear_errors, linear_backward = _gradient_errors(_as_linears(_gpt2()), options)
        assert all(r.decision != "kept" for r in linear_backward)
        assert max(errors.values()) < 2 * max(linear_errors.values()), (errors, linear_errors)
